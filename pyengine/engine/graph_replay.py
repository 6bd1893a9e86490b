"""S13: a captured step, replayed (CUDA graphs' idea in NumPy).

At small batch the host, not the arithmetic, sets the pace: a decode step of a d=64 model is hundreds of
Python-level calls (views cut, shapes checked, scalars converted, scratch allocated, the plan turned into
arguments) around NumPy kernels that each take a microsecond. The course's answer, as vLLM's CUDA graphs:

  capture   the first step of a shape bucket runs through ``StepCapture``: the model's fast path calls it for
            every operation (models/base.py ``EagerOps``), and it records each one as a ``functools.partial``
            with every argument already bound -- buffer views of the arena, scratch slices, the step's index
            arrays -- then runs it. Norms, RoPE, activations, matrix products, decode-group attention, the
            embedding lookup and KV writes are recorded as their individual ufunc / matmul / assignment calls
            (``rms_norm_ops``, ``apply_rope_ops`` (3 calls over full-width RoPE rows, a power-of-two
            attention scale folded into the queries' rows: exact), ``gated_activation_ops``,
            ``Linear.matmul_ops``, ``group_attention_ops`` below, ``Embedding.ops``, ``write_ops``); the rest
            (quantized KV writes, stored-format attention, gathers, an MoE layer) as one call each.
  replay    later steps with the same bucket copy their per-step data (token ids, positions, cache slots,
            logits rows, each query group's block ids and mask) into the arrays the calls were bound to and
            run the list: ``for op in step.flat: op()``. When the batch alone names its bucket (``batch_key``:
            its query lengths and logits rows), ``bind_batch`` derives just those arrays from the block tables
            (the runner's plan is skipped); otherwise the plan is made and ``bind`` copies from it. Either way
            a bound prologue then gathers the step's RoPE rows once for all layers.
  re-bind   a group's padded context grows by a block every block_size tokens (and a lone sequence's blocks
            may stop being one zero-copy run): then only that group's attention calls are rebuilt in every
            layer (``CapturedStep.regroup``, ``BoundAttention.build``), not the whole step.

A bucket (``step_key``) is what fixes the step's other shapes: its tokens T, its logits rows, and per kind of
layer each query group's rows and query length; ``batch_key`` names it from the batch's sorted query lengths,
and ``bind_batch`` puts a batch whose sequences come in another order into the captured order. Shapes are
exact, not padded up: a padded row would change BLAS's kernel choice (matvec vs sgemm, the row-loop cut-offs
of layers/linear.py), and padded keys the softmax sum's pairwise order, so a padded step could not be
bit-identical to the plain one; and NumPy has no launch cost that a padded bucket would amortise (a capture
costs about one plain step). Steps with a long query (a prompt or chunk) stay plain: their attention runs tile
by tile anyway, and their arithmetic dwarfs the calls.
The replayed step computes exactly what the plain step computes (the same ufuncs in the same order on the
same arrays; tests/test_graph_replay.py checks np.array_equal on the logits), and needs no threads or C code:
it runs in Pyodide as well (tests/test_pyodide_graph_replay.py).
"""
from __future__ import annotations

import math
import operator
from collections import OrderedDict
from functools import partial

import numpy as np

from pyengine import tuning
from pyengine.engine.kv_cache import PagedKVCache, slot_mapping
from pyengine.engine.step_plan import KindPlan, StepPlan, group_arrays, read_span
from pyengine.layers.activation import gated_activation_ops
from pyengine.layers.linear import Embedding
from pyengine.layers.norm import rms_norm_ops
from pyengine.layers.paged_attention import AttentionPlan, QueryGroup, group_attention
from pyengine.layers.rotary import apply_rope_ops, rope_rows_ops
from pyengine.models.base import EagerOps


