"""S16 bad input: a GGUF whose experts disagree with its metadata is refused with a message naming the tensor
or key; expert_used_count > expert_count and unknown gating functions likewise. Also the router's maths on its
own against a plain per-token reading of the definition (sigmoid gating, selection bias, scale)."""
from __future__ import annotations

import numpy as np
import pytest

import tiny_models
from pyengine.engine.model_runner import ModelRunner
from pyengine.gguf import GGUFError
from pyengine.layers.moe import MoEConfig, gate_probs, route
from tiny_models import write_tiny


def load(path):
    return ModelRunner(str(path), max_model_len=64, max_num_batched_tokens=32, max_num_seqs=2)


@pytest.mark.parametrize("variant", ["qwen3moe", "mixtral"])
def test_expert_count_disagreeing_with_metadata_is_refused(tmp_path, variant):
    def fewer(t):
        t["blk.0.ffn_up_exps.weight"] = t["blk.0.ffn_up_exps.weight"][:6]
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up_exps\.weight' has shape \(6, 32, 64\), expected "
                                         r"\(8, 32, 64\)"):
        load(write_tiny(tmp_path / "m.gguf", variant, edit=fewer))


def test_expert_rows_disagreeing_with_metadata_are_refused(tmp_path):
    def wider(t):
        t["blk.2.ffn_down_exps.weight"] = np.zeros((8, 64, 64), np.float32)
    with pytest.raises(ValueError, match=r"'blk\.2\.ffn_down_exps\.weight' has shape \(8, 64, 64\)"):
        load(write_tiny(tmp_path / "m.gguf", "qwen2moe", edit=wider))


def test_router_and_shared_gate_shapes_are_checked(tmp_path):
    def router(t):
        t["blk.1.ffn_gate_inp.weight"] = t["blk.1.ffn_gate_inp.weight"][:7]
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_gate_inp\.weight' has shape \(7, 64\)"):
        load(write_tiny(tmp_path / "a.gguf", "qwen2moe", edit=router))

    def gate(t):
        t["blk.0.ffn_gate_inp_shexp.weight"] = t["blk.0.ffn_gate_inp_shexp.weight"][:10]
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate_inp_shexp\.weight' has shape \(10,\)"):
        load(write_tiny(tmp_path / "b.gguf", "qwen2moe", edit=gate))


def test_missing_expert_tensor_is_named(tmp_path):
    def drop(t):
        del t["blk.1.ffn_gate_exps.weight"]
    with pytest.raises(Exception, match=r"blk\.1\.ffn_gate_exps\.weight"):
        load(write_tiny(tmp_path / "m.gguf", "qwen3moe", edit=drop))


def test_shared_expert_promised_by_the_metadata_must_exist(tmp_path):
    def drop(t):
        del t["blk.2.ffn_down_shexp.weight"]
    with pytest.raises(Exception, match=r"blk\.2\.ffn_down_shexp\.weight"):
        load(write_tiny(tmp_path / "m.gguf", "qwen2moe", edit=drop))


def test_more_experts_used_than_exist_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_models, "N_USED", 9)
    with pytest.raises(GGUFError, match=r"'qwen3moe\.expert_used_count' = 9 exceeds 'qwen3moe\.expert_count' = 8"):
        load(write_tiny(tmp_path / "m.gguf", "qwen3moe"))


def test_unknown_gating_function_is_refused(tmp_path):
    with pytest.raises(GGUFError, match=r"'llama\.expert_gating_func' = 7 is not a known gating function"):
        load(write_tiny(tmp_path / "m.gguf", "mixtral", extra_meta={"llama.expert_gating_func": 7}))


@pytest.mark.parametrize("md, match", [
    ({"a.expert_count": 8}, "'a.expert_used_count' is missing"),
    ({"a.expert_count": 0, "a.expert_used_count": 1}, "'a.expert_count' = 0 must be an integer >= 1"),
    ({"a.expert_count": 8, "a.expert_used_count": 2, "a.expert_weights_scale": -1.0}, "must be a positive"),
    ({"a.expert_count": 8, "a.expert_used_count": 2, "a.expert_weights_norm": 3}, "must be a bool"),
])
def test_bad_moe_metadata_is_refused(md, match):
    with pytest.raises(GGUFError, match=match):
        MoEConfig.from_gguf(md, "a", expert_ffn_default=32)


def test_sigmoid_gating_with_selection_bias_and_scale():
    """DeepSeek-V3-style routing (gating func 2, exp_probs_b bias, weights scale): per token, the top-k of
    sigmoid(logit) + bias by a sort, the weights sigmoid(logit) renormalised then scaled."""
    m = MoEConfig.from_gguf({"a.expert_count": 16, "a.expert_used_count": 4, "a.expert_gating_func": 2,
                             "a.expert_weights_norm": True, "a.expert_weights_scale": 2.5}, "a", 32)
    assert m.gating == "sigmoid"
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 16)).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32)
    sel, w = route(gate_probs(logits.copy(), m.gating), m, bias)
    for t in range(50):
        p = 1.0 / (1.0 + np.exp(-logits[t].astype(np.float64)))
        want = sorted(np.argsort(-(p + bias), kind="stable")[:4])
        assert sorted(sel[t]) == want
        got = dict(zip(sel[t].tolist(), w[t].tolist()))
        ref = p[want] / p[want].sum() * 2.5
        assert np.allclose([got[e] for e in want], ref, rtol=1e-5)
