"""S17: Megatron's tensor-parallel linear layers, behind the `Linear` protocol (NumPy only).

Split a sub-layer's first matrix by output columns and its second by input rows, and the sub-layer needs one
sum across ranks, at its end:

    attention:  [Q|K|V] columns of this rank's heads -> its heads' attention -> Wo rows of its heads -> Allreduce
    MLP:        [gate|up] columns of its FFN range   -> act(gate) * up       -> Wdown rows of that range -> Allreduce

  ColumnParallelLinear   a slice of the output columns: an ordinary product, no communication
  RowParallelLinear      a slice of the input rows: the product is a partial sum, summed over the ranks in place
  VocabParallelHead      the LM head's vocabulary split by columns: each rank computes its logits columns and
                         rank 0 gathers them (the LM head is the largest matrix: splitting it splits its time)
  ExpertSlice            an MoE layer's experts e0..e1 (expert parallelism): moe_forward computes the routed
                         pairs of these experts only and ends with one Allreduce (the shared expert's share in it)
  SplitNorm              an RMSNorm whose columns are spread over the ranks (OLMoE's q/k norms over all heads):
                         each rank sums its squares, one Allreduce of two numbers per token, then its columns

The communicator is whatever the runtime gives (pyengine/parallel/mpi.py wraps MPI): an object with
``allreduce(buf)`` (in-place sum over the tensor ranks) and ``gather_columns(part, out, bounds)`` (rank 0's
``out[:, bounds[r]:bounds[r+1]] = part of rank r``). These layers import nothing but NumPy.
"""
from __future__ import annotations

import numpy as np

from pyengine.layers.linear import BlockedLinear, DenseLinear
from pyengine.layers.moe import Experts


class ColumnParallelLinear(DenseLinear):
    """Output columns ``columns`` (index array into the full matrix's columns) of a (in, out) matrix; its
    product needs no communication (each rank keeps its columns: its heads, its FFN range)."""

    def __init__(self, w: np.ndarray, columns: np.ndarray, full_shape: tuple[int, int], act: str | None = None):
        super().__init__(w, act)
        self.columns, self.full_shape = columns, full_shape


class RowParallelLinear(DenseLinear):
    """Input rows ``rows`` of a (in, out) matrix: x holds the matching slice of the features (this rank's heads
    or FFN columns), so x @ w is this rank's partial sum of the full product; ``comm.allreduce`` adds the
    ranks' partial sums in place (every rank ends with the full output). ``comm`` None: the partial sum is
    left to a later Allreduce (a shared expert's, summed with the routed experts')."""

    def __init__(self, w: np.ndarray, rows: np.ndarray, full_shape: tuple[int, int], comm):
        super().__init__(w)
        self.rows, self.full_shape, self.comm = rows, full_shape, comm

    def matmul(self, x, out=None):
        out = super().matmul(x, out)
        if self.comm is not None:
            self.comm.allreduce(out)
        return out


class VocabParallelHead(BlockedLinear):
    """The LM head's columns bounds[r]..bounds[r+1] on tensor rank r; ``matmul`` returns the whole (rows, V)
    logits on rank 0 (gathered), this rank's columns only elsewhere."""

    def __init__(self, out_in_rows: np.ndarray, bounds: list[int], rank: int, comm):
        super().__init__(out_in_rows)
        self.bounds, self.rank, self.comm = bounds, rank, comm
        self.full_shape = (self.shape[0], bounds[-1])

    def matmul(self, x, out=None):
        v0, v1 = self.bounds[self.rank], self.bounds[self.rank + 1]
        rows = x.shape[0]
        if out is None or out.shape[-1] != self.full_shape[1]:
            out = np.empty((rows, self.full_shape[1]), np.float32)
        part = super().matmul(x, out[:, v0:v1])
        self.comm.gather_columns(part, out, self.bounds)
        return out

    def columns(self, x) -> tuple[int, np.ndarray]:
        """(first vocabulary id, this rank's columns of the logits of rows ``x``), not gathered (S19: a rank
        reduces its columns of prompt logprobs before anything goes over the wire)."""
        return self.bounds[self.rank], super().matmul(x)


class ExpertSlice(Experts):
    """Experts e0..e1-1 of a layer (expert parallelism), dequantized once from the lean (quantized) ``Experts``
    of the whole layer: E / N of the experts' memory on each of N ranks. ``held`` tells moe_forward which
    experts' rows it computes; ``comm.allreduce`` sums the ranks' outputs at the layer's end."""

    def __init__(self, lean: Experts, e0: int, e1: int, comm):
        (g, tg), (u, tu), (dn, td) = lean.q
        super().__init__((g[e0:e1], tg), (u[e0:e1], tu), (dn[e0:e1], td), lean.d, lean.f, "resident", lean.act)
        self.held, self.comm, self.n_experts = (e0, e1), comm, lean.n_experts

    def weights(self, e: int):
        return super().weights(e - self.held[0])

    def ffn(self, e: int, x, out, gate_up, h):
        return super().ffn(e - self.held[0], x, out, gate_up, h)


class SplitNorm:
    """RMSNorm of the queries and of the keys over all heads when each rank holds some heads' columns: the
    mean of squares needs every column, so each rank sums its own, one Allreduce adds them (two floats per
    token), and each rank normalises its columns. A KV head replicated on several ranks counts ``k_share``
    (1 / replicas) from each."""

    def __init__(self, q_cols: int, k_cols: int, k_share: float, comm):
        self.q_cols, self.k_cols, self.k_share, self.comm = q_cols, k_cols, np.float32(k_share), comm

    def __call__(self, q, k, wq, wk, eps: float, out_q, out_k) -> None:
        ss = np.empty((q.shape[0], 2), np.float32)
        np.einsum("tc,tc->t", q, q, out=ss[:, 0])
        np.einsum("tc,tc->t", k, k, out=ss[:, 1])
        ss[:, 1] *= self.k_share
        self.comm.allreduce(ss)
        ss /= np.array([self.q_cols, self.k_cols], np.float32)
        ss += np.float32(eps)
        np.sqrt(ss, out=ss)
        np.divide(q, ss[:, :1], out=out_q)
        out_q *= wq
        np.divide(k, ss[:, 1:], out=out_k)
        out_k *= wk