def step_key(plan: StepPlan, max_logits: int) -> tuple | None:
    """The shape bucket of a planned step, or None if it stays plain (a long query, or more logits rows than
    the arena plans for): the step's tokens, its logits rows, and per kind of layer each query group's rows and
    query length. A group's padded block count and zero-copy start are not part of it: they change every few
    tokens, so they are re-bound (``CapturedStep.regroup``). Tuning constants that choose call shapes are part
    of it (``bench tuning`` sweeps them in a running process)."""
    if len(plan.logits_indices) > max_logits or any(k.attention.runs for k in plan.kinds):
        return None
    groups = tuple(tuple((_rows_key(g.rows), g.q_len) for g in k.attention.groups) for k in plan.kinds)
    return (plan.num_tokens, len(plan.logits_indices), groups) + _tuning()


def batch_key(batch, max_logits: int) -> tuple | None:
    """The bucket of a (validated) batch from its lengths alone, without planning it: sequences with the same
    query length form one group (step_plan.query_groups) unless their padded contexts overflow a group's slots,
    which ``CapturedStep.bind_batch`` checks. Order-free: the sorted query lengths and the number of logits rows
    (``bind_batch`` puts the batch's sequences in the captured step's order). None if some query is empty or
    long."""
    ql = batch.query_lens
    if not ql or min(ql) < 1 or max(ql) > tuning.SHORT_QUERY_MAX or len(batch.logits_indices) > max_logits:
        return None
    return (tuple(sorted(ql)), len(batch.logits_indices)) + _tuning()


def _tuning() -> tuple:
    return (tuning.DECODE_SLOTS, tuning.LINEAR_ROW_LOOP_MAX, tuning.SMALL_GEMM_ROWS, tuning.SMALL_GEMM_CHUNK_MIN,
            tuning.REGROUP_MIN_ROWS,
            tuning.DECODE_KEY_CHUNK)


def _rows_key(rows) -> tuple:
    return (rows.start, rows.stop) if isinstance(rows, slice) else tuple(rows.tolist())


def _mask_shape(G: int, q_len: int, L: int, window) -> tuple:
    """The shape of layers/paged_attention.py group_mask's result."""
    return (G, 1, 1, L) if q_len == 1 and window is None else (G, 1, 1, q_len, L)


def _exact_scale(scale) -> bool:
    """A power of two (as float32): multiplying by it commutes exactly with rounding (normal values)."""
    return scale is not None and scale > 0 and math.frexp(scale)[0] == 0.5 and float(np.float32(scale)) == scale


class BoundAttention:
    """One query group's attention in one layer of a captured step: its bound calls (``group_attention_ops``),
    rebuilt by ``build`` when the group's padded block count or zero-copy start changes."""

    def __init__(self, step: "CapturedStep", kind: int, index: int, layer: int, q, kv, out, scratch, scale,
                 prescaled: bool = False, softcap: float | None = None):
        self.step, self.kind, self.index, self.prescaled = step, kind, index, prescaled
        self.args = (layer, q, kv, out, scratch, scale)
        self.softcap = softcap
        self.ops: list = []
        self.build()

    def build(self) -> None:
        layer, q, kv, out, scratch, scale = self.args
        group, seen = self.step.groups[self.kind][self.index], {}

        def alloc(shape):          # the step's pooled temporaries: no allocation when rebuilt
            seen[shape] = seen.get(shape, -1) + 1
            return self.step.temp(shape, seen[shape])
        if self.softcap:              # Gemma 2's soft-capped scores: the group as one call
            self.ops = [partial(group_attention, layer, q, kv, group, out, scratch,
                                1.0 if self.prescaled else scale, self.softcap)]
            return
        try:
            self.ops = group_attention_ops(layer, q, kv, group, out, scratch, scale, alloc, self.prescaled,
                                           self.step.shared.setdefault((self.kind, self.index), {}))
        except ValueError:            # a view that would need a copy: keep the group as one call
            # (queries already scaled: times 1.0, exact)
            self.ops = [partial(group_attention, layer, q, kv, group, out, scratch,
                                1.0 if self.prescaled else scale)]

    def __call__(self) -> None:
        for op in self.ops:
            op()


