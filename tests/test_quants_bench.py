"""`pyengine bench dequant` runs end to end (tiny sizes) and reports every format as bit-exact against the
gguf package in the same run. Speed is not asserted here (benchmarks print ratios; tests check behaviour)."""
from __future__ import annotations

import re

import gguf  # noqa: F401  the reference the bench compares against (a dev dependency): missing = failure

from pyengine.cli import main
from pyengine.gguf.quants import SUPPORTED_TYPES


def test_bench_dequant_smoke(capsys):
    assert main(["bench", "dequant", "--weights", "4096", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^(\w+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)x\s+(yes|NO)$", out, re.M)
    assert [r[0] for r in rows] == [t.name for t in SUPPORTED_TYPES]
    assert all(r[7] == "yes" for r in rows), out
    sources = {r[0]: r[1] for r in rows}
    assert sources["Q4_1"].startswith("blk.") and sources["Q8_0"] != "synthetic"   # real SmolLM2 tensors
    assert "geometric mean speed ratio" in out
