"""S15 automata over bytes: the IR compiled to a DFA (regular grammars) or a pushdown matcher (recursion).

`compile_rules(rules, root)` finds the rules that take part in recursion (cycles of ``ref``); every other
rule is inlined where it is used. With no recursion left the whole grammar is one NFA (Thompson
construction), determinized by subset construction over byte classes and minimized (Moore): a `ByteDFA`,
whose state is one int and whose token mask is one vectorized walk of the vocabulary (`vocab.py`).

With recursion, each recursive rule gets its own DFA over bytes plus "call rule q" edges, and the state of
the `PushdownMatcher` is a *set of stacks* of (rule, DFA state) frames, advanced one byte at a time (a
deterministic view of a nondeterministic pushdown automaton, as llama.cpp's GBNF sampler does). Calls in
tail position replace the caller's frame, so right recursion (``list ::= item list?``) stays flat; left
recursion is refused. Stack sets are interned to ints so masks and byte steps can be cached per state.

State 0 is the dead state in both: no continuation is possible.
"""
from __future__ import annotations

import numpy as np

from . import budget as _budget
from .counter import CountedRule
from .distinct import DistinctKeysRule
from .ir import GrammarError

MAX_DFA_STATES = 20_000          # past this a regular grammar is compiled rule by rule (pushdown) instead
MAX_STACK_DEPTH = 64             # nesting of recursive rules (JSON depth); deeper outputs are not allowed
MAX_STACKS = 4096                # stacks in one pushdown state (ambiguous grammars multiply them)
PROBE_STATES = 512               # pushdown states explored at compile time to catch ambiguity early


class _TooLarge(_budget.GrammarTooLarge):
    """A DFA past MAX_DFA_STATES (the grammar is then compiled rule by rule instead)."""


class TooAmbiguous(GrammarError):
    """A pushdown state with more than MAX_STACKS parse stacks (the per-sequence stack budget)."""

    def __init__(self, message: str | None = None, keyword: str | None = None):
        super().__init__(message or f"grammar is too ambiguous (more than {MAX_STACKS} parse stacks at once)",
                         keyword)


