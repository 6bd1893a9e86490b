"""S17: one rank's slice of the model — its layers, and in each its heads' and FFN range's rows and columns.

The weights are read quantized (the lean loader: views of the file, nothing dequantized), then only this rank's
part is dequantized to float32, matrix by matrix, so a rank never holds the whole model in float32. The model
object is the architecture's own class built from the rank's config (layout.rank_config: its head counts, FFN
width and layer count), so models/*.py run unchanged on a slice: every matrix of a layer is a `Linear`. How
each field of a layer splits is declared by the architecture's model class (``tp_split``, as mlx-lm's
``Model.shard()``: field -> one of SPLIT_KINDS); this module only carries the kinds out, and knows no
architecture by name.
"""
from __future__ import annotations

import numpy as np

from pyengine.layers.linear import DenseLinear
from pyengine.layers.moe import MoE
from pyengine.layers.parallel_linear import (ColumnParallelLinear, ExpertSlice, RowParallelLinear, SplitNorm,
                                             VocabParallelHead)
from pyengine.parallel.layout import rank_config

# what a model class's ``tp_split`` may say of a layer field:
SPLIT_KINDS = {
    "replicate": "kept whole on every rank (norms of d, per-head q/k norms)",
    "qkv": "a Q|K|V matrix: the columns of this rank's query heads and KV heads",
    "gate_up": "a gate|up matrix: this rank's FFN columns of both halves",
    "heads_rows": "the attention output matrix: the rows of this rank's query heads (partial sums, Allreduce)",
    "ffn_rows": "the down matrix: the rows of this rank's FFN columns (partial sums, Allreduce)",
    "qkv_vector": "a vector over Q|K|V columns (biases): this rank's entries",
    "q_heads_norm": "an RMSNorm over all query columns: this rank's entries, the statistic summed over the ranks",
    "k_heads_norm": "the same over all key columns (with the q one)",
    "experts": "the routed experts: this rank's range of whole experts (expert parallelism), the router whole",
}
MATRIX_SPLITS = ("qkv", "gate_up", "heads_rows", "ffn_rows")
# in a layer with experts the gated MLP fields are its shared expert's: split by the shared expert's columns
SHARED = {"gate_up": "shared_gate_up", "ffn_rows": "shared_rows"}


def _ranges(part, c, how: str) -> list[tuple[int, int]]:
    """The full matrix's output columns (column-parallel) or input rows (row-parallel) of this rank."""
    hd, H, Hkv, F = c.head_dim, c.n_heads, c.n_kv_heads, c.ffn_dim
    q0, q1 = part.q_heads[0], part.q_heads[-1] + 1
    k0, k1 = part.kv_heads[0], part.kv_heads[-1] + 1
    f0, f1 = part.ffn
    if how.startswith("shared"):
        (f0, f1), F, how = part.shared, c.moe.shared_ffn, how[len("shared_"):]
    if how == "qkv":
        return [(q0 * hd, q1 * hd), ((H + k0) * hd, (H + k1) * hd), ((H + Hkv + k0) * hd, (H + Hkv + k1) * hd)]
    if how == "gate_up":
        return [(f0, f1), (F + f0, F + f1)]
    if how == "heads_rows":
        return [(q0 * hd, q1 * hd)]
    return [(f0, f1)]


def shard_linear(lean, part, c, how: str, comm):
    """The rank's tensor-parallel Linear from a lean (quantized (out, in) rows) one."""
    q = lean.q
    ranges = _ranges(part, c, how)
    idx = np.concatenate([np.arange(a, b) for a, b in ranges])
    full_shape = (q.shape[1], q.shape[0])
    if how in ("qkv", "gate_up", "shared_gate_up"):   # output columns = rows of the stored matrix: only those
        rows = np.concatenate([q.dequantize(r0=a, r1=b) for a, b in ranges])
        return ColumnParallelLinear(rows.T, idx, full_shape, lean.act)
    full = q.dequantize()                # (out, in): one matrix in float32 at a time
    # a shared expert's partial sum is not reduced alone: it joins the routed experts' Allreduce (moe_forward)
    return RowParallelLinear(np.ascontiguousarray(full[:, idx].T), idx, full_shape,
                             None if how == "shared_rows" else comm)


