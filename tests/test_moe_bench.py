"""`pyengine bench moe --quick` runs end to end and prints its table, the batch sweep and the expert load.
Speed is not asserted (benchmarks print ratios measured in the same run; tests check behaviour)."""
from pyengine.cli import main


def test_bench_moe_quick(capsys):
    assert main(["bench", "moe", "--quick"]) == 0
    out = capsys.readouterr().out
    for kind in ("moe", "dense-active", "dense-total"):
        assert any(line.startswith(kind + " ") for line in out.splitlines()), kind
    assert "routing+gather share" in out and "expert load over the run" in out
    # the quick shape: 8 experts of 128 rows, top-2, d=128 -> FFN MFLOP/token 0.20 (moe) vs 0.79 (dense-total)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] and
            line.split()[0] in ("moe", "dense-active", "dense-total")}
    assert float(rows["moe"][7]) < float(rows["dense-total"][7]) and rows["moe"][5] == rows["dense-total"][5]
