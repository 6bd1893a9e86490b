"""Record tests/golden/rope_scaling.json: RoPE inverse frequencies and cos/sin tables computed by HF transformers'
own rope init functions (`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`, and the rotary embedding's
`compute_default_rope_parameters` for unscaled RoPE), the independent reference for pyengine/layers/rotary.py.

Run outside CI with the reference venv:  /work/refvenv/bin/python scripts/make_golden_rope.py
More cases (e.g. another architecture's RoPE) are added by appending to CASES below; tests/test_rope_scaling.py
runs every case in the file and fails on a `rope_type` it does not know how to map onto pyengine's arguments.
HF computes in float32, so the file also records the dtype and the tests compare at float32 precision.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

OUT = Path(__file__).resolve().parent.parent / "tests" / "golden" / "rope_scaling.json"
POSITIONS = [0, 1, 2, 17, 100, 1000, 4095]

# name, head_dim, n_heads, rope_parameters (HF's names), context, and what a GGUF of that model would carry
# (llama.cpp's keys: llama.rope.scaling.type / .factor / .original_context_length), or None when llama.cpp
# stores the scaling differently (llama3: the converter writes a rope_freqs.weight tensor of per-dimension factors).
CASES = [
    dict(name="none_smollm2", head_dim=64, n_heads=9,
         rope={"rope_type": "default", "rope_theta": 100000.0}, context=8192,
         gguf={"type": "none", "factor": None, "orig": None}),
    dict(name="none_theta1e6_hd256", head_dim=256, n_heads=4,
         rope={"rope_type": "default", "rope_theta": 1000000.0}, context=32768,
         gguf={"type": "none", "factor": None, "orig": None}),
    dict(name="linear_llama2_x2", head_dim=128, n_heads=32,
         rope={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, context=8192,
         gguf={"type": "linear", "factor": 2.0, "orig": 4096}),
    dict(name="linear_hd256_x8", head_dim=256, n_heads=4,
         rope={"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}, context=32768,
         gguf={"type": "linear", "factor": 8.0, "orig": 4096}),
    dict(name="linear_smollm2_x4", head_dim=64, n_heads=9,
         rope={"rope_type": "linear", "rope_theta": 100000.0, "factor": 4.0}, context=32768,
         gguf={"type": "linear", "factor": 4.0, "orig": 8192}),
    dict(name="llama3_llama31_8b", head_dim=128, n_heads=32,
         rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, context=131072,
         gguf={"type": "llama3", "factor": 8.0, "orig": 8192}),
    dict(name="llama3_llama32_1b", head_dim=64, n_heads=32,
         rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, context=131072,
         gguf={"type": "llama3", "factor": 32.0, "orig": 8192}),
    dict(name="llama3_smollm2_shape", head_dim=64, n_heads=9,
         rope={"rope_type": "llama3", "rope_theta": 100000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 2048}, context=8192,
         gguf={"type": "llama3", "factor": 4.0, "orig": 2048}),
    dict(name="llama3_custom_band", head_dim=128, n_heads=8,
         rope={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 16.0, "low_freq_factor": 2.0,
               "high_freq_factor": 8.0, "original_max_position_embeddings": 4096}, context=65536,
         gguf=None),   # non-default band edges: llama.cpp's keys cannot express them
    # YaRN (issue 30): Qwen2.5-7B-Instruct's documented long-context setting, SmolLM2's shape, and non-default
    # betas (llama.cpp's rope.scaling.yarn_beta_fast / yarn_beta_slow keys)
    dict(name="yarn_qwen25_7b_x4", head_dim=128, n_heads=28,
         rope={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
               "original_max_position_embeddings": 32768}, context=131072,
         gguf={"type": "yarn", "factor": 4.0, "orig": 32768}),
    dict(name="yarn_smollm2_shape_x4", head_dim=64, n_heads=9,
         rope={"rope_type": "yarn", "rope_theta": 100000.0, "factor": 4.0,
               "original_max_position_embeddings": 2048}, context=8192,
         gguf={"type": "yarn", "factor": 4.0, "orig": 2048}),
    dict(name="yarn_betas_x8", head_dim=64, n_heads=8,
         rope={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0,
               "original_max_position_embeddings": 2048}, context=16384,
         gguf={"type": "yarn", "factor": 8.0, "orig": 2048, "beta_fast": 16.0, "beta_slow": 2.0}),
]


def record(case: dict) -> dict:
    cfg = LlamaConfig(hidden_size=case["head_dim"] * case["n_heads"], num_attention_heads=case["n_heads"],
                      head_dim=case["head_dim"], max_position_embeddings=case["context"],
                      rope_parameters=dict(case["rope"]))
    kind = case["rope"]["rope_type"]
    if kind == "default":
        inv, scale = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        inv, scale = ROPE_INIT_FUNCTIONS[kind](cfg)
    emb = LlamaRotaryEmbedding(cfg)
    assert torch.equal(emb.inv_freq, inv), "the rotary module and the init function disagree"
    x = torch.zeros(1, len(POSITIONS), case["head_dim"], dtype=torch.float32)
    cos, sin = emb(x, torch.tensor([POSITIONS]))
    half = case["head_dim"] // 2                      # HF repeats the table for the two halves: keep one
    default_inv, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(
        LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=case["n_heads"], head_dim=case["head_dim"],
                    rope_parameters={"rope_type": "default", "rope_theta": case["rope"]["rope_theta"]}))
    return {**case, "dtype": str(inv.dtype).replace("torch.", ""), "attention_scaling": float(scale),
            "inv_freq": inv.tolist(), "unscaled_inv_freq": default_inv.tolist(), "positions": POSITIONS,
            "cos": cos[0, :, :half].tolist(), "sin": sin[0, :, :half].tolist()}


def main():
    golden = {
        "source": f"transformers {transformers.__version__} (torch {torch.__version__}): "
                  "modeling_rope_utils.ROPE_INIT_FUNCTIONS and LlamaRotaryEmbedding (compute_default_rope_parameters, "
                  "forward) -- recorded by scripts/make_golden_rope.py",
        "cases": [record(c) for c in CASES],
    }
    cases = ",\n".join(json.dumps(c) for c in golden["cases"])      # one case a line: appending stays a small diff
    OUT.write_text(f'{{"source": {json.dumps(golden["source"])},\n"cases": [\n{cases}\n]}}\n')
    print(f"wrote {OUT} ({len(golden['cases'])} cases)")


if __name__ == "__main__":
    main()
