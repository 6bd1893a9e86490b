"""What a benchmark owes its reader besides figures (S20): a plan, signs of life, and a verdict on its own numbers.

- `plan_line`: the sections about to run and how long each should take, estimated from a first timed step;
- `Progress`: a line on stderr at least every `interval` seconds while a section runs (a daemon thread: the
  bench is CPython, never the core), so a long section is never silence;
- `Checks`: figures that cannot be true on a quiet machine -- a ratio above 1 against the section's own
  roofline, a negative time, a batch no faster than one sequence, a cache slower than recomputing -- and the
  machine's own state: the load average above the usable cores, or the process getting well under one core
  while it runs one thread. Any of these makes the run "unreliable", said once at the end with the advice
  to rerun on a quiet machine.
"""
from __future__ import annotations

import os
import sys
import threading
import time

# a single-thread section that gets less than this share of a core was waiting for one (another process ran)
MIN_CPU_SHARE = 0.8
# measured ratio above its own roofline by more than timing noise
RATIO_SLACK = 1.05


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def plan_line(estimates: dict[str, float]) -> str:
    """`plan: prefill ~4 s, decode ~6 s, ...; expected ~1.2 min` from {section: seconds}."""
    parts = ", ".join(f"{name} ~{_duration(s)}" for name, s in estimates.items())
    return f"plan: {parts}; expected ~{_duration(sum(estimates.values()))} in all (estimated from one timed step)"


class Progress:
    """Prints `  ... <section>: 12 s in it` to `stream` every `interval` seconds between `start()` and `stop()`;
    set `.section` as the run moves on. Also a context manager."""

    def __init__(self, section: str, interval: float = 10.0, stream=None):
        self.section, self.interval = section, interval
        self.stream = stream if stream is not None else sys.stderr
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lines = 0

    @property
    def section(self) -> str:
        return self._section

    @section.setter
    def section(self, name: str) -> None:
        self._section, self._since = name, time.perf_counter()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            print(f"  ... {self._section}: {time.perf_counter() - self._since:.0f} s in it", file=self.stream,
                  flush=True)
            self.lines += 1

    def start(self) -> "Progress":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False


class Checks:
    """Collects what makes a run's figures doubtful; `verdict()` is the closing line."""

    def __init__(self, cores: int | None = None):
        self.cores = cores or usable_cores()
        self.problems: list[str] = []
        self.loads: list[float] = []

    def sample_load(self, load: float | None = None) -> None:
        load = load_average() if load is None else load
        if load is not None:
            self.loads.append(load)

    def not_above_roofline(self, what: str, ratio: float) -> None:
        if ratio > RATIO_SLACK:
            self.problems.append(f"{what} is {ratio:.2f}x its own roofline (impossible on a quiet machine)")

    def positive(self, what: str, value: float) -> None:
        if value <= 0:
            self.problems.append(f"{what} is {value:.3g} (a time cannot be negative)")

    def batch_gains(self, ratios: dict[int, float]) -> None:
        for batch, ratio in ratios.items():
            if batch > 1 and ratio < 1:
                self.problems.append(f"{batch} sequences together are slower in aggregate than one "
                                     f"(ratio {ratio:.2f})")

    def cache_helps(self, context: int, speedup: float) -> None:
        if context >= 128 and speedup < 1:
            self.problems.append(f"at context {context} the KV cache is slower than recomputing ({speedup:.2f}x)")

    def cpu_share(self, what: str, cpu_s: float, wall_s: float) -> None:
        share = cpu_s / wall_s if wall_s > 0 else 1.0
        if share < MIN_CPU_SHARE:
            self.problems.append(f"{what} got {share:.0%} of a core while running one thread (the cores are "
                                 "busy with other work)")

    def busy(self) -> bool:
        return bool(self.loads) and max(self.loads) > self.cores

    def verdict(self) -> str:
        notes = list(self.problems)
        if self.busy():
            notes.insert(0, f"load {max(self.loads):.1f} on {self.cores} cores")
        if not notes:
            return "figures consistent: no ratio above its roofline, no negative time, the machine was not busy"
        return ("unreliable: " + "; ".join(notes)
                + ". Rerun on a quiet machine (and with OPENBLAS_NUM_THREADS=1 on a shared one).")
