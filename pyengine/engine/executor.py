"""The executor seam: how the engine has its steps computed (vLLM v1's `Executor`).

The engine calls, one way: engine -> executor -> runner(s) -> model -> layers. `LocalExecutor` runs one
`ModelRunner` in this process; `pyengine.parallel.executor.MPIExecutor` drives the ranks of an MPI job (the engine
layer never imports it: `pyengine.llm.build_engine` hands it in). What an executor must provide is the `Executor`
protocol below; what a runner must provide is `Runner`.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from pyengine.engine.forward_batch import ForwardBatch


@runtime_checkable
class Runner(Protocol):
    """One rank's model runner as the engine and the executors see it (engine/model_runner.py; tests inject fakes).
    ``run`` returns (len(logits_indices), V) float32 logits. ``config``: the model's (its ``vocab_size``,
    ``d_model``, ``n_params``); ``gguf``: its model file (None without one); ``graphs``: S13's captured steps (None:
    every step runs plain); ``expert_load``: S16's routed-token counts (None unless MoE); the limits it was built for
    (None: it has none), which the engine's may not exceed; ``enforce_eager``: S13's off switch. Its ``tokenizer`` (a
    property that may load or refuse) is read only by an engine given none."""
    num_blocks: int
    block_size: int
    config: object
    gguf: object
    graphs: object
    expert_load: object
    max_model_len: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    enforce_eager: bool

    def run(self, batch: ForwardBatch) -> np.ndarray: ...


class KVBlockStore(Protocol):
    """Whole KV blocks of a rank's cache (engine/kv_cache.py `PagedKVCache`), every layer: (2, n, layers, block_size,
    heads, row) arrays as stored. ``heads``: a range of this cache's KV heads; ``out``: an array to read into."""

    def block_data(self, n: int, heads: int | None = None) -> np.ndarray: ...

    def read_blocks(self, blocks, heads: tuple[int, int] | None = None,
                    out: np.ndarray | None = None) -> np.ndarray: ...

    def write_blocks(self, blocks, data: np.ndarray) -> None: ...

    def block_views(self, blocks) -> list[tuple[np.ndarray, np.ndarray]]: ...


@runtime_checkable
class KVRunner(Runner, Protocol):
    """A `Runner` whose paged KV cache is in this process (engine/model_runner.py; S20's prompt cache reads and
    writes its blocks)."""
    kv_cache: KVBlockStore


class StageInput(Protocol):
    """A step's input to one pipeline stage of a rank (`RankRunner.stage_input`): ``x``, the (T, d) activations the
    stage embeds into or receives, runs its layers over and sends on; ``logits_indices``, the rows whose logits are
    wanted (the last stage sends those back)."""
    x: np.ndarray
    logits_indices: np.ndarray


@runtime_checkable
class RankRunner(Protocol):
    """What an executor of several ranks (parallel/executor.py `MPIExecutor`, parallel/mpi.py `MPIGroup`) uses of
    each rank's runner (engine/model_runner.py, built with a `RankShard`), and nothing else: check and plan a step,
    run it whole (one stage) or a stage's parts (embed, layers, head), and whole KV blocks (S18). ``held``: the bytes
    it holds (weights, KV cache) for the group's stats."""
    held: dict
    kv_cache: KVBlockStore

    def check(self, batch: ForwardBatch) -> None: ...

    def run_part(self, batch: ForwardBatch) -> np.ndarray: ...

    def stage_input(self, batch: ForwardBatch) -> StageInput: ...

    def embed(self, step: StageInput) -> None: ...

    def run_layers(self, step: StageInput) -> None: ...

    def head(self, hidden: np.ndarray, first: int = 0) -> np.ndarray: ...

    def logits_rows(self, n: int) -> np.ndarray | None: ...

    def run_rows(self, rows) -> np.ndarray: ...               # S19 (parallel/prompt_rows.py)

    def final_states(self, hidden: np.ndarray) -> np.ndarray: ...

    def logit_columns(self, hidden: np.ndarray) -> tuple[int, np.ndarray]: ...


@runtime_checkable
class RankShard(Protocol):
    """What a `ModelRunner` of one rank's part is built with (``shard=``; parallel/mpi.py `MPIGroup`): it loads this
    rank's part of the model, the parallel layers talking to the other ranks through it."""

    def load_part(self, gguf, config) -> tuple: ...      # (this rank's config, its weights, its model)


@runtime_checkable
class Executor(Protocol):
    """What `LLMEngine` drives. ``runner``: the runner of this process (its config, tokenizer, KV cache, gguf).
    ``pipeline_groups`` > 1: steps of different sequences may be in flight at once (``launch`` .. ``finish``, in
    launch order). ``failure``: why no more steps can run (a rank was lost), or None. KV blocks (S18 disagg):
    ``read_blocks`` / ``write_blocks`` move whole blocks' K and V of every layer (all ranks' heads), ``block_views``
    gives them per block (views of the cache when it is all here, no copy), ``block_layout``
    gives one such block's K shape (layers, block_size, KV heads, row) and dtype. ``group``: the
    communicator of this executor's ranks (None: one process)."""
    runner: Runner
    group: object

    @property
    def pipeline_groups(self) -> int: ...

    @property
    def failure(self) -> str | None: ...

    def run(self, batch: ForwardBatch) -> np.ndarray: ...

    def launch(self, batch: ForwardBatch) -> None: ...

    def finish(self) -> np.ndarray: ...

    def read_blocks(self, blocks) -> np.ndarray: ...

    def write_blocks(self, blocks, data: np.ndarray) -> None: ...

    def block_views(self, blocks) -> list[tuple[np.ndarray, np.ndarray]]: ...

    def block_layout(self) -> tuple[tuple[int, int, int, int], np.dtype]: ...

    def close(self) -> None: ...


@runtime_checkable
class PromptRowsExecutor(Protocol):
    """S19: an executor whose ranks hold the model in parts (parallel/executor.py `MPIExecutor`). The rows of a
    step whose prompt logprobs or pooled states are wanted (engine/prompt_logprobs.py `PromptRows`) go with the
    step (``ask_rows`` before its run or launch); their values come back reduced (``rows_back`` after its run or
    finish: `PromptValues`, or None if none were asked)."""

    def ask_rows(self, rows) -> None: ...

    def rows_back(self): ...


class LocalExecutor:
    """One runner in this process (any object with the `Runner` contract): no pipelining, no other ranks."""

    pipeline_groups = 1
    failure = None
    group = None

    def __init__(self, runner):
        self.runner = runner

    def run(self, batch: ForwardBatch) -> np.ndarray:
        return self.runner.run(batch)

    def launch(self, batch: ForwardBatch) -> None:
        raise RuntimeError("a local executor runs one step at a time (pipeline_groups = 1)")

    def finish(self) -> np.ndarray:
        raise RuntimeError("a local executor runs one step at a time (pipeline_groups = 1)")

    def read_blocks(self, blocks) -> np.ndarray:
        return self.runner.kv_cache.read_blocks(blocks)

    def write_blocks(self, blocks, data: np.ndarray) -> None:
        self.runner.kv_cache.write_blocks(np.asarray(blocks), data)

    def block_views(self, blocks) -> list[tuple[np.ndarray, np.ndarray]]:
        return self.runner.kv_cache.block_views(blocks)

    def block_layout(self) -> tuple[tuple[int, int, int, int], np.dtype]:
        k = self.runner.kv_cache.k
        return (k.shape[0], k.shape[2], k.shape[3], k.shape[4]), k.dtype

    def close(self) -> None:
        """Nothing to stop: the runner lives in this process."""
