"""S18: moving a prompt's KV cache between engines — one block per message, checked on receipt.

A block message carries every layer's K and V of one KV block (``PagedKVCache.k[:, b]`` and ``.v[:, b]``: the
bytes as stored, float32 / fp16 / q8_0 / q4_0 alike, so both sides must use the same ``kv_cache_dtype``) behind a
56-byte header:

    b"B" | 3 pad | crc32 of the data (uint32) | transfer id (int64) | block index in the prompt (int64) | 32-byte hash

The hash is the block's chained prefix-cache name (engine/block_manager.py ``hash_block``; zeros for the prompt's
last, partial block). The receiver checks both: the CRC says the bytes arrived as sent, the hash says the block
holds the tokens the receiver expects at that index (its own hash chain over the same prompt). A block that fails
either check is refused with `TransferError` and nothing is written.

A tensor-parallel instance holds each block sharded by KV head over its ranks; `KVBlocks` reads and writes whole
blocks (all KV heads in order) all the same: its rank 0 gathers the other ranks' heads before packing and
scatters a received block's heads to the ranks holding them. So the message, its CRC and its hash do not depend
on either side's tensor-parallel size (a prefill instance of 2 ranks may ship to a decode instance of 1).

Messages travel over a `Transport`: every message is one uint8 buffer whose first byte says its kind (``C``: a
pickled control dict, ``B``: a block), sent on one MPI tag, so messages from one rank arrive in the order sent
(MPI's non-overtaking rule). `MPITransport` is the real one (CPython + mpi4py); `LoopbackNet` connects engines in
one process the same way (tests, and the reading of the protocol without MPI).
"""
from __future__ import annotations

import pickle
import struct
import zlib
from collections import deque

import numpy as np

HEADER = struct.Struct("<c3xIqq32s")      # 56 bytes
NO_HASH = b"\0" * 32
TAG = 1900                                 # the one MPI tag of the disaggregation protocol


class TransferError(RuntimeError):
    """A KV block arrived damaged, out of place or for a prompt that does not match."""


class KVBlocks:
    """An instance's KV blocks whole — every layer's K and V with all KV heads in order — whoever holds them,
    read and written through the engine's executor (engine/executor.py ``read_blocks`` / ``write_blocks``).

    Alone (`LocalExecutor`) they are this process's `PagedKVCache` blocks. In a tensor-parallel instance each rank
    holds its KV heads (parallel/layout.py); its `MPIExecutor` (this process its rank 0) gathers the other ranks'
    heads of the blocks on a read (one order and one message per rank, however many blocks) and on a write keeps
    this rank's heads and sends the others theirs (not waited for). So a block message is the same bytes whatever
    the tensor-parallel sizes of the two sides."""

    def __init__(self, executor):
        self.executor = executor
        self.shape, self.dtype = executor.block_layout()    # one block's K: (L, bs, Hkv, row)
        self.nbytes = 2 * int(np.prod(self.shape)) * self.dtype.itemsize    # data bytes of a block message

    def read(self, blocks) -> np.ndarray:
        """(2, n, layers, block_size, KV heads, row): K and V of cache blocks ``blocks``."""
        return self.executor.read_blocks(blocks)

    def views(self, blocks) -> list[tuple[np.ndarray, np.ndarray]]:
        """(K, V) of each of cache blocks ``blocks``, each (layers, block_size, KV heads, row), to be packed at
        once: alone, views of the cache itself (no copy); in a TP instance, of one gather."""
        return self.executor.block_views(blocks)

    def write(self, blocks, data: np.ndarray) -> None:
        """Write ``data`` (as ``read`` returns it) into cache blocks ``blocks``."""
        self.executor.write_blocks(blocks, data)


def pack_data(k: np.ndarray, v: np.ndarray, xid: int, index: int, chain_hash: bytes | None) -> np.ndarray:
    """The message of one block's K and V (each (layers, block_size, KV heads, row)), the ``index``-th block of
    transfer ``xid``'s prompt."""
    buf = np.empty(HEADER.size + k.nbytes + v.nbytes, np.uint8)
    data = buf[HEADER.size:].view(k.dtype).reshape((2,) + k.shape)
    data[0], data[1] = k, v
    HEADER.pack_into(buf, 0, b"B", zlib.crc32(buf[HEADER.size:]), xid, index, chain_hash or NO_HASH)
    return buf


def block_header(buf: np.ndarray) -> tuple[int, int, bytes]:
    """(transfer id, block index, chain hash) of a block message, before any check."""
    if buf.size < HEADER.size or bytes(buf[:1]) != b"B":
        raise TransferError("not a KV block message")
    _, _, xid, index, h = HEADER.unpack_from(buf, 0)
    return xid, index, h


