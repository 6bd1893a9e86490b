"""Smoke tests of every `pyengine bench` subcommand in its `--quick` form, run as a user runs them (a
subprocess of the CLI): each exits 0, prints its table, and every ratio it prints is a finite positive
number. Speed is not asserted (benchmarks print ratios; tests check behaviour); each run stays well under a
minute of one core's CPU time."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from pyengine.cli.bench import BENCHMARKS

pytestmark = pytest.mark.slow
NUMBER = r"-?(?:\d+(?:\.\d*)?(?:e[-+]?\d+)?|nan|inf)"


def bench(*argv: str) -> str:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pyengine", "bench", *argv], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


def finite_positive(values, what: str, at_least: int) -> list[float]:
    nums = [float(v) for v in values]
    assert len(nums) >= at_least, f"{what}: expected >= {at_least} ratios, found {nums}"
    assert all(math.isfinite(v) and v > 0 for v in nums), f"{what}: {nums}"
    return nums


def ratios_after_word(out: str) -> list[str]:
    return re.findall(rf"ratio\s+({NUMBER})", out)


def ratios_with_x(out: str) -> list[str]:
    return re.findall(rf"(?<![\w.])({NUMBER})x\b", out)


def test_every_subcommand_has_a_quick_smoke_test():
    tested = {"engine", "dequant", "tokenizer", "paging", "serve", "tuning", "linear", "kv", "structured",
              "spec", "moe", "parallel", "replay"}    # tests/test_spec_bench.py, test_moe_bench.py,
    #                                                test_bench_parallel.py, test_bench_replay_quick below
    assert set(BENCHMARKS) == tested


def test_bench_replay_quick():
    out = bench("replay", "--quick")
    finite_positive(re.findall(rf"({NUMBER})x less", out), "tiny-model step ratios", 2)
    finite_positive(re.findall(rf"step ({NUMBER})x faster", out), "real-model step ratios", 2)
    assert len(re.findall(r"outside\)", out)) == 4, out
    replays = [int(n) for n in re.findall(r"(\d+) replays", out)]
    assert len(replays) == 2 and min(replays) > 0, out


def test_bench_engine_quick():
    out = bench("--quick")                      # `pyengine bench` = engine, the README's first figures
    for section in ("prefill 64 tokens:", "decode 8 tokens:", "batched decode", "KV cache:", "attention for one"):
        assert section in out, out
    finite_positive(ratios_after_word(out), "engine prefill/decode ratios", 4)
    rows = re.findall(rf"^\s+(\d+)\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})$",
                      out, re.M)
    assert [r[0] for r in rows] == ["1", "4"], out
    finite_positive([v for r in rows for v in r[1:]], "batched decode table", 12)
    kv = re.findall(rf"^\s+(32|64)\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})$", out, re.M)
    assert [r[0] for r in kv] == ["32", "64"], out
    finite_positive([r[3] for r in kv], "KV-cache speedups", 2)
    finite_positive(re.findall(rf"memory ratio ({NUMBER})x", out), "flash memory ratio", 1)
    assert re.search(r"growth exponent per step: with cache -?[\d.]+, without -?[\d.]+", out)
    # issue 33: a plan before the sections, and a verdict on the run's own figures after them
    plan = re.search(r"^plan: prefill ~\S+ s, decode ~\S+ s, batch ~\S+ s, kv ~\S+ s, flash ~\S+ s(, threads ~\S+ s)?; expected ~", out,
                     re.M)
    assert plan and plan.start() < out.index("prefill 64 tokens:"), out
    assert re.search(r"^(figures consistent: .*|unreliable: .*Rerun on a quiet machine.*)$", out.splitlines()[-1]), out


def test_bench_dequant_quick():
    out = bench("dequant", "--quick")
    rows = re.findall(rf"^(\w+)\s+\S+\s+\d+\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})x\s+(yes|NO)$",
                      out, re.M)
    assert len(rows) >= 12 and all(r[5] == "yes" for r in rows), out
    finite_positive([v for r in rows for v in r[1:5]], "dequant MB/s and ratios", 48)
    finite_positive(re.findall(rf"geometric mean speed ratio .*: ({NUMBER})x", out), "geometric mean", 1)


def test_bench_tokenizer_quick():
    out = bench("tokenizer", "--quick")
    assert out.count("round-trip ok") == 2, out          # SmolLM2 (BPE) and Gemma 3 (SentencePiece)
    assert "ROUND-TRIP MISMATCH" not in out
    finite_positive(re.findall(rf"({NUMBER}) MB/s", out), "tokenizer MB/s", 6)
    finite_positive(re.findall(rf"re-only split = ({NUMBER})x", out), "encode / split ratio", 2)


@pytest.mark.parametrize("what, n_ratios", [("prefix", 2), ("batching", 3), ("chunked", 13)])
def test_bench_paging_quick(what, n_ratios):
    # (waste is tests/test_engine_bench_paging.py's, in-process); one sub-benchmark a run keeps each short
    extra = ("--frontier", "3") if what == "chunked" else ()
    out = bench("paging", "--quick", "--only", what, *extra)
    assert f"[{what}:" in out, out
    finite_positive(ratios_after_word(out), f"paging {what}", n_ratios)
    if what == "chunked":       # the frontier's setup: a fixed target of 3x the measured decode step
        assert re.search(r"ITL target \d+ ms \(3x\)", out) and "setups meeting both goals" in out, out


def test_bench_serve_quick():
    out = bench("serve", "--quick", "--compare", "prefix-cache", "--shared-prefix", "16")
    header = out.splitlines()[0].split()
    assert header[:3] == ["config", "rate", "ok/fail"] and "TTFT" in header, out
    rows = [ln for ln in out.splitlines() if ln.strip().startswith("prefix-cache")]
    assert len(rows) == 2 and all(" 6/0 " in r for r in rows), out
    finite_positive(ratios_with_x(out), "serve on/off ratios", 4)


def test_bench_tuning_quick():
    out = bench("tuning", "--param", "DECODE_KEY_CHUNK", "--values", "256,128", "--quick")
    rows = re.findall(rf"^\s+(\d+)\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})$",
                      out, re.M)
    assert [r[0] for r in rows] == ["256", "128"], out
    finite_positive([v for r in rows for v in r[1:]], "tuning sweep times and ratios", 12)
    assert [float(v) for v in rows[0][2::2]] == [1.0, 1.0, 1.0]          # the first value is the baseline


def test_bench_linear_quick():
    out = bench("linear", "--quick", "--kinds", "dense,head", "--forward")
    cell = rf"({NUMBER}) \(({NUMBER})\)"
    for kind in ("dense", "head"):
        table = out.split(f"\n{kind}:")[1].split("\n\n")[0]
        assert re.search(r"column blocks\s+row loop\s+one product", table), out
        rows = re.findall(rf"^\s+(\d+)\s+{cell}\s+{cell}\s+{cell}$", table, re.M)
        assert [r[0] for r in rows] == ["1", "2", "5"], out
        finite_positive([v for r in rows for v in r[1:]], f"{kind} row times and ratios", 18)
        assert float(rows[0][2]) == 1.0                              # one row through the column blocks: the unit
    fwd = re.findall(rf"^\s+(\d)\s+({NUMBER}) \(({NUMBER})\)\s+({NUMBER}) \(({NUMBER})\)$",
                     out.split("whole forward")[1], re.M)
    assert [r[0] for r in fwd] == [str(q) for q in range(1, 10)], out
    assert float(fwd[0][2]) == float(fwd[0][4]) == 1.0


def test_linear_crossover_is_the_last_row_count_before_the_loop_loses():
    from pyengine.bench.linear import crossover
    assert crossover({1: 1, 2: 1.4, 3: 1.7, 4: 2.6}, {1: 1, 2: 2.4, 3: 2.5, 4: 2.5}) == 3
    assert crossover({1: 1, 2: 3.0}, {1: 1, 2: 2.0}) == 1                  # never loop
    assert crossover({1: 1, 2: 1.5, 3: 1.9}, {1: 1, 2: 2.0, 3: 2.1}) == 3  # the loop wins throughout


def test_bench_kv_quick():
    from pyengine.model_files import default_model_path
    out = bench("kv", "--quick", "--only", "kv", "--model", default_model_path(), "--dtypes", "auto,q8_0",
                "--steps", "2", "--windows", "1", "--ctx", "128", "--batch-context", "128")
    rows = re.findall(rf"^\s+(auto|q8_0)\s+(\d+)\s+(\d+)\s+(\d+)\s+({NUMBER})", out, re.M)
    assert [r[0] for r in rows] == ["auto", "q8_0"], out
    assert int(rows[1][1]) * 3 < int(rows[0][1])                      # q8_0 stores < 1/3 of the bytes per token
    finite_positive(re.findall(rf"blocks x({NUMBER})", out), "KV block ratio", 1)
    finite_positive(re.findall(rf"@2048 x({NUMBER})", out), "decode ratio", 1)



def test_bench_kv_scales_quick():
    """--only scales: both head shapes, both orders agreeing (the bench raises otherwise), two ratios each."""
    out = bench("kv", "--quick", "--only", "scales")
    rows = re.findall(rf"^\s+(SmolLM2-135M|Gemma 3 270M) .*K x({NUMBER})\s+V x({NUMBER})$", out, re.M)
    assert [r[0] for r in rows] == ["SmolLM2-135M", "Gemma 3 270M"], out
    finite_positive([x for r in rows for x in r[1:]], "fold / cast-then-scale ratios", 4)

def test_bench_structured_quick():
    out = bench("structured", "--limit", "4", "--engines", "pyengine", "--tokens", "10")
    row = re.search(rf"^pyengine\s+(\d+)/(\d+)\s+({NUMBER})ms\s+({NUMBER})ms\s+({NUMBER})ms\s+({NUMBER})ms", out, re.M)
    assert row and row.group(1) == row.group(2) == "4", out
    finite_positive(row.groups()[2:], "compile and mask times", 4)