def split_of(model, layer) -> dict:
    """The model class's ``tp_split``, checked: every field of its layers has a known kind."""
    split, arch = type(model).tp_split, model.config.arch
    if not isinstance(split, dict):
        raise ValueError(f"{arch}: {type(model).__name__} declares no tensor-parallel split (tp_split)")
    bad = {k: v for k, v in split.items() if v not in SPLIT_KINDS}
    missing = [f for f in (layer._fields if layer is not None else ()) if f not in split]
    if bad or missing:
        raise ValueError(f"{arch}: {type(model).__name__}.tp_split " + (f"has unknown kinds {bad}" if bad else
                         f"declares no split for the layer fields {missing}"))
    return split


def load_shard(gguf, part, comm, stage_first: bool):
    """(rank config, weights, model) of this rank: the layers of its stage, each split for its tensor rank;
    stage 0 (``stage_first``) also the embedding (quantized rows, read per token) and its LM-head columns.
    Each field splits as the model class's ``tp_split`` says (SPLIT_KINDS). An MoE layer's routed experts are
    not `Linear`s: with tensor parallelism each rank keeps its range of whole experts (expert parallelism,
    layout.py; dequantized once, E / N of them), the router whole, and its columns of the shared expert; q/k
    norms over all heads get their statistic summed over the ranks (SplitNorm). Pipeline stages alone keep
    every expert quantized, as one process does."""
    from pyengine.models import architecture

    c, w, full = architecture(gguf).build(gguf, "lean")     # quantized rows: only this rank's get dequantized
    a, b = part.layers
    layers = []
    whole = len(part.q_heads) == c.n_heads and tuple(part.ffn) == (0, c.ffn_dim)   # pipeline only: no split
    hd = c.head_dim
    qkv_cols = np.concatenate([np.arange(x, y) for x, y in _ranges(part, c, "qkv")])
    split_norm = None
    split = split_of(full, w.layers[0] if w.layers else None)
    for L in w.layers[a:b]:
        fields = {}
        moe = getattr(L, "moe", None)
        for name, value in zip(L._fields, L):
            how = split[name]
            if value is None or how == "replicate":
                continue
            if whole:                                       # pipeline stage only: every matrix dequantized
                if hasattr(value, "q"):
                    fields[name] = DenseLinear.from_quant(value.q, value.act)
            elif how in MATRIX_SPLITS:
                fields[name] = shard_linear(value, part, c, SHARED.get(how, how) if moe is not None else how, comm)
            elif how == "experts":
                fields[name] = value._replace(experts=ExpertSlice(value.experts, *part.experts, comm))
            elif how == "qkv_vector":
                fields[name] = np.ascontiguousarray(value[qkv_cols])
            elif how in ("q_heads_norm", "k_heads_norm"):
                first, heads = (part.q_heads[0], part.q_heads) if how == "q_heads_norm" else \
                    (part.kv_heads[0], part.kv_heads)
                fields[name] = value[first * hd:(first + len(heads)) * hd].copy()
                # a KV head replicated on r ranks (more ranks than KV heads) counts 1/r from each
                split_norm = SplitNorm(c.n_heads * hd, c.n_kv_heads * hd, min(1.0, c.n_kv_heads / comm.tp), comm)
        layers.append(L._replace(**fields))
    rc = rank_config(c, part)
    w.layers, w.config, w.mode = layers, rc, "resident"
    if stage_first:
        v0, v1 = part.vocab
        bounds = comm.vocab_bounds
        w.head = VocabParallelHead(w.head.q.dequantize(r0=v0, r1=v1), bounds, part.tp_rank, comm)
        w.tied = False           # the embedding keeps the quantized rows (the head holds only some columns)
    else:
        w.head, w.embed = None, None
    model = type(full)(rc, w)
    model.split_norm = split_norm
    model.kind_of = full.kind_of[a:b]                        # the kinds of its layers, by their global index
    return rc, w, model

