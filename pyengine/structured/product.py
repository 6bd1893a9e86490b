"""S15 languages intersected: the product of byte DFAs, optionally with a character counter.

A JSON Schema string may carry several constraints at once (``format``, ``pattern``, ``minLength`` /
``maxLength``). Each of the first two is a regular language over the bytes of the JSON string body
(`regex.py` spelled through `json_schema.json_char_class`); the length bounds count *characters of the
decoded string* (code points, as JSON Schema does). `intersect` builds the product automaton of the
constraints' DFAs and, when bounds are given, of a character counter:

    body = intersect([dfa_of(format_ir), dfa_of(pattern_ir)], lexer=dfa_of(rep(JSON_CHAR, 0, None)),
                     lo=3, hi=40)          # -> ("dfa", ...) IR node, or ir.NOTHING when empty

The counter adds one when the lexer DFA (any sequence of JSON string characters) is at a character
boundary and reads a byte, so an escape (``\\n``, ``\\"``, ``\\u00e9``) and a multi-byte UTF-8 character each
count as one character, as they decode to one code point. The product is built breadth-first over the
reachable state tuples only, and the counter is dropped ("free") as soon as the bounds can no longer bind:
the count reached ``lo`` and the longest completion from here still fits under ``hi`` (for instance a
uuid, 36 characters, under ``maxLength: 64``). The result is trimmed (states that cannot reach acceptance
are removed, so a token mask never leads into a dead end) and minimized, and is embedded in the grammar as
one ``("dfa", ...)`` IR node (`ir.py`). Its size is bounded by ``limit`` states and by the time budget
(`budget.py`): past it, `GrammarTooLarge` names the limit.
"""
from __future__ import annotations

import numpy as np

from . import budget as _budget
from . import ir
from .automaton import ByteDFA, MAX_DFA_STATES, _minimize, _rows_id, compile_rules, minimize_by_labels
from .counter import INF, CountedRule
from .counter import remaining as _remaining
from .ir import GrammarError

MAX_STRING_STATES = 2048     # states of one string's automaton (it is embedded in the schema's DFA)
MAX_BUILT_STATES = 12288     # states built for it before minimization (which runs only past MAX_STRING_STATES:
                             # the schema's own compile minimizes the whole automaton anyway)
FREE = -1               # the counter value "the bounds can no longer bind"


class CounterTooLarge(_budget.GrammarTooLarge):
    """The counted product past the state limits (the plain intersection fitted); ``states``: the
    minimized size when it was built (0 when the build itself overflowed)."""

    def __init__(self, message: str, keyword: str | None = None, states: int = 0, suggest: int = 0):
        super().__init__(message, keyword)
        self.states = states
        self.suggest = suggest          # a cap that should fit (0: none known)


def dfa_of(node) -> ByteDFA:
    """The minimized DFA of a regular IR node (no rule references)."""
    automaton = compile_rules({"root": node}, "root")
    if not isinstance(automaton, ByteDFA):
        raise _budget.GrammarTooLarge(f"grammar too large (a string constraint needs more than {MAX_DFA_STATES} "
                                      "DFA states)")
    return automaton


def _classes(tables):
    """Byte classes no table separates: (class per byte, representative byte per class, mask per class)."""
    ids = np.stack([_rows_id(np.ascontiguousarray(t.T)) for t in tables], axis=1)
    cls = _rows_id(ids)
    n = int(cls.max()) + 1
    reps = [0] * n
    masks = [0] * n
    for b in range(255, -1, -1):
        reps[cls[b]] = b
        masks[cls[b]] |= 1 << b
    return cls, reps, masks


def _minimize_labelled(rows, acc, boundary):
    """Moore's refinement of the uncounted product with (accepting, at a character boundary) as the
    initial labels, so every counter value copies the fewest states (a wide class such as ``\\w`` spells
    many equivalent mid-character states). State 0 stays dead, 1 the start."""
    label = np.array(acc, dtype=np.int32) * 2 + np.array(boundary, dtype=np.int32)
    new_table, reps = minimize_by_labels(np.array(rows, dtype=np.int32), label)
    return new_table.tolist(), [bool(acc[r]) for r in reps.tolist()], [int(boundary[r]) for r in reps.tolist()]


