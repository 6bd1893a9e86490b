"""S14 rejection sampling keeps the output distribution exactly the model's (chi-square tests, fixed seeds).

1. Synthetic: known target rows p_0..p_k and drafter rows q_1..q_k over 8 tokens. The i-th emitted token,
   given that at least i were emitted, must follow p_i; the first draft's acceptance rate must be
   sum_x min(p(x), q(x)). Both drafters: one with distributions q, and one-hot guesses (n-gram).
2. Through the engine over the fake model: the joint law of the first three generated tokens with top-k 3,
   whose exact probabilities the test computes from the fake model's logits by hand.
Negative controls: a sampler that accepts too often (min(1, 1.5 p/q)) and one that redraws from p instead of
the residual must both fail the same tests.
"""
import numpy as np
import pytest

from engine_fakes import VOCAB, context_logits, make_engine, run_all
from pyengine.layers import rejection_sampler as rs
from pyengine.sampling_params import SamplingParams
from test_sampling_distribution import chi2_pvalue
from test_spec_engine import OracleProposer

V = 8
N = 20000
ALPHA = 1e-3          # a correct sampler fails a given check with probability 1e-3 (seeds fixed: never)


def synthetic(seed=0, k=3):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(V) * 0.7, size=k + 1)
    p[:, rng.choice(V, 2, replace=False)] = 0.0        # tokens the model never emits
    p /= p.sum(1, keepdims=True)
    q = 0.6 * p[:k] + 0.4 * rng.dirichlet(np.ones(V) * 0.7, size=k)   # a drafter that is often right
    q[:, 0] = 0.0                                      # a token the drafter never proposes
    q /= q.sum(1, keepdims=True)
    return p, q


def broken_accepts_too_often(draft_ids, target, draft_probs, rng):
    out = []
    for i, d in enumerate(draft_ids):
        q_d = 1.0 if draft_probs is None else draft_probs[i, d]
        if rng.random() * q_d < 1.5 * target[i, d]:
            out.append(int(d))
            continue
        res = np.maximum(target[i] - (draft_probs[i] if draft_probs is not None else np.eye(target.shape[1])[d]), 0)
        out.append(rs.draw(res, rng))
        return out
    return out + [rs.draw(target[len(draft_ids)], rng)]


def broken_redraws_from_p(draft_ids, target, draft_probs, rng):
    out = []
    for i, d in enumerate(draft_ids):
        q_d = 1.0 if draft_probs is None else draft_probs[i, d]
        if rng.random() * q_d < target[i, d]:
            out.append(int(d))
            continue
        return out + [rs.draw(target[i], rng)]
    return out + [rs.draw(target[len(draft_ids)], rng)]


def emitted_counts(sampler, p, q, one_hot, seed):
    """counts[i][x]: how often the i-th emitted token was x; and how often draft 1 was accepted."""
    rng = np.random.default_rng(seed)
    k = len(p) - 1
    counts = np.zeros((k + 1, V))
    accepted_first = 0
    for _ in range(N):
        drafts = [int(rng.choice(V, p=q[i])) for i in range(k)]
        out = sampler(drafts, p, None if one_hot else q, rng)
        for i, t in enumerate(out):
            counts[i, t] += 1
        accepted_first += len(out) > 1
    return counts, accepted_first


def passes(counts, p, accepted_first, q, one_hot) -> bool:
    ok = all(chi2_pvalue(counts[i], p[i]) > ALPHA for i in range(len(p)) if counts[i].sum() >= 200)
    # first draft: P(accept) = sum min(p, q) for a q drafter; for one-hot guesses drawn from q, E_q[p(d)]
    rate = float(np.minimum(p[0], q[0]).sum()) if not one_hot else float(q[0] @ p[0])
    z = (accepted_first - N * rate) / np.sqrt(N * rate * (1 - rate))
    return ok and abs(z) < 3.3


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_synthetic_emitted_tokens_follow_p(seed, one_hot):
    p, q = synthetic(seed)
    counts, acc = emitted_counts(rs.rejection_sample, p, q, one_hot, seed + 10)
    assert counts[2].sum() > 500                   # later positions are really exercised
    assert passes(counts, p, acc, q, one_hot)


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("broken", [broken_accepts_too_often, broken_redraws_from_p])
def test_negative_controls_fail(broken, one_hot):
    p, q = synthetic(0)
    counts, acc = emitted_counts(broken, p, q, one_hot, 10)
    assert not passes(counts, p, acc, q, one_hot)


