"""S08: perplexity and KL divergence -- where the error of fewer bits lands, as numbers.

llama.cpp's method (``llama-perplexity``), so the figures compare:
- the text is tokenized once (BOS only if the model's file asks for it);
- it is cut into non-overlapping windows of ``ctx`` tokens (the tail that does not fill a window is dropped);
  when the model adds BOS, the first token of every window is replaced by BOS;
- each window is one fresh sequence; only its second half is scored (every scored token has at least ctx/2
  tokens of context): the logits at positions ctx/2 .. ctx-2 predict tokens ctx/2+1 .. ctx-1;
- PPL = exp(mean NLL) over all scored tokens, with the standard error of the mean NLL carried through the
  exponential: err(PPL) = PPL * sqrt((E[nll^2] - E[nll]^2) / (N - 1)).

KL divergence: a reference run (``save_base``) stores the log-probabilities of every scored position; a run
of another configuration (quantized weights or KV cache) is compared position by position: KL(base || this),
whether both pick the same top token, and percentiles of the KL. The log-probabilities are stored as uint16
per vocabulary entry with a float32 (min, scale) per position (as llama.cpp does; our own file layout,
``KLD_MAGIC``): values below max - ``LOGPROB_RANGE`` are clamped there (probabilities < 1e-13).

Plain functions over arrays; the model is anything with ``run(ForwardBatch) -> logits`` (a ModelRunner).
"""
from __future__ import annotations

import math
import struct
from typing import BinaryIO, Callable, Iterator, NamedTuple

import numpy as np

KLD_MAGIC = b"PYEKLD01"
LOGPROB_RANGE = 30.0        # log-prob span kept per position: exp(-30) ~ 1e-13, below any probability that matters
_ROWS = 64                  # logits rows turned into log-probs at a time (float64 temporaries stay small)


def windows(token_ids, ctx: int, bos_token_id: int | None = None) -> list[np.ndarray]:
    """The non-overlapping ``ctx``-token windows of a token stream; with ``bos_token_id`` (the model adds BOS)
    each window's first token is replaced by it, as llama-perplexity does."""
    if ctx < 4:
        raise ValueError(f"ctx must be at least 4 tokens, got {ctx}")
    ids = np.asarray(token_ids, dtype=np.int64)
    n = len(ids) // ctx
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens: fewer than one window of ctx={ctx}")
    out = []
    for i in range(n):
        w = ids[i * ctx:(i + 1) * ctx].copy()
        if bos_token_id is not None:
            w[0] = bos_token_id
        out.append(w)
    return out


def scored_range(ctx: int) -> tuple[int, int]:
    """(first, last + 1) logits rows scored in a window: the second half, each predicting the next token."""
    return ctx // 2, ctx - 1


