"""S18: the router on rank 0 — an `LLMEngine`-shaped front for P prefill and D decode instances.

The OpenAI server (pyengine/server/) drives it exactly like one engine (server/engine_client.py's EngineClient): ``add_request``, ``step``, ``abort_request``,
``stats``. Nothing is computed here; ``step`` waits briefly for the instances' messages and turns them into the
`RequestOutput`s the server streams:

    add_request  -> checks (as LLMEngine.add_request would refuse: prompt, vocabulary, context, KV pool), then
                    "prefill" to the least loaded live prefill instance (fewest prompt tokens in its hands),
                    naming the decode instance it is to ship to (fewest sequences, then lowest KV usage)
    prefill out  -> the first token: the client's first chunk (TTFT does not wait for the transfer)
    adopted      -> the decode instance holds a sequence's prompt blocks (the transfer's counters)
    decoding     -> it holds every sequence of the request; its outputs continue the same stream
    error        -> the request ends with that error (its blocks are freed on both sides)

n > 1 (OpenAI ``n``, several choices of one prompt): one routed request, its n sequences prefilled together on one
prefill instance and adopted one after the other by one decode instance (prefill_worker.py), so every choice is
the colocated engine's choice of that index. The stream carries each choice under its index: a choice's first
token from the prefill instance's outputs, the rest from the decode instance's (until a sequence is adopted, the
decode side's outputs show it empty; the server streams each choice from its own token count, so nothing repeats
or goes missing), finish reasons per choice, the prompt counted once in usage (the server's own count).

Liveness: every instance reports at least every HEARTBEAT_S. An instance on this host whose process is gone, a
zombie or stopped is dead at once; elsewhere, one that owes an answer and has been silent for ``timeout`` seconds. A
tensor-parallel instance is named by its leader's rank; it is dead as well when one of its followers is (their
pids come with its hello), or when its leader says it is ("down": a step or KV gather met a lost rank).
A dead prefill instance fails the requests it holds (not yet adopted) with `ParallelError` (the server answers 503)
while the decode instances keep serving: new requests go to the other prefill instances, or, with none left, to a
decode instance as whole requests ("run": it then prefills too). With no decode instance left the router reports a
`failure` and the server answers 503.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pyengine.disagg.instance import HEARTBEAT_S
from pyengine.engine.input_processor import InputProcessor
from pyengine.engine.llm_engine import EngineOverloaded
from pyengine.engine.prompt_logprobs import routed_params
from pyengine.parallel.launcher_link import say_abort
from pyengine.parallel.mpi import ParallelError, proc_state
from pyengine.structured.matcher import COMPILE_CACHE_SIZE, export
from pyengine.server.engine_loop import EngineFailure

STEP_WAIT_S = 0.02             # a step returns after this long without news (the server loop then steps again)
LIVENESS_EVERY_S = 0.25
DRAIN_S = 1.0                  # the server keeps stepping this long after the last request: the final reports


@dataclass
class InstanceState:
    rank: int
    role: str
    info: dict = field(default_factory=dict)        # its hello: pid, host, num_blocks, block_size, ...
    stats: dict = field(default_factory=dict)       # its latest report
    last_seen: float = 0.0
    dead: str | None = None
    prompt_tokens: int = 0                          # prefill: prompt tokens of the requests in its hands
    seqs: int = 0                                   # decode: sequences of the requests routed to it, not finished
    grammars: OrderedDict = field(default_factory=OrderedDict)  # keys of the automata sent to it, newest last


@dataclass
class Routed:
    xid: int
    rid: str
    prompt_len: int
    prefill: int | None
    decode: int
    stage: str                                      # "prefill" -> "transfer" -> "decode"
    seqs: int = 1                                   # its sequences (the OpenAI n)


class RequestFailed(EngineFailure):
    """A request that ended with an error on an instance: the server loop hands it to the request's handler
    (an EngineFailure) and, as it is ``finished``, forgets the request."""
    finished = True


class Router:
    def __init__(self, transport, tokenizer, gguf, prefill_ranks, decode_ranks, max_model_len: int,
                 max_waiting: int | None = None, timeout: float = 60.0, wait_s: float = STEP_WAIT_S):
        self.t, self.tokenizer, self.max_model_len = transport, tokenizer, max_model_len
        self.max_waiting, self.timeout, self.wait_s = max_waiting, timeout, wait_s
        self.instances = {r: InstanceState(r, "prefill") for r in prefill_ranks}
        self.instances.update({r: InstanceState(r, "decode") for r in decode_ranks})
        self.gguf = gguf
        self.vocab_size = int(tokenizer.vocab_size or 0)
        self.requests: dict[str, Routed] = {}
        self.by_xid: dict[int, Routed] = {}
        self._next_xid = 1
        self.inputs = InputProcessor(tokenizer, self.vocab_size, max_model_len)   # the engines' prompt forms
        self._checked = 0.0
        self._closed = False
        self._drain_until = 0.0
        self._failed: list = []                      # failures found outside a step, returned by the next one
        self.transfers: list[dict] = []              # adopted transfers not yet seen by the metrics
        self.totals = {"transfers": 0, "blocks_sent": 0, "blocks_cached": 0, "bytes": 0, "transfer_s": 0.0,
                       "prefill_failures": 0}
        from pyengine.disagg.step_trace import StepTrace
        self.trace = StepTrace.from_env(0, "router")  # PYENGINE_STEP_TRACE: when each step's tokens passed here
        self._delivered: list = []

    # --- start-up ---------------------------------------------------------------------------------
    def wait_ready(self, timeout: float = 600.0) -> None:
        """Until every instance has said hello (its model loaded); RuntimeError naming the missing ones."""
        t0 = time.monotonic()
        while any(not i.info for i in self.instances.values()):
            self._poll_once([])
            if time.monotonic() - t0 > timeout:
                missing = [r for r, i in self.instances.items() if not i.info]
                raise RuntimeError(f"instances {missing} did not start within {timeout:g} s")
            time.sleep(0.005)

    # --- the engine-shaped API ----------------------------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    def alive(self, role: str) -> list[InstanceState]:
        return [i for i in self.instances.values() if i.role == role and i.dead is None]

    def failure(self) -> str | None:
        if self.alive("decode"):
            return None
        dead = "; ".join(f"rank {i.rank}: {i.dead}" for i in self.instances.values() if i.role == "decode")
        return f"no decode instance is alive ({dead})"

    def health(self) -> tuple[str, str | None]:
        """The server's /health: unhealthy without a decode instance (nothing can run), degraded without a
        prefill instance (decode instances run whole requests: slower first tokens, less capacity)."""
        import socket
        failure = self.failure()
        if failure:
            return "unhealthy", failure
        # an idle router steps no more and so notices no death: look (read-only: a step may be running) now
        host = socket.gethostname()
        why = {i.rank: i.dead or (self._local_death(i, host) if i.info else None)
               for i in self.instances.values()}
        if all(why[i.rank] for i in self.instances.values() if i.role == "decode"):
            return "unhealthy", "no decode instance is alive (" + "; ".join(
                f"rank {r}: {w}" for r, w in why.items() if self.instances[r].role == "decode") + ")"
        if all(why[i.rank] for i in self.instances.values() if i.role == "prefill"):
            return "degraded", "no prefill instance is alive (" + "; ".join(
                f"rank {r}: {w}" for r, w in why.items() if self.instances[r].role == "prefill") + \
                "); decode instances run whole requests"
        return "ok", None

    def model_metadata(self) -> dict | None:
        return self.gguf.metadata

    def _check(self, request_id: str, ids: list[int], params) -> tuple:
        """The refusals LLMEngine.add_request would give, decided here so that the client gets them at once;
        returns (the SamplingParams checked, the request's sequences): an embedding request's are greedy, 1."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        hidden = next((i.info["hidden_size"] for i in self.instances.values() if i.info), 0)
        params, n = routed_params(params, hidden)         # S19: embeddings checked as 1-token greedy requests
        max_tokens = self.inputs.check(ids, params)       # the engines' own refusals
        total = len(ids) + max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                             f"max_model_len ({self.max_model_len})")
        for inst in self.alive("decode") + self.alive("prefill"):
            bs, nb = inst.info["block_size"], inst.info["num_blocks"]
            if -(-total // bs) > nb:
                raise ValueError(f"prompt + max_tokens = {total} tokens needs {-(-total // bs)} KV blocks; the "
                                 f"pool has only {nb}")
        self.inputs.matchers(params, 1)                   # a schema the grammar compiler refuses: refused here
        self.inputs.token_masks(params, 1, ids)           # so are token fields the model cannot honour
        waiting = sum(1 for r in self.requests.values() if r.stage == "prefill")
        if self.max_waiting is not None and waiting >= self.max_waiting:
            raise EngineOverloaded(f"waiting queue is full ({self.max_waiting} requests)")
        return params, n

    def add_request(self, request_id: str, prompt, params=None, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        from pyengine.sampling_params import SamplingParams
        params = params if params is not None else SamplingParams()
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        _, ids = self.inputs.encode(prompt)
        checked, n = self._check(request_id, ids, params)
        self._check_liveness(self._failed)           # the server may have been idle: route to live ones only
        decodes = self.alive("decode")
        if not decodes:
            raise ParallelError(self.failure())
        dec = min(decodes, key=lambda i: (i.seqs, i.stats.get("kv_cache_usage", 0.0), i.rank))
        prefills = self.alive("prefill")
        xid = self._next_xid
        self._next_xid += 1
        if prefills:
            pre = min(prefills, key=lambda i: (i.prompt_tokens, i.rank))
            self._send_grammar(pre, checked)
        self._send_grammar(dec, checked)
        if prefills:
            r = Routed(xid, request_id, len(ids), pre.rank, dec.rank, "prefill", n)
            pre.prompt_tokens += len(ids)
            self.t.send(pre.rank, {"op": "prefill", "xid": xid, "rid": request_id, "ids": ids, "params": params,
                                   "decode": dec.rank, "priority": priority})
        else:                                        # no prefill instance left: the decode instance does it all
            r = Routed(xid, request_id, len(ids), None, dec.rank, "decode", n)
            self.t.send(dec.rank, {"op": "run", "xid": xid, "rid": request_id, "ids": ids, "params": params,
                                   "priority": priority})
        dec.seqs += r.seqs
        self.requests[request_id], self.by_xid[xid] = r, r

    def _send_grammar(self, inst: InstanceState, params) -> None:
        """Give an instance the automaton of a constrained request before the request itself, once per grammar:
        compiled here (by the server's compile worker, off every loop), it is not compiled again on the
        instance's step loop. Instances keep it in their compile cache, which holds more grammars than the
        COMPILE_CACHE_SIZE newest ones remembered here; one evicted there is compiled there again (correct, only
        slower)."""
        so = params.structured_outputs
        carried = export(so.request) if so is not None else None
        if carried is None:
            return
        key, automaton = carried
        if key in inst.grammars:
            inst.grammars.move_to_end(key)
            return
        self.t.send(inst.rank, {"op": "grammar", "key": key, "automaton": automaton})
        inst.grammars[key] = True
        while len(inst.grammars) > COMPILE_CACHE_SIZE:
            inst.grammars.popitem(last=False)

    def abort_request(self, request_id: str):
        r = self.requests.get(request_id)
        if r is None:
            return None
        for rank in {r.prefill, r.decode} - {None}:
            self.t.send(rank, {"op": "abort", "xid": r.xid})
        self._drop(r)
        return None

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or the last one ended less than DRAIN_S ago (the instances' last reports)."""
        return bool(self.requests) or time.monotonic() < self._drain_until

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def num_used_blocks(self) -> int:
        return sum(int(i.stats.get("used_blocks", 0)) for i in self.instances.values() if i.dead is None)

    def step(self) -> list:
        """Outputs (and failures) the instances have sent; waits up to ``wait_s`` for the first."""
        outputs, self._failed = self._failed, []
        deadline = time.monotonic() + self.wait_s
        while True:
            got = self._poll_once(outputs)
            if not got and (outputs or time.monotonic() >= deadline):
                break
            if not got:
                time.sleep(0.0005)
        now = time.monotonic()
        if now - self._checked > LIVENESS_EVERY_S:
            self._checked = now
            self._check_liveness(outputs)
        if self._delivered:
            self.trace.delivered(self._delivered, time.monotonic())
            self._delivered = []
        return outputs

    def close(self) -> None:
        """Send every instance home (idempotent). With a dead or stopped rank the job is aborted instead
        (MPI cannot finish with a rank that does not take part)."""
        if self._closed:
            return
        self._closed = True
        if self.trace is not None:
            self.trace.close()
        for r in self.instances:
            self.t.send(r, {"op": "stop"})
        comm = self.t.comm
        if comm is not None and any(i.dead for i in self.instances.values()):
            say_abort()                              # the launcher: the ranks this ends did not fail by themselves
            comm.Abort(0)
        t0 = time.monotonic()
        while self.t.pending() and time.monotonic() - t0 < 5.0:
            time.sleep(0.001)

    # --- messages ---------------------------------------------------------------------------------------
    def _drop(self, r: Routed) -> None:
        self.requests.pop(r.rid, None)
        self.by_xid.pop(r.xid, None)
        if r.stage == "prefill" and r.prefill is not None:
            self.instances[r.prefill].prompt_tokens -= r.prompt_len
        self.instances[r.decode].seqs -= r.seqs
        if not self.requests:
            self._drain_until = time.monotonic() + DRAIN_S

    def _poll_once(self, outputs: list) -> bool:
        from pyengine.disagg.kv_transfer import parse_message
        m = self.t.recv()
        if m is None:
            return False
        src, buf = m
        _, msg = parse_message(buf)
        inst = self.instances.get(src)
        if inst is None:
            return True
        inst.last_seen = time.monotonic()
        op = msg["op"]
        if op == "hello":
            inst.info = msg
        elif op == "stats":
            inst.stats = msg["stats"]
        elif op == "down":                            # a TP instance lost one of its ranks
            if inst.dead is None:
                self._declare_dead(inst, msg["error"], outputs)
        elif op == "shipped":
            pass                                      # the prefill side's view; the decode side's "adopted" counts
        elif op == "outs":
            if self.trace is not None:
                self._delivered.append((msg.get("t"), time.monotonic(), [out.request_id for _, out in msg["outs"]]))
            for xid, out in msg["outs"]:
                r = self.by_xid.get(xid)
                if r is not None:                     # else aborted or failed meanwhile
                    self._on_output(r, out, outputs)
        else:
            r = self.by_xid.get(msg.get("xid"))
            if r is None:
                return True                           # aborted or failed meanwhile
            if op == "decoding":
                r.stage = "decode"
            elif op == "adopted":
                self.transfers.append(msg)
                t = self.totals
                t["transfers"] += 1
                t["blocks_sent"] += msg["blocks"]
                t["blocks_cached"] += msg["cached"]
                t["bytes"] += msg["bytes"]
                t["transfer_s"] += msg["seconds"]
            elif op == "error":
                exc = ValueError(msg["error"]) if msg["kind"] == "ValueError" else RuntimeError(msg["error"])
                self._fail(r, exc, outputs)
        return True

    def _on_output(self, r: Routed, out, outputs: list) -> None:
        if r.stage == "prefill":                      # its first token: the prompt is done, its blocks move next
            self.instances[r.prefill].prompt_tokens -= r.prompt_len
            r.stage = "transfer"
        if out.finished:
            if r.stage == "transfer":                 # finished by its first token: nothing to ship
                r.stage = "done"
            self._drop(r)
        outputs.append(out)

    def _fail(self, r: Routed, exc: BaseException, outputs: list) -> None:
        for rank in {r.prefill, r.decode} - {None}:
            if self.instances[rank].dead is None:
                self.t.send(rank, {"op": "abort", "xid": r.xid})
        self._drop(r)
        outputs.append(RequestFailed(r.rid, exc))

    def _check_liveness(self, outputs: list) -> None:
        import socket
        host, now = socket.gethostname(), time.monotonic()
        for inst in self.instances.values():
            if inst.dead is not None or not inst.info:
                continue
            why = self._local_death(inst, host)
            owes = any(inst.rank in (r.prefill, r.decode) for r in self.requests.values())
            if why is None and owes and now - inst.last_seen > max(self.timeout, 4 * HEARTBEAT_S):
                why = f"silent for {now - inst.last_seen:.0f} s"
            if why is not None:
                self._declare_dead(inst, why, outputs)

    @staticmethod
    def _local_death(inst: InstanceState, host: str) -> str | None:
        """Why an instance on this host is dead (a process gone, a zombie or stopped), or None; reads only."""
        # a tensor-parallel instance: its leader and each follower rank (their leader reports a lost one too)
        for h, pid in [(inst.info.get("host"), inst.info["pid"])] + list(inst.info.get("followers", ())):
            state = proc_state(pid) if h == host else None
            if state in ("gone", "Z", "X", "T", "t"):
                return f"pid {pid} {'stopped' if state in 'Tt' else 'dead'}"
        return None

    def _declare_dead(self, inst: InstanceState, why: str, outputs: list) -> None:
        inst.dead = why
        if inst.role == "prefill":
            self.totals["prefill_failures"] += 1
        exc = ParallelError(f"{inst.role} instance rank {inst.rank} ({why}) failed its requests")
        for r in list(self.requests.values()):
            if r.decode == inst.rank or (r.prefill == inst.rank and r.stage in ("prefill", "transfer")):
                self._fail(r, exc, outputs)

    # --- introspection -----------------------------------------------------------------------------
    def stats(self) -> dict:
        live = [i for i in self.instances.values() if i.dead is None]
        total = lambda k, among=live: sum(i.stats.get(k, 0) for i in among)  # noqa: E731
        ever = list(self.instances.values())          # counters keep what a dead instance did
        blocks = total("total_blocks")
        dec = [i.stats for i in live if i.role == "decode" and "prefix_cache_hit_rate" in i.stats]
        return {
            "running": total("running"), "waiting": total("waiting"), "unfinished_requests": len(self.requests),
            "used_blocks": total("used_blocks"), "total_blocks": blocks,
            "kv_cache_usage": total("used_blocks") / blocks if blocks else 0.0,
            "prefix_cache_hit_rate": sum(s["prefix_cache_hit_rate"] for s in dec) / len(dec) if dec else 0.0,
            "generation_tokens": total("generation_tokens", ever),
            "computed_prompt_tokens": total("computed_prompt_tokens", ever),
            "kv_transfer": dict(self.totals),
            "instances": [{"rank": i.rank, "role": i.role, "alive": i.dead is None, "dead": i.dead, **i.stats}
                          for i in self.instances.values()],
        }
