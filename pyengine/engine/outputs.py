"""S01: what the engine hands back after each step (vLLM's shapes, plus streaming deltas and timings).

Every `RequestOutput` is a snapshot: lists are copies, so a consumer may keep it while the engine runs on.
Times come from ``time.monotonic()`` (the engine's clock; only differences are meaningful).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int                              # which of the request's n completions
    text: str                               # cumulative released text
    token_ids: list[int]                    # cumulative generated ids
    logprobs: list[dict[int, float]] | None = None   # per generated token {id: logprob} (sampled + top-n)
    finish_reason: str | None = None        # None | "stop" | "length" | "abort"
    stop_reason: str | int | None = None    # the stop string or stop token id that ended it
    delta_text: str = ""                    # text released by this step
    delta_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)   # one entry per step that produced tokens
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0              # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    # S14 speculative decoding (vLLM's names): verifications with drafts, drafted and accepted tokens
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification (accepted drafts + the model's own); 0 without drafts."""
        from pyengine.engine.spec_decode import mean_acceptance_length
        return mean_acceptance_length(self.num_drafts, self.num_accepted_tokens)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # S19: vLLM's prompt_logprobs (entry 0 None, then {id: Logprob} per prompt token; engine/prompt_logprobs.py)
    prompt_logprobs: list | None = None
    pooled: object = None                   # S19: a pooling request's vector (float32 ndarray, engine/pooling.py)

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens if self.metrics else 0


def snapshot_metrics(m: RequestMetrics) -> RequestMetrics:
    return RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time, list(m.token_times),
                          m.finished_time, m.num_prompt_tokens, m.num_cached_tokens, m.num_preemptions,
                          m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens)

