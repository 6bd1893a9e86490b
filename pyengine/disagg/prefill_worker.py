"""S18: a prefill instance — computes prompts and their first token, then ships the prompt's KV blocks.

    router  --prefill(xid, prompt, params, decode rank)-->  prefill
    prefill: engine steps (chunked prefill as usual) until the first token; that output goes to the router at once
             (the client's first token), the sequence is parked with its blocks (engine.prefill_only)
    prefill --offer(xid, prompt, params, block hashes)-->   decode
    decode  --have(xid, k)-->                               prefill   (its prefix cache holds the first k blocks)
    prefill --block k, k+1, ... (kv_transfer messages)-->   decode    (at most tuning.TRANSFER_WINDOW in flight; a tensor-parallel
                                                                      instance gathers its ranks' heads of them first)
    prefill --commit(xid, first token, sampler state)-->    decode
    prefill: frees the blocks once all are packed; "shipped" (blocks, bytes, seconds) to the router

n > 1 (the OpenAI ``n``): the engine runs the request's n sequences as the colocated engine does (sequence i > 0
waits for sequence 0's first token, then computes only the prompt's last partial block over the cached full ones,
and samples its first token from its own generator), so every choice's first token and sampler state are the
colocated ones (within the limits under "Exactness"). The sequences go to the same decode instance one after the other, each with its own offer (its
``index``), "have", blocks and commit: the next offer leaves only once the previous commit has, and the decode
side handles its messages in order, so by then the shared full blocks are in its prefix cache and only the
sequence's own last block moves ("have" says so; nothing assumes it). A sequence that ended with its first token
here sends no blocks, only that token ("first", after the request's first offer). The request's blocks here are
freed once every sequence is shipped or reported (the siblings still to prefill keep reading the shared ones).
Exactness: a sibling's first token is the colocated one when the colocated engine computes its prompt chunks as
this one does: here (no decodes beside it) each sibling's last block is one chunk; the colocated engine splits it
only when that step's budget (max_num_batched_tokens less choice 0's decode token, or S11's chunk budget) runs out,
or, without prefix caching, when the n prompts do not fit one step. Later tokens are computed in other batches than
the colocated engine's (choice 0 decodes alone while the others move), which changes no bits: a row's product does
not depend on its batch (layers/linear.py DenseLinear).

While a transfer is under way, or its offer has waited less than ``tuning.OFFER_WAIT_S`` for an answer, no new engine step
starts (a long prefill step would stall the transfer, whose messages MPI moves only while both sides take part);
the decode side takes blocks for a share of its step time between two of its steps (decode_worker.py). A transfer whose decode instance stops answering for ``timeout`` seconds is given up: its request
fails, its blocks are freed here.
"""
from __future__ import annotations

import time

from pyengine import tuning
from pyengine.disagg.instance import Instance
from pyengine.disagg.kv_transfer import KVBlocks, pack_data
from pyengine.engine.block_manager import hash_block
from pyengine.engine.prompt_logprobs import decode_params



def prompt_hashes(token_ids, block_size: int) -> list[bytes]:
    """The chained prefix-cache names of a prompt's full blocks (block_manager.hash_block)."""
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        out.append(hash_block(out[-1] if out else None, token_ids[i * block_size:(i + 1) * block_size]))
    return out


def first_token(req, seq) -> dict:
    """What the decode side needs of a prefilled sequence besides its K/V: its first token, its generator's state
    after it and the token's logprobs (with the cumulative logprob)."""
    rng, lps = req.rngs[seq.index], req.logprobs[seq.index]
    return {"token": seq.output_token_ids[0], "rng": None if rng is None else rng.bit_generator.state,
            "logprob": None if lps is None else (lps[0], req.cumulative_logprob[seq.index])}


class Transfer:
    """One sequence's prompt blocks on their way to a decode instance."""

    def __init__(self, xid: int, rid: str, dest: int, seq, hashes: list[bytes], first: dict):
        self.xid, self.rid, self.dest, self.seq, self.hashes, self.first = xid, rid, dest, seq, hashes, first
        self.index = seq.index
        self.next = None                        # next block index to send (None: waiting for "have")
        self.end = len(seq.block_table)
        self.sent = self.bytes = 0
        self.t0 = self.t_last = time.monotonic()
        self.packed = False