def length_range(dfa: ByteDFA, lexer: ByteDFA) -> tuple[int, int]:
    """(fewest, most) characters of the strings of ``dfa``'s language (INF: unbounded or empty)."""
    tables = [dfa.table, lexer.table]
    _, reps, _ = _classes(tables)
    rows = [dfa.table[:, reps].tolist(), lexer.table[:, reps].tolist()]
    index, tuples, prow, todo = {(1, 1): 1}, [None, (1, 1)], [[0] * len(reps), None], [1]
    while todo:
        p = todo.pop()
        a, b = tuples[p]
        row = []
        for c in range(len(reps)):
            nxt = (rows[0][a][c], rows[1][b][c])
            if not nxt[0] or not nxt[1]:
                row.append(0)
                continue
            j = index.get(nxt)
            if j is None:
                j = index[nxt] = len(tuples)
                tuples.append(nxt)
                prow.append(None)
                todo.append(j)
            row.append(j)
        prow[p] = row
    acc = [False] + [bool(dfa.accepting[a]) and bool(lexer.accepting[b]) for a, b in tuples[1:]]
    boundary = [0] + [int(lexer.accepting[b]) for _, b in tuples[1:]]
    fewest, most = _remaining(prow, acc, boundary)
    return fewest[1], most[1]