def window_logits(runner, window: np.ndarray) -> np.ndarray:
    """Logits (n_scored, V) of a window's scored rows, as a fresh sequence (blocks 0, 1, ... of the runner's
    cache), prefilled in chunks of the runner's max_num_batched_tokens."""
    first, last = scored_range(len(window))
    step = runner.max_num_batched_tokens
    parts = []
    for start in range(0, len(window), step):
        chunk = window[start:start + step]
        batch = runner.contiguous_batch(chunk, start, logits_all=True)
        rows = np.arange(max(first, start), min(last, start + len(chunk))) - start
        if len(rows) == 0:
            rows = np.array([len(chunk) - 1])     # the runner needs some logits row; this one is not scored
            runner.run(_with_rows(batch, rows))
            continue
        parts.append(np.array(runner.run(_with_rows(batch, rows))))   # copy: the arena view is reused
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _with_rows(batch, rows: np.ndarray):
    batch.logits_indices = np.asarray(rows, dtype=np.int64)
    return batch


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (the NLL of a 49152-way softmax needs more than float32's sum)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood (float64) of each target token under its logits row."""
    out = np.empty(len(targets), np.float64)
    for r in range(0, len(targets), _ROWS):
        lp = log_softmax(logits[r:r + _ROWS])
        out[r:r + _ROWS] = -lp[np.arange(len(lp)), targets[r:r + _ROWS]]
    return out


class PPL(NamedTuple):
    ppl: float
    err: float          # standard error of the PPL estimate
    n_tokens: int


def ppl_estimate(nll: np.ndarray) -> PPL:
    """PPL = exp(mean NLL) +/- PPL * standard error of the mean NLL (llama.cpp's formula)."""
    nll = np.asarray(nll, dtype=np.float64)
    n = len(nll)
    mean = float(nll.mean())
    var = float((nll * nll).mean()) - mean * mean
    ppl = math.exp(mean)
    err = ppl * math.sqrt(var / (n - 1)) if n > 1 and var > 0 else 0.0
    return PPL(ppl, err, n)


class WindowScore(NamedTuple):
    index: int          # window number (0-based)
    nll: np.ndarray     # (n_scored,) float64
    logits: np.ndarray  # (n_scored, V) float32 logits of the scored rows
    targets: np.ndarray  # (n_scored,) int64 tokens they predict


def score_windows(runner, wins: list[np.ndarray]) -> Iterator[WindowScore]:
    """Run every window through the model and yield its scored rows."""
    for i, w in enumerate(wins):
        logits = window_logits(runner, w)
        first, last = scored_range(len(w))
        targets = w[first + 1:last + 1]
        yield WindowScore(i, token_nll(logits, targets), logits, targets)


def perplexity(runner, wins: list[np.ndarray], on_window: Callable[[int, int, PPL], None] | None = None,
               on_logits: Callable[[WindowScore], None] | None = None) -> PPL:
    """llama.cpp's perplexity over token windows (``windows``). ``on_window(i, n_windows, running estimate)``
    after each window (progress); ``on_logits(score)`` sees each window's scored logits (the KL base file)."""
    nll = []
    for s in score_windows(runner, wins):
        nll.append(s.nll)
        if on_logits is not None:
            on_logits(s)
        if on_window is not None:
            on_window(s.index, len(wins), ppl_estimate(np.concatenate(nll)))
    return ppl_estimate(np.concatenate(nll))


# ---------------------------------------------------------------------------------------------------------
# KL divergence: the base file
# ---------------------------------------------------------------------------------------------------------

def quantize_logprobs(lp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, V) log-probs -> (lo (rows,), scale (rows,), q (rows, V) uint16) with lp ~ lo + q * scale."""
    hi = lp.max(axis=1)
    lo = np.maximum(lp.min(axis=1), hi - LOGPROB_RANGE)
    scale = np.maximum((hi - lo) / 65535.0, 1e-30)
    q = np.rint((np.maximum(lp, lo[:, None]) - lo[:, None]) / scale[:, None])
    return lo.astype(np.float32), scale.astype(np.float32), np.clip(q, 0, 65535).astype(np.uint16)


def dequantize_logprobs(lo: np.ndarray, scale: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The stored log-probs, renormalized (float64): a proper distribution again after the rounding."""
    lp = lo.astype(np.float64)[:, None] + q.astype(np.float64) * scale.astype(np.float64)[:, None]
    return log_softmax(lp)


class KLBaseWriter:
    """Writes the base file: header (magic, ctx, V, n_windows, n_tokens), the windows' tokens (int32), then per
    scored position float32 lo, float32 scale and V uint16."""

    def __init__(self, f: BinaryIO, wins: list[np.ndarray], vocab_size: int):
        self.f, self.vocab_size = f, vocab_size
        ctx = len(wins[0])
        tokens = np.concatenate(wins).astype("<i4")
        f.write(KLD_MAGIC + struct.pack("<4I", ctx, vocab_size, len(wins), len(tokens)))
        f.write(tokens.tobytes())

    def add(self, score: WindowScore) -> None:
        for r in range(0, len(score.logits), _ROWS):
            lo, scale, q = quantize_logprobs(log_softmax(score.logits[r:r + _ROWS]))
            for i in range(len(q)):
                self.f.write(struct.pack("<2f", lo[i], scale[i]))
                self.f.write(q[i].astype("<u2").tobytes())


class KLBase:
    """A base file opened for comparison: ``wins`` (the token windows it was made on), ``rows(n)`` reads the
    next n positions' log-probs."""

    def __init__(self, f: BinaryIO):
        self.f = f
        head = f.read(len(KLD_MAGIC) + 16)
        if len(head) < len(KLD_MAGIC) + 16 or head[:len(KLD_MAGIC)] != KLD_MAGIC:
            raise ValueError("not a pyengine KL-divergence base file (bad magic); make one with "
                             "--kl-divergence-base FILE")
        self.ctx, self.vocab_size, n_windows, n_tokens = struct.unpack("<4I", head[len(KLD_MAGIC):])
        if n_tokens != n_windows * self.ctx:
            raise ValueError(f"corrupt KL base file: {n_tokens} tokens for {n_windows} windows of {self.ctx}")
        raw = f.read(4 * n_tokens)
        if len(raw) != 4 * n_tokens:
            raise ValueError("corrupt KL base file: truncated token list")
        tokens = np.frombuffer(raw, "<i4").astype(np.int64)
        self.wins = [tokens[i * self.ctx:(i + 1) * self.ctx] for i in range(n_windows)]
        self._row = 8 + 2 * self.vocab_size

    def rows(self, n: int) -> np.ndarray:
        raw = self.f.read(n * self._row)
        if len(raw) != n * self._row:
            raise ValueError("KL base file is truncated: fewer scored positions than its windows need")
        rec = np.frombuffer(raw, np.uint8).reshape(n, self._row)
        lo = rec[:, 0:4].copy().view("<f4")[:, 0]
        scale = rec[:, 4:8].copy().view("<f4")[:, 0]
        q = rec[:, 8:].copy().view("<u2")
        return dequantize_logprobs(lo, scale, q)


class KLStats:
    """Accumulates per-position KL(base || this), top-1 agreement and both NLLs."""

    def __init__(self):
        self.kl, self.same_top, self.nll, self.nll_base = [], [], [], []

    def add(self, base_lp: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> None:
        for r in range(0, len(targets), _ROWS):
            lp = log_softmax(logits[r:r + _ROWS])
            b = base_lp[r:r + _ROWS]
            t = targets[r:r + _ROWS]
            rows = np.arange(len(t))
            self.kl.append(np.maximum((np.exp(b) * (b - lp)).sum(axis=1), 0.0))
            self.same_top.append(np.argmax(b, axis=1) == np.argmax(lp, axis=1))
            self.nll.append(-lp[rows, t])
            self.nll_base.append(-b[rows, t])

    def summary(self) -> dict:
        kl = np.concatenate(self.kl)
        top = np.concatenate(self.same_top).astype(np.float64)
        nll, nll_b = np.concatenate(self.nll), np.concatenate(self.nll_base)
        n = len(kl)
        d = nll - nll_b                                  # ln(PPL(Q)/PPL(base)) per token
        se = (lambda x: float(np.std(x, ddof=1) / math.sqrt(n)) if n > 1 else 0.0)
        pct = {p: float(np.percentile(kl, p)) for p in (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0)}
        q, b = ppl_estimate(nll), ppl_estimate(nll_b)
        return {"n_tokens": n, "ppl": q.ppl, "ppl_err": q.err, "ppl_base": b.ppl, "ppl_base_err": b.err,
                "ln_ppl_ratio": float(d.mean()), "ln_ppl_ratio_err": se(d),
                "kl_mean": float(kl.mean()), "kl_mean_err": se(kl), "kl_max": float(kl.max()),
                "kl_min": float(kl.min()), "kl_percentiles": pct,
                "same_top": float(top.mean()), "same_top_err": math.sqrt(top.mean() * (1 - top.mean()) / max(1, n - 1))}


def format_kl(s: dict) -> str:
    """The comparison in llama-perplexity --kl-divergence's words."""
    p = s["kl_percentiles"]
    lines = [
        f"Mean PPL(Q)                   : {s['ppl']:10.6f} +/- {s['ppl_err']:10.6f}",
        f"Mean PPL(base)                : {s['ppl_base']:10.6f} +/- {s['ppl_base_err']:10.6f}",
        f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio']:10.6f} +/- {s['ln_ppl_ratio_err']:10.6f}",
        f"Mean    KLD: {s['kl_mean']:10.6f} +/- {s['kl_mean_err']:10.6f}",
        f"Maximum KLD: {s['kl_max']:10.6f}",
        f"99.9%   KLD: {p[99.9]:10.6f}",
        f"99.0%   KLD: {p[99.0]:10.6f}",
        f"95.0%   KLD: {p[95.0]:10.6f}",
        f"90.0%   KLD: {p[90.0]:10.6f}",
        f"Median  KLD: {p[50.0]:10.6f}",
        f"10.0%   KLD: {p[10.0]:10.6f}",
        f" 5.0%   KLD: {p[5.0]:10.6f}",
        f" 1.0%   KLD: {p[1.0]:10.6f}",
        f"Minimum KLD: {s['kl_min']:10.6f}",
        f"Same top p: {100 * s['same_top']:6.3f} +/- {100 * s['same_top_err']:5.3f} %",
    ]
    return "\n".join(lines)


def kl_divergence(runner, base: KLBase, on_window: Callable[[int, int, dict], None] | None = None) -> dict:
    """Compare this runner against a base file, on the base file's own token windows."""
    if runner.config.vocab_size != base.vocab_size:
        raise ValueError(f"KL base file has a vocabulary of {base.vocab_size}, the model {runner.config.vocab_size}")
    stats = KLStats()
    for s in score_windows(runner, base.wins):
        stats.add(base.rows(len(s.targets)), s.logits, s.targets)
        if on_window is not None:
            on_window(s.index, len(base.wins), stats)
    return stats.summary()
