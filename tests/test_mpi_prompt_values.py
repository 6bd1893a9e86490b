"""S19 under S17 over real MPI: prompt logprobs and embeddings of an engine whose model is split over ranks
(tensor parallelism: the LM head split by vocabulary, each rank reducing its columns; pipeline stages: the last
stage's residual rows sent back to stage 0, cross-step and within-step; both at once). Reference: the same
engine in one process on the tiny seeded model (tests/tiny_models.py): the same ids and ranks, pooled vectors
within 1e-5, logprobs within 1e-5 with pipeline stages alone. With tensor parallelism the ranks' partial sums
are added in another order, so the logits themselves differ from one process's by about 1e-5 (measured: the
sampled tokens' logprobs, from the gathered logits, by 1.1e-5; the prompt logprobs by 1.5e-5 to 1.8e-5): there
the bound is 5e-5, as for the sampled tokens' logprobs in every configuration (decode batches differ with
pipelining: 1.2e-5). The reduction itself (each rank's column statistics merged on rank 0) is checked within
1e-6 (float32 exponentials) of the whole rows' log-softmax here, without MPI. Each configuration is one short
MPI job."""
import functools
import json
import os
import subprocess

import numpy as np
import pytest

from tiny_models import write_tiny

pytestmark = pytest.mark.slow
HERE = os.path.dirname(__file__)
KW = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=24, block_size=4)
PROMPTS = [[int(t) for t in np.random.default_rng(s).integers(1, 320, n)] for s, n in ((1, 7), (2, 40), (3, 19))]
SCRIPT = '''
import json, sys
from engine_fakes import WideTokenizer
import pyengine.parallel.mpi as mpi
from pyengine import LLM, SamplingParams
from pyengine.engine.pooling import PoolingParams


def run(llm, prompts):
    items = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k, logprobs=5, ignore_eos=True)
              for k in (0, 5, 2)]
    gen = llm.generate(items, params)
    score = llm.generate(items[:1], SamplingParams(max_tokens=0, prompt_logprobs=3))
    out = {"prompt_logprobs": [[None if e is None else [[t, v.logprob, v.rank] for t, v in e.items()]
                                for e in o.prompt_logprobs] for o in gen + score],
           "tokens": [o.outputs[0].token_ids for o in gen],
           "sampled": [[[[t, v] for t, v in e.items()] for e in o.outputs[0].logprobs] for o in gen]}
    for pooling in ("last", "mean"):
        out[pooling] = [o.outputs.embedding for o in llm.embed(items, PoolingParams(pooling=pooling))]
    return out


if __name__ == "__main__":
    path, tp, pp, cross = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    kw = json.loads(sys.argv[5])
    mpi.CROSS_STEP = cross
    llm = LLM(path, tokenizer=WideTokenizer(), tensor_parallel_size=tp, pipeline_parallel_size=pp, **kw)
    print("OUT " + json.dumps(run(llm, json.loads(sys.argv[6]))), flush=True)
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("mpiplp")
    model = str(write_tiny(d / "tiny.gguf", "llama", seed=5))
    (d / "plp_job.py").write_text(SCRIPT)
    import sys
    sys.path.insert(0, str(d))
    from plp_job import WideTokenizer, run
    from pyengine import LLM
    return d, model, run(LLM(model, tokenizer=WideTokenizer(), **KW), PROMPTS)


def same(got, want, tol):
    assert got["tokens"] == want["tokens"]
    for g, w in zip(got["sampled"], want["sampled"]):
        for ge, we in zip(g, w):
            assert [t for t, _ in ge] == [t for t, _ in we]
            assert np.allclose([v for _, v in ge], [v for _, v in we], atol=5e-5, rtol=0)
    for g, w in zip(got["prompt_logprobs"], want["prompt_logprobs"]):
        assert len(g) == len(w) and g[0] is None and w[0] is None
        for ge, we in zip(g[1:], w[1:]):
            assert [t for t, _, _ in ge] == [t for t, _, _ in we] and [r for _, _, r in ge] == [r for _, _, r in we]
            assert np.allclose([v for _, v, _ in ge], [v for _, v, _ in we], atol=tol, rtol=0)
    for pooling in ("last", "mean"):
        assert np.max(np.abs(np.asarray(got[pooling]) - np.asarray(want[pooling]))) <= 1e-5


@pytest.mark.parametrize("tp,pp,cross", [(2, 1, True), (1, 2, True), (2, 2, True), (2, 2, False)])
def test_prompt_values_over_mpi_equal_one_process(setup, tp, pp, cross):
    from pyengine.parallel.launch import mpiexec_command, rank_env
    d, model, want = setup
    env = rank_env()
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    p = subprocess.run(mpiexec_command(tp * pp, [str(d / "plp_job.py"), model, str(tp), str(pp), str(int(cross)),
                                                 json.dumps(KW), json.dumps(PROMPTS)]),
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("OUT ")]
    assert len(lines) == 1                                   # rank 0 only
    same(json.loads(lines[0][4:]), want, 5e-5 if tp > 1 else 1e-5)


@pytest.mark.parametrize("k,splits", [(0, [0, 320]), (5, [0, 160, 320]), (3, [0, 2, 150, 320]), (20, [0, 7, 320])])
def test_column_statistics_merge_to_the_whole_rows_entries(k, splits):
    from pyengine.engine.prompt_logprobs import column_stats, merge_stats, prompt_logprob_entries, target_logits
    rng = np.random.default_rng(k)
    logits = (rng.standard_normal((9, 320)) * 4).astype(np.float32)
    logits[3, 17] = logits[3, 200] = logits[3].max() + 1          # a tie across two ranks: ids break it
    next_ids = rng.integers(0, 320, 9)
    next_ids[3] = 200
    target = sum(target_logits(logits[:, a:b], a, next_ids) for a, b in zip(splits, splits[1:]))
    parts = [column_stats(logits[:, a:b], a, target, k) for a, b in zip(splits, splits[1:])]
    got, want = merge_stats(parts, target, next_ids, k), prompt_logprob_entries(logits, next_ids, k)
    for g, w in zip(got, want):
        assert list(g) == list(w) and [e.rank for e in g.values()] == [e.rank for e in w.values()]
        assert np.allclose([e.logprob for e in g.values()], [e.logprob for e in w.values()], atol=1e-6, rtol=0)


# --- through the OpenAI server (one request each, in tests/test_mpi_serve.py and tests/test_disagg_serve.py) --------
SERVED_PROMPT = "The capital of France is Paris"


@functools.lru_cache(maxsize=1)
def served_reference() -> dict:
    """The one-process engine's prompt logprobs (top 2) and last-token embedding of SERVED_PROMPT (SmolLM2)."""
    from model_paths import model_path
    from pyengine import LLM, SamplingParams
    llm = LLM(model_path("smollm2"), max_model_len=256, max_num_seqs=4)
    out = llm.generate([SERVED_PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    ids = out.prompt_token_ids
    return {"ids": ids, "token_logprobs": [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))],
            "embedding": llm.embed([SERVED_PROMPT])[0].outputs.embedding}


def check_served_prompt_values(client, url: str) -> None:
    """echo + logprobs (scoring only) and /v1/embeddings from a server whose model is split over ranks or whose
    prompts are prefilled by a prefill instance: the one-process engine's values (SmolLM2's logits under tensor
    parallelism differ by about 1e-5 of their scale; 1e-3 as against HF)."""
    import httpx
    want = served_reference()
    got = client.completions.create(model="SmolLM2-135M-Instruct", prompt=SERVED_PROMPT, echo=True, logprobs=2,
                                    max_tokens=0).choices[0].logprobs
    assert got.token_logprobs[0] is None and len(got.token_logprobs) == len(want["ids"])
    assert np.max(np.abs(np.asarray(got.token_logprobs[1:]) - want["token_logprobs"])) < 1e-3
    r = httpx.post(url + "/v1/embeddings", json={"input": SERVED_PROMPT}, timeout=60)
    assert r.status_code == 200, r.text
    assert np.max(np.abs(np.asarray(r.json()["data"][0]["embedding"]) - want["embedding"])) < 1e-4
