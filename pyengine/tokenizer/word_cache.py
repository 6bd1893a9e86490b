"""A memo with a byte budget, for the tokenizer's per-word results and merge ranks (S02).

Natural text repeats words, so BPE memoizes word -> ids. Bounding only the entry count is not enough: a
client can send distinct megabyte-long "words" and each entry then holds megabytes. Here every entry is
charged an estimate of its size, words longer than `max_key_chars` are never stored (they do not repeat,
and one alone could fill the budget), and the oldest entries go first once the budget is spent.
"""
from __future__ import annotations

# CPython sizes, rounded up: a str header (~50 B) plus up to 4 B a character, a list header (~56 B) plus
# 8 B a slot, and the dict entry (~100 B with its share of the table).
ENTRY_OVERHEAD = 210
# Word memos (bpe.py, spm.py): 32 MiB holds ~130k typical entries (the old count bound was 200k); longer
# words are not memoized (they rarely repeat, and a client's megabyte "word" must not stay resident).
WORD_CACHE_BYTES = 32 << 20
WORD_CACHE_MAX_CHARS = 256


def ids_cost(key: str, ids) -> int:
    """Estimated bytes of one word -> ids entry."""
    return ENTRY_OVERHEAD + 4 * len(key) + 8 * len(ids)


class BoundedCache:
    """dict-like memo: `data` is a plain dict for the hot path's `data.get(key)`; `put` keeps the total
    estimated size under `max_bytes` by evicting the oldest entries (insertion order)."""

    def __init__(self, max_bytes: int, max_key_chars: int | None = None, cost=ids_cost):
        self.data: dict = {}
        self.max_bytes = max_bytes
        self.max_key_chars = max_key_chars
        self.cost = cost
        self.nbytes = 0
        self._costs: dict = {}

    def get(self, key):
        return self.data.get(key)

    def put(self, key, value) -> None:
        if key in self.data or (self.max_key_chars is not None and len(key) > self.max_key_chars):
            return
        c = self.cost(key, value)
        if c > self.max_bytes:
            return
        while self.nbytes + c > self.max_bytes and self.data:
            old = next(iter(self.data))
            del self.data[old]
            self.nbytes -= self._costs.pop(old)
        self.data[key] = value
        self._costs[key] = c
        self.nbytes += c

    def __len__(self) -> int:
        return len(self.data)

    def __contains__(self, key) -> bool:
        return key in self.data

    def clear(self) -> None:
        self.data.clear()
        self._costs.clear()
        self.nbytes = 0
