"""Each logits processor against exact small examples and an independent pure-Python reference."""
import math

import numpy as np
import pytest

from pyengine.layers.sampler import (
    Sampler, apply_logit_bias, apply_min_p, apply_presence_frequency_penalties, apply_repetition_penalty,
    apply_temperature, apply_top_k, apply_top_p, log_softmax, make_rng, sample_row, softmax, token_logprobs)
from pyengine.sampling_params import SamplingParams
from sampling_reference import py_kept_min_p, py_kept_top_k, py_kept_top_p


def kept(arr):
    return set(np.flatnonzero(np.isfinite(arr)).tolist())


LOG4 = [math.log(v) for v in (0.5, 0.3, 0.15, 0.05)]


# --- exact examples -----------------------------------------------------------------------------
def test_logit_bias_exact():
    out = apply_logit_bias(np.array([1.0, 2.0, 3.0]), {0: -100.0, 2: 0.5})
    assert out.tolist() == [-99.0, 2.0, 3.5]


def test_repetition_penalty_divides_positive_multiplies_negative():
    x = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    out = apply_repetition_penalty(x, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0]
    assert x.tolist() == [2.0, -1.0, 0.5, 3.0]                 # input untouched
    assert apply_repetition_penalty(x, [3], 0.5).tolist() == [2.0, -1.0, 0.5, 6.0]   # < 1 rewards


def test_presence_frequency_penalties_exact():
    x = np.zeros(5)
    out = apply_presence_frequency_penalties(x, [2, 2, 3], presence=0.5, frequency=0.25)
    assert out.tolist() == [0.0, 0.0, -1.0, -0.75, 0.0]
    assert apply_presence_frequency_penalties(x, [], 0.5, 0.25).tolist() == [0.0] * 5


def test_temperature():
    assert apply_temperature(np.array([1.0, -2.0]), 0.5).tolist() == [2.0, -4.0]
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(np.array([1.0]), 0.0)


@pytest.mark.parametrize("p, expect", [(0.3, {0}), (0.5, {0}), (0.75, {0, 1}), (0.81, {0, 1, 2}),
                                       (0.96, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_exact(p, expect):
    assert kept(apply_top_p(np.array(LOG4), p)) == expect


def test_top_p_keeps_top_token_and_ties():
    assert kept(apply_top_p(np.array([5.0, 0.0, 0.0]), 1e-9)) == {0}
    # two tokens tied at the boundary are both kept, whichever the sort puts first
    assert kept(apply_top_p(np.array([1.0, 0.0, 0.0, -3.0]), 0.7)) == {0, 1, 2}


@pytest.mark.parametrize("min_p, expect", [(0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.65, {0}), (1.0, {0})])
def test_min_p_exact(min_p, expect):
    assert kept(apply_min_p(np.array(LOG4), min_p)) == expect


def test_top_k_exact():
    x = np.array([0.1, 3.0, -1.0, 2.0, 2.0])
    assert kept(apply_top_k(x, 1)) == {1}
    assert kept(apply_top_k(x, 2)) == {1, 3, 4}                 # tie with the 2nd is kept
    assert kept(apply_top_k(x, 0)) == kept(apply_top_k(x, -1)) == kept(apply_top_k(x, 9)) == set(range(5))
    assert apply_top_k(x, 3)[1] == 3.0                          # kept values unchanged


# --- randomized comparison with the references ------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_processors_match_python_reference(seed):
    rng = np.random.default_rng(seed)
    V = int(rng.integers(5, 300))
    x = rng.normal(0, 2.5, V)
    xs = x.tolist()
    for k in (1, 3, V // 2, V - 1):
        assert kept(apply_top_k(x, k)) == py_kept_top_k(xs, k)
    for p in (0.05, 0.5, 0.9, 0.999):
        assert kept(apply_top_p(x, p)) == py_kept_top_p(xs, p)
    for m in (0.01, 0.1, 0.5):
        assert kept(apply_min_p(x, m)) == py_kept_min_p(xs, m)
    # 2-D input = the same processor row by row
    X = rng.normal(0, 2, (4, V))
    for fn, arg in ((apply_top_k, 7), (apply_top_p, 0.6), (apply_min_p, 0.2)):
        batched = fn(X, arg)
        for r in range(4):
            np.testing.assert_array_equal(batched[r], fn(X[r], arg))


def test_softmax_and_log_softmax():
    x = np.array([1000.0, 999.0, -np.inf])                     # no overflow, -inf -> probability 0
    p = softmax(x)
    assert p[2] == 0.0
    assert p[0] == pytest.approx(1 / (1 + math.exp(-1)))
    assert log_softmax(x)[1] == pytest.approx(-1 - math.log(1 + math.exp(-1)))


# --- the Sampler over a batch -------------------------------------------------------------------
def test_greedy_is_argmax_and_penalties_change_it():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1, (5, 64)).astype(np.float32)
    greedy = SamplingParams(temperature=0)
    tokens, infos = Sampler().sample(logits, [greedy] * 5, [[]] * 5, [[]] * 5, [None] * 5)
    assert tokens.tolist() == np.argmax(logits, axis=1).tolist() and infos == [None] * 5
    top = int(np.argmax(logits[0]))
    second = int(np.argsort(-logits[0])[1])
    banned = SamplingParams(temperature=0, logit_bias={top: -100})
    assert Sampler().sample(logits[:1], [banned], [[]], [[]], [None])[0][0] == second
    # a strong presence penalty on the argmax token (already generated) moves greedy off it
    pen = SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0)
    out = [top] * 5
    assert sample_row(logits[0], pen, None, [], out) == int(np.argmax(
        logits[0] - np.where(np.arange(64) == top, 12.0, 0.0)))


def test_same_seed_same_tokens_and_batch_independence():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1.5, (4, 200)).astype(np.float32)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s) for s in (11, 12, 13, 14)]

    def run(rows):
        toks = []
        rngs = [make_rng(params[r], None) for r in rows]
        for _ in range(30):
            t, _ = Sampler().sample(logits[rows], [params[r] for r in rows], [[]] * len(rows),
                                    [[]] * len(rows), rngs)
            toks.append(t.tolist())
        return np.array(toks)

    full = run([0, 1, 2, 3])
    again = run([0, 1, 2, 3])
    np.testing.assert_array_equal(full, again)
    np.testing.assert_array_equal(full[:, 2], run([2])[:, 0])   # a row's draws do not depend on its batch
    assert len({tuple(full[:, r]) for r in range(4)}) == 4       # different seeds differ


