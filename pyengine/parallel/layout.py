"""S17: who computes what — the split of one model over ``tp`` x ``pp`` ranks (NumPy only, no MPI here).

World rank ``r`` is pipeline stage ``r // tp`` and tensor rank ``r % tp`` in it. Rank 0 (stage 0, tensor rank
0) owns the scheduler, sampling and the HTTP server.

Tensor parallelism (Megatron): a tensor rank holds whole query heads with their KV head(s), and a range of
FFN columns. Heads split by KV group (a query head and its KV head stay on one rank, so attention needs no
communication): SmolLM2's 3 KV groups of 3 query heads over 2 ranks give 2 + 1 groups (6 + 3 query heads).
With more ranks than KV heads, a KV head is replicated and its group's query heads are split (Gemma 3 270M: 4
query heads, 1 KV head over 2 ranks = 2 + 2 query heads, each with a copy of the KV head). The FFN columns are
split evenly: each sub-layer ends in an Allreduce, so each waits for its own slowest rank, and evening out the
weights per rank instead (more FFN columns for the rank with fewer heads) made the MLP uneven as well.

Mixtures of experts (S16) split by experts — expert parallelism: each tensor rank holds whole experts, E / N of
them (uneven allowed), computes the routed (token, expert) pairs whose expert it holds, and the layer ends with
one Allreduce like a dense MLP's down projection. The router is replicated (every rank routes every token the
same way); a shared expert (Qwen2-MoE) is split by its own FFN columns and its partial sum rides in the same
Allreduce. Expert weights — nearly all of an MoE model — so fall as 1/N; splitting every expert by columns
instead would cost the same one Allreduce but cut each expert's small products N ways.

Pipeline parallelism: contiguous layers per stage; stage 0 also holds the embedding and the LM head (SmolLM2
ties them: one matrix), so it gets fewer layers, balanced by weight count.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

FFN_UNIT = 16               # FFN columns are shared out in multiples of this (SIMD-friendly slices)


@dataclass(frozen=True)
class RankPart:
    """One rank's share of the model."""
    rank: int
    stage: int
    tp_rank: int
    q_heads: tuple             # global query-head indices it holds (contiguous)
    kv_heads: tuple            # global KV-head indices (contiguous; replicated ones appear on several ranks)
    ffn: tuple                 # (f0, f1): its FFN columns
    vocab: tuple               # (v0, v1): its LM-head columns (stage 0 only computes them)
    layers: tuple              # (first, last): its stage's layers
    experts: tuple = (0, 0)    # (e0, e1): the routed experts it holds (MoE; all of them without TP)
    shared: tuple = (0, 0)     # (s0, s1): its columns of the shared expert (Qwen2-MoE)


def split_heads(n_heads: int, n_kv_heads: int, tp: int) -> list[tuple[tuple, tuple]]:
    """Per tensor rank (query heads, KV heads). ValueError saying what to change if it cannot be done."""
    g = n_heads // n_kv_heads
    if tp <= n_kv_heads:
        # whole KV groups, uneven allowed: the first n_kv_heads % tp ranks take one more group
        base, extra = divmod(n_kv_heads, tp)
        out, k = [], 0
        for r in range(tp):
            n = base + (r < extra)
            out.append((tuple(range(k * g, (k + n) * g)), tuple(range(k, k + n))))
            k += n
        return out
    if tp % n_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp} exceeds the model's {n_kv_heads} KV heads and is not a multiple "
                         f"of it: use at most {n_kv_heads} ranks or a multiple of {n_kv_heads}")
    per = tp // n_kv_heads                  # ranks per replicated KV head, splitting its g query heads
    if per > g:
        raise ValueError(f"tensor_parallel_size {tp} exceeds the model's {n_heads} query heads: use at most "
                         f"{n_heads} ranks")
    out = []
    for kv in range(n_kv_heads):
        base, extra = divmod(g, per)
        q = kv * g
        for j in range(per):
            n = base + (j < extra)
            out.append((tuple(range(q, q + n)), (kv,)))
            q += n
    return out


def _cuts(total: int, shares: list[float], unit: int) -> list[int]:
    """Boundaries splitting ``total`` in proportion to ``shares``, at multiples of ``unit`` when possible."""
    s = sum(shares)
    unit = unit if total >= unit * len(shares) * 2 else 1
    cuts, acc = [0], 0.0
    for w in shares[:-1]:
        acc += w
        cuts.append(min(total, max(cuts[-1] + unit, int(round(acc / s * total / unit)) * unit)))
    return cuts + [total]


