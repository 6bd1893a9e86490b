"""`pyengine bench parallel` runs its setups end to end (tiny workload: the numbers are not checked, only that
every setup reports them and the MPI ones report every rank; pipeline stages in both modes)."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_parallel_prints_every_setup():
    p = subprocess.run([sys.executable, "-m", "pyengine", "bench", "parallel", "--setups", "one,tp2,pp2",
                        "--sequences", "4", "--steps", "2", "--prefill", "32", "--no-transport"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = {ln.split()[0]: ln for ln in p.stdout.splitlines()[2:] if ln.startswith("  ") and "x)" in ln + "x)"}
    assert {"one", "tp2", "pp2", "pp2/within"} <= set(rows)                # pp2: cross-step and within-step
    assert "tp2/within" not in rows
    for r in ("tp2", "pp2", "pp2/within"):
        assert rows[r].count("%") == 2                                      # comm and busy share of both ranks
