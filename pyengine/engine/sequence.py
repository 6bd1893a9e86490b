"""S09: a `Sequence` is one stream of tokens the engine is generating (a request with n > 1 has n of them).

The scheduler only needs two numbers to plan a step for any sequence, prompt or decode alike
(the nano-vllm / vLLM-v1 view): ``num_tokens`` (prompt + generated) and ``num_computed_tokens``
(how many of them already have K/V in the paged cache). A step computes some of the rest.
"""
from __future__ import annotations

import enum
from typing import Any

from pyengine import tuning


class SequenceStatus(enum.Enum):
    WAITING = "waiting"        # never scheduled yet
    RUNNING = "running"        # owns blocks; scheduled every step until it finishes
    PREEMPTED = "preempted"    # blocks taken back; will recompute its tokens when re-admitted
    FINISHED = "finished"


class Sequence:
    """Token ids, KV bookkeeping and scheduling keys of one generated stream."""

    def __init__(self, seq_id: int, request_id: str, index: int, prompt_token_ids: list[int],
                 params: Any = None, priority: int = 0, arrival_step: int = 0,
                 max_tokens: int | None = None):
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.seq_id = seq_id                  # global arrival order: FCFS tie-breaker
        self.request_id = request_id
        self.index = index                    # position among the request's n completions
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self._token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority              # vLLM convention: lower value = served earlier
        self.arrival_step = arrival_step      # scheduler step at arrival: drives aging
        self.max_tokens = max_tokens
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0          # tokens whose K/V are in the cache
        self.num_cached_tokens = 0            # of those, how many came from the prefix cache at admission
        self.block_table: list[int] = []      # block ids covering positions [0, num_computed + scheduled)
        self.block_hashes: list[bytes] = []   # chained hashes of this sequence's full blocks (see block_manager)
        self.num_registered_blocks = 0        # leading full blocks already offered to the prefix cache
        self.skip_prefix_cache = False        # S19: prompt logprobs / pooling need every prompt row computed
        self.wait_for: "Sequence | None" = None  # n > 1: siblings wait for the first one's prompt to be cached
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.num_preemptions = 0
        self.group = 0                        # S17 cross-step pipelining: the group of sequences it runs in
        # S14 speculative decoding (see engine/spec_decode.py): this step's drafts, the distributions they were
        # drawn from (None: certain guesses), the running acceptance estimate and an unverified guess
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs = None
        self.spec_alpha = tuning.ALPHA_PRIOR
        self.spec_shadow: tuple[int, list[int]] | None = None
        self.spec_probe_gap = tuning.PROBE_GAP       # back-off of an expensive proposer: steps to the next probe
        self.spec_probe_at: int | None = None
        self.spec_grammar = None              # S15: the grammar matcher of a constrained sequence (for drafters)

    # token views ---------------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        return self._token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        """True while more than one token lacks K/V (prompt, a chunk of it, or recompute after preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))
        self._token_ids.append(int(token_id))

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}#{self.index}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={self.block_table})")
