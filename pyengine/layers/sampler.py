"""S04 sampling: turn a row of logits into the next token.

Each logits processor is a plain function ``logits -> logits`` over the last axis (works on (V,) and
(B, V)), returns a new array, and marks removed tokens with -inf. The order of the pipeline is
the one HF transformers uses:

    logit_bias -> repetition penalty -> presence/frequency penalties      (shape the scores)
    -> greedy argmax, or: temperature -> top-k -> top-p -> min-p -> draw   (shape the distribution)

`Sampler.sample` runs that pipeline over a batch where every row has its own `SamplingParams` and
its own `np.random.Generator`. Logprobs reported back are those of the *raw* model distribution
(log-softmax of the unprocessed logits), as vLLM does by default.

The sampled path follows the sampling law of `docs/sampling.md`, which `ts-mini/src/17_sampler.ts`
implements too: weights come from `law_exp` (only +, -, *, floor and exact scaling by powers of two,
so every IEEE-754 runtime gets the same bits), every sum is sequential in float64 (`np.cumsum`, never
the pairwise `np.sum`), and one uniform double per token walks the kept tokens in ascending id order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pyengine.sampling_params import SamplingParams

NEG_INF = -np.inf
TOP_P_CANDIDATES = 512     # top-p first tries to find the nucleus among this many tokens


# --- distributions ------------------------------------------------------------------------------
def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p over the last axis in float64 (max subtracted so exp never overflows)."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def softmax(logits: np.ndarray) -> np.ndarray:
    """p over the last axis in float64; -inf logits get probability exactly 0."""
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


# --- the law's exponential -----------------------------------------------------------------------
# exp(d) for d <= 0 from IEEE-754 +, -, * and floor only (no libm: np.exp and JS Math.exp differ in the
# last bit now and then). d = k ln2 + r with |r| <= ln2/2 (ln2 split in a high part with trailing zero
# bits, so k * LN2_HI is exact), e^r by Horner over the Taylor series to r^13 (relative error < 1e-16),
# then scaled by 2^k exactly. Below LAW_EXP_FLOOR the weight is 0 (e^-700 is 1e-304 of the top token).
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e+00
LAW_EXP_FLOOR = -700.0
_EXP_COEFS = tuple(1.0 / math.factorial(n) for n in range(13, -1, -1))   # 1/13! ... 1/1!, 1/0!


def law_exp(d: np.ndarray) -> np.ndarray:
    """exp(d) for d <= 0 (float64), bit-identical in NumPy, Pyodide and ts-mini's `lawExp`; d < -700 -> 0."""
    d = np.array(d, dtype=np.float64)                  # a copy: worked on in place
    dead = ~(d >= LAW_EXP_FLOOR)                       # NaN and -inf included
    d[dead] = 0.0
    k = d * INV_LN2
    k += 0.5
    np.floor(k, out=k)
    t = k * LN2_HI
    np.subtract(d, t, out=d)                           # r = (d - k * LN2_HI) - k * LN2_LO
    np.multiply(k, LN2_LO, out=t)
    d -= t
    p = np.full_like(d, _EXP_COEFS[0])
    for c in _EXP_COEFS[1:]:
        p *= d
        p += c
    p = np.ldexp(p, k.astype(np.int32), out=p)
    p[dead] = 0.0
    return p


def law_weights(x: np.ndarray) -> np.ndarray:
    """Unnormalised probabilities of one row of scores: law_exp(x - max x); the top token weighs exactly 1."""
    x = np.asarray(x, dtype=np.float64)
    return law_exp(x - np.max(x))


def seq_sum(w: np.ndarray) -> float:
    """The law's sum: left to right in float64 (np.sum is pairwise and would round differently)."""
    return float(np.cumsum(w)[-1]) if len(w) else 0.0


# --- logits processors --------------------------------------------------------------------------
def apply_logit_bias(logits: np.ndarray, bias: dict[int, float]) -> np.ndarray:
    """Add ``bias[id]`` to the logit of each listed token (OpenAI ``logit_bias``)."""
    out = np.array(logits, dtype=np.float64)
    if bias:
        ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        out[..., ids] += np.fromiter(bias.values(), dtype=np.float64, count=len(bias))
    return out


