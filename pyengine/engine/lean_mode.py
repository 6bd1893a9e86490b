"""S21: what the streaming lean weight mode changes besides the weights (picoLM's budget: a 1.1B model in 256 MB).

Lean weights are views of the memory-mapped GGUF (file-backed pages the OS can evict), multiplied an L2-sized
block of rows at a time (layers/linear.py ``LeanLinear``); what is left is private memory, and at a long
context most of it is the KV cache and the per-batch buffers. So unless told otherwise lean mode keeps the KV
cache in q8_0 (3.8x smaller than float32; fp16 is 2x: at the 1.1B shape's 2048 context fp16 alone is 44 MiB,
more than the 64 MiB goal leaves after Python and NumPy; head dimensions that are no multiple of 32 stay
float32) and plans batches of LEAN_BATCH_TOKENS tokens (longer
prompts run in chunks), which sizes the activation and attention buffers of the arena (models/base.py
``Buffers.specs``: batches of at most SHORT_QUERY_MAX tokens need no whole-context K/V copy nor prefill scores).
"""
from __future__ import annotations

import os

LEAN_KV_CACHE_DTYPE = "q8_0"
LEAN_BATCH_TOKENS = 8        # <= tuning.SHORT_QUERY_MAX (no whole-context K/V copy), = LEAN_FOLD_MAX_ROWS (folded)
RESIDENT_KV_CACHE_DTYPE = "auto"
RESIDENT_BATCH_TOKENS = 2048


def mode_defaults(weights_mode: str, kv_cache_dtype: str | None, max_num_batched_tokens: int | None,
                  head_dim: int | None = None) -> tuple[str, int]:
    """(kv_cache_dtype, max_num_batched_tokens) with the mode's defaults for the ones left None. q8_0 rows are
    blocks of 32: a ``head_dim`` that is no multiple of 32 (tiny test models) keeps its KV cache as it was,
    float32 ("auto")."""
    lean = weights_mode == "lean"
    kv = kv_cache_dtype
    if kv is None:
        kv = LEAN_KV_CACHE_DTYPE if lean else RESIDENT_KV_CACHE_DTYPE
        if lean and head_dim is not None and head_dim % 32:
            kv = RESIDENT_KV_CACHE_DTYPE
    n = max_num_batched_tokens
    if n is None:
        n = LEAN_BATCH_TOKENS if lean else RESIDENT_BATCH_TOKENS
    return kv, n


def engine_defaults(model, runner, weights_mode: str, kv_cache_dtype: str | None,
                    max_num_batched_tokens: int | None) -> tuple[str, int]:
    """`mode_defaults` for an `LLMEngine` building its runner for ``model`` (whose head dimension is read only
    when a lean default KV type depends on it); an injected runner has its own KV type and batch: the engine's
    defaults stay the resident ones, as before S21."""
    if runner is not None:
        return mode_defaults("resident", kv_cache_dtype, max_num_batched_tokens)
    head_dim = None
    if runner is None and weights_mode == "lean" and kv_cache_dtype is None:
        head_dim = head_dim_of(model)
    return mode_defaults(weights_mode, kv_cache_dtype, max_num_batched_tokens, head_dim)


def head_dim_of(model) -> int | None:
    """The head dimension of a model given as a GGUFFile or a path (None for anything else: the default model is
    resolved later, its head dimension 64 needs no fallback)."""
    from pyengine.gguf.reader import GGUFFile
    from pyengine.models import load_config

    try:
        gguf = model if isinstance(model, GGUFFile) else GGUFFile(model) if isinstance(model, (str, os.PathLike)) \
            else None
        return None if gguf is None else load_config(gguf).head_dim
    except (OSError, ValueError):
        return None                      # the runner reports the file's problem itself


def memory_plan(gguf, weights_mode: str, max_model_len: int, kv_cache_dtype: str | None = None,
                block_size: int = 16) -> dict:
    """What one sequence of ``max_model_len`` tokens holds in ``weights_mode`` (``pyengine info --memory``), in
    bytes: "weights" (private: resident float32 matrices, norms), "mapped" (file-backed views of the GGUF: lean
    mode's quantized matrices, evictable), "kv_cache", "buffers" (the rest of the arena: activations, attention,
    lean scratch), and "kv_cache_dtype" / "max_num_batched_tokens" as the mode's defaults resolve them. The
    arena regions come from the very functions the runner sizes it with; Python and NumPy come on top."""
    import numpy as np

    from pyengine import tuning
    from pyengine.arena import plan_nbytes
    from pyengine.engine.kv_cache import PagedKVCache
    from pyengine.layers.linear import LeanLinear, stage_rows
    from pyengine.models import load_model
    from pyengine.models.base import Buffers

    c, w, model = load_model(gguf, "lean")             # views of the file: cheap, nothing dequantized
    kv_dtype, batch = mode_defaults(weights_mode, kv_cache_dtype, None, c.head_dim)
    mapped = private = norms = 0
    seen = set()
    for _, lin in w.linears():
        if id(lin) not in seen and isinstance(lin, LeanLinear):
            seen.add(id(lin))
            mapped += lin.nbytes
            private += 4 * lin.shape[0] * lin.shape[1]
    for L in w.layers:
        for v in L:
            if isinstance(v, np.ndarray):
                norms += v.nbytes
            experts = getattr(v, "experts", None)
            if experts is not None:
                mapped += experts.nbytes
                private += 4 * 3 * experts.n_experts * experts.f * experts.d
    if not w.tied:                                     # the embedding's own rows (resident: a float32 copy)
        src = w.embed.source
        mapped += src.nbytes
        private += 4 * c.vocab_size * c.d_model
    lean = weights_mode == "lean"
    weights = norms + (0 if lean else private)
    blocks = -(-max_model_len // block_size)
    kv = blocks * PagedKVCache.bytes_per_block(c.n_layers, block_size, c.n_kv_heads, c.head_dim, kv_dtype)
    batch = min(batch, max_model_len) if lean else batch
    # the weights scratch: lean's blocks, or resident's staged blocks (Pyodide's rows layout; else none)
    staged = max((stage_rows(lin.shape[1], lin.shape[0]) * lin.shape[0] for _, lin in w.linears()), default=0)
    specs = Buffers.specs(c, len(model.kinds), batch, max_model_len, 1, blocks * block_size,
                          w.lean_floats if lean else staged, tuning.FLASH_MIN_QUERY, kv_converts=kv_dtype != "auto")
    return {"weights": weights, "mapped": mapped if lean else 0, "kv_cache": kv, "buffers": plan_nbytes(specs),
            "kv_cache_dtype": kv_dtype, "max_num_batched_tokens": batch}
