"""S17/S18: whole KV blocks of a tensor-parallel instance, gathered onto rank 0 and scattered from it (`KVShards`,
a part of `MPIGroup`: disaggregation's KV transfer, pyengine/disagg/kv_transfer.py `KVBlocks`). A rank's cache is
read and written only through its `KVBlockStore` surface (engine/executor.py: `PagedKVCache.block_data`,
``read_blocks``, ``write_blocks``).
"""
from __future__ import annotations

import numpy as np

from pyengine.parallel.wire import OP_KV_GATHER, OP_KV_SCATTER, TAG_KV, TAG_PLAN


class KVShards:
    # --- S18: whole KV blocks of a tensor-parallel instance ----------------------------------------------
    # Each tensor rank's cache holds its KV heads (part.kv_heads, contiguous; with more ranks than KV heads a head
    # is replicated). A disaggregated instance ships whole blocks (every KV head in order, the bytes as stored:
    # a head's row is float32 / fp16 / q8_0 / q4_0 blocks of its own, so head slices of any format are exact):
    # rank 0 gathers the others' heads of a block before packing it, and scatters a received block's heads to
    # the ranks holding them. Orders ride on TAG_PLAN like a step's, so a follower writes a block before it
    # runs any later step that reads it.
    def _kv_heads(self, r: int) -> tuple[int, int]:
        h = self.parts[r].kv_heads
        return h[0], h[-1] + 1

    def _kv_contrib(self, r: int) -> tuple[int, int]:
        """The heads rank ``r`` sends in a gather: its own, less those an earlier rank holds (replicas)."""
        h0, h1 = self._kv_heads(r)
        before = max((self._kv_heads(q)[1] for q in range(r)), default=0)
        return max(h0, before), h1

    def _kv_shard(self, kv, blocks: np.ndarray, h0: int, h1: int) -> np.ndarray:
        """(2, n, layers, block_size, h1 - h0, row) of this rank's cache: K and V of global heads h0..h1."""
        l0 = h0 - self._kv_heads(self.rank)[0]
        return kv.read_blocks(blocks, (l0, l0 + h1 - h0))

    def kv_gather(self, kv, blocks) -> np.ndarray:
        """Rank 0: (2, n, layers, block_size, all KV heads, row) — K and V of cache blocks ``blocks`` of ``kv``
        (this rank's `KVBlockStore`, engine/executor.py), every rank's heads put in place (one order and one
        message per contributing rank, however many blocks)."""
        ids = np.asarray(blocks, np.int64)
        out = kv.block_data(len(ids), self.n_kv_heads)
        if self.tp > 1:
            self._post(np.array([OP_KV_GATHER, len(ids), 0, 0, 0, 0, 0, 0], np.int64), ids, look=False)
            # each follower's heads land in place: an MPI subarray type of ``out`` (no copy after the receive)
            sizes = list(out.shape[:-1]) + [out.shape[-1] * out.itemsize]
            types, reqs = [], []
            for r in range(1, self.tp):
                c0, c1 = self._kv_contrib(r)
                if c1 > c0:
                    t = self.MPI.BYTE.Create_subarray(sizes, sizes[:4] + [c1 - c0, sizes[5]], [0] * 4 + [c0, 0])
                    types.append(t.Commit())
                    reqs.append(self.world.Irecv([out.reshape(-1).view(np.uint8), 1, t], r, TAG_KV))
        h0, h1 = self._kv_heads(0)            # meanwhile this rank's own heads
        kv.read_blocks(ids, out=out[:, :, :, :, h0:h1])
        if self.tp > 1:
            try:
                self._wait(reqs, "KV gather")
            finally:
                for t in types:
                    t.Free()
        return out

    def kv_scatter(self, kv, blocks, data: np.ndarray) -> None:
        """Rank 0: write ``data`` (2, n, layers, block_size, all KV heads, row) into cache blocks ``blocks`` of
        every rank, each its own heads; the others' shards are sent and not waited for."""
        ids = np.asarray(blocks, np.int64)
        h0, h1 = self._kv_heads(0)
        kv.write_blocks(ids, data[:, :, :, :, h0:h1])
        if self.tp == 1:
            return
        self._post(np.array([OP_KV_SCATTER, len(ids), 0, 0, 0, 0, 0, 0], np.int64), ids, look=False)
        try:
            for r in range(1, self.tp):
                c0, c1 = self._kv_heads(r)
                shard = np.ascontiguousarray(data[:, :, :, :, c0:c1])
                self._sending.append((self.world.Isend([shard.reshape(-1).view(np.uint8), self.MPI.BYTE], r,
                                                       TAG_KV + 1), shard))
        except self.MPI.Exception as exc:
            self._lost(f"failed (KV scatter: {exc.Get_error_string()})")

    def _kv_follow(self, runner, op: int, n: int) -> None:
        """A follower's part of a kv_gather / kv_scatter order."""
        kv = runner.kv_cache
        ids = self._recv(n, TAG_PLAN + 1)
        if op == OP_KV_GATHER:
            c0, c1 = self._kv_contrib(self.rank)
            if c1 > c0:
                shard = self._kv_shard(kv, ids, c0, c1)
                self._wait(self.world.Isend([shard.reshape(-1).view(np.uint8), self.MPI.BYTE], 0, TAG_KV),
                           "KV gather")
            return
        h0, h1 = self._kv_heads(self.rank)
        shard = kv.block_data(n, h1 - h0)
        self._wait(self.world.Irecv([shard.reshape(-1).view(np.uint8), self.MPI.BYTE], 0, TAG_KV + 1), "KV scatter")
        kv.write_blocks(ids, shard)
