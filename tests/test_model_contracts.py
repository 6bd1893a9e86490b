"""S03/S06/S09/S17: the contracts every architecture in the registry keeps, on tiny random GGUFs of each
(tests/tiny_models.py): the fast paged forward equals the readable ``forward_reference``; chunked prefill and
decode steps equal it too; a ragged batch equals each sequence alone; shuffled block tables equal contiguous
ones; lean weights equal resident ones; tensor and pipeline parallelism over MPI equal one process. A new architecture gets all of
these by adding its shape to tests/tiny_models.py."""
from __future__ import annotations

import numpy as np
import pytest

from pyengine.engine.forward_batch import ForwardBatch
from pyengine.engine.model_runner import ModelRunner
from pyengine.models import ARCHITECTURES
from tiny_models import ARCH_OF, ARCHS, NEW, SLIDING_WINDOW, VOCAB, write_tiny

BS = 8
KW = dict(max_model_len=256, max_num_batched_tokens=160, max_num_seqs=8, num_blocks=120, block_size=BS,
          flash_min_query=24)


def test_every_registered_architecture_has_a_tiny_model():
    assert sorted(set(ARCH_OF[v] for v in ARCHS)) == sorted(ARCHITECTURES)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf", request.param, seed=3)
    return request.param, str(path), ModelRunner(str(path), **KW)


def close(a, b, tol=2e-4):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max())


def ids(n, seed):
    return np.random.default_rng(seed).integers(3, VOCAB, n)


