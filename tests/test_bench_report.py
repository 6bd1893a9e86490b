"""The bench's verdict on its own figures (issue 33): each impossible figure and a busy machine make the run
"unreliable" with the reason; a clean run says so; a section that runs long prints a progress line on time."""
from __future__ import annotations

import io
import time

from pyengine.bench.report import Checks, Progress, plan_line


def test_each_impossible_figure_is_named():
    c = Checks(cores=2)
    c.sample_load(0.4)
    c.not_above_roofline("decode", 0.93)
    c.positive("non-GEMM work", 0.2)
    c.batch_gains({1: 1.0, 8: 5.1, 32: 9.8})
    c.cache_helps(512, 4.0)
    c.cpu_share("decode", 0.95, 1.0)
    assert c.verdict().startswith("figures consistent")
    c.not_above_roofline("decode", 1.4)
    c.positive("non-GEMM work per layer", -0.3)
    c.batch_gains({1: 1.0, 32: 0.97})
    c.cache_helps(256, 0.8)
    c.cache_helps(32, 0.8)              # a tiny context may lose to recomputing: not flagged
    c.cpu_share("decode", 0.3, 1.0)
    v = c.verdict()
    assert v.startswith("unreliable: ") and v.endswith("Rerun on a quiet machine (and with OPENBLAS_NUM_THREADS=1 "
                                                       "on a shared one).")
    for part in ("decode is 1.40x its own roofline", "non-GEMM work per layer is -0.3", "32 sequences together",
                 "at context 256 the KV cache is slower", "decode got 30% of a core"):
        assert part in v, (part, v)
    assert "context 32" not in v


def test_a_busy_machine_alone_makes_the_run_unreliable():
    c = Checks(cores=2)
    c.sample_load(1.2)
    c.sample_load(5.5)
    assert c.verdict().startswith("unreliable: load 5.5 on 2 cores")


def test_progress_lines_while_a_section_runs():
    out = io.StringIO()
    with Progress("kv", interval=0.05, stream=out) as p:
        time.sleep(0.3)
        p.section = "flash"
        time.sleep(0.3)
    text = out.getvalue()
    assert "... kv: " in text and "... flash: " in text and p.lines >= 3


def test_plan_line_totals_the_sections():
    line = plan_line({"prefill": 3.0, "decode": 100.0})
    assert line.startswith("plan: prefill ~3 s, decode ~1.7 min; expected ~1.7 min in all")
