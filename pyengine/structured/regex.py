"""S15 regular expressions (Python `re` syntax, the subset a grammar can enforce) -> the byte-level IR.

Parsing gives a *character-level* tree (character classes as code point ranges); `lower` turns it into the
byte-level IR with a function that spells one character class: as raw UTF-8 for a plain regex, or as the
JSON string encoding of the character for a JSON Schema ``pattern`` (where ``"`` must be written ``\\"``).

Supported: literals and escapes, ``.``, classes ``[...]`` with ranges and negation, ``\\d \\w \\s`` and their
negations (exactly Python's Unicode sets), groups ``(...)``, ``(?:...)``, ``(?P<name>...)``, ``|``,
quantifiers ``* + ? {m} {m,} {m,n} {,n}`` (lazy forms too: laziness does not change the language), and
``^``/``$`` at the ends. Anything else (backreferences, lookaround, ``\\b``, inline flags) is a
`GrammarError` naming it: a regex is never enforced only in part.
"""
from __future__ import annotations

from . import ir
from .ir import GrammarError

MAX_REPEAT = 1000          # a counted repetition is unrolled into that many copies of its automaton

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}
_META = set("\\.^$|?*+()[]{}-/ \"'#&~!@%,:;<=>`_")
_unicode_sets: dict[str, list[tuple[int, int]]] = {}


def _ranges_where(pred) -> list[tuple[int, int]]:
    out, start = [], None
    for c in range(ir.MAX_UNICODE + 2):
        ok = c <= ir.MAX_UNICODE and pred(chr(c))
        if ok and start is None:
            start = c
        elif not ok and start is not None:
            out.append((start, c - 1))
            start = None
    return out


def unicode_class(letter: str) -> list[tuple[int, int]]:
    """Python re's \\d, \\w, \\s (str patterns: Unicode-aware), computed once from str predicates."""
    if letter not in _unicode_sets:
        preds = {"d": str.isdecimal, "w": lambda ch: ch.isalnum() or ch == "_",
                 "s": lambda ch: ch in " \t\n\r\f\v\x1c\x1d\x1e\x1f\x85" or ch.isspace()}
        if letter in "dws":
            _unicode_sets[letter] = _ranges_where(preds[letter])
        else:
            _unicode_sets[letter] = ir.negate_ranges(unicode_class(letter.lower()))
    return _unicode_sets[letter]


class _Parser:
    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise GrammarError(f"regex must be a string, got {type(pattern).__name__}")
        self.p = pattern
        self.i = 0
        self.depth = 0

    def error(self, what: str) -> GrammarError:
        shown = self.p if len(self.p) <= 80 else self.p[:77] + "..."
        return GrammarError(f"regex {shown!r}: {what} (at position {self.i})")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        if self.i >= len(self.p):
            raise self.error("unexpected end of pattern")
        c = self.p[self.i]
        self.i += 1
        return c

    def parse(self):
        node = self.alternation()
        if self.i != len(self.p):
            raise self.error(f"unbalanced {self.p[self.i]!r}")
        return node

    def alternation(self):
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", tuple(branches))

    def sequence(self):
        items = []
        while self.peek() is not None and self.peek() not in "|)":
            atom = self.atom()
            items.append(self.quantified(atom))
        return ("seq", tuple(items))

    def quantified(self, atom):
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and (counted := self._counted()) is not None:
                lo, hi = counted
            else:
                return atom
            if atom[0] in ("bol", "eol"):
                raise self.error("quantified anchor")
            if self.peek() == "?":
                self.i += 1                 # lazy: same language
            elif self.peek() == "+":
                raise self.error("possessive quantifier is not supported")
            if (hi if hi is not None else lo) > MAX_REPEAT:
                raise self.error(f"repetition count above {MAX_REPEAT}")
            atom = ("rep", atom, lo, hi)

    def _counted(self):
        """Parse {m}, {m,}, {m,n}, {,n} at self.i (advancing) or return None (a literal '{')."""
        j = self.p.find("}", self.i)
        if j < 0:
            return None
        body = self.p[self.i + 1:j]
        parts = body.split(",")
        if len(parts) > 2 or not all((s.isascii() and s.isdigit()) or s == "" for s in parts) or parts == [""] or \
                (len(parts) == 2 and parts == ["", ""]):
            return None
        self.i = j + 1
        lo = int(parts[0]) if parts[0] else 0
        hi = lo if len(parts) == 1 else (int(parts[1]) if parts[1] else None)
        if hi is not None and hi < lo:
            raise self.error("min repeat greater than max repeat")
        return lo, hi

    def atom(self):
        c = self.take()
        if c == "(":
            self.depth += 1
            if self.depth > ir.MAX_NESTING:
                raise self.error(f"groups nested deeper than {ir.MAX_NESTING}")
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?P<", self.i):
                j = self.p.find(">", self.i)
                if j < 0:
                    raise self.error("unterminated group name")
                self.i = j + 1
            elif self.peek() == "?":
                raise self.error("group extension (?...) (lookaround, flags, backreference) is not supported")
            node = self.alternation()
            if self.peek() != ")":
                raise self.error("missing )")
            self.i += 1
            self.depth -= 1
            return node
        if c == ")":
            raise self.error("unbalanced )")
        if c == "[":
            return ("cc", self.char_set())
        if c == ".":
            return ("cc", ir.negate_ranges([(10, 10)]))
        if c == "^":
            return ("bol",)
        if c == "$":
            return ("eol",)
        if c in "*+?":
            raise self.error(f"nothing to repeat before {c!r}")
        if c == "\\":
            return self.escape(in_class=False)
        return ("cc", [(ord(c), ord(c))])

    def escape(self, in_class: bool):
        c = self.take()
        if c in "dwsDWS":
            return ("cc", unicode_class(c))
        if c in _ESCAPES:
            if c == "0" and self.peek() is not None and self.peek().isdigit():
                raise self.error("octal escapes are not supported")
            return ("cc", [(ord(_ESCAPES[c]),) * 2])
        if c == "b" and in_class:
            return ("cc", [(8, 8)])
        if c in "xuU":
            n = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i:self.i + n]
            if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"bad \\{c} escape")
            self.i += n
            v = int(digits, 16)
            return ("cc", [(v, v)])
        if c == "A" and not in_class:
            return ("bol",)
        if c == "Z" and not in_class:
            return ("eol_strict",)
        if c.isalnum():
            raise self.error(f"escape \\{c} is not supported")
        return ("cc", [(ord(c), ord(c))])

    def char_set(self) -> list[tuple[int, int]]:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.error("unterminated character set")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self._set_item()
            if len(lo) == 1 and self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self._set_item()
                if len(hi) != 1:
                    raise self.error("bad character range")
                if hi[0][0] < lo[0][0]:
                    raise self.error("bad character range")
                ranges.append((lo[0][0], hi[0][0]))
            else:
                ranges.extend(lo)
        return ir.negate_ranges(ranges) if negate else ir.normalize_ranges(ranges)

    def _set_item(self) -> list[tuple[int, int]]:
        c = self.take()
        if c == "\\":
            node = self.escape(in_class=True)
            if node[0] != "cc":
                raise self.error("anchor inside a character set")
            return node[1]
        if c == "[" and self.peek() in (":", "=", "."):
            raise self.error("POSIX character classes are not supported")
        return [(ord(c), ord(c))]


