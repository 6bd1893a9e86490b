"""S15 a string's length counted at run time: exact minLength / maxLength without multiplying states.

`product.intersect` spells a length bound into the automaton: states (p, n) for every count n the bounds can
still tell apart, so ``format: uri, maxLength: 2083`` needs about 2083 times the looping states of the uri
automaton. When that does not fit, the schema compiler emits the string body as a rule of its own,

    ("counted", edges, accepting, boundary, lo, hi)     # ir.py; built by product.counted_node

(the uncounted product of format / pattern / JSON string characters, with per state whether it sits at a
character boundary), which the pushdown matcher runs as a `CountedRule`: a frame state is (p, n), p the
product state and n the decoded characters so far, both in one int ``p + Q * k`` (k = n, or FREE_K once
the bounds can no longer bind). Nothing is tabulated per count:

- a byte step is p's row plus n + boundary[p], kept only when a completion within the bounds exists:
  n + fewest[p'] <= hi when n >= lo, and when n < lo a completion of lo-n..hi-n more characters, read from a
  bitset of p's completion lengths up to lo + Q (a shortest completion past lo - n is at most Q longer,
  because a longer one repeats a state and a cycle of at most Q characters can be cut out of it);
- a token mask is one vectorized walk of the vocabulary per product state p (cached, `vocab.counted_walk`):
  the state each token ends in and the characters it adds; (p, n)'s mask is then a few array comparisons.

The counter states are interned by the pushdown matcher as the string is decoded (one per token step), so a
``maxLength: 1000000`` costs nothing at compile time beyond the uncounted product.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from . import budget as _budget

INF = 1 << 60
MAX_LENGTH_BITS = 1 << 22        # (product states) x (minLength + states) bits of completion lengths
WALKS_KEPT = 32                  # per product state: the walk of the vocabulary (3 arrays of <= vocab size)


class Lazy:
    """A read-only sequence computed on demand: ``rule.rows[s][b]``, ``rule.accepting[s]`` as the pushdown
    matcher reads a rule DFA's lists (the counted rules here and distinct.py's)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, i):
        return self.fn(i)


def dfa_table(edges, accepting):
    """(rows as lists, flat int32 table, accepting list, accepting array) of a DFA given as ir.py edges;
    state 0 is dead, ir.py's state i is i + 1."""
    q = len(edges) + 1
    table = np.zeros((q, 256), dtype=np.int32)
    for s, out in enumerate(edges, start=1):
        for mask, t in out:
            bits = np.unpackbits(np.frombuffer(int(mask).to_bytes(32, "little"), dtype=np.uint8),
                                 bitorder="little").astype(bool)
            table[s, bits] = t + 1
    acc = [False] + [bool(a) for a in accepting]
    return table.tolist(), table.reshape(-1), acc, np.array(acc, dtype=bool)


class CountedRule:
    """A rule of the pushdown matcher whose frame state carries a character count (module docstring)."""

    counted = True

    def __init__(self, node):
        _, edges, accepting, boundary, lo, hi = node
        q = len(edges) + 1                          # dead 0, the IR's states 0.. become 1..
        self.q = q
        self.table_rows, self.flat, self.acc, self.acc_np = dfa_table(edges, accepting)
        self.weight = [0] + [int(b) for b in boundary]
        self.lo, self.hi = int(lo), (None if hi is None else int(hi))
        self.free_k = max(self.lo, self.hi or 0) + 1
        self.fewest, self.most = remaining(self.table_rows, self.acc, self.weight)
        self.bits_hi = self.lo + q if self.lo else 0
        self.lengths = _completion_lengths(self.table_rows, self.acc, self.weight, self.bits_hi) if self.lo else None
        self.weight_np = np.array(self.weight, dtype=np.int32)
        self.fewest_np = np.array([min(f, INF) for f in self.fewest], dtype=np.int64)
        self.most_np = np.array([min(m, INF) for m in self.most], dtype=np.int64)
        self._views()
        self._walks: OrderedDict = OrderedDict()

    def __getstate__(self):
        state = dict(self.__dict__)
        for k in ("rows", "accepting", "has_bytes", "calls", "final_only"):
            state.pop(k)
        state["_walks"] = OrderedDict()
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._views()

    def _views(self):
        """The lists the pushdown matcher reads, computed on demand (not pickled)."""
        self.rows = Lazy(self._row)
        self.accepting = Lazy(self._accepting)
        self.has_bytes = Lazy(lambda s: any(self.table_rows[s % self.q]))
        self.calls = Lazy(lambda s: ())
        self.final_only = Lazy(lambda s: False)

    # --- one frame state ----------------------------------------------------------------------------
    def _norm(self, p: int, k: int) -> int:
        """The frame state of product state p after k characters (k < 0: the bounds cannot bind), or 0 when
        no completion from there meets the bounds."""
        if not p or self.fewest[p] >= INF:
            return 0
        if k < 0:
            return p + self.q * k
        lo, hi = self.lo, self.hi
        if hi is not None and k + self.fewest[p] > hi:
            return 0
        if k >= lo:
            return p + self.q * (self.free_k if hi is None or k + self.most[p] <= hi else k)
        j = lo - k
        u = j + self.q if hi is None else min(hi - k, j + self.q)
        if u < j or (self.lengths[p] >> j) & ((1 << (u - j + 1)) - 1) == 0:
            return 0
        return p + self.q * k

    def start_ok(self) -> bool:
        return self._norm(1, 0) != 0

    def is_free(self, s: int) -> bool:
        """Whether the bounds can no longer bind from frame state s (reached with no count carried)."""
        return self._norm(s, 0) // self.q == self.free_k and self._norm(s, 0) != 0

    def _row(self, s: int):
        p, k = s % self.q, s // self.q
        row = self.table_rows[p]
        k2 = -1 if k == self.free_k else k + self.weight[p]
        return Lazy(lambda b: self._norm(row[b], k2))

    def _accepting(self, s: int) -> bool:
        p, k = s % self.q, s // self.q
        return self.acc[p] and (k == self.free_k or (k >= self.lo and (self.hi is None or k <= self.hi)))

    # --- token masks ----------------------------------------------------------------------------------
    def _walk(self, p: int, vocab):
        key = (p, vocab.key)
        hit = self._walks.get(key)
        if hit is None:
            hit = self._walks[key] = vocab.counted_walk(self.flat, p, self.weight_np, self.acc_np)
            if len(self._walks) > WALKS_KEPT:
                self._walks.popitem(last=False)
        else:
            self._walks.move_to_end(key)
        return hit

    def frame_mask(self, s: int, vocab):
        """(token ids read whole inside the string from frame state s, token ids that leave the string part
        way: the pushdown matcher steps those byte by byte)."""
        p, k = s % self.q, s // self.q
        ids, ends, adds, slow = self._walk(p, vocab)
        if k == self.free_k:
            return ids, slow
        n = k + adds
        ok = np.ones(len(ids), dtype=bool)
        if self.hi is not None:
            ok &= n + self.fewest_np[ends] <= self.hi
        if self.lo:
            short = np.flatnonzero(ok & (n < self.lo))
            if len(short):
                lengths, lo, hi, q = self.lengths, self.lo, self.hi, self.q
                for i, e, c in zip(short.tolist(), ends[short].tolist(), n[short].tolist()):
                    j = lo - c
                    u = j + q if hi is None else min(hi - c, j + q)
                    if u < j or (lengths[e] >> j) & ((1 << (u - j + 1)) - 1) == 0:
                        ok[i] = False
        return ids[ok], slow


