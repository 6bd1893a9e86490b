"""S15 JSON Schema -> byte-level grammar rules (compact JSON: no whitespace, properties in declared order).

The compiler enforces a schema or refuses it: every validation keyword it meets is either compiled into
the grammar or raises `GrammarError` naming the keyword (the server turns it into HTTP 400). Unknown
keywords are annotations in JSON Schema (they never fail validation) and are ignored, like ``title``.

Policy (the same as OpenAI's strict mode and XGrammar's default): an object admits only the properties its
schema lists unless ``additionalProperties`` says otherwise; listed properties appear in declared order;
integers are written without exponent or fraction; numbers with bounds without exponent.

Covered: type (and unions), enum, const, properties / required / additionalProperties (false, true, schema),
anyOf, oneOf (when the branches are provably exclusive), allOf (merged), local $ref (incl. recursion),
items / prefixItems / additionalItems / minItems / maxItems, minLength / maxLength, pattern, format
(date, time, date-time, uuid, email, ipv4, ipv6, hostname, uri) and any combination of the last four
(their languages intersected: `product.py`; lengths count the decoded string's code points),
minimum / maximum / exclusiveMinimum / exclusiveMaximum (integer-valued bounds for numbers, any bounds for
integers), minProperties / maxProperties (members counted in the grammar: `_counted`).
"""
from __future__ import annotations

import copy
import functools
import json
import math
from urllib.parse import unquote

from . import ir
from . import budget as _budget
from .automaton import compile_rules, estimate_states, productive
from .ir import GrammarError, alt, literal, opt, ref, rep, seq
from .product import CounterTooLarge, dfa_of, intersect, length_range
from .regex import MAX_REPEAT, regex_to_ir

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "definitions", "$defs", "contentEncoding", "contentMediaType",
               "$anchor", "$vocabulary", "discriminator", "nullable_annotation"}
SUPPORTED = {"type", "enum", "const", "properties", "required", "additionalProperties", "anyOf", "oneOf",
             "allOf", "$ref", "items", "prefixItems", "additionalItems", "minItems", "maxItems", "minLength",
             "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
             "minProperties", "maxProperties", "uniqueItems", "patternProperties", "propertyNames"}
# Validation keywords of the JSON Schema vocabularies this compiler does not enforce: always an error.
UNSUPPORTED = {"not", "if", "then", "else", "multipleOf",
               "dependencies", "dependentRequired", "dependentSchemas", "unevaluatedProperties",
               "unevaluatedItems", "contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef",
               "$dynamicAnchor", "$recursiveAnchor", "contentSchema", "extends", "disallow", "divisibleBy"}
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
TYPE_KEYWORDS = {
    "object": {"properties", "required", "additionalProperties", "minProperties", "maxProperties",
               "patternProperties", "propertyNames"},
    "array": {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
}
MAX_BOUND_DIGITS = 400        # a numeric bound costs O(digits^2) automaton states
DIGITS = ir.byte_set(0x30, 0x39)
DIGITS19 = ir.byte_set(0x31, 0x39)

_H = "[0-9a-fA-F]"
_PCHAR = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%" + _H + _H + ")"
_REGNAME = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=]|%" + _H + _H + ")"
_DATE = (r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)"
         r"|(?:0[13578]|1[02])-31)")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_H4 = _H + "{1,4}"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "T" + _TIME,
    "uuid": f"{_H}{{8}}-{_H}{{4}}-{_H}{{4}}-{_H}{{4}}-{_H}{{12}}",
    # what email-validator (pydantic's EmailStr) accepts too: a dot-atom local part of at most 64
    # characters (one inner dot), two or three domain labels without edge hyphens, a top-level domain of
    # letters; 254 characters at most in all (64 + 1 + 63 + 1 + 63 + 1 + 61)
    "email": (r"[A-Za-z0-9_%+\-]{1,32}(?:\.[A-Za-z0-9_%+\-]{1,31})?@" + _LABEL + r"(?:\." + _LABEL + r")?"
              r"\.[A-Za-z]{2,61}"),
    "ipv4": r"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
    "ipv6": "|".join([
        f"(?:{_H4}:){{7}}{_H4}", f"(?:{_H4}:){{1,7}}:", f"(?:{_H4}:){{1,6}}:{_H4}",
        f"(?:{_H4}:){{1,5}}(?::{_H4}){{1,2}}", f"(?:{_H4}:){{1,4}}(?::{_H4}){{1,3}}",
        f"(?:{_H4}:){{1,3}}(?::{_H4}){{1,4}}", f"(?:{_H4}:){{1,2}}(?::{_H4}){{1,5}}",
        f"{_H4}:(?::{_H4}){{1,6}}", f":(?:(?::{_H4}){{1,7}}|:)"]),
    # RFC 1123 labels of 1..63 letters, digits and inner hyphens; at most 253 characters in all (three
    # labels of up to 63 and a fourth of up to 61, so the bound holds without counting)
    "hostname": (_LABEL + r"(?:\." + _LABEL + r"){0,2}(?:\.[A-Za-z0-9](?:[A-Za-z0-9\-]{0,59}[A-Za-z0-9])?)?"),
    "uri": (r"[A-Za-z][A-Za-z0-9+.\-]*:(?://(?:(?:" + _REGNAME[3:-1] + r"|:)*@)?" + _REGNAME + r"*(?::[0-9]*)?"
            r"(?:/" + _PCHAR + r"*)*|/(?:" + _PCHAR + r"+(?:/" + _PCHAR + r"*)*)?|" + _PCHAR + r"+(?:/" + _PCHAR
            + r"*)*)?(?:\?(?:" + _PCHAR + r"|[/?])*)?(?:#(?:" + _PCHAR + r"|[/?])*)?"),
}


# --- JSON text pieces ------------------------------------------------------------------------------
_SHORT = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
_HEX = alt(ir.byte_set(0x30, 0x39), ir.byte_set(0x41, 0x46), ir.byte_set(0x61, 0x66))


def _char_forms(c: int) -> ir.GrammarNode:
    """Every spelling of character c inside a JSON string that this grammar allows."""
    forms = []
    if c in _SHORT:
        forms.append(literal(_SHORT[c]))
    if c < 0x20:
        hi, lo = divmod(c, 16)
        hexlo = alt(*{literal(ch) for ch in {f"{lo:x}", f"{lo:X}"}})
        forms.append(seq(literal(f"\\u00{hi}"), hexlo))
    return alt(*forms)


