"""S19: embeddings — a request whose output is the model's pooled final hidden state, not tokens (vLLM's pooling).

A pooling request is a prefill-only request of the same engine: its prompt runs through the same ragged batches
as every other request (chunked prefill included), and when its last chunk is done the engine ends it with
finish_reason "length" and `RequestOutput.pooled` set. Its state comes from the runner's final residual stream of
that step (`HiddenStateRunner.hidden_states`: the final RMSNorm applied, the input of the LM head), pooled per
request:

    "last"  the last prompt token's state (a causal model's only state that has seen the whole prompt)
    "mean"  the mean over every prompt token's state (summed chunk by chunk, in float64)

then L2-normalized unless ``normalize=False``. This is a decoder language model's pooled state, not a trained
embedding model: it ranks near-duplicates and topic overlap, it is not tuned for retrieval.

The prefix cache is bypassed for such a request (a cached block has K/V but no hidden states); its blocks are still
offered to the cache for later requests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

POOLING_TYPES = ("last", "mean")


@runtime_checkable
class HiddenStateRunner(Protocol):
    """A runner that can hand back, for rows of its latest run's tokens, the final (normed) hidden states and the
    LM head's logits (in bounded slices: engine/prompt_logprobs.py)."""

    def hidden_states(self, rows: np.ndarray) -> np.ndarray: ...

    def prompt_logits(self, rows: np.ndarray, max_rows: int): ...


@dataclass
class PoolingParams:
    """How a pooling request is pooled (vLLM's name): ``pooling`` "last" or "mean"; ``normalize`` (L2, default
    True); ``dimensions``: None, or the model's hidden size (no truncation: the model was not trained for it)."""
    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, (int, np.integer))):
            raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}")

    def check(self, hidden_size: int) -> None:
        """ValueError when ``dimensions`` is not the model's ``hidden_size``."""
        if self.dimensions is not None and int(self.dimensions) != hidden_size:
            raise ValueError(f"dimensions={self.dimensions} is not supported: this model's embeddings have "
                             f"{hidden_size} dimensions (it was not trained to be truncated)")


class PoolState:
    """One request's pooled state while its prompt runs: positions covered so far and their float64 sum (mean)
    or the last position's state."""

    def __init__(self, params: PoolingParams, num_prompt_tokens: int):
        self.params, self.num_prompt_tokens = params, num_prompt_tokens
        self.covered = 0                  # prompt positions pooled so far (a recompute does not add them twice)
        self.total: np.ndarray | None = None
        self.last: np.ndarray | None = None

    def positions(self, start: int, n: int) -> range:
        """The positions of a chunk [start, start + n) whose states this request still needs."""
        lo = max(start, self.covered)
        if self.params.pooling == "last":
            lo = max(lo, self.num_prompt_tokens - 1)
        return range(lo, min(start + n, self.num_prompt_tokens))

    def add(self, positions: range, states: np.ndarray) -> None:
        if not len(positions):
            return
        if self.params.pooling == "mean":
            s = states.astype(np.float64).sum(axis=0)
            self.total = s if self.total is None else self.total + s
        else:
            self.last = states[-1].astype(np.float64)
        self.covered = positions.stop

    def result(self) -> np.ndarray:
        """The pooled (and, by default, L2-normalized) float32 vector."""
        v = self.total / self.num_prompt_tokens if self.params.pooling == "mean" else self.last
        if self.params.normalize:
            norm = float(np.linalg.norm(v))
            v = v / norm if norm > 0 else v
        return v.astype(np.float32)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's shape): ``outputs.embedding`` is a list of floats."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def from_request_output(cls, out) -> "EmbeddingRequestOutput":
        if out.pooled is None:
            raise ValueError(f"request {out.request_id!r} has no pooled state (it was not a pooling request)")
        return cls(out.request_id, list(out.prompt_token_ids), EmbeddingOutput([float(x) for x in out.pooled]))
