"""S17 over MPI on the real model: tensor parallelism (Megatron split, SmolLM2's 9 query / 3 KV heads split
unevenly), pipeline parallelism and both combined compute what one process computes. Each configuration is one
MPI job (tests/mpi_check.py under the wheel's mpiexec, ranks oversubscribing the 2 cores) that writes logits of
a prompt and of passes after it, and the batched greedy continuations of the golden prompts decoded together
with other prompts. With pipeline stages the engine runs cross-step pipelining (a step of each of the pp groups
of sequences in flight), and the logits passes are also run with another step in flight behind each. References: the same model in one process (logits within 1e-4 of the logits' scale; greedy
tokens identical) and HF transformers' greedy continuations (tests/golden/generation_smollm2.json). Also with
Open MPI forced onto TCP (no shared memory), as between hosts. A rank killed between engine steps makes the next
step fail naming it, and the job still ends by itself (fault tolerance: parallel/mpi.py)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from model_paths import model_path

pytestmark = pytest.mark.slow
HERE = os.path.dirname(__file__)
GOLDEN = os.path.join(HERE, "golden", "generation_smollm2.json")
KW = dict(max_model_len=512, num_blocks=256, block_size=16, max_num_batched_tokens=512, max_num_seqs=16,
          max_logits=64)
LOGITS = [[3, 1], [1, 2], [24, 3], [100, 4]]      # a context, then a decode, a 24-token and a 100-token pass
EXTRA = ["The three primary colors are", "In 1492, Columbus", "The quick brown fox", "Dear Sir or Madam,",
         "Once upon a time", "def fib(n):", "Water boils at", "Hello, my name is", "To be or not to be,"]
MAX_TOKENS = 8


def run_mpi(tmp, model, tp, pp, tcp=False, kw=KW, logits=LOGITS, prompts=None, max_tokens=MAX_TOKENS,
            runner_greedy=False):
    """One MPI job of tp x pp ranks; returns (result dict, [logits arrays]). ``runner_greedy``: prompts are
    token-id lists decoded on the runner (mpi_check.batched_greedy), not through the engine. ``model`` a list:
    the models in turn in the one job, and a list of (result dict, [logits arrays]) per model."""
    from pyengine.parallel.launch import mpiexec_command, rank_env
    models = [model] if isinstance(model, str) else list(model)
    args = [os.path.join(HERE, "mpi_check.py"), *(x for m in models for x in ("--model", m)), "--tp", str(tp),
            "--pp", str(pp), "--out", str(tmp), "--kw", json.dumps(kw), "--logits", json.dumps(logits),
            "--max-tokens", str(max_tokens)]
    if prompts is not None:
        path = os.path.join(tmp, "prompts.json")
        json.dump(prompts, open(path, "w"))
        args += ["--prompts", path] + (["--runner-greedy"] if runner_greedy else [])
    env = rank_env(tcp)
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    proc = subprocess.run(mpiexec_command(tp * pp, args), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if not isinstance(model, str):
        return [_mpi_result(os.path.join(tmp, str(k)), logits) for k in range(len(models))]
    return _mpi_result(tmp, logits)


def _mpi_result(tmp, logits):
    res = json.load(open(os.path.join(tmp, "result.json")))
    npz = np.load(os.path.join(tmp, "logits.npz"))
    cross = os.path.join(tmp, "logits_cross.npz")   # pipeline stages: the passes under cross-step pipelining
    if os.path.exists(cross):
        res["logits_cross"] = [np.load(cross)[f"arr_{i}"] for i in range(len(logits))]
    return res, [npz[f"arr_{i}"] for i in range(len(logits))]


def reference(model, kw=KW, logits=LOGITS, prompts=None, max_tokens=MAX_TOKENS, runner_greedy=False):
    """The same passes and greedy continuations in one process."""
    sys.path.insert(0, HERE)
    from mpi_check import batched_greedy, greedy
    if runner_greedy:
        greedy = batched_greedy
    from pyengine.engine.model_runner import ModelRunner
    r = ModelRunner(model, **kw)
    out, pos = [], 0
    for n, seed in logits:
        ids = np.random.default_rng(seed).integers(3, r.config.vocab_size, n)
        out.append(r.run(r.contiguous_batch(ids, pos, logits_all=True)).copy())
        pos += n
    from pyengine.engine.executor import LocalExecutor
    return out, (greedy(LocalExecutor(r), prompts, max_tokens) if prompts is not None else None)


# two prompts sharing their first blocks: the second hits the prefix cache (with pipeline stages: from
# whichever group computed them first); with the 16 others, more than max_num_seqs: admissions wait
PREAMBLE = ("You are a helpful assistant. Answer in one short sentence, be precise, and never invent facts "
            "that were not given to you, whatever the question may be and whoever may ask it. Question: ")
SHARED = [PREAMBLE + "what colour is the sky?", PREAMBLE + "how many legs has a spider?"]


def prompts():
    golden = json.load(open(GOLDEN))["cases"]
    return [{"prompt_token_ids": c["prompt_ids"]} for c in golden] + SHARED[:1] + EXTRA + SHARED[1:]


@pytest.fixture(scope="module")
def one():
    return reference(model_path("smollm2"), prompts=prompts())


CONFIGS = [(2, 1, False), (3, 1, False), (1, 2, False), (2, 2, False), (2, 1, True), (1, 2, True)]


@pytest.mark.parametrize("tp,pp,tcp", CONFIGS, ids=[f"tp{t}-pp{p}{'-tcp' if c else ''}" for t, p, c in CONFIGS])
def test_parallel_equals_one_process_and_hf(one, tmp_path, tp, pp, tcp):
    ref_logits, ref_greedy = one
    res, got = run_mpi(tmp_path, model_path("smollm2"), tp, pp, tcp, prompts=prompts())
    if pp > 1:       # cross-step pipelining: the engine kept a step of each of the pp groups in flight
        assert res["engine"]["pipeline_groups"] == pp and res["engine"]["max_groups_in_flight"] == pp
        assert len(res["logits_cross"]) == len(got)
        got = got + res["logits_cross"]
        ref_logits = ref_logits + ref_logits
    else:
        assert "logits_cross" not in res and "max_groups_in_flight" not in res["engine"]
    for a, b in zip(got, ref_logits, strict=True):
        # float32 partial sums added in another order: rounding only
        assert np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max()), np.abs(a - b).max()
    assert res["greedy"] == ref_greedy
    assert res["engine"]["prefix_cache_hit_tokens"] >= 32
    golden = json.load(open(GOLDEN))["cases"]
    for i, c in enumerate(golden):                  # the independent reference, as the single-process test
        want = c["greedy_ids"][:MAX_TOKENS]
        if res["greedy"][i] != want:
            k = next(j for j, (x, y) in enumerate(zip(res["greedy"][i], want)) if x != y)
            assert c["greedy_margins"][k] < 0.02, f"golden case {i} diverges from HF at step {k}"
    parts, stats = res["parts"], res["stats"]
    assert len(stats) == tp * pp and all(s["steps"] > 0 for s in stats)
    if tp == 2:        # SmolLM2's 3 KV groups over 2 ranks: 2 + 1 groups (6 + 3 query heads)
        assert [len(p["q_heads"]) for p in parts[:2]] == [6, 3] and [len(p["kv_heads"]) for p in parts[:2]] == [2, 1]
    if tp == 3:
        assert [len(p["q_heads"]) for p in parts] == [3, 3, 3]
    if pp == 2:
        (a0, a1), (b0, b1) = parts[0]["layers"], parts[-1]["layers"]
        assert a0 == 0 and a1 == b0 and b1 == 30 and a1 < 15    # stage 0 also holds the LM head: fewer layers
    # each rank holds about 1/N of the weights and of the KV cache (N = tp for the KV heads, x pp for layers)
    total_kv = 2 * 30 * 256 * 16 * 3 * 64 * 4
    assert sum(s["kv_bytes"] for s in stats) == total_kv * (1 if tp <= 3 else tp // 3)
    layer_w = sum(s["weights_bytes"] for s in stats)
    assert layer_w < 1.05 * 4 * 134_515_008                  # no rank holds more than its part (about 1x total)


def test_llm_api_under_mpiexec(tmp_path):
    """`LLM(tensor_parallel_size=2, pipeline_parallel_size=2)` in a program started with mpiexec -n 4: rank 0
    generates what one process generates, the other ranks compute and exit with it."""
    from pyengine import LLM
    from pyengine.parallel.launch import mpiexec_command, rank_env
    from pyengine.sampling_params import SamplingParams
    script = tmp_path / "gen.py"
    script.write_text(
        "import json, sys\nfrom pyengine import LLM, SamplingParams\n"
        "llm = LLM(sys.argv[1], tensor_parallel_size=2, pipeline_parallel_size=2, max_model_len=256, max_num_seqs=4)\n"
        "out = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))\n"
        "print('OUT ' + json.dumps([o.outputs[0].token_ids for o in out]))\n")
    prompts = EXTRA[:3]
    p = subprocess.run(mpiexec_command(4, [str(script), model_path("smollm2"), json.dumps(prompts)]),
                       env=rank_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("OUT ")]
    assert len(lines) == 1                                   # rank 0 only
    want = LLM(model_path("smollm2"), max_model_len=256, max_num_seqs=4).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert json.loads(lines[0][4:]) == [o.outputs[0].token_ids for o in want]
    with pytest.raises(ValueError, match="mpiexec -n 4"):
        LLM(model_path("smollm2"), tensor_parallel_size=2, pipeline_parallel_size=2, max_model_len=64)
    with pytest.raises(ValueError, match="mpiexec -n 2"):               # outside an MPI job
        LLM(model_path("smollm2"), tensor_parallel_size=2, max_model_len=64)


def test_gemma3_tp2_replicates_its_single_kv_head(tmp_path):
    """Gemma 3 270M (4 query heads, 1 KV head) over 2 ranks: each rank holds 2 query heads and a copy of the KV
    head; a 40-token prompt, a decode and a 20-token pass equal one process (sliding-window layers included)."""
    kw = dict(max_model_len=256, num_blocks=64, block_size=16, max_num_batched_tokens=256, max_num_seqs=4,
              max_logits=64)
    passes = [[40, 1], [1, 2], [20, 3]]
    res, got = run_mpi(tmp_path, model_path("gemma3"), 2, 1, kw=kw, logits=passes)
    want, _ = reference(model_path("gemma3"), kw=kw, logits=passes)
    for a, b in zip(got, want):
        assert np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max())
        assert (a.argmax(-1) == b.argmax(-1)).all()
    assert [(p["q_heads"], p["kv_heads"]) for p in res["parts"]] == [([0, 1], [0]), ([2, 3], [0])]


FAULT_SCRIPT = """
import json, os, signal, sys
from pyengine.engine.llm_engine import LLMEngine
from pyengine.parallel.launch import mpi_runner
from pyengine.parallel.mpi import ParallelError
from pyengine.sampling_params import SamplingParams
ex = mpi_runner(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), max_model_len=256, max_num_seqs=4)
eng = LLMEngine(executor=ex)
for i in range(3):
    eng.add_request(f"r{i}", [1, 2, 3, 4 + i], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
eng.step(); eng.step()
victim = int(sys.argv[4])
os.kill(ex.group.where[victim][1], signal.SIGKILL)
try:
    while eng.has_unfinished_requests():
        eng.step()
    err = None
except ParallelError as exc:
    err = str(exc)
used = eng.num_used_blocks()
for i in range(3):
    eng.abort_request(f"r{i}")
print("OUT " + json.dumps({"error": err, "failure": ex.failure, "used_before": used,
                           "used_after": eng.num_used_blocks()}), flush=True)
ex.close()
"""


@pytest.mark.parametrize("tp,pp,victim,tcp", [(2, 1, 1, True), (2, 2, 3, False)], ids=["tp2-tcp", "tp2pp2"])
def test_dead_rank_fails_the_engine_step_naming_it(tmp_path, tp, pp, victim, tcp):
    """A rank SIGKILLed between engine steps (over TCP, as between hosts; and the last rank of TP 2 x PP 2): the
    next step raises ParallelError naming it within the deadline (MPI_ERR_PROC_FAILED from ULFM, not a hang),
    rank 0 lives on, aborting the requests frees their KV, and the job ends by itself (every live rank takes
    rank 0's STOP)."""
    from pyengine.parallel.launch import mpiexec_command, rank_env
    script = tmp_path / "fault.py"
    script.write_text(FAULT_SCRIPT)
    p = subprocess.run(mpiexec_command(tp * pp, [str(script), model_path("smollm2"), str(tp), str(pp), str(victim)]),
                       env=rank_env(tcp), capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("OUT ")]
    assert len(lines) == 1 and p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    out = json.loads(lines[0][4:])
    assert out["error"] and f"rank {victim} (pid" in out["error"] and "dead" in out["error"]
    assert out["failure"] == out["error"]
    assert out["used_before"] > 0 and out["used_after"] == 0


ABORT_SCRIPT = """
import json, sys
from pyengine.engine.llm_engine import LLMEngine
from pyengine.parallel.launch import mpi_runner
from pyengine.sampling_params import SamplingParams
ex = mpi_runner(sys.argv[1], 1, 2, max_model_len=256, max_num_seqs=4)
eng = LLMEngine(executor=ex)
for i, p in enumerate(json.loads(sys.argv[2])):
    eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
eng.step()                                # group 0's first step is back, group 1's is in flight
groups = {s.request_id: s.group for s in eng.scheduler.running}
victim = next(r for r, g in sorted(groups.items()) if g == 1)
used = eng.num_used_blocks()
eng.abort_request(victim)
held = eng.num_used_blocks()              # its step is in flight: its blocks are not free yet
eng.step()                                # group 1's step is back
live = len({b for s in eng.scheduler.running for b in s.block_table})
after = eng.num_used_blocks()
done = {}
while eng.has_unfinished_requests():
    for o in eng.step():
        if o.finished:
            done[o.request_id] = o.outputs[0].token_ids
print("OUT " + json.dumps(dict(groups=groups, victim=victim, used=used, held=held, live=live, after=after,
                               final=eng.num_used_blocks(), done=done)), flush=True)
ex.close()
"""


def test_abort_of_a_sequence_in_flight_frees_its_blocks_when_its_step_is_back(tmp_path):
    """PP 2, cross-step: four requests dealt into two groups; one of group 1 is aborted while group 1's step is
    in flight. Its blocks stay held until that step is back, then are free (used = the live sequences' blocks);
    the other requests generate what one process generates, and at the end no block is used."""
    from pyengine import LLM
    from pyengine.parallel.launch import mpiexec_command, rank_env
    from pyengine.sampling_params import SamplingParams
    script = tmp_path / "abort.py"
    script.write_text(ABORT_SCRIPT)
    prompts = EXTRA[:4]
    p = subprocess.run(mpiexec_command(2, [str(script), model_path("smollm2"), json.dumps(prompts)]),
                       env=rank_env(), capture_output=True, text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("OUT ")]
    assert p.returncode == 0 and len(lines) == 1, p.stdout[-2000:] + p.stderr[-3000:]
    out = json.loads(lines[0][4:])
    assert sorted(out["groups"].values()) == [0, 0, 1, 1]
    assert out["held"] == out["used"] > out["after"] == out["live"] > 0
    assert out["final"] == 0
    want = LLM(model_path("smollm2"), max_model_len=256, max_num_seqs=4).generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert set(out["done"]) == {f"r{i}" for i in range(4)} - {out["victim"]}
    for i, o in enumerate(want):
        if f"r{i}" != out["victim"]:
            assert out["done"][f"r{i}"] == o.outputs[0].token_ids


@pytest.mark.parametrize("calls, code", [("e(1); e()", 1), ("e()", 0), ("e(); raise SystemError('x')", 1)])
def test_exit_without_finalize_keeps_an_explicit_status(calls, code):
    """A failed start asks for status 1; the stop after it (exit_without_finalize() again) must not turn that into
    0. Without an explicit status: 1 only after an uncaught exception."""
    src = f"from pyengine.parallel.launch import exit_without_finalize as e; {calls}"
    p = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=60)
    assert p.returncode == code, p.stderr