def block_nbytes(kv) -> int:
    """Data bytes of one block message of this process's `PagedKVCache` ``kv`` (K and V of every layer)."""
    L, _, bs, heads, row = kv.k.shape
    return 2 * L * bs * heads * row * kv.k.dtype.itemsize


def check_block(blocks: KVBlocks, buf: np.ndarray, expect_hash: bytes | None) -> np.ndarray:
    """Verify a block message (size, CRC, chain hash); its K and V (2, layers, block_size, KV heads, row)."""
    if buf.size != HEADER.size + blocks.nbytes:
        raise TransferError(f"KV block message of {buf.size} bytes, expected {HEADER.size + blocks.nbytes} "
                            "(do both sides use the same model and --kv-cache-dtype?)")
    _, crc, xid, index, h = HEADER.unpack_from(buf, 0)
    data = buf[HEADER.size:]
    if zlib.crc32(data) != crc:
        raise TransferError(f"KV block {index} of transfer {xid}: checksum mismatch (damaged in transit)")
    if h != (expect_hash or NO_HASH):
        raise TransferError(f"KV block {index} of transfer {xid}: its prefix hash is not the one of the "
                            "receiver's prompt at that block")
    return data.view(blocks.dtype).reshape((2,) + blocks.shape)


def control_message(msg: dict) -> np.ndarray:
    return np.frombuffer(b"C" + pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)


def parse_message(buf: np.ndarray):
    """("C", dict) or ("B", the block buffer)."""
    kind = bytes(buf[:1])
    if kind == b"C":
        return "C", pickle.loads(buf[1:].tobytes())
    if kind == b"B":
        return "B", buf
    raise TransferError(f"unknown message kind {kind!r}")


class MPITransport:
    """Point-to-point messages between the ranks of one MPI job (non-blocking sends kept until complete)."""

    def __init__(self, comm=None):
        from mpi4py import MPI                # lazy: CPython + the `parallel` extra only
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._sends: list[tuple[object, int, np.ndarray]] = []
        self._status = MPI.Status()

    def send(self, dest: int, msg: dict) -> None:
        self.send_buffer(dest, control_message(msg))

    def send_buffer(self, dest: int, buf: np.ndarray) -> None:
        self._sends.append((self.comm.Isend(buf, dest, TAG), dest, buf))

    def progress(self) -> None:
        """Retire completed sends (their buffers may then be reused); a send to a rank that failed (ULFM
        raises on it) is dropped: the router's liveness check fails that rank's requests."""
        if self._sends:
            self._sends = [s for s in self._sends if not self._done(s[0])]

    def _done(self, req) -> bool:
        try:
            return req.Test()
        except self.MPI.Exception:
            return True

    def _ack_failures(self) -> None:
        """ULFM (``mpiexec --with-ft ulfm``, parallel/launch.py): once a rank has failed, receives from any
        source raise until the failure is acknowledged; the dead rank itself is found by the router's
        liveness check (its pid), not here."""
        try:
            self.comm.Ack_failed()
        except (self.MPI.Exception, NotImplementedError, AttributeError):
            pass

    def pending(self, dest: int | None = None) -> int:
        """Sends not yet completed (to ``dest``, or to anyone)."""
        self.progress()
        return sum(1 for _, d, _ in self._sends if dest is None or d == dest)

    def recv(self):
        """(source rank, message buffer) of the next message that has arrived, or None."""
        st = self._status
        try:
            if not self.comm.Iprobe(self.MPI.ANY_SOURCE, TAG, st):
                return None
        except self.MPI.Exception:
            self._ack_failures()
            return None
        src, n = st.Get_source(), st.Get_count(self.MPI.BYTE)
        buf = np.empty(n, np.uint8)
        self.comm.Recv(buf, src, TAG)
        return src, buf


class LoopbackNet:
    """In-process stand-in for the MPI job: one inbox per rank, delivery in order, nothing ever pending."""

    def __init__(self, size: int):
        self.inbox = [deque() for _ in range(size)]
        self.dead: set[int] = set()           # ranks that stopped (tests): their mail is dropped

    def transport(self, rank: int) -> "LoopbackTransport":
        return LoopbackTransport(self, rank)


class LoopbackTransport:
    comm = None                  # no MPI communicator (`MPITransport.comm`): nothing to abort

    def __init__(self, net: LoopbackNet, rank: int):
        self.net, self.rank, self.size = net, rank, len(net.inbox)

    def send(self, dest: int, msg: dict) -> None:
        self.send_buffer(dest, control_message(msg))

    def send_buffer(self, dest: int, buf: np.ndarray) -> None:
        if dest not in self.net.dead and self.rank not in self.net.dead:
            self.net.inbox[dest].append((self.rank, np.array(buf, copy=True)))

    def progress(self) -> None:
        pass

    def pending(self, dest: int | None = None) -> int:
        return 0

    def recv(self):
        box = self.net.inbox[self.rank]
        return box.popleft() if box else None