def apply_repetition_penalty(logits: np.ndarray, seen_ids, penalty: float) -> np.ndarray:
    """HF/vLLM (CTRL paper) repetition penalty on every token seen in prompt + output.

    A positive logit is divided by ``penalty`` and a negative one multiplied by it, so for
    penalty > 1 a seen token always becomes less likely, whatever the sign of its logit.
    """
    out = np.array(logits, dtype=np.float64)
    if penalty != 1.0 and len(seen_ids):
        ids = np.unique(np.asarray(seen_ids, dtype=np.int64))
        sel = out[..., ids]
        out[..., ids] = np.where(sel > 0, sel / penalty, sel * penalty)
    return out


def apply_presence_frequency_penalties(logits: np.ndarray, output_ids, presence: float,
                                       frequency: float) -> np.ndarray:
    """OpenAI penalties over the *generated* tokens only (as vLLM):
    ``logit[t] -= frequency * count(t) + presence * (count(t) > 0)``."""
    out = np.array(logits, dtype=np.float64)
    if (presence or frequency) and len(output_ids):
        ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        out[..., ids] -= frequency * counts + presence
    return out


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Divide by the temperature: < 1 sharpens, > 1 flattens. Greedy (T ~ 0) never gets here."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive here (greedy is argmax), got {temperature}")
    return np.asarray(logits, dtype=np.float64) / temperature


def apply_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k highest logits (ties with the k-th are kept too); k <= 0 or k >= V: no-op."""
    x = np.asarray(logits, dtype=np.float64)
    V = x.shape[-1]
    if k <= 0 or k >= V:
        return x.copy()
    kth = np.partition(x, V - k, axis=-1)[..., V - k:V - k + 1]   # k-th largest per row
    return np.where(x < kth, NEG_INF, x)


def apply_top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Nucleus: keep the smallest set of most likely tokens whose probability sums to >= p.

    A token is kept when the mass of the strictly more likely tokens is still < p, so the top
    token always survives and the token that crosses p is included. Tokens tied with the last kept
    one are kept too (the set does not depend on how a sort breaks ties). The law's arithmetic
    (docs/sampling.md): weights w = law_exp(x - max), target p * (sum of w in id order), the mass
    before each token summed left to right over w sorted descending.
    """
    x = np.asarray(logits, dtype=np.float64)
    if p >= 1.0:
        return x.copy()
    if x.ndim > 1:
        return np.stack([apply_top_p(row, p) for row in x])
    w = law_weights(x)
    return np.where(w >= top_p_cutoff(w, p), x, NEG_INF)


def top_p_cutoff(w: np.ndarray, p: float) -> float:
    """The weight of the last token the nucleus keeps (every w >= it is kept), for weights ``w`` (1-D)."""
    target = p * seq_sum(w)
    V = len(w)
    m = TOP_P_CANDIDATES
    while True:
        # The nucleus is usually far smaller than V: the m largest weights sorted give the same exclusive
        # prefix sums as a full sort, so when the crossing lies inside them the cutoff is the full sort's.
        top = w if 4 * m >= V else np.partition(w, V - m)[V - m:]
        desc = -np.sort(-top)
        before = np.concatenate(([0.0], np.cumsum(desc)[:-1]))
        n_keep = int(np.count_nonzero(before < target))
        if n_keep < len(desc) or len(top) == V:
            return float(desc[max(n_keep, 1) - 1])
        m *= 8


