"""S15 llama.cpp's GBNF grammar format -> byte-level rules, so users can bring their existing grammars.

    root   ::= "(" expr ")" | [a-z]+         # rules, alternation, grouping, comments
    expr   ::= term ("+" term)*              # repetition * + ? {m} {m,} {m,n}
    term   ::= [0-9]{1,3} | "\\u00e9" | .     # literals with escapes, [^...] classes, . any character

A rule ends where the next ``name ::=`` starts (llama.cpp also lets a rule continue after ``|`` or inside
parentheses; this reader accepts every such file). The start rule is ``root``.
"""
from __future__ import annotations

from . import ir
from .ir import GrammarError

_ESC = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "^": "^",
        "/": "/", "'": "'", "0": "\0", "f": "\f", "v": "\v", "a": "\a", "b": "\b", ".": "."}


class _GBNF:
    def __init__(self, text: str):
        if not isinstance(text, str):
            raise GrammarError(f"a GBNF grammar must be a string, got {type(text).__name__}")
        self.s = text
        self.i = 0
        self.depth = 0
        self.rules: dict[str, tuple] = {}

    def error(self, msg: str) -> GrammarError:
        line = self.s.count("\n", 0, self.i) + 1
        return GrammarError(f"GBNF: {msg} (line {line})")

    def space(self) -> None:
        s, n = self.s, len(self.s)
        while self.i < n:
            c = s[self.i]
            if c == "#":
                while self.i < n and s[self.i] != "\n":
                    self.i += 1
            elif c.isspace():
                self.i += 1
            else:
                break

    def name(self) -> str | None:
        j = self.i
        while j < len(self.s) and (self.s[j].isalnum() or self.s[j] in "-_."):
            j += 1
        if j == self.i:
            return None
        out = self.s[self.i:j]
        self.i = j
        return out

    def at_rule_start(self) -> bool:
        save = self.i
        ok = self.name() is not None
        if ok:
            self.space()
            ok = self.s.startswith("::=", self.i)
        self.i = save
        return ok

    def parse(self) -> dict:
        self.space()
        while self.i < len(self.s):
            name = self.name()
            if name is None:
                raise self.error(f"expected a rule name, got {self.s[self.i]!r}")
            self.space()
            if not self.s.startswith("::=", self.i):
                raise self.error(f"expected ::= after {name!r}")
            self.i += 3
            if name in self.rules:
                raise self.error(f"rule {name!r} is defined twice")
            self.rules[name] = self.alternation(top=True)
            self.space()
        if "root" not in self.rules:
            raise GrammarError("GBNF: the grammar has no 'root' rule")
        return self.rules

    def alternation(self, top: bool) -> tuple:
        branches = [self.sequence(top)]
        while True:
            self.space()
            if self.s.startswith("|", self.i):
                self.i += 1
                branches.append(self.sequence(top))
            else:
                return ir.alt(*branches) if len(branches) > 1 else branches[0]

    def sequence(self, top: bool) -> tuple:
        items = []
        while True:
            self.space()
            if self.i >= len(self.s) or self.s[self.i] in "|)" or (top and self.at_rule_start()):
                return ir.seq(*items) if items else ir.EMPTY
            items.append(self.postfix(self.primary()))

    def primary(self) -> tuple:
        c = self.s[self.i]
        if c == '"':
            self.i += 1
            chars = []
            while True:
                if self.i >= len(self.s):
                    raise self.error("unterminated string literal")
                ch = self.s[self.i]
                if ch == '"':
                    self.i += 1
                    break
                chars.append(self.char())
            return ir.literal("".join(chars))
        if c == "[":
            self.i += 1
            negate = self.s.startswith("^", self.i)
            if negate:
                self.i += 1
            ranges = []
            while True:
                if self.i >= len(self.s):
                    raise self.error("unterminated character class")
                if self.s[self.i] == "]":
                    self.i += 1
                    break
                lo = ord(self.char())
                hi = lo
                if self.s.startswith("-", self.i) and not self.s.startswith("-]", self.i):
                    self.i += 1
                    hi = ord(self.char())
                    if hi < lo:
                        raise self.error("bad character range")
                ranges.append((lo, hi))
            return ir.char_class(ir.negate_ranges(ranges) if negate else ranges)
        if c == ".":
            self.i += 1
            return ir.char_class([(0, ir.MAX_UNICODE)])
        if c == "(":
            self.i += 1
            self.depth += 1
            if self.depth > ir.MAX_NESTING:
                raise self.error(f"parentheses nested deeper than {ir.MAX_NESTING}")
            node = self.alternation(top=False)
            self.space()
            if not self.s.startswith(")", self.i):
                raise self.error("missing )")
            self.i += 1
            self.depth -= 1
            return node
        name = self.name()
        if name is None:
            raise self.error(f"unexpected {c!r}")
        return ir.ref(name)

    def char(self) -> str:
        ch = self.s[self.i]
        if ch != "\\":
            self.i += 1
            return ch
        e = self.s[self.i + 1:self.i + 2]
        if e in ("x", "u", "U"):
            n = {"x": 2, "u": 4, "U": 8}[e]
            digits = self.s[self.i + 2:self.i + 2 + n]
            if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"bad \\{e} escape")
            self.i += 2 + n
            v = int(digits, 16)
            if v > ir.MAX_UNICODE:
                raise self.error("code point out of range")
            return chr(v)
        if e in _ESC:
            self.i += 2
            return _ESC[e]
        raise self.error(f"unknown escape \\{e}")

    def postfix(self, node) -> tuple:
        while True:
            c = self.s[self.i:self.i + 1]
            if c in ("*", "+", "?"):
                self.i += 1
                node = ir.rep(node, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[c])
            elif c == "{":
                j = self.s.find("}", self.i)
                if j < 0:
                    raise self.error("unterminated {m,n}")
                parts = self.s[self.i + 1:j].replace(" ", "").split(",")
                if len(parts) > 2 or not all(p.isascii() and (p.isdigit() or p == "") for p in parts):
                    raise self.error("bad repetition {m,n}: counts are non-negative integers")
                lo = int(parts[0]) if parts[0] else 0
                hi = lo if len(parts) == 1 else (int(parts[1]) if parts[1] else None)
                if len(parts) > 2 or (hi is not None and hi < lo) or (hi or lo) > 1000:
                    raise self.error("bad repetition {m,n}")
                self.i = j + 1
                node = ir.rep(node, lo, hi)
            else:
                return node


def parse_gbnf(text: str) -> tuple[dict, str]:
    """GBNF text -> (rules, "root"); undefined rule names are an error."""
    rules = _GBNF(text).parse()
    for name, body in rules.items():
        for r in _names(body):
            if r not in rules:
                raise GrammarError(f"GBNF: rule {name!r} uses undefined rule {r!r}")
    return rules, "root"


def _names(node):
    kind = node[0]
    if kind == "ref":
        yield node[1]
    elif kind in ("seq", "alt"):
        for n in node[1]:
            yield from _names(n)
    elif kind == "rep":
        yield from _names(node[1])
