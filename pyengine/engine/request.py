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

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