def split_ffn(config, heads: list, tp: int) -> list[tuple[int, int]]:
    """FFN column ranges, as even as FFN_UNIT allows. Not balanced against the heads: the attention and the MLP
    sub-layers each end in an Allreduce, so each waits for its slowest rank on its own; giving the rank with
    fewer heads more FFN columns (equal weights per rank) made the MLP uneven too (measured: docs/scaling.md)."""
    F = config.ffn_dim
    cuts = _cuts(F, [1.0] * tp, FFN_UNIT)
    if any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"tensor_parallel_size {tp} leaves a rank no FFN columns (ffn_dim {F}): use fewer ranks")
    return list(zip(cuts, cuts[1:]))


def split_layers(n_layers: int, pp: int, head_layers: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous layer ranges per stage; stage 0 counts ``head_layers`` layers' worth of extra work (the LM
    head), so it gets fewer layers."""
    if pp > n_layers:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {n_layers} layers: use at most "
                         f"{n_layers} stages")
    shares = [1.0] * pp
    cost = (n_layers + head_layers) / pp
    first = max(1, round(cost - head_layers)) if pp > 1 else n_layers
    first = min(first, n_layers - (pp - 1))
    rest = _cuts(n_layers - first, shares[1:], 1) if pp > 1 else [0]
    cuts = [0] + [first + c for c in rest]
    return list(zip(cuts, cuts[1:]))


def split_experts(n_experts: int, tp: int) -> list[tuple[int, int]]:
    """Contiguous expert ranges per tensor rank (expert parallelism); ValueError saying what to change."""
    if tp > n_experts:
        raise ValueError(f"tensor_parallel_size {tp} exceeds the model's {n_experts} experts (each rank holds whole "
                         f"experts): use at most {n_experts} ranks")
    base, extra = divmod(n_experts, tp)
    cuts = [0]
    for r in range(tp):
        cuts.append(cuts[-1] + base + (r < extra))
    return list(zip(cuts, cuts[1:]))


def plan_ranks(config, tp: int, pp: int) -> list[RankPart]:
    """Every rank's part for ``tp`` tensor x ``pp`` pipeline ranks; ValueError saying what to change."""
    for name, v in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    c = config
    moe = getattr(c, "moe", None)
    heads = split_heads(c.n_heads, c.n_kv_heads, tp)
    ffn = split_ffn(c, heads, tp)
    experts, shared = [(0, 0)] * tp, [(0, 0)] * tp
    ffn_w = 3 * c.ffn_dim * c.d_model
    if moe is not None:
        experts = split_experts(moe.n_experts, tp)
        if moe.shared_ffn:
            cuts = _cuts(moe.shared_ffn, [1.0] * tp, FFN_UNIT)
            if any(b <= a for a, b in zip(cuts, cuts[1:])):
                raise ValueError(f"tensor_parallel_size {tp} leaves a rank no columns of the shared expert "
                                 f"(width {moe.shared_ffn}): use fewer ranks")
            shared = list(zip(cuts, cuts[1:]))
        ffn_w = 3 * c.d_model * (moe.n_experts * moe.expert_ffn + moe.shared_ffn)
    layer_w = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim * c.d_model * 2 + ffn_w
    stages = split_layers(c.n_layers, pp, c.vocab_size * c.d_model / tp / (layer_w / tp))
    vcuts = _cuts(c.vocab_size, [1.0] * tp, FFN_UNIT)
    return [RankPart(s * tp + t, s, t, heads[t][0], heads[t][1], ffn[t], (vcuts[t], vcuts[t + 1]), stages[s],
                     experts[t], shared[t])
            for s in range(pp) for t in range(tp)]


def rank_config(config, part: RankPart):
    """The config a rank builds its model from: its own head counts, FFN width and layer count, so the model
    files and the KV cache (its KV heads, its layers) need no change."""
    moe = getattr(config, "moe", None)
    kw = {"moe": replace(moe, shared_ffn=part.shared[1] - part.shared[0])} if moe is not None and moe.shared_ffn else {}
    return replace(config, n_heads=len(part.q_heads), n_kv_heads=len(part.kv_heads),
                   ffn_dim=part.ffn[1] - part.ffn[0], n_layers=part.layers[1] - part.layers[0], **kw)
