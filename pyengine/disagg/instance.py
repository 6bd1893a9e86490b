"""S18: what a prefill and a decode instance share — an `LLMEngine` driven by messages instead of HTTP.

An instance is one MPI rank (or, in tests, one end of a `LoopbackNet`) with its own engine, model runner and paged
KV cache. Its loop (``run``): take every message that has arrived (``handle``, the role's own), do the role's
transfer work, run one engine step if the engine has work, send the step's outputs to the router (rank 0) in one
message, and tell the router its state (``stats``: running / waiting, KV usage, transfer counters) after any
change and at least every ``HEARTBEAT_S`` while idle. Requests are named by the router's transfer id ``xid`` on the
wire.
"""
from __future__ import annotations

import time

from pyengine.disagg.kv_transfer import TransferError, parse_message
from pyengine.disagg.step_trace import StepTrace
from pyengine.parallel.mpi import IDLE_SLEEP_S, ParallelError
from pyengine.structured.matcher import install

ROUTER = 0
HEARTBEAT_S = 0.5              # an idle instance still reports this often (the router's liveness check)
STATS_KEYS = ("running", "waiting", "used_blocks", "total_blocks", "kv_cache_usage", "cached_blocks",
              "prefix_cache_hit_rate", "generation_tokens", "computed_prompt_tokens", "steps")


