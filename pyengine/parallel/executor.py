"""S17: `MPIExecutor`, the executor (engine/executor.py's protocol) of an MPI job's ranks.

Rank 0 holds the engine and this executor; every rank (rank 0 too) holds a `ModelRunner` of its part of the model
(its stage's layers, its heads and FFN columns, its KV heads), built with the rank's `MPIGroup` as its ``shard``.
The executor drives the runners: a step's plan goes to every rank (``MPIGroup.send_step``), each runs its part
(`MPIGroup.step`, through the runner's `RankRunner` surface: engine/executor.py), rank 0 gets the logits. The runners
never call back: they only plan, run layers and the head of their part. Calls run engine -> executor -> group ->
runner -> model -> layers (the layers talk to the other ranks through the group, their communicator).
"""
from __future__ import annotations

import numpy as np

from pyengine.engine.executor import RankRunner
from pyengine.engine.forward_batch import ForwardBatch


class MPIExecutor:
    """Rank 0's driver of an MPI group's runners (``runner``: rank 0's own part, a `RankRunner`; ``group``: the
    `MPIGroup`)."""

    def __init__(self, runner: RankRunner, group):
        self.runner, self.group = runner, group
        self._asked = None                # S19: the prompt rows of the next step run or launched
        group.held = runner.held        # what rank 0 holds (weights, KV cache), in the group's stats

    @property
    def pipeline_groups(self) -> int:
        """S17: steps of different sequences the engine may keep in flight: the stages with cross-step pipelining."""
        return self.group.groups

    @property
    def failure(self) -> str | None:
        """Why the group cannot run steps any more (a rank stopped answering), or None."""
        return self.group.failure

    def run(self, batch: ForwardBatch) -> np.ndarray:
        """(len(logits_indices), V) float32 logits of one step that every rank runs its part of."""
        self.runner.check(batch)
        rows, self._asked = self._asked, None
        self.group.send_step(batch, rows)
        return self.group.step(self.runner, batch, rows)

    def launch(self, batch: ForwardBatch) -> None:
        """S17 cross-step pipelining: start a step and return at once (stage 0 has run its layers)."""
        self.runner.check(batch)
        rows, self._asked = self._asked, None
        self.group.launch(self.runner, batch, rows)

    def finish(self) -> np.ndarray:
        """S17: the logits of the oldest launched step (as ``run`` returns them)."""
        return self.group.finish(self.runner)

    def ask_rows(self, rows) -> None:
        """S19: the next step run or launched also brings back the values of ``rows`` (`PromptRows`):
        parallel/prompt_rows.py."""
        self._asked = rows

    def rows_back(self):
        """S19: the `PromptValues` of the step run or finished last (None if it asked for none)."""
        got, self.group.prompt_result = self.group.prompt_result, None
        return got

    def read_blocks(self, blocks) -> np.ndarray:
        """K and V of whole blocks, every layer, all KV heads (the other tensor ranks' heads gathered)."""
        if self.group.tp > 1:
            return self.group.kv_gather(self.runner.kv_cache, blocks)
        return self.runner.kv_cache.read_blocks(blocks)

    def write_blocks(self, blocks, data: np.ndarray) -> None:
        if self.group.tp > 1:
            self.group.kv_scatter(self.runner.kv_cache, blocks, data)
        else:
            self.runner.kv_cache.write_blocks(np.asarray(blocks), data)

    def block_views(self, blocks) -> list[tuple[np.ndarray, np.ndarray]]:
        """(K, V) of each whole block: views of one gather over the tensor ranks (of rank 0's cache with one)."""
        if self.group.tp > 1:
            data = self.read_blocks(blocks)
            return [(data[0, j], data[1, j]) for j in range(len(blocks))]
        return self.runner.kv_cache.block_views(blocks)

    def block_layout(self) -> tuple[tuple[int, int, int, int], np.dtype]:
        """One whole block's K: (layers, block_size, KV heads of every tensor rank, row), and its dtype."""
        k = self.runner.kv_cache.k
        heads = self.group.n_kv_heads if self.group.tp > 1 else k.shape[3]
        return (k.shape[0], k.shape[2], heads, k.shape[4]), k.dtype

    def close(self) -> None:
        """Rank 0 stops every rank of its group (also done at exit)."""
        if self.group.is_driver:
            self.group.stop()