# --- NFA (Thompson construction) ---------------------------------------------------------------------
class _NFA:
    def __init__(self, rules: dict, inline: set):
        self.rules, self.inline = rules, inline
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int]]] = []     # (byte mask, target)
        self.calls: list[list[tuple[str, int]]] = []     # (rule name, target)
        self._inlining: list[str] = []
        self.budget = _budget.current()

    def start(self, node) -> tuple[int, int]:
        """(start, final) states of a new automaton for ``node``, refused before it is built when its
        estimated size is past the state budget."""
        size = estimate_states(node, self.rules, self.inline)
        if len(self.eps) + size > self.budget.max_states:
            raise self.budget.too_large(f"about {size} automaton states")
        s, f = self.new(), self.new()
        self.build(node, s, f)
        return s, f

    def new(self) -> int:
        n = len(self.eps)
        if n >= self.budget.max_states:
            raise self.budget.too_large(f"more than {self.budget.max_states} automaton states")
        if not n & 4095:
            self.budget.check_time()
        self.eps.append([])
        self.edges.append([])
        self.calls.append([])
        return len(self.eps) - 1

    def build(self, node, a: int, b: int) -> None:
        """Add paths a -> b matching ``node``."""
        kind = node[0]
        if kind == "b":
            if node[1]:
                self.edges[a].append((node[1], b))
        elif kind == "seq":
            items = node[1]
            if not items:
                self.eps[a].append(b)
                return
            cur = a
            for n in items[:-1]:
                nxt = self.new()
                self.build(n, cur, nxt)
                cur = nxt
            self.build(items[-1], cur, b)
        elif kind == "alt":
            for n in node[1]:
                x, y = self.new(), self.new()
                self.eps[a].append(x)
                self.build(n, x, y)
                self.eps[y].append(b)
        elif kind == "rep":
            _, sub, lo, hi = node
            cur = a
            for _ in range(lo):
                nxt = self.new()
                self.build(sub, cur, nxt)
                cur = nxt
            if hi is None:
                x, y = self.new(), self.new()
                self.eps[cur].append(x)
                self.build(sub, x, y)
                self.eps[y].append(x)
                self.eps[x].append(b)
            else:
                for _ in range(hi - lo):
                    self.eps[cur].append(b)
                    nxt = self.new()
                    self.build(sub, cur, nxt)
                    cur = nxt
                self.eps[cur].append(b)
        elif kind == "ref":
            name = node[1]
            if name not in self.rules:
                raise GrammarError(f"undefined rule {name!r}")
            if name in self.inline:
                if name in self._inlining:
                    raise GrammarError(f"rule {name!r} is recursive")   # cannot happen: SCCs are not inlined
                self._inlining.append(name)
                x, y = self.new(), self.new()
                self.eps[a].append(x)
                self.build(self.rules[name], x, y)
                self.eps[y].append(b)
                self._inlining.pop()
            else:
                self.calls[a].append((name, b))
        elif kind == "dfa":
            # a trimmed DFA (product.py): its states become NFA states, state 0 the entry
            _, edges, accepting = node
            states = [self.new() for _ in edges]
            self.eps[a].append(states[0])
            for s, out in zip(states, edges):
                self.edges[s].extend((m, states[t]) for m, t in out)
            for s, acc in zip(states, accepting):
                if acc:
                    self.eps[s].append(b)
        elif kind == "clist":
            self._counted_list(node, a, b)
        elif kind == "list":
            items, required, sep = node[1:4]
            at_least_one = len(node) > 4 and node[4]
            if not items:
                if not at_least_one:
                    self.eps[a].append(b)
                return
            # none[i]: no item written yet before item i; some[i]: at least one written
            none = [a] + [self.new() for _ in items]
            some = [None] + [self.new() for _ in items]
            for i, (item, req) in enumerate(zip(items, required)):
                self.build(item, none[i], some[i + 1])
                if some[i] is not None:
                    mid = self.new()
                    self.build(sep, some[i], mid)
                    self.build(item, mid, some[i + 1])
                if not req:
                    self.eps[none[i]].append(none[i + 1])
                    if some[i] is not None:
                        self.eps[some[i]].append(some[i + 1])
            self.eps[some[-1]].append(b)
            if not any(required) and not at_least_one:
                self.eps[none[-1]].append(b)
        else:
            raise GrammarError(f"unknown grammar node {kind!r}")

    def _counted_list(self, node, a: int, b: int) -> None:
        """("clist", items, required, sep, lo, hi, extra): JSON object members counted (ir.py). States
        (i, c): items 0..i-1 decided, c written so far (capped at ``hi``, or saturated at ``max(lo, 1)``
        without one); then the extra members on a chain Y[r] (r: room left under ``hi``)."""
        _, items, required, sep, lo, hi, extra = node
        cap = hi if hi is not None else max(lo, 1)
        cur = {0: a}
        for item, req in zip(items, required):
            nxt: dict[int, int] = {}

            def at(c):
                if c not in nxt:
                    nxt[c] = self.new()
                return nxt[c]

            for c, st in sorted(cur.items()):
                c2 = c + 1 if hi is not None else min(c + 1, cap)
                if c2 <= cap:
                    self._member(item, sep, c, st, at(c2))
                if not req:
                    self.eps[st].append(at(c))
            cur = nxt
        chain: dict = {}

        def y(r):                   # a member written, room r left (None: unbounded); min satisfied
            if r not in chain:
                chain[r] = self.new()
                self.eps[chain[r]].append(b)
                if r is None:
                    self._member(extra, sep, 1, chain[r], chain[r])
                elif r > 0:
                    self._member(extra, sep, 1, chain[r], y(r - 1))
            return chain[r]

        for c, st in sorted(cur.items()):
            if c >= lo:
                self.eps[st].append(b)
            if extra is None or c < lo - 1:
                continue
            room = None if hi is None else hi - c
            if room is not None and room <= 0:
                continue
            self._member(extra, sep, c, st, y(None if room is None else room - 1))

    def _member(self, item, sep, written: int, a: int, b: int) -> None:
        if written:
            mid = self.new()
            self.build(sep, a, mid)
            self.build(item, mid, b)
        else:
            self.build(item, a, b)

    def closure(self, states) -> frozenset:
        seen = set(states)
        work = list(states)
        eps = self.eps
        while work:
            s = work.pop()
            for t in eps[s]:
                if t not in seen:
                    seen.add(t)
                    work.append(t)
        return frozenset(seen)


