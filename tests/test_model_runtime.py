"""S05/S21: the runner's memory discipline (arena, no per-token allocations), lean weights, bad input."""
import tracemalloc

import numpy as np
import pytest

from pyengine.engine.forward_batch import ForwardBatch
from pyengine.engine.model_runner import ModelRunner
from pyengine.gguf.reader import GGUFFile
from pyengine.model_files import default_model_path

PROMPT = [504, 3575, 282, 4649, 314, 253, 1345, 2767, 28, 351, 260, 1795, 282, 1038, 30]   # any ids < vocab


@pytest.fixture(scope="module")
def gguf():
    return GGUFFile(default_model_path())


@pytest.fixture(scope="module")
def runner(gguf):
    return ModelRunner(gguf, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=2)


def test_decode_allocates_nothing_model_sized(runner):
    """N decode steps under tracemalloc (which sees NumPy's buffers): the peak of new allocations per step is
    tiny next to one weight matrix and the arena, because every activation is an out= view of the arena."""
    runner.run(runner.contiguous_batch(PROMPT, 0))
    batches = [runner.contiguous_batch([PROMPT[i % len(PROMPT)]], len(PROMPT) + i) for i in range(7)]
    runner.run(batches[0])                     # warm-up (first-call caches; S13 captures the decode bucket)
    runner.run(batches[1])                     # and its first replay binds it (once per bucket, not per step)
    batches = batches[1:]
    tracemalloc.start()
    try:
        peaks = []
        for b in batches[1:]:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            logits = runner.run(b)
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
    smallest_weight = min(w.nbytes for _, w in runner.weights.linears())   # the (576, 576) Wo
    assert logits.base is not None and np.shares_memory(logits, runner.arena.buffer)
    assert max(peaks) < smallest_weight / 4, (peaks, smallest_weight)
    assert max(peaks) < runner.arena.nbytes / 500, (peaks, runner.arena.nbytes)


def test_arena_holds_all_runtime_state(runner):
    kv = runner.kv_cache
    assert np.shares_memory(kv.k, runner.arena.buffer) and np.shares_memory(kv.v, runner.arena.buffer)
    assert kv.k.shape == (30, runner.num_blocks, runner.block_size, 3, 64)
    summary = runner.arena.summary()
    for region in ("kv_cache", "act", "attn", "logits", "rope"):
        assert region in summary
    # the arena was sized from the limits: KV for num_blocks blocks + activations for 64 tokens
    kv_bytes = 2 * 30 * runner.num_blocks * runner.block_size * 3 * 64 * 4
    assert kv_bytes < runner.arena.nbytes < kv_bytes + 64 * 2**20


def test_default_num_blocks(gguf, runner):
    """Enough blocks for max_num_seqs full-length sequences, capped by the KV memory budget (but always at
    least one full-length sequence)."""
    assert runner.num_blocks == 2 * 128 // 16
    per_block = 2 * 30 * 16 * 3 * 64 * 4
    capped = ModelRunner(gguf, max_model_len=256, max_num_batched_tokens=16, max_num_seqs=64, weights_mode="lean",
                         kv_budget_bytes=40 * per_block)
    assert capped.num_blocks == 40
    tiny = ModelRunner(gguf, max_model_len=256, max_num_batched_tokens=16, max_num_seqs=64, weights_mode="lean",
                       kv_budget_bytes=1)
    assert tiny.num_blocks == 256 // 16


def test_lean_weights_give_the_same_logits(gguf, runner):
    """Lean mode keeps quantized bytes and dequantizes a layer at a time into the arena: same numbers."""
    lean = ModelRunner(gguf, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=2, weights_mode="lean")
    assert lean.weights.nbytes < runner.weights.nbytes / 5
    assert "lean" in lean.arena.summary()
    a = runner.run(runner.contiguous_batch(PROMPT, 0)).copy()
    b = lean.run(lean.contiguous_batch(PROMPT, 0)).copy()
    assert np.abs(a - b).max() <= 1e-4
    assert np.argmax(a) == np.argmax(b)
    b2 = lean.run(lean.contiguous_batch([int(np.argmax(b))], len(PROMPT)))
    a2 = runner.run(runner.contiguous_batch([int(np.argmax(a))], len(PROMPT)))
    assert np.abs(a2 - b2).max() <= 1e-4


def test_reference_and_fast_path_agree_on_every_position(runner):
    ref = runner.model.forward_reference(PROMPT)
    fast = runner.run(runner.contiguous_batch(PROMPT, 0, logits_all=True))
    assert np.abs(ref - fast).max() <= 1e-3


def test_accepts_bytes(gguf):
    with open(default_model_path(), "rb") as f:
        data = f.read()
    r = ModelRunner(data, max_model_len=32, max_num_batched_tokens=16, max_num_seqs=1, weights_mode="lean")
    assert r.config.n_layers == 30 and r.num_blocks >= 2


def test_refuses_unknown_architectures(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(path, "mamba")
    w.add_uint32("mamba.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'mamba' is not supported \(supported: gemma2, gemma3, granitemoe, llama, olmoe, phi3, qwen2, qwen2moe, qwen3, qwen3moe\)"):
        ModelRunner(str(path), max_model_len=32)


def test_max_model_len_beyond_the_trained_context_is_refused(gguf):
    with pytest.raises(ValueError, match="max_model_len 8193 exceeds the model's context length 8192"):
        ModelRunner(gguf, max_model_len=8193)


def test_bad_batches_raise_value_errors(runner):
    ok = runner.contiguous_batch(PROMPT, 0)
    cases = {
        "sum\\(query_lens\\)": ForwardBatch(ok.token_ids, ok.positions, [3], ok.context_lens, ok.block_tables,
                                           ok.logits_indices),
        "token_ids": ForwardBatch(np.full(15, 10**6), ok.positions, ok.query_lens, ok.context_lens,
                                  ok.block_tables, ok.logits_indices),
        "block_tables": ForwardBatch(ok.token_ids, ok.positions, ok.query_lens, ok.context_lens,
                                     [np.array([10**6], np.int32)], ok.logits_indices),
        "logits_indices": ForwardBatch(ok.token_ids, ok.positions, ok.query_lens, ok.context_lens,
                                       ok.block_tables, np.array([99])),
        "positions": ForwardBatch(ok.token_ids, ok.positions + 1, ok.query_lens, ok.context_lens,
                                  ok.block_tables, ok.logits_indices),
        "max_num_batched_tokens": runner.contiguous_batch(list(range(65)), 0),
    }
    for msg, batch in cases.items():
        with pytest.raises(ValueError, match=msg):
            runner.run(batch)
    with pytest.raises(ValueError, match="max_model_len"):
        ModelRunner(runner.gguf, max_model_len=0)
    with pytest.raises(ValueError, match="weights mode"):
        ModelRunner(runner.gguf, max_model_len=16, weights_mode="fast")