def table(n_tokens, rng=None, pool=None):
    n = -(-n_tokens // BS)
    if rng is None:
        return np.arange(n, dtype=np.int32)
    return pool[:n]


def test_fast_forward_equals_the_reference(tiny):
    """A 70-token prompt (tiled flash attention; past gemma3's sliding window) at every position."""
    _, _, r = tiny
    toks = ids(70, 1)
    ref = r.model.forward_reference(toks)
    fast = r.run(r.contiguous_batch(toks, 0, logits_all=True))
    assert close(fast, ref)


def test_chunks_and_decodes_equal_the_reference(tiny):
    """The same prompt in chunks of 9 (short queries: batched like decodes) and of 30 (plain attention), then
    decode steps: every row equals the reference's."""
    _, _, r = tiny
    toks = ids(80, 2)
    ref = r.model.forward_reference(toks)
    for chunk in (9, 30):
        pos = 0
        while pos < 70:
            n = min(chunk, 70 - pos)
            got = r.run(r.contiguous_batch(toks[pos:pos + n], pos, logits_all=True))
            assert close(got, ref[pos:pos + n]), (chunk, pos)
            pos += n
        for p in range(70, 80):                                  # decodes
            got = r.run(r.contiguous_batch(toks[p:p + 1], p))
            assert close(got[0], ref[p]), p


def test_ragged_batch_with_shuffled_tables_equals_each_alone(tiny):
    """Three prompts (30, 5, 50 tokens) in one ragged batch through shuffled block tables = each alone through
    contiguous ones; then one step with a decode, a 3-token and a 7-token query (speculative verification's
    shape) = each alone."""
    _, _, r = tiny
    rng = np.random.default_rng(7)
    lens = [30, 5, 50]
    prompts = [ids(n + 12, 10 + s) for s, n in enumerate(lens)]
    pool = rng.permutation(r.num_blocks - 20).astype(np.int32) + 20       # blocks 0..19: the "alone" runs
    per = -(-70 // BS)
    tables = [pool[s * per:(s + 1) * per] for s in range(3)]
    together = r.run(ForwardBatch(np.concatenate([p[:n] for p, n in zip(prompts, lens)]),
                                  np.concatenate([np.arange(n) for n in lens]), lens, lens, tables,
                                  np.cumsum(lens) - 1)).copy()
    for s, n in enumerate(lens):
        alone = r.run(r.contiguous_batch(prompts[s][:n], 0))
        assert close(together[s], alone[0]), s
        assert close(alone[0], r.model.forward_reference(prompts[s][:n])[-1])
    q = [1, 3, 7]
    order = [2, 0, 1]
    batch = ForwardBatch(np.concatenate([prompts[s][lens[s]:lens[s] + q[k]] for k, s in enumerate(order)]),
                         np.concatenate([np.arange(lens[s], lens[s] + q[k]) for k, s in enumerate(order)]),
                         q, [lens[s] + q[k] for k, s in enumerate(order)], [tables[s] for s in order],
                         np.arange(sum(q)))
    got = r.run(batch).copy()
    row = 0
    for k, s in enumerate(order):
        ref = r.model.forward_reference(prompts[s][:lens[s] + q[k]])[lens[s]:]
        assert close(got[row:row + q[k]], ref), s
        row += q[k]


def test_lean_weights_equal_resident(tiny):
    _, path, r = tiny
    lean = ModelRunner(path, weights_mode="lean", **KW)
    assert lean.weights.nbytes < r.weights.nbytes / 2
    toks = ids(40, 4)
    a = r.run(r.contiguous_batch(toks, 0, logits_all=True)).copy()
    b = lean.run(lean.contiguous_batch(toks, 0, logits_all=True))
    assert close(a, b, 1e-5)
    assert close(lean.model.forward_reference(toks), a)


def test_lean_few_row_matvecs_equal_one_product(tiny):
    """LeanLinear runs 2..LEAN_ROW_LOOP_MAX rows as matvecs over the freshly dequantized rows, more as one
    product: both equal x @ W in float64 (W the matrix the GGUF holds, dequantized whole)."""
    from pyengine import tuning
    _, path, _ = tiny
    lean = ModelRunner(path, weights_mode="lean", **KW)
    rng = np.random.default_rng(3)
    for _, lin in lean.weights.linears():
        w = lin.dense().astype(np.float64)
        for n in (1, 2, tuning.LEAN_ROW_LOOP_MAX, tuning.LEAN_ROW_LOOP_MAX + 1):
            x = rng.standard_normal((n, lin.shape[0])).astype(np.float32)
            out = np.empty((n, lin.shape[1]), np.float32)
            assert lin.matmul(x, out) is out
            assert np.abs(out - x @ w).max() <= 1e-4 * max(1.0, np.abs(x @ w).max())


def test_unsupported_weights_mode_and_architecture_are_refused(tiny, tmp_path):
    _, path, _ = tiny
    with pytest.raises(ValueError, match="weights mode"):
        ModelRunner(path, weights_mode="fast", **KW)


def test_gemma3_sliding_layers_read_only_their_window(tmp_path):
    """A decode at position 150: the global layers gather all 19 blocks, the sliding-window layers only the
    blocks holding the last SLIDING_WINDOW positions (their cost stops growing with the context); a prompt's
    run starts its keys at the window too."""
    r = ModelRunner(str(write_tiny(tmp_path / "g.gguf", "gemma3", seed=1)), **KW)
    assert r.model.windows == [SLIDING_WINDOW, None] and r.model.kind_of == [0, 0, 1]
    t = np.arange(20, dtype=np.int32)[::-1].copy()                       # scattered: gathered, not in place
    plan = r.plan(ForwardBatch(np.array([5]), np.array([150]), [1], [151], [t], np.array([0])))
    local, full = (k.attention for k in plan.kinds)
    (g_local,), (g_full,) = local.groups, full.groups
    assert g_full.blocks.shape == (1, 19) and list(g_full.blocks[0]) == list(t[:19])
    first = 150 - SLIDING_WINDOW + 1
    assert g_local.blocks.shape[1] == 19 - first // BS and list(g_local.blocks[0]) == list(t[first // BS:19])
    plan = r.plan(ForwardBatch(ids(60, 8), np.arange(100, 160), [60], [160], [t], np.array([59])))
    (run_local,), (run_full,) = plan.kinds[0].attention.runs, plan.kinds[1].attention.runs
    assert (run_local.keys.first, run_local.offset) == (100 - SLIDING_WINDOW + 1, SLIDING_WINDOW - 1)
    assert (run_full.keys.first, run_full.offset) == (0, 100)


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("variant", [v for v in ARCHS if v not in NEW])
def test_mpi_parallel_equals_one_process(variant, tmp_path, tp, pp):
    """S17 over MPI (tests/mpi_check.py under mpiexec): Megatron tensor parallelism by heads and FFN columns (4
    ranks: more than the 2 KV heads, so each KV head is replicated on 2 ranks that split its query heads),
    pipeline stages, and both: a 33-token prompt, a decode and a 20-token pass equal one process. (Issue 30's
    architectures: test_mpi_new_architectures_equal_one_process, all in one job.)"""
    from test_mpi_parallel import reference, run_mpi
    path = str(write_tiny(tmp_path / f"{variant}.gguf", variant, seed=3))
    passes = [[33, 5], [1, 6], [20, 7]]
    res, got = run_mpi(tmp_path, path, tp, pp, kw=KW, logits=passes)
    want, _ = reference(path, kw=KW, logits=passes)
    if pp > 1:                                   # the passes again under cross-step pipelining (mpi_check.py)
        got, want = got + res["logits_cross"], want + want
    for a, b in zip(got, want, strict=True):
        assert close(a, b)
    assert len(res["stats"]) == tp * pp


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
@pytest.mark.parametrize("variant", ["qwen2moe", "olmoe"])
def test_mpi_moe_greedy_and_logits_equal_one_process(tmp_path, variant, tp, pp):
    """S17 on the two MoE layouts that once refused tensor parallelism — Qwen2-MoE (QKV biases, a shared expert)
    and OLMoE (q/k norms over all heads): routed experts split across the tensor ranks (expert parallelism, 4 of
    the 8 each), the shared expert by its columns, the norms' statistic summed over the ranks. Logits within
    1e-4 of one process and batched greedy continuations identical, for TP 2 and PP 2."""
    from test_mpi_parallel import reference, run_mpi
    path = str(write_tiny(tmp_path / f"{variant}.gguf", variant, seed=5))
    passes = [[33, 5], [1, 6], [20, 7]]
    prompts = [ids(n, 20 + n).tolist() for n in (3, 11, 26, 7)]
    res, got = run_mpi(tmp_path, path, tp, pp, kw=KW, logits=passes, prompts=prompts, runner_greedy=True)
    want, greedy = reference(path, kw=KW, logits=passes, prompts=prompts, runner_greedy=True)
    for a, b in zip(got, want):
        assert close(a, b, 1e-4)
    assert res["greedy"] == greedy and len(set(map(tuple, greedy))) > 1    # not one repeated token stream
    parts = res["parts"]
    if tp == 2:
        assert [p["experts"] for p in parts] == [[0, 4], [4, 8]]
        if variant == "qwen2moe":
            assert [p["shared"] for p in parts] == [[0, 32], [32, 64]]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_mpi_new_architectures_equal_one_process(tmp_path, tp, pp):
    """S17 on issue 30's architectures (tiny_models.NEW: Q|K|V biases and an output bias, per-head q/k norms and a
    head dim != d / H, ...), every one in turn in one MPI job (one start-up): TP 2 splits each by the split its
    layer declares, PP 2 by stages; a 33-token prompt, a decode and a 20-token pass (PP: also under cross-step
    pipelining) within 2e-4 and batched greedy continuations identical to one process."""
    from test_mpi_parallel import reference, run_mpi
    paths = [str(write_tiny(tmp_path / f"{v}.gguf", v, seed=3)) for v in NEW]
    passes = [[33, 5], [1, 6], [20, 7]]
    prompts = [ids(n, 30 + n).tolist() for n in (3, 11, 26)]
    results = run_mpi(tmp_path, paths, tp, pp, kw=KW, logits=passes, prompts=prompts, runner_greedy=True)
    assert len(results) == len(NEW)
    for variant, path, (res, got) in zip(NEW, paths, results):
        want, greedy = reference(path, kw=KW, logits=passes, prompts=prompts, runner_greedy=True)
        if pp > 1:
            got, want = got + res["logits_cross"], want + want
        for a, b in zip(got, want, strict=True):
            assert close(a, b), variant
        assert res["greedy"] == greedy and len(set(map(tuple, greedy))) > 1, variant
        assert len(res["stats"]) == tp * pp


def test_every_architecture_declares_its_tensor_parallel_split(tiny):
    """Issue 30.7: each model class says how every field of its layers splits (parallel/shard.py carries the
    kinds out and names no architecture); an undeclared field is refused by name."""
    import inspect

    from pyengine.parallel import shard
    variant, _, r = tiny
    L = r.weights.layers[0]
    split = shard.split_of(r.model, L)
    assert set(L._fields) <= set(split) and set(split.values()) <= set(shard.SPLIT_KINDS)
    src = inspect.getsource(shard)
    assert not [a for a in ARCHITECTURES if f'"{a}"' in src or f"'{a}'" in src]

    class Undeclared(type(r.model)):
        tp_split = {k: v for k, v in split.items() if k != "wo"}
    with pytest.raises(ValueError, match="declares no split for the layer fields \\['wo'\\]"):
        shard.split_of(_with_config(Undeclared, r), L)


def _with_config(cls, r):
    m = cls.__new__(cls)
    m.config = r.config
    return m