def _byte_classes(masks) -> tuple[np.ndarray, list[int]]:
    """Partition 0..255 into classes no mask splits: class id per byte and a representative byte each."""
    sig = [0] * 256
    for k, m in enumerate(masks):
        bit = 1 << k
        while m:
            low = m & -m
            sig[low.bit_length() - 1] |= bit
            m ^= low
    ids: dict[int, int] = {}
    cls = np.empty(256, dtype=np.int32)
    reps = []
    for b in range(256):
        c = ids.get(sig[b])
        if c is None:
            c = ids[sig[b]] = len(reps)
            reps.append(b)
        cls[b] = c
    return cls, reps


def _determinize(nfa: _NFA, start: int, final: int):
    """Subset construction. Returns (byte table (n, 256) with 0 = dead, accepting (n,), calls per state
    {rule: target}) for DFA states 1..n-1, state 1 the start."""
    masks = sorted({m for es in nfa.edges for m, _ in es})
    cls, reps = _byte_classes(masks)
    covers = {m: [c for c, r in enumerate(reps) if m >> r & 1] for m in masks}
    n_cls = len(reps)
    index: dict[frozenset, int] = {frozenset(): 0}
    sets = [frozenset()]
    rows: list[list[int]] = [[0] * n_cls]
    calls: list[dict] = [{}]
    s0 = nfa.closure([start])
    index[s0] = 1
    sets.append(s0)
    todo = [1]
    rows.append(None)
    calls.append(None)
    budget = _budget.current()
    while todo:
        d = todo.pop()
        if not d & 255:
            budget.check_time()
        nxt: list[set | None] = [None] * n_cls
        call_targets: dict[str, set] = {}
        for s in sets[d]:
            for m, t in nfa.edges[s]:
                for c in covers[m]:
                    if nxt[c] is None:
                        nxt[c] = set()
                    nxt[c].add(t)
            for name, t in nfa.calls[s]:
                call_targets.setdefault(name, set()).add(t)
        row = [0] * n_cls
        memo: dict[frozenset, int] = {}
        for c in range(n_cls):
            if nxt[c] is None:
                continue
            key = frozenset(nxt[c])
            j = memo.get(key)
            if j is None:
                j = memo[key] = _intern(nfa, key, index, sets, rows, calls, todo)
            row[c] = j
        rows[d] = row
        calls[d] = {name: _intern(nfa, frozenset(ts), index, sets, rows, calls, todo)
                    for name, ts in call_targets.items()}
    table = np.asarray(rows, dtype=np.int32)        # (states, byte classes)
    accepting = np.array([final in s for s in sets], dtype=bool)
    return table, cls, accepting, calls


def _intern(nfa, key, index, sets, rows, calls, todo) -> int:
    closed = nfa.closure(key)
    j = index.get(closed)
    if j is None:
        j = index[closed] = len(sets)
        if j > MAX_DFA_STATES:
            raise _TooLarge(f"grammar too large (more than {MAX_DFA_STATES} DFA states)")
        sets.append(closed)
        rows.append(None)
        calls.append(None)
        todo.append(j)
    return j


def _rows_id(sig: np.ndarray) -> np.ndarray:
    """Equal rows -> equal small ints (np.unique over the rows' bytes)."""
    sig = np.ascontiguousarray(sig)
    view = sig.view(np.dtype((np.void, sig.dtype.itemsize * sig.shape[1]))).reshape(-1)
    _, inv = np.unique(view, return_inverse=True)
    return inv.reshape(-1)


