"""BLAS threads: how many NumPy's BLAS may use, chosen once per process (``--threads N``, ``LLM(threads=N)``).

OpenBLAS starts one thread per core in every process; on a host whose cores are busy its threads wait for each
other and a 22-token prompt's first token took 3-34 s against 0.25 s with one thread (issue 26). The default here
follows the cores this process may use (``os.sched_getaffinity``), capped at ``tuning.DEFAULT_THREADS_MAX`` (the
figures in docs/performance.md), and backs off to the cores that are idle right now (``/proc/stat`` sampled for
``tuning.THREADS_IDLE_SAMPLE_S``), at least 1. The count is set through threadpoolctl (the CPython extras) when NumPy
is loaded already, else through ``OPENBLAS_NUM_THREADS`` & co. before it loads. In Pyodide there is one thread and
nothing to set.
"""
from __future__ import annotations

import os
import sys
import time

from pyengine import tuning

ENV_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")
_CHOSEN: dict = {}          # what apply_threads set last: {"threads": n, "how": ..., "why": ...}


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), else os.cpu_count(), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _cpu_times() -> dict[int, tuple[int, int]] | None:
    """Per-core (busy, total) jiffies from /proc/stat, or None where there is none."""
    try:
        with open("/proc/stat") as f:
            lines = f.readlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *vals = line.split()
            v = [int(x) for x in vals[:8]]
            idle = v[3] + (v[4] if len(v) > 4 else 0)            # idle + iowait
            out[int(name[3:])] = (sum(v) - idle, sum(v))
    return out


def idle_cores(sample_s: float | None = None) -> float | None:
    """Idle cores among those this process may use, measured over ``sample_s`` seconds; None if unknown."""
    sample_s = tuning.THREADS_IDLE_SAMPLE_S if sample_s is None else sample_s
    a = _cpu_times()
    if not a:
        return None
    time.sleep(sample_s)
    b = _cpu_times()
    try:
        cores = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        cores = set(a)
    idle = 0.0
    for c in cores:
        if c in a and c in b:
            busy, total = b[c][0] - a[c][0], b[c][1] - a[c][1]
            idle += 1.0 - busy / total if total > 0 else 1.0
    return idle


def env_threads() -> int | None:
    """The thread count the environment asks for (OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS), or None."""
    for var in ENV_VARS[:2]:
        v = os.environ.get(var, "").strip()
        if v.isdigit() and int(v) >= 1:
            return int(v)
    return None


def default_threads(respect_env: bool = True) -> tuple[int, str]:
    """(threads, why): what the environment says if it says (the user's choice wins, unless not ``respect_env``),
    else the usable cores up to tuning.DEFAULT_THREADS_MAX, fewer when they are busy now."""
    env = env_threads() if respect_env else None
    if env is not None:
        return env, "from the environment"
    cores = usable_cores()
    n = max(1, min(cores, tuning.DEFAULT_THREADS_MAX))
    why = f"{cores} usable core{'s' * (cores != 1)}, at most {tuning.DEFAULT_THREADS_MAX} by default"
    if n > 1:
        idle = idle_cores()
        if idle is not None and idle < n - tuning.THREADS_IDLE_SLACK:
            n = max(1, int(idle + tuning.THREADS_IDLE_SLACK))
            why += f", {idle:.1f} idle now"
    return n, why


def apply_threads(threads: int | None = None) -> int:
    """Set NumPy's BLAS to ``threads`` threads (None: `default_threads`) and return the count. Pyodide: 1."""
    if sys.platform == "emscripten":
        _CHOSEN.update(threads=1, how="one thread (Pyodide)", why="the browser worker has one thread")
        return 1
    if threads is None:
        threads, why = default_threads()
    else:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer or None, got {threads!r}")
        why = "asked for"
    if "numpy" not in sys.modules:      # before NumPy loads its BLAS: the environment is read at load
        for var in ENV_VARS:
            os.environ[var] = str(threads)
        how = "environment"
    else:
        try:
            from threadpoolctl import threadpool_limits     # lazy: a CPython extra, absent in Pyodide
        except ImportError:
            _CHOSEN.update(threads=None, wanted=threads, how=None, why=why)
            return threads
        threadpool_limits(limits=threads, user_api="blas")
        how = "threadpoolctl"
    _CHOSEN.update(threads=threads, how=how, why=why)
    return threads


def describe() -> str:
    """One line for startup logs: what `apply_threads` chose and why."""
    if not _CHOSEN:
        return "BLAS threads: not set (the library's own default)"
    n = _CHOSEN["threads"]
    if n is None:                        # NumPy was loaded and threadpoolctl is missing: nothing could be set
        return (f"BLAS threads: the BLAS library's own default, not the {_CHOSEN['wanted']} chosen "
                f"({_CHOSEN['why']}): pip install threadpoolctl to let pyengine set it")
    return f"BLAS threads: {n} ({_CHOSEN['why']}; set by {_CHOSEN['how']})"


def blas_threads() -> int | None:
    """The BLAS thread count in effect now (threadpoolctl), or None when it cannot be read."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    counts = [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"]
    return max(counts) if counts else None
