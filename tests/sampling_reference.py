"""Plain-Python references of the logits processors (lists, loops, `sorted`; no NumPy), shared by the
sampling tests. They restate the definitions in pyengine/layers/sampler.py's docstrings independently:
the tests compare the NumPy processors' kept sets and values with these. The chi-square helpers at the end
(NumPy for the counting) judge sampled counts against a reference distribution."""
import math

import numpy as np


def py_probs(xs):
    m = max(xs)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    s = sum(e)
    return [v / s for v in e]


def py_kept_top_k(xs, k):
    if k <= 0 or k >= len(xs):
        return set(range(len(xs)))
    kth = sorted(xs, reverse=True)[k - 1]
    return {i for i, x in enumerate(xs) if x >= kth}


def py_kept_top_p(xs, p):
    if p >= 1.0:
        return set(range(len(xs)))
    probs = py_probs(xs)
    kept, total, last = set(), 0.0, None
    for i in sorted(range(len(xs)), key=lambda i: -probs[i]):
        if total >= p:
            break
        kept.add(i)
        total += probs[i]
        last = probs[i]
    return kept | {i for i, q in enumerate(probs) if q == last}   # ties with the last kept token


def py_kept_min_p(xs, min_p):
    if min_p <= 0:
        return set(range(len(xs)))
    probs = py_probs(xs)
    top = max(probs)
    return {i for i, q in enumerate(probs) if q >= min_p * top}


def py_repetition_penalty(xs, seen, penalty):
    out = list(xs)
    for t in set(seen):
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


def py_presence_frequency(xs, output, presence, frequency):
    out = list(xs)
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return out


# --- chi-square p-value via the regularized upper incomplete gamma function Q(a, x) --------------
def gamma_q(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a): power series for P when x < a + 1, else Lentz continued fraction."""
    if x <= 0:
        return 1.0
    log_prefix = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-16:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-16:
            break
    return math.exp(log_prefix) * h


def chi2_sf(stat: float, dof: int) -> float:
    return gamma_q(dof / 2, stat / 2)


def chi2_pvalue(counts, probs) -> float:
    """Goodness of fit of observed `counts` to `probs`; cells with expected count < 5 are pooled.
    A draw in a zero-probability cell is an outright rejection (p = 0)."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = counts.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    exp = probs * n
    big = exp >= 5
    obs_cells = list(counts[big])
    exp_cells = list(exp[big])
    small = (~big) & (probs > 0)
    if small.any():
        obs_cells.append(counts[small].sum())
        exp_cells.append(exp[small].sum())
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_cells, exp_cells))
    return chi2_sf(stat, len(obs_cells) - 1)


def chi2_pvalue_ranked(counts, probs, min_expected: float = 25.0) -> float:
    """Goodness of fit over a large vocabulary: tokens sorted by reference probability are grouped, most
    likely first, into consecutive cells of at least `min_expected` expected draws (the remainder joins
    the last cell), so every cell is large enough for the chi-square approximation. A draw of a
    zero-probability token is an outright rejection (p = 0)."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = counts.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    obs_cells, exp_cells, o, e = [], [], 0.0, 0.0
    for i in sorted(np.flatnonzero(probs).tolist(), key=lambda i: -probs[i]):
        o += counts[i]
        e += probs[i] * n
        if e >= min_expected:
            obs_cells.append(o)
            exp_cells.append(e)
            o = e = 0.0
    if e > 0:
        if obs_cells:
            obs_cells[-1] += o
            exp_cells[-1] += e
        else:
            obs_cells, exp_cells = [o], [e]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_cells, exp_cells))
    return chi2_sf(stat, len(obs_cells) - 1) if len(obs_cells) > 1 else 1.0