def remaining(rows, accepting, weight):
    """Per state: (fewest, most) characters still to read before acceptance (INF: unbounded; a state
    that cannot accept gets fewest INF). rows: successor lists; weight[s] 1 if leaving s starts a char."""
    n = len(rows)
    succ = [set(t for t in r if t) for r in rows]
    pred = [[] for _ in range(n)]
    for s in range(1, n):
        for t in succ[s]:
            pred[t].append(s)
    # fewest: 0/1-weighted shortest path to an accepting state, backwards (a deque-free Dijkstra by layers)
    fewest = [INF] * n
    frontier = [s for s in range(1, n) if accepting[s]]
    for s in frontier:
        fewest[s] = 0
    dist = 0
    while frontier:
        # zero-weight closure at this distance
        work = list(frontier)
        layer = set(frontier)
        while work:
            t = work.pop()
            for s in pred[t]:
                if not weight[s] and fewest[s] > dist:
                    fewest[s] = dist
                    layer.add(s)
                    work.append(s)
        nxt = set()
        for t in layer:
            for s in pred[t]:
                if weight[s] and fewest[s] > dist + 1:
                    fewest[s] = dist + 1
                    nxt.add(s)
        frontier = list(nxt)
        dist += 1
    # most: longest path over the co-accessible states, INF where a cycle can still be entered: peel
    # states whose successors are all peeled (Kahn's order); what is never peeled reaches a cycle
    live = [fewest[s] < INF for s in range(n)]
    outdeg = [sum(1 for t in succ[s] if live[t]) if live[s] else 0 for s in range(n)]
    order = [s for s in range(1, n) if live[s] and not outdeg[s]]
    i = 0
    while i < len(order):
        t = order[i]
        i += 1
        for s in pred[t]:
            if live[s]:
                outdeg[s] -= 1
                if not outdeg[s]:
                    order.append(s)
    most = [INF] * n
    for s in order:
        best = 0 if accepting[s] else -INF
        for t in succ[s]:
            if live[t]:
                best = max(best, most[t] + weight[s])
        most[s] = best
    return fewest, most


def _completion_lengths(rows, acc, weight, top: int) -> list[int]:
    """Per state, a bitset (Python int) of the character counts 0..top of its completions to acceptance."""
    n = len(rows)
    if n * (top + 1) > MAX_LENGTH_BITS:
        raise _budget.GrammarTooLarge(f"grammar too large (minLength {top - n} counted over {n} states needs "
                                      f"more than {MAX_LENGTH_BITS} bits)", "minLength")
    budget = _budget.current()
    full = (1 << (top + 1)) - 1
    pred = [[] for _ in range(n)]
    for s in range(1, n):
        for t in set(rows[s]):
            if t:
                pred[t].append(s)
    bits = [1 if acc[s] else 0 for s in range(n)]
    work = [s for s in range(1, n) if acc[s]]
    steps = 0
    while work:
        t = work.pop()
        steps += 1
        if not steps & 1023:
            budget.check_time()
        for s in pred[t]:
            new = bits[s] | ((bits[t] << weight[s]) & full)
            if new != bits[s]:
                bits[s] = new
                work.append(s)
    return bits