def test_unseeded_rngs_come_from_the_engine_generator():
    p = SamplingParams(temperature=1.0)
    a = make_rng(p, np.random.default_rng(5)).random(4)
    b = make_rng(p, np.random.default_rng(5)).random(4)
    np.testing.assert_array_equal(a, b)
    seeded = SamplingParams(seed=3)
    np.testing.assert_array_equal(make_rng(seeded, None).random(3), np.random.default_rng(3).random(3))
    assert not np.array_equal(make_rng(seeded, None, index=1).random(3), np.random.default_rng(3).random(3))


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 3, (2, 50)).astype(np.float32)
    params = [SamplingParams(temperature=0.3, top_k=3, logprobs=5, seed=0, logit_bias={1: 50.0}),
              SamplingParams(temperature=0, logprobs=0)]
    tokens, infos = Sampler().sample(logits, params, [[], []], [[], []], [make_rng(params[0], None), None])
    assert tokens[0] == 1                                         # the bias forced it ...
    for r in range(2):
        row = [float(v) for v in logits[r]]
        lse = max(row) + math.log(sum(math.exp(v - max(row)) for v in row))
        ref = [v - lse for v in row]
        info = infos[r]
        assert info.token_id == tokens[r]
        assert info.logprob == pytest.approx(ref[tokens[r]], abs=1e-9)   # ... but logprobs ignore the bias
        assert info.rank == 1 + sum(v > ref[tokens[r]] for v in ref)
        order = sorted(range(50), key=lambda i: -ref[i])[:params[r].logprobs]
        assert info.top_ids == order
        assert info.top_logprobs == pytest.approx([ref[i] for i in order], abs=1e-9)
    assert infos[1].top_ids == [] and infos[1].rank == 1
    assert infos[0].as_dict()[1] == infos[0].logprob


def test_token_logprobs_top_n_capped_by_vocab():
    info = token_logprobs(np.array([0.0, 1.0, 2.0]), 0, 10)
    assert info.top_ids == [2, 1, 0] and info.rank == 3


def test_sampler_input_checks():
    s = Sampler()
    with pytest.raises(ValueError, match="logits"):
        s.sample(np.zeros(5), [SamplingParams()], [[]], [[]], [None])
    with pytest.raises(ValueError, match="rngs"):
        s.sample(np.zeros((2, 5)), [SamplingParams()] * 2, [[]] * 2, [[]] * 2, [None])
    with pytest.raises(ValueError, match="generator"):
        s.sample(np.zeros((1, 5)), [SamplingParams()], [[]], [[]], [None])
