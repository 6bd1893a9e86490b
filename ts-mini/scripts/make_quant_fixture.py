"""Write ts-mini/test/fixtures/quant_fixture.json: dequantized values computed by the `gguf` package.

The TypeScript kernels are checked against these (an independent implementation of the block formats).
Run from the repo root with the dev venv (gguf is a test-only dependency there):

    .venv/bin/python ts-mini/scripts/make_quant_fixture.py

Three parts:
  "header": version, counts, alignment and a few tensor records (name, shape, type, absolute offset) as gguf reads them.
  "tensors":  rows of real SmolLM2 tensors (Q8_0 embedding, Q4_1 weights, an F32 norm), identified by tensor name and
            row; the test reads the same rows from the GGUF itself, so tensor offsets are checked too.
  "blocks": self-contained raw blocks (base64) + their values, for every other format the kernels support:
            Q4_0/Q5_0/Q8_0/Q4_1/F16/BF16 quantized here from seeded random data, Q4_K/Q6_K/Q5_0 rows taken from the
            Gemma 3 270M Q4_K_M file when it is present (scripts/assemble_gemma.py).
"""
import base64
import json
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFReader
from gguf.quants import dequantize, quantize

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(HERE, "..", "test", "fixtures", "quant_fixture.json")
GEMMA = os.path.join(ROOT, ".cache", "models", "gemma-3-270m-q4_k_m.gguf")


def floats(a):
    # 9 significant digits round-trip float32 exactly and keep the file small.
    return [float("%.9g" % v) for v in np.asarray(a, dtype=np.float32).ravel()]


def model_path():
    env = os.environ.get("PYENGINE_MODEL")
    if env:
        return env
    sys.path.insert(0, ROOT)
    from pyengine.model_files import default_model_path
    return str(default_model_path())


def row_values(reader, name, rows):
    t = next(t for t in reader.tensors if t.name == name)
    data = np.asarray(t.data)  # quantized: (rows, row_bytes) uint8; F32: (rows, n) float32
    return t, [floats(dequantize(data[r], t.tensor_type)) for r in rows]


def main():
    path = model_path()
    r = GGUFReader(path)
    model = []
    for name, rows in [("token_embd.weight", [0, 1, 12345, 49151]), ("blk.0.attn_q.weight", [0, 575]),
                       ("blk.29.ffn_down.weight", [7]), ("blk.3.attn_k.weight", [191])]:
        t, vals = row_values(r, name, rows)
        model.append({"name": name, "type": t.tensor_type.name, "rows": rows, "values": vals})
    norm = next(t for t in r.tensors if t.name == "output_norm.weight")
    model.append({"name": "output_norm.weight", "type": "F32", "rows": [0], "values": [floats(norm.data)]})

    rng = np.random.default_rng(1234)
    blocks = []
    for qt in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.F16, T.BF16):
        x = (rng.standard_normal(64) * 0.1).astype(np.float32)
        x[5] = 0.37  # an outlier, so scales are not all alike
        raw = quantize(x.reshape(1, 64), qt).reshape(-1)
        blocks.append({"type": qt.name, "source": "gguf.quants.quantize(seeded random)", "n": 64,
                       "raw": base64.b64encode(raw.tobytes()).decode(), "values": floats(dequantize(raw, qt))})
    if os.path.exists(GEMMA):
        g = GGUFReader(GEMMA)
        for name, n_bytes in [("blk.0.attn_output.weight", 2 * 144), ("blk.0.ffn_down.weight", 2 * 210),
                              ("blk.0.attn_q.weight", 4 * 22)]:
            t = next(t for t in g.tensors if t.name == name)
            raw = np.asarray(t.data)[3].reshape(-1)[:n_bytes].copy()  # row 3, first few blocks
            blocks.append({"type": t.tensor_type.name, "source": f"gemma-3-270m-q4_k_m.gguf {name} row 3",
                           "n": int(len(dequantize(raw, t.tensor_type))),
                           "raw": base64.b64encode(raw.tobytes()).decode(),
                           "values": floats(dequantize(raw, t.tensor_type))})
    else:
        print("warning: Gemma GGUF not found; Q4_K/Q6_K blocks not written", file=sys.stderr)

    header = {
        "version": int(r.fields["GGUF.version"].parts[-1][0]), "tensor_count": len(r.tensors),
        "kv_count": int(r.fields["GGUF.kv_count"].parts[-1][0]), "alignment": int(r.alignment),
        "tensors": [{"name": t.name, "shape": [int(v) for v in reversed(t.shape)], "type": t.tensor_type.name,
                     "offset": int(t.data_offset), "nbytes": int(t.n_bytes)} for t in r.tensors[:6] + r.tensors[-2:]],
    }
    out = {"generator": "ts-mini/scripts/make_quant_fixture.py (gguf package dequantize)",
           "model": os.path.basename(path), "header": header, "tensors": model, "blocks": blocks}
    with open(OUT, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
