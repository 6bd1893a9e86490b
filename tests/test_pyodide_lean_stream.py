"""S21 in Pyodide: the streaming lean products (folded block scales, L2-sized row blocks) run unchanged inside
Pyodide under Node — per quant format against the float64 product of the dequantized matrix, and a seeded
random Q4_K_M llama gives the same greedy tokens lean as resident."""
from __future__ import annotations

import pytest

from pyodide_harness import harness

pytestmark = [pytest.mark.pyodide, pytest.mark.slow]

SNIPPET = r"""
import numpy as np
from pyengine import LLM, SamplingParams
from pyengine.gguf import quants
from pyengine.gguf.quants import GGMLType
from pyengine.gguf.random_llama import LlamaShape, write_random_llama
from pyengine.layers.linear import LeanLinear, QuantMatrix

rng = np.random.default_rng(0)
for t in (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1):
    w = rng.standard_normal((96, 512)).astype(np.float32) * 0.1
    lin = LeanLinear(QuantMatrix([(quants.quantizer(t)(w).reshape(96, -1), int(t))], 512))
    ref_w = lin.dense().astype(np.float64)
    for n in (1, 3, 12):
        x = rng.standard_normal((n, 512)).astype(np.float32)
        err = np.abs(lin.matmul(x) - x @ ref_w).max() / np.abs(x @ ref_w).max()
        assert err < 2e-6, (t.name, n, err)
    print("format ok", t.name)
write_random_llama("/tmp/m.gguf", LlamaShape(256, 2, 4, 2, 512, 512, 256), seed=3)
toks = {}
for mode in ("resident", "lean"):
    llm = LLM("/tmp/m.gguf", weights_mode=mode, kv_cache_dtype="auto", max_model_len=128, max_num_seqs=1)
    out = llm.generate([{"prompt_token_ids": [1] + list(range(300, 330))}],
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    toks[mode] = list(out[0].outputs[0].token_ids)
assert toks["lean"] == toks["resident"], toks
print("tokens ok", toks["lean"])
"""


def test_lean_stream_in_pyodide():
    report = harness.run_in_pyodide(SNIPPET)
    assert report["ok"], harness.describe(report)
    assert report["stdout"].count("format ok") == 5 and "tokens ok" in report["stdout"], report["stdout"]