def apply_min_p(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Keep tokens with p >= min_p * p_max (vLLM's rule, in probability space): law_exp(x - max) >= min_p,
    the top token's weight being exactly 1."""
    x = np.asarray(logits, dtype=np.float64)
    if min_p <= 0.0:
        return x.copy()
    return np.where(law_exp(x - np.max(x, axis=-1, keepdims=True)) >= min_p, x, NEG_INF)


def apply_allowed_mask(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """S15 grammar constraint: -inf on every token whose ``allowed`` entry is False (a boolean mask over
    the vocabulary; logits columns past its end are padding and are removed too)."""
    x = np.asarray(logits, dtype=np.float64)
    V = x.shape[-1]
    if len(allowed) < V:
        allowed = np.concatenate([allowed, np.zeros(V - len(allowed), dtype=bool)])
    return np.where(allowed[:V], x, NEG_INF)


def sample_from_logits(logits: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index of a 1-D logits vector by inverting the CDF with a single uniform number (the law:
    weights law_exp(x - max), cumulated left to right in float64, the first index whose running sum
    exceeds u * total)."""
    return law_draw(law_weights(logits), rng.random())


def law_draw(w: np.ndarray, u: float) -> int:
    """The law's walk: the first index whose running (left-to-right, float64) sum of ``w`` exceeds
    ``u * total``; if rounding put u * total on the total, the last index of positive weight."""
    cdf = np.cumsum(w)
    idx = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    if idx >= len(w) or w[idx] <= 0.0:
        idx = int(np.flatnonzero(w > 0)[-1])
    return idx


def process_logits(logits: np.ndarray, params: SamplingParams, prompt_ids=(), output_ids=()) -> np.ndarray:
    """The score-shaping half of the pipeline (bias and penalties) on one row, float64."""
    x = np.array(logits, dtype=np.float64)
    if params.logit_bias:
        x = apply_logit_bias(x, params.logit_bias)
    if params.repetition_penalty != 1.0:
        seen = np.concatenate([np.asarray(prompt_ids, dtype=np.int64), np.asarray(output_ids, dtype=np.int64)])
        x = apply_repetition_penalty(x, seen, params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        x = apply_presence_frequency_penalties(x, output_ids, params.presence_penalty, params.frequency_penalty)
    return x


def sample_row(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None,
               prompt_ids=(), output_ids=()) -> int:
    """Full pipeline for one row of logits."""
    x = process_logits(logits, params, prompt_ids, output_ids)
    if params.greedy:
        return int(np.argmax(x))
    if rng is None:
        raise ValueError("a random generator is required for temperature > 0")
    x, live = distribution_logits(x, params)
    j = sample_from_logits(x, rng)
    return int(live[j]) if live is not None else j


def distribution_logits(x: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray | None]:
    """The distribution-shaping half (temperature -> top-k -> top-p -> min-p) of processed scores ``x``:
    (logits over the live tokens, their ids or None when all V are live)."""
    x = apply_temperature(x, params.temperature)
    # After each truncation only live tokens matter: compacting to them makes the next steps work on
    # k (or the nucleus) values instead of V. `live` maps compact positions back to token ids.
    live = None
    if 0 < params.top_k < x.shape[-1]:
        x, live = _compact(apply_top_k(x, params.top_k), live)
    if params.top_p < 1.0:
        x, live = _compact(apply_top_p(x, params.top_p), live)
    return apply_min_p(x, params.min_p), live


def _compact(x: np.ndarray, live: np.ndarray | None):
    keep = np.flatnonzero(x != NEG_INF)
    if len(keep) == len(x):
        return x, live
    return x[keep], (keep if live is None else live[keep])


# --- logprobs -----------------------------------------------------------------------------------
@dataclass
class SampleLogprobs:
    """Raw-distribution logprobs for one sampled token."""
    token_id: int
    logprob: float              # log p(token_id) under the unprocessed logits
    rank: int                   # 1 = most likely token
    top_ids: list[int]          # the `params.logprobs` most likely ids, best first
    top_logprobs: list[float]

    def as_dict(self) -> dict[int, float]:
        """{id: logprob} for the top-n plus the sampled token (vLLM's per-position shape)."""
        d = dict(zip(self.top_ids, self.top_logprobs))
        d[self.token_id] = self.logprob
        return d


def token_logprobs(logits: np.ndarray, token_id: int, top_n: int) -> SampleLogprobs:
    """Logprob and rank of `token_id` and the top-n (id, logprob) of one raw logits row."""
    lp = log_softmax(logits)
    chosen = lp[token_id]
    rank = int(np.count_nonzero(lp > chosen)) + 1
    top_ids: list[int] = []
    top_lps: list[float] = []
    if top_n > 0:
        n = min(top_n, lp.shape[-1])
        cand = np.argpartition(-lp, n - 1)[:n]
        cand = cand[np.lexsort((cand, -lp[cand]))]     # by logprob desc, then id asc: deterministic
        top_ids = [int(i) for i in cand]
        top_lps = [float(lp[i]) for i in cand]
    return SampleLogprobs(int(token_id), float(chosen), rank, top_ids, top_lps)


# --- the batch sampler --------------------------------------------------------------------------
def make_rng(params: SamplingParams, engine_rng: np.random.Generator, index: int = 0) -> np.random.Generator:
    """The per-sequence generator: from `params.seed` (choice `index` of n gets its own stream, and
    choice 0 equals a plain seed), else a child of the engine's generator."""
    if params.seed is not None:
        if index == 0:
            return np.random.default_rng(params.seed)
        return np.random.default_rng(np.random.SeedSequence(params.seed, spawn_key=(index,)))
    return engine_rng.spawn(1)[0]


class Sampler:
    """Samples one token per row of a (B, V) logits batch, each row with its own params and rng."""

    def sample(self, logits: np.ndarray, params: list[SamplingParams], prompt_ids: list,
               output_ids: list, rngs: list, allowed: list | None = None,
               token_masks: list | None = None) -> tuple[np.ndarray, list[SampleLogprobs | None]]:
        """Returns token ids (B,) int64 and per row a `SampleLogprobs` (when params.logprobs is not
        None) or None. `rngs[i]` may be None for greedy rows; the logits are only read. ``allowed[i]``
        (S15): a boolean token mask from the row's grammar, or None for an unconstrained row (only the
        constrained rows pay for masking). ``token_masks[i]`` (issue 32): the row's `TokenMasks`
        (allowed_token_ids, bad_words, min_tokens, thinking budget; layers/token_masks.py) or None."""
        logits = np.asarray(logits)
        if logits.ndim != 2:
            raise ValueError(f"logits must be (batch, vocab), got shape {logits.shape}")
        B, V = logits.shape
        for name, seq in (("params", params), ("prompt_ids", prompt_ids), ("output_ids", output_ids),
                          ("rngs", rngs)):
            if len(seq) != B:
                raise ValueError(f"{name} has {len(seq)} entries for a batch of {B} logits rows")
        tokens = np.empty(B, dtype=np.int64)
        # Plain greedy rows (no bias/penalties) need no copy: one argmax over all of them.
        if allowed is not None and len(allowed) != B:
            raise ValueError(f"allowed has {len(allowed)} entries for a batch of {B} logits rows")
        masks = allowed if allowed is not None else [None] * B
        extra = token_masks if token_masks is not None else [None] * B
        if len(extra) != B:
            raise ValueError(f"token_masks has {len(extra)} entries for a batch of {B} logits rows")
        plain = [i for i, p in enumerate(params)
                 if p.greedy and not p.logit_bias and not p.has_penalties and masks[i] is None and extra[i] is None]
        if len(plain) == B:
            tokens[:] = np.argmax(logits, axis=-1)              # all greedy: no (B, V) copy (out= needs intp:
                                                                # int32 on wasm32)
        elif plain:
            tokens[plain] = np.argmax(logits[plain], axis=-1)
        plain_set = set(plain)
        for i, p in enumerate(params):
            if i not in plain_set:
                row = logits[i] if masks[i] is None else apply_allowed_mask(logits[i], masks[i])
                if extra[i] is not None:        # the law's step 4, beside the grammar's mask
                    row = extra[i].apply(row, output_ids[i])
                tokens[i] = sample_row(row, p, rngs[i], prompt_ids[i], output_ids[i])
        infos: list[SampleLogprobs | None] = [
            token_logprobs(logits[i], int(tokens[i]), p.logprobs) if p.logprobs is not None else None
            for i, p in enumerate(params)]
        return tokens, infos
