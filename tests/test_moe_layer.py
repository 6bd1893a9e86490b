"""S16 layers/moe.py on its own: the grouped fast path equals the per-token reading (``moe_reference``) for a
prompt-sized and a decode-sized step, with and without a shared expert; lean weights dequantize exactly the
experts a step routes to (three matrices each, once per step) into the arena's lean scratch; the expert load
counts what was routed."""
from __future__ import annotations

import numpy as np
import pytest

import pyengine.layers.moe as moe_mod
from pyengine.engine.model_runner import ModelRunner
from pyengine.layers.moe import moe_forward, moe_reference
from tiny_models import N_EXPERTS, N_USED, write_tiny

KW = dict(max_model_len=64, max_num_batched_tokens=48, max_num_seqs=2)


@pytest.mark.parametrize("variant", ["qwen2moe", "mixtral"])
@pytest.mark.parametrize("T", [1, 3, 48])
def test_grouped_equals_per_token(tmp_path, variant, T):
    r = ModelRunner(str(write_tiny(tmp_path / "m.gguf", variant, seed=4)), **KW)
    L = r.weights.layers[0]
    x = np.random.default_rng(T).standard_normal((T, r.config.d_model)).astype(np.float32)
    out = np.empty_like(x)
    counts = moe_forward(L.moe, r.config.moe, x, out, r.buffers.rows(T).moe, L.w_gate_up, L.w_down)
    ref = moe_reference(L.moe, r.config.moe, x, L.w_gate_up, L.w_down)
    assert np.abs(out - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    assert counts.sum() == T * N_USED and len(counts) == N_EXPERTS


def test_lean_dequantizes_only_the_routed_experts_into_arena_scratch(tmp_path, monkeypatch):
    r = ModelRunner(str(write_tiny(tmp_path / "m.gguf", "qwen3moe", seed=5)), weights_mode="lean", **KW)
    experts = r.weights.layers[0].moe.experts
    assert experts.scratch is r.buffers.lean                     # bound by the runner, not allocated per call
    calls = []
    real = moe_mod.quants.dequantize
    stacked = [q for L in r.weights.layers if L.moe is not None for q, _ in L.moe.experts.q]

    def counting(raw, t, shape, out=None):            # only the experts' rows (the quants module is shared)
        if any(np.shares_memory(raw, q) for q in stacked):
            calls.append(out is not None and np.shares_memory(out, r.buffers.lean))
        return real(raw, t, shape, out=out)
    monkeypatch.setattr(moe_mod.quants, "dequantize", counting)
    before = r.model.expert_load.counts.copy()
    r.run(r.contiguous_batch([5], 0))                            # one decode token: k experts per MoE layer
    moe_layers = [i for i, L in enumerate(r.weights.layers) if L.moe is not None]
    assert len(calls) == 3 * N_USED * len(moe_layers) and all(calls)
    calls.clear()
    r.run(r.contiguous_batch(list(range(3, 40)), 1))             # 37 tokens: every touched expert once
    step = r.model.expert_load.counts[r.model.expert_load.step]
    touched = int(np.count_nonzero(step))
    assert len(calls) == 3 * touched and all(calls)
    assert (step.sum(axis=1) == 37 * N_USED).all()
    assert r.model.expert_load.counts.sum() == before.sum() + (1 + 37) * N_USED * len(moe_layers)