def json_char_class(ranges) -> ir.GrammarNode:
    """One character of ``ranges`` as it may be written inside a JSON string: raw UTF-8, except ``"``,
    backslash and control characters, which are escaped (short escapes or ``\\u00XX``)."""
    ranges = ir.normalize_ranges(ranges)
    special = [c for c in list(range(0x20)) + [0x22, 0x5C] if any(lo <= c <= hi for lo, hi in ranges)]
    raw = ir.normalize_ranges([r for lo, hi in ranges for r in _minus_special(lo, hi)])
    parts = [ir.char_class(raw)] if raw else []
    controls = [c for c in special if c < 0x20]
    if len(controls) == 0x20:               # all of them: one compact \u00XX form plus the short escapes
        parts.append(seq(literal("\\u00"), ir.byte_set(0x30, 0x31), _HEX))
        parts.extend(literal(_SHORT[c]) for c in special if c in _SHORT)
    else:
        parts.extend(_char_forms(c) for c in special)
    return alt(*parts) if parts else ir.NOTHING


def _minus_special(lo: int, hi: int):
    lo = max(lo, 0x20)
    for a, b in ((lo, min(hi, 0x21)), (max(lo, 0x23), min(hi, 0x5B)), (max(lo, 0x5D), hi)):
        if a <= b:
            yield a, b


JSON_CHAR = json_char_class([(0, ir.MAX_UNICODE)])
JSON_STRING = seq(literal('"'), rep(JSON_CHAR, 0, None), literal('"'))
INT_PART = alt(literal("0"), seq(DIGITS19, rep(DIGITS, 0, None)))
JSON_INTEGER = seq(opt(literal("-")), INT_PART)
FRACTION = seq(literal("."), rep(DIGITS, 1, None))
EXPONENT = seq(alt(literal("e"), literal("E")), opt(alt(literal("+"), literal("-"))), rep(DIGITS, 1, None))
JSON_NUMBER = seq(JSON_INTEGER, opt(FRACTION), opt(EXPONENT))


def dumps(value) -> str:
    """The compact serialisation this grammar writes (and the tests feed back)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def any_json_rules(rules: dict) -> None:
    """Rules for any JSON value (recursive): json:value, json:object, json:array."""
    member = seq(JSON_STRING, literal(":"), ref("json:value"))
    rules["json:object"] = seq(literal("{"), opt(seq(member, rep(seq(literal(","), member), 0, None))),
                               literal("}"))
    rules["json:array"] = seq(literal("["), opt(seq(ref("json:value"), rep(seq(literal(","), ref("json:value")),
                                                                              0, None))), literal("]"))
    rules["json:value"] = alt(ref("json:object"), ref("json:array"), JSON_STRING, JSON_NUMBER, literal("true"),
                              literal("false"), literal("null"))


# --- integer ranges as digit strings ---------------------------------------------------------------
def _digits_range(lo: str, hi: str) -> ir.GrammarNode:
    """Digit strings of equal length n with lo <= s <= hi (lexicographic = numeric at equal length): the
    common prefix, then the first differing digit (lo's, between, hi's) with the tails of `_at_least` /
    `_at_most`. O(digits) pieces, and nested only three deep whatever the length."""
    if lo == hi:
        return literal(lo)
    d = 0
    while lo[d] == hi[d]:
        d += 1
    a, b, k = int(lo[d]), int(hi[d]), len(lo) - d - 1
    parts = [seq(literal(lo[d]), _at_least(lo[d + 1:]))]
    if b - a > 1:
        parts.append(seq(ir.byte_set(0x30 + a + 1, 0x30 + b - 1), rep(DIGITS, k, k)))
    parts.append(seq(literal(hi[d]), _at_most(hi[d + 1:])))
    return seq(literal(lo[:d]), alt(*parts))


def _at_least(s: str) -> ir.GrammarNode:
    """Digit strings t of len(s) with t >= s: s itself, or s's first i digits, a greater digit, anything."""
    n = len(s)
    if s == "0" * n:
        return rep(DIGITS, n, n)
    parts = [literal(s)]
    for i, c in enumerate(s):
        if c != "9":
            parts.append(seq(literal(s[:i]), ir.byte_set(ord(c) + 1, 0x39), rep(DIGITS, n - 1 - i, n - 1 - i)))
    return alt(*parts)


def _at_most(s: str) -> ir.GrammarNode:
    """Digit strings t of len(s) with t <= s."""
    n = len(s)
    if s == "9" * n:
        return rep(DIGITS, n, n)
    parts = [literal(s)]
    for i, c in enumerate(s):
        if c != "0":
            parts.append(seq(literal(s[:i]), ir.byte_set(0x30, ord(c) - 1), rep(DIGITS, n - 1 - i, n - 1 - i)))
    return alt(*parts)


def nat_range(lo: int, hi: int | None) -> ir.GrammarNode:
    """Decimal spellings (no leading zeros) of the naturals lo..hi (hi None: unbounded)."""
    lo = max(lo, 0)
    if hi is not None and hi < lo:
        return ir.NOTHING
    parts = []
    if lo == 0:
        parts.append(literal("0"))
        lo = 1
    if hi is not None and hi < lo:
        return alt(*parts)
    # lo's length (from lo), the lengths strictly between (every number), hi's length (up to hi): one
    # node each, O(digits) in all
    n, m = len(str(lo)), None if hi is None else len(str(hi))
    if m == n:
        parts.append(_digits_range(str(lo), str(hi)))
        return alt(*parts)
    if lo == 10 ** (n - 1):
        first = n                           # lo's length is whole: it joins the free lengths
    else:
        parts.append(_digits_range(str(lo), "9" * n))
        first = n + 1
    if m is None:
        parts.append(seq(DIGITS19, rep(DIGITS, first - 1, None)))
    else:
        if first <= m - 1:
            parts.append(seq(DIGITS19, rep(DIGITS, first - 1, m - 2)))
        parts.append(_digits_range("1" + "0" * (m - 1), str(hi)))
    return alt(*parts)