class Instance:
    role = "instance"

    def __init__(self, engine, transport):
        self.engine, self.t = engine, transport
        self.rid_of: dict[int, str] = {}          # xid -> request id in this engine
        self.xid_of: dict[str, int] = {}
        self.stopped = False
        self.counters = {"transfers": 0, "blocks": 0, "bytes": 0, "transfer_s": 0.0, "transfer_failures": 0}
        self._last_report = 0.0
        self.changed = True
        self.trace = None                         # StepTrace when PYENGINE_STEP_TRACE names a directory
        self.down = False                         # lost a rank of its tensor-parallel group (lost_group)

    # --- messages --------------------------------------------------------------------------------
    def hello(self) -> dict:
        import os
        import socket
        r = self.engine.runner
        group = self.engine.executor.group        # a TP instance: its followers too (the router's liveness check)
        return {"op": "hello", "role": self.role, "pid": os.getpid(), "host": socket.gethostname(),
                "followers": [] if group is None else [list(w) for w in group.where[1:]],
                "num_blocks": r.num_blocks, "block_size": r.block_size, "max_model_len": self.engine.max_model_len,
                "max_num_seqs": self.engine.scheduler.max_num_seqs, "hidden_size": int(r.config.d_model)}

    def to_router(self, msg: dict) -> None:
        self.t.send(ROUTER, msg)

    def fail(self, xid: int, exc: BaseException) -> None:
        """Tell the router request ``xid`` ended with an error here (its blocks are already freed)."""
        self.to_router({"op": "error", "xid": xid, "kind": type(exc).__name__, "error": str(exc)})

    def track(self, xid: int, rid: str) -> None:
        self.rid_of[xid], self.xid_of[rid] = rid, xid

    def forget(self, xid: int) -> str | None:
        rid = self.rid_of.pop(xid, None)
        if rid is not None:
            self.xid_of.pop(rid, None)
        return rid

    def handle_common(self, msg: dict) -> bool:
        """Stop, abort and grammars, for both roles; False if the message is the role's own."""
        op = msg["op"]
        if op == "stop":
            self.stopped = True
        elif op == "abort":
            self.abort(msg["xid"])
        elif op == "grammar":                     # compiled by the router's server: not compiled again here
            install(msg["key"], msg["automaton"])
        else:
            return False
        return True

    def abort(self, xid: int) -> None:
        rid = self.forget(xid)
        if rid is not None:
            self.engine.abort_request(rid)

    def send_outputs(self, outputs, t_step: float | None = None) -> None:
        """A step's outputs in one message: the router hands them to their streams together (with one message per
        request its step could end between two of them and deliver the rest a loop later)."""
        batch = []
        for out in outputs:
            xid = self.xid_of.get(out.request_id)
            if xid is None:
                continue
            batch.append((xid, out))
            if out.finished:
                self.forget(xid)
        if batch:                                 # "t": the step's end (time.monotonic), for the router's trace
            self.to_router({"op": "outs", "outs": batch, "t": round(t_step or time.monotonic(), 6)})

    def count_transfer(self, blocks: int, nbytes: int, seconds: float) -> None:
        c = self.counters
        c["transfers"] += 1
        c["blocks"] += blocks
        c["bytes"] += nbytes
        c["transfer_s"] += seconds

    def stats(self) -> dict:
        s = self.engine.stats()
        return {**{k: s[k] for k in STATS_KEYS if k in s}, **self.counters}

    def report(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or self.changed or now - self._last_report > HEARTBEAT_S:
            self.to_router({"op": "stats", "stats": self.stats()})
            self._last_report, self.changed = now, False

    # --- the loop --------------------------------------------------------------------------------
    def run_once(self) -> bool:
        """One turn of the loop; True if anything happened. A tensor-parallel instance that lost one of its ranks
        (`ParallelError` from a step or a KV gather / scatter) goes down: ``lost_group``."""
        if self.down:
            self.t.progress()
            return self.receive_down()
        try:
            return self._run_once()
        except ParallelError as exc:
            self.lost_group(exc)
            return True

    def lost_group(self, exc: BaseException) -> None:
        """Drop every request here (their blocks freed, a transfer's other side told), tell the router this
        instance is down (it fails their requests with `ParallelError`: 503), stop the surviving ranks; from now
        on only wait for the router's stop."""
        self.down = True
        for xid in list(self.rid_of):
            self.abort(xid)
        self.to_router({"op": "down", "error": f"lost one of its tensor ranks (numbered within the instance): {exc}"})
        self.engine.executor.close()

    def receive_down(self) -> bool:
        m = self.t.recv()
        if m is None:
            return False
        kind, payload = parse_message(m[1])
        if kind == "C" and payload["op"] == "stop":
            self.stopped = True
        return True

    def _run_once(self) -> bool:
        self.t.progress()
        busy = self.receive()
        busy = self.work() or busy
        if self.engine.scheduler.has_unfinished() and self.may_step():
            running = list(self.engine.scheduler.running) if self.trace is not None else None
            t0, cpu0 = time.monotonic(), time.process_time()
            self.step_started = time.perf_counter()
            outputs = self.engine.step()
            t1, cpu = time.monotonic(), time.process_time() - cpu0
            self.send_outputs(outputs, t1)
            self.after_step()
            if self.trace is not None:
                self.trace.step(t0, t1, cpu, running, outputs)
            busy = True
        self.changed = self.changed or busy
        self.report()
        return busy

    def start(self) -> None:
        self.to_router(self.hello())
        self.trace = StepTrace.from_env(self.t.rank, self.role)

    def run(self) -> None:
        self.start()
        while not self.stopped:
            if not self.run_once():
                time.sleep(IDLE_SLEEP_S)
        self.report(force=True)
        if self.trace is not None:
            self.trace.close()

    def receive(self) -> bool:
        """Handle the messages that have arrived; KV blocks only while this turn has spent less than
        ``block_budget_s`` on them and at most ``blocks_per_poll`` (the rest wait in MPI's queue), so adopting a
        long prompt holds up the running decodes' next step by about that budget, not by the whole prompt."""
        busy, blocks = False, 0
        t0 = time.perf_counter()
        while blocks < self.blocks_per_poll and not (blocks and time.perf_counter() - t0 > self.block_budget_s):
            m = self.t.recv()
            if m is None:
                break
            src, buf = m
            kind, payload = parse_message(buf)
            if kind == "B":
                blocks += 1
                tb = time.perf_counter()
                self.on_block(src, payload)
                if self.trace is not None:
                    self.trace.adopted(1, time.perf_counter() - tb)
            elif not self.handle_common(payload):
                self.handle(src, payload)
            busy = True
        return busy

    # role hooks
    blocks_per_poll = 1 << 30
    block_budget_s = float("inf")

    def handle(self, src: int, msg: dict) -> None:
        raise ValueError(f"{self.role} instance: unknown message {msg.get('op')!r} from rank {src}")

    def on_block(self, src: int, buf) -> None:
        raise TransferError(f"{self.role} instance: unexpected KV block from rank {src}")

    def work(self) -> bool:
        return False

    def may_step(self) -> bool:
        return True

    def after_step(self) -> None:
        pass
