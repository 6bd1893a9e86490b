"""S05: the model runner — owns the GGUF file, config, weights, arena and paged KV cache; ``run(batch)``.

Everything that changes at runtime lives in one arena sized here, up front, from the config and the limits
(max_model_len, max_num_batched_tokens, max_num_seqs, num_blocks): the model's named buffers (models/base.py
`Buffers`) and the KV cache. The runner never decides block tables (the engine's BlockManager does, and passes
them in each ForwardBatch); it turns each batch into a step plan (engine/step_plan.py) — cache slots, RoPE
rows, how each sequence reads its context — and hands it to the model: ``model.forward(plan, kv, buffers)``.
"""
from __future__ import annotations

import numpy as np

from pyengine import tuning
from pyengine.arena import Arena
from pyengine.engine.args import DEFAULT_KV_BUDGET_BYTES
from pyengine.engine.forward_batch import ForwardBatch
from pyengine.engine.kv_cache import PagedKVCache, check_kv_dtype
from pyengine.engine.step_plan import plan_step


class StageInput:
    """A step's input to this rank's stage: its plan and its buffers cut to its T rows (``x``: the activations)."""

    def __init__(self, plan, buffers):
        self.plan, self.buffers = plan, buffers

    @property
    def x(self) -> np.ndarray:
        return self.buffers.x

    @property
    def logits_indices(self) -> np.ndarray:
        return self.plan.logits_indices