def int_range(lo: int | None, hi: int | None) -> ir.GrammarNode:
    """Integers lo..hi (None: unbounded) in JSON, with no ``-0``."""
    parts = []
    if hi is None or hi >= 0:
        parts.append(nat_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        neg_hi = None if lo is None else -lo
        neg_lo = 1 if hi is None or hi >= 0 else -hi
        parts.append(seq(literal("-"), nat_range(neg_lo, neg_hi)))
    return alt(*parts)


def _fraction_kind(pred_lo, pred_hi, i: int) -> str:
    """Combine 'any' / 'zero' / 'nonzero' / 'none' fraction constraints for integer part i."""
    kinds = {pred_lo(i), pred_hi(i)}
    if "none" in kinds or kinds == {"zero", "nonzero"}:
        return "none"
    kinds.discard("any")
    return kinds.pop() if kinds else "any"


_FRAC = {"any": opt(FRACTION), "zero": opt(seq(literal("."), rep(literal("0"), 1, None))),
         "nonzero": seq(literal("."), rep(DIGITS, 0, None), DIGITS19, rep(DIGITS, 0, None))}


def _magnitude(lo, lo_excl, hi, hi_excl) -> ir.GrammarNode:
    """Non-negative decimals y = I.F (no exponent) with lo <(=) y <(=) hi; bounds are ints or None."""
    def pred_lo(i):
        if lo is None or i > lo:
            return "any"
        if i < lo:
            return "none"
        return "nonzero" if lo_excl else "any"

    def pred_hi(i):
        if hi is None or i < hi:
            return "any"
        if i > hi:
            return "none"
        return "none" if hi_excl else "zero"

    points = sorted({p for p in (lo, hi) if p is not None and p >= 0})
    segments = []            # (first, last or None) of integer parts with constant predicates
    start = 0
    for p in points:
        if p > start:
            segments.append((start, p - 1))
        segments.append((p, p))
        start = p + 1
    segments.append((start, None))
    parts = []
    for a, b in segments:
        kind = _fraction_kind(pred_lo, pred_hi, a)
        if kind != "none":
            parts.append(seq(nat_range(a, b), _FRAC[kind]))
    return alt(*parts)


def number_range(lo, lo_excl: bool, hi, hi_excl: bool) -> ir.GrammarNode:
    """JSON numbers (no exponent) within integer-valued bounds; negative zero is never written."""
    pos = _magnitude(None if lo is None or lo < 0 else lo, lo_excl, hi, hi_excl) \
        if hi is None or hi >= 0 else ir.NOTHING
    parts = [pos] if pos != ir.NOTHING else []
    if lo is None or lo < 0:
        # x = -y with y > 0 and -hi <(=) y <(=) -lo
        nlo, nlo_excl = (0, True) if hi is None or hi >= 0 else (-hi, hi_excl)
        neg = _magnitude(nlo, nlo_excl, None if lo is None else -lo, lo_excl)
        if neg != ir.NOTHING:
            parts.append(seq(literal("-"), neg))
    return alt(*parts) if parts else ir.NOTHING


# --- the compiler ----------------------------------------------------------------------------------
def _types_of(value) -> set:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    if isinstance(value, list):
        return {"array"}
    return {"object"}


def _canon(value) -> str:
    def norm(v):
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        return {k: norm(x) for k, x in v.items()}
    return json.dumps(norm(value), sort_keys=True)


class SchemaCompiler:
    def __init__(self, schema):
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON Schema must be an object or a boolean, got {type(schema).__name__}")
        self.schema = schema
        self.rules: dict[str, ir.GrammarNode] = {}
        self.depth = 0
        self.empty: list[tuple[str, str]] = []      # (why, keyword) of subschemas found unsatisfiable

    def compile(self) -> tuple[dict, str]:
        root = self._ref_rule("#")
        if self.empty and (self.rules[root] == ir.NOTHING or not productive(self.rules, root)):
            why, keyword = self.empty[0]
            raise GrammarError(f"the schema admits no value: {why}", keyword)
        if self.rules[root] == ir.NOTHING:
            raise GrammarError("the schema admits no value")
        return self.rules, root

    # $ref ------------------------------------------------------------------------------------------
    def resolve(self, pointer: str):
        if not isinstance(pointer, str):
            raise GrammarError("$ref must be a string", "$ref")
        if not pointer.startswith("#"):
            raise GrammarError(f"$ref {pointer!r}: only local references (#/...) are supported", "$ref")
        if pointer not in ("#", "#/") and not pointer.startswith("#/"):
            raise GrammarError(f"$ref {pointer!r}: anchors are not supported, only JSON pointers", "$ref")
        node = self.schema
        for part in pointer[2:].split("/") if len(pointer) > 2 else []:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise GrammarError(f"$ref {pointer!r} does not resolve", "$ref")
        return node

    def _ref_rule(self, pointer: str) -> str:
        if not isinstance(pointer, str):
            raise GrammarError(f"$ref must be a string, got {type(pointer).__name__}", "$ref")
        name = "ref:" + pointer
        if name not in self.rules:
            self.rules[name] = ir.NOTHING              # placeholder: recursion refers to the name
            self.rules[name] = self.node(self.resolve(pointer))
        return name

    def deref(self, s):
        """A schema with a top-level $ref (and no siblings) replaced by its target, for merging."""
        seen = 0
        while isinstance(s, dict) and "$ref" in s:
            target = self.resolve(s["$ref"])
            rest = {k: v for k, v in s.items() if k != "$ref"}
            s = merge_schemas(target, rest) if _validating(rest) else target
            seen += 1
            if seen > 32:
                raise GrammarError("$ref chain too deep or cyclic", "$ref")
        return s

    # schemas ---------------------------------------------------------------------------------------
    def node(self, s) -> ir.GrammarNode:
        self.depth += 1
        try:
            if self.depth > ir.MAX_NESTING:
                raise GrammarError(f"the schema nests subschemas and $ref deeper than {ir.MAX_NESTING} levels")
            return self._node(s)
        finally:
            self.depth -= 1

    def _node(self, s) -> ir.GrammarNode:
        if s is True or s == {}:
            any_json_rules(self.rules)
            return ref("json:value")
        if s is False:
            return ir.NOTHING
        if not isinstance(s, dict):
            raise GrammarError(f"a subschema must be an object or a boolean, got {s!r}")
        for k in s:
            if k in UNSUPPORTED:
                raise GrammarError(f"JSON Schema keyword {k!r} is not supported", k)
        if "$ref" in s:
            rest = {k: v for k, v in s.items() if k != "$ref"}
            if not _validating(rest):
                return ref(self._ref_rule(s["$ref"]))
            return self.node(merge_schemas(self.deref({"$ref": s["$ref"]}), rest))
        if "allOf" in s:
            subs = s["allOf"]
            if not isinstance(subs, list) or not subs:
                raise GrammarError("allOf must be a non-empty array", "allOf")
            merged = {k: v for k, v in s.items() if k != "allOf"}
            for sub in subs:
                merged = merge_schemas(merged, self.deref(sub))
            return self.node(merged)
        for key in ("anyOf", "oneOf"):
            if key in s:
                subs = s[key]
                if not isinstance(subs, list) or not subs:
                    raise GrammarError(f"{key} must be a non-empty array", key)
                rest = {k: v for k, v in s.items() if k != key}
                branches = [merge_schemas(rest, self.deref(b)) if _validating(rest) else self.deref(b)
                            for b in subs]
                if key == "oneOf":
                    self._check_exclusive(branches)
                return alt(*[self.node(b) for b in branches])
        if "enum" in s or "const" in s:
            return self._enum(s)
        types = self._types(s)
        return alt(*[self._typed(t, s) for t in types])

    def _types(self, s) -> list[str]:
        t = s.get("type")
        if t is None:
            found = [name for name, kws in TYPE_KEYWORDS.items() if kws & set(s)]
            if not found:
                return list(TYPES)
            if "number" in found:
                found.append("integer")
            return found
        ts = [t] if isinstance(t, str) else t
        if not isinstance(ts, list) or not all(x in TYPES for x in ts):
            raise GrammarError(f"type must be one of {TYPES} or a list of them, got {t!r}", "type")
        if "number" in ts and "integer" in ts:
            ts = [x for x in ts if x != "integer"]
        return list(dict.fromkeys(ts))

    def _enum(self, s) -> ir.GrammarNode:
        values = s["enum"] if "enum" in s else [s["const"]]
        if "enum" in s and "const" in s:
            values = [v for v in values if _canon(v) == _canon(s["const"])]
        if not isinstance(values, list):
            raise GrammarError("enum must be an array", "enum")
        extra = [k for k in s if k in SUPPORTED and k not in ("enum", "const", "type")]
        if extra:
            raise GrammarError(f"enum/const combined with {extra[0]!r} is not supported", extra[0])
        if "type" in s:
            allowed = set(self._types(s)) | ({"integer"} if "number" in self._types(s) else set())
            values = [v for v in values if _types_of(v) & allowed and
                      not (isinstance(v, float) and not v.is_integer() and allowed == {"integer"})]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise GrammarError("enum/const values must be finite numbers", "enum")
        return ir.literals([dumps(v) for v in values]) if values else ir.NOTHING   # a trie: O(total length)

    def _check_exclusive(self, branches) -> None:
        info = [(self._branch_types(b), self._branch_values(b), self._discriminators(b), self._closed(b))
                for b in branches]
        for i in range(len(info)):
            for j in range(i + 1, len(info)):
                (ti, vi, di, ci), (tj, vj, dj, cj) = info[i], info[j]
                if not ti & tj:
                    continue
                if vi is not None and vj is not None and not vi & vj:
                    continue
                if any(k in dj and not di[k] & dj[k] for k in di):
                    continue
                if ti & tj == {"object"} and ci and cj and \
                        ((ci[1] - cj[0] and cj[2]) or (cj[1] - ci[0] and ci[2])):
                    continue        # a property one branch requires, the other (closed) forbids
                raise GrammarError("oneOf: branches are not provably mutually exclusive (anyOf would accept "
                                   "values matching several)", "oneOf")

    def _branch_types(self, b) -> set:
        b = self.deref(b)
        if b is True or not isinstance(b, dict):
            return set(TYPES) if b is not False else set()
        if "enum" in b or "const" in b:
            vals = b.get("enum", [b.get("const")])
            out = set()
            for v in vals:
                out |= _types_of(v)
            return out
        for key in ("anyOf", "oneOf"):
            if key in b and isinstance(b[key], list):
                out = set()
                for sub in b[key]:
                    out |= self._branch_types(sub)
                return out
        ts = set(self._types(b))
        if "number" in ts:
            ts.add("integer")
        if "integer" in ts:
            ts.add("number")
        return ts

    def _branch_values(self, b):
        b = self.deref(b)
        if isinstance(b, dict) and ("enum" in b or "const" in b):
            return {_canon(v) for v in b.get("enum", [b.get("const")])}
        return None

    def _closed(self, b):
        """(listed properties, required properties, closed?) of an object branch, closed meaning the
        schema itself says additionalProperties: false; None if not a plain object schema."""
        b = self.deref(b)
        if not isinstance(b, dict) or any(k in b for k in ("anyOf", "oneOf", "allOf", "patternProperties")):
            return None
        props = set(b.get("properties", {}))
        return props, set(b.get("required", [])), b.get("additionalProperties") is False

    def _discriminators(self, b) -> dict:
        """Required properties whose value is fixed by enum/const: {name: canonical values}."""
        b = self.deref(b)
        out = {}
        if isinstance(b, dict):
            props = b.get("properties", {})
            for k in b.get("required", []):
                sub = self.deref(props.get(k, True))
                if isinstance(sub, dict) and ("enum" in sub or "const" in sub):
                    out[k] = {_canon(v) for v in sub.get("enum", [sub.get("const")])}
        return out

    # one JSON type ---------------------------------------------------------------------------------
    def _typed(self, t: str, s: dict) -> ir.GrammarNode:
        if t == "null":
            return literal("null")
        if t == "boolean":
            return alt(literal("true"), literal("false"))
        if t == "string":
            return self._string(s)
        if t in ("integer", "number"):
            return self._number(s, t == "integer")
        if t == "array":
            return self._array(s)
        return self._object(s)

    def _string(self, s) -> ir.GrammarNode:
        lo = _count(s, "minLength", 0)
        hi = _count(s, "maxLength", None)
        fmt, pattern = s.get("format"), s.get("pattern")
        if fmt is not None and fmt not in FORMATS:
            raise GrammarError(f"format {fmt!r} is not supported (supported: {', '.join(FORMATS)})", "format")
        regexes = [(r, False) for r in ([FORMATS[fmt]] if fmt else [])]
        if pattern is not None:
            if not isinstance(pattern, str):
                raise GrammarError("pattern must be a string", "pattern")
            regexes.append((pattern, True))
        if regexes:
            bodies = []
            for r, search in regexes:
                try:
                    bodies.append(_format_ir(r) if not search else regex_to_ir(r, json_char_class, search=True))
                except GrammarError as e:
                    raise GrammarError(f"pattern: {e}", "pattern") from None
            if len(bodies) == 1 and not lo and hi is None:
                return seq(literal('"'), bodies[0], literal('"'))
            return seq(literal('"'), self._intersected(bodies, fmt, pattern, lo, hi), literal('"'))
        if (hi is not None and hi > MAX_REPEAT) or lo > MAX_REPEAT:
            # unrolled, the repetition would cost states per character: counted at run time instead
            body = self._counted_string(intersect([], _lexer(), lo, hi, counted=True))
            if body == ir.NOTHING:
                self.empty.append((f"minLength {lo} with maxLength {hi} admits no string", "minLength"))
            return seq(literal('"'), body, literal('"'))
        return seq(literal('"'), rep(JSON_CHAR, lo, hi), literal('"'))

    def _intersected(self, bodies, fmt, pattern, lo: int, hi: int | None) -> ir.GrammarNode:
        """format / pattern / minLength / maxLength together: the product of their automata (product.py).
        Lengths count the characters of the decoded string (code points), an escape such as ``\\n`` or
        ``\\u001f`` being one character, as JSON Schema counts them."""
        said = [f"format {fmt!r}"] if fmt else []
        said += [f"pattern {pattern[:60]!r}"] if pattern is not None else []
        said += [f"minLength {lo}"] if lo else []
        said += [f"maxLength {hi}"] if hi is not None else []
        what = " with ".join(said)
        keyword = "maxLength" if hi is not None else "minLength" if lo else "pattern"
        counting = bool(lo) or hi is not None
        try:
            dfas = [dfa_of(b) for b in bodies]
            if len(dfas) == 1 and counting:
                fewest, most = length_range(dfas[0], _lexer())
                if lo <= fewest and (hi is None or most <= hi):
                    return bodies[0]                # the bounds cannot bind: the regex as it is
            try:
                body = intersect(dfas, _lexer() if counting else None, lo, hi)
            except CounterTooLarge:
                # the bounds spelled into the automaton would multiply its states: the string becomes a
                # rule of its own whose count is kept at run time (counter.py), exact at any length
                body = self._counted_string(intersect(dfas, _lexer(), lo, hi, counted=True))
        except _budget.GrammarTooLarge as e:
            raise _budget.GrammarTooLarge(f"{what}: {e}", keyword) from None
        if body == ir.NOTHING:
            self.empty.append((f"{what} admits no string", keyword))
        return body

    def _counted_string(self, node) -> ir.GrammarNode:
        """A ("counted", ...) string body as a rule of its own (the pushdown matcher counts its characters)."""
        if node[0] != "counted":
            return node
        name = f"counted:{len(self.rules)}"
        self.rules[name] = node
        return ref(name)

    def _number(self, s, integer: bool) -> ir.GrammarNode:
        lo, lo_excl = _bound(s, "minimum", "exclusiveMinimum", lower=True)
        hi, hi_excl = _bound(s, "maximum", "exclusiveMaximum", lower=False)
        if lo is None and hi is None:
            return JSON_INTEGER if integer else JSON_NUMBER
        if integer:
            ilo = None if lo is None else (math.floor(lo) + 1 if lo_excl and _integral(lo) else math.ceil(lo))
            ihi = None if hi is None else (math.ceil(hi) - 1 if hi_excl and _integral(hi) else math.floor(hi))
            return int_range(ilo, ihi)
        for name, v in (("minimum", lo), ("maximum", hi)):
            if v is not None and not _integral(v):
                raise GrammarError(f"{name}: non-integer bounds on numbers are not supported ({v})", name)
        return number_range(None if lo is None else int(lo), lo_excl, None if hi is None else int(hi), hi_excl)

    def _array(self, s) -> ir.GrammarNode:
        lo = _count(s, "minItems", 0)
        hi = _count(s, "maxItems", None)
        prefix = s.get("prefixItems")
        if s.get("uniqueItems") is True and (hi is None or hi > 1):
            unique = self._unique_array(s, lo, hi)
            if unique is not None:
                return unique
        items = s.get("items", True)
        if isinstance(items, list):              # draft 4-7 tuple form
            if prefix is not None:
                raise GrammarError("items as an array together with prefixItems", "items")
            prefix, items = items, s.get("additionalItems", True)
        elif "additionalItems" in s and prefix is None:
            pass                                 # additionalItems without a tuple has no effect
        prefix = prefix or []
        if not isinstance(prefix, list):
            raise GrammarError("prefixItems must be an array", "prefixItems")
        comma = literal(",")
        p_nodes = [self.node(p) for p in prefix]
        k = len(p_nodes)
        options = []
        for m in range(0, k):                    # shorter than the prefix: its first m items
            if lo <= m and (hi is None or m <= hi):
                options.append(_joined(p_nodes[:m], comma))
        if hi is None or hi >= k:                # the whole prefix, then r more items
            rest = self.node(items) if items is not False else ir.NOTHING
            rlo, rhi = max(lo - k, 0), None if hi is None else hi - k
            for name, v in (("minItems", rlo), ("maxItems", rhi or 0)):
                if v > MAX_REPEAT:
                    raise GrammarError(f"{name} above {MAX_REPEAT} is not supported", name)
            if rest == ir.NOTHING or rhi == 0:
                if rlo == 0:
                    options.append(_joined(p_nodes, comma))
            elif k == 0:
                body = seq(rest, rep(seq(comma, rest), max(rlo - 1, 0), None if rhi is None else rhi - 1))
                options.append(opt(body) if rlo == 0 else body)
            else:
                options.append(seq(_joined(p_nodes, comma), rep(seq(comma, rest), rlo, rhi)))
        return seq(literal("["), alt(*options) if options else ir.NOTHING, literal("]"))

    def _pattern_member(self, s, names, addl):
        """(key, value) of the ``"key":value`` members for patternProperties, or None. Enforced when every
        pattern shares one schema, no listed property matches a pattern (its value would have to satisfy both)
        and additionalProperties is false or absent (keys outside the patterns are then not written)."""
        pp = s.get("patternProperties")
        if not pp:
            return None
        if not isinstance(pp, dict):
            raise GrammarError("patternProperties must be an object", "patternProperties")
        if addl is not False:
            raise GrammarError("patternProperties together with additionalProperties is not supported",
                               "patternProperties")
        schemas = list(pp.values())
        if any(_canon(x) != _canon(schemas[0]) for x in schemas[1:]):
            raise GrammarError("patternProperties with different schemas per pattern is not supported",
                               "patternProperties")
        keys = []
        for pattern in pp:
            search = _searcher(pattern, "patternProperties")
            if any(search(n) for n in names):
                raise GrammarError(f"patternProperties: pattern {pattern!r} matches a listed property",
                                   "patternProperties")
            try:
                keys.append(regex_to_ir(pattern, json_char_class, search=True))
            except GrammarError as e:
                raise GrammarError(f"patternProperties: {e}", "patternProperties") from None
        value = self.node(schemas[0])
        if value == ir.NOTHING:
            return None
        return seq(literal('"'), alt(*keys), literal('"')), value

    def _unique_array(self, s, lo, hi):
        """uniqueItems: items from a finite enum are written as distinct values in declared order (a
        `list` of optional items); any other array with uniqueItems holds at most one item."""
        items = self.deref(s.get("items", True))
        if s.get("prefixItems") or isinstance(items, list):
            raise GrammarError("uniqueItems with tuple items is not supported", "uniqueItems")
        values = None
        if isinstance(items, dict) and ("enum" in items or "const" in items) and \
                not [k for k in items if k in SUPPORTED and k not in ("enum", "const", "type")]:
            values = list({_canon(v): v for v in (items["enum"] if "enum" in items else [items["const"]])}.values())
        if values is None or len(values) > 64:
            if lo > 1:
                raise GrammarError("uniqueItems with minItems above 1 is only supported for enum items",
                                   "uniqueItems")
            return self._array({**{k: v for k, v in s.items() if k != "uniqueItems"}, "maxItems": 1})
        nodes = [self._enum({**items, "enum": [v]}) for v in values]
        nodes = [n for n in nodes if n != ir.NOTHING]
        if lo > len(nodes):
            return ir.NOTHING
        if (hi is not None and hi < len(nodes)) or lo > 1:
            raise GrammarError("uniqueItems over enum items with these minItems/maxItems is not supported",
                               "uniqueItems")
        if lo == 0:
            return seq(literal("["), ("list", tuple(nodes), (False,) * len(nodes), literal(",")), literal("]"))
        firsts = [seq(nodes[i], *[opt(seq(literal(","), n)) for n in nodes[i + 1:]]) for i in range(len(nodes))]
        return seq(literal("["), alt(*firsts), literal("]"))

    def _object(self, s) -> ir.GrammarNode:
        props = s.get("properties", {})
        if not isinstance(props, dict):
            raise GrammarError("properties must be an object", "properties")
        required = s.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise GrammarError("required must be an array of strings", "required")
        addl = s.get("additionalProperties", False)      # policy: unlisted properties are not written
        names = list(props)
        for r in required:
            if r not in props:
                if addl is False:
                    raise GrammarError(f"required property {r!r} is not in properties and additionalProperties "
                                       "is false", "required")
                names.append(r)
        self._check_count_size(s, names, required, addl)
        name_ok, extra_key = self._property_names(s)
        members, flags, listed = [], [], []
        for name in names:
            sub = props.get(name, addl)
            value = self.node(sub) if name_ok(name) else ir.NOTHING
            if value == ir.NOTHING:
                if name in required:
                    return ir.NOTHING
                continue
            members.append(seq(literal(dumps(name)), literal(":"), value))
            flags.append(name in required)
            listed.append((name, value, name in required))
        singles = list(members)                  # one member each (for maxProperties 1)
        distinct = self._pattern_member(s, names, addl)     # (key node, value node) of the extra members
        open_extras = False
        if distinct is not None and extra_key is not None:
            raise GrammarError("propertyNames together with patternProperties is not supported", "propertyNames")
        extra = None if distinct is None else seq(distinct[0], literal(":"), distinct[1])
        if extra is None and addl is not False:
            value = self.node(addl)
            if value != ir.NOTHING:
                if extra_key is not None and any(name_ok(n) for n in names):
                    raise GrammarError("propertyNames with listed properties and additionalProperties is not "
                                       "supported", "propertyNames")
                extra = seq(extra_key if extra_key is not None else _string_not_in(names), literal(":"), value)
                distinct = (extra_key if extra_key is not None else _string_not_in(names), value)
                open_extras = extra_key is None      # any name but the listed ones: never a dead end
        if extra is not None:
            members.append(seq(extra, rep(seq(literal(","), extra), 0, None)))
            flags.append(False)
            singles.append(extra)
        n_req = sum(flags)
        lo_p = _count(s, "minProperties", 0)
        hi_p = _count(s, "maxProperties", None)
        if hi_p is not None and hi_p < max(n_req, lo_p):
            return ir.NOTHING
        if extra is None and lo_p > len(members):
            raise GrammarError(f"minProperties {lo_p} exceeds the {len(members)} properties the grammar may write "
                               "(unlisted properties need additionalProperties)", "minProperties")
        if hi_p == 1 and (extra is not None or len(members) > 1):
            # at most one member: the required one, or any single one (or none, without minProperties)
            if n_req:
                options = [singles[flags.index(True)]]
            else:
                options = singles + ([] if lo_p else [ir.EMPTY])
            return seq(literal("{"), alt(*options), literal("}"))
        if (hi_p is not None and (extra is not None or hi_p < len(members))) or (lo_p > n_req and lo_p > 1):
            if extra is not None and distinct is not None and len(members) == 1 and lo_p > 1:
                return self._distinct(*distinct, lo_p, hi_p)
            if extra is not None and open_extras and lo_p > n_req + 1:
                # an object of the required members and extras needs two or more of the latter to count:
                # distinct names beside the listed members (distinct.py); keys too many for one DFA keep
                # the counted list below
                try:
                    return self._distinct(*distinct, lo_p, hi_p, listed)
                except _budget.GrammarTooLarge:
                    pass
            return self._counted(members, flags, extra, lo_p, hi_p)
        at_least_one = False
        if lo_p > n_req:
            if lo_p == 1 and members:
                at_least_one = True              # {} is not allowed: the list must not be empty
        body = ("list", tuple(members), tuple(flags), literal(","), at_least_one)
        return seq(literal("{"), body, literal("}"))

    def _check_count_size(self, s, names, required, addl) -> None:
        """Refuse at once (before any member's value is compiled) a min/maxProperties whose unrolled
        count cannot fit the state budget even if every value were a single state."""
        lo, hi = _count(s, "minProperties", 0), _count(s, "maxProperties", None)
        if hi is None and lo <= 1:
            return
        cap = hi if hi is not None else lo
        cost = sum((min(i, cap) + 1) * (len(dumps(n).encode("utf-8")) + 3) for i, n in enumerate(names))
        budget = _budget.current()
        if cost > budget.max_states:
            keyword = "maxProperties" if hi is not None else "minProperties"
            message = budget.too_large(f"{keyword} {cap} over {len(names)} properties unrolls to more than "
                                       f"{cost} automaton states").args[0]
            raise _budget.GrammarTooLarge(message, keyword)

    def _counted(self, members, flags, extra, lo: int, hi: int | None) -> ir.GrammarNode:
        """minProperties / maxProperties counted in the grammar: a ("clist", ...) node (ir.py) over the
        listed members and the repeated extra member. Every member written counts towards maxProperties;
        towards minProperties count the listed members and at most one extra member, because two extra
        members may carry the same name (a grammar cannot keep arbitrary names apart) and would then
        make one property, not two."""
        listed, req = members[:-1], flags[:-1]
        if extra is None:
            listed, req = members, flags
        # each member its own rule: inlined into one DFA when it fits; past MAX_DFA_STATES (every member
        # copied once per count) compile_rules falls back to rule-by-rule automata, members then called
        base = f"count:{len(self.rules)}"
        for i, m in enumerate(listed):
            self.rules[f"{base}:{i}"] = m
        listed = [ref(f"{base}:{i}") for i in range(len(listed))]
        if extra is not None:
            self.rules[f"{base}:extra"] = extra
            extra = ref(f"{base}:extra")
        node = ("clist", tuple(listed), tuple(req), literal(","), lo, hi, extra)
        n_most = len(listed) + (1 if extra is not None else 0)
        if lo > n_most:
            raise GrammarError(f"minProperties {lo} needs more than the {len(listed)} listed properties and one "
                               "additional property (several additional properties may share a name, so only "
                               "one counts towards minProperties)", "minProperties")
        budget = _budget.current()
        cost = estimate_states(node, self.rules, {n for n in self.rules if n.startswith(base + ":")})
        if cost > budget.max_states:
            keyword = "maxProperties" if hi is not None else "minProperties"
            value = hi if hi is not None else lo
            message = budget.too_large(f"{keyword} {value} over {len(listed)} properties"
                                       f"{' and additionalProperties' if extra is not None else ''} unrolls to "
                                       f"about {cost} automaton states").args[0]
            raise _budget.GrammarTooLarge(message, keyword)
        return seq(literal("{"), node, literal("}"))

    def _distinct(self, key, value, lo: int, hi: int | None, listed=()) -> ir.GrammarNode:
        """An object of additional properties, lo..hi members with pairwise distinct names (two or more
        extras count towards minProperties): an ("xkeys", ...) rule (distinct.py) over the keys' DFA.
        ``listed``: (name, value node, required) of the listed members beside the extras (any order)."""
        if hi is not None and hi < max(lo, sum(r for _, _, r in listed)):
            return ir.NOTHING
        keys = [literal(dumps(name)) for name, _, _ in listed]
        node = intersect([dfa_of(alt(key, *keys) if keys else key)])
        if node == ir.NOTHING:
            return ir.NOTHING
        _, edges, accepting = node
        if any(a and e for a, e in zip(accepting, edges)):
            raise GrammarError("minProperties over additional properties whose names the grammar cannot "
                               "delimit is not supported", "minProperties")
        base = f"distinct:{len(self.rules)}"
        self.rules[base + ":value"] = value
        members = []
        for i, (name, v, req) in enumerate(listed):
            self.rules[f"{base}:{i}"] = v
            members.append((name, dumps(name).encode("utf-8"), f"{base}:{i}", req))
        self.rules[base] = ("xkeys", edges, accepting, base + ":value", lo, hi, *([tuple(members)] if listed else []))
        return seq(literal("{"), ref(base), literal("}"))

    def _property_names(self, s):
        """(predicate over listed names, key node for extra properties or None) from propertyNames, which
        is enforced when it is a string schema of pattern / minLength / maxLength only."""
        pn = s.get("propertyNames", True)
        if pn is True or pn == {}:
            return (lambda name: True), None
        if pn is False:
            return (lambda name: False), ir.NOTHING
        allowed = {"type", "pattern", "minLength", "maxLength"}
        if not isinstance(pn, dict) or set(pn) - allowed - ANNOTATIONS or pn.get("type", "string") != "string":
            raise GrammarError("propertyNames other than a string pattern / minLength / maxLength is not supported",
                               "propertyNames")
        search = _searcher(pn["pattern"], "propertyNames") if "pattern" in pn else None
        lo, hi = _count(pn, "minLength", 0), _count(pn, "maxLength", None)

        def ok(name: str) -> bool:
            return (search is None or search(name)) and lo <= len(name) and (hi is None or len(name) <= hi)

        key = self._string({k: v for k, v in pn.items() if k != "type"})
        return ok, key


@functools.lru_cache(maxsize=len(FORMATS))
def _format_ir(regex: str):
    """A format's regex as JSON string body IR (parsed once per process)."""
    return regex_to_ir(regex, json_char_class)


@functools.lru_cache(maxsize=1)
def _lexer():
    """The DFA of any sequence of JSON string characters: the character counter of `product.intersect`."""
    return dfa_of(rep(JSON_CHAR, 0, None))


def _searcher(pattern, keyword: str):
    """``re.search(pattern, text) is not None`` by the project's own regex engine: the pattern compiled
    to an automaton (linear in the text; never Python's backtracking ``re`` on a client's pattern)."""
    if not isinstance(pattern, str):
        raise GrammarError(f"{keyword}: a pattern must be a string", keyword)
    try:
        automaton = compile_rules({"root": regex_to_ir(pattern, search=True)}, "root")
    except GrammarError as e:
        raise type(e)(f"{keyword}: pattern {pattern[:80]!r}: {e}", keyword) from None

    def search(text: str) -> bool:
        state = automaton.step(automaton.initial(), text.encode("utf-8", "surrogatepass"))
        return bool(state) and automaton.is_accepting(state)

    return search


def _joined(nodes, sep) -> ir.GrammarNode:
    out = []
    for i, n in enumerate(nodes):
        if i:
            out.append(sep)
        out.append(n)
    return seq(*out) if out else ir.EMPTY


def _string_not_in(names) -> ir.GrammarNode:
    """A JSON string literal spelling none of ``names`` (a trie over their characters)."""
    trie: dict = {}
    for name in names:
        node = trie
        for ch in name:
            node = node.setdefault(ch, {})
        node[None] = True

    any_tail = seq(rep(JSON_CHAR, 0, None), literal('"'))

    def rest(node) -> ir.GrammarNode:
        kids = sorted(c for c in node if c is not None)
        parts = [] if None in node else [literal('"')]
        others = json_char_class(ir.negate_ranges([(ord(c), ord(c)) for c in kids]))
        parts.append(seq(others, any_tail))
        for c in kids:
            parts.append(seq(json_char_class([(ord(c), ord(c))]), rest(node[c])))
        return alt(*parts)

    return seq(literal('"'), rest(trie))


def _count(s, key, default):
    v = s.get(key, default)
    if v is default:
        return v
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise GrammarError(f"{key} must be a non-negative integer, got {v!r}", key)
    return v


def _bound(s, inclusive: str, exclusive: str, lower: bool):
    """(value, exclusive?) of the tighter of the two bound keywords (draft 4 boolean form too)."""
    best = None
    v = s.get(inclusive)
    ex = s.get(exclusive)
    for key, val in ((inclusive, v), (exclusive, ex)):
        if val is not None and not isinstance(val, bool) and not isinstance(val, (int, float)):
            raise GrammarError(f"{key} must be a number", key)
    if v is not None:
        best = (v, ex is True)
    if ex is not None and not isinstance(ex, bool):
        if best is None or (ex >= best[0] if lower else ex <= best[0]):
            best = (ex, True)
    if best is not None and isinstance(best[0], float) and not math.isfinite(best[0]):
        raise GrammarError(f"{inclusive} must be finite", inclusive)
    if best is not None and abs(best[0]) >= 10 ** MAX_BOUND_DIGITS:
        raise GrammarError(f"{inclusive}: bounds of {MAX_BOUND_DIGITS} digits and more are not supported", inclusive)
    return best if best is not None else (None, False)


def _integral(v) -> bool:
    """Whether a bound is a whole number (ints of any size: float() would overflow past 1e308)."""
    return isinstance(v, int) or v.is_integer()


def _validating(s: dict) -> bool:
    return any(k not in ANNOTATIONS for k in s) if isinstance(s, dict) else True


def merge_schemas(a, b):
    """A schema equivalent to allOf [a, b] (both without $ref at the top), or GrammarError."""
    if a is False or b is False:
        return False
    if a is True or a == {}:
        return copy.deepcopy(b) if isinstance(b, dict) else b
    if b is True or b == {}:
        return copy.deepcopy(a)
    if not isinstance(a, dict) or not isinstance(b, dict):
        raise GrammarError("allOf: subschemas must be objects or booleans", "allOf")
    for s in (a, b):
        for k in s:
            if k in UNSUPPORTED:
                raise GrammarError(f"JSON Schema keyword {k!r} is not supported", k)
        for k in ("$ref", "anyOf", "oneOf", "allOf"):
            if k in s and k in a and k in b and a[k] != b[k]:
                raise GrammarError(f"allOf: cannot combine two different {k!r}", k)
    out = dict(a)
    if any(k in a or k in b for k in TYPE_KEYWORDS["object"]):
        out.update(_merge_objects(a, b))
    for k, v in b.items():
        if k in TYPE_KEYWORDS["object"]:
            continue
        if k not in out:
            out[k] = v
        elif k in ANNOTATIONS or out[k] == v or (k not in SUPPORTED and k not in UNSUPPORTED):
            continue                             # annotations (known or unknown keywords): keep the first
        elif k == "type":
            ta, tb = set(_as_list(out[k])), set(_as_list(v))
            both = (ta | ({"integer"} if "number" in ta else set())) & (tb | ({"integer"} if "number" in tb else set()))
            if "number" in both:
                both.discard("integer")
            if not both:
                return False
            out[k] = sorted(both)
        elif k in ("minimum", "minLength", "minItems"):
            out[k] = max(out[k], v)
        elif k in ("maximum", "maxLength", "maxItems"):
            out[k] = min(out[k], v)
        elif k in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(v, bool) \
                and not isinstance(out[k], bool):
            out[k] = max(out[k], v) if k == "exclusiveMinimum" else min(out[k], v)
        elif k == "items" and isinstance(v, dict) and isinstance(out[k], dict):
            out[k] = {"allOf": [out[k], v]}
        elif k == "enum":
            keep = {_canon(x) for x in v}
            out[k] = [x for x in out[k] if _canon(x) in keep]
        else:
            raise GrammarError(f"allOf: cannot combine two different values of {k!r}", k)
    return out


def _as_list(t):
    return [t] if isinstance(t, str) else list(t)


def _merge_objects(a, b) -> dict:
    """properties / required / additionalProperties of allOf [a, b]: a property unlisted by one side is
    checked by that side's additionalProperties (false forbids it)."""
    out = {}
    pa, pb = a.get("properties", {}), b.get("properties", {})
    aa, ab = a.get("additionalProperties"), b.get("additionalProperties")
    props = {}
    for name in list(pa) + [n for n in pb if n not in pa]:
        sa = pa.get(name, True if aa is None else aa)
        sb = pb.get(name, True if ab is None else ab)
        if sa is False or sb is False:
            continue
        props[name] = sb if sa is True else sa if sb is True else {"allOf": [sa, sb]}
    required = list(dict.fromkeys(list(a.get("required", [])) + list(b.get("required", []))))
    if any(r not in props and (r in pa or r in pb) for r in required):
        props = dict(props)
        # a required property forbidden by one side: no value satisfies both
        return {"properties": props, "required": required, "additionalProperties": False,
                "minProperties": len(props) + 1}
    if props or "properties" in a or "properties" in b:
        out["properties"] = props
    if required:
        out["required"] = required
    if aa is not None or ab is not None:
        if aa is False or ab is False:
            out["additionalProperties"] = False
        elif aa is None or aa is True:
            out["additionalProperties"] = ab
        elif ab is None or ab is True:
            out["additionalProperties"] = aa
        else:
            out["additionalProperties"] = {"allOf": [aa, ab]}
    for k in ("minProperties", "maxProperties"):
        vals = [s[k] for s in (a, b) if k in s]
        if vals:
            out[k] = max(vals) if k == "minProperties" else min(vals)
    return out


def compile_json_schema(schema) -> tuple[dict, str]:
    """Schema (dict, bool or JSON text) -> (rules, root rule name)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        except RecursionError:
            raise GrammarError("the JSON schema text nests too deeply") from None
        except ValueError as e:            # e.g. an integer past Python's digit limit
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    return SchemaCompiler(schema).compile()


def json_object_rules() -> tuple[dict, str]:
    """OpenAI's ``{"type": "json_object"}``: any JSON object."""
    rules: dict = {}
    any_json_rules(rules)
    return rules, "json:object"