def parse(pattern: str):
    """The character-level tree of ``pattern``."""
    return _Parser(pattern).parse()


def _strip_anchors(tree, search: bool):
    """Top-level alternatives with their ^/$ removed. Full-match mode ignores anchors at the ends;
    search mode (JSON Schema ``pattern``, like ``re.search``) pads an unanchored end with ``.*``-like
    filler. Anchors anywhere else are an error."""
    branches = tree[1] if tree[0] == "alt" else (tree,)
    out = []
    for b in branches:
        items = list(b[1]) if b[0] == "seq" else [b]
        start = bool(items) and items[0][0] == "bol"
        if start:
            items = items[1:]
        end = None
        if items and items[-1][0] in ("eol", "eol_strict"):
            end = items[-1][0]
            items = items[:-1]
        _check_no_anchor(("seq", tuple(items)))
        out.append((("seq", tuple(items)), start, end))
    return out


def _check_no_anchor(node):
    kind = node[0]
    if kind in ("bol", "eol", "eol_strict"):
        raise GrammarError("regex anchors (^, $, \\A, \\Z) are only supported at the start and end")
    if kind in ("seq", "alt"):
        for n in node[1]:
            _check_no_anchor(n)
    elif kind == "rep":
        _check_no_anchor(node[1])


def lower(node, spell_class) -> tuple:
    """Character-level tree -> byte-level IR, spelling each class with ``spell_class(ranges)``."""
    kind = node[0]
    if kind == "cc":
        return spell_class(node[1])
    if kind == "seq":
        return ir.seq(*[lower(n, spell_class) for n in node[1]])
    if kind == "alt":
        return ir.alt(*[lower(n, spell_class) for n in node[1]])
    if kind == "rep":
        return ir.rep(lower(node[1], spell_class), node[2], node[3])
    raise GrammarError(f"regex anchor in an unsupported place ({kind})")


def regex_to_ir(pattern: str, spell_class=ir.char_class, search: bool = False) -> tuple:
    """A regex as byte-level IR. ``search=False``: the whole output must match (vLLM's ``regex``);
    ``search=True``: ``re.search`` semantics (JSON Schema ``pattern``)."""
    tree = parse(pattern)
    any_char = ir.rep(spell_class(ir.negate_ranges([])), 0, None)
    alts = []
    for body, start, end in _strip_anchors(tree, search):
        node = lower(body, spell_class)
        if search:
            if not start:
                node = ir.seq(any_char, node)
            if end is None:
                node = ir.seq(node, any_char)
            elif end == "eol":
                node = ir.seq(node, ir.opt(spell_class([(10, 10)])))   # $ also matches before a final \n
        alts.append(node)
    return ir.alt(*alts)
