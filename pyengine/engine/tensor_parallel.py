"""S17: tensor parallelism — the linear layers' output columns (and the decode attention groups) split between
processes on one machine.

Why processes: NumPy hands a matmul to OpenBLAS, whose threads pack (copy) each weight matrix before
multiplying. At decode sizes (tens of rows) that packing is about half of a step. OpenBLAS also has an unpacked
"small matrix" kernel that streams the weights (AVX-512 builds, products of up to 1e6 multiply-adds), but it
runs on one thread. So rank 0 (this process) and ``tensor_parallel_size - 1`` worker processes each own a
slice of every weight's output columns, stored as (columns, in) rows, and multiply it in row blocks small
enough for that kernel, at the same time.

Megatron-style layouts split attention heads and sum row-parallel partial outputs; SmolLM2's 9 query / 3 KV
heads do not split in two, and on one machine outputs can simply meet in shared memory. So every weight here
is column-parallel: each rank reads the input x (all rows) from the shared arena and writes its own output
columns into it; for the gated MLP projection each rank holds the same range of gate and up columns and writes
SwiGLU of them. Norms and RoPE run on rank 0; decode attention is shared out by sequence groups, since the
arena (KV cache, activations) lives in shared memory that every rank maps.

Passes of at most ``SPLIT_ROWS`` tokens split (decode steps); longer ones (prefills) run on rank 0 alone over
the slices with OpenBLAS's own threads, the workers asleep. During a split pass rank 0's OpenBLAS runs one
thread (set through its C API), so that its idle helper thread does not compete with the workers for cores.
Each weight exists once: the ranks' slices live in page-aligned shared memory that every process maps. A
worker that dies is noticed at its next operation: rank 0 then computes everything itself (a warning,
nothing lost).

Protocol for a split pass: rank 0 writes one byte to each worker's stdin (wake), then per operation writes op,
argument and where x and out lie in the arena into shared control slots, then ``seq += 1``; each worker spins on
``seq``, does its share, then ``done[r] = seq``. An END op sends the workers back to their blocking read. Plain
stores stay in order on x86-64 (total store order), which is why only that architecture is accepted. CPython on
Linux only: the browser build has no processes.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import types
import warnings

import numpy as np

from pyengine import tuning
from pyengine.layers.activation import ACTIVATIONS, gated_activation
from pyengine.layers.linear import Linear

# ctrl slots: the operation, its argument (rows, or the layer), where x and out lie in the arena (byte offset,
# row stride in floats); ctrl[DONE + r] is worker r's last finished seq
SEQ, OP, ARG, X_OFF, X_STRIDE, O_OFF, O_STRIDE, GATED = range(8)
DONE = 9
OP_END, OP_GROUPS, OP_ATTN = -1, -2, -3    # besides products (op = weight index >= 0)
CTRL_SLOTS = 64
SPIN_CHECK = 1 << 16                       # spin iterations between liveness checks
ACT_CODES = (None, "silu", "gelu_tanh")    # the GATED ctrl slot: which activation a gated product applies
WAIT_TIMEOUT_S = 30.0                      # a product that takes this long means the worker is stuck


def matmul_row_blocks(w: np.ndarray, xt: np.ndarray, out_t: np.ndarray) -> np.ndarray:
    """out_t = w @ xt for (n, k) rows w, (k, rows) xt, (n, rows) out_t: in blocks of weight rows small enough for
    the unpacked kernel, or as one sgemm when even MIN_BLOCK_ROWS rows would exceed it (many input rows)."""
    n, k = w.shape
    rows = xt.shape[1]
    mnk, min_rows = tuning.SMALL_GEMM_MNK, tuning.MIN_BLOCK_ROWS
    if rows * k * min_rows > mnk:
        return np.matmul(w, xt, out=out_t)
    bm = mnk // (rows * k) // min_rows * min_rows
    for r in range(0, n, bm):
        np.matmul(w[r:r + bm], xt, out=out_t[r:r + bm])
    return out_t


def column_bounds(n: int, ranks: int) -> list[int]:
    """Split n output columns into ``ranks`` slices at multiples of 16, rank 0's larger by RANK0_EXTRA: the
    workers start each product a little after rank 0 (they see it posted, then read its arguments), so equal
    slices leave rank 0 waiting at every product."""
    weights = np.array([1 + tuning.RANK0_EXTRA] + [1.0] * (ranks - 1))
    cuts = np.cumsum(weights)[:-1] / weights.sum() * n
    unit = 16 if n >= 16 * ranks else 1
    return [0] + [int(round(c / unit)) * unit for c in cuts] + [n]


def rank_segments(n: int, ranks: int, gated: bool) -> list[list[tuple[int, int]]]:
    """Per rank, the output-column ranges its slice computes, in slice-row order. A gated weight ([gate | up],
    2F columns) gives each rank the same range of both halves, so that it can apply SwiGLU to its own part."""
    if not gated:
        b = column_bounds(n, ranks)
        return [[(b[r], b[r + 1])] for r in range(ranks)]
    f = n // 2
    b = column_bounds(f, ranks)
    return [[(b[r], b[r + 1]), (f + b[r], f + b[r + 1])] for r in range(ranks)]


def _copy_segments(out: np.ndarray, out_t: np.ndarray, segments) -> None:
    """Write (rows_of_slice, T) results into out's (T, columns) segments."""
    i = 0
    for c0, c1 in segments:
        np.copyto(out[:, c0:c1], out_t[i:i + c1 - c0].T)
        i += c1 - c0


