"""S09: `LLMEngine`, the continuous-batching loop (vLLM's shape, nano-vllm's size).

One ``step()`` = schedule -> build one ragged `ForwardBatch` -> ``runner.run`` -> sample the sequences that
reached the end of their known tokens -> stop checks -> `RequestOutput` snapshots with cumulative text and
the new delta. Nothing runs in the background: a server loop, the `LLM` class or a browser worker simply
calls ``step()`` while ``has_unfinished_requests()``.

Around the loop, in modules of their own: the input and output processors (prompt forms -> ids and refusals;
stop checks, logprobs, deltas -> outputs), S14's draft step (engine/spec_step.py: drafts proposed before a step,
cut by their grammar (S15), verified after it), S17's steps in flight (engine/flights.py: with an executor over
M > 1 pipeline stages the running sequences are dealt into M groups, one step of each in flight, ``step()``
finishing the oldest), S18's hand-over of prefilled sequences (engine/handoff.py) and ``stats`` / ``snapshot``
(engine/introspect.py).

A request with ``n > 1`` becomes n sequences. The first one prefills the prompt; the others wait until it
has produced its first token, by which time the prompt's full blocks are in the prefix cache, so they
only compute the last partial block (with prefix caching off they simply compute the prompt again).
"""
from __future__ import annotations

import time

import numpy as np

from pyengine.engine.args import EngineArgs, engine_config
from pyengine.engine.block_manager import BlockManager
from pyengine.engine.executor import Executor
from pyengine.engine.flights import Flight, InFlight
from pyengine.engine.forward_batch import build_batch
from pyengine.engine.handoff import PrefillHandoff
from pyengine.engine.input_processor import InputProcessor, stop_token_ids
from pyengine.engine.introspect import engine_snapshot, engine_stats
from pyengine.engine.output_processor import OutputProcessor
from pyengine.engine.outputs import RequestOutput
from pyengine.engine.prompt_logprobs import PromptPass, finish_scoring, pooling_of
from pyengine.engine.request import EngineOverloaded, EngineRequest, note_scheduled
from pyengine.engine.sampler_step import sample_step
from pyengine.engine.scheduler import SchedulerOutput, make_scheduler
from pyengine.engine.sequence import Sequence
from pyengine.engine.spec_decode import make_speculative_decoder
from pyengine.engine.spec_step import DraftStep
from pyengine.layers.sampler import Sampler, make_rng
from pyengine.sampling_params import SamplingParams


