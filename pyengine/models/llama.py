"""S03: the Llama forward pass (SmolLM2 is a Llama), over GGUF weights.

    x = embed(tokens)
    per layer:  x += Wo · attention(rope(Wq · norm(x)), rope(Wk · norm(x)), Wv · norm(x))
                x += Wdown · (silu(Wgate · norm(x)) * Wup · norm(x))
    logits = head · norm(x)          (head = token_embd when the embeddings are tied)

Weights: Q|K|V are fused into one matrix and gate|up into one, so a layer is four GEMMs. Matrices are
stored as (in, out), i.e. transposed from GGUF's (out, in) rows, and applied as ``x @ W``: over the whole layer
chain OpenBLAS runs this orientation as fast as or faster than any (out, in) formulation for every row count
(1..512), and its matvec (1 row) is ~1.4x faster (sgemv "N" streams rows; the 49152-wide head: 4.4 vs 8.2 ms).
OpenBLAS's sgemm has a large fixed cost for few rows (it packs the whole weight each call): 2 rows cost ~2.4x
one row. So ``linear`` runs 2..4 rows as separate matvecs (the second one hits cache), and the head runs
2..8 rows as matvecs over 4096-column blocks that stay in cache (see ``linear`` and ``_lm_head``). The head is
stored as contiguous (d, 4096) column blocks (`ColumnBlocks`): with the whole (d, 49152) matrix's long rows,
OpenBLAS multiplies 8..32 rows 1.3-1.5x slower than block by block (32 rows: ~24 vs ~17 ms).
GGUF stores Q/K rows permuted for llama.cpp's interleaved RoPE; we undo that permutation at load
(the same row shuffle works on quantized rows, whose blocks never cross a row) and use half-split RoPE.
Modes: "resident" dequantizes everything to float32 once (fastest); "lean" keeps the quantized bytes and
dequantizes one layer at a time into arena scratch just before use (picoLM-style, for 32-bit browsers).

Two forwards: ``forward_reference`` is the readable one (recomputes the whole sequence, allocates freely) that
every fast path is tested against; ``forward`` is the fast paged one (ragged batch, KV cache, out= buffers).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pyengine.arena import Arena, ArenaSpec, spec
from pyengine.engine.kv_cache import ContextView, PagedKVCache, contiguous_start, slot_mapping
from pyengine.gguf import quants
from pyengine.layers.activation import swiglu
from pyengine.layers.attention import (attention, decode_attention, flash_attention, grouped_attention,
                                       padding_mask)
from pyengine.layers.norm import rms_norm
from pyengine.layers.rotary import apply_rope, interleaved_to_half, rope_cos_sin, rope_inv_freq

SUPPORTED_ARCHS = ("llama",)
HEAD_CHUNK_ROWS = 4096      # lean mode: rows of the LM head dequantized at a time
# Row counts where per-row matvecs beat one sgemm (OpenBLAS 0.3.31, measured over the whole 30-layer chain with
# cold weights, one thread): layers 2 rows 30 vs 50 ms, 4 rows 43 vs 53, 8 rows 62 vs 59; head (4096-column
# slices) 2 rows 7 vs 30 ms, 8 rows 18.5 vs 27, 16 rows 34 vs 31.
LINEAR_ROW_LOOP_MAX = 4
HEAD_ROW_LOOP_MAX = 8
HEAD_COL_CHUNK = 4096      # columns per block of the resident head
# Padded context slots (per K and V) gathered at once by batched decode attention: a group's K and V (2 x 1.5 MB)
# stay in cache from the gather to the two matmuls. Groups of 8192 were 13% slower at 32 x 512 tokens.
DECODE_SLOTS = 2048


def linear(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = x @ w for (rows, in) x and (in, out) w; few rows run as matvecs (sgemm's per-call cost)."""
    if not isinstance(w, np.ndarray):      # S17: a ColumnParallelLinear (its slices on several processes)
        return w.matmul(x, out)
    n = x.shape[0]
    if 1 < n <= LINEAR_ROW_LOOP_MAX:
        for r in range(n):
            np.matmul(x[r], w, out=out[r])
    else:
        np.matmul(x, w, out=out)
    return out


