"""S09: a request as the engine holds it — its sequences (n > 1: several), their sampler state, stop checkers,
logprobs and grammar matchers, and its metrics (engine/llm_engine.py; engine/output_processor.py fills it)."""
from __future__ import annotations

from pyengine.engine.outputs import RequestMetrics
from pyengine.engine.sequence import Sequence


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (``max_waiting``); the HTTP server answers 429."""


class EngineRequest:
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

    def add_sequence(self, seq_id: int, max_tokens: int, prefix_caching: bool, rng) -> Sequence:
        """The request's next sequence (``rng``: its sampler's generator, None when greedy). With prefix caching the
        later ones wait for the first (its prompt's blocks then cached); S19: a first one whose prompt rows are
        wanted (prompt logprobs, pooling) computes its whole prompt."""
        i = len(self.seqs)
        seq = Sequence(seq_id, self.request_id, i, self.prompt_token_ids, self.params, self.priority,
                       max_tokens=max_tokens)
        if i > 0 and prefix_caching:
            seq.wait_for = self.seqs[0]
        seq.skip_prefix_cache = i == 0 and (self.prompt_state is not None or self.pool is not None)
        self.seqs.append(seq)
        self.rngs.append(rng)
        return seq

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def note_scheduled(sched, owner: dict, counters: dict, now: float) -> None:
    """A step was scheduled: its requests are admitted, their first-scheduled time and cached tokens, the
    preemptions, and the engine's step and prompt-token ``counters`` (``owner``: seq_id -> its request)."""
    counters["steps"] += 1
    for seq, n in sched.scheduled:
        req = owner[seq.seq_id]
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = now
            req.metrics.num_cached_tokens = seq.num_cached_tokens
            counters["prompt_tokens"] += seq.num_prompt_tokens
        req.admitted = True
        # prompt tokens actually run through the model (cache hits excluded, recomputes included)
        counters["computed_prompt_tokens"] += max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))
    for seq in sched.preempted:
        owner[seq.seq_id].metrics.num_preemptions += 1
