"""S14: drafters. A proposer guesses the next k tokens of a sequence cheaply; the model then checks them all in
one forward pass (see `pyengine/layers/rejection_sampler.py`).

Every proposer has one method, ``propose(seqs, ks, rngs) -> [(draft ids, draft probabilities or None)]``:
for each sequence at most ``ks[i]`` ids, and either the (len, V) distributions q the ids were drawn from or None
when the ids are certain guesses (q one-hot). ``free`` says whether proposing costs a forward pass (the
engine's back-off only probes an expensive proposer now and then). ``release(seq)`` forgets a sequence.

- `NgramProposer` (prompt lookup): the last n tokens of the sequence, n from ``prompt_lookup_max`` down to
  ``prompt_lookup_min``, are searched for earlier in its own prompt and output; what followed the latest
  earlier occurrence is the guess. No model, no state: it shines when the output repeats its input (code
  edits, summaries quoting the passage).
"""
from __future__ import annotations

import numpy as np


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix
    (of n_max..n_min tokens) of ``tokens``; [] if none matches."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = tokens[L - n:]
        # windows starting at 0..L-n-1 (each followed by at least one token): all n positions must agree
        hit = tokens[:L - n] == pattern[0]
        for j in range(1, n):
            hit &= tokens[j:L - n + j] == pattern[j]
        starts = np.flatnonzero(hit)
        if starts.size:
            s = int(starts[-1]) + n
            return tokens[s:s + k].tolist()
    return []


class NgramProposer:
    free = True

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, seqs, ks, rngs=None) -> list[tuple[list[int], None]]:
        out = []
        for seq, k in zip(seqs, ks):
            ids = ngram_lookup(np.asarray(seq.token_ids, dtype=np.int64), k, self.n_min, self.n_max) if k else []
            out.append((ids, None))
        return out

    def release(self, seq) -> None:
        pass
