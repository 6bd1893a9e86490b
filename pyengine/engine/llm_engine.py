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

from pyengine.engine.block_manager import BlockManager
from pyengine.engine.chunk_budget import ChunkBudget, check_target_itl_ms
from pyengine.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, snapshot_metrics
from pyengine.engine.scheduler import Scheduler, SchedulerOutput
from pyengine.engine.sequence import Sequence, SequenceStatus
from pyengine.engine.spec_decode import spec_stats


def check_prompt(ids: list[int], params, vocab_size: int, max_model_len: int) -> int:
    """ValueError if the prompt's ids or the params cannot run on this model; else the request's max_tokens."""
    if not ids:
        raise ValueError("prompt is empty (no tokens)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is out of range for vocab size {vocab_size}")
    params.validate_for_vocab(vocab_size)
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - len(ids)
    if max_tokens <= 0:
        raise ValueError(f"prompt ({len(ids)} tokens) leaves no room in max_model_len ({max_model_len})")
    return max_tokens


def stop_token_ids(tok) -> set[int]:
    """The ids that end a sequence: the tokenizer's stop tokens, else its EOS."""
    ids = getattr(tok, "stop_token_ids", None)
    if ids is None:
        ids = [tok.eos_token_id] if getattr(tok, "eos_token_id", None) is not None else []
    return {int(t) for t in ids}


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
        self.metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids))
        self.admitted = False

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class _Flight:
    """One scheduled step, from its scheduling until its logits are back (S17: several may be in flight)."""

    def __init__(self, group, sched, batch, sampled, decode_only, t_step, t_start):
        self.group, self.sched, self.batch, self.sampled = group, sched, batch, sampled
        self.decode_only, self.t_step, self.t_start = decode_only, t_step, t_start


