"""S09-S17: what an engine shows about itself — ``stats()`` (the counters the server's /metrics, the benches and the
tests read) and ``snapshot()`` (the browser demo's live view, once per step)."""
from __future__ import annotations

from pyengine.engine.spec_decode import spec_stats


def engine_stats(engine) -> dict:
    """The counters of ``engine`` (`LLMEngine.stats`): queues, KV blocks, prefix cache, steps, drafts, chunk budget."""
    bm, sch = engine.block_manager, engine.scheduler
    load = engine.runner.expert_load        # MoE models (S16)
    return {
        **({"expert_load": load.snapshot()} if load is not None else {}),
        "running": len(sch.running), "waiting": len(sch.waiting), "preempted": len(sch.preempted),
        "unfinished_requests": len(engine.requests),
        "used_blocks": bm.num_used_blocks(), "free_blocks": bm.num_free_blocks(), "total_blocks": bm.num_blocks,
        "kv_cache_usage": bm.num_used_blocks() / bm.num_blocks, "cached_blocks": bm.num_cached_blocks(),
        "prefix_cache_hits": bm.hits, "prefix_cache_misses": bm.misses,
        "prefix_cache_hit_rate": bm.hit_rate(), "prefix_cache_hit_tokens": bm.hit_tokens,
        "prefix_cache_query_tokens": bm.query_tokens, "prefix_cache_evictions": bm.evictions,
        "num_preemptions": sch.num_preemptions, **engine.counters,
        **spec_stats(engine.spec),
        **(sch.chunk_budget.stats() if sch.chunk_budget is not None else {}),
        **({"pipeline_groups": engine.pipeline_groups, "max_groups_in_flight": engine.in_flight.max_groups}
           if engine.pipeline_groups > 1 else {}),
    }


def engine_snapshot(engine) -> dict:
    """`engine_stats` plus what a live view of the engine draws (the browser demo's panel, once per step):
    ``blocks``, each KV block's state (0 free, 1 in use, 2 in use and in the prefix cache, 3 free but
    holding a cached prefix, S06/S07); ``owners``, request id -> the blocks its sequences hold;
    ``requests``, request id -> prompt tokens, prompt tokens reused from the prefix cache, drafted and
    accepted tokens (S14) and the size of the grammar's token mask for its next token (S15, else None);
    ``step_ms``, the latest step's time split."""
    bm = engine.block_manager
    blocks = [(2 if h is not None else 1) if r > 0 else (3 if h is not None else 0)
              for r, h in zip(bm.ref_counts, bm.block_hash)]
    owners: dict[str, list[int]] = {}
    requests = {}
    for rid, req in engine.requests.items():
        held = owners.setdefault(rid, [])
        for seq in req.seqs:
            held.extend(b for b in seq.block_table if b not in held)
        m = req.metrics
        mask = None
        if req.matchers is not None and not req.finished:
            mask = int(req.matchers[0].allowed_mask().sum())
        requests[rid] = {"prompt_tokens": m.num_prompt_tokens, "cached_tokens": m.num_cached_tokens,
                         "admitted": req.admitted, "draft_tokens": m.num_draft_tokens,
                         "accepted_tokens": m.num_accepted_tokens, "grammar_mask_size": mask}
    return {**engine.stats(), "block_size": bm.block_size, "blocks": blocks, "owners": owners,
            "requests": requests, "step_ms": dict(engine.last_step_ms)}
