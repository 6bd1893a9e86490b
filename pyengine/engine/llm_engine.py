"""S09: `LLMEngine`, the continuous-batching loop (vLLM's shape, nano-vllm's size).

One ``step()`` = schedule -> build one ragged `ForwardBatch` -> ``runner.run`` -> sample the sequences that
reached the end of their known tokens -> stop checks -> `RequestOutput` snapshots with cumulative text and
the new delta. Nothing runs in the background: a server loop, the `LLM` class or a browser worker simply
calls ``step()`` while ``has_unfinished_requests()``.

With speculative decoding (S14, ``speculative_config``) a step first asks the proposer for drafts of every
decoding sequence; each then scores its last token and its k drafts in the same batch, the rejection sampler
keeps an accepted prefix plus one token of the model's own, and the rejected drafts' KV slots are rolled back.
A constrained sequence's (S15) draft is first cut where its grammar stops allowing it, and each of its k+1
verification rows is masked with the grammar state after the drafts before it (structured/processor.py).

S17 cross-step pipelining: with a runner over M > 1 pipeline stages (``runner.pipeline_groups``) the running
sequences are dealt into M groups and ``step()`` launches the next step of every group not in flight, then
finishes the oldest one in flight (``_pipelined_step``): the stages overlap across steps, and a sequence is
scheduled again only once its step's tokens are back.

A request with ``n > 1`` becomes n sequences. The first one prefills the prompt; the others wait until it
has produced its first token, by which time the prompt's full blocks are in the prefix cache, so they
only compute the last partial block (with prefix caching off they simply compute the prompt again).
"""
from __future__ import annotations

import time

import numpy as np

from pyengine.engine.args import EngineArgs
from pyengine.engine.block_manager import BlockManager
from pyengine.engine.chunk_budget import ChunkBudget, check_target_itl_ms
from pyengine.engine.executor import Executor
from pyengine.engine.input_processor import InputProcessor, stop_token_ids
from pyengine.engine.output_processor import OutputProcessor
from pyengine.engine.outputs import RequestMetrics, RequestOutput
from pyengine.engine.prompt_logprobs import PromptPass, finish_scoring, init_request, pooling_of
from pyengine.engine.scheduler import Scheduler, SchedulerOutput
from pyengine.engine.sequence import Sequence, SequenceStatus
from pyengine.engine.spec_decode import make_speculative_decoder, spec_stats
from pyengine.layers.sampler import Sampler


