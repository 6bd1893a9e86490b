"""The baseline of `pyengine bench paging --hf-python PY`: HF transformers' batched ``generate`` on the same
prompts, run by another interpreter (one with torch, transformers and gguf; never imported by pyengine).

Reads JSON from stdin: {"model": GGUF path, "prompts": [[token ids], ...], "steps": decode steps}.
Prints one JSON line: {"decode_tok_s": ..., "threads": ...}. The prompts are left-padded into one batch
(HF's way); the decode rate is B * steps / (time of steps+1 new tokens - time of 1 new token), so the
prefill and the first token are not counted, as in our own aggregate decode figure.
"""
import json
import os
import sys
import time


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM

    job = json.load(sys.stdin)
    folder, name = os.path.split(os.path.abspath(job["model"]))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    prompts, steps = job["prompts"], int(job["steps"])
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    def run(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    run(2)                                                    # warm-up
    first = min(run(1) for _ in range(2))
    full = min(run(steps + 1) for _ in range(2))
    print(json.dumps({"decode_tok_s": len(prompts) * steps / (full - first), "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
