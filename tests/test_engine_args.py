"""Issue 26: one place for the engine's options (`EngineArgs`), its executor seam, BLAS threads and the named contracts.

Cheap: tiny seeded models, the real model's header only."""
from __future__ import annotations

import argparse
import importlib

import numpy as np
import pytest

from engine_fakes import FakeTokenizer, WideTokenizer
from model_paths import model_path
from tiny_models import write_tiny

from pyengine.engine.args import EngineArgs, default_max_model_len
from pyengine.engine.executor import Executor, LocalExecutor, Runner
from pyengine.gguf.reader import GGUFFile


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("args") / "tiny.gguf", "llama", seed=3))


@pytest.mark.parametrize("field,value,says", [
    ("max_model_len", 0, "max_model_len must be a positive integer"),
    ("max_num_seqs", -1, "max_num_seqs must be a positive integer"),
    ("max_num_batched_tokens", 1.5, "max_num_batched_tokens must be a positive integer"),
    ("block_size", True, "block_size must be a positive integer"),
    ("threads", 0, "threads must be a positive integer"),
    ("max_waiting", -1, "max_waiting must be >= 0"),
    ("weights_mode", "fast", "weights mode must be 'resident' or 'lean'"),
    ("kv_cache_dtype", "int3", "kv_cache_dtype must be one of"),
    ("speculative_config", "{not json", "--speculative-config is not valid JSON"),
])
def test_validate_names_the_bad_option_before_anything_loads(field, value, says):
    args = EngineArgs(model="/nonexistent.gguf", **{field: value})
    with pytest.raises(ValueError, match=says):
        args.validate()
    with pytest.raises(ValueError, match=says):    # the builder validates before it opens the file
        args.create_engine()


def test_llm_and_the_cli_resolve_the_same_context_length():
    """Issue 33 item 8: `LLM()` and `pyengine generate` both take the model's trained context when one sequence's
    KV cache fits (SmolLM2: 8192, the GGUF's own context_length), no longer 2048 against 8192."""
    path = model_path("smollm2")
    gguf = GGUFFile(path)
    trained = int(gguf.metadata["llama.context_length"])
    api = EngineArgs(model=path)                  # what LLM(path) builds from
    api.load_model()
    from pyengine.cli import generate
    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    cli = EngineArgs.from_cli_args(p.parse_args(["hi", "--model", path]))
    cli.load_model()
    assert api.max_model_len == cli.max_model_len == default_max_model_len(gguf) == trained == 8192
    assert api.model_context == trained
    with pytest.raises(ValueError, match="exceeds the model's context length 8192"):
        EngineArgs(model=path, max_model_len=8193).load_model()


def test_every_engine_command_spells_weights_and_threads_the_same():
    """--weights resident|lean and --threads N on generate, chat, serve, perplexity and bench engine."""
    for name in ("generate", "chat", "serve", "perplexity"):
        p = argparse.ArgumentParser()
        importlib.import_module(f"pyengine.cli.{name}").add_arguments(p)
        extra = {"generate": ["hi"], "perplexity": ["--file", "x.txt"]}.get(name, [])
        a = p.parse_args(extra + ["--weights", "lean", "--threads", "1"])
        assert (a.weights_mode, a.threads) == ("lean", 1), name
        with pytest.raises(SystemExit):
            p.parse_args(extra + ["--weights", "fast"])
        if name != "perplexity":
            e = EngineArgs.from_cli_args(a)
            assert (e.weights_mode, e.threads) == ("lean", 1)
    from pyengine.bench import engine as bench_engine
    p = argparse.ArgumentParser()
    bench_engine.add_arguments(p)
    a = p.parse_args(["--weights", "lean", "--threads", "1"])
    assert (a.weights, a.threads) == ("lean", 1)


def test_serve_flags_become_engine_args():
    from pyengine.cli import serve
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    a = EngineArgs.from_cli_args(p.parse_args(["--max-num-seqs", "3", "--no-prefix-cache", "--tensor-parallel-size",
                                               "2", "--kv-cache-dtype", "q8_0", "--max-waiting", "5"]))
    # the step budget is resolved with the model (S21: 2048, or 8 with --weights lean)
    assert (a.max_num_seqs, a.max_num_batched_tokens, a.enable_prefix_caching, a.enable_chunked_prefill) == \
        (3, None, False, True)
    assert (a.tensor_parallel_size, a.num_ranks, a.kv_cache_dtype, a.max_waiting) == (2, 2, "q8_0", 5)
    with pytest.raises(ValueError, match="mpiexec -n 2"):      # more ranks need an MPI executor
        a.create_engine()