def test_greedy_verification_and_empty_residual():
    assert rs.verify_greedy([5, 6, 7], [5, 6, 1, 9]) == [5, 6, 1]
    assert rs.verify_greedy([5, 6], [5, 6, 2]) == [5, 6, 2]
    assert rs.verify_greedy([4], [5, 6]) == [5]
    p = np.array([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    rng = np.random.default_rng(0)
    # q == p exactly: always accepted, the bonus comes from the last row
    for _ in range(50):
        out = rs.rejection_sample([1], p, p[:1].copy(), rng)
        assert out[0] == 1 and len(out) == 2


# --- through the engine: the exact joint law of the first three tokens -----------------------------------
TEMP, TOPK, NTOK = 0.8, 3, 3


def exact_law(prompt):
    """P(t1, t2, t3) by hand: softmax over the 3 largest logits / T at each prefix of the fake model."""
    law = {}

    def rec(ctx, prefix, prob):
        if len(prefix) == NTOK:
            law[tuple(prefix)] = prob
            return
        x = context_logits(ctx).astype(np.float64)
        top = np.argsort(-x)[:TOPK]
        w = np.exp((x[top] - x[top].max()) / TEMP)
        for t, pt in zip(top, w / w.sum()):
            rec(ctx + [int(t)], prefix + [int(t)], prob * pt)

    rec(list(prompt), [], 1.0)
    return law


def engine_law(prompt, proposer, n_runs=2000, n=50):
    eng = make_engine(num_blocks=1024, max_num_seqs=n, max_num_batched_tokens=512,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 2, "adaptive": False})
    eng.spec.proposer = proposer
    params = SamplingParams(n=n, temperature=TEMP, top_k=TOPK, max_tokens=NTOK, ignore_eos=True)
    for r in range(n_runs // n):
        eng.add_request(f"r{r}", {"prompt_token_ids": prompt}, params.clone(seed=1000 + r))
    final = run_all(eng)
    st = eng.stats()
    samples = [tuple(c.token_ids) for out in final.values() for c in out.outputs]
    return samples, st


@pytest.mark.parametrize("sampled_q", [True, False])
def test_engine_first_tokens_follow_the_model(sampled_q):
    prompt = [5, 9, 14, 2, 33]
    law = exact_law(prompt)
    cells = sorted(law)
    samples, st = engine_law(prompt, OracleProposer(0.5, sampled_q=sampled_q))
    assert st["spec_decode_num_drafts"] >= len(samples) // 2
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
    counts = [samples.count(c) for c in cells]
    assert sum(counts) == len(samples)                   # nothing outside the top-3 support
    assert chi2_pvalue(counts, [law[c] for c in cells]) > ALPHA


@pytest.mark.parametrize("broken", [broken_accepts_too_often, broken_redraws_from_p])
def test_engine_negative_control_fails(monkeypatch, broken):
    prompt = [5, 9, 14, 2, 33]
    law = exact_law(prompt)
    cells = sorted(law)
    monkeypatch.setattr(rs, "rejection_sample", broken)
    samples, _ = engine_law(prompt, OracleProposer(0.5, sampled_q=False))
    counts = [samples.count(c) for c in cells]
    assert sum(counts) < len(samples) or chi2_pvalue(counts, [law[c] for c in cells]) < ALPHA