def intersect(dfas: list[ByteDFA], lexer: ByteDFA | None = None, lo: int = 0, hi: int | None = None,
              limit: int = MAX_BUILT_STATES, max_states: int = MAX_STRING_STATES, counted: bool = False):
    """The IR node of the intersection of the DFAs' languages, restricted (when ``lexer`` is given) to
    strings of ``lo``..``hi`` characters; ``ir.NOTHING`` when it is empty. At most ``limit`` states are
    built and ``max_states`` kept after minimization (past either: `GrammarTooLarge`). With ``counted``
    the bounds are left to the run-time counter: a ("counted", ...) node (`counter.py`), whose size is
    that of the uncounted product whatever the bounds."""
    budget = _budget.current()
    parts = list(dfas) + ([lexer] if lexer is not None else [])
    tables = [d.table for d in parts]
    cls, reps, cmasks = _classes(tables)
    rows = [d.table[:, reps].tolist() for d in parts]
    accs = [d.accepting.tolist() for d in parts]
    k = len(parts)
    # 1. the plain product (no counter): reachable tuples
    index = {tuple([1] * k): 1}
    tuples = [None, tuple([1] * k)]
    prow = [None, None]
    todo = [1]
    n_cls = len(reps)
    while todo:
        p = todo.pop()
        if not p & 1023:
            budget.check_time()
        cur = tuples[p]
        row = [0] * n_cls
        for c in range(n_cls):
            nxt = tuple(rows[i][cur[i]][c] for i in range(k))
            if 0 in nxt:
                continue
            j = index.get(nxt)
            if j is None:
                j = index[nxt] = len(tuples)
                if j > limit:
                    raise _budget.GrammarTooLarge(f"grammar too large (the intersection needs more than {limit} "
                                                  "DFA states)")
                tuples.append(nxt)
                prow.append(None)
                todo.append(j)
            row[c] = j
        prow[p] = row
    prow[0] = [0] * n_cls
    acc = [False] + [all(accs[i][t[i]] for i in range(k)) for t in tuples[1:]]
    if lexer is None:
        return _node(prow, acc, cmasks)
    boundary = [0] + [int(accs[k - 1][t[k - 1]]) for t in tuples[1:]]
    prow, acc, boundary = _minimize_labelled(prow, acc, boundary)
    fewest, most = _remaining(prow, acc, boundary)
    if fewest[1] >= INF:
        return ir.NOTHING
    if counted:
        return _counted_node(prow, acc, boundary, fewest, cmasks, lo, hi, max_states)
    # states on or before a cycle carry every count the bounds tell apart: past the limit at once (the
    # caller then counts at run time: counted=True)
    looping = sum(1 for p in range(1, len(prow)) if fewest[p] < INF and most[p] >= INF)
    span = (hi - lo) if hi is not None else lo
    if looping and span * looping > max_states:
        raise CounterTooLarge(f"grammar too large (the length-bounded string needs about {span * looping} "
                              f"DFA states, more than {max_states})", suggest=lo + (max_states * 9 // 10) // looping)
    # 2. the counter: states (p, count) with count FREE once the bounds cannot bind
    def norm(p, c):
        if c == FREE:
            return c
        if (hi is not None and c + fewest[p] > hi) or c + most[p] < lo:
            return None                     # the bounds cannot be met from here
        if c >= lo and (hi is None or c + most[p] <= hi):
            return FREE
        return c

    c0 = norm(1, 0)
    if c0 is None:
        return ir.NOTHING
    index2 = {(1, c0): 1}
    states = [None, (1, c0)]
    crow = [[0] * n_cls, None]
    todo = [1]
    while todo:
        q = todo.pop()
        if not q & 1023:
            budget.check_time()
        p, c = states[q]
        row = [0] * n_cls
        w = boundary[p]
        for x, p2 in enumerate(prow[p]):
            if not p2 or fewest[p2] >= INF:
                continue
            c2 = norm(p2, c if c == FREE else c + w)
            if c2 is None:
                continue
            key = (p2, c2)
            j = index2.get(key)
            if j is None:
                j = index2[key] = len(states)
                if j > limit:
                    raise CounterTooLarge(f"grammar too large (the length-bounded string needs more than {limit} "
                                          "DFA states while building)")
                states.append(key)
                crow.append(None)
                todo.append(j)
            row[x] = j
        crow[q] = row
    cacc = [False] + [acc[p] and (c == FREE or (c >= lo and (hi is None or c <= hi))) for p, c in states[1:]]
    node = _node(crow, cacc, cmasks, minimize=len(crow) > max_states)
    if node != ir.NOTHING and len(node[1]) > max_states:
        raise CounterTooLarge(f"grammar too large (the length-bounded string needs {len(node[1])} DFA states, "
                              f"more than {max_states})", states=len(node[1]))
    return node


def _counted_node(rows, acc, boundary, fewest, cmasks, lo: int, hi: int | None, max_states: int):
    """The uncounted product, trimmed, as ("counted", edges, accepting, boundary, lo, hi) (ir.py), or
    ir.NOTHING when no string meets the bounds; the plain DFA node when the bounds cannot bind at all."""
    keep = [0] + [s for s in range(1, len(rows)) if fewest[s] < INF]
    if len(keep) - 1 > max_states:
        raise _budget.GrammarTooLarge(f"grammar too large (the string needs {len(keep) - 1} DFA states, "
                                      f"more than {max_states})")
    new = [0] * len(rows)
    for i, s in enumerate(keep):
        new[s] = i
    table = np.array([[new[t] for t in rows[s]] for s in keep], dtype=np.int32)
    table[0] = 0
    node = dfa_node(table, np.array([acc[s] for s in keep], dtype=bool), cmasks)
    node = ("counted", node[1], node[2], tuple(int(boundary[s]) for s in keep[1:]), int(lo),
            None if hi is None else int(hi))
    rule = CountedRule(node)
    if not rule.start_ok():
        return ir.NOTHING
    if rule.is_free(1):
        return ("dfa", node[1], node[2])
    return node


def _node(rows, acc, cmasks, minimize: bool = True):
    """Trim (keep states that reach acceptance), minimize, and spell as a ("dfa", ...) IR node."""
    n = len(rows)
    pred = [[] for _ in range(n)]
    for s in range(1, n):
        for t in rows[s]:
            if t:
                pred[t].append(s)
    live = [False] * n
    work = [s for s in range(1, n) if acc[s]]
    for s in work:
        live[s] = True
    while work:
        t = work.pop()
        for s in pred[t]:
            if not live[s]:
                live[s] = True
                work.append(s)
    if not live[1]:
        return ir.NOTHING
    table = np.array([[t if live[t] else 0 for t in r] if live[s] else [0] * len(r)
                      for s, r in enumerate(rows)], dtype=np.int32)
    accepting = np.array(acc, dtype=bool)
    if minimize:
        table, accepting = _minimize(table, accepting)
    else:                           # renumber the live states (dead 0, start 1)
        keep = [0] + [s for s in range(1, n) if live[s]]
        new = np.zeros(n, dtype=np.int32)
        new[keep] = np.arange(len(keep), dtype=np.int32)
        table, accepting = new[table[keep]], accepting[keep]
    return dfa_node(table, accepting, cmasks)


def dfa_node(table: np.ndarray, accepting: np.ndarray, cmasks) -> ir.GrammarNode:
    """A trimmed DFA (state 0 dead, 1 start; columns are byte classes with byte masks ``cmasks``) as the
    IR node ("dfa", edges, accepting): per state 1..n-1 (renumbered 0..n-2) its (byte mask, target)
    edges, one per target."""
    edges = []
    for s in range(1, table.shape[0]):
        by_target: dict[int, int] = {}
        for c, t in enumerate(table[s].tolist()):
            if t:
                by_target[t - 1] = by_target.get(t - 1, 0) | cmasks[c]
        edges.append(tuple(sorted((m, t) for t, m in by_target.items())))
    if len(edges) > 0 and not any(accepting[1:]):
        raise GrammarError("internal: an untrimmed DFA")
    return ("dfa", tuple(edges), tuple(bool(a) for a in accepting[1:].tolist()))