class ModelRunner:
    """``model``: path, bytes-like or GGUFFile, of any architecture in the registry (pyengine.models). Beyond the
    contract's limits:
    weights_mode      "resident" (float32 weights, fastest) or "lean" (quantized, dequantized per matrix)
    kv_budget_bytes   cap on the KV cache when num_blocks is None (default: max_num_seqs full-length sequences)
    max_logits        logits rows planned in the arena per run (default max_num_seqs; more rows still work)
    flash_min_query   sequences with at least this many new tokens use tiled flash attention
    kv_cache_dtype    KV cache storage (S08): "auto" (float32), "fp16", "q8_0", "q4_0" (see kv_cache.py); the
                      default budget then holds 2x / 3.8x / 7.1x the blocks
    shard             S17 over MPI: a `RankShard` (engine/executor.py; `pyengine.parallel.mpi.MPIGroup`): this process
                      builds only its rank's part (its stage's layers, its heads and FFN columns, its KV heads),
                      through ``shard.load_part``; an executor (parallel/executor.py `MPIExecutor`) drives the
                      ranks' runners, which never call it back
    enforce_eager     S13 off switch (vLLM's name): every step runs plain; by default a step whose queries are
                      all short (decodes, speculative verification) is captured once per shape bucket and
                      replayed (engine/graph_replay.py); a rank's part always runs plain
    """

    def __init__(self, model, max_model_len: int = 2048, num_blocks: int | None = None, block_size: int = 16,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 64, weights_mode: str = "resident",
                 kv_budget_bytes: int = DEFAULT_KV_BUDGET_BYTES, max_logits: int | None = None,
                 flash_min_query: int | None = None, shard=None, kv_cache_dtype: str = "auto",
                 enforce_eager: bool = False):
        from pyengine.gguf.reader import GGUFFile
        from pyengine.models import load_config, load_model
        from pyengine.models.base import Buffers

        for name, value in (("max_model_len", max_model_len), ("block_size", block_size),
                            ("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if num_blocks is not None and (not isinstance(num_blocks, (int, np.integer)) or num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive integer or None, got {num_blocks!r}")
        if weights_mode not in ("resident", "lean"):
            raise ValueError(f"weights mode must be 'resident' or 'lean', got {weights_mode!r}")
        self.gguf = model if isinstance(model, GGUFFile) else GGUFFile(model)
        self.config = c = load_config(self.gguf)
        if c.context_length and max_model_len > c.context_length:
            # RoPE was trained up to context_length: longer sequences would silently degrade.
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {c.context_length}")
        self.max_model_len = int(max_model_len)
        self.block_size = int(block_size)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.max_num_seqs = int(max_num_seqs)
        self.flash_min_query = tuning.FLASH_MIN_QUERY if flash_min_query is None else int(flash_min_query)
        self.kv_cache_dtype = check_kv_dtype(kv_cache_dtype, c.head_dim)
        # from the whole model's shape, so that every rank of a parallel group agrees on num_blocks
        per_block = PagedKVCache.bytes_per_block(c.n_layers, block_size, c.n_kv_heads, c.head_dim, kv_cache_dtype)
        if num_blocks is None:
            # enough for every sequence at full length, unless that exceeds the memory budget
            want = max_num_seqs * -(-max_model_len // block_size)
            num_blocks = max(-(-max_model_len // block_size), min(want, kv_budget_bytes // per_block))
        self.num_blocks = int(num_blocks)

        self.sharded = shard is not None
        if shard is not None:
            if weights_mode != "resident":
                raise ValueError("a parallel runner takes resident weights (lean ones are not split yet)")
            c, self.weights, self.model = shard.load_part(self.gguf, c)
        else:
            _, self.weights, self.model = load_model(self.gguf, weights_mode)
        self.rank_config = c          # this process's part of the model (the whole one without `parallel`)
        self.max_logits = int(max_logits or max(max_num_seqs, 1))
        # batched short queries: padded K/V of several sequences; always room for one full-length context
        full = -(-self.max_model_len // block_size) * block_size
        decode_slots = max(full, min(max(1, min(self.max_num_seqs, self.max_num_batched_tokens)) * full,
                                     tuning.DECODE_SLOTS))
        n_kinds = len(self.model.kinds)
        specs = (Buffers.specs(c, n_kinds, self.max_num_batched_tokens, self.max_model_len, self.max_logits,
                               decode_slots, self.weights.lean_floats, self.flash_min_query,
                               kv_converts=self.kv_cache_dtype != "auto")
                 + PagedKVCache.arena_specs(c.n_layers, self.num_blocks, block_size, c.n_kv_heads, c.head_dim,
                                            kv_cache_dtype))
        self.decode_slots = decode_slots
        self.arena = Arena.from_specs(specs)
        self.kv_cache = PagedKVCache(self.arena, c.n_layers, self.num_blocks, block_size, c.n_kv_heads,
                                     c.head_dim, kv_cache_dtype)
        # what this rank holds (float32 weights, KV cache), for the parallel benchmark
        self.held = {"weights_bytes": sum(lin.nbytes for _, lin in self.weights.linears()),
                     "kv_bytes": self.kv_cache.k.nbytes + self.kv_cache.v.nbytes} if shard is not None else {}
        self.buffers = Buffers.from_arena(self.arena, n_kinds)
        self.weights.bind_scratch(self.buffers.lean)
        self.model.prepare(self.buffers)
        self._tokenizer = None
        self.graphs = None
        self.enforce_eager = enforce_eager

    @property
    def enforce_eager(self) -> bool:
        """S13: True when every step runs plain (no captured steps)."""
        return self.graphs is None

    @enforce_eager.setter
    def enforce_eager(self, value: bool) -> None:
        from pyengine.engine.graph_replay import StepGraphs
        self.graphs = None if value or self.sharded else (self.graphs or StepGraphs())

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from pyengine.tokenizer import Tokenizer      # lazy: the runner's tests need no tokenizer
            self._tokenizer = Tokenizer.from_gguf(self.gguf)
        return self._tokenizer

    @property
    def expert_load(self):
        """S16: the MoE model's routed-token counts (models/base.py `ExpertLoad`), None for a dense model."""
        return self.model.expert_load

    def check(self, batch: ForwardBatch) -> None:
        """ValueError if ``batch`` does not fit this runner's limits (its blocks, vocab, tokens, context)."""
        batch.validate(self.block_size, self.num_blocks, self.config.vocab_size)
        if batch.num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"batch has {batch.num_tokens} tokens, max_num_batched_tokens is "
                             f"{self.max_num_batched_tokens}")
        if batch.context_lens and max(batch.context_lens) > self.max_model_len:
            raise ValueError(f"context length {max(batch.context_lens)} exceeds max_model_len {self.max_model_len}")

    def run(self, batch: ForwardBatch) -> np.ndarray:
        """(len(logits_indices), V) float32 logits: a view into the arena, valid until the next run. A rank's part
        (``shard``) is run by its executor instead (parallel/executor.py)."""
        self.check(batch)
        if self.sharded:
            raise RuntimeError("a rank's part of the model runs through its executor (MPIExecutor.run)")
        if self.graphs is not None:                # S13: a known bucket replayed without planning the step
            logits = self.graphs.run_batch(batch, self.buffers.logits.shape[0])
            if logits is not None:
                return logits
        plan = self.plan(batch)
        if self.graphs is not None:                                  # S13: replayed, or captured now
            logits = self.graphs.run(plan, batch, self.model, self.kv_cache, self.buffers, self.block_size,
                                     self.max_slots)
            if logits is not None:
                return logits
        return self.model.forward(plan, self.kv_cache, self.buffers.rows(plan.num_tokens))

    def plan(self, batch: ForwardBatch):
        """The step plan of a (validated) batch."""
        b = self.buffers
        return plan_step(batch, self.block_size, self.model.windows, b.rope_tables, b.rope_rows,
                         self.max_slots, self.flash_min_query)

    def hidden_states(self, rows) -> np.ndarray:
        """S19 (engine/pooling.py): the final hidden states (the final norm applied: the LM head's input) of rows
        ``rows`` of the latest run's tokens, as a new (len(rows), d) float32 array; valid until the next run."""
        if self.sharded:
            raise RuntimeError("a rank's part of the model has no whole hidden state")
        return self.model.final_hidden(self.buffers.x, np.asarray(rows, dtype=np.int64))

    def prompt_logits(self, rows, max_rows: int):
        """S19 (engine/prompt_logprobs.py): the LM head applied to rows ``rows`` of the latest run's tokens, at most
        ``max_rows`` at a time: yields (offset in rows, (m, V) float32 logits, a new array each time). Read before
        the next run."""
        if self.sharded:
            raise RuntimeError("a rank's part of the model has no whole hidden state")
        rows, b = np.asarray(rows, dtype=np.int64), self.buffers
        for start in range(0, len(rows), max_rows):
            yield start, self.model.logits(b.x, rows[start:start + max_rows], b, first=b.logits.shape[0])

    @property
    def max_slots(self) -> int:
        """Padded context slots a batched query group may gather."""
        return min(tuning.DECODE_SLOTS, self.decode_slots)

    # --- S17: a rank's part, as an executor of several ranks drives it (engine/executor.py `RankRunner`) --------
    def run_part(self, batch: ForwardBatch) -> np.ndarray:
        """This rank's part of a whole step on one stage: its layers (its heads and columns), then its head."""
        plan = self.plan(batch)
        return self.model.forward(plan, self.kv_cache, self.buffers.rows(plan.num_tokens))

    def stage_input(self, batch: ForwardBatch) -> "StageInput":
        """The plan of a stage's step and its activation rows (``x``: embedded here or received)."""
        plan = self.plan(batch)
        return StageInput(plan, self.buffers.rows(plan.num_tokens))

    def embed(self, step: "StageInput") -> None:
        self.model.embed(step.plan.token_ids, step.x)

    def run_layers(self, step: "StageInput") -> None:
        self.model.run_layers(step.plan, self.kv_cache, step.buffers)

    def head(self, hidden: np.ndarray, first: int = 0) -> np.ndarray:
        """Logits of ``hidden`` rows (the last stage's), in the arena's logits rows from ``first`` on (new ones if
        more rows than planned); a tensor rank's columns gathered onto rank 0 by the parallel head."""
        return self.model.logits(hidden, np.arange(len(hidden)), self.buffers, first)

    def logits_rows(self, n: int) -> np.ndarray | None:
        """The arena's first ``n`` logits rows (where `head` writes them), None when more than were planned."""
        logits = self.buffers.logits
        return logits[:n] if n <= logits.shape[0] else None

    # --- S19 under S17: a rank's part of prompt logprobs and pooled states (parallel/prompt_rows.py) ------------
    def run_rows(self, rows) -> np.ndarray:
        """Rows ``rows`` of the latest run's residual stream (after the stage's layers: with one stage, the final
        one), a new array."""
        return np.take(self.buffers.x, np.asarray(rows, dtype=np.int64), axis=0)

    def final_states(self, hidden: np.ndarray) -> np.ndarray:
        """The final norm of final residual rows ``hidden`` (the state `hidden_states` pools), a new array."""
        return self.model.final_hidden(hidden, np.arange(len(hidden)))

    def logit_columns(self, hidden: np.ndarray) -> tuple[int, np.ndarray]:
        """(first id, this rank's columns of the logits of final residual rows ``hidden``), not gathered."""
        return self.model.logit_columns(hidden)

    # --- helpers for tests and benchmarks (the real generation loop is the engine's) -------------------
    def contiguous_batch(self, token_ids, start: int, logits_all: bool = False) -> ForwardBatch:
        """One sequence whose blocks are 0, 1, 2, ... (block table = arange): tokens at start.. start+n."""
        ids = np.asarray(token_ids, dtype=np.int64)
        n = len(ids)
        table = np.arange(-(-(start + n) // self.block_size), dtype=np.int32)
        return ForwardBatch(token_ids=ids, positions=np.arange(start, start + n, dtype=np.int64), query_lens=[n],
                            context_lens=[start + n], block_tables=[table],
                            logits_indices=np.arange(n) if logits_all else np.array([n - 1]))

    def generate_greedy(self, prompt_ids, n: int) -> list[int]:
        """Greedy tokens for one sequence: prefill (in max_num_batched_tokens chunks), then n-1 decodes."""
        ids = list(int(t) for t in prompt_ids)
        if not ids or len(ids) + n > self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens + {n} new exceeds max_model_len {self.max_model_len}")
        out: list[int] = []
        pos = 0
        while pos < len(ids):
            chunk = ids[pos:pos + self.max_num_batched_tokens]
            logits = self.run(self.contiguous_batch(chunk, pos))
            pos += len(chunk)
        for _ in range(n):
            tok = int(np.argmax(logits[0]))
            out.append(tok)
            if len(out) == n:
                break
            logits = self.run(self.contiguous_batch([tok], pos))
            pos += 1
        return out