def swiglu_linear(x: np.ndarray, w, gate_up: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = swiglu(x @ w) through the (rows, 2F) scratch ``gate_up``. A tensor-parallel w (S17) gates each
    rank's columns where they are computed instead."""
    if not isinstance(w, np.ndarray) and w.gated(x, out):
        return out
    return swiglu(linear(x, w, gate_up), out=out)


def check_arch(config) -> None:
    if config.arch not in SUPPORTED_ARCHS:
        raise ValueError(f"architecture {config.arch!r} is not supported by the Llama forward pass "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)})")


# ---------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------

def dequantize_into(raw: np.ndarray, ggml_type: int, out: np.ndarray) -> np.ndarray:
    """Dequantize raw bytes into a preallocated C-contiguous float32 ``out`` (no model-sized temporaries)."""
    return quants.dequantize(raw, ggml_type, out.shape, out=out)


class QuantMatrix:
    """A (rows, cols) weight kept as quantized rows, possibly several tensors stacked (a fused matrix)."""

    def __init__(self, parts: list[tuple[np.ndarray, int]], cols: int):
        self.parts = parts                       # [(raw uint8 (rows_i, row_bytes_i), ggml_type)]
        self.cols = cols
        self.shape = (sum(p.shape[0] for p, _ in parts), cols)
        self.nbytes = sum(p.nbytes for p, _ in parts)

    def dequantize(self, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(self.shape, np.float32) if out is None else out
        r = 0
        for raw, t in self.parts:
            dequantize_into(raw, t, out[r:r + raw.shape[0]])
            r += raw.shape[0]
        return out

    def rows(self, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Dequantize selected rows (embedding lookup); single-part matrices only."""
        (raw, t), = self.parts
        return dequantize_into(np.take(raw, idx, axis=0), t, out)


class ColumnBlocks:
    """A float32 (rows, cols) matrix kept as contiguous column blocks of ``width`` columns (the resident LM
    head, (d, V)): ``matmul`` writes x @ M block by block; ``columns`` gathers columns (tied embeddings)."""

    def __init__(self, out_in_rows: np.ndarray, width: int):
        """``out_in_rows``: the (cols, rows) matrix as GGUF stores it (one row per output column)."""
        cols, rows = out_in_rows.shape
        self.width = width
        self.blocks = [np.ascontiguousarray(out_in_rows[c:c + width].T) for c in range(0, cols, width)]
        self.shape = (rows, cols)
        self.nbytes = sum(b.nbytes for b in self.blocks)

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(x.shape[:-1] + (self.shape[1],), np.float32) if out is None else out
        for i, b in enumerate(self.blocks):
            np.matmul(x, b, out=out[..., i * self.width:i * self.width + b.shape[1]])
        return out

    def columns(self, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out[t] = M[:, idx[t]] for (T,) indices: out is (T, rows)."""
        idx = np.asarray(idx, dtype=np.int64)
        which, col = np.divmod(idx, self.width)
        for i in np.unique(which).tolist():
            sel = which == i
            out[sel] = self.blocks[i][:, col[sel]].T          # (rows, k) gather: k*rows floats, small
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.concatenate(self.blocks, axis=1).astype(dtype or np.float32, copy=False)


class DecodeGroup(NamedTuple):
    """Decoding sequences attended in one batched call (built once per step, used by every layer)."""
    rows: slice | np.ndarray   # their rows in the batch: a slice when consecutive
    blocks: np.ndarray         # (G, n_blocks) block ids; padding repeats the last valid block (read but masked)
    lens: np.ndarray           # (G,) context lengths
    contiguous: bool           # rows is a slice
    pad: np.ndarray            # (G, 1, 1, n_blocks * block_size) padding-key mask (attention.padding_mask)
    start: int | None          # a lone sequence with consecutive blocks: its first cache slot (no gather)


class LayerWeights(NamedTuple):
    """One layer; matrices are (in, out) float32 arrays (or QuantMatrix of the (out, in) rows in lean mode)."""
    attn_norm: np.ndarray      # (d,)
    wqkv: np.ndarray           # (d, H*hd + 2*Hkv*hd)   columns: Q (RoPE half-split order) | K (same) | V
    wo: np.ndarray             # (H*hd, d)
    ffn_norm: np.ndarray       # (d,)
    w_gate_up: np.ndarray      # (d, 2F)                columns: gate | up
    w_down: np.ndarray         # (F, d)


class LlamaWeights:
    def __init__(self, config, mode, embed, output_norm, head, layers, freq_factors=None):
        self.config, self.mode = config, mode
        # resident: embed is None and head is (d, V) float32 `ColumnBlocks` (embedding rows are its columns when
        # tied; an untied embedding is a plain (d, V) array);
        # lean: both are QuantMatrix (V, d) rows, the same object when tied.
        self.embed = embed
        self.output_norm = output_norm
        self.head = head
        self.layers = layers                   # list[LayerWeights] of arrays or QuantMatrix
        self.freq_factors = freq_factors

    @classmethod
    def from_gguf(cls, gguf, config, mode: str = "resident") -> "LlamaWeights":
        check_arch(config)
        if mode not in ("resident", "lean"):
            raise ValueError(f"weights mode must be 'resident' or 'lean', got {mode!r}")
        c = config
        hd, d = c.head_dim, c.d_model

        def quant(name: str, shape: tuple[int, int], unpermute_heads: int = 0) -> QuantMatrix:
            info = gguf.tensor(name)
            if tuple(info.shape) != shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(info.shape)}, expected {shape}")
            layout = quants.block_layout(info.ggml_type)
            raw = info.data.reshape(shape[0], shape[1] // layout.block_size * layout.type_size)
            if unpermute_heads:
                raw = np.ascontiguousarray(interleaved_to_half(raw, unpermute_heads))
            return QuantMatrix([(raw, info.ggml_type)], shape[1])

        def fused(*mats: QuantMatrix) -> QuantMatrix:
            return QuantMatrix([p for m in mats for p in m.parts], mats[0].cols)

        def vector(name: str, n: int) -> np.ndarray:
            v = gguf.dequantize(name)
            if v.shape != (n,):
                raise ValueError(f"tensor {name!r} has shape {v.shape}, expected ({n},)")
            return v

        def realize(m: QuantMatrix):
            # resident: dequantize once, transposed to (in, out); the (out, in) copy is freed right away
            return np.ascontiguousarray(m.dequantize().T) if mode == "resident" else m

        layers = []
        for i in range(c.n_layers):
            p = f"blk.{i}."
            wqkv = fused(quant(p + "attn_q.weight", (c.n_heads * hd, d), c.n_heads),
                         quant(p + "attn_k.weight", (c.n_kv_heads * hd, d), c.n_kv_heads),
                         quant(p + "attn_v.weight", (c.n_kv_heads * hd, d)))
            gate_up = fused(quant(p + "ffn_gate.weight", (c.ffn_dim, d)), quant(p + "ffn_up.weight", (c.ffn_dim, d)))
            layers.append(LayerWeights(
                attn_norm=vector(p + "attn_norm.weight", d), wqkv=realize(wqkv),
                wo=realize(quant(p + "attn_output.weight", (d, c.n_heads * hd))),
                ffn_norm=vector(p + "ffn_norm.weight", d), w_gate_up=realize(gate_up),
                w_down=realize(quant(p + "ffn_down.weight", (d, c.ffn_dim)))))
        embed = quant("token_embd.weight", (c.vocab_size, d))
        head = embed if "output.weight" not in gguf.tensors else quant("output.weight", (c.vocab_size, d))
        if mode == "resident":
            # keep only the transposed head; with tied weights, embedding rows are read from its columns
            tied = head is embed
            head = ColumnBlocks(head.dequantize(), HEAD_COL_CHUNK)
            embed = None if tied else realize(embed)
        freq = gguf.dequantize("rope_freqs.weight") if "rope_freqs.weight" in gguf.tensors else None
        return cls(config, mode, embed, vector("output_norm.weight", d), head, layers, freq)

    @property
    def nbytes(self) -> int:
        mats = [self.head] + ([] if self.embed is None or self.embed is self.head else [self.embed])
        mats += [w for layer in self.layers for w in layer]
        return sum(m.nbytes for m in mats) + self.output_norm.nbytes

    def layer(self, i: int, scratch: dict | None = None) -> LayerWeights:
        """Layer i as float32 arrays: stored ones (resident) or dequantized into ``scratch`` views (lean)."""
        w = self.layers[i]
        if self.mode == "resident":
            return w
        s = scratch or {}
        # (out, in) rows dequantized into scratch; the transposed view is the (in, out) matrix
        return LayerWeights(w.attn_norm, w.wqkv.dequantize(s.get("wqkv")).T, w.wo.dequantize(s.get("wo")).T,
                            w.ffn_norm, w.w_gate_up.dequantize(s.get("w_gate_up")).T,
                            w.w_down.dequantize(s.get("w_down")).T)

    def embed_rows(self, token_ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty((len(token_ids), self.config.d_model), np.float32) if out is None else out
        if self.mode == "lean":
            return self.embed.rows(token_ids, out)
        if self.embed is None:                                      # tied: columns of the (d, V) head
            return self.head.columns(token_ids, out)
        np.copyto(out, self.embed[:, token_ids].T)                  # (d, T) gather: T*d floats, small
        return out


def decode_group_attention(layer: int, kv, A: dict, q_rot: np.ndarray, attn: np.ndarray, group: DecodeGroup,
                           scale: float) -> None:
    """Attention of a group of decoding sequences in one batched call: their context blocks are gathered
    (whole blocks, `PagedKVCache.gather_blocks` into arena scratch) into a padded (G, n_blocks*block_size,
    Hkv, hd) buffer, or, for a lone sequence with consecutive blocks, read in place (`PagedKVCache.read`). ``A``: the arena views (or a tensor-parallel
    worker's own scratch) holding attn.k_batch, attn.v_batch and attn.scores."""
    rows, blocks, contiguous = group.rows, group.blocks, group.contiguous
    G, nb = blocks.shape
    n = G * nb * kv.block_size
    shape = (G, nb * kv.block_size, kv.n_kv_heads, kv.head_dim)
    if group.start is not None:
        kb, vb = kv.read(layer, group.start, n, A["attn.k_batch"], A["attn.v_batch"])
    else:
        kb, vb = kv.gather_blocks(layer, blocks, A["attn.k_batch"], A["attn.v_batch"])
    if contiguous:
        decode_attention(q_rot[rows], kb.reshape(shape), vb.reshape(shape), scale=scale,
                         out=attn[rows], scratch=A["attn.scores"], pad=group.pad)
    else:
        attn[rows] = decode_attention(q_rot[rows], kb.reshape(shape), vb.reshape(shape), scale=scale,
                                      scratch=A["attn.scores"], pad=group.pad)


# ---------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------

class LlamaModel:
    def __init__(self, config, weights: LlamaWeights, flash_min_query: int = 128, flash_tile: int = 256,
                 flash_q_tile: int = 128):
        check_arch(config)
        self.config, self.weights = config, weights
        c = config
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling_type, c.rope_scaling_factor,
                                      c.rope_orig_context, freq_factors=weights.freq_factors)
        self.scale = c.head_dim ** -0.5
        # Prefills of at least flash_min_query tokens use tiled flash attention (bounded scratch);
        # shorter ones (decode, small chunks) use one plain softmax over the whole context.
        self.flash_min_query, self.flash_tile, self.flash_q_tile = flash_min_query, flash_tile, flash_q_tile
        # S17: a TensorParallelGroup (set by the runner) whose workers share every linear layer and decode attention
        self.tensor_parallel = None

    # --- the reference ------------------------------------------------------------------------------
    def forward_reference(self, token_ids, positions=None) -> np.ndarray:
        """Logits (T, V) for one whole sequence, recomputed from scratch: no cache, no fusion tricks."""
        c, w = self.config, self.weights
        token_ids = np.asarray(token_ids, dtype=np.int64)
        T = len(token_ids)
        positions = np.arange(T) if positions is None else np.asarray(positions, dtype=np.int64)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        nq, nk = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        x = w.embed_rows(token_ids)
        for i in range(c.n_layers):
            L = w.layer(i)
            h = rms_norm(x, L.attn_norm, c.rms_eps)
            qkv = h @ L.wqkv
            q = apply_rope(qkv[:, :nq].reshape(T, c.n_heads, c.head_dim), cos, sin)
            k = apply_rope(qkv[:, nq:nq + nk].reshape(T, c.n_kv_heads, c.head_dim), cos, sin)
            v = qkv[:, nq + nk:].reshape(T, c.n_kv_heads, c.head_dim)
            x = x + attention(q, k, v, offset=0).reshape(T, nq) @ L.wo
            h = rms_norm(x, L.ffn_norm, c.rms_eps)
            x = x + swiglu(h @ L.w_gate_up) @ L.w_down
        h = rms_norm(x, w.output_norm, c.rms_eps)
        return w.head.matmul(h) if w.mode == "resident" else h @ w.head.dequantize().T

    # --- the fast path ------------------------------------------------------------------------------
    def arena_specs(self, max_tokens: int, max_model_len: int, max_logits: int, max_seqs: int = 1,
                    block_size: int = 16) -> list[ArenaSpec]:
        """Every buffer ``forward`` needs, sized for the runner's limits."""
        c = self.config
        H, Hkv, hd, d = c.n_heads, c.n_kv_heads, c.head_dim, c.d_model
        qkv = (H + 2 * Hkv) * hd
        # scores, plus half as much again for the halving key reductions (attention._reduce_keys)
        plain_scores = Hkv * (self.flash_min_query - 1) * (H // Hkv) * (max_model_len + max_model_len // 2 + 1)
        flash_scores = Hkv * (self.flash_tile + self.flash_tile // 2 + 1) * self.flash_q_tile * (H // Hkv)
        # batched decode: padded K/V of several sequences; always room for one full-length context
        full = -(-max_model_len // block_size) * block_size
        decode_slots = max(full, min(max(1, min(max_seqs, max_tokens)) * full, DECODE_SLOTS))
        specs = [
            spec("act.x", (max_tokens, d)), spec("act.xn", (max_tokens, d)),
            spec("act.qkv", (max_tokens, qkv)), spec("act.qk_rot", (max_tokens, H + Hkv, hd)),
            spec("act.rope_tmp", (max_tokens, H + Hkv, hd // 2)),
            spec("act.attn", (max_tokens, H, hd)), spec("act.proj", (max_tokens, d)),
            spec("act.gate_up", (max_tokens, 2 * c.ffn_dim)), spec("act.ffn", (max_tokens, c.ffn_dim)),
            spec("rope.table_cos", (max_model_len, hd // 2)), spec("rope.table_sin", (max_model_len, hd // 2)),
            spec("rope.cos", (max_tokens, H + Hkv, hd // 2)), spec("rope.sin", (max_tokens, H + Hkv, hd // 2)),
            spec("attn.k_ctx", (max_model_len, Hkv, hd)), spec("attn.v_ctx", (max_model_len, Hkv, hd)),
            spec("attn.k_batch", (decode_slots, Hkv, hd)), spec("attn.v_batch", (decode_slots, Hkv, hd)),
            spec("attn.scores", (max(plain_scores, flash_scores, H * decode_slots),)),
            spec("logits.x", (max_logits, d)), spec("logits.xn", (max_logits, d)),
            spec("logits.out", (max_logits, c.vocab_size)),
        ]
        if self.weights.mode == "lean":
            w0 = self.weights.layers[0]
            # (out, in) row scratch for one layer's matrices, reused by every layer
            specs += [spec(f"lean.{n}", getattr(w0, n).shape) for n in ("wqkv", "wo", "w_gate_up", "w_down")]
            specs.append(spec("lean.head", (min(HEAD_CHUNK_ROWS, c.vocab_size), d)))
        return specs

    def prepare(self, arena: Arena) -> None:
        """Fill the arena's RoPE tables (once: positions 0 .. max_model_len-1)."""
        n = arena["rope.table_cos"].shape[0]
        cos, sin = rope_cos_sin(np.arange(n), self.inv_freq)
        arena["rope.table_cos"][...] = cos
        arena["rope.table_sin"][...] = sin

    def forward(self, batch, kv: PagedKVCache, arena: Arena) -> np.ndarray:
        """`_forward`, with the tensor-parallel workers (if any) awake for it."""
        tp = self.tensor_parallel
        if tp is None or not tp.begin(len(batch.token_ids)):
            return self._forward(batch, kv, arena)
        try:
            return self._forward(batch, kv, arena)
        finally:
            tp.end()

    def _forward(self, batch, kv: PagedKVCache, arena: Arena) -> np.ndarray:
        """Logits (len(batch.logits_indices), V): a view of arena["logits.out"], valid until the next call
        (a new array if more rows are asked than the arena was planned for).

        One GEMM per weight for all T tokens of the ragged batch; K/V of every token is written to its cache
        slot, then each sequence attends over its own context through its block table: decoding sequences
        (one new token) together, in batched calls over their gathered, padded contexts (``_decode_groups``);
        prefills and chunks one by one (plain or flash). A decode alone in its group whose blocks are
        consecutive (single-stream generation, as the allocator keeps runs) reads its context as a zero-copy
        slice instead.
        """
        c, w = self.config, self.weights
        H, Hkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
        nq, nk = H * hd, Hkv * hd
        T = len(batch.token_ids)
        A = arena.views
        x, xn, qkv, proj = A["act.x"][:T], A["act.xn"][:T], A["act.qkv"][:T], A["act.proj"][:T]
        qk_rot, rope_tmp = A["act.qk_rot"][:T], A["act.rope_tmp"][:T]
        q_rot, k_rot = qk_rot[:, :H], qk_rot[:, H:]
        attn, gate_up, ffn = A["act.attn"][:T], A["act.gate_up"][:T], A["act.ffn"][:T]
        cos, sin = A["rope.cos"][:T], A["rope.sin"][:T]
        k_ctx, v_ctx, scores = A["attn.k_ctx"], A["attn.v_ctx"], A["attn.scores"]
        lean = {n: A[f"lean.{n}"] for n in ("wqkv", "wo", "w_gate_up", "w_down")} if w.mode == "lean" else None

        # Per-batch metadata (O(T) small integers): cache slots of the new tokens and each sequence's context.
        positions = np.asarray(batch.positions, dtype=np.int64)
        # this step's cos/sin, repeated for the H + Hkv rotated heads once here rather than broadcast per layer
        np.copyto(cos, np.take(A["rope.table_cos"], positions, axis=0)[:, None, :])
        np.copyto(sin, np.take(A["rope.table_sin"], positions, axis=0)[:, None, :])
        seqs, slots, decodes, start = [], [], [], 0
        for qlen, ctx, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
            slots.append(slot_mapping(positions[start:start + qlen], table, kv.block_size))
            if qlen == 1:
                decodes.append((start, ctx, table))
            elif qlen:
                seqs.append((start, start + qlen, ctx, ContextView(table, ctx, kv.block_size)))
            start += qlen
        slots = np.concatenate(slots) if slots else np.zeros(0, np.int64)
        tp = self.tensor_parallel
        shared = tp is not None and tp.active and len(decodes) > 1
        # S17: when shared, at least one group per rank, so that the workers can take some of them
        groups = self._decode_groups(decodes, kv.block_size, min(DECODE_SLOTS, A["attn.k_batch"].shape[0]),
                                     ways=tp.size if shared else 1)
        if shared:
            groups = tp.share_decode_groups(groups, T)         # sends the workers theirs, returns ours

        w.embed_rows(np.asarray(batch.token_ids, dtype=np.int64), out=x)
        for i in range(c.n_layers):
            L = w.layer(i, lean)
            rms_norm(x, L.attn_norm, c.rms_eps, out=xn)
            linear(xn, L.wqkv, qkv)
            # Q and K heads are adjacent columns of qkv: rotate them in one call
            apply_rope(qkv[:, :nq + nk].reshape(T, H + Hkv, hd), cos, sin, out=qk_rot, tmp=rope_tmp)
            kv.write(i, slots, k_rot, qkv[:, nq + nk:].reshape(T, Hkv, hd))
            if shared:
                tp.attention_begin(i)                          # the workers attend over their groups meanwhile
            for group in groups:
                decode_group_attention(i, kv, A, q_rot, attn, group, self.scale)
            for group in (tp.attention_end() if shared else ()):   # theirs, if a worker was lost
                decode_group_attention(i, kv, A, q_rot, attn, group, self.scale)
            for a, b, ctx, view in seqs:
                k, v = view.kv(kv, i, k_ctx, v_ctx)
                if b - a >= self.flash_min_query:
                    flash_attention(q_rot[a:b], k, v, offset=ctx - (b - a), scale=self.scale,
                                    tile=self.flash_tile, q_tile=self.flash_q_tile, out=attn[a:b], scratch=scores)
                else:
                    grouped_attention(q_rot[a:b], k, v, offset=ctx - (b - a), scale=self.scale, out=attn[a:b],
                                      scratch=scores)
            linear(attn.reshape(T, nq), L.wo, proj)
            x += proj
            rms_norm(x, L.ffn_norm, c.rms_eps, out=xn)
            swiglu_linear(xn, L.w_gate_up, gate_up, out=ffn)
            linear(ffn, L.w_down, proj)
            x += proj

        idx = np.asarray(batch.logits_indices, dtype=np.int64)
        n = len(idx)
        if n <= A["logits.out"].shape[0]:
            hx, hxn, logits = A["logits.x"][:n], A["logits.xn"][:n], A["logits.out"][:n]
        else:   # more rows than planned (e.g. prompt logprobs): rare, so allocate rather than fail
            hx, hxn = np.empty((n, c.d_model), np.float32), np.empty((n, c.d_model), np.float32)
            logits = np.empty((n, c.vocab_size), np.float32)
        np.take(x, idx, axis=0, out=hx)
        rms_norm(hx, w.output_norm, c.rms_eps, out=hxn)
        self._lm_head(hxn, logits, A)
        return logits

    @staticmethod
    def _decode_groups(decodes, block_size: int, max_slots: int, ways: int = 1):
        """Split the decoding sequences [(row, context_len, block_table)] into `DecodeGroup`s whose padded
        contexts fit ``max_slots`` (a longer sequence forms a group of its own). ``ways`` > 1: the slots of
        all of them padded to the longest are shared over at least that many groups (tensor parallelism's
        ranks each take some)."""
        if not decodes:
            return []
        longest = -(-max(d[1] for d in decodes) // block_size) * block_size
        if ways > 1 and len(decodes) > 1:
            max_slots = min(max_slots, -(-len(decodes) * longest // ways))
        if len(decodes) * longest > max_slots:                 # must split: similar lengths together pad less
            decodes = sorted(decodes, key=lambda d: d[1])
        groups, cur, cur_nb = [], [], 0
        for d in decodes:
            nb = max(cur_nb, -(-d[1] // block_size))
            if cur and (len(cur) + 1) * nb * block_size > max_slots:
                groups.append(cur)
                cur, nb = [], -(-d[1] // block_size)
            cur.append(d)
            cur_nb = nb
        groups.append(cur)
        out = []
        for g in groups:
            nb = -(-max(d[1] for d in g) // block_size)
            blocks = np.empty((len(g), nb), np.int64)
            for j, (_, ctx, table) in enumerate(g):
                n = -(-ctx // block_size)
                blocks[j, :n] = table[:n]
                blocks[j, n:] = table[n - 1]
            rows = np.array([d[0] for d in g], np.int64)
            contiguous = bool(np.all(np.diff(rows) == 1))
            lens = np.array([d[1] for d in g], np.int64)
            start = contiguous_start(g[0][2], g[0][1], block_size) if len(g) == 1 else None
            out.append(DecodeGroup(slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else rows, blocks, lens,
                                   contiguous, padding_mask(lens, nb * block_size), start))
        return out

    def _lm_head(self, h: np.ndarray, out: np.ndarray, A: dict) -> None:
        head = self.weights.head
        if self.weights.mode == "resident":
            n = h.shape[0]
            if 1 < n <= HEAD_ROW_LOOP_MAX and isinstance(head, ColumnBlocks):
                for i, cols in enumerate(head.blocks):              # ~9 MB: stays in cache across the rows
                    c0 = i * head.width
                    for r in range(n):
                        np.matmul(h[r], cols, out=out[r, c0:c0 + cols.shape[1]])
            else:
                head.matmul(h, out)
            return
        chunk = A["lean.head"]
        (raw, t), = head.parts
        for r0 in range(0, head.shape[0], chunk.shape[0]):
            r1 = min(head.shape[0], r0 + chunk.shape[0])
            dequantize_into(raw[r0:r1], t, chunk[:r1 - r0])
            np.matmul(h, chunk[:r1 - r0].T, out=out[:, r0:r1])
