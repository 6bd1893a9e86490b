"""Record tests/golden/generation_gemma3.json from HF transformers (the independent reference) for Gemma 3 270M.

Run with the reference venv (never in CI), after scripts/assemble_gemma.py:
    /work/refvenv/bin/python scripts/make_golden_gemma3.py [GGUF]

transformers dequantizes the GGUF to float32 (and undoes llama.cpp's +1 on Gemma's norm weights), so this is the
original checkpoint's math. Greedy tokens come from a loop without a KV cache (one full forward per token): HF's
cached generate can drift from its own full forward at near-ties. Per prompt:
  prompt_ids      HF tokenizer with add_special_tokens=True (Gemma's tokenizer adds BOS)
  greedy_ids      N_NEW greedy tokens (pure argmax; EOS does not stop)
  greedy_margins  per greedy step, top1 - top2 logit
  top_logprobs    top-20 log_softmax at several positions of prompt_ids + greedy_ids; the entry at `position` p
                  is the distribution of the token at p + 1. The long prompt (past the 512-token sliding window)
                  has entries past the window.
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_GGUF = os.path.join(HERE, "..", ".cache", "models", "gemma-3-270m-q4_k_m.gguf")
OUT = os.path.join(HERE, "..", "tests", "golden", "generation_gemma3.json")
N_NEW = 24
TOP = 20

CHAT = "<start_of_turn>user\nWhat are three tips for staying healthy?<end_of_turn>\n<start_of_turn>model\n"
TOPICS = ["rivers", "mountains", "cities", "forests", "deserts", "oceans", "islands", "valleys", "lakes",
          "glaciers", "volcanoes", "canyons"]
# A long prompt (well past the 512-token window): a numbered travel log, varied enough not to loop.
LONG = "A travel log.\n" + "".join(
    f"Day {i + 1}: we walked past {TOPICS[i % len(TOPICS)]} and counted {3 * i + 7} birds, "
    f"{(i * 13) % 17 + 2} boats and {(i * 7) % 11 + 1} bridges; the weather was "
    f"{['sunny', 'windy', 'rainy', 'foggy', 'mild'][i % 5]} and dinner cost {10 + (i * 3) % 9} euros.\n"
    for i in range(40)) + "Summary of the trip: on the first day we"
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    CHAT,
    "Shopping list:\n1. Apples\n2. Bread\n3.",
    "La Tour Eiffel est un monument de Paris. Elle a été construite en",
    "Once upon a time",
    LONG,
]


def logits_at(model, seq, rows):
    """{row: float32 logits} of one full forward without cache; the 262144-column head only at ``rows``."""
    hidden = model.model(torch.tensor([seq]), use_cache=False).last_hidden_state[0]
    assert getattr(model.config, "final_logit_softcapping", None) is None
    return dict(zip(rows, model.lm_head(hidden[rows]).float()))


def no_cache_greedy(model, ids):
    """The greedy tokens a loop without KV cache gives (argmax of a full forward, one token at a time), in a
    few full forwards: a cached generate proposes the continuation, one full forward checks every proposed token
    against its own argmax, and the first disagreement is replaced and proposed on from. The result is
    token-for-token the no-cache loop's (each kept token is the full forward's argmax after its prefix)."""
    seq = list(ids)
    with torch.no_grad():
        while len(seq) < len(ids) + N_NEW:
            x = torch.tensor([seq])
            draft = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=len(ids) + N_NEW - len(seq),
                                   do_sample=False, num_beams=1)[0, len(seq):].tolist()
            rows = list(range(len(seq) - 1, len(seq) + len(draft) - 1))
            at = logits_at(model, seq + draft, rows)
            full = [int(at[r].argmax()) for r in rows]
            k = next((i for i, (a, b) in enumerate(zip(draft, full)) if a != b), len(draft))
            seq += draft[:k] + ([full[k]] if k < len(draft) else [])
    return seq[:len(ids) + N_NEW]


def main():
    path = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_GGUF)
    folder, name = os.path.dirname(path), os.path.basename(path)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None          # pure argmax: EOS does not stop
    cases = []
    for prompt in PROMPTS:
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
        seq = no_cache_greedy(model, ids)
        greedy = seq[len(ids):]
        assert len(greedy) == N_NEW
        n = len(ids)
        positions = sorted({0, n // 2, n - 1, n + 9, n + N_NEW - 2} | ({520, n - 200} if n > 600 else set()))
        steps = list(range(n - 1, n + N_NEW - 1))                  # the rows that predict each greedy token
        with torch.no_grad():
            rows = logits_at(model, seq[:-1], sorted(set(steps) | set(positions)))
        top2 = {r: torch.topk(rows[r], 2).values for r in steps}
        margins = [float(top2[r][0] - top2[r][1]) for r in steps]
        logits = torch.stack([rows[p] for p in positions])
        logp = dict(zip(positions, torch.log_softmax(logits, dim=-1)))
        top = []
        for p in positions:
            v, i = torch.topk(logp[p], TOP)
            top.append({"position": p, "ids": i.tolist(), "logprobs": [round(x, 6) for x in v.tolist()]})
        cases.append({"prompt": prompt, "prompt_ids": ids, "greedy_ids": greedy,
                      "greedy_margins": [round(m, 6) for m in margins], "top_logprobs": top})
        print(f"{n:5d} prompt tokens, min margin {min(margins):.4f}: {tok.decode(greedy)!r}"[:200], flush=True)
    doc = {
        "model": name,
        "reference": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
                     "GGUF dequantized to float32, greedy loop without KV cache",
        "config": {k: getattr(model.config, k, None) for k in ("sliding_window", "rope_theta", "query_pre_attn_scalar",
                                                              "final_logit_softcapping", "layer_types")},
        "note": "top_logprobs[position=p] is log_softmax of the logits at index p of prompt_ids + greedy_ids "
                "(the distribution of token p + 1); greedy_margins[k] = top1 - top2 logit at greedy step k",
        "cases": cases,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(doc, f, separators=(",", ":"), default=str)
        f.write("\n")
    print(f"wrote {os.path.relpath(OUT)} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