def minimize_by_labels(table: np.ndarray, labels) -> tuple[np.ndarray, np.ndarray]:
    """Moore's partition refinement over the (states, byte classes) table, from the states' initial ``labels``
    (the dead state 0 is a class of its own). Returns the minimal table (dead 0, start 1, the others in
    first-seen order) and ``reps``: for each new state, an old state it stands for."""
    n = table.shape[0]
    part = np.asarray(labels).astype(np.int32).reshape(-1)
    part[0] = -1                                   # dead is its own class
    _, part = np.unique(part, return_inverse=True)
    part = part.reshape(-1).astype(np.int32)
    budget = _budget.current()
    while True:
        budget.check_time()
        new = _rows_id(np.concatenate([part[:, None], part[table]], axis=1)).astype(np.int32)
        if new.max() == part.max():
            break
        part = new
    order = {int(part[0]): 0}
    order.setdefault(int(part[1]), 1)
    for p in part.tolist():
        order.setdefault(p, len(order))
    remap = np.array([order[p] for p in range(int(part.max()) + 1)], dtype=np.int32)
    reps = np.zeros(len(order), dtype=np.int64)
    reps[remap[part]] = np.arange(n)
    new_table = remap[part[table[reps]]].astype(np.int32)
    new_table[0] = 0
    return new_table, reps


