"""S15 the grammar IR: every input (regex, JSON Schema, choice, GBNF) becomes rules over *bytes*.

A node is a plain tuple, so rules can be built, compared and hashed cheaply:

    ("b", mask)                 one byte whose value is a set bit of the 256-bit int ``mask``
    ("seq", (n1, n2, ...))      concatenation (the empty sequence matches the empty string)
    ("alt", (n1, n2, ...))      alternation (the empty alternation matches nothing)
    ("rep", node, lo, hi)       node repeated lo..hi times (hi None: unbounded)
    ("ref", name)               the rule ``name`` of the grammar (may be recursive)
    ("list", items, required, sep, at_least_one)
                                the items in order, each present or (when not required) left out, with
                                ``sep`` between consecutive present ones (and at least one present when
                                ``at_least_one``): JSON object members. Kept as one
                                node because spelling it with seq/alt needs quadratic size.
    ("clist", items, required, sep, lo, hi, extra)
                                JSON object members counted (minProperties / maxProperties): the items
                                in order as in "list", then ``extra`` (a member node, or None) repeated;
                                lo <= listed written + min(extras, 1) and listed + extras <= hi (hi None:
                                unbounded). Only one extra member counts towards ``lo``: two of them may
                                spell the same name.
    ("dfa", edges, accepting)   a trimmed DFA built elsewhere (`product.py`: languages intersected):
                                per state, its (byte mask, target state) edges; state 0 is the start.

Text is matched as UTF-8: a character class (code point ranges) becomes an alternation of byte-range
sequences (`char_class`), so a token may end in the middle of a character.
"""
from __future__ import annotations

GrammarNode = tuple
EMPTY: GrammarNode = ("seq", ())
NOTHING: GrammarNode = ("alt", ())
MAX_UNICODE = 0x10FFFF
MAX_NESTING = 100          # groups in groups (regex, GBNF), subschemas in subschemas: deeper is refused


class GrammarError(ValueError):
    """A grammar, schema or regex that cannot be compiled; the message names the construct (a JSON
    Schema error names the keyword, in ``keyword``)."""

    def __init__(self, message: str, keyword: str | None = None):
        super().__init__(message)
        self.keyword = keyword


def byte_set(lo: int, hi: int) -> GrammarNode:
    """One byte in [lo, hi]."""
    return ("b", ((1 << (hi + 1)) - 1) ^ ((1 << lo) - 1))


def seq(*nodes) -> GrammarNode:
    out = []
    for n in nodes:
        if n[0] == "seq":
            out.extend(n[1])
        else:
            out.append(n)
    return out[0] if len(out) == 1 else ("seq", tuple(out))


def alt(*nodes) -> GrammarNode:
    """Alternation, flattened and deduplicated in O(n) by hashing the nodes (first occurrence kept)."""
    out: dict = {}
    for n in nodes:
        for m in (n[1] if n[0] == "alt" else (n,)):
            out.setdefault(m, None)
    return next(iter(out)) if len(out) == 1 else ("alt", tuple(out))


def rep(node: GrammarNode, lo: int, hi: int | None) -> GrammarNode:
    if hi is not None and hi < lo:
        return NOTHING
    if hi == 1 and lo == 1:
        return node
    return ("rep", node, lo, hi)


def opt(node: GrammarNode) -> GrammarNode:
    return rep(node, 0, 1)


_BYTES = [("b", 1 << b) for b in range(256)]     # shared: a literal's bytes cost no new tuples


def literal(text: str | bytes) -> GrammarNode:
    data = text.encode("utf-8") if isinstance(text, str) else text
    if not data:
        return EMPTY
    return _BYTES[data[0]] if len(data) == 1 else ("seq", tuple(_BYTES[b] for b in data))


def ref(name: str) -> GrammarNode:
    return ("ref", name)


# --- code point ranges -> UTF-8 byte sequences ------------------------------------------------------
def normalize_ranges(ranges) -> list[tuple[int, int]]:
    """Sorted, merged, clipped to Unicode scalar values (no surrogates: UTF-8 cannot spell them)."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        lo, hi = max(lo, 0), min(hi, MAX_UNICODE)
        if lo > hi:
            continue
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    clipped = []
    for lo, hi in out:          # drop the surrogate block D800..DFFF
        if hi < 0xD800 or lo > 0xDFFF:
            clipped.append((lo, hi))
        else:
            if lo < 0xD800:
                clipped.append((lo, 0xD7FF))
            if hi > 0xDFFF:
                clipped.append((0xE000, hi))
    return clipped


def negate_ranges(ranges) -> list[tuple[int, int]]:
    out, nxt = [], 0
    for lo, hi in normalize_ranges(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_UNICODE:
        out.append((nxt, MAX_UNICODE))
    return normalize_ranges(out)


_UTF8_BOUNDS = ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, MAX_UNICODE))


def _utf8_split(lo: int, hi: int, n: int, out: list) -> None:
    """Split [lo, hi] (all of UTF-8 length n) until every byte position is a plain byte range."""
    for i in range(1, n):
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m:
                _utf8_split(lo, lo | m, n, out)
                _utf8_split((lo | m) + 1, hi, n, out)
                return
            if hi & m != m:
                _utf8_split(lo, (hi & ~m) - 1, n, out)
                _utf8_split(hi & ~m, hi, n, out)
                return
    a, b = chr(lo).encode("utf-8"), chr(hi).encode("utf-8")
    out.append(tuple(zip(a, b)))


def char_class(ranges) -> GrammarNode:
    """One character whose code point is in one of ``ranges`` [(lo, hi), ...], as UTF-8 bytes."""
    seqs: list = []
    for lo, hi in normalize_ranges(ranges):
        for n, (blo, bhi) in enumerate(_UTF8_BOUNDS, start=1):
            a, b = max(lo, blo), min(hi, bhi)
            if a <= b:
                _utf8_split(a, b, n, seqs)
    # merge single-byte ranges into one byte set
    single = 0
    multi = []
    for s in seqs:
        if len(s) == 1:
            single |= byte_set(*s[0])[1]
        else:
            multi.append(seq(*[byte_set(a, b) for a, b in s]))
    parts = ([("b", single)] if single else []) + multi
    return alt(*parts) if parts else NOTHING


def literals(items) -> GrammarNode:
    """Any one of the strings (or bytes) ``items``, as a trie: shared prefixes are spelled once, so N
    literals cost O(total length) to build and to compile (an alternation of N literals would give the
    NFA N parallel branches and the alternation's deduplication O(N) node hashes of O(length) each)."""
    data = sorted({x.encode("utf-8") if isinstance(x, str) else bytes(x) for x in items})
    if not data:
        return NOTHING

    def common(a: bytes, b: bytes, d: int) -> int:
        n = min(len(a), len(b))
        while d < n and a[d] == b[d]:
            d += 1
        return d

    def node(lo: int, hi: int, d: int) -> GrammarNode:
        # data[lo:hi] share their first d bytes; sorted, so their common prefix is that of the ends
        deep = common(data[lo], data[hi - 1], d)
        prefix = literal(data[lo][d:deep])
        parts = []
        if len(data[lo]) == deep:
            parts.append(EMPTY)
            lo += 1
        start = lo
        while start < hi:                    # group by the byte at position ``deep``
            b, end = data[start][deep], start + 1
            while end < hi and data[end][deep] == b:
                end += 1
            parts.append(node(start, end, deep))
            start = end
        # the parts are distinct by construction: no deduplication (hashing nested tuples is not O(1))
        return seq(prefix, parts[0] if len(parts) == 1 else ("alt", tuple(parts)))

    return node(0, len(data), 0)
