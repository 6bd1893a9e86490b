"""The BPE merge loop shared by byte-level BPE and SentencePiece-style BPE (S02).

A word starts as a list of symbol ids. Repeatedly, the adjacent pair with the best (lowest) merge rank
is fused into one symbol, ties going to the leftmost pair -- exactly HF tokenizers' `Word::merge_all`.
A heap of candidate pairs plus a doubly linked list of symbols makes a word of n symbols cost
O(n log n), so a paragraph that is one long "word" (SentencePiece) stays fast. Heap entries go stale when
a neighbour merges first; we detect that by re-checking that the pair still yields the same new id.
"""
from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import Callable, Optional

# pair_info(left_id, right_id) -> (rank, merged_id), or None when the pair does not merge.
PairInfo = Callable[[int, int], Optional[tuple]]


def bpe_merge(ids: list[int], pair_info: PairInfo) -> list[int]:
    """Apply merges to one word's symbol ids until no adjacent pair merges."""
    n = len(ids)
    if n < 2:
        return list(ids)
    heap = []
    for i in range(n - 1):
        m = pair_info(ids[i], ids[i + 1])
        if m is not None:
            heap.append((m[0], i, m[1]))
    if not heap:
        return list(ids)
    heapify(heap)
    sym = list(ids)
    nxt = list(range(1, n + 1))       # n means "no next symbol"
    prv = list(range(-1, n - 1))      # -1 means "no previous symbol"
    alive = [True] * n
    while heap:
        _, pos, new_id = heappop(heap)
        if not alive[pos]:
            continue
        right = nxt[pos]
        if right >= n:
            continue
        m = pair_info(sym[pos], sym[right])
        if m is None or m[1] != new_id:   # stale: a neighbour merged first
            continue
        sym[pos] = new_id
        alive[right] = False
        after = nxt[right]
        nxt[pos] = after
        if after < n:
            prv[after] = pos
            m = pair_info(new_id, sym[after])
            if m is not None:
                heappush(heap, (m[0], pos, m[1]))
        before = prv[pos]
        if before >= 0:
            m = pair_info(sym[before], new_id)
            if m is not None:
                heappush(heap, (m[0], before, m[1]))
    return [s for s, a in zip(sym, alive) if a]