def test_engine_over_a_runner_takes_its_limits_and_refuses_larger_ones(tiny):
    args = EngineArgs(model=tiny, max_model_len=128, max_num_seqs=3, max_num_batched_tokens=40, threads=1)
    runner = args.create_runner()
    from pyengine.engine.llm_engine import LLMEngine
    eng = LLMEngine(runner=runner, tokenizer=FakeTokenizer())
    assert (eng.max_model_len, eng.scheduler.max_num_seqs, eng.config.max_num_batched_tokens) == (128, 3, 40)
    with pytest.raises(ValueError, match="max_num_seqs=4 exceeds the model runner's max_num_seqs=3"):
        LLMEngine(runner=runner, tokenizer=FakeTokenizer(), max_num_seqs=4)
    with pytest.raises(ValueError, match="takes no other options"):
        LLMEngine(args, LocalExecutor(runner), max_num_seqs=2)


def test_the_builder_and_the_keyword_form_give_the_same_tokens(tiny):
    """EngineArgs.create_engine and LLMEngine(model, **options) build the same engine: same greedy tokens as the
    runner's own greedy loop (an engine-free reference)."""
    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.sampling_params import SamplingParams
    kw = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64, threads=1)
    prompt = [5, 9, 13, 2, 7, 11]
    ref = EngineArgs(model=tiny, **kw).create_runner().generate_greedy(prompt, 6)
    for eng in (EngineArgs(model=tiny, **kw).create_engine(tokenizer=WideTokenizer()),
                LLMEngine(tiny, tokenizer=WideTokenizer(), **kw)):
        assert isinstance(eng.executor, Executor) and isinstance(eng.runner, Runner)
        eng.add_request("a", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6,
                                                                          ignore_eos=True))
        out = None
        while eng.has_unfinished_requests():
            out = next((o for o in eng.step() if o.finished), out)
        assert out.outputs[0].token_ids == ref


def test_threads_are_set_through_threadpoolctl_and_the_environment_wins(monkeypatch):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from pyengine.engine import threads as T

    def blas():
        return max(i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas")

    before = blas()
    try:
        assert T.apply_threads(2) == 2 and blas() == 2          # read back through threadpoolctl itself
        assert "2 (asked for; set by threadpoolctl)" in T.describe()
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
        assert T.default_threads() == (1, "from the environment")
        assert T.apply_threads(None) == 1 and blas() == 1
        monkeypatch.delenv("OPENBLAS_NUM_THREADS")
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        n, why = T.default_threads()
        assert 1 <= n <= min(T.usable_cores(), T.tuning.DEFAULT_THREADS_MAX) and "usable core" in why
        idle = T.idle_cores(0.02)
        assert idle is None or 0.0 <= idle <= T.usable_cores() + 1e-9
        monkeypatch.setattr(T, "idle_cores", lambda sample_s=None: 0.3)   # every core busy: back off to 1
        monkeypatch.setattr(T.tuning, "DEFAULT_THREADS_MAX", 2)
        monkeypatch.setattr(T, "usable_cores", lambda: 2)
        assert T.default_threads() == (1, "2 usable cores, at most 2 by default, 0.3 idle now")
    finally:
        T.apply_threads(before)


def test_named_contracts():
    """Every registered architecture module, both executors and the proposer registry meet their protocols."""
    from pyengine.engine import spec_decode
    from pyengine.engine.proposers import PROPOSERS, NgramProposer, Proposer, ngram_lookup
    from pyengine.models import ARCHITECTURES
    from pyengine.models.contract import ArchitectureModule
    from pyengine.parallel.executor import MPIExecutor
    for arch, name in ARCHITECTURES.items():
        mod = importlib.import_module(name)
        assert isinstance(mod, ArchitectureModule) and mod.ARCH == arch, name
    group = type("Group", (), {"groups": 2, "failure": None})()
    assert isinstance(MPIExecutor(type("R", (), {"held": {}})(), group), Executor)
    assert isinstance(LocalExecutor(object()), Executor)
    assert set(PROPOSERS) == set(spec_decode.METHODS)
    cfg = spec_decode.SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    proposer = PROPOSERS["ngram"](cfg, None, 64)
    assert isinstance(proposer, NgramProposer) and isinstance(proposer, Proposer)
    tokens = np.random.default_rng(4).integers(0, 5, 60)
    seq = type("Seq", (), {"token_ids": tokens.tolist(), "seq_id": 0})()
    drafts = proposer.propose([seq], [3])       # the registry's proposer against the plain scan
    assert drafts[0][0] == ngram_lookup(tokens, 3, cfg.prompt_lookup_min, cfg.prompt_lookup_max) != []
    with pytest.raises(ValueError, match="speculative_config method must be one of"):
        from pyengine.engine.proposers import make_proposer
        make_proposer(type("C", (), {"method": "eagle"})())