def _rank_product(w: np.ndarray, segments, x: np.ndarray, out: np.ndarray, gated: str | None, xt_buf: np.ndarray,
                  out_buf: np.ndarray) -> None:
    """One rank's share of out = x @ W: x^T (contiguous, for the unpacked kernel) times its rows, written into
    its output columns; ``gated`` (an activation name): act(gate) * up of its [gate | up] rows written into its
    range of the F outputs."""
    (n, k), rows = w.shape, x.shape[0]
    xt, out_t = xt_buf[:k * rows].reshape(k, rows), out_buf[:n * rows].reshape(n, rows)
    np.copyto(xt, x.T)
    matmul_row_blocks(w, xt, out_t)
    if gated:                                            # rows: [gate | up] of this rank's range of F
        c0, c1 = segments[0]
        f = c1 - c0
        # the activation on contiguous rows (on the transposed views it is slower than the copies it saves), into
        # the x^T buffer, free once the product is done
        act = ACTIVATIONS[gated](out_t[:f], out=xt_buf[:f * rows].reshape(f, rows))
        act *= out_t[f:]
        np.copyto(out[:, c0:c1], act.T)
    else:
        _copy_segments(out, out_t, segments)


class ColumnParallelLinear(Linear):
    """A `Linear` ((in, out) shape) whose output columns are split over the group's ranks: ``slices[r]`` holds
    rank r's (columns, in) rows, in shared memory, for the output columns ``segments[r]`` (see `rank_segments`)."""

    def __init__(self, group: "TensorParallelGroup", op: int, shape: tuple[int, int], segments: list,
                 slices: list[np.ndarray], act: str | None = None):
        self.group, self.op, self.shape, self.act = group, op, shape, act
        self.segments = segments
        self.slices = slices
        self.nbytes = sum(sl.nbytes for sl in slices)

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty((x.shape[0], self.shape[1]), np.float32) if out is None else out
        if self.group.run(self, x, out):
            return out
        # every slice here: outside a split pass, without workers, or x / out outside the arena
        for sl, segments in zip(self.slices, self.segments):
            i = 0
            for c0, c1 in segments:
                np.matmul(x, sl[i:i + c1 - c0].T, out=out[:, c0:c1])
                i += c1 - c0
        return out

    def gated(self, x: np.ndarray, out: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
        """out = act(gate) * up, each rank gating its own columns in a split pass; else multiply, then gate."""
        if self.group.run(self, x, out, gated=self.act):
            return out
        return gated_activation(self.matmul(x, scratch), self.act, out=out)

    def dense(self) -> np.ndarray:
        full = np.empty(self.shape, np.float32)
        for sl, segments in zip(self.slices, self.segments):
            i = 0
            for c0, c1 in segments:
                full[:, c0:c1] = sl[i:i + c1 - c0].T
                i += c1 - c0
        return full

    def columns(self, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out[t] = W[:, idx[t]] (the tied embedding's rows are the head's columns)."""
        idx = np.asarray(idx, dtype=np.int64)
        for sl, ((a, b),) in zip(self.slices, self.segments):          # the head: one range per rank
            sel = (idx >= a) & (idx < b)
            if sel.any():
                out[sel] = sl[idx[sel] - a]
        return out


class WorkerLost(RuntimeError):
    """A worker exited or stopped answering."""


class TensorParallelGroup:
    """Rank 0's side: the shared memory (weights, arena, I/O), the worker processes, the split weights.

    ``weights``: resident `models.base.Weights`; every matrix (`Weights.linears`) is replaced in place by a
    `ColumnParallelLinear`. ``arena_specs``: the runner's arena, created here in shared memory (``.arena``).
    ``split_rows``: passes of at most this many tokens split (the workers' buffers hold that many rows)."""

    def __init__(self, weights, size: int, arena_specs, num_blocks: int, block_size: int, max_model_len: int,
                 split_rows: int | None = None, attn_scale: float | None = None):
        from pyengine.arena import Arena, plan_nbytes

        if not isinstance(size, (int, np.integer)) or size < 2:
            raise ValueError(f"tensor_parallel_size must be an integer >= 2 here, got {size!r}")
        if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
            raise ValueError(f"tensor parallelism runs on Linux x86-64 (worker processes, x86-64 store "
                             f"ordering); this is {sys.platform} {platform.machine()}")
        if weights.mode != "resident":
            raise ValueError("tensor parallelism needs weights_mode='resident' (lean weights are dequantized "
                             "per layer on rank 0)")
        self._blas = openblas_threads()
        if self._blas is None:
            raise ValueError("tensor parallelism needs NumPy's OpenBLAS (rank 0 sets its thread count per pass)")
        c = weights.config
        attn_scale = c.head_dim ** -0.5 if attn_scale is None else attn_scale
        self.size = int(size)
        self.k_max = max(lin.shape[0] for _, lin in weights.linears())
        self.split_rows = int(tuning.SPLIT_ROWS if split_rows is None else split_rows)
        self.active = False
        self.disabled_reason: str | None = None
        self._fds, self.procs = [], []
        self._saved_threads = None
        self._theirs: list = []                               # decode groups given to the workers this pass
        self._block_size = int(block_size)

        # every weight, as (out, in) rows
        mats = [(where, lin.dense().T, lin.act) for where, lin in weights.linears()]
        segments = [rank_segments(m.shape[0], self.size, act is not None) for _, m, act in mats]
        rows = [[sum(c1 - c0 for c0, c1 in seg) for seg in per_rank] for per_rank in segments]
        # per rank: [(byte offset, (rows, in))] in one page-aligned buffer. Separate NumPy allocations start
        # 16 bytes past a page, and the unpacked kernel's loads then straddle cache lines: 1.4x slower.
        layouts = [[] for _ in range(self.size)]
        ends = [0] * self.size
        for (_, m, _), n in zip(mats, rows):
            for r in range(self.size):
                layouts[r].append((ends[r], (n[r], m.shape[1])))
                ends[r] += -(-n[r] * m.shape[1] * 4 // 64) * 64
        out_floats = max(max(n) for n in rows) * self.split_rows
        # decode groups handed to the workers: per sequence its row, length and block table (+ a header)
        self.meta_ints = 16 + self.split_rows * (6 + -(-int(max_model_len) // self._block_size))
        try:
            weight_mem = [self._shared(e, f"weights{r}") for r, e in enumerate(ends)]     # rank 0's too
            io = self._shared(8 * (CTRL_SLOTS + self.meta_ints), "io")
            self.ctrl, self.meta = _io_views(io[1], self.meta_ints)
            # each rank transposes x and computes its columns in private buffers, then writes into the arena
            self.local_xt = np.empty(self.k_max * self.split_rows, np.float32)
            self.local_out = np.empty(out_floats, np.float32)
            arena_mem = self._shared(plan_nbytes(arena_specs), "arena")
            self.arena = Arena.from_specs(arena_specs, buffer=arena_mem[1])
            self._arena_base = self.arena.buffer.__array_interface__["data"][0]

            # split every weight: each rank's rows into its memory
            self.linears, by_where = [], {}
            for op, (where, m, act) in enumerate(mats):
                slices = []
                for r in range(self.size):
                    off, shape = layouts[r][op]
                    sl = np.ndarray(shape, np.float32, weight_mem[r][1], off)
                    np.concatenate([m[c0:c1] for c0, c1 in segments[op][r]], out=sl)
                    slices.append(sl)
                lin = ColumnParallelLinear(self, op, (m.shape[1], m.shape[0]), segments[op], slices, act)
                self.linears.append(lin)
                by_where[where] = lin
            del mats
            weights.map_linears(lambda where, _: by_where[where])

            # the workers: fresh interpreters with one BLAS thread each (set before their NumPy loads)
            env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
            for r in range(1, self.size):
                spec = {"rank": r, "weights": weight_mem[r][0], "layout": layouts[r], "io": io[0],
                        "segments": [seg[r] for seg in segments], "k_max": self.k_max, "split_rows": self.split_rows,
                        "out_floats": out_floats, "meta_ints": self.meta_ints, "arena": arena_mem[0],
                        "arena_specs": [(a.name, list(a.shape), a.dtype.str) for a in arena_specs],
                        "kv": [c.n_layers, int(num_blocks), self._block_size, c.n_kv_heads, c.head_dim],
                        "n_heads": c.n_heads, "scale": float(attn_scale)}
                p = subprocess.Popen([sys.executable, "-m", "pyengine.engine.tensor_parallel"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                     pass_fds=[fd for fd, _ in (weight_mem[r][0], io[0], arena_mem[0])])
                self.procs.append(p)
                p.stdin.write((json.dumps(spec) + "\n").encode())
                p.stdin.flush()
            for p in self.procs:                                  # each says "ready" once it has mapped
                line = p.stdout.readline()
                if line.strip() != b"ready":
                    p.wait(timeout=10)
                    raise RuntimeError(f"tensor-parallel worker failed to start: "
                                       f"{p.stderr.read().decode(errors='replace')[-2000:]}")
        except BaseException:
            self.close()
            raise

    def _shared(self, nbytes: int, name: str):
        """((fd, size), buffer): anonymous shared memory (memfd) the workers inherit by descriptor. It is freed
        when the last mapping goes: no name to clean up after a crash."""
        import mmap
        size = max(int(nbytes), 1)
        fd = os.memfd_create(f"pyengine-tp-{name}")
        self._fds.append(fd)
        os.ftruncate(fd, size)
        return (fd, size), mmap.mmap(fd, size)

    # --- per forward pass ------------------------------------------------------------------------
    def begin(self, rows: int) -> bool:
        """Wake the workers for a forward pass of ``rows`` tokens if it splits (see SPLIT_ROWS)."""
        if self.disabled_reason is not None or rows > self.split_rows:
            return False
        try:
            for p in self.procs:
                p.stdin.write(b"w")
                p.stdin.flush()
        except OSError as e:
            self.disable(f"worker pipe closed ({e})")
            return False
        get, set_ = self._blas
        self._saved_threads = get()
        set_(1)
        self.active = True
        return True

    def end(self) -> None:
        if not self.active:
            return
        self.active = False
        self._blas[1](self._saved_threads)
        try:
            self._post(OP_END, 0)
            self._wait()
        except WorkerLost as e:
            self.disable(str(e))

    def run(self, lin: ColumnParallelLinear, x: np.ndarray, out: np.ndarray, gated: str | None = None) -> bool:
        """out = x @ W (or, ``gated``, act(gate) * up) with every rank computing its columns, reading x from and
        writing out into the shared arena. False (nothing done) outside a split pass, for more rows than the
        workers' buffers hold, or if x or out is not an arena view: rank 0 then does it alone."""
        if not self.active or x.shape[0] > self.split_rows:
            return False
        xs, os_ = self._in_arena(x), self._in_arena(out)
        if xs is None or os_ is None:
            return False
        rows, k = x.shape
        self.ctrl[X_OFF:GATED + 1] = xs + os_ + (ACT_CODES.index(gated),)
        self._post(lin.op, rows)
        _rank_product(lin.slices[0], lin.segments[0], x, out, gated, self.local_xt, self.local_out)
        try:
            self._wait()
        except WorkerLost as e:            # redo alone; the group is off from now on
            self.disable(str(e))
            return False
        return True

    def _in_arena(self, a: np.ndarray) -> tuple[int, int] | None:
        """(byte offset, row stride in floats) of a 2-D float32 arena view with contiguous rows."""
        if a.ndim != 2 or a.dtype != np.float32 or a.strides[1] != 4 or a.strides[0] % 4:
            return None
        off = a.__array_interface__["data"][0] - self._arena_base
        if off < 0 or off + a.strides[0] * (a.shape[0] - 1) + 4 * a.shape[1] > self.arena.buffer.nbytes:
            return None
        return off, a.strides[0] // 4

    def share_decode_groups(self, groups: list, rows: int) -> list:
        """Give the workers some of this pass's decode groups (balanced by padded context slots); returns rank
        0's. ``rows``: the pass's token count (the workers' views of q and the attention output)."""
        self._theirs = []
        if not self.active or len(groups) < 2:
            return groups
        load = [0] * self.size
        share = [[] for _ in range(self.size)]
        for g in sorted(groups, key=lambda g: -g.blocks.size):
            r = load.index(min(load))
            share[r].append(g)
            load[r] += g.blocks.size
        pos = 1
        self.meta[0] = self.size - 1
        for r in range(1, self.size):
            pos = _pack_groups(self.meta, pos, share[r])
        try:
            self._post(OP_GROUPS, rows)
            self._wait()
        except WorkerLost as e:
            self.disable(str(e))
            return groups
        self._theirs = [g for r in range(1, self.size) for g in share[r]]
        return share[0]

    def attention_begin(self, layer: int) -> None:
        """The workers start on their decode groups of ``layer`` (q and K/V of this layer are in place)."""
        if self.active and self._theirs:
            self._post(OP_ATTN, layer)

    def attention_end(self) -> list:
        """Wait for the workers' attention; returns the groups rank 0 must still do (all theirs if one died)."""
        if not self._theirs:
            return []
        if self.active:
            try:
                self._wait()
                return []
            except WorkerLost as e:
                self.disable(str(e))
        theirs, self._theirs = self._theirs, []
        return theirs

    def _post(self, op: int, arg: int) -> None:
        self.ctrl[OP] = op
        self.ctrl[ARG] = arg
        self.ctrl[SEQ] += 1                  # last: the workers act on seq (stores stay in order on x86-64)

    def _wait(self) -> None:
        seq = self.ctrl[SEQ]
        done = self.ctrl[DONE:DONE + self.size - 1]
        spins, t0 = 0, None
        while (done != seq).any():
            spins += 1
            if spins % SPIN_CHECK == 0:
                t0 = t0 or time.monotonic()
                for p in self.procs:
                    if p.poll() is not None:
                        raise WorkerLost(f"tensor-parallel worker exited with code {p.returncode}: "
                                         f"{p.stderr.read().decode(errors='replace')[-1000:]}")
                if time.monotonic() - t0 > WAIT_TIMEOUT_S:
                    raise WorkerLost(f"tensor-parallel worker did not answer in {WAIT_TIMEOUT_S:.0f} s")

    def disable(self, reason: str) -> None:
        """Stop the workers; rank 0 computes everything from now on (the shared memory stays mapped)."""
        if self.disabled_reason is None:
            warnings.warn(f"tensor parallelism disabled: {reason}", RuntimeWarning, stacklevel=3)
            self.disabled_reason = reason
        if self.active:
            self.active = False
            self._blas[1](self._saved_threads)
        self._stop_workers()

    # --- lifetime ----------------------------------------------------------------------------------
    def _stop_workers(self) -> None:
        for p in self.procs:
            try:
                p.stdin.close()              # EOF: the worker returns from its blocking read and exits
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
            p.stderr.close()
        self.procs = []

    def close(self) -> None:
        """Stop the workers. The shared memory is freed with its last view (the runner's arena, the weights)."""
        if self.disabled_reason is None:
            self.disabled_reason = "closed"
        self.active = False
        self._stop_workers()
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _pack_groups(meta: np.ndarray, pos: int, groups: list) -> int:
    """Write query groups at meta[pos:]: count, then per group G, nb, start (-1: gathered), q_len, rows, context
    lengths, blocks. Returns the next position. (Shared groups come from single-kind models: no window.)"""
    meta[pos] = len(groups)
    pos += 1
    for g in groups:
        G, nb = g.blocks.shape
        rows = np.arange(g.rows.start, g.rows.stop) if isinstance(g.rows, slice) else g.rows
        meta[pos:pos + 4] = (G, nb, -1 if g.start is None else g.start, g.q_len)
        pos += 4
        for part in (rows, g.lens, g.blocks.reshape(-1)):
            meta[pos:pos + part.size] = part
            pos += part.size
    return pos


def _unpack_groups(meta: np.ndarray, pos: int, block_size: int) -> tuple[list, int]:
    from pyengine.layers.paged_attention import QueryGroup, group_mask
    groups = []
    n = int(meta[pos])
    pos += 1
    for _ in range(n):
        G, nb, start, q_len = (int(v) for v in meta[pos:pos + 4])
        pos += 4
        rows, lens = meta[pos:pos + G * q_len].copy(), meta[pos + G * q_len:pos + G * q_len + G].copy()
        pos += G * q_len + G
        blocks = meta[pos:pos + G * nb].reshape(G, nb).copy()
        pos += G * nb
        consecutive = bool(np.all(np.diff(rows) == 1))
        groups.append(QueryGroup(slice(int(rows[0]), int(rows[-1]) + 1) if consecutive else rows, q_len, blocks,
                                 lens, group_mask(lens, np.zeros(G, np.int64), q_len, nb * block_size, None),
                                 None if start < 0 else start))
    return groups, pos


def openblas_threads():
    """(get, set) of the thread count of the OpenBLAS that NumPy loaded (found in /proc/self/maps), or None."""
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                try:
                    get, set_ = (getattr(lib, f"{prefix}_get_num_threads{suffix}"),
                                 getattr(lib, f"{prefix}_set_num_threads{suffix}"))
                except AttributeError:
                    continue
                get.restype, set_.argtypes = ctypes.c_int, [ctypes.c_int]
                return get, set_
    return None


def _io_views(buf, meta_ints: int):
    """ctrl (int64 slots) and the decode-group metadata (int64)."""
    return (np.ndarray((CTRL_SLOTS,), np.int64, buf, 0),
            np.ndarray((meta_ints,), np.int64, buf, 8 * CTRL_SLOTS))


def _attach(fd_size) -> "mmap.mmap":
    """Map rank 0's memory; populated now, so that no step pays the page faults (the arena is ~650 MB)."""
    import mmap
    fd, size = fd_size
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


def worker_main() -> int:
    """A worker rank: map the segments, then serve one forward pass per wake byte until stdin closes."""
    from pyengine.arena import Arena, spec as arena_spec
    from pyengine.engine.kv_cache import PagedKVCache
    from pyengine.layers.paged_attention import group_attention

    stdin = sys.stdin.buffer
    spec = json.loads(stdin.readline())
    r = spec["rank"]
    wmem, io, amem = _attach(spec["weights"]), _attach(spec["io"]), _attach(spec["arena"])
    weights = [np.ndarray(tuple(shape), np.float32, wmem, off) for off, shape in spec["layout"]]
    ctrl, meta = _io_views(io, spec["meta_ints"])
    segments = spec["segments"]                          # each product's output columns on this rank
    xt_buf = np.empty(spec["k_max"] * spec["split_rows"], np.float32)
    out_buf = np.empty(spec["out_floats"], np.float32)
    specs = [arena_spec(name, shape, dtype) for name, shape, dtype in spec["arena_specs"]]
    arena = Arena.from_specs(specs, buffer=amem, zero=False)          # rank 0's arena, same views
    n_layers, num_blocks, block_size, n_kv, hd = spec["kv"]
    kv = PagedKVCache(arena, n_layers, num_blocks, block_size, n_kv, hd)
    # gather scratch of this rank's own (rank 0 uses the arena's at the same time)
    scratch = types.SimpleNamespace(**{n: np.zeros_like(arena[f"attn.{n}"]) for n in ("k_batch", "v_batch", "scores")})
    H, scale = spec["n_heads"], spec["scale"]
    groups, tokens = [], 0
    parent = os.getppid()
    # read before saying ready: rank 0 may post the first operation as soon as it reads "ready"
    seen = int(ctrl[SEQ])
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while stdin.read(1):                                 # b"" = rank 0 closed the pipe (or died)
        while True:
            spins = 0
            while ctrl[SEQ] == seen:
                spins += 1
                if spins % SPIN_CHECK == 0 and os.getppid() != parent:
                    return 0
            seen = int(ctrl[SEQ])
            op, arg = int(ctrl[OP]), int(ctrl[ARG])
            if op == OP_END:
                ctrl[DONE + r - 1] = seen
                break
            if op == OP_GROUPS:                          # this pass's groups: skip the ranks before this one
                tokens, pos = arg, 1
                for _ in range(r):
                    groups, pos = _unpack_groups(meta, pos, block_size)
            elif op == OP_ATTN:
                q_rot, attn = arena["act.qk_rot"][:tokens, :H], arena["act.attn"][:tokens]
                for g in groups:
                    group_attention(arg, q_rot, kv, g, attn, scratch, scale)
            else:
                w, rows = weights[op], arg
                x_off, x_stride, o_off, o_stride, gated = (int(v) for v in ctrl[X_OFF:GATED + 1])
                x = np.ndarray((rows, w.shape[1]), np.float32, amem, x_off, (4 * x_stride, 4))
                # out spans up to the last column this rank writes (gated: its range of the F outputs)
                width = segments[op][0][1] if gated else max(c1 for _, c1 in segments[op])
                out = np.ndarray((rows, width), np.float32, amem, o_off, (4 * o_stride, 4))
                _rank_product(w, segments[op], x, out, ACT_CODES[gated], xt_buf, out_buf)
            ctrl[DONE + r - 1] = seen
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
