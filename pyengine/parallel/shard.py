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
from pyengine.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, VocabParallelHead
from pyengine.parallel.layout import rank_config

# field of a layer -> how tensor parallelism splits it (the fields every architecture in the registry uses)
SPLITS = {"wqkv": "qkv", "w_gate_up": "gate_up", "wo": "heads_rows", "w_down": "ffn_rows"}


def _ranges(part, c, how: str) -> list[tuple[int, int]]:
    """The full matrix's output columns (column-parallel) or input rows (row-parallel) of this rank."""
    hd, H, Hkv, F = c.head_dim, c.n_heads, c.n_kv_heads, c.ffn_dim
    q0, q1 = part.q_heads[0], part.q_heads[-1] + 1
    k0, k1 = part.kv_heads[0], part.kv_heads[-1] + 1
    f0, f1 = part.ffn
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
    if how in ("qkv", "gate_up"):        # output columns = rows of the stored matrix: dequantize only those
        rows = np.concatenate([q.dequantize(r0=a, r1=b) for a, b in ranges])
        return ColumnParallelLinear(rows.T, idx, full_shape, lean.act)
    full = q.dequantize()                # (out, in): one matrix in float32 at a time
    return RowParallelLinear(np.ascontiguousarray(full[:, idx].T), idx, full_shape, comm)


def load_shard(gguf, part, comm, stage_first: bool):
    """(rank config, weights, model) of this rank: the layers of its stage, each split for its tensor rank;
    stage 0 (``stage_first``) also the embedding (quantized rows, read per token) and its LM-head columns.
    An MoE layer's routed experts are not `Linear`s: every rank of the stage keeps all of them (quantized, only
    the routed ones dequantized per step) and computes the whole routed output, so only attention is split."""
    from pyengine.models import architecture

    c, w, full = architecture(gguf).build(gguf, "lean")     # quantized rows: only this rank's get dequantized
    a, b = part.layers
    layers = []
    whole = len(part.q_heads) == c.n_heads and tuple(part.ffn) == (0, c.ffn_dim)   # pipeline only: no split
    for L in w.layers[a:b]:
        fields = {}
        for name, value in zip(L._fields, L):
            if hasattr(value, "q") and whole:
                fields[name] = DenseLinear.from_quant(value.q, value.act)
            elif hasattr(value, "q"):
                if name not in SPLITS:
                    raise ValueError(f"{c.arch}: no tensor-parallel split is defined for the matrix {name!r}")
                fields[name] = shard_linear(value, part, c, SPLITS[name], comm)
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
    model.kind_of = full.kind_of[a:b]                        # the kinds of its layers, by their global index
    return rc, w, model

