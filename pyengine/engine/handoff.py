"""S18 disaggregation, the engine's side: hand a prefilled sequence from one engine to another.

A prefill instance's engine (``prefill_only``) stops each sequence after its first token and parks it in
``prefilled`` with its blocks until its KV cache is shipped (``release_prefilled``); a decode instance's engine
adopts it (``add_prefilled``: its blocks allocated, prefix-cache hits first), has its K/V written into them through
the executor (``write_blocks``), then starts it decoding (``commit_prefilled``). pyengine/disagg/ drives both sides;
`LLMEngine` takes these methods from `PrefillHandoff`.
"""
from __future__ import annotations

import time

from pyengine.engine.outputs import RequestOutput
from pyengine.engine.request import EngineOverloaded
from pyengine.engine.sequence import Sequence, SequenceStatus


class PrefillHandoff:
    """The hand-over methods of `LLMEngine` (they use its requests, scheduler, block manager and outputs)."""

    def release_prefilled(self, request_id: str) -> None:
        """Prefill side: the request's KV blocks have been shipped (or its transfer was given up): free its
        blocks and forget it, without counting it as finished or aborted here."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if seq in self.prefilled:
                self.prefilled.remove(seq)
            if not seq.is_finished:
                self._finish(seq)
            self._seq_owner.pop(seq.seq_id, None)

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], params, arrival_time=None,
                      index: int = 0, priority: int = 0) -> Sequence:
        """Decode side: adopt sequence ``index`` of a request whose prompt K/V another engine computed. The
        first call registers the request with all its ``params.n`` sequences, each in no scheduler queue until
        it is committed (n > 1: the prefill engine ran them as `add_request` does, and offers them one by one).
        The sequence's blocks are allocated now, prefix-cache hits first: ``seq.num_cached_tokens`` tokens are
        already here (a sibling committed before it left the prompt's full blocks in the cache), the caller
        writes the rest into ``seq.block_table`` (engine/kv_cache.py layout), then calls `commit_prefilled`.
        `abort_request` frees its blocks as usual. Raises ValueError like `add_request` (or for a sequence
        adopted already), and EngineOverloaded when the blocks are not free now (a request with no other
        sequence here is then forgotten)."""
        req = self.requests.get(request_id)
        new = req is None
        if new:
            self.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, params, priority,
                             arrival_time=arrival_time)
            req = self.requests[request_id]
            for s in req.seqs:                  # each waits for its own commit, in no queue
                self.scheduler.waiting.remove(s)
                s.wait_for = None
        elif list(prompt_token_ids) != req.prompt_token_ids:
            raise ValueError(f"request {request_id!r} is here with another prompt")
        if not 0 <= index < len(req.seqs):
            raise ValueError(f"request {request_id!r} has no sequence {index} (n = {len(req.seqs)})")
        seq, bm = req.seqs[index], self.block_manager
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"sequence {index} of request {request_id!r} is adopted already")
        cached = bm.get_computed_blocks(seq)
        need = seq.num_tokens - len(cached) * bm.block_size
        if len(self.scheduler.running) >= self.scheduler.max_num_seqs or not bm.can_allocate(
                seq, cached, need + 1, self.scheduler.watermark_blocks if self.scheduler.running else 0):
            if new:
                self.release_prefilled(request_id)
            raise EngineOverloaded("no room for a prefilled sequence now")
        bm.allocate(seq, cached, need)
        return seq

    def commit_prefilled(self, request_id: str, first_token: int, rng_state=None, logprob=None,
                         arrival_time: float | None = None, index: int = 0) -> RequestOutput | None:
        """Decode side: every prompt block of `add_prefilled`'s sequence ``index`` holds its K/V; append the
        first token the prefill engine sampled (its stop checker and grammar advance, its text is not emitted
        again: the prefill side streamed it) with the sampler state after it (``rng_state``: the numpy
        bit-generator state; ``logprob``: its logprobs dict and cumulative logprob), and start decoding.
        n > 1: a sibling that ended with its first token on the prefill side is committed without
        `add_prefilled` (no blocks): the same token ends it here. Returns the request's output if the token
        ends the sequence here (finished when no sibling is left), else None."""
        req = self.requests[request_id]
        seq = req.seqs[index]
        if seq.status is not SequenceStatus.WAITING or seq.wait_for is not None:
            raise ValueError(f"sequence {index} of request {request_id!r} is not waiting for its commit")
        if seq.block_table:
            seq.num_computed_tokens = seq.num_tokens
            self.block_manager.cache_computed_blocks(seq)
        if rng_state is not None and req.rngs[index] is not None:
            req.rngs[index].bit_generator.state = rng_state
        now = time.monotonic()
        m = req.metrics
        if not req.admitted:                    # the request's first sequence here: its prompt counts once
            req.admitted = True
            m.first_scheduled_time = now
            m.num_cached_tokens = seq.num_cached_tokens
            self.counters["prompt_tokens"] += seq.num_prompt_tokens
        self._append_token(seq, req, first_token, None, now, {})
        if logprob is not None and req.logprobs[index] is not None:
            req.logprobs[index].append(logprob[0])
            req.cumulative_logprob[index] = logprob[1]
        if seq.is_finished:
            if req.finished:
                del self.requests[request_id]
                for s in req.seqs:
                    self._seq_owner.pop(s.seq_id, None)
                self.counters["finished_requests"] += 1
            return self.output_processor.make_output(req, {})
        if not seq.block_table:
            self.abort_request(request_id)
            raise RuntimeError(f"sequence {index} of request {request_id!r} was committed without its KV blocks "
                               f"and its first token does not end it")
        seq.status = SequenceStatus.RUNNING
        self.scheduler.running.append(seq)
        return None
