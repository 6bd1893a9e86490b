"""S03: the model's hyper-parameters, read from GGUF metadata (keys as llama.cpp names them).

GGUF stores hyper-parameters under the architecture's prefix: ``llama.block_count``, ``gemma3.embedding_length``
... ``ModelConfig.from_gguf`` reads the keys every architecture has once into a frozen dataclass, so model code
never touches metadata; an architecture module (models/<arch>.py) extends it with its own keys, and the model
registry (models/__init__.py) says which architectures run.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from pyengine.gguf import GGUFError

@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rope_scaling_type: str         # "none", "linear", "yarn", ...
    rope_scaling_factor: float     # 1.0 when there is no scaling
    rope_orig_context: int         # context the model was trained at (= context_length without scaling)
    rms_eps: float
    rope_dim: int                  # dimensions RoPE rotates (= head_dim, or fewer: partial rotary, phi3 only)
    tie_embeddings: bool           # no output.weight: the LM head reuses token_embd.weight
    bos_token_id: int | None
    eos_token_id: int | None
    n_params: int                  # sum of all tensors' elements
    rope_beta_fast: float = 32.0   # YaRN: pairs turning more than this often over the original context keep
    rope_beta_slow: float = 1.0    #       their frequency, fewer than beta_slow are interpolated
    rope_attn_factor: float = 1.0  # rope.scaling.attn_factor: cos and sin times this (YaRN: times its own too)

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_gguf(cls, gguf, partial_rotary: bool = False) -> "ModelConfig":
        """Read from a GGUFFile (or anything GGUFFile accepts: path, bytes, ...). ``partial_rotary``: the
        architecture rotates only the first rope.dimension_count dimensions of each head (else they must be
        all of them)."""
        from pyengine.gguf.reader import GGUFFile
        if not isinstance(gguf, GGUFFile):
            gguf = GGUFFile(gguf)
        md = gguf.metadata
        arch = md.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError("metadata key 'general.architecture' is missing or not a string")

        def number(key: str, kind: type, default: Any = None, required: bool = False, positive: bool = True):
            full = f"{arch}.{key}"
            if full not in md:
                if required:
                    raise GGUFError(f"required metadata key {full!r} is missing")
                return default
            value = md[full]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and
                                                                                 not isinstance(value, int)):
                kind_name = "an integer" if kind is int else "a number"
                raise GGUFError(f"metadata key {full!r} must be {kind_name}, got {value!r:.60}")
            if not math.isfinite(value) or (positive and value <= 0):
                raise GGUFError(f"metadata key {full!r} = {value} must be a positive number")
            return kind(value)

        n_layers = number("block_count", int, required=True)
        d_model = number("embedding_length", int, required=True)
        n_heads = number("attention.head_count", int, required=True)
        n_kv_heads = number("attention.head_count_kv", int, default=n_heads)
        ffn_dim = number("feed_forward_length", int, required=True)
        context_length = number("context_length", int, required=True)
        rms_eps = number("attention.layer_norm_rms_epsilon", float, required=True)
        rope_theta = number("rope.freq_base", float, default=10000.0)
        if n_heads % n_kv_heads:
            raise GGUFError(f"{arch}.attention.head_count = {n_heads} is not a multiple of "
                            f"{arch}.attention.head_count_kv = {n_kv_heads}")
        # head_dim: explicit key_length (Gemma: 256 != 640/4), else d_model / n_heads as llama.cpp does.
        head_dim = number("attention.key_length", int)
        if head_dim is None:
            if d_model % n_heads:
                raise GGUFError(f"{arch}.embedding_length = {d_model} is not a multiple of "
                                f"{arch}.attention.head_count = {n_heads} and {arch}.attention.key_length "
                                "is missing")
            head_dim = d_model // n_heads
        rope_dim = number("rope.dimension_count", int, default=head_dim)
        if rope_dim != head_dim and not partial_rotary:
            raise GGUFError(f"{arch}.rope.dimension_count = {rope_dim} differs from the head dim {head_dim} "
                            f"(partial rotary embeddings are not supported for {arch})")
        if rope_dim > head_dim or rope_dim % 2 or (head_dim - rope_dim) % 2:
            raise GGUFError(f"{arch}.rope.dimension_count = {rope_dim} must be even and at most the head dim "
                            f"{head_dim}, with an even remainder")

        scaling_type = md.get(f"{arch}.rope.scaling.type", "none")
        if not isinstance(scaling_type, str):
            raise GGUFError(f"metadata key '{arch}.rope.scaling.type' must be a string")
        scaling_factor = number("rope.scaling.factor", float, default=None, positive=False)
        linear = number("rope.scale_linear", float)      # older files: linear scaling only
        if scaling_factor is None and linear is not None:
            scaling_type, scaling_factor = "linear", linear
        if scaling_factor is not None and scaling_factor < 0:
            raise GGUFError(f"metadata key '{arch}.rope.scaling.factor' = {scaling_factor} is negative")
        if not scaling_factor:          # absent, or 0 which llama.cpp also reads as "no scaling"
            scaling_factor = 1.0
        orig_context = number("rope.scaling.original_context_length", int, default=context_length)
        beta_fast = number("rope.scaling.yarn_beta_fast", float, default=32.0)
        beta_slow = number("rope.scaling.yarn_beta_slow", float, default=1.0)
        attn_factor = number("rope.scaling.attn_factor", float, default=1.0)
        if scaling_type == "yarn" and beta_slow >= beta_fast:
            raise GGUFError(f"{arch}.rope.scaling.yarn_beta_slow = {beta_slow} must be below "
                            f"{arch}.rope.scaling.yarn_beta_fast = {beta_fast}")

        vocab_size = _vocab_size(gguf, arch)
        bos = md.get("tokenizer.ggml.bos_token_id")
        eos = md.get("tokenizer.ggml.eos_token_id")
        for key, tid in (("bos", bos), ("eos", eos)):
            if tid is not None and (not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < vocab_size):
                raise GGUFError(f"metadata key 'tokenizer.ggml.{key}_token_id' = {tid!r:.40} is not a token id "
                                f"below the vocab size {vocab_size}")
        return cls(
            arch=arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
            head_dim=head_dim, ffn_dim=ffn_dim, vocab_size=vocab_size, context_length=context_length,
            rope_theta=rope_theta, rope_scaling_type=scaling_type, rope_scaling_factor=scaling_factor,
            rope_orig_context=orig_context, rms_eps=rms_eps, rope_dim=rope_dim,
            tie_embeddings="output.weight" not in gguf.tensors,
            bos_token_id=bos, eos_token_id=eos,
            n_params=sum(t.n_elements for t in gguf.tensors.values()),
            rope_beta_fast=beta_fast, rope_beta_slow=beta_slow, rope_attn_factor=attn_factor,
        )


def _vocab_size(gguf, arch: str) -> int:
    """Vocab = tokenizer token list, else {arch}.vocab_size, else rows of token_embd; they must agree."""
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    embd = gguf.tensors.get("token_embd.weight")
    rows = embd.shape[0] if embd is not None and len(embd.shape) == 2 else None
    if isinstance(tokens, list) and tokens:
        vocab = len(tokens)
    elif isinstance(gguf.metadata.get(f"{arch}.vocab_size"), int):
        vocab = gguf.metadata[f"{arch}.vocab_size"]
    elif rows is not None:
        vocab = rows
    else:
        raise GGUFError("cannot tell the vocab size: no 'tokenizer.ggml.tokens', "
                        f"'{arch}.vocab_size' or 2-D 'token_embd.weight'")
    if rows is not None and rows != vocab:
        raise GGUFError(f"tensor 'token_embd.weight' has {rows} rows but the vocab has {vocab} tokens")
    return int(vocab)