def _make_scheduler(config: EngineArgs, block_manager: BlockManager) -> Scheduler:
    """The scheduler of ``config``'s limits; S11: a chunk budget unless chunking by a target ITL is off."""
    target = config.target_itl_ms
    budget = ChunkBudget(target) if target is None or check_target_itl_ms(target) > 0 else None
    return Scheduler(block_manager, max_num_seqs=config.max_num_seqs,
                     max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
                     enable_chunked_prefill=config.enable_chunked_prefill, watermark=config.watermark,
                     aging_steps=config.aging_steps, chunk_budget=budget)


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (``max_waiting``); the HTTP server answers 429."""


class _Request:
    def __init__(self, request_id, prompt, prompt_token_ids, params, priority, arrival_time):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.priority = priority
        self.seqs: list[Sequence] = []
        self.checkers: list = []
        self.rngs: list = []
        self.logprobs: list[list | None] = []
        self.cumulative_logprob: list[float | None] = []
        self.matchers: list | None = None      # S15: one grammar matcher per sequence, or None
        self.token_masks: list | None = None   # issue 32: one TokenMasks per sequence (layers/token_masks.py)
        self.metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids))
        self.admitted = False
        # S19 (engine/prompt_logprobs.py, engine/pooling.py): what its prompt's forward also yields
        self.prompt_state = self.pool = None
        self.score_only = False                 # max_tokens 0 or pooling: ends after its prefill

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class _Flight:
    """One scheduled step, from its scheduling until its logits are back (S17: several may be in flight)."""

    def __init__(self, group, sched, batch, sampled, decode_only, t_step, t_start, extra=None):
        self.group, self.sched, self.batch, self.sampled = group, sched, batch, sampled
        self.extra = extra                      # S19: the step's prompt-logprob / pooled rows (PromptPass)
        self.decode_only, self.t_step, self.t_start = decode_only, t_step, t_start


class LLMEngine:
    def __init__(self, config: EngineArgs | None = None, executor: Executor | None = None, *, tokenizer=None,
                 draft_runner=None, runner=None, **options):
        """``config``: resolved `EngineArgs`; ``executor``: the `Executor` computing the steps (as
        `EngineArgs.create_engine` / `pyengine.llm.build_engine` build them). Keyword form: ``LLMEngine(model,
        max_model_len=.., ...)`` (any `EngineArgs` field), with ``runner=`` (a ModelRunner-like object: tests use
        fakes) or ``executor=`` (e.g. `parallel.launch.mpi_runner`'s) injected; ``tokenizer=``; ``draft_runner=``
        (S14's draft model)."""
        if not isinstance(config, EngineArgs):
            if "model" in options:                  # LLMEngine(model=path, ...): the keyword form of the first one
                if config is not None:
                    raise TypeError("LLMEngine got the model twice (positionally and as model=)")
                config = options.pop("model")
            config = EngineArgs(model=config, **options)
            executor = config.local_executor(runner) if executor is None else config.attach(executor)
        elif options or runner is not None:
            raise ValueError("LLMEngine(config, executor) takes no other options: set them on the EngineArgs")
        self.config, self.executor = config, executor
        config.check_runner(executor.runner)
        self.tokenizer = tokenizer if tokenizer is not None else executor.runner.tokenizer
        self.max_model_len, self.max_waiting = config.max_model_len, config.max_waiting
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size, config.enable_prefix_caching)
        self.scheduler = _make_scheduler(config, self.block_manager)
        # S17 cross-step pipelining (parallel/mpi.py): the running sequences are dealt into M groups, one step
        # of each in flight at once (one group with speculative decoding: its drafts need the latest tokens)
        self.pipeline_groups = executor.pipeline_groups if config.speculative_config is None else 1
        self.scheduler.num_groups = self.pipeline_groups
        self.clock = time.perf_counter          # S11: step durations for the chunk budget (tests inject one)
        self.sampler, self.rng = Sampler(), np.random.default_rng(config.seed)
        self.eos_token_ids = stop_token_ids(self.tokenizer)
        self.vocab_size = int(getattr(self.tokenizer, "vocab_size", 0) or self.runner.config.vocab_size)
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, config.max_model_len, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, config.max_model_len)
        self.spec = None if config.speculative_config is None else make_speculative_decoder(
            config.speculative_config, config.max_model_len, self.runner, draft_runner=draft_runner,
            max_num_seqs=config.max_num_seqs)
        self._reset_state()

    def _reset_state(self) -> None:
        """The bookkeeping of requests, sequences, steps in flight and counters, empty."""
        self._in_flight: list[_Flight] = []
        self.max_groups_in_flight = 0
        self._draft_masks: dict[int, list] = {}  # S15 x S14: seq_id -> grammar masks of its verification rows
        self.requests: dict[str, _Request] = {}
        self._seq_owner: dict[int, _Request] = {}
        self._next_seq_id = 0
        # S18 (pyengine/disagg/): a prefill instance's engine stops each sequence after its first token and
        # parks it in ``prefilled`` with its blocks, until its KV cache is shipped (``release_prefilled``)
        self.prefill_only = False
        self.prefilled: list[Sequence] = []
        # the latest step's wall time split (ms): plan (drafts, scheduling, batch), forward, sample (+ outputs)
        self.last_step_ms: dict[str, float] = {}
        self.counters = {"prompt_tokens": 0, "computed_prompt_tokens": 0, "generation_tokens": 0,
                         "finished_requests": 0, "aborted_requests": 0, "steps": 0,
                         "spec_decode_num_grammar_cut_tokens": 0}     # S15: draft tokens the grammar forbade

    @property
    def runner(self):
        """This process's model runner (the executor's): its config, tokenizer, KV cache, gguf."""
        return self.executor.runner

    @runner.setter
    def runner(self, runner) -> None:       # tests put a wrapper in front of it
        self.executor.runner = runner

    # requests ------------------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    def num_waiting_requests(self) -> int:
        return sum(1 for r in self.requests.values() if not r.admitted)

    def add_request(self, request_id: str, prompt, params=None, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        """Queue a request. ValueError if it is malformed or can never fit; EngineOverloaded if the
        waiting queue is full. ``arrival_time`` (extension) defaults to ``time.monotonic()``."""
        from pyengine.layers.sampler import make_rng
        from pyengine.sampling_params import SamplingParams

        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if self.max_waiting is not None and self.num_waiting_requests() >= self.max_waiting:
            raise EngineOverloaded(f"waiting queue is full ({self.max_waiting} requests)")
        if params is None:
            params = SamplingParams()
        pooling, params = pooling_of(self, params)     # S19: an embedding request
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        text, ids = self.input_processor.encode(prompt)
        max_tokens = self.input_processor.check(ids, params)
        max_tokens = 0 if pooling is not None else max_tokens
        self.scheduler.check_fits(len(ids), max_tokens)

        req = _Request(request_id, text, ids, params, priority,
                       time.monotonic() if arrival_time is None else arrival_time)
        req.matchers = self.input_processor.matchers(params, params.n)
        req.token_masks = self.input_processor.token_masks(params, params.n, ids)
        init_request(req, params, pooling, max_tokens)
        for i in range(params.n):
            seq = Sequence(self._next_seq_id, request_id, i, ids, params, priority, max_tokens=max_tokens)
            self._next_seq_id += 1
            if i > 0 and self.block_manager.enable_prefix_caching:
                seq.wait_for = req.seqs[0]
            req.seqs.append(seq)
            self.output_processor.add_sequence(req, params, max_tokens)
            seq.skip_prefix_cache = i == 0 and (req.prompt_state is not None or req.pool is not None)
            req.rngs.append(None if params.greedy else make_rng(params, self.rng, i))
            self._seq_owner[seq.seq_id] = req
        self.requests[request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free all its blocks; returns its final output (None if unknown)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        flying = {s.seq_id for f in self._in_flight for s, _ in f.sched.scheduled}
        for seq in req.seqs:
            if not seq.is_finished:        # S17: blocks of a sequence in flight are freed when its step is back
                self._finish(seq, free_blocks=seq.seq_id not in flying)
                self.output_processor.abort(req, seq)
        for seq in req.seqs:
            self._seq_owner.pop(seq.seq_id, None)
        req.metrics.finished_time = time.monotonic()
        self.counters["aborted_requests"] += 1
        return self.output_processor.make_output(req, {})

    def has_unfinished_requests(self) -> bool:
        """Also True while a step is in flight (S17: of aborted sequences, whose blocks it frees when back)."""
        return bool(self.requests or self._in_flight)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def health(self) -> tuple[str, str | None]:
        """("ok", None), or ("unhealthy", why) when the runner cannot run steps (S17: a lost parallel rank)."""
        failure = self.executor.failure
        return ("unhealthy", failure) if failure else ("ok", None)

    def model_metadata(self) -> dict | None:
        """The model GGUF's metadata (the server reads its general.sampling.* defaults); None without a file."""
        return self.runner.gguf.metadata if self.runner.gguf is not None else None

    def num_used_blocks(self) -> int:
        return self.block_manager.num_used_blocks()

    # the step ------------------------------------------------------------------------------------
    def _build_batch(self, sched: SchedulerOutput):
        from pyengine.engine.forward_batch import ForwardBatch

        token_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, block_tables, logits_indices, sampled = [], [], [], [], []
        for seq, n in sched.scheduled:
            start = seq.num_computed_tokens
            k = len(seq.spec_token_ids)          # S14: a decode's drafts ride behind its last token
            token_ids.extend(seq.token_ids[start:start + n - k])
            token_ids.extend(seq.spec_token_ids)
            positions.extend(range(start, start + n))
            query_lens.append(n)
            context_lens.append(start + n)
            block_tables.append(np.asarray(seq.block_table, dtype=np.int32))
            # the prompt (or recompute) is complete: sample the next token (S19: unless it only scores its prompt)
            if start + n - k == seq.num_tokens and not self._seq_owner[seq.seq_id].score_only:
                logits_indices.extend(range(len(token_ids) - k - 1, len(token_ids)))   # k + 1 rows to verify
                sampled.append(seq)
        extra = PromptPass.plan(sched.scheduled, lambda s: self._seq_owner[s.seq_id])   # S19: prompt rows
        batch = ForwardBatch(token_ids=np.asarray(token_ids, dtype=np.int64),
                             positions=np.asarray(positions, dtype=np.int64),
                             query_lens=query_lens, context_lens=context_lens, block_tables=block_tables,
                             logits_indices=np.asarray(logits_indices, dtype=np.int64))
        return batch, sampled, extra

    def _propose(self) -> None:
        """S14: drafts for every running sequence about to decode (see engine/spec_decode.py)."""
        seqs, rngs = [], []
        for seq in self.scheduler.running:
            seq.spec_token_ids, seq.spec_draft_probs = [], None
            if seq.num_tokens - seq.num_computed_tokens == 1 and seq.params.speculative:
                req = self._seq_owner[seq.seq_id]
                seqs.append(seq)
                rngs.append(req.rngs[seq.index])
                # S15: a drafter may mask its own guesses with the sequence's grammar
                seq.spec_grammar = req.matchers[seq.index] if req.matchers is not None else None
        if seqs:
            self.spec.propose(seqs, rngs)
            self._check_drafts(seqs)

    def _check_drafts(self, seqs) -> None:
        """S15: cut each constrained draft at the first token its grammar forbids; keep the masks of its
        verification rows for `_verify` (see structured/processor.py)."""
        from pyengine.structured.processor import check_draft
        self._draft_masks.clear()
        for seq in seqs:
            if seq.spec_grammar is None or not seq.spec_token_ids:
                continue
            k = len(seq.spec_token_ids)
            seq.spec_token_ids, seq.spec_draft_probs, masks = check_draft(
                seq.spec_grammar, seq.spec_token_ids, seq.spec_draft_probs)
            self.counters["spec_decode_num_grammar_cut_tokens"] += k - len(seq.spec_token_ids)
            if seq.spec_token_ids:
                self._draft_masks[seq.seq_id] = masks

    def step(self) -> list[RequestOutput]:
        if self.pipeline_groups > 1:
            return self._pipelined_step()
        t_step = self.clock()
        # S14's back-off prices a step by the process's CPU time: on a shared host its wall time also holds
        # other processes' load, which drifts more than the draft lengths' costs differ (docs/performance.md)
        t_start = time.process_time()
        if self.spec is not None:
            self._propose()
        flight = self._schedule(0, t_step, t_start)
        if flight is None:
            return []
        captures = self._captures()
        t_plan = self.clock()
        logits = self.executor.run(flight.batch) if flight.batch.token_ids.size else None
        # S13: a step captured now costs more than its replays will; it would price its draft length too high
        flight.decode_only = flight.decode_only and self._captures() == captures
        t_forward = self.clock()
        outputs = self._complete(flight, logits)
        self.last_step_ms = {"plan": (t_plan - t_step) * 1e3, "forward": (t_forward - t_plan) * 1e3,
                             "sample": (self.clock() - t_forward) * 1e3}
        return outputs

    def _pipelined_step(self) -> list[RequestOutput]:
        """S17 cross-step pipelining: launch the next step of every group not in flight, then finish the
        oldest step in flight and return its outputs. While that step's activations went through the later
        stages, stage 0 (this process) already ran the other groups' steps; a sequence is scheduled again
        only once its step is back and sampled."""
        try:
            flying = {f.group for f in self._in_flight}
            for g in range(self.pipeline_groups):
                flight = None if g in flying else self._schedule(g, self.clock(), time.process_time())
                if flight is not None:
                    if flight.batch.token_ids.size:
                        self.executor.launch(flight.batch)
                    self._in_flight.append(flight)
            self.max_groups_in_flight = max(self.max_groups_in_flight, len(self._in_flight))
            if not self._in_flight:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("scheduler could not schedule any of the unfinished requests")
                return []
            flight = self._in_flight.pop(0)
            logits = self.executor.finish() if flight.batch.token_ids.size else None
        except Exception:                  # e.g. a lost rank: no step is in flight any more
            for f in self._in_flight:
                self._free_aborted(f.sched)
            self._in_flight.clear()
            raise
        return self._complete(flight, logits)

    def _schedule(self, group: int, t_step: float, t_start: float) -> _Flight | None:
        """Plan ``group``'s next step (None if it has nothing to run) and build its batch."""
        sched = self.scheduler.schedule(group)
        if sched.is_empty:
            if self.pipeline_groups == 1 and self.scheduler.has_unfinished():
                # add_request's checks make this unreachable; fail loudly rather than spin forever
                raise RuntimeError("scheduler could not schedule any of the unfinished requests")
            return None
        now = time.monotonic()
        self.counters["steps"] += 1
        for seq, n in sched.scheduled:
            req = self._seq_owner[seq.seq_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.metrics.num_cached_tokens = seq.num_cached_tokens
                self.counters["prompt_tokens"] += seq.num_prompt_tokens
            req.admitted = True
            # prompt tokens actually run through the model (cache hits excluded, recomputes included)
            self.counters["computed_prompt_tokens"] += max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))
        for seq in sched.preempted:
            self._seq_owner[seq.seq_id].metrics.num_preemptions += 1

        # S14's back-off prices draft lengths by the times of steps that only decode (no prompt chunks)
        decode_only = all(n == 1 + len(s.spec_token_ids) for s, n in sched.scheduled) and not sched.preempted
        batch, sampled, extra = self._build_batch(sched)
        return _Flight(group, sched, batch, sampled, decode_only, t_step, t_start, extra)

    def _free_aborted(self, sched: SchedulerOutput) -> list[Sequence]:
        """S17: free the blocks of the sequences of a step that were aborted while it was in flight."""
        gone = [s for s, _ in sched.scheduled if s.is_finished]
        for seq in gone:
            self.block_manager.free(seq)
        return gone

    def _complete(self, flight: _Flight, logits) -> list[RequestOutput]:
        """A step's logits are back: advance its sequences, sample, check stops, make the outputs."""
        sched, sampled = flight.sched, flight.sampled
        if flight.extra is not None:          # S19: prompt logprobs and pooled states first (the runner's latest run)
            flight.extra.take(self.runner, self.vocab_size)
        if self._free_aborted(sched):      # S17 (one row per sequence: no drafts with pipelining)
            keep = [i for i, s in enumerate(sampled) if not s.is_finished]
            logits, sampled = (logits[keep] if keep else None), [sampled[i] for i in keep]
            sched.scheduled = [(s, n) for s, n in sched.scheduled if not s.is_finished]
        self.scheduler.on_step_done(sched)

        deltas: dict[str, dict[int, list]] = {}
        if flight.extra is not None:          # S19: requests that only score their prompt end here
            finish_scoring(self, flight.extra.scoring, deltas)
        num_drafts = sum(len(s.spec_token_ids) for s, _ in sched.scheduled)
        if sampled:
            self._sample(sampled, logits, deltas)
        if self.spec is not None:
            if flight.decode_only:
                self.spec.observe_step(time.process_time() - flight.t_start, len(sched.scheduled), num_drafts)
            for seq, _ in sched.scheduled:
                seq.spec_token_ids, seq.spec_draft_probs = [], None
            self._draft_masks.clear()
        outputs = []
        for rid, d in deltas.items():
            req = self.requests[rid]
            outputs.append(self.output_processor.make_output(req, d))
            if req.finished:
                del self.requests[rid]
                for s in req.seqs:
                    self._seq_owner.pop(s.seq_id, None)
                self.counters["finished_requests"] += 1
        # S17: with pipelining, launch to finish: what the group's sequences wait between two tokens
        self.scheduler.observe_step(sched, self.clock() - flight.t_step)
        return outputs

    def _captures(self) -> int:
        """S13: steps the runner has captured so far (0 without captured steps)."""
        graphs = getattr(self.runner, "graphs", None)
        return graphs.captures if graphs is not None else 0

    def _sample(self, sampled: list[Sequence], logits, deltas: dict) -> None:
        """Plain rows through the batch sampler; sequences with drafts through the rejection sampler."""
        reqs = [self._seq_owner[s.seq_id] for s in sampled]
        rows, row = [], 0
        for s in sampled:
            rows.append(row)
            row += 1 + len(s.spec_token_ids)
        plain = [i for i, s in enumerate(sampled) if not s.spec_token_ids]
        results: list = [None] * len(sampled)
        if plain:
            sel = logits if len(plain) == len(logits) else logits[[rows[i] for i in plain]]
            allowed = None                      # S15: the grammar's token mask of each constrained row
            if any(reqs[i].matchers is not None for i in plain):
                allowed = [reqs[i].matchers[sampled[i].index].allowed_mask() if reqs[i].matchers is not None
                           else None for i in plain]
            token_masks = None                  # issue 32: allowed_token_ids, bad_words, min_tokens, thinking
            if any(reqs[i].token_masks is not None for i in plain):
                token_masks = [reqs[i].token_masks[sampled[i].index] if reqs[i].token_masks is not None
                               else None for i in plain]
            tokens, infos = self.sampler.sample(
                sel, [reqs[i].params for i in plain], [sampled[i].prompt_token_ids for i in plain],
                [sampled[i].output_token_ids for i in plain], [reqs[i].rngs[sampled[i].index] for i in plain],
                allowed=allowed, token_masks=token_masks)
            for i, tok, info in zip(plain, tokens.tolist(), infos):
                results[i] = ([int(tok)], [info])
        for i, seq in enumerate(sampled):
            if results[i] is None:
                results[i] = self._verify(seq, reqs[i], logits[rows[i]:rows[i] + 1 + len(seq.spec_token_ids)])
        now = time.monotonic()
        for seq, req, (toks, infos) in zip(sampled, reqs, results):
            for tok, info in zip(toks, infos):
                self._append_token(seq, req, tok, info, now, deltas)
                if seq.is_finished:
                    break
            if seq.spec_token_ids:
                k, accepted = len(seq.spec_token_ids), len(toks) - 1
                self.spec.record(seq, k, accepted)
                m = req.metrics
                m.num_drafts += 1
                m.num_draft_tokens += k
                m.num_accepted_tokens += accepted
                self.scheduler.accept_drafts(seq, accepted)

    def _verify(self, seq: Sequence, req: _Request, rows) -> tuple[list[int], list]:
        """S14: the tokens one verification emits (accepted drafts + the model's own) and their logprobs."""
        from pyengine.layers.rejection_sampler import verify
        from pyengine.layers.sampler import token_logprobs

        p = req.params
        raw, masks = rows, self._draft_masks.get(seq.seq_id)
        if masks is not None:                   # S15: row i masked with the grammar after the first i drafts
            from pyengine.structured.processor import mask_rows
            rows = mask_rows(rows, masks)
        if req.token_masks is not None:         # issue 32: row i after the first i drafts
            tm, drafts = req.token_masks[seq.index], seq.spec_token_ids
            rows = np.stack([tm.apply(rows[i], seq.output_token_ids, drafts[:i]) for i in range(len(rows))])
        toks = verify(rows, seq.spec_token_ids, seq.spec_draft_probs, p, req.rngs[seq.index],
                      seq.prompt_token_ids, seq.output_token_ids)
        infos = [token_logprobs(raw[j], t, p.logprobs) if p.logprobs is not None else None
                 for j, t in enumerate(toks)]
        return toks, infos

    def _append_token(self, seq: Sequence, req: _Request, tok: int, info, now: float, deltas: dict) -> None:
        if req.matchers is not None and not req.matchers[seq.index].advance(tok):
            raise RuntimeError(f"sampled token {tok} is outside the grammar of request {req.request_id!r}")
        seq.append_token(tok)
        if req.token_masks is not None:
            req.token_masks[seq.index].advance(tok)
        self.counters["generation_tokens"] += 1
        res = self.output_processor.on_token(seq, req, tok, info, now, deltas)
        if res is not None:
            seq.finish_reason, seq.stop_reason = res.finish_reason, res.stop_reason
            self._finish(seq)
            if req.finished:
                req.metrics.finished_time = now
        if self.prefill_only and not seq.is_finished:      # S18: the decode instance takes it from here
            self.scheduler.running.remove(seq)
            self.prefilled.append(seq)

    def _finish(self, seq: Sequence, free_blocks: bool = True) -> None:
        self.scheduler.finish(seq, free_blocks)
        if self.spec is not None:
            self.spec.release(seq)

    # S18 disaggregation (pyengine/disagg/): hand a prefilled sequence from one engine to another ----------
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
                      index: int = 0) -> Sequence:
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
            self.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, params, arrival_time=arrival_time)
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

    # introspection -------------------------------------------------------------------------------
    def stats(self) -> dict:
        bm, sch = self.block_manager, self.scheduler
        load = getattr(getattr(self.runner, "model", None), "expert_load", None)     # MoE models (S16)
        return {
            **({"expert_load": load.snapshot()} if load is not None else {}),
            "running": len(sch.running), "waiting": len(sch.waiting), "preempted": len(sch.preempted),
            "unfinished_requests": len(self.requests),
            "used_blocks": bm.num_used_blocks(), "free_blocks": bm.num_free_blocks(), "total_blocks": bm.num_blocks,
            "kv_cache_usage": bm.num_used_blocks() / bm.num_blocks, "cached_blocks": bm.num_cached_blocks(),
            "prefix_cache_hits": bm.hits, "prefix_cache_misses": bm.misses,
            "prefix_cache_hit_rate": bm.hit_rate(), "prefix_cache_hit_tokens": bm.hit_tokens,
            "prefix_cache_query_tokens": bm.query_tokens, "prefix_cache_evictions": bm.evictions,
            "num_preemptions": sch.num_preemptions, **self.counters,
            **spec_stats(self.spec),
            **(sch.chunk_budget.stats() if sch.chunk_budget is not None else {}),
            **({"pipeline_groups": self.pipeline_groups, "max_groups_in_flight": self.max_groups_in_flight}
               if self.pipeline_groups > 1 else {}),
        }

    def snapshot(self) -> dict:
        """stats() plus what a live view of the engine draws (the browser demo's panel, once per step):
        ``blocks``, each KV block's state (0 free, 1 in use, 2 in use and in the prefix cache, 3 free but
        holding a cached prefix, S06/S07); ``owners``, request id -> the blocks its sequences hold;
        ``requests``, request id -> prompt tokens, prompt tokens reused from the prefix cache, drafted and
        accepted tokens (S14) and the size of the grammar's token mask for its next token (S15, else None);
        ``step_ms``, the latest step's time split."""
        bm = self.block_manager
        blocks = [(2 if h is not None else 1) if r > 0 else (3 if h is not None else 0)
                  for r, h in zip(bm.ref_counts, bm.block_hash)]
        owners: dict[str, list[int]] = {}
        requests = {}
        for rid, req in self.requests.items():
            held = owners.setdefault(rid, [])
            for seq in req.seqs:
                held.extend(b for b in seq.block_table if b not in held)
            m = req.metrics
            mask = None
            if req.matchers is not None and not req.finished:
                mask = int(req.matchers[0].allowed_mask().sum())
            requests[rid] = {"prompt_tokens": m.num_prompt_tokens, "cached_tokens": m.num_cached_tokens,
                             "admitted": req.admitted, "draft_tokens": m.num_draft_tokens,
                             "accepted_tokens": m.num_accepted_tokens, "grammar_mask_size": mask}
        return {**self.stats(), "block_size": bm.block_size, "blocks": blocks, "owners": owners,
                "requests": requests, "step_ms": dict(self.last_step_ms)}