class PrefillWorker(Instance):
    role = "prefill"

    def __init__(self, engine, transport, timeout: float = 60.0):
        super().__init__(engine, transport)
        engine.prefill_only = True
        self.blocks = KVBlocks(engine.executor)
        self.timeout = timeout
        self.decode_of: dict[int, int] = {}      # xid -> the decode rank the router chose
        self.transfers: dict[int, Transfer] = {}  # xid -> the transfer under way (one sequence of it at a time)
        self.shipped: dict[int, set[int]] = {}   # xid -> indices of its sequences offered or reported so far

    def handle(self, src: int, msg: dict) -> None:
        op, xid = msg["op"], msg.get("xid")
        if op == "prefill":
            try:
                self.engine.add_request(msg["rid"], {"prompt_token_ids": msg["ids"]}, msg["params"], msg["priority"])
            except Exception as exc:            # refused here (the router checked it already): report it
                self.fail(xid, exc)
                return
            self.track(xid, msg["rid"])
            self.decode_of[xid] = msg["decode"]
        elif op == "have" and xid in self.transfers:
            tr = self.transfers[xid]
            tr.next, tr.t_last = msg["have"], time.monotonic()
        elif op == "refuse" and xid in self.transfers:
            self.give_up(xid, RuntimeError(f"decode instance rank {src} refused the transfer: {msg['error']}"))
        elif op in ("have", "refuse"):
            pass                                # a transfer aborted meanwhile
        else:
            super().handle(src, msg)

    def forget(self, xid: int) -> str | None:
        self.decode_of.pop(xid, None)
        self.shipped.pop(xid, None)
        return super().forget(xid)

    def abort(self, xid: int) -> None:
        tr = self.transfers.pop(xid, None)
        if tr is not None:
            self.t.send(tr.dest, {"op": "abort", "xid": xid})
            self.engine.release_prefilled(tr.rid)
            self.forget(xid)
            return
        super().abort(xid)

    def give_up(self, xid: int, exc: BaseException) -> None:
        self.counters["transfer_failures"] += 1
        self.abort(xid)
        self.fail(xid, exc)

    def after_step(self) -> None:
        """Offer newly prefilled sequences to their decode instance."""
        for xid in list(self.decode_of):
            if xid not in self.transfers:
                self.advance(xid)

    def advance(self, xid: int) -> None:
        """No transfer of request ``xid`` is under way: offer its next prefilled sequence; else report the ones
        that ended with their first token (once its first offer is out: the decode side then knows the
        request); once every sequence is shipped or reported, free the request here."""
        eng = self.engine
        req = eng.requests.get(self.rid_of.get(xid))
        if req is None:                           # released already (its last blocks are packed)
            self.forget(xid)
            return
        done, dest = self.shipped.setdefault(xid, set()), self.decode_of[xid]
        seq = next((s for s in req.seqs if s.index not in done and s in eng.prefilled), None)
        if seq is not None:
            done.add(seq.index)
            hashes = prompt_hashes(seq.prompt_token_ids, eng.block_manager.block_size)
            self.transfers[xid] = Transfer(xid, req.request_id, dest, seq, hashes, first_token(req, seq))
            self.t.send(dest, {"op": "offer", "xid": xid, "rid": req.request_id, "index": seq.index,
                               "ids": seq.prompt_token_ids, "params": decode_params(req.params), "hashes": hashes,
                               "priority": req.priority})
            return
        if not done:
            return                                # its first sequence is still being prefilled
        for s in req.seqs:
            if s.is_finished and s.index not in done:
                done.add(s.index)
                self.t.send(dest, {"op": "first", "xid": xid, "index": s.index, **first_token(req, s)})
        if len(done) == len(req.seqs):
            eng.release_prefilled(req.request_id)
            self.forget(xid)

    def work(self) -> bool:
        """Push block messages of the transfers under way; finish the ones whose sends completed. True only if a
        message went out or a transfer ended: a turn that only waits (a full window, the decode side taking its
        blocks between its steps) lets the loop sleep instead of spinning on the core the ranks share."""
        busy = False
        now = time.monotonic()
        for xid, tr in list(self.transfers.items()):
            if tr.next is None or (tr.packed and self.t.pending(tr.dest)):
                if now - tr.t_last > self.timeout:
                    self.give_up(xid, RuntimeError(f"decode instance rank {tr.dest} did not take the KV blocks "
                                                   f"within {self.timeout:g} s"))
                continue
            room = tuning.TRANSFER_WINDOW - self.t.pending(tr.dest)
            if not tr.packed and room > 0:
                busy = True
                todo = range(tr.next, min(tr.end, tr.next + room))
                kvs = self.blocks.views([tr.seq.block_table[i] for i in todo]) if todo else []
                for i, (k, v) in zip(todo, kvs):   # (a TP instance gathered its ranks' heads of them at once)
                    buf = pack_data(k, v, xid, i, tr.hashes[i] if i < len(tr.hashes) else None)
                    self.t.send_buffer(tr.dest, buf)
                    tr.next, tr.sent, tr.bytes, tr.t_last = i + 1, tr.sent + 1, tr.bytes + buf.size, now
                if tr.next >= tr.end:
                    self.t.send(tr.dest, {"op": "commit", "xid": xid, "index": tr.index, "blocks": tr.sent,
                                          **tr.first})
                    req = self.engine.requests.get(tr.rid)
                    if req is not None and len(self.shipped[xid]) == len(req.seqs):
                        self.engine.release_prefilled(tr.rid)  # every sequence is packed: the blocks are free
                    tr.packed = True
            if tr.packed and not self.t.pending(tr.dest):
                busy = True
                del self.transfers[xid]
                secs = time.monotonic() - tr.t0
                self.count_transfer(tr.sent, tr.bytes, secs)
                self.to_router({"op": "shipped", "xid": xid, "index": tr.index, "blocks": tr.sent, "bytes": tr.bytes,
                                "seconds": secs})
                self.advance(xid)                          # its next sequence, or the end of the request here
        return busy

    def may_step(self) -> bool:
        now = time.monotonic()
        return not any(tr.next is not None or now - tr.t0 < tuning.OFFER_WAIT_S for tr in self.transfers.values())
