"""S19 requests through S18's disaggregated router (in one process, as tests/test_disagg.py): prompt logprobs are
computed by the prefill instance in the prompt's own forward and reach the router with its first output; an
embedding request is answered by a prefill instance alone; a request's ``priority`` reaches the schedulers of
both instances. Reference: the colocated engine (one LLMEngine, the same configuration) on the same prompts."""
import numpy as np
import pytest

from test_disagg import KW, Cluster, golden_prompts, runners  # noqa: F401  (module fixtures)
from pyengine.engine.llm_engine import LLMEngine
from pyengine.engine.pooling import PoolingParams
from pyengine.engine.prompt_logprobs import decode_params, routed_params
from pyengine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def colocated_outputs(runner, prompts, params):
    """Per prompt: (its last prompt_logprobs reported, its final RequestOutput), each prompt alone."""
    res = []
    for i, p in enumerate(prompts):
        eng = LLMEngine(runner=runner, **KW)
        eng.add_request(f"c{i}", p, params)
        plp, final = None, None
        while eng.has_unfinished_requests():
            for o in eng.step():
                plp = o.prompt_logprobs if o.prompt_logprobs is not None else plp
                final = o if o.finished else final
        res.append((plp, final))
    return res


def routed_outputs(c, prompts, params, prefix="d"):
    """The same through the router: the last prompt_logprobs any output carried (the server keeps it so)."""
    plps, outs = {}, []
    for i, p in enumerate(prompts):
        rid = f"{prefix}{i}"
        c.router.add_request(rid, p, params)
        while rid not in c.final:
            for o in c.turn():
                if getattr(o, "prompt_logprobs", None) is not None:
                    plps[o.request_id] = o.prompt_logprobs
        outs.append((plps.get(rid), c.final[rid]))
    c.settle()
    c.assert_no_blocks()
    return outs


def same_entries(a, b):
    assert a is not None and b is not None and len(a) == len(b) and a[0] is None and b[0] is None
    for ea, eb in zip(a[1:], b[1:]):
        assert list(ea) == list(eb)                              # the same ids, in the same order
        for t in ea:
            assert abs(ea[t].logprob - eb[t].logprob) <= 1e-5 and ea[t].rank == eb[t].rank


def test_prompt_logprobs_come_from_the_prefill_instance(runners, golden_prompts):  # noqa: F811
    prompts = [golden_prompts[0], golden_prompts[-1]]            # the longer one runs in chunks of 64
    for params in (SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=3, logprobs=1),
                   SamplingParams(max_tokens=0, prompt_logprobs=0)):     # scoring only: ends on the prefill side
        ref = colocated_outputs(runners[0], prompts, params)
        got = routed_outputs(Cluster(runners), prompts, params)
        for (rp, rf), (gp, gf) in zip(ref, got):
            same_entries(gp, rp)
            assert len(gp) == len(rf.prompt_token_ids)
            assert gf.outputs[0].token_ids == rf.outputs[0].token_ids
            assert gf.outputs[0].finish_reason == rf.outputs[0].finish_reason


def test_embeddings_are_answered_by_a_prefill_instance(runners, golden_prompts):  # noqa: F811
    prompts = [golden_prompts[1], golden_prompts[-1]]
    c = Cluster(runners)
    for pooling in ("last", "mean"):
        params = PoolingParams(pooling=pooling)
        ref = colocated_outputs(runners[0], prompts, params)
        got = routed_outputs(c, prompts, params, prefix=pooling)
        for (_, rf), (_, gf) in zip(ref, got):
            assert gf.pooled is not None and gf.pooled.shape == rf.pooled.shape
            assert np.max(np.abs(gf.pooled - rf.pooled)) <= 1e-5
        assert c.decode.engine.stats()["prompt_tokens"] == 0       # the decode instance never saw them
    with pytest.raises(ValueError, match="dimensions=8"):
        c.router.add_request("dims", prompts[0], PoolingParams(dimensions=8))
    assert not c.router.requests and not any(c.net.inbox)


def test_priority_reaches_both_instances_schedulers(runners):  # noqa: F811
    c = Cluster(runners, kw=dict(KW, max_num_seqs=1))           # one sequence at a time: the queue's order shows
    adopted = {}
    add_prefilled = c.decode.engine.add_prefilled

    def spy(rid, *a, priority=0, **kw):
        adopted[rid] = priority
        return add_prefilled(rid, *a, priority=priority, **kw)
    c.decode.engine.add_prefilled = spy
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for rid, p, prio in (("a", [5, 6, 7], 0), ("b", [8, 9, 10], 5), ("c", [11, 12, 13], -1)):
        c.router.add_request(rid, p, params, priority=prio)
    first = []                                                   # the order of the first tokens (prefill side)
    while len(c.final) < 3:
        for o in c.turn():
            if getattr(o, "outputs", None) and o.outputs[0].token_ids and o.request_id not in first:
                first.append(o.request_id)
    assert first == ["c", "a", "b"]                              # lower is earlier, as in vLLM
    assert adopted == {"a": 0, "b": 5, "c": -1}
    c.settle()
    c.assert_no_blocks()
    with pytest.raises(ValueError, match="priority"):
        c.router.add_request("bad", [5, 6], params, priority="high")


def test_routed_and_decode_params():
    sp = SamplingParams(n=2, prompt_logprobs=1)
    assert routed_params(sp, 64) == (sp, 2)
    checked, n = routed_params(PoolingParams(), 64)
    assert n == 1 and checked.max_tokens == 1 and checked.temperature == 0
    assert decode_params(sp).prompt_logprobs is None and decode_params(sp).n == 2 and sp.prompt_logprobs == 1