class LLMEngine(PrefillHandoff):
    def __init__(self, config: EngineArgs | None = None, executor: Executor | None = None, *, tokenizer=None,
                 draft_runner=None, runner=None, **options):
        """``config``: resolved `EngineArgs`; ``executor``: the `Executor` computing the steps (as
        `EngineArgs.create_engine` / `pyengine.llm.build_engine` build them). Keyword form: ``LLMEngine(model,
        max_model_len=.., ...)`` (any `EngineArgs` field), with ``runner=`` (a ModelRunner-like object: tests use
        fakes) or ``executor=`` (e.g. `parallel.launch.mpi_runner`'s) injected; ``tokenizer=``; ``draft_runner=``
        (S14's draft model)."""
        self.config, self.executor = config, executor = engine_config(config, executor, runner, options)
        config.check_runner(executor.runner)
        self.tokenizer = tokenizer if tokenizer is not None else executor.runner.tokenizer
        self.max_model_len, self.max_waiting = config.max_model_len, config.max_waiting
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size, config.enable_prefix_caching)
        self.scheduler = make_scheduler(config, self.block_manager)
        # S17 cross-step pipelining (parallel/mpi.py): the running sequences are dealt into M groups, one step
        # of each in flight at once (one group with speculative decoding: its drafts need the latest tokens)
        self.pipeline_groups = executor.pipeline_groups if config.speculative_config is None else 1
        self.scheduler.num_groups = self.pipeline_groups
        self.clock = time.perf_counter          # S11: step durations for the chunk budget (tests inject one)
        self.sampler, self.rng = Sampler(), np.random.default_rng(config.seed)
        self.eos_token_ids = stop_token_ids(self.tokenizer)
        self.vocab_size = int(self.tokenizer.vocab_size or self.runner.config.vocab_size)
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, config.max_model_len, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, config.max_model_len)
        self.spec = None if config.speculative_config is None else make_speculative_decoder(
            config.speculative_config, config.max_model_len, self.runner, draft_runner=draft_runner,
            max_num_seqs=config.max_num_seqs)
        self.drafts = DraftStep(self.spec)      # S14: propose, cut (S15), verify (engine/spec_step.py)
        self._reset_state()

    def _reset_state(self) -> None:
        """The bookkeeping of requests, sequences, steps in flight and counters, empty."""
        self.in_flight = InFlight()             # S17: steps launched, not finished (engine/flights.py)
        self.requests: dict[str, EngineRequest] = {}
        self._seq_owner: dict[int, EngineRequest] = {}
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
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if self.max_waiting is not None and self.num_waiting_requests() >= self.max_waiting:
            raise EngineOverloaded(f"waiting queue is full ({self.max_waiting} requests)")
        if params is None:
            params = SamplingParams()
        pooling, params = pooling_of(self, params)     # S19: an embedding request
        req, max_tokens = self.input_processor.make_request(
            request_id, prompt, params, priority, time.monotonic() if arrival_time is None else arrival_time,
            pooling, self.scheduler.check_fits)
        for i in range(params.n):
            seq = req.add_sequence(self._next_seq_id, max_tokens, self.block_manager.enable_prefix_caching,
                                   None if params.greedy else make_rng(params, self.rng, i))
            self._next_seq_id += 1
            self.output_processor.add_sequence(req, params, max_tokens)
            self._seq_owner[seq.seq_id] = req
        self.requests[request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free all its blocks; returns its final output (None if unknown)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        flying = self.in_flight.seq_ids()
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
        return bool(self.requests or self.in_flight)

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
    def step(self) -> list[RequestOutput]:
        if self.pipeline_groups > 1:
            return self._pipelined_step()
        t_step = self.clock()
        # S14's back-off prices a step by the process's CPU time: on a shared host its wall time also holds
        # other processes' load, which drifts more than the draft lengths' costs differ (docs/performance.md)
        t_start = time.process_time()
        if self.spec is not None:
            self.counters["spec_decode_num_grammar_cut_tokens"] += self.drafts.propose(self.scheduler.running,
                                                                                       self._seq_owner)
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
            flying = self.in_flight.groups()
            for g in range(self.pipeline_groups):
                flight = None if g in flying else self._schedule(g, self.clock(), time.process_time())
                if flight is not None:
                    if flight.batch.token_ids.size:
                        self.executor.launch(flight.batch)
                    self.in_flight.add(flight)
            if not self.in_flight.launched():
                if self.scheduler.has_unfinished():
                    raise RuntimeError("scheduler could not schedule any of the unfinished requests")
                return []
            flight = self.in_flight.oldest()
            logits = self.executor.finish() if flight.batch.token_ids.size else None
        except Exception:                  # e.g. a lost rank: no step is in flight any more
            self.in_flight.drop(self._free_aborted)
            raise
        return self._complete(flight, logits)

    def _schedule(self, group: int, t_step: float, t_start: float) -> Flight | None:
        """Plan ``group``'s next step (None if it has nothing to run) and build its batch."""
        sched = self.scheduler.schedule(group)
        if sched.is_empty:
            if self.pipeline_groups == 1 and self.scheduler.has_unfinished():
                # add_request's checks make this unreachable; fail loudly rather than spin forever
                raise RuntimeError("scheduler could not schedule any of the unfinished requests")
            return None
        note_scheduled(sched, self._seq_owner, self.counters, time.monotonic())
        # S14's back-off prices draft lengths by the times of steps that only decode (no prompt chunks)
        decode_only = all(n == 1 + len(s.spec_token_ids) for s, n in sched.scheduled) and not sched.preempted
        batch, sampled = build_batch(sched, lambda s: self._seq_owner[s.seq_id].score_only)
        extra = PromptPass.plan(sched.scheduled, lambda s: self._seq_owner[s.seq_id])   # S19: prompt rows
        if extra is not None:
            extra.ask(self.executor)      # S19 under S17: the rows travel with the step
        return Flight(group, sched, batch, sampled, decode_only, t_step, t_start, extra)

    def _free_aborted(self, sched: SchedulerOutput) -> list[Sequence]:
        """S17: free the blocks of the sequences of a step that were aborted while it was in flight."""
        gone = [s for s, _ in sched.scheduled if s.is_finished]
        for seq in gone:
            self.block_manager.free(seq)
        return gone

    def _complete(self, flight: Flight, logits) -> list[RequestOutput]:
        """A step's logits are back: advance its sequences, sample, check stops, make the outputs."""
        sched, sampled = flight.sched, flight.sampled
        if flight.extra is not None:          # S19: prompt logprobs and pooled states first (the runner's latest run)
            flight.extra.take(self.executor, self.vocab_size)
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
            self.drafts.done(sched.scheduled)
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
        graphs = self.runner.graphs
        return graphs.captures if graphs is not None else 0

    def _sample(self, sampled: list[Sequence], logits, deltas: dict) -> None:
        """Sample (engine/sampler_step.py), append each sequence's tokens, count its drafts' fate."""
        reqs = [self._seq_owner[s.seq_id] for s in sampled]
        results = sample_step(self.sampler, self.drafts, sampled, reqs, logits)
        now = time.monotonic()
        for seq, req, (toks, infos) in zip(sampled, reqs, results):
            for tok, info in zip(toks, infos):
                self._append_token(seq, req, tok, info, now, deltas)
                if seq.is_finished:
                    break
            if seq.spec_token_ids:
                self.scheduler.accept_drafts(seq, self.drafts.accepted(seq, req, len(toks) - 1))

    def _append_token(self, seq: Sequence, req: EngineRequest, tok: int, info, now: float, deltas: dict) -> None:
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

    # introspection (engine/introspect.py) ----------------------------------------------------------------
    def stats(self) -> dict:
        return engine_stats(self)

    def snapshot(self) -> dict:
        return engine_snapshot(self)