class LLMEngine:
    def __init__(self, model=None, max_model_len: int = 2048, block_size: int = 16, num_blocks: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, max_waiting: int | None = None, *,
                 runner=None, tokenizer=None, seed: int | None = None, watermark: float = 0.03,
                 aging_steps: int = 64, tensor_parallel_size: int = 1, speculative_config=None,
                 draft_runner=None, weights_mode: str = "resident", kv_cache_dtype: str = "auto",
                 pipeline_parallel_size: int = 1, target_itl_ms: float | None = None,
                 enforce_eager: bool = False):
        """``runner``/``tokenizer`` (keyword-only extension): inject any object with the ModelRunner contract
        (tests use a fake one); by default a `ModelRunner` is built for ``model`` (path, bytes, GGUFFile or
        None for the default model), its weights in ``weights_mode`` ("resident" or "lean"), its KV cache in
        ``kv_cache_dtype``; ``enforce_eager`` (vLLM's name) runs every step plain instead of replaying
        captured steps (S13; also set on an injected runner that has the switch).
        ``speculative_config`` (S14, vLLM's dict): ``{"method": "ngram" | "draft_model",
        "num_speculative_tokens": k, "prompt_lookup_min", "prompt_lookup_max", "model"}``; ``draft_runner``
        (extension) injects the draft model's runner.
        S17: inside an MPI job (``mpiexec -n N*M python script.py``), ``tensor_parallel_size`` N and
        ``pipeline_parallel_size`` M run over MPI: rank 0 gets the engine, the other ranks compute in here until
        rank 0 is done, then exit (``pyengine serve`` starts its ranks itself).
        S11: with chunked prefill, ``target_itl_ms`` sizes each step's prompt chunks so that a step with decodes
        is predicted to last at most that long (engine/chunk_budget.py); None derives the target from the
        decodes' own measured cost, 0 turns it off (chunks fill ``max_num_batched_tokens``)."""
        if runner is None and tensor_parallel_size * pipeline_parallel_size > 1:
            from pyengine.parallel.mpi import launched_under_mpi    # lazy: mpi4py only when asked for
            if launched_under_mpi():
                from pyengine.model_files import resolve_model
                from pyengine.parallel.launch import mpi_runner
                runner = mpi_runner(resolve_model(model) if model is None or isinstance(model, str) else model,
                                    tensor_parallel_size, pipeline_parallel_size, max_model_len=max_model_len,
                                    num_blocks=num_blocks, block_size=block_size,
                                    max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                    kv_cache_dtype=kv_cache_dtype)
                tensor_parallel_size, pipeline_parallel_size, kv_cache_dtype = 1, 1, "auto"   # the runner has them
            else:
                raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = "
                                 f"{tensor_parallel_size * pipeline_parallel_size} ranks run over MPI: start this "
                                 f"program with mpiexec -n {tensor_parallel_size * pipeline_parallel_size} (pip "
                                 f"install 'pyengine[parallel]'), or use pyengine serve, which starts its ranks")
        if runner is None:
            from pyengine.engine.model_runner import ModelRunner
            if model is None or isinstance(model, str):
                from pyengine.model_files import resolve_model
                model = resolve_model(model)
            runner = ModelRunner(model, max_model_len=max_model_len, num_blocks=num_blocks, block_size=block_size,
                                 max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                 weights_mode=weights_mode, kv_cache_dtype=kv_cache_dtype,
                                 enforce_eager=enforce_eager)
        elif tensor_parallel_size * pipeline_parallel_size != 1 or kv_cache_dtype != "auto":
            raise ValueError("tensor_parallel_size, pipeline_parallel_size and kv_cache_dtype build the runner: "
                             "pass them to the runner you inject")
        if enforce_eager and hasattr(runner, "enforce_eager"):
            runner.enforce_eager = True
        for name, want in (("max_model_len", max_model_len), ("max_num_batched_tokens", max_num_batched_tokens),
                           ("max_num_seqs", max_num_seqs)):
            have = getattr(runner, name, None)
            if isinstance(have, int) and want > have:
                raise ValueError(f"{name}={want} exceeds the model runner's {name}={have}")
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {max_waiting}")
        self.runner = runner
        self.tokenizer = tokenizer if tokenizer is not None else runner.tokenizer
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching)
        chunk_budget = None
        if target_itl_ms is None or check_target_itl_ms(target_itl_ms) > 0:
            chunk_budget = ChunkBudget(target_itl_ms)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                   enable_chunked_prefill=enable_chunked_prefill, watermark=watermark,
                                   aging_steps=aging_steps, chunk_budget=chunk_budget)
        # S17 cross-step pipelining (parallel/mpi.py): the running sequences are dealt into M groups, one step
        # of each in flight at once (one group with speculative decoding: its drafts need the latest tokens)
        self.pipeline_groups = getattr(runner, "pipeline_groups", 1) if speculative_config is None else 1
        self.scheduler.num_groups = self.pipeline_groups
        self._in_flight: list[_Flight] = []
        self.max_groups_in_flight = 0
        self.clock = time.perf_counter          # S11: step durations for the chunk budget (tests inject one)
        from pyengine.layers.sampler import Sampler
        self.sampler = Sampler()
        self.rng = np.random.default_rng(seed)
        tok = self.tokenizer
        self.eos_token_ids = stop_token_ids(tok)
        self.vocab_size = int(getattr(tok, "vocab_size", 0) or runner.config.vocab_size)
        self.spec = None
        if speculative_config is not None:
            from pyengine.engine.spec_decode import make_speculative_decoder
            self.spec = make_speculative_decoder(speculative_config, max_model_len, runner,
                                                 draft_runner=draft_runner, max_num_seqs=max_num_seqs)
        self._structured = None                 # S15: built on the first constrained request
        self._draft_masks: dict[int, list] = {}  # S15 x S14: seq_id -> grammar masks of its verification rows
        self.requests: dict[str, _Request] = {}
        self._seq_owner: dict[int, _Request] = {}
        self._next_seq_id = 0
        # S18 (pyengine/disagg/): a prefill instance's engine stops each sequence after its first token and
        # parks it in ``prefilled`` with its blocks, until its KV cache is shipped (``release_prefilled``)
        self.prefill_only = False
        self.prefilled: list[Sequence] = []
        self.counters = {"prompt_tokens": 0, "computed_prompt_tokens": 0, "generation_tokens": 0,
                         "finished_requests": 0, "aborted_requests": 0, "steps": 0,
                         "spec_decode_num_grammar_cut_tokens": 0}     # S15: draft tokens the grammar forbade

    # requests ------------------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            bos = getattr(self.tokenizer, "bos_token_id", None)
            # SmolLM2/HF adds no BOS; Gemma does: follow the GGUF's tokenizer.ggml.add_bos_token flag.
            if getattr(self.tokenizer, "add_bos_token", False) and bos is not None and ids[:1] != [bos]:
                ids = [bos] + ids
            return prompt, list(ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError("prompt must be a str, a list of token ids or {'prompt_token_ids': [...]}, "
                         f"got {type(prompt).__name__}")

    def num_waiting_requests(self) -> int:
        return sum(1 for r in self.requests.values() if not r.admitted)

    def add_request(self, request_id: str, prompt, params=None, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        """Queue a request. ValueError if it is malformed or can never fit; EngineOverloaded if the
        waiting queue is full. ``arrival_time`` (extension) defaults to ``time.monotonic()``."""
        from pyengine.engine.stop_checker import StopChecker
        from pyengine.layers.sampler import make_rng
        from pyengine.sampling_params import SamplingParams

        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if self.max_waiting is not None and self.num_waiting_requests() >= self.max_waiting:
            raise EngineOverloaded(f"waiting queue is full ({self.max_waiting} requests)")
        if params is None:
            params = SamplingParams()
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        text, ids = self._encode(prompt)
        max_tokens = check_prompt(ids, params, self.vocab_size, self.max_model_len)
        self.scheduler.check_fits(len(ids), max_tokens)

        req = _Request(request_id, text, ids, params, priority,
                       time.monotonic() if arrival_time is None else arrival_time)
        if params.structured_outputs is not None:
            req.matchers = self._structured_outputs().matchers(params, params.n)
        for i in range(params.n):
            seq = Sequence(self._next_seq_id, request_id, i, ids, params, priority, max_tokens=max_tokens)
            self._next_seq_id += 1
            if i > 0 and self.block_manager.enable_prefix_caching:
                seq.wait_for = req.seqs[0]
            req.seqs.append(seq)
            req.checkers.append(StopChecker(self.tokenizer, params, self.eos_token_ids, max_tokens=max_tokens))
            req.rngs.append(None if params.greedy else make_rng(params, self.rng, i))
            req.logprobs.append([] if params.logprobs is not None else None)
            req.cumulative_logprob.append(0.0 if params.logprobs is not None else None)
            self._seq_owner[seq.seq_id] = req
        self.requests[request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)

    def _structured_outputs(self):
        if self._structured is None:
            from pyengine.structured.processor import StructuredOutputs
            self._structured = StructuredOutputs(self.tokenizer, self.eos_token_ids, self.vocab_size)
        return self._structured

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free all its blocks; returns its final output (None if unknown)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        flying = {s.seq_id for f in self._in_flight for s, _ in f.sched.scheduled}
        for seq, checker in zip(req.seqs, req.checkers):
            if not seq.is_finished:        # S17: blocks of a sequence in flight are freed when its step is back
                self._finish(seq, free_blocks=seq.seq_id not in flying)
                checker.finish("abort")
                seq.finish_reason = "abort"
        for seq in req.seqs:
            self._seq_owner.pop(seq.seq_id, None)
        req.metrics.finished_time = time.monotonic()
        self.counters["aborted_requests"] += 1
        return self._make_output(req, {})

    def has_unfinished_requests(self) -> bool:
        """Also True while a step is in flight (S17: of aborted sequences, whose blocks it frees when back)."""
        return bool(self.requests or self._in_flight)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

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
            if start + n - k == seq.num_tokens:  # the prompt (or recompute) is complete: sample the next token
                logits_indices.extend(range(len(token_ids) - k - 1, len(token_ids)))   # k + 1 rows to verify
                sampled.append(seq)
        batch = ForwardBatch(token_ids=np.asarray(token_ids, dtype=np.int64),
                             positions=np.asarray(positions, dtype=np.int64),
                             query_lens=query_lens, context_lens=context_lens, block_tables=block_tables,
                             logits_indices=np.asarray(logits_indices, dtype=np.int64))
        return batch, sampled

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
        logits = self.runner.run(flight.batch) if flight.batch.token_ids.size else None
        # S13: a step captured now costs more than its replays will; it would price its draft length too high
        flight.decode_only = flight.decode_only and self._captures() == captures
        return self._complete(flight, logits)

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
                        self.runner.launch(flight.batch)
                    self._in_flight.append(flight)
            self.max_groups_in_flight = max(self.max_groups_in_flight, len(self._in_flight))
            if not self._in_flight:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("scheduler could not schedule any of the unfinished requests")
                return []
            flight = self._in_flight.pop(0)
            logits = self.runner.finish() if flight.batch.token_ids.size else None
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
        batch, sampled = self._build_batch(sched)
        return _Flight(group, sched, batch, sampled, decode_only, t_step, t_start)

    def _free_aborted(self, sched: SchedulerOutput) -> list[Sequence]:
        """S17: free the blocks of the sequences of a step that were aborted while it was in flight."""
        gone = [s for s, _ in sched.scheduled if s.is_finished]
        for seq in gone:
            self.block_manager.free(seq)
        return gone

    def _complete(self, flight: _Flight, logits) -> list[RequestOutput]:
        """A step's logits are back: advance its sequences, sample, check stops, make the outputs."""
        sched, sampled = flight.sched, flight.sampled
        if self._free_aborted(sched):      # S17 (one row per sequence: no drafts with pipelining)
            keep = [i for i, s in enumerate(sampled) if not s.is_finished]
            logits, sampled = (logits[keep] if keep else None), [sampled[i] for i in keep]
            sched.scheduled = [(s, n) for s, n in sched.scheduled if not s.is_finished]
        self.scheduler.on_step_done(sched)

        deltas: dict[str, dict[int, list]] = {}
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
            outputs.append(self._make_output(req, d))
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
            tokens, infos = self.sampler.sample(
                sel, [reqs[i].params for i in plain], [sampled[i].prompt_token_ids for i in plain],
                [sampled[i].output_token_ids for i in plain], [reqs[i].rngs[sampled[i].index] for i in plain],
                allowed=allowed)
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
        toks = verify(rows, seq.spec_token_ids, seq.spec_draft_probs, p, req.rngs[seq.index],
                      seq.prompt_token_ids, seq.output_token_ids)
        infos = [token_logprobs(raw[j], t, p.logprobs) if p.logprobs is not None else None
                 for j, t in enumerate(toks)]
        return toks, infos

    def _append_token(self, seq: Sequence, req: _Request, tok: int, info, now: float, deltas: dict) -> None:
        if req.matchers is not None and not req.matchers[seq.index].advance(tok):
            raise RuntimeError(f"sampled token {tok} is outside the grammar of request {req.request_id!r}")
        seq.append_token(tok)
        self.counters["generation_tokens"] += 1
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        if not m.token_times or m.token_times[-1] != now:
            m.token_times.append(now)
        if info is not None:
            req.logprobs[seq.index].append(info.as_dict())
            req.cumulative_logprob[seq.index] += info.logprob
        checker = req.checkers[seq.index]
        res = checker.append(tok)
        if req.matchers is not None:            # S15: a failed grammar finishes its sequence ("error")
            from pyengine.structured.processor import grammar_outcome
            res = grammar_outcome(req.matchers[seq.index], checker, res)
        delta = res.delta_text
        if not res.finished and seq.num_tokens >= self.max_model_len:
            res = checker.finish("length")
            delta += res.delta_text
        if res.finished:
            seq.finish_reason, seq.stop_reason = res.finish_reason, res.stop_reason
            self._finish(seq)
            if req.finished:
                m.finished_time = now
        entry = deltas.setdefault(req.request_id, {}).setdefault(seq.index, [[], ""])
        entry[0].append(tok)      # a verification may emit several tokens in one step
        entry[1] += delta
        if self.prefill_only and not seq.is_finished:      # S18: the decode instance takes it from here
            self.scheduler.running.remove(seq)
            self.prefilled.append(seq)

    def _finish(self, seq: Sequence, free_blocks: bool = True) -> None:
        self.scheduler.finish(seq, free_blocks)
        if self.spec is not None:
            self.spec.release(seq)

    def _make_output(self, req: _Request, deltas: dict[int, list]) -> RequestOutput:
        outs = []
        for seq, checker in zip(req.seqs, req.checkers):
            toks, delta = deltas.get(seq.index, ([], ""))
            lps = req.logprobs[seq.index]
            outs.append(CompletionOutput(
                index=seq.index, text=checker.text, token_ids=list(seq.output_token_ids),
                logprobs=list(lps) if lps is not None else None, finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, delta_text=delta, delta_token_ids=list(toks),
                cumulative_logprob=req.cumulative_logprob[seq.index]))
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), outs, req.finished,
                             snapshot_metrics(req.metrics))

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
            return self._make_output(req, {})
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
