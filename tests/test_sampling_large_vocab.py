"""The logits processors at the real vocabulary size (SmolLM2: V = 49152) against the plain-Python
references of tests/sampling_reference.py, with exact kept sets and exact penalty values.

Small vocabularies cannot test top-p's fast path (pyengine/layers/sampler.py looks for the nucleus among
the TOP_P_CANDIDATES most likely tokens first, only when V > 4 * TOP_P_CANDIDATES) nor its fallback: a
flat 49152-token distribution has a nucleus of tens of thousands of tokens, a long-tailed one of a few
hundred. Both kinds are here, and each case asserts which path it exercises. The chi-square test at the
end draws through the fast path and fits the draws to the reference distribution, with negative controls.
"""
import math

import numpy as np
import pytest

from pyengine.layers.sampler import (
    TOP_P_CANDIDATES, apply_logit_bias, apply_min_p, apply_presence_frequency_penalties, apply_repetition_penalty,
    apply_top_k, apply_top_p, sample_row)
from pyengine.sampling_params import SamplingParams
from sampling_reference import (
    chi2_pvalue_ranked, py_kept_min_p, py_kept_top_k, py_kept_top_p, py_presence_frequency, py_probs,
    py_repetition_penalty)

V = 49152


def _families():
    rng = np.random.default_rng(49152)
    flat = rng.normal(0.0, 0.1, V)                              # nearly uniform: huge nuclei
    peaked = rng.normal(0.0, 1.0, V)
    peaked[rng.choice(V, 3, replace=False)] = [14.0, 12.5, 11.0]   # three tokens hold most of the mass
    tail = -1.2 * np.log(np.arange(1, V + 1, dtype=np.float64))    # Zipf-like, s = 1.2 ...
    tail = tail[rng.permutation(V)]                             # ... at scattered token ids
    return {"flat": flat, "peaked": peaked, "long_tail": tail}


LOGITS = _families()


def kept(arr):
    return set(np.flatnonzero(np.isfinite(arr)).tolist())


def fast_path_applies(x, p) -> bool:
    """Whether top-p's candidate shortcut covers the nucleus (the sampler's own condition, restated)."""
    probs = sorted(py_probs(x.tolist()), reverse=True)
    return sum(probs[:TOP_P_CANDIDATES]) >= p


@pytest.mark.parametrize("family", list(LOGITS))
def test_top_k_kept_sets_at_full_vocab(family):
    x = LOGITS[family]
    xs = x.tolist()
    for k in (1, 40, 512, 5000, V - 1):
        got = kept(apply_top_k(x, k))
        assert got == py_kept_top_k(xs, k)
        assert len(got) == k                                    # no ties in these logits


# (family, p, whether the fast path covers it, nucleus size range): the flat family's nuclei are far
# beyond the candidate count, so a shortcut capped at 512 tokens cannot pass.
TOP_P_CASES = [
    ("flat", 0.05, False, (1500, 3000)), ("flat", 0.6, False, (25000, 32000)), ("flat", 0.95, False, (45000, V)),
    ("peaked", 0.5, True, (1, 1)), ("peaked", 0.9, True, (2, 3)), ("peaked", 0.999, False, (513, V)),
    ("long_tail", 0.5, True, (5, 30)), ("long_tail", 0.8, True, (200, 512)), ("long_tail", 0.9, False, (1000, 4000)),
]


@pytest.mark.parametrize("family, p, fast, size", TOP_P_CASES, ids=[f"{f}-{p}" for f, p, _, _ in TOP_P_CASES])
def test_top_p_kept_sets_at_full_vocab(family, p, fast, size):
    x = LOGITS[family]
    assert fast_path_applies(x, p) == fast
    ref = py_kept_top_p(x.tolist(), p)
    got = kept(apply_top_p(x, p))
    assert len(got) == len(ref)
    assert got == ref
    assert size[0] <= len(got) <= size[1]


