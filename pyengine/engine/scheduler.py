"""S10/S11: the scheduler decides, every step, which sequences compute how many tokens.

One rule covers prompts, chunks, decodes and recomputation (the vLLM-v1 / nano-vllm view): a scheduled
sequence computes ``num_new`` of its ``num_tokens - num_computed_tokens`` missing tokens. A step is planned as

1. running sequences first, decodes before prefill chunks, best key first; each grows its block table by
   the slots it needs. If the pool is empty, the *worst* running sequence (lowest priority, latest arrival)
   is preempted by recompute: its blocks are freed and it goes back to the preempted queue with its tokens.
2. then (only in a step without preemption) preempted and waiting sequences are admitted, best key first,
   while there is token budget, a free sequence slot and KV room beyond the watermark. A prefix-cache hit
   counts as already computed. A prompt longer than the remaining budget is split into chunks (S11).
   With a `ChunkBudget` (engine/chunk_budget.py) a chunk is also cut to what the step's target inter-token
   latency leaves once the decodes are planned, from a cost model fitted to measured step times.

S17 cross-step pipelining (parallel/mpi.py): with ``num_groups`` M > 1 the running sequences are dealt into M
groups (each sequence joins the group that admits it, at most ceil(max_num_seqs / M) per group) and
``schedule(g)`` plans group g's step alone: the other groups' sequences may be in flight, so it never grows,
preempts or admits into them.

Keys: ``(priority - age // aging_steps, arrival order)`` with the vLLM convention that a lower priority value
is served first; age is counted in scheduler steps, so a long-waiting request eventually outranks any new
arrival (no starvation) and the order is deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pyengine.engine.block_manager import BlockManager
from pyengine.engine.chunk_budget import ChunkBudget, StepShape, check_target_itl_ms
from pyengine.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)   # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    shape: StepShape | None = None       # S11: the step's cost features, with a ChunkBudget

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 2048, enable_chunked_prefill: bool = True, watermark: float = 0.03,
                 aging_steps: int = 64, chunk_budget: ChunkBudget | None = None):
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            # every running sequence must be able to decode in one step, or decodes could starve
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({max_num_seqs})")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if aging_steps <= 0:
            raise ValueError(f"aging_steps must be positive, got {aging_steps}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.aging_steps = aging_steps
        # S11: prompt chunks sized from a target ITL (only matters with chunked prefill)
        self.chunk_budget = chunk_budget if enable_chunked_prefill else None
        self.waiting: list[Sequence] = []
        self.preempted: list[Sequence] = []
        self.running: list[Sequence] = []
        self.step_count = 0
        self.num_preemptions = 0
        self.num_groups = 1                  # S17: groups of sequences in flight at once (set by the engine)

    # queue management ----------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """ValueError if a request could never run: too long for the model or for the whole KV pool."""
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                             f"exceeds max_model_len ({self.max_model_len})")
        if self.bm.blocks_for(total) > self.bm.num_blocks:
            raise ValueError(f"prompt + max_tokens = {total} tokens needs {self.bm.blocks_for(total)} KV blocks; "
                             f"the pool has only {self.bm.num_blocks}")
        if not self.enable_chunked_prefill and num_prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) exceeds max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) and chunked prefill is disabled")

    def add(self, seq: Sequence) -> None:
        seq.arrival_step = self.step_count
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, free_blocks: bool = True) -> None:
        """Take ``seq`` out of whatever queue holds it and free all its blocks (finish or abort); S17: a
        sequence aborted while its step is in flight keeps them until the step is back (``free_blocks``)."""
        for queue in (self.running, self.waiting, self.preempted):
            if seq in queue:
                queue.remove(seq)
                break
        if free_blocks:
            self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.preempted)

    def key(self, seq: Sequence) -> tuple[int, int]:
        age = self.step_count - seq.arrival_step
        return (seq.priority - age // self.aging_steps, seq.seq_id)

    @staticmethod
    def _drop_drafts(seq: Sequence, keep: int = 0) -> None:
        del seq.spec_token_ids[max(keep, 0):]
        if seq.spec_draft_probs is not None:
            seq.spec_draft_probs = seq.spec_draft_probs[:len(seq.spec_token_ids)] if seq.spec_token_ids else None

    def _preempt(self, seq: Sequence) -> None:
        self._drop_drafts(seq)
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted.append(seq)

    def _num_new_tokens(self, remaining: int, budget: int, shape: StepShape | None = None, start: int = 0) -> int:
        """Tokens a prefill may compute this step (0 = not this step); with a chunk budget, also within the
        step's target ITL given ``shape`` (what is planned so far), for a chunk from position ``start``."""
        if shape is not None:
            return self.chunk_budget.max_chunk(shape, start, min(remaining, budget))
        if self.enable_chunked_prefill or remaining > self.max_num_batched_tokens:
            # (without chunking, only a recompute longer than any step is split; prompts are checked at add)
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    # planning ------------------------------------------------------------------------------------
    def schedule(self, group: int = 0) -> SchedulerOutput:
        """The next step of ``group`` (S17: one of ``num_groups``; the only one without pipelining)."""
        self.step_count += 1
        out = SchedulerOutput()
        planned: dict[int, tuple[Sequence, int]] = {}
        budget = self.max_num_batched_tokens
        shape = out.shape = StepShape() if self.chunk_budget is not None else None
        mine = [s for s in self.running if s.group == group]
        group_cap = -(-self.max_num_seqs // self.num_groups)

        # 1. running sequences: decodes first, then chunks of prompts already under way
        order = sorted(mine, key=self.key)
        order = [s for s in order if not s.is_prefill] + [s for s in order if s.is_prefill]
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING:
                continue                                   # preempted earlier in this loop
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining == 1 and seq.spec_token_ids:
                # S14: a decode with drafts scores 1 + k tokens; drafts give way to budget and memory
                # (never a reason to preempt anyone)
                k = min(len(seq.spec_token_ids), budget - 1)
                while k > 0 and not self.bm.can_append(seq, 1 + k):
                    k -= 1
                self._drop_drafts(seq, k)
            decode = remaining == 1
            start = seq.num_computed_tokens
            n = 1 + len(seq.spec_token_ids) if decode else self._num_new_tokens(remaining, budget, shape, start)
            if n <= 0 or n > budget:
                continue
            while not self.bm.can_append(seq, n):
                victim = max(mine, key=self.key)
                self._preempt(victim)
                mine.remove(victim)
                out.preempted.append(victim)
                if victim.seq_id in planned:               # give back what it had been promised
                    budget += planned.pop(victim.seq_id)[1]
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.bm.append_slots(seq, n)
            planned[seq.seq_id] = (seq, n)
            budget -= n
            if shape is not None and decode:
                shape.add_decode(start + n, n)
            elif shape is not None:
                shape.add_chunk(start, n)

        # 2. admissions: preempted (recompute) and waiting sequences compete on the same key
        if not out.preempted:
            candidates = sorted(self.preempted + self.waiting, key=self.key)
            for seq in candidates:
                if len(self.running) >= self.max_num_seqs or len(mine) >= group_cap or budget <= 0:
                    break
                if seq.wait_for is not None:
                    lead = seq.wait_for
                    if not (lead.is_finished or lead.num_output_tokens > 0):
                        continue                           # n > 1 sibling: wait until the prompt is cached
                    seq.wait_for = None
                cached = self.bm.get_computed_blocks(seq)
                remaining = seq.num_tokens - len(cached) * self.bm.block_size
                n = self._num_new_tokens(remaining, budget, shape, len(cached) * self.bm.block_size)
                if n <= 0:
                    break
                # Room for the whole rest of the prompt (not just this chunk), so an admitted prefill does
                # not stall half-way; the watermark keeps room for running decodes unless nothing runs.
                reserve = self.watermark_blocks if self.running else 0
                if not self.bm.can_allocate(seq, cached, remaining, reserve):
                    break                                  # strict order: nothing jumps ahead of it
                self.bm.allocate(seq, cached, n)
                (self.preempted if seq.status is SequenceStatus.PREEMPTED else self.waiting).remove(seq)
                seq.status = SequenceStatus.RUNNING
                seq.group = group
                self.running.append(seq)
                mine.append(seq)
                planned[seq.seq_id] = (seq, n)
                budget -= n
                if shape is not None:
                    shape.add_chunk(len(cached) * self.bm.block_size, n)

        out.scheduled = list(planned.values())
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """S11: the measured duration of a step this scheduler planned (fits the chunk budget's cost model)."""
        if self.chunk_budget is not None and out.shape is not None:
            self.chunk_budget.observe(out.shape, seconds)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """The runner has written K/V for the scheduled tokens: advance and publish full blocks. A decode's
        drafts are not tokens of the sequence yet: the engine accounts for the accepted ones after verifying."""
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n - len(seq.spec_token_ids)
            self.bm.cache_computed_blocks(seq)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After verification: the first ``num_accepted`` drafts (now appended to the sequence) have valid
        K/V; the slots of the rejected ones are rolled back (blocks holding only those are freed)."""
        seq.spec_token_ids, seq.spec_draft_probs = [], None
        if seq.is_finished:
            return
        seq.num_computed_tokens += num_accepted
        self.bm.trim(seq, seq.num_computed_tokens)
        self.bm.cache_computed_blocks(seq)


def make_scheduler(config, block_manager: BlockManager) -> Scheduler:
    """The scheduler of ``config``'s limits (a resolved `EngineArgs`); S11: a chunk budget unless chunking by a
    target ITL is off."""
    target = config.target_itl_ms
    budget = ChunkBudget(target) if target is None or check_target_itl_ms(target) > 0 else None
    return Scheduler(block_manager, max_num_seqs=config.max_num_seqs,
                     max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
                     enable_chunked_prefill=config.enable_chunked_prefill, watermark=config.watermark,
                     aging_steps=config.aging_steps, chunk_budget=budget)
