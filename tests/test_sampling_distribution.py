"""Statistical check of the sampler: draws follow the distribution the processors define.

For several processor combinations we draw 20000 tokens from a fixed logits vector and run a
chi-square goodness-of-fit test against the distribution computed by an independent pure-Python
reference. Seeds are fixed, so the test is deterministic; the negative controls show the same test
rejects distributions that are only slightly wrong.
"""
import math

import numpy as np
import pytest

from pyengine.layers.sampler import Sampler, sample_row
from pyengine.sampling_params import SamplingParams
from sampling_reference import chi2_pvalue, chi2_sf

N_DRAWS = 20000


def test_chi2_sf_against_closed_forms():
    for x in (0.1, 1.0, 3.841458820694124, 10.0, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)          # dof 2: e^(-x/2)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)  # dof 1: erfc
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(124.34211340400407, 100) == pytest.approx(0.05, rel=1e-8)


# --- independent reference of the processor pipeline (plain Python lists) -----------------------
def ref_distribution(logits, p: SamplingParams, prompt=(), output=()):
    x = [float(v) for v in logits]
    for tid, b in p.logit_bias.items():
        x[tid] += b
    if p.repetition_penalty != 1.0:
        for tid in set(prompt) | set(output):
            x[tid] = x[tid] / p.repetition_penalty if x[tid] > 0 else x[tid] * p.repetition_penalty
    for tid in set(output):
        x[tid] -= p.frequency_penalty * list(output).count(tid) + p.presence_penalty
    x = [v / p.temperature for v in x]
    alive = set(range(len(x)))
    if 0 < p.top_k < len(x):
        kth = sorted(x, reverse=True)[p.top_k - 1]
        alive = {i for i in alive if x[i] >= kth}

    def probs_of(alive):
        m = max(x[i] for i in alive)
        w = {i: math.exp(x[i] - m) for i in alive}
        s = sum(w.values())
        return {i: v / s for i, v in w.items()}

    if p.top_p < 1.0:
        pr = probs_of(alive)
        keep, total = [], 0.0
        for i in sorted(alive, key=lambda i: -pr[i]):
            if total >= p.top_p:
                break
            keep.append(i)
            total += pr[i]
        alive = set(keep)
    if p.min_p > 0:
        pr = probs_of(alive)
        top = max(pr.values())
        alive = {i for i in alive if pr[i] >= p.min_p * top}
    pr = probs_of(alive)
    return np.array([pr.get(i, 0.0) for i in range(len(x))])


LOGITS = np.random.default_rng(1234).normal(0, 1.5, 30).astype(np.float32)
PROMPT = [0, 3, 3, 7]
OUTPUT = [5, 5, 5, 9, 1]

CASES = {
    "plain": SamplingParams(temperature=1.0),
    "temp_topk": SamplingParams(temperature=0.7, top_k=6),
    "hot_topp": SamplingParams(temperature=1.3, top_p=0.8),
    "minp": SamplingParams(temperature=1.0, min_p=0.08),
    "all_truncations": SamplingParams(temperature=1.5, top_k=12, top_p=0.9, min_p=0.05),
    "penalties_bias": SamplingParams(temperature=1.1, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.4,
                                     frequency_penalty=0.3, logit_bias={2: 1.5, 4: -3.0}),
}


def draw(params, seed, prompt=PROMPT, output=OUTPUT):
    rng = np.random.default_rng(seed)
    toks = [sample_row(LOGITS, params, rng, prompt, output) for _ in range(N_DRAWS)]
    return np.bincount(toks, minlength=len(LOGITS))


@pytest.fixture(scope="module")
def samples():
    return {name: draw(p, seed=100 + i) for i, (name, p) in enumerate(CASES.items())}


@pytest.mark.parametrize("name", list(CASES))
def test_draws_fit_the_processed_distribution(samples, name):
    expected = ref_distribution(LOGITS, CASES[name], PROMPT, OUTPUT)
    counts = samples[name]
    assert counts[expected == 0].sum() == 0                   # truncated tokens never appear
    assert chi2_pvalue(counts, expected) > 1e-4


def test_truncations_actually_truncate():
    live = {name: int((ref_distribution(LOGITS, p, PROMPT, OUTPUT) > 0).sum()) for name, p in CASES.items()}
    assert live["plain"] == 30 and live["temp_topk"] == 6
    assert 1 < live["hot_topp"] < 30 and 1 < live["minp"] < 30 and 1 < live["all_truncations"] < 12


def test_batched_sampler_fits_too():
    # Sampler.sample over a batch: 20000 rows, one shared generator.
    p = CASES["hot_topp"]
    rng = np.random.default_rng(7)
    logits = np.tile(LOGITS, (N_DRAWS, 1))
    tokens, _ = Sampler().sample(logits, [p] * N_DRAWS, [[]] * N_DRAWS, [[]] * N_DRAWS, [rng] * N_DRAWS)
    counts = np.bincount(tokens, minlength=len(LOGITS))
    assert chi2_pvalue(counts, ref_distribution(LOGITS, p)) > 1e-4


# --- negative controls: the test has power ------------------------------------------------------
def test_rejects_wrong_temperature(samples):
    wrong = ref_distribution(LOGITS, SamplingParams(temperature=0.8, top_k=6))   # drawn at 0.7
    assert chi2_pvalue(samples["temp_topk"], wrong) < 1e-6


def test_rejects_missing_penalties(samples):
    p = CASES["penalties_bias"]
    wrong = ref_distribution(LOGITS, p.clone(repetition_penalty=1.0))   # forgot the repetition penalty
    assert chi2_pvalue(samples["penalties_bias"], wrong) < 1e-6


def test_rejects_off_by_one_nucleus(samples):
    # top-p that drops the token crossing p: the crossing token's draws make the fit impossible
    p = CASES["hot_topp"]
    right = ref_distribution(LOGITS, p)
    order = np.argsort(-right)
    wrong = right.copy()
    wrong[order[int((right > 0).sum()) - 1]] = 0.0
    wrong /= wrong.sum()
    assert chi2_pvalue(samples["hot_topp"], wrong) < 1e-6
    # and a generator that ignores temperature is rejected too
    rng = np.random.default_rng(3)
    plain = rng.choice(len(LOGITS), size=N_DRAWS, p=ref_distribution(LOGITS, SamplingParams()))
    assert chi2_pvalue(np.bincount(plain, minlength=30), right) < 1e-6
