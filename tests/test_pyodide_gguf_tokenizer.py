"""S21/S22 in Pyodide: the unchanged pyengine wheel reads GGUF files from bytes, dequantizes every quant
type the two real models use, and tokenizes exactly like HF — inside Pyodide under Node.

References: the `gguf` package (run here in CPython) for dequantized values; tests/golden/tokenizer_*.json
(HF transformers) for token ids; and pyengine's own reading in CPython for metadata and the tensor table
(Pyodide must agree with CPython; the CPython reader is checked against `gguf` by tests/test_gguf_reader.py).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from pyodide_harness import harness

pytestmark = [pytest.mark.pyodide, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "pyodide"))   # golden_checks: shared with the Pyodide snippets

from model_paths import model_path  # noqa: E402
N_SAMPLES = 4096


def gguf_reference(path: str, out_json: Path) -> dict:
    """What Pyodide must reproduce: pyengine's own reading of the file in CPython (metadata fingerprints,
    tensor table) and, from the independent `gguf` package, dequantized values of the smallest tensor of each
    ggml type at seeded random flat indices (plus each tensor's sum)."""
    import gguf
    from golden_checks import metadata_digest
    from pyengine import GGUFFile

    g = GGUFFile(path)
    table = [{"name": t.name, "shape": list(t.shape), "type": int(t.ggml_type), "offset": int(t.offset),
              "nbytes": int(t.nbytes)} for t in g.tensors.values()]
    smallest = {}
    for t in g.tensors.values():
        if t.ggml_type not in smallest or t.n_elements < smallest[t.ggml_type].n_elements:
            smallest[t.ggml_type] = t
    rng = np.random.default_rng(0)
    samples = []
    for key, t in sorted(smallest.items()):
        qtype = gguf.GGMLQuantizationType(key)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows = t.data.reshape(-1, t.shape[-1] // block * type_size)   # raw bytes, one row per output row
        values = gguf.quants.dequantize(rows, qtype).astype(np.float32).ravel()
        idx = np.unique(rng.integers(0, values.size, size=min(N_SAMPLES, values.size)))
        samples.append({"name": t.name, "type": qtype.name, "index": idx.tolist(),
                        "values": values[idx].tolist(), "sum": float(values.astype(np.float64).sum())})
    ref = {"metadata": metadata_digest(g.metadata), "version": g.version, "alignment": g.alignment,
           "tensors": table, "samples": samples}
    out_json.write_text(json.dumps(ref))
    return ref


SNIPPET_GGUF = r"""
import json, time
import numpy as np
from pyengine import GGUFFile
ref = json.load(open('/work/ref.json'))
t0 = time.perf_counter()
g = GGUFFile(MODEL_BYTES)
print(f"parsed in {time.perf_counter() - t0:.2f}s")
bad = []
from golden_checks import metadata_digest
digest = metadata_digest(g.metadata)
if [g.version, g.alignment] != [ref['version'], ref['alignment']]:
    bad.append(f"version/alignment {g.version}/{g.alignment}")
for key, want in ref['metadata'].items():
    if digest.get(key) != want:
        bad.append(f"metadata {key}: differs from CPython's reading")
if set(digest) != set(ref['metadata']):
    bad.append(f"metadata keys differ: {sorted(set(digest) ^ set(ref['metadata']))[:5]}")
names = list(g.tensors)
if names != [t['name'] for t in ref['tensors']]:
    bad.append("tensor names/order differ")
for t in ref['tensors']:
    info = g.tensors.get(t['name'])
    if info is None:
        continue
    got = [list(info.shape), int(info.ggml_type), int(info.offset), int(info.nbytes), int(info.data.size)]
    want = [t['shape'], t['type'], t['offset'], t['nbytes'], t['nbytes']]
    if got != want:
        bad.append(f"{t['name']}: [shape, type, offset, nbytes, data.size] {got} != {want}")
for s in ref['samples']:
    t0 = time.perf_counter()
    x = g.dequantize(s['name'])
    dt = time.perf_counter() - t0
    if x.dtype != np.float32 or list(x.shape) != next(t['shape'] for t in ref['tensors'] if t['name'] == s['name']):
        bad.append(f"{s['name']}: dtype/shape {x.dtype} {x.shape}")
        continue
    flat = x.ravel()
    got, want = flat[np.asarray(s['index'])], np.asarray(s['values'], dtype=np.float32)
    err = np.abs(got - want).max()
    tol = 1e-6 * max(1.0, float(np.abs(want).max()))
    total = float(flat.astype(np.float64).sum())
    print(f"{s['type']:>5} {s['name']}: {flat.size} values in {dt*1e3:.0f} ms, max err {err:.1e}")
    if not err <= tol or abs(total - s['sum']) > 1e-4 * max(1.0, abs(s['sum'])):
        bad.append(f"{s['type']} {s['name']}: max err {err:.2e}, sum {total} != {s['sum']}")
try:
    g.dequantize('no.such.tensor')
    bad.append('missing tensor did not raise')
except ValueError as exc:
    if 'no.such.tensor' not in str(exc):
        bad.append(f'missing-tensor error does not name it: {exc}')
for b in bad:
    print('FAIL', b)
assert not bad, f"{len(bad)} mismatches"
"""


@pytest.fixture(scope="module")
def setup_ok():
    problem = harness.missing_setup()
    if problem:
        pytest.fail(problem)


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_gguf_reader_and_dequant_in_pyodide(setup_ok, tmp_path, which):
    path = model_path(which)
    ref = gguf_reference(path, tmp_path / "ref.json")
    report = harness.run_in_pyodide(SNIPPET_GGUF, files={"/work/ref.json": tmp_path / "ref.json"}, model=path)
    print(report["stdout"], report["timings_ms"], f"wall {report['wall_s']}s")
    assert report["ok"], harness.describe(report)
    assert report["versions"]["python"].startswith("3.13")
    assert report["stdout"].count("max err") == len(ref["samples"])  # every quant type was exercised


SNIPPET_TOKENIZER = r"""
import json, time
from pyengine import Tokenizer
from golden_checks import check_tokenizer
golden = json.load(open('/work/golden/tokenizer.json'))
t0 = time.perf_counter()
tok = Tokenizer.from_gguf(MODEL_BYTES)
t1 = time.perf_counter()
bad = check_tokenizer(tok, golden)
t2 = time.perf_counter()
n = sum(len(golden.get(k, [])) for k in ('cases', 'lossy_cases', 'special_cases', 'decode_cases'))
print(f"tokenizer built in {t1 - t0:.2f}s, {n} cases checked in {t2 - t1:.2f}s")
for b in bad:
    print('FAIL', b)
assert not bad, f"{len(bad)} of {n} cases differ"
"""


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_tokenizer_golden_in_pyodide(setup_ok, which):
    golden = HERE / "golden" / f"tokenizer_{which}.json"
    if not golden.is_file():
        pytest.fail(f"{golden} missing (produced by scripts/ of the tokenizer chapter)")
    path = model_path(which)
    report = harness.run_in_pyodide(SNIPPET_TOKENIZER, model=path, files={"/work/golden/tokenizer.json": golden})
    print(report["stdout"], report["timings_ms"], f"wall {report['wall_s']}s")
    assert report["ok"], harness.describe(report)
    assert "cases checked" in report["stdout"]
