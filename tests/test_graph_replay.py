"""S13: a captured step replayed equals the plain step bit for bit (np.array_equal on the logits, not allclose),
for every architecture in the registry, over many steps whose batch composition changes (buckets captured,
replayed, evicted): decodes alone and batched, short multi-token queries with logits at every row (speculative
verification), prefix-shared and shuffled block tables (gathered contexts), a re-prefill after preemption; and
through the engine on the real model with prefix caching, preemption and n-gram speculation. The plain step is
the independent reference here: it runs the unrecorded functions (layers/*.py) the bound calls mirror."""
from __future__ import annotations

import numpy as np
import pytest

from pyengine.engine.forward_batch import ForwardBatch
from pyengine.engine.model_runner import ModelRunner
from tiny_models import ARCHS, VOCAB, write_tiny

BS = 8
KW = dict(max_model_len=256, max_num_batched_tokens=160, max_num_seqs=8, num_blocks=160, block_size=BS,
          flash_min_query=24)


def batch(work, tables, lens, all_rows=()):
    """One step: ``work`` [(seq, token ids)], each appended after ``lens[seq]`` cached tokens; logits at the
    last row of each sequence, or at all its rows for sequences in ``all_rows`` (verification)."""
    ids, pos, ql, cl, bt, li = [], [], [], [], [], []
    for s, toks in work:
        start = len(ids)
        ids += list(toks)
        pos += range(lens[s], lens[s] + len(toks))
        lens[s] += len(toks)
        ql.append(len(toks))
        cl.append(lens[s])
        bt.append(tables[s])
        li += list(range(start, len(ids))) if s in all_rows else [len(ids) - 1]
    return ForwardBatch(token_ids=np.array(ids, np.int64), positions=np.array(pos, np.int64), query_lens=ql,
                        context_lens=cl, block_tables=bt, logits_indices=np.array(li))


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    path = str(write_tiny(tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf", request.param, seed=5))
    return ModelRunner(path, enforce_eager=True, **KW), ModelRunner(path, **KW)


@pytest.fixture(scope="module", params=[("llama", "lean", "auto"), ("llama32", "resident", "q8_0"),
                                        ("gemma3", "resident", "fp16"), ("llama32", "lean", "q4_0")],
                ids=lambda p: "-".join(p))
def variant_pair(request, tmp_path_factory):
    """Lean weights (one call per product) and quantized / half KV caches (converted reads and gathers;
    "llama32": the benchmark's tiny llama with 32-wide heads, as ggml's KV blocks need)."""
    from pyengine.bench.replay import write_tiny as write_tiny_llama
    arch, mode, kv = request.param
    where = tmp_path_factory.mktemp(arch) / f"{arch}.gguf"
    path = (write_tiny_llama(str(where), seed=6, layers=3, vocab=VOCAB, heads=2) if arch == "llama32" else
            str(write_tiny(where, arch, seed=6)))
    kw = dict(KW, weights_mode=mode, kv_cache_dtype=kv)
    return ModelRunner(path, enforce_eager=True, **kw), ModelRunner(path, **kw)


def test_replayed_steps_equal_plain_steps_bit_for_bit(pair):
    check_steps(*pair)


def test_lean_weights_and_kv_dtypes_replay_bit_for_bit(variant_pair):
    check_steps(*variant_pair)


def check_steps(plain, replayed):
    assert plain.graphs is None and replayed.graphs is not None
    rng = np.random.default_rng(0)
    pool = rng.permutation(KW["num_blocks"]).astype(np.int32)
    # seq 0, 1: consecutive blocks (zero-copy reads when alone); 2: shuffled; 3 shares seq 0's first 2 blocks
    # (a prefix-cache hit) then its own; 4: consecutive, re-prefilled after a "preemption"
    tables = {0: np.arange(0, 32, dtype=np.int32), 1: np.arange(32, 64, dtype=np.int32), 2: pool[:32],
              3: np.concatenate([np.arange(0, 2), np.arange(64, 94)]).astype(np.int32),
              4: np.arange(96, 128, dtype=np.int32)}
    tables[2] = np.setdiff1d(pool, np.arange(0, 128), assume_unique=True)[:32].astype(np.int32)
    prompts = {s: rng.integers(3, VOCAB, n) for s, n in ((0, 30), (1, 5), (2, 40), (3, 12), (4, 20))}
    lens = {s: 0 for s in tables}
    state = {"plain": dict(lens), "replayed": dict(lens)}
    steps = 0

    def step(work, all_rows=()):
        nonlocal steps
        a = plain.run(batch(work, tables, state["plain"], all_rows)).copy()
        b = replayed.run(batch(work, tables, state["replayed"], all_rows))
        assert np.array_equal(a, b), (steps, [(s, len(t)) for s, t in work])
        steps += 1
        return a

    step([(0, prompts[0]), (1, prompts[1]), (2, prompts[2])])           # prompts: plain path
    state["plain"][3] = state["replayed"][3] = 16                        # seq 3 reuses seq 0's 16 tokens
    step([(3, prompts[3][:3])])                                          # a short query on a cached prefix
    step([(4, prompts[4])])
    for t in range(60):
        live = [s for s in (0, 1, 2, 3, 4) if t % (s + 2) or s == 0]     # composition changes each step
        if t == 30:                                                      # seq 4 preempted: recomputed
            state["plain"][4] = state["replayed"][4] = 0
            step([(4, rng.integers(3, VOCAB, 25))])
            continue
        verify = {1} if t % 7 == 3 else set()                           # seq 1 verifies 1 + 3 drafts
        work = [(s, rng.integers(3, VOCAB, 4 if s in verify else 1)) for s in live]
        step(work, verify)
    g = replayed.graphs
    assert g.replays > 10 and g.captures > 5 and g.unplanned > 0 and g.regroups > 0, \
        (g.captures, g.replays, g.unplanned, g.regroups)
    assert not set(g.by_batch.values()) - set(g.steps.values())
    assert steps == 63


def test_contexts_growing_and_buckets_evicted_still_equal(pair):
    """Decodes crossing block boundaries re-bind their groups' padded contexts (regroups, no recapture); with a
    cache of two buckets, three alternating compositions keep evicting and recapturing; every step still
    equals the plain one, and most replays skip the plan (``bind_batch``)."""
    from pyengine.engine.graph_replay import StepGraphs
    plain, replayed = pair
    replayed.graphs = g = StepGraphs(capacity=2)
    tables = {5: np.arange(128, 144, dtype=np.int32), 6: np.arange(144, 160, dtype=np.int32)}
    lens_a, lens_b = {5: 0, 6: 0}, {5: 0, 6: 0}
    rng = np.random.default_rng(1)
    for s, n in ((5, 30), (6, 20)):
        toks = rng.integers(3, VOCAB, n)
        plain.run(batch([(s, toks)], tables, lens_a))
        replayed.run(batch([(s, toks)], tables, lens_b))
    for t in range(45):
        work = [[(5, rng.integers(3, VOCAB, 1))], [(5, rng.integers(3, VOCAB, 1)), (6, rng.integers(3, VOCAB, 1))],
                [(6, rng.integers(3, VOCAB, 3))]][t % 3 if t >= 24 else 0]
        a = plain.run(batch(work, tables, lens_a, {6})).copy()
        b = replayed.run(batch(work, tables, lens_b, {6}))
        assert np.array_equal(a, b), t
    assert len(g.steps) == 2 and g.captures >= 5 and g.regroups >= 2 and g.unplanned > 20, \
        (g.captures, g.regroups, g.unplanned)
    assert not set(g.by_batch.values()) - set(g.steps.values())


def test_enforce_eager_reaches_the_runner_from_the_engine_and_the_cli(tmp_path):
    from pyengine.cli.generate import add_model_arguments
    from pyengine.engine.llm_engine import LLMEngine
    import argparse
    path = str(write_tiny(tmp_path / "llama.gguf", "llama"))
    from engine_fakes import FakeTokenizer
    runner = ModelRunner(path, **KW)
    LLMEngine(runner=runner, tokenizer=FakeTokenizer(), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=160,
              enforce_eager=True)
    assert runner.enforce_eager and runner.graphs is None
    runner.enforce_eager = False
    assert runner.graphs is not None
    p = argparse.ArgumentParser()
    add_model_arguments(p)
    assert p.parse_args(["--enforce-eager"]).enforce_eager and not p.parse_args([]).enforce_eager


@pytest.mark.slow
def test_engine_on_the_real_model_replays_bit_for_bit():
    """SmolLM2 through the engine: prefix caching (a shared prompt prefix), preemption (few KV blocks) and
    n-gram speculation (verification steps); every step's logits replayed = plain, so the tokens are equal."""
    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.model_files import default_model_path
    from pyengine.sampling_params import SamplingParams
    runner = ModelRunner(default_model_path(), max_model_len=256, num_blocks=14, block_size=16,
                         max_num_batched_tokens=256, max_num_seqs=4, max_logits=32)
    graphs = runner.graphs
    prefix = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    prompts = [prefix + "def mul(a, b):", prefix + "def div(a, b):", "1, 2, 3, 4, 5, 6,", "The capital of"]
    logged = {}

    def generate(mode):
        runner.graphs = None if mode == "plain" else graphs
        rows, inner = logged.setdefault(mode, []), runner.run

        def run(b):
            out = inner(b)
            rows.append(np.array(out))
            return out
        runner.run = run
        try:
            # no adaptive back-off: it reads wall-clock timings, so the two runs' batches could differ
            spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
            eng = LLMEngine(runner=runner, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256,
                            speculative_config=spec)
            for i, p in enumerate(prompts):
                eng.add_request(f"q{i}", p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            final = {}
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        final[out.request_id] = out.outputs[0].token_ids
            return [final[f"q{i}"] for i in range(len(prompts))], eng.stats()
        finally:
            del runner.run

    want, stats_plain = generate("plain")
    got, stats = generate("replayed")
    assert got == want
    assert len(logged["plain"]) == len(logged["replayed"])
    assert all(np.array_equal(a, b) for a, b in zip(logged["plain"], logged["replayed"]))
    assert graphs.replays >= 10 and graphs.captures >= 5
    assert stats["spec_decode_num_drafts"] > 0 and stats["num_preemptions"] > 0, stats


def test_silu_fold_is_exact(tmp_path):
    """fold_norms halves SwiGLU's gate columns at load (``silu_half``): the logits equal, bit for bit, those of
    the same weights with the gate restored and plain ``silu`` (halving is exact in binary floating point)."""
    path = str(write_tiny(tmp_path / "llama.gguf", "llama", seed=4))
    folded, restored = (ModelRunner(path, enforce_eager=True, **KW) for _ in range(2))
    for L in restored.weights.layers:
        assert L.w_gate_up.act == "silu_half"
        L.w_gate_up.scale_columns(L.w_gate_up.shape[1] // 2, 2.0)
        L.w_gate_up.act = "silu"
    toks = np.random.default_rng(0).integers(3, VOCAB, 60)
    a = folded.run(folded.contiguous_batch(toks, 0, logits_all=True)).copy()
    assert np.array_equal(a, restored.run(restored.contiguous_batch(toks, 0, logits_all=True)))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_verification_steps_in_any_order_replay_one_bucket(tmp_path, arch):
    """S13 bucket keys are order-free: 8 sequences verifying drafts (logits at every row, so the products run
    as sgemm over 26-32 rows and the head over all of them) come in a new order every step, with two patterns
    of draft lengths. Each pattern is captured once and then replayed in whatever order (``bind_batch`` puts
    the batch's sequences in the captured order and keeps the logits in the batch's), every step bit for bit
    the plain one. Before, every new order was a new bucket (a capture per step)."""
    path = str(write_tiny(tmp_path / f"{arch}.gguf", arch, seed=7))
    kw = dict(KW, max_logits=64)
    plain, replayed = ModelRunner(path, enforce_eager=True, **kw), ModelRunner(path, **kw)
    rng = np.random.default_rng(3)
    tables = {s: np.arange(20 * s, 20 * s + 20, dtype=np.int32) for s in range(8)}
    tables[3] = rng.permutation(np.arange(100, 120)).astype(np.int32)       # one gathered context
    lens_a, lens_b = {s: 0 for s in tables}, {s: 0 for s in tables}
    for s in tables:
        toks = rng.integers(3, VOCAB, 17 + 2 * s)              # long queries: plain, never captured
        plain.run(batch([(s, toks)], tables, lens_a))
        replayed.run(batch([(s, toks)], tables, lens_b))
    g, steps = replayed.graphs, 24
    for t in range(steps):
        drafts = [3] * 8 if t % 3 else [3, 3, 2, 3, 1, 3, 3, 2]          # per sequence s, drafts of length k
        order = rng.permutation(8)
        work = [(int(s), rng.integers(3, VOCAB, 1 + drafts[s])) for s in order]
        a = plain.run(batch(work, tables, lens_a, set(tables))).copy()
        b = replayed.run(batch(work, tables, lens_b, set(tables)))
        assert np.array_equal(a, b), (t, order)
    assert g.captures == 2 and g.replays == steps - 2 and g.unplanned == steps - 2, \
        (g.captures, g.replays, g.unplanned)


def test_bound_norm_equals_the_plain_function():
    """The bound one-row RMSNorm (scalar mean / eps / sqrt) against the plain function it replaces, bit for
    bit, over rows of very different scales (the sqrt's double rounding, eps dominating tiny rows)."""
    from pyengine.layers.norm import rms_norm, rms_norm_ops
    rng = np.random.default_rng(11)
    for d in (64, 576):
        for scale in (1e-6, 1e-3, 1.0, 1e3):
            for _ in range(50):
                x = (rng.standard_normal((1, d)) * scale).astype(np.float32)
                out, ms = np.empty_like(x), np.empty((1, 1), np.float32)
                for op in rms_norm_ops(x, None, 1e-5, out, ms):
                    op()
                assert np.array_equal(out, rms_norm(x, None, 1e-5)), (d, scale)