def _minimize(table: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The minimal DFA of (table, accepting): the dead state stays 0 and the start state becomes 1."""
    new_table, reps = minimize_by_labels(table, accepting)
    return new_table, np.asarray(accepting, dtype=bool)[reps]


class ByteDFA:
    """A deterministic automaton over bytes: ``table[state, byte] -> state``; 0 is dead, 1 the start."""

    kind = "dfa"

    def __init__(self, table: np.ndarray, accepting: np.ndarray):
        self.table = np.ascontiguousarray(table, dtype=np.int32)
        self.flat = self.table.reshape(-1)
        self.accepting = accepting
        self.live = self.table.any(axis=1)          # some byte leads on (not a final-only state)
        self.num_states = self.table.shape[0]

    def initial(self) -> int:
        return 1

    def step(self, state: int, data: bytes) -> int:
        t = self.table
        for b in data:
            state = int(t[state, b])
            if not state:
                return 0
        return state

    def is_accepting(self, state: int) -> bool:
        return bool(self.accepting[state])

    def can_continue(self, state: int) -> bool:
        return bool(self.live[state])

    def token_mask(self, state: int, vocab) -> np.ndarray:
        return vocab.dfa_mask(self.flat, state)


class _RuleDFA:
    counted = False                                 # a plain rule (counter.CountedRule: a counted string)

    def __init__(self, table, accepting, calls):
        self.rows = table.tolist()                  # python lists: the byte-at-a-time walk is scalar
        self.flat = np.ascontiguousarray(table, dtype=np.int32).reshape(-1)
        # where the rule may hand over to a callee or back to its caller: a token passing such a state
        # and then leaving the rule's own transitions needs the full pushdown step
        self.escapable = np.array([a or bool(c) for a, c in zip(accepting.tolist(), calls)], dtype=bool)
        self.accepting = accepting.tolist()
        self.calls = [list(c.items()) for c in calls]
        self.has_bytes = table.any(axis=1).tolist()
        # a state that can only end the rule: a call from it to q can replace the frame (tail call)
        self.final_only = [a and not hb and not c for a, hb, c in zip(self.accepting, self.has_bytes, self.calls)]


class PushdownMatcher:
    """Recursive rules as DFAs with call edges; the state is an interned set of stacks."""

    kind = "pda"

    def __init__(self, rule_dfas: dict[str, _RuleDFA], root: str):
        self.rules = rule_dfas
        self.root = root
        self._sets: list[frozenset] = [frozenset()]
        self._ids: dict[frozenset, int] = {frozenset(): 0}
        self._steps: dict[int, int] = {}            # state * 256 + byte -> state
        self._accepting: dict[int, bool] = {0: False}
        self.start = self._intern(self._closure([((root, 1),)]))

    @property
    def num_states(self) -> int:
        return len(self._sets)

    def _closure(self, stacks) -> frozenset:
        rules = self.rules
        seen = set()
        work = list(stacks)
        keep = set()
        while work:
            st = work.pop()
            if st in seen:
                continue
            seen.add(st)
            if len(seen) > MAX_STACKS * 4:
                raise TooAmbiguous()
            name, s = st[-1]
            r = rules[name]
            if r.has_bytes[s]:
                keep.add(st)
            if r.accepting[s]:
                if len(st) == 1:
                    keep.add(st)
                else:
                    work.append(st[:-1])
            for q, t in r.calls[s]:
                if r.final_only[t]:
                    work.append(st[:-1] + ((q, 1),))      # tail call: nothing left to do after q
                elif len(st) < MAX_STACK_DEPTH:
                    work.append(st[:-1] + ((name, t), (q, 1)))
        return frozenset(keep)

    def _intern(self, stacks: frozenset) -> int:
        i = self._ids.get(stacks)
        if i is None:
            if len(stacks) > MAX_STACKS:
                raise TooAmbiguous()
            i = self._ids[stacks] = len(self._sets)
            self._sets.append(stacks)
            self._accepting[i] = any(len(st) == 1 and self.rules[st[0][0]].accepting[st[0][1]] for st in stacks)
        return i

    def initial(self) -> int:
        return self.start

    def step_byte(self, state: int, b: int) -> int:
        key = state * 256 + b
        nxt = self._steps.get(key)
        if nxt is None:
            rules = self.rules
            moved = []
            for st in self._sets[state]:
                name, s = st[-1]
                t = rules[name].rows[s][b]
                if t:
                    moved.append(st[:-1] + ((name, t),))
            nxt = self._intern(self._closure(moved)) if moved else 0
            self._steps[key] = nxt
        return nxt

    def step(self, state: int, data: bytes) -> int:
        for b in data:
            state = self.step_byte(state, b)
            if not state:
                return 0
        return state

    def is_accepting(self, state: int) -> bool:
        return self._accepting[state]

    def can_continue(self, state: int) -> bool:
        return any(self.rules[st[-1][0]].has_bytes[st[-1][1]] for st in self._sets[state])

    def token_mask(self, state: int, vocab) -> np.ndarray:
        """Per distinct top frame, a vectorized walk inside its rule; the few tokens that leave the rule
        part-way are checked with the full pushdown step."""
        mask = np.zeros(vocab.size, dtype=bool)
        slow = []
        for name, s in {st[-1] for st in self._sets[state]}:
            r = self.rules[name]
            ok, maybe = r.frame_mask(s, vocab) if r.counted else vocab.frame_walk(r.flat, s, r.escapable)
            mask[ok] = True
            slow.append(maybe)
        if slow:
            tb = vocab.token_bytes
            for tid in np.unique(np.concatenate(slow)).tolist():
                if not mask[tid] and self.step(state, tb[tid]):
                    mask[tid] = True
        return mask

    def trie_mask(self, state: int, vocab) -> np.ndarray:
        """The same mask by walking the vocabulary trie byte by byte (the reference for token_mask)."""
        return vocab.trie_mask(self.step_byte, state)


# --- compilation -------------------------------------------------------------------------------------
def _refs(node, out: set) -> set:
    kind = node[0]
    if kind == "ref":
        out.add(node[1])
    elif kind in ("seq", "alt"):
        for n in node[1]:
            _refs(n, out)
    elif kind == "rep":
        _refs(node[1], out)
    elif kind in ("list", "clist"):
        for n in node[1]:
            _refs(n, out)
        _refs(node[3], out)
        if kind == "clist" and node[6] is not None:
            _refs(node[6], out)
    elif kind == "xkeys":
        out.add(node[3])
        out.update(m[2] for m in (node[6] if len(node) > 6 else ()))
    return out


def recursive_rules(rules: dict, root: str) -> set:
    """Rules on a cycle of references reachable from ``root`` (Tarjan's SCCs, iteratively)."""
    graph = {}
    todo = [root]
    while todo:
        r = todo.pop()
        if r in graph:
            continue
        if r not in rules:
            raise GrammarError(f"undefined rule {r!r}")
        graph[r] = sorted(_refs(rules[r], set()))
        todo.extend(graph[r])
    index, low, on, stack, out = {}, {}, set(), [], set()
    counter = [0]
    for v0 in graph:
        if v0 in index:
            continue
        work = [(v0, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter[0]
                counter[0] += 1
                stack.append(v)
                on.add(v)
            recurse = False
            for j in range(i, len(graph[v])):
                w = graph[v][j]
                if w not in index:
                    work.append((v, j + 1))
                    work.append((w, 0))
                    recurse = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if recurse:
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph[v]:
                    out.update(comp)
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
    return out


def compile_rules(rules: dict, root: str):
    """IR rules -> `ByteDFA` (no recursion) or `PushdownMatcher`. A grammar whose automaton would be too
    large (a big rule inlined at many places) is compiled as a pushdown matcher with every rule its own
    small DFA instead."""
    # a counted string (counter.py) and distinct-named members (distinct.py) are always rules of their own,
    # their frame states carrying run-time data; the members' value rule is called from the latter
    special = {n for n in reachable_rules(rules, root) if rules[n][0] in ("counted", "xkeys")}
    rec = recursive_rules(rules, root) | special | {r for n in special if rules[n][0] == "xkeys"
                                                      for r in _refs(rules[n], set())}
    if not productive(rules, root):
        raise GrammarError("the grammar matches nothing (its language is empty)")
    inline = set(rules) - rec
    try:
        if rec:
            return _pushdown(rules, root, rec, inline)
        nfa = _NFA(rules, inline)
        s, f = nfa.start(rules[root])
        table, cls, acc, _ = _determinize(nfa, s, f)
    except _TooLarge:
        every = reachable_rules(rules, root)
        if len(every) == 1:          # rule by rule would build the same automaton again
            raise
        return _pushdown(rules, root, every, set())
    table, acc = _minimize(table, acc)
    return ByteDFA(table[:, cls], acc)


def estimate_states(node, rules: dict, inline: set) -> int:
    """The NFA states ``_NFA.build`` makes for ``node`` (inlined rules expanded, calls free), computed
    without building: shared subtrees are sized once."""
    memo: dict[int, int] = {}
    keep = []

    def size(n) -> int:
        got = memo.get(id(n))
        if got is not None:
            return got
        kind = n[0]
        if kind == "b":
            out = 0
        elif kind == "seq":
            out = sum(size(m) for m in n[1]) + max(len(n[1]) - 1, 0)
        elif kind == "alt":
            out = sum(size(m) for m in n[1]) + 2 * len(n[1])
        elif kind == "rep":
            sub, lo, hi = size(n[1]), n[2], n[3]
            out = lo * (sub + 1) + ((sub + 3) if hi is None else (hi - lo) * (sub + 1))
        elif kind == "ref":
            out = 2 + size(rules[n[1]]) if n[1] in inline and n[1] in rules else 0
        elif kind == "list":
            items, sep = n[1], n[3]
            out = 3 * len(items) + sum(2 * size(m) for m in items) + len(items) * size(sep)
        elif kind == "dfa":
            out = len(n[1])
        elif kind == "clist":
            out = clist_states(n, size)
        else:
            out = 0
        memo[id(n)] = out
        keep.append(n)
        return out

    return size(node)


def clist_states(node, size) -> int:
    """NFA states `_NFA._counted_list` makes for ``node`` (``size``: the estimate of a subnode)."""
    _, items, required, sep, lo, hi, extra = node
    cap = hi if hi is not None else max(lo, 1)
    per = [size(m) + size(sep) + 2 for m in items]
    out = sum((min(i, cap) + 1) * (per[i] + 1) for i in range(len(items)))
    if extra is not None:
        out += (min(len(items), cap) + 2 + (hi or 1)) * (size(extra) + size(sep) + 2)
    return out


def clist_productive(node, ok) -> bool:
    """Whether some count of members meets the bounds of a ("clist", ...) node."""
    _, items, required, sep, lo, hi, extra = node
    if any(r and not ok(m) for m, r in zip(items, required)):
        return False
    n_req = sum(required)
    n_max = n_req + sum(1 for m, r in zip(items, required) if not r and ok(m))
    has_extra = extra is not None and ok(extra)
    if n_max + (1 if has_extra else 0) >= 2 and not ok(sep):
        n_max = min(n_max, 1)
        has_extra = has_extra and n_max == 0
    for c in range(n_req, n_max + 1):
        if hi is not None and c > hi:
            break
        if c >= lo or (has_extra and c == lo - 1 and (hi is None or c + 1 <= hi)):
            return True
    return False


def productive(rules: dict, root: str) -> bool:
    """Whether ``root`` matches at least one string (the least fixpoint of the productive rules)."""
    names = reachable_rules(rules, root)
    good: set = set()

    def ok(n) -> bool:
        kind = n[0]
        if kind == "b":
            return n[1] != 0
        if kind == "seq":
            return all(ok(m) for m in n[1])
        if kind == "alt":
            return any(ok(m) for m in n[1])
        if kind == "rep":
            return n[2] == 0 or ok(n[1])
        if kind == "ref":
            return n[1] in good
        if kind == "dfa":
            return any(n[2])                    # trimmed: an accepting state is reachable
        if kind == "counted":
            return True                         # product.counted_node: the start meets the bounds
        if kind == "xkeys":                     # members need a value; required listed ones theirs
            listed = n[6] if len(n) > 6 else ()
            return (n[4] == 0 or n[3] in good) and all(m[2] in good for m in listed if m[3])
        if kind == "clist":
            return clist_productive(n, ok)
        if kind == "list":
            items, required, sep = n[1], n[2], n[3]
            at_least_one = len(n) > 4 and n[4]
            if any(r and not ok(m) for m, r in zip(items, required)):
                return False
            if sum(required) >= 2 and not ok(sep):
                return False
            return not (at_least_one and not any(required)) or any(ok(m) for m in items)
        return False

    changed = True
    while changed:
        changed = False
        for name in names:
            if name not in good and ok(rules[name]):
                good.add(name)
                changed = True
    return root in good


def reachable_rules(rules: dict, root: str) -> set:
    seen, todo = set(), [root]
    while todo:
        r = todo.pop()
        if r not in seen:
            seen.add(r)
            todo.extend(_refs(rules[r], set()))
    return seen


def _pushdown(rules, root, rec, inline):
    names = set(rec) | {root}
    dfas = {}
    for name in names:
        if rules[name][0] == "counted":
            dfas[name] = CountedRule(rules[name])
            continue
        if rules[name][0] == "xkeys":
            dfas[name] = DistinctKeysRule(rules[name])
            continue
        nfa = _NFA(rules, inline - {name})
        s, f = nfa.start(rules[name])
        table, cls, acc, calls = _determinize(nfa, s, f)
        dfas[name] = _RuleDFA(table[:, cls], acc, calls)
    _check_left_recursion(dfas)
    matcher = PushdownMatcher(dfas, root)
    _probe(matcher)
    return matcher


def _probe(m: PushdownMatcher) -> None:
    """Ambiguity bounded at compile time where it shows early: walk the first PROBE_STATES pushdown
    states breadth-first (each over the bytes its top frames can read) and refuse the grammar if one of
    them needs more than MAX_STACKS parse stacks. Deeper blow-ups are caught per sequence at run time."""
    budget = _budget.current()
    seen, todo = {m.start}, [m.start]
    while todo and len(seen) < PROBE_STATES:
        state = todo.pop(0)
        budget.check_time()
        bytes_out = set()
        for name, s in {st[-1] for st in m._sets[state]}:
            row = m.rules[name].rows[s]
            bytes_out.update(b for b in range(256) if row[b])
        for b in sorted(bytes_out):
            nxt = m.step_byte(state, b)        # raises TooAmbiguous
            if nxt and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)


def _check_left_recursion(dfas: dict) -> None:
    """Refuse rules that can call themselves before reading a byte (the stack would grow forever)."""
    nullable = {n: d.accepting[1] for n, d in dfas.items()}
    changed = True
    while changed:          # a rule is nullable if an accepting state is reachable through nullable calls
        changed = False
        for n, d in dfas.items():
            if nullable[n]:
                continue
            seen, work = {1}, [1]
            while work:
                s = work.pop()
                if d.accepting[s]:
                    nullable[n] = changed = True
                    break
                for q, t in d.calls[s]:
                    if nullable[q] and t not in seen:
                        seen.add(t)
                        work.append(t)
    first: dict[str, set] = {}
    for n, d in dfas.items():
        seen, work, calls = {1}, [1], set()
        while work:
            s = work.pop()
            for q, t in d.calls[s]:
                calls.add(q)
                if nullable[q] and t not in seen:
                    seen.add(t)
                    work.append(t)
        first[n] = calls
    for n in dfas:
        seen, work = set(), list(first[n])
        while work:
            q = work.pop()
            if q == n:
                raise GrammarError(f"rule {n!r} is left-recursive (it can call itself before reading a byte)")
            if q not in seen:
                seen.add(q)
                work.extend(first.get(q, ()))
