"""`pyengine info`: the report on the real models, checked against the gguf package's reader."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from pyengine.cli import main
from pyengine.model_files import default_model_path

import gguf

from model_paths import gemma_gguf


def _field(text: str, label: str) -> str:
    m = re.search(rf"^{re.escape(label)}\s*: (.*)$", text, re.M)
    assert m, f"no {label!r} line in:\n{text}"
    return m.group(1)


def _type_table(text: str) -> dict[str, tuple[int, int, int]]:
    rows = re.findall(r"^(F32|F16|BF16|Q\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+$", text, re.M)
    return {name: (int(count), int(params), int(nbytes)) for name, count, params, nbytes in rows}


@pytest.fixture(scope="module")
def smol_ref():
    return gguf.GGUFReader(default_model_path())


def test_info_default_model(capsys, smol_ref):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert _field(out, "architecture") == "llama"
    assert _field(out, "layers") == "30"
    assert _field(out, "hidden size") == "576"
    assert _field(out, "heads (q/kv)") == "9/3"
    assert _field(out, "head dim") == "64"
    assert _field(out, "FFN size") == "1536"
    assert _field(out, "vocab") == "49152"
    assert _field(out, "context length") == "8192"
    assert _field(out, "rope base") == "100000"
    assert _field(out, "tokenizer") == "gpt2 (pre: smollm)"
    assert "134515008" in _field(out, "parameters")
    assert f"({Path(default_model_path()).stat().st_size} bytes)" in _field(out, "file size")
    # per-type table against the reference reader
    want: dict[str, list[int]] = {}
    for t in smol_ref.tensors:
        row = want.setdefault(t.tensor_type.name, [0, 0, 0])
        row[0] += 1
        row[1] += int(t.n_elements)
        row[2] += int(t.n_bytes)
    assert _type_table(out) == {k: tuple(v) for k, v in want.items()}
    assert "blk.0.attn_q.weight" not in out


def test_info_tensors_listing(capsys, smol_ref):
    assert main(["info", "--model", default_model_path(), "--tensors"]) == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^(\S+)\s+\[([\d, ]+)\]\s+(\w+)\s+(\d+)$", out, re.M)
    assert [name for name, *_ in listed] == [t.name for t in smol_ref.tensors]
    for (name, shape, tname, nbytes), t in zip(listed, smol_ref.tensors):
        assert [int(s) for s in shape.split(",")] == [int(d) for d in reversed(t.shape.tolist())], name
        assert tname == t.tensor_type.name and int(nbytes) == int(t.n_bytes), name


def test_info_gemma(capsys):
    assert main(["info", gemma_gguf()]) == 0
    out = capsys.readouterr().out
    assert _field(out, "architecture").startswith("gemma3")
    assert (_field(out, "layers"), _field(out, "heads (q/kv)"), _field(out, "head dim")) == ("18", "4/1", "256")
    assert _field(out, "vocab") == "262144"
    assert _field(out, "tokenizer") == "llama (pre: default)"
    table = _type_table(out)
    assert set(table) == {"F32", "Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    assert sum(c for c, _, _ in table.values()) == 236


def test_info_errors_are_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    assert main(["info", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "not a GGUF file" in err and "Traceback" not in err
    assert main(["info", str(tmp_path / "missing.gguf")]) == 1
    assert "not found" in capsys.readouterr().err


def test_info_lists_the_architectures_that_run_and_a_partial_rotary_head(capsys, tmp_path):
    """Issue 30: the report names every architecture in the registry, and describes a phi3 file whose RoPE turns
    only part of each head (a config the plain reader refuses for other architectures)."""
    from pyengine.models import ARCHITECTURES
    from tiny_models import PHI3_ROPE_DIM, write_tiny
    path = write_tiny(tmp_path / "phi3.gguf", "phi3")
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert _field(out, "architecture") == "phi3"
    assert _field(out, "head dim") == f"16 (rotary: the first {PHI3_ROPE_DIM})"
    listed = _field(out, "runs (S03)").split(", ")
    assert listed == sorted(ARCHITECTURES) and {"qwen2", "qwen3", "gemma2", "phi3"} <= set(listed)