def test_top_p_batch_mixing_fast_and_slow_rows():
    # one row whose nucleus the shortcut covers and two it does not: each row gets its own exact set
    X = np.stack([LOGITS["long_tail"], LOGITS["flat"], LOGITS["peaked"]])
    for p in (0.8, 0.6):
        out = apply_top_p(X, p)
        for r in range(3):
            assert kept(out[r]) == py_kept_top_p(X[r].tolist(), p)


@pytest.mark.parametrize("family", list(LOGITS))
def test_min_p_kept_sets_at_full_vocab(family):
    x = LOGITS[family]
    xs = x.tolist()
    for m in (1e-4, 0.01, 0.1, 0.5, 0.95):
        assert kept(apply_min_p(x, m)) == py_kept_min_p(xs, m)


@pytest.mark.parametrize("family", list(LOGITS))
def test_penalties_and_bias_exact_values_at_full_vocab(family):
    x = LOGITS[family]
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, V, 300).tolist()
    output = rng.choice(rng.integers(0, V, 40), 200).tolist()   # repeated ids: counts up to ~10
    output += [V - 1, 0, 0]                                     # both ends of the vocabulary
    xs = x.tolist()
    for pen in (1.3, 0.8):
        np.testing.assert_array_equal(apply_repetition_penalty(x, prompt + output, pen),
                                      py_repetition_penalty(xs, prompt + output, pen))
    np.testing.assert_array_equal(apply_presence_frequency_penalties(x, output, 0.4, 0.3),
                                  py_presence_frequency(xs, output, 0.4, 0.3))
    bias = {int(t): float(b) for t, b in zip(rng.integers(0, V, 50), rng.normal(0, 5, 50))}
    ref = list(xs)
    for t, b in bias.items():
        ref[t] += b
    np.testing.assert_array_equal(apply_logit_bias(x, bias), ref)


# --- chi-square through the fast path ------------------------------------------------------------
N_DRAWS = 2500          # ~4 ms a draw at V = 49152 on one core: about 10 s


def ref_top_p_distribution(x, p, temperature=1.0):
    xs = [v / temperature for v in x.tolist()]
    alive = py_kept_top_p(xs, p)
    m = max(xs[i] for i in alive)
    w = {i: math.exp(xs[i] - m) for i in alive}
    s = sum(w.values())
    return np.array([w.get(i, 0.0) / s for i in range(len(xs))])


@pytest.fixture(scope="module")
def fast_path_draws():
    x, p = LOGITS["long_tail"], 0.8
    assert fast_path_applies(x, p)
    params = SamplingParams(temperature=1.0, top_p=p, seed=0)
    rng = np.random.default_rng(2026)
    toks = [sample_row(x, params, rng) for _ in range(N_DRAWS)]
    return np.bincount(toks, minlength=V)


def test_top_p_draws_fit_at_full_vocab(fast_path_draws):
    expected = ref_top_p_distribution(LOGITS["long_tail"], 0.8)
    assert fast_path_draws[expected == 0].sum() == 0
    assert chi2_pvalue_ranked(fast_path_draws, expected) > 1e-4


def test_top_p_chi_square_rejects_wrong_distributions(fast_path_draws):
    x = LOGITS["long_tail"]
    untruncated = np.array(py_probs(x.tolist()))
    smaller_nucleus = ref_top_p_distribution(x, 0.7)
    hotter = ref_top_p_distribution(x, 0.8, temperature=1.1)
    renormalized_wrong = ref_top_p_distribution(x, 0.8)         # right support, mass moved off the top token
    top = int(np.argmax(renormalized_wrong))
    renormalized_wrong[top] *= 0.6
    renormalized_wrong /= renormalized_wrong.sum()
    for wrong in (untruncated, smaller_nucleus, hotter, renormalized_wrong):
        assert chi2_pvalue_ranked(fast_path_draws, wrong) < 1e-6
