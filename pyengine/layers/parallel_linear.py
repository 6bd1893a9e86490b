"""S17: Megatron's tensor-parallel linear layers, behind the `Linear` protocol (NumPy only).

Split a sub-layer's first matrix by output columns and its second by input rows, and the sub-layer needs one
sum across ranks, at its end:

    attention:  [Q|K|V] columns of this rank's heads -> its heads' attention -> Wo rows of its heads -> Allreduce
    MLP:        [gate|up] columns of its FFN range   -> act(gate) * up       -> Wdown rows of that range -> Allreduce

  ColumnParallelLinear   a slice of the output columns: an ordinary product, no communication
  RowParallelLinear      a slice of the input rows: the product is a partial sum, summed over the ranks in place
  VocabParallelHead      the LM head's vocabulary split by columns: each rank computes its logits columns and
                         rank 0 gathers them (the LM head is the largest matrix: splitting it splits its time)

The communicator is whatever the runtime gives (pyengine/parallel/mpi.py wraps MPI): an object with
``allreduce(buf)`` (in-place sum over the tensor ranks) and ``gather_columns(part, out, bounds)`` (rank 0's
``out[:, bounds[r]:bounds[r+1]] = part of rank r``). These layers import nothing but NumPy.
"""
from __future__ import annotations

import numpy as np

from pyengine.layers.linear import BlockedLinear, DenseLinear


class ColumnParallelLinear(DenseLinear):
    """Output columns ``columns`` (index array into the full matrix's columns) of a (in, out) matrix; its
    product needs no communication (each rank keeps its columns: its heads, its FFN range)."""

    def __init__(self, w: np.ndarray, columns: np.ndarray, full_shape: tuple[int, int], act: str | None = None):
        super().__init__(w, act)
        self.columns, self.full_shape = columns, full_shape


class RowParallelLinear(DenseLinear):
    """Input rows ``rows`` of a (in, out) matrix: x holds the matching slice of the features (this rank's heads
    or FFN columns), so x @ w is this rank's partial sum of the full product; ``comm.allreduce`` adds the
    ranks' partial sums in place (every rank ends with the full output)."""

    def __init__(self, w: np.ndarray, rows: np.ndarray, full_shape: tuple[int, int], comm):
        super().__init__(w)
        self.rows, self.full_shape, self.comm = rows, full_shape, comm

    def matmul(self, x, out=None):
        out = super().matmul(x, out)
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
