"""S21: what the streaming lean weight mode changes besides the weights (picoLM's budget: a 1.1B model in 256 MB).

Lean weights are views of the memory-mapped GGUF (file-backed pages the OS can evict), multiplied an L2-sized
block of rows at a time (layers/linear.py ``LeanLinear``); what is left is private memory, and at a long
context most of it is the KV cache and the per-batch buffers. So unless told otherwise lean mode keeps the KV
cache in q8_0 (3.8x smaller than float32; fp16 is 2x: at the 1.1B shape's 2048 context fp16 alone is 44 MiB,
more than the 64 MiB goal leaves after Python and NumPy) and plans batches of LEAN_BATCH_TOKENS tokens (longer
prompts run in chunks), which sizes the activation and attention buffers of the arena (models/base.py
``Buffers.specs``: batches of at most SHORT_QUERY_MAX tokens need no whole-context K/V copy nor prefill scores).
"""
from __future__ import annotations

LEAN_KV_CACHE_DTYPE = "q8_0"
LEAN_BATCH_TOKENS = 8        # <= tuning.SHORT_QUERY_MAX (no whole-context K/V copy), = LEAN_FOLD_MAX_ROWS (folded)
RESIDENT_KV_CACHE_DTYPE = "auto"
RESIDENT_BATCH_TOKENS = 2048


def mode_defaults(weights_mode: str, kv_cache_dtype: str | None,
                  max_num_batched_tokens: int | None) -> tuple[str, int]:
    """(kv_cache_dtype, max_num_batched_tokens) with the mode's defaults for the ones left None."""
    lean = weights_mode == "lean"
    kv = kv_cache_dtype if kv_cache_dtype is not None else (LEAN_KV_CACHE_DTYPE if lean else RESIDENT_KV_CACHE_DTYPE)
    n = max_num_batched_tokens
    if n is None:
        n = LEAN_BATCH_TOKENS if lean else RESIDENT_BATCH_TOKENS
    return kv, n
