"""S18: where an instance's time goes, step by step — the evidence behind the decode rank's ITL tail.

With ``PYENGINE_STEP_TRACE=DIR`` in its environment every instance appends one JSON line per engine step to
``DIR/rank<N>-<role>.jsonl`` (line-buffered, so a reader sees every finished step while the server runs):

    t0, t1      the step's start and end (time.monotonic: CLOCK_MONOTONIC, the clock a client on the same host
                reads with time.monotonic, so a token's step can be joined with its arrival at the client)
    cpu         the process's CPU seconds during the step (wall - cpu = time the core was taken by others)
    seqs, ctx   sequences in the batch and the longest context among them (tokens)
    rids        the requests that got a token from this step
    adopt_s, adopt_blocks   KV blocks checked and written since the previous step (decode side)
    gc_s        Python's garbage collector since the previous step ended (this step included)
    loop_s      the rest of the time since the previous step ended (messages, reports, sends, sleeping)

The router writes ``DIR/rank0-router.jsonl``: for each message of outputs, the step end it carries (``t_step``,
the t1 above), when the router received it (``t_recv``) and when its step handed it to the server (``t_out``),
so a late token is placed on the MPI + router side or on the HTTP + client side.

`pyengine bench serve --compare disagg` sets it for the disaggregated server and joins the decode rank's trace
with its client's token arrivals: a late token is then either a slow step (wall, cpu, adoption, GC) or a late
delivery (step end -> client), docs/disaggregation.md.
"""
from __future__ import annotations

import gc
import json
import os
import time

ENV = "PYENGINE_STEP_TRACE"


class StepTrace:
    """One instance's per-step records, written as JSON lines to ``path``."""

    def __init__(self, path: str):
        self.f = open(path, "w", buffering=1)
        self.gc_s = self.adopt_s = 0.0
        self.adopt_blocks = 0
        self.last_end = time.monotonic()
        self._gc_t0 = None
        gc.callbacks.append(self._on_gc)

    @classmethod
    def from_env(cls, rank: int, role: str) -> "StepTrace | None":
        d = os.environ.get(ENV)
        if not d:
            return None
        os.makedirs(d, exist_ok=True)
        return cls(os.path.join(d, f"rank{rank}-{role}.jsonl"))

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self.gc_s += time.perf_counter() - self._gc_t0
            self._gc_t0 = None

    def adopted(self, blocks: int, seconds: float) -> None:
        self.adopt_blocks += blocks
        self.adopt_s += seconds

    def step(self, t0: float, t1: float, cpu: float, running, outputs) -> None:
        ctx = max((s.num_tokens for s in running), default=0)
        rec = {"t0": round(t0, 6), "t1": round(t1, 6), "cpu": round(cpu, 6), "seqs": len(running), "ctx": ctx,
               "rids": [o.request_id for o in outputs], "adopt_s": round(self.adopt_s, 6),
               "adopt_blocks": self.adopt_blocks, "gc_s": round(self.gc_s, 6),
               "loop_s": round(max(0.0, t0 - self.last_end - self.adopt_s), 6)}
        self.f.write(json.dumps(rec) + "\n")
        self.gc_s = self.adopt_s = 0.0
        self.adopt_blocks = 0
        self.last_end = t1

    def delivered(self, records: list[tuple[float, float, list[str]]], t_out: float) -> None:
        """The router's side (rank 0): each instance message of outputs handed to the server in one step, as
        (the instance's step end, when the router received it, its request ids), and when the step returned."""
        for t_step, t_recv, rids in records:
            self.f.write(json.dumps({"t_step": t_step, "t_recv": round(t_recv, 6), "t_out": round(t_out, 6),
                                     "rids": rids}) + "\n")

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self.f.close()


def read(path: str) -> list[dict]:
    """The records of a trace file (a line cut short by a stopped writer is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out
