"""S18: a decode instance — adopts prefilled sequences into its own paged cache and continues their streams.

On an *offer* (prompt, params, the prefill side's block hashes) the engine registers the request and allocates its
blocks at once (``LLMEngine.add_prefilled``): the leading blocks its prefix cache already holds are hits, so it
answers *have k* and only blocks k.. are sent. Each block message is checked (kv_transfer: size, CRC, and its
prefix hash against this side's own hash chain of the prompt) and written straight into the block the sequence
was given (a tensor-parallel instance: each rank its KV heads, kv_transfer.KVBlocks), for at most a quarter of a decode step's time between two steps (``tuning.ADOPT_STEP_SHARE``), so a long prompt
never stalls the running decodes for more than that. When every block is in and the *commit* (first token, sampler state) has arrived,
``LLMEngine.commit_prefilled`` starts the sequence decoding; its outputs go to the router like any engine's.

n > 1: the request's sequences arrive one after the other (prefill_worker.py), each offer naming its ``index``;
the first registers the request with all n sequences (``add_prefilled``), and as the previous sequence's commit
was handled before the next offer, that offer finds the prompt's full blocks in the prefix cache ("have k") and
only its own last block comes. A *first* message commits a sequence that ended with its first token on the prefill
side (no blocks). Offers and *first* messages are taken in arrival order. Once every sequence of a request is
here, the router is told (*decoding*: a prefill instance lost from then on no longer concerns the request).

An offer that does not fit now (no sequence slot or not enough free blocks) waits, oldest first; the prefill side
keeps its blocks meanwhile (back-pressure). A *run* message is an ordinary request (the router's fallback when no
prefill instance is alive: this instance then prefills too, as a colocated engine).
"""
from __future__ import annotations

import time
from collections import deque

from pyengine import tuning
from pyengine.disagg.instance import Instance
from pyengine.disagg.kv_transfer import KVBlocks, TransferError, block_header, check_block
from pyengine.disagg.prefill_worker import prompt_hashes
from pyengine.engine.llm_engine import EngineOverloaded



class Adoption:
    """One prompt's blocks arriving: ``have`` leading blocks were prefix-cache hits, the rest come in."""

    def __init__(self, xid: int, rid: str, src: int, seq, hashes: list[bytes], have: int):
        self.xid, self.rid, self.src, self.seq, self.hashes, self.have = xid, rid, src, seq, hashes, have
        self.index = seq.index
        self.received = self.bytes = 0
        self.commit: dict | None = None
        self.t0 = time.monotonic()


