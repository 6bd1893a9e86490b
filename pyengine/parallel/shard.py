"""S17: one rank's slice of the model — its layers, and in each its heads' and FFN range's rows and columns.

The weights are read quantized (the lean loader: views of the file, nothing dequantized), then only this rank's
part is dequantized to float32, matrix by matrix, so a rank never holds the whole model in float32. The model
object is the architecture's own class built from the rank's config (layout.rank_config: its head counts, FFN
width and layer count), so models/*.py run unchanged on a slice: every matrix of a layer is a `Linear`, and
which kind of tensor-parallel `Linear` a field gets is said here, by field name.
"""
from __future__ import annotations

import numpy as np

from pyengine.layers.linear import DenseLinear
from pyengine.layers.moe import MoE
from pyengine.layers.parallel_linear import (ColumnParallelLinear, ExpertSlice, RowParallelLinear, SplitNorm,
                                             VocabParallelHead)
from pyengine.parallel.layout import rank_config

# field of a layer -> how tensor parallelism splits it (the fields every architecture in the registry uses)
SPLITS = {"wqkv": "qkv", "w_gate_up": "gate_up", "wo": "heads_rows", "w_down": "ffn_rows"}
# in an MoE layer the gate|up and down matrices are its shared expert's: split by the shared expert's columns
MOE_SPLITS = {**SPLITS, "w_gate_up": "shared_gate_up", "w_down": "shared_rows"}


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


def load_shard(gguf, part, comm, stage_first: bool):
    """(rank config, weights, model) of this rank: the layers of its stage, each split for its tensor rank;
    stage 0 (``stage_first``) also the embedding (quantized rows, read per token) and its LM-head columns.
    An MoE layer's routed experts are not `Linear`s: with tensor parallelism each rank keeps its range of whole
    experts (expert parallelism, layout.py; dequantized once, E / N of them), the router whole, and its columns
    of the shared expert; OLMoE's q/k norms over all heads get their statistic summed over the ranks
    (SplitNorm). Pipeline stages alone keep every expert quantized, as one process does."""
    from pyengine.models import architecture

    c, w, full = architecture(gguf).build(gguf, "lean")     # quantized rows: only this rank's get dequantized
    a, b = part.layers
    layers = []
    whole = len(part.q_heads) == c.n_heads and tuple(part.ffn) == (0, c.ffn_dim)   # pipeline only: no split
    hd = c.head_dim
    qkv_cols = np.concatenate([np.arange(x, y) for x, y in _ranges(part, c, "qkv")])
    split_norm = None
    for L in w.layers[a:b]:
        fields = {}
        moe = getattr(L, "moe", None)
        splits = SPLITS if moe is None else MOE_SPLITS
        for name, value in zip(L._fields, L):
            if hasattr(value, "q") and whole:
                fields[name] = DenseLinear.from_quant(value.q, value.act)
            elif hasattr(value, "q"):
                if name not in splits:
                    raise ValueError(f"{c.arch}: no tensor-parallel split is defined for the matrix {name!r}")
                fields[name] = shard_linear(value, part, c, splits[name], comm)
        if not whole:
            if moe is not None:
                fields["moe"] = moe._replace(experts=ExpertSlice(moe.experts, *part.experts, comm))
            if getattr(L, "bqkv", None) is not None:                  # Qwen2-MoE: biases of its Q|K|V columns
                fields["bqkv"] = np.ascontiguousarray(L.bqkv[qkv_cols])
            qn = getattr(L, "q_norm", None)
            if qn is not None and qn.shape[0] == c.n_heads * hd:      # OLMoE: norms over all heads at once
                q0, k0 = part.q_heads[0] * hd, part.kv_heads[0] * hd
                fields["q_norm"] = qn[q0:q0 + len(part.q_heads) * hd].copy()
                fields["k_norm"] = L.k_norm[k0:k0 + len(part.kv_heads) * hd].copy()
                # a KV head replicated on r ranks (more ranks than KV heads) counts 1/r from each
                split_norm = SplitNorm(c.n_heads * hd, c.n_kv_heads * hd,
                                       min(1.0, c.n_kv_heads / comm.tp), comm)
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