class CapturedStep:
    """One bucket's forward step: ``ops``, every call of the step bound to its arrays, in order, and the
    per-step inputs those calls read (``token_ids``, ``positions``, ``slots``, ``logits_indices``, each group's
    ``blocks`` and ``mask``), owned here and refilled by ``bind`` (from a plan) or ``bind_batch`` (from the
    batch itself). ``logits`` is the view the last calls write."""

    def __init__(self, plan: StepPlan, batch, rope_tables: list, block_size: int, max_slots: int,
                 n_heads: int | None = None, scale: float | None = None):
        self.key = None
        self.ops: list = []             # the recorded calls; a group's attention is one BoundAttention entry
        self.flat: list | None = None   # the same with each BoundAttention's calls spliced in (what replays)
        self.scratch: list[np.ndarray] = []          # reduction and regrouping buffers the plain calls allocate
        self.pool: dict[tuple, np.ndarray] = {}     # ``temp``: those of them used within one call, shared
        self.shared: dict[tuple, dict] = {}           # (kind, group) -> its layers' common attention calls
        self.slot_elems: np.ndarray | None = None    # ``write_ops``: flat cache indices of a one-token step
        self.token_ids, self.slots = plan.token_ids.copy(), plan.slots.copy()
        self.logits_indices = plan.logits_indices.copy()
        self.positions = np.array(batch.positions, np.int64)
        self.groups = [[g._replace(blocks=g.blocks.copy(), mask=g.mask.copy()) for g in k.attention.groups]
                       for k in plan.kinds]
        self.plan = StepPlan(plan.num_tokens, self.token_ids, self.slots,
                             [KindPlan(k.cos, k.sin, AttentionPlan(gs, [], k.attention.window))
                              for k, gs in zip(plan.kinds, self.groups)], self.logits_indices)
        self.logits: np.ndarray | None = None
        self.block_size, self.max_slots, self.regroups = block_size, max_slots, 0
        self.windows = [k.attention.window for k in plan.kinds]
        self.attention: dict[tuple[int, int], list[BoundAttention]] = {}   # (kind, group) -> one per layer
        # which sequences of the batch each group holds (its rows' first rows), for bind_batch; a kind whose
        # sequences of one query length were split over several groups is planned every step instead
        self.query_lens = list(batch.query_lens)          # the captured order of the sequences
        first = np.cumsum([0] + self.query_lens)[:-1].tolist()
        seq_at = {r: s for s, r in enumerate(first)}
        self.members = [[[seq_at[int(r)] for r in np.arange(len(plan.token_ids))[g.rows][::g.q_len]]
                         for g in gs] for gs in self.groups]
        self.unsplit = all(len({g.q_len for g in gs}) == len(gs) for gs in self.groups)
        self.lj = [[self._lj(g) for g in gs] for gs in self.groups]
        # RoPE as three calls (layers/rotary.py ``apply_rope_ops``) over full-width rows [cos | cos] and
        # [-sin | sin] of every rotated head, gathered once per step for all layers by the bound prologue;
        # with a power-of-two attention scale the query heads' rows carry it (exact), so attention skips its
        # scaling pass (``prescale``)
        self.prescale = scale if n_heads is not None and _exact_scale(scale) else None
        self.rope_rows, self.prologue = [], []
        for tables, k in zip(rope_tables, plan.kinds):
            shape = k.cos.shape[:2] + (2 * k.cos.shape[2],)          # (T, rotated heads, hd)
            rows = self.own(shape), self.own(shape)
            self.rope_rows.append(rows)
            self.prologue += rope_rows_ops(tables, self.positions, rows, n_heads, self.prescale, self.own)
        for op in self.prologue:
            op()

    @staticmethod
    def _lj(g: QueryGroup) -> np.ndarray:
        """A group's mask as layers/paged_attention.py group_mask builds it, in integers: key l of the padded
        context (first block b0) is hidden from query j when l - j > ctx - first key - q_len (it comes later),
        or, in a window W, when l - j <= ctx - first key - q_len - W. ``lj`` = l - j, (1, Q, L)."""
        return np.arange(g.mask.shape[-1])[None, None, :] - np.arange(g.q_len)[None, :, None]

    def own(self, shape: tuple) -> np.ndarray:
        """A float32 scratch array of this step (bound into its calls)."""
        a = np.empty(shape, np.float32)
        self.scratch.append(a)
        return a

    def temp(self, shape: tuple, n: int = 0) -> np.ndarray:
        """The ``n``-th float32 temporary of this shape: written and read within one call of the model (a
        norm's mean squares, RoPE's products, a group's attention), so every layer and group shares it (fewer
        cache lines, and nothing allocated when ``regroup`` rebuilds the attention calls)."""
        a = self.pool.get((shape, n))
        if a is None:
            a = self.pool[(shape, n)] = self.own(shape)
        return a

    def write_ops(self, kv: PagedKVCache, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> list:
        """A KV write, bound (``PagedKVCache.write_ops``). One token's K and V rows (contiguous, as in a lone
        decode) into a float32 cache: as two ``np.put`` into the layer's flat cache (~1 us less than an
        assignment through an index array) at the flat indices of the step's slot, prepared once per step for
        all layers by the prologue."""
        if not (kv.zero_copy and slots is self.slots and len(slots) == 1 and k.flags.c_contiguous
                and v.flags.c_contiguous):
            return kv.write_ops(layer, slots, k, v)
        row = k.size                                  # one slot: Hkv x hd values
        if self.slot_elems is None or self.slot_elems.size != row:
            self.slot_elems, first = np.empty(row, np.intp), np.empty(1, np.intp)     # np.put takes intp
            ops = [partial(np.multiply, self.slots, row, first), partial(np.add, first, np.arange(row),
                                                                          self.slot_elems)]
            for op in ops:
                op()
            self.prologue += ops
        return [partial(np.put, kv.k_slots[layer].reshape(-1, copy=False), self.slot_elems, k),
                partial(np.put, kv.v_slots[layer].reshape(-1, copy=False), self.slot_elems, v)]

    def regroup(self, kind: int, index: int, blocks: np.ndarray, start, window) -> QueryGroup:
        """Give group ``index`` of ``kind`` new block ids of another padded length (or another zero-copy
        start): new blocks / mask arrays, and its attention calls rebuilt in every layer."""
        g = self.groups[kind][index]
        L = blocks.shape[1] * self.block_size
        g = g._replace(blocks=blocks, mask=np.zeros(_mask_shape(blocks.shape[0], g.q_len, L, window), bool),
                       start=start)
        self.groups[kind][index] = g
        self.lj[kind][index] = self._lj(g)
        self.shared.pop((kind, index), None)
        self.regroups += 1
        for bound in self.attention.get((kind, index), ()):
            bound.build()
        self.flat = None
        return g

    def bind(self, plan: StepPlan, batch) -> None:
        """Copy a later step's data (same bucket) into the arrays the calls read, and gather its RoPE rows."""
        np.copyto(self.token_ids, plan.token_ids)
        np.copyto(self.positions, batch.positions)
        np.copyto(self.slots, plan.slots)
        np.copyto(self.logits_indices, plan.logits_indices)
        for k, (mine, kind) in enumerate(zip(self.groups, plan.kinds)):
            for i, (g, new) in enumerate(zip(mine, kind.attention.groups)):
                if g.blocks.shape != new.blocks.shape or g.start != new.start:
                    g = self.regroup(k, i, new.blocks.copy(), new.start, kind.attention.window)
                else:
                    np.copyto(g.blocks, new.blocks)
                np.copyto(g.mask, new.mask)
        for op in self.prologue:
            op()

    def bind_batch(self, batch) -> bool:
        """Derive a later batch's data (same ``batch_key``) straight into the bound arrays, without a plan;
        False if its sequences of one query length would be split over several groups (then plan it)."""
        if not self.unsplit:
            return False
        bs, ql, cl, tables = self.block_size, batch.query_lens, batch.context_lens, batch.block_tables
        order = self._order(ql)
        if order is not None:      # the same lengths in another order: the batch's sequences in the captured one
            ql, cl, tables = self.query_lens, [cl[s] for s in order], [tables[s] for s in order]
        for k, (window, groups, members) in enumerate(zip(self.windows, self.groups, self.members)):
            for i, (g, mem) in enumerate(zip(groups, members)):
                if len(mem) == 1:        # a lone sequence (most decodes): group_arrays' work, in scalars
                    c, table = cl[mem[0]], tables[mem[0]]
                    b0, nb = read_span(ql[mem[0]], c, bs, window)
                    if nb * bs > self.max_slots:
                        return False
                    run = table[b0:b0 + nb].tolist()      # a few ids: Python compares them fastest
                    start = run[0] * bs if run == list(range(run[0], run[0] + nb)) else None
                    if nb != g.blocks.shape[1] or start != g.start:
                        g = self.regroup(k, i, np.array(run, np.int64)[None], start, window)
                    else:
                        g.blocks[0] = run
                    edge = c - b0 * bs - g.q_len
                else:
                    reads = [(0, cl[s]) + read_span(ql[s], cl[s], bs, window) + (tables[s],) for s in mem]
                    nb = max(r[3] for r in reads)
                    if len(mem) * nb * bs > self.max_slots:
                        return False
                    same = nb == g.blocks.shape[1]
                    blocks, lens, key_starts, _, start = group_arrays(reads, g.q_len, bs, window,
                                                                      g.blocks if same else None, mask=False)
                    if not same or start != g.start:
                        g = self.regroup(k, i, blocks, start, window)
                    edge = (lens - key_starts - g.q_len)[:, None, None]
                lj = self.lj[k][i]
                mask = g.mask.reshape((len(mem),) + lj.shape[1:])
                np.greater(lj, edge, out=mask)
                if window is not None:
                    mask |= lj <= edge - window
        if order is None:
            np.copyto(self.token_ids, batch.token_ids)
            np.copyto(self.positions, batch.positions)
            np.copyto(self.logits_indices, batch.logits_indices)
        else:
            # captured row r holds the batch's row src[r]; logits rows stay in the batch's order (every op
            # computes its rows alike wherever they sit: elementwise, per-row products, one group per query length)
            first = np.cumsum([0] + list(batch.query_lens))
            src = np.concatenate([np.arange(first[s], first[s + 1]) for s in order])
            np.take(batch.token_ids, src, 0, self.token_ids)
            np.take(batch.positions, src, 0, self.positions)
            where = np.empty_like(src)
            where[src] = np.arange(len(src))
            np.take(where, batch.logits_indices, 0, self.logits_indices)
        i = 0
        for q, c, table in zip(ql, cl, tables):          # positions run from c - q to c - 1 (validated)
            if q == 1:
                self.slots[i] = int(table[(c - 1) // bs]) * bs + (c - 1) % bs
            else:
                self.slots[i:i + q] = slot_mapping(np.arange(c - q, c), table, bs)
            i += q
        for op in self.prologue:
            op()
        return True

    def _order(self, ql) -> list | None:
        """None if ``ql`` lists the captured query lengths in the captured order; else, for each captured
        sequence, the batch's sequence that takes its place (the next one of the same query length)."""
        if list(ql) == self.query_lens:
            return None
        same: dict[int, list] = {}
        for s, q in enumerate(ql):
            same.setdefault(q, []).append(s)
        for v in same.values():
            v.reverse()
        return [same[q].pop() for q in self.query_lens]

    def replay(self) -> np.ndarray:
        if self.flat is None:
            self.flat = [o for op in self.ops for o in (op.ops if isinstance(op, BoundAttention) else (op,))]
        for op in self.flat:
            op()
        return self.logits


class StepCapture(EagerOps):
    """The recorder: runs each call of the fast path, like ``EagerOps``, and appends it, bound, to
    ``step.ops``."""

    def __init__(self, step: CapturedStep):
        self.step = step

    def _run(self, ops: list) -> None:
        for op in ops:
            op()
        self.step.ops += ops
        self.step.flat = None

    def call(self, f, *args) -> None:
        bound = None      # the embedding lookup and a KV write have bound forms of fewer Python-level calls
        if isinstance(f, Embedding):
            bound = f.ops(*args)
        elif getattr(f, "__func__", None) is PagedKVCache.write:
            bound = self.step.write_ops(f.__self__, *args)
        self._run(bound or [partial(f, *args)])

    def rms_norm(self, x, weight, eps, out) -> None:
        self._run(rms_norm_ops(x, weight, eps, out, self.step.temp(x.shape[:-1] + (1,))))

    def matmul(self, lin, x, out) -> None:
        self._run(lin.matmul_ops(x, out))

    def gated(self, lin, x, out, scratch) -> None:
        self._run(lin.matmul_ops(x, scratch) + gated_activation_ops(scratch, lin.act, out))

    def rope(self, x, cos, sin, out, tmp) -> None:
        step = self.step
        kind = next((k for k, kp in enumerate(step.plan.kinds) if kp.cos is cos), None)
        if kind is None or x.shape[1] != step.rope_rows[kind][0].shape[1]:
            raise ValueError("a captured step rotates the heads of its plan's RoPE rows only")
        self._run(apply_rope_ops(x, *step.rope_rows[kind], out, step.temp(x.shape)))

    def attention(self, i, q, kv, plan, out, scratch, scale, softcap=None) -> None:
        if plan.runs:
            raise ValueError("a step with long queries is not captured (step_key keeps it plain)")
        step = self.step
        kind = next(k for k, kp in enumerate(step.plan.kinds) if kp.attention is plan)
        if step.prescale is not None and scale != step.prescale:
            raise ValueError(f"attention scale {scale} is not the one folded into the RoPE rows ({step.prescale})")
        for index in range(len(plan.groups)):
            bound = BoundAttention(step, kind, index, i, q, kv, out, scratch, scale, step.prescale is not None,
                                   softcap)
            step.attention.setdefault((kind, index), []).append(bound)
            self._run([bound])


def group_attention_ops(layer: int, q: np.ndarray, kv, group: QueryGroup, out: np.ndarray, scratch,
                        scale: float, own, prescaled: bool = False, shared: dict | None = None) -> list:
    """The calls of layers/paged_attention.py ``group_attention`` and layers/attention.py ``decode_attention``
    for one query group over a float32 cache, bound (a cache stored as fp16 / q8_0 / q4_0 goes through
    ``stored_decode_attention``, bound as the one ``group_attention`` call): the context read (a zero-copy
    view of the cache, or the gather into k_batch / v_batch), the regrouped scaled queries (``prescaled``:
    scaled already, with their RoPE rows; for one query per sequence, a view), the score products by key
    chunk, the mask, softmax and the weighted values, written into ``out``'s rows. ``own(shape)``: the step's
    scratch allocator. ``shared``: a dict kept for the group's layers (until its shapes change), where the
    calls that do not read this layer's keys and values are made once and reused. Raises ValueError if a
    view would need a copy (reshape(copy=False))."""
    if kv.converts:       # stored K/V formats: layers/attention.py stored_decode_attention, as one bound call
        return [partial(group_attention, layer, q, kv, group, out, scratch, 1.0 if prescaled else scale)]
    G, nb = group.blocks.shape
    bs, n = kv.block_size, group.blocks.size * kv.block_size
    ops = []
    if group.start is not None and kv.zero_copy:
        k, v = kv.k_slots[layer][group.start:group.start + n], kv.v_slots[layer][group.start:group.start + n]
    elif group.start is not None:
        ops.append(partial(kv.read, layer, group.start, n, scratch.k_batch, scratch.v_batch))
        k, v = scratch.k_batch[:n], scratch.v_batch[:n]
    else:
        ops.append(partial(kv.gather_blocks, layer, group.blocks, scratch.k_batch[:n], scratch.v_batch[:n]))
        k, v = scratch.k_batch[:n], scratch.v_batch[:n]
    L, (Hkv, hd) = nb * bs, k.shape[-2:]
    k, v = k.reshape((G, L, Hkv, hd), copy=False), v.reshape((G, L, Hkv, hd), copy=False)
    key = (q.__array_interface__["data"], q.shape, q.strides, out.__array_interface__["data"], scale, prescaled,
           scratch.scores.__array_interface__["data"], L, Hkv, hd)
    c = shared.get(key) if shared is not None else None
    if c is None:
        c = _softmax_ops(q, group, out, scratch, scale, own, prescaled, L, Hkv, hd)
        if shared is not None:
            shared[key] = c
    qg, s, acc, tmp, chunk = c["qg"], c["s"], c["acc"], c["tmp"], tuning.DECODE_KEY_CHUNK
    kt, vt = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
    ops += c["queries"]
    ops += [partial(np.matmul, qg, kt[..., l0:l0 + chunk], s[..., l0:l0 + chunk]) for l0 in range(0, L, chunk)]
    ops += c["softmax"]
    ops.append(partial(np.matmul, s[..., :chunk], vt[:, :, :chunk], acc))
    for l0 in range(chunk, L, chunk):
        ops += [partial(np.matmul, s[..., l0:l0 + chunk], vt[:, :, l0:l0 + chunk], tmp),
                partial(np.add, acc, tmp, acc)]
    return ops + c["output"]


def _softmax_ops(q, group: QueryGroup, out, scratch, scale, own, prescaled, L, Hkv, hd) -> dict:
    """``group_attention_ops``' arrays and calls that are the same in every layer: the queries regrouped
    (and scaled), the scores' views, the masked softmax and the division into the output rows."""
    G, (H, Q), queries = group.blocks.shape[0], (q.shape[1], group.q_len), []
    g = H // Hkv
    if isinstance(group.rows, slice):
        qs = q[group.rows]
    else:
        qs = own((G * Q, H, hd))
        queries.append(partial(np.take, q, group.rows, 0, qs))
    s = scratch.scores[:G * H * Q * L].reshape((G, Hkv, g * Q, L), copy=False)
    q5 = qs.reshape((G, Q, Hkv, g, hd), copy=False).transpose(0, 2, 3, 1, 4)
    if prescaled and Q == 1:        # the queries (scaled with their RoPE rows) already are (G, Hkv, g, hd)
        qg = qs.reshape((G, Hkv, g, hd), copy=False)
    else:
        qg = own((G, Hkv, g * Q, hd))
        queries.append(partial(np.copyto, qg.reshape(G, Hkv, g, Q, hd), q5) if prescaled else
                       partial(np.multiply, q5, np.array(scale, np.float32), qg.reshape(G, Hkv, g, Q, hd)))
    mx, den, acc = own((G, Hkv, g * Q, 1)), own((G, Hkv, g * Q, 1)), own((G, Hkv, g * Q, hd))
    # the softmax's ufuncs over the fewest dimensions the same elements allow (NumPy's per-call set-up grows
    # with them): one query per sequence masks (G, H, L) by (G, 1, L); the reductions see (rows, L)
    s2, rows = s.reshape(-1, L), G * Hkv * g * Q
    masked = ((s.reshape(G, Hkv * g, L), group.mask.reshape((G, 1, L), copy=False)) if Q == 1 else
              (s.reshape(G, Hkv, g, Q, L), group.mask.reshape((G, 1, 1, Q, L), copy=False)))
    if G == 1 and Q == 1 and group.mask.ndim == 4:
        # a lone decode without a window (group_mask's 4-D form) hides only keys past its context, all in its
        # last block: mask that block alone (the rest of the mask is False), not all L keys
        tail = L - L // group.blocks.shape[1]
        masked = (masked[0][..., tail:], masked[1][..., tail:])
    softmax = [partial(np.copyto, masked[0], np.float32(-np.inf), where=masked[1]),
               partial(np.maximum.reduce, s2, -1, None, mx.reshape(rows, 1), True),
               partial(np.subtract, s2, mx.reshape(rows, 1), s2), partial(np.exp, s2, s2),
               partial(np.add.reduce, s2, -1, None, den.reshape(rows, 1), True)]
    tmp = own(acc.shape) if L > tuning.DECODE_KEY_CHUNK else None
    # acc / den straight into the output rows (the plain step divides in place, then copies: the same values)
    res = out[group.rows] if isinstance(group.rows, slice) else own((G * Q, H, hd))
    if Q == 1:            # (G, Hkv, g, hd) is (G, H, hd): rows of hd
        output = [partial(np.divide, acc.reshape(rows, hd), den.reshape(rows, 1),
                          res.reshape((rows, hd), copy=False))]
    else:
        output = [partial(np.divide, acc.reshape(G, Hkv, g, Q, hd), den.reshape(G, Hkv, g, Q, 1),
                          res.reshape((G, Q, Hkv, g, hd), copy=False).transpose(0, 2, 3, 1, 4))]
    if not isinstance(group.rows, slice):
        output.append(partial(operator.setitem, out, group.rows, res))
    return {"queries": queries, "qg": qg, "s": s, "acc": acc, "tmp": tmp, "softmax": softmax, "output": output}


class StepGraphs:
    """The runner's captured steps, by bucket, least recently used dropped past ``capacity``; counters
    ``captures``, ``replays``, ``unplanned`` (replays that skipped the plan) and ``regroups`` (attention calls
    rebuilt for a new padded context length; the tests assert them)."""

    def __init__(self, capacity: int | None = None):
        self.capacity = tuning.GRAPH_CACHE_STEPS if capacity is None else int(capacity)
        self.steps: OrderedDict[tuple, CapturedStep] = OrderedDict()
        self.by_batch: dict[tuple, CapturedStep] = {}     # batch_key -> the step last captured or replayed for it
        self.captures = self.replays = self.unplanned = self._evicted_regroups = 0

    @property
    def regroups(self) -> int:
        return self._evicted_regroups + sum(s.regroups for s in self.steps.values())

    def run_batch(self, batch, max_logits: int) -> np.ndarray | None:
        """Logits of a (validated) batch whose bucket is known without a plan, replayed; else None."""
        key = batch_key(batch, max_logits)
        step = self.by_batch.get(key) if key is not None else None
        if step is None or not step.bind_batch(batch):
            return None
        self.steps.move_to_end(step.key)
        self.replays += 1
        self.unplanned += 1
        return step.replay()

    def run(self, plan: StepPlan, batch, model, kv, buffers, block_size: int, max_slots: int) -> np.ndarray | None:
        """Logits of a planned step, replayed or captured now; None if the step is not capturable (run it
        plain)."""
        max_logits = buffers.logits.shape[0]
        key = step_key(plan, max_logits)
        if key is None:
            return None
        step = self.steps.get(key)
        if step is not None:
            self.steps.move_to_end(key)
            self.replays += 1
            step.bind(plan, batch)
            logits = step.replay()
        else:
            step = CapturedStep(plan, batch, buffers.rope_tables, block_size, max_slots, model.config.n_heads,
                                model.scale)
            step.key = key
            step.logits = logits = model.forward(step.plan, kv, buffers.rows(plan.num_tokens),
                                                 ops=StepCapture(step))
            self.steps[key] = step
            self.captures += 1
            if len(self.steps) > self.capacity:
                old = self.steps.popitem(last=False)[1]
                self._evicted_regroups += old.regroups
                for k in [k for k, s in self.by_batch.items() if s is old]:    # several batch keys may share it
                    del self.by_batch[k]
        bkey = batch_key(batch, max_logits)
        if step.unsplit and bkey is not None:
            self.by_batch[bkey] = step
        return logits