class DecodeWorker(Instance):
    role = "decode"

    @property
    def block_budget_s(self) -> float:
        """Time for blocks in one turn while decodes run (their next step waits): ADOPT_STEP_SHARE of the last
        step, at least ADOPT_BUDGET_S; no limit when nothing runs."""
        if not self.engine.scheduler.running:
            return float("inf")
        return max(tuning.ADOPT_BUDGET_S, tuning.ADOPT_STEP_SHARE * self.last_step_s)

    def after_step(self) -> None:
        self.last_step_s = time.perf_counter() - self.step_started

    def __init__(self, engine, transport):
        super().__init__(engine, transport)
        self.blocks_per_poll = tuning.ADOPT_BLOCKS_PER_POLL
        self.adopting: dict[int, Adoption] = {}
        self.offers: deque = deque()             # (src, msg) waiting for room: offers and "first" messages
        self.arrived: dict[int, tuple[int, set[int]]] = {}   # xid -> (n, indices of its sequences committed)
        self.counters.update(cached_blocks_hit=0)
        self.step_started = self.last_step_s = 0.0
        self.blocks = KVBlocks(engine.executor)

    def handle(self, src: int, msg: dict) -> None:
        op, xid = msg["op"], msg.get("xid")
        if op in ("offer", "first"):
            self.offers.append((src, msg))
        elif op == "commit" and xid in self.adopting:
            self.adopting[xid].commit = msg
            self.maybe_commit(xid)
        elif op == "commit":
            pass                                  # aborted meanwhile
        elif op == "run":                         # a whole request here (no prefill instance alive)
            try:
                self.engine.add_request(msg["rid"], {"prompt_token_ids": msg["ids"]}, msg["params"], msg["priority"])
            except Exception as exc:
                self.fail(xid, exc)
                return
            self.track(xid, msg["rid"])
        else:
            super().handle(src, msg)

    def abort(self, xid: int) -> None:
        self.offers = deque((s, m) for s, m in self.offers if m["xid"] != xid)
        self.adopting.pop(xid, None)
        super().abort(xid)

    def forget(self, xid: int) -> str | None:
        self.arrived.pop(xid, None)
        return super().forget(xid)

    def work(self) -> bool:
        """Take waiting offers while they fit."""
        busy = False
        bs = self.engine.block_manager.block_size
        sch = self.engine.scheduler
        while self.offers:
            src, msg = self.offers[0]
            xid = msg["xid"]
            if msg["op"] == "first":
                self.offers.popleft()
                if xid in self.rid_of:                # else aborted meanwhile
                    self.committed(xid, msg)
                busy = True
                continue
            if len(sch.running) + len(self.adopting) >= sch.max_num_seqs:
                break
            try:
                seq = self.engine.add_prefilled(msg["rid"], msg["ids"], msg["params"], index=msg["index"],
                                                priority=msg["priority"])
            except EngineOverloaded:
                break                            # no room yet: the oldest offer waits, and so do the others
            except Exception as exc:
                self.offers.popleft()
                self.t.send(src, {"op": "refuse", "xid": xid, "error": str(exc)})
                continue
            self.offers.popleft()
            mine = prompt_hashes(msg["ids"], bs)
            if mine != list(msg["hashes"]):
                self.abort(xid)
                self.engine.abort_request(msg["rid"])
                self.t.send(src, {"op": "refuse", "xid": xid, "error": "block hashes disagree with this prompt"})
                continue
            self.track(xid, msg["rid"])
            self.arrived.setdefault(xid, (msg["params"].n, set()))
            ad = self.adopting[xid] = Adoption(xid, msg["rid"], src, seq, mine, seq.num_cached_tokens // bs)
            self.counters["cached_blocks_hit"] += ad.have
            self.t.send(src, {"op": "have", "xid": xid, "have": ad.have})
            busy = True
        return busy

    def on_block(self, src: int, buf) -> None:
        xid, index, _ = block_header(buf)
        ad = self.adopting.get(xid)
        if ad is None:
            return                               # its request was aborted: drop what is still in flight
        try:
            if not ad.have <= index < len(ad.seq.block_table):
                raise TransferError(f"KV block {index} of transfer {xid} is outside the blocks it needs")
            data = check_block(self.blocks, buf, ad.hashes[index] if index < len(ad.hashes) else None)
        except TransferError as exc:
            self.counters["transfer_failures"] += 1
            self.t.send(ad.src, {"op": "abort", "xid": xid})
            self.abort(xid)
            self.fail(xid, exc)
            return
        self.blocks.write([ad.seq.block_table[index]], data[:, None])   # a TP instance: each rank its heads
        ad.received += 1
        ad.bytes += buf.size
        self.maybe_commit(xid)

    def maybe_commit(self, xid: int) -> None:
        ad = self.adopting[xid]
        if ad.commit is None or ad.received < ad.commit["blocks"]:
            return
        del self.adopting[xid]
        c = ad.commit
        if ad.received != len(ad.seq.block_table) - ad.have:
            self.abort(xid)
            self.fail(xid, TransferError(f"transfer {xid}: {ad.received} blocks arrived, "
                                         f"{len(ad.seq.block_table) - ad.have} were needed"))
            return
        secs = time.monotonic() - ad.t0
        self.count_transfer(ad.received, ad.bytes, secs)
        self.to_router({"op": "adopted", "xid": xid, "blocks": ad.received, "cached": ad.have, "bytes": ad.bytes,
                        "seconds": secs})
        self.committed(xid, c)

    def committed(self, xid: int, c: dict) -> None:
        """Sequence ``c["index"]`` of request ``xid`` starts here with the first token the prefill side sampled
        (after its blocks, or alone if that token ended it); the router hears once every sequence is here."""
        rid = self.rid_of[xid]
        try:
            out = self.engine.commit_prefilled(rid, c["token"], c["rng"], c["logprob"], index=c["index"])
        except (ValueError, RuntimeError) as exc:     # the request is aborted here (its blocks are free)
            self.abort(xid)
            self.fail(xid, exc)
            return
        n, arrived = self.arrived[xid]
        arrived.add(c["index"])
        if len(arrived) == n:
            self.to_router({"op": "decoding", "xid": xid})
        if out is not None:
            self.send_outputs([out])
