"""S19/S20 Prometheus metrics of one server: latency histograms, engine gauges, token counters.

Each app gets its own `CollectorRegistry` (never the process-global one), so tests and benchmarks can
build several apps in one process. Names follow vLLM's, with a `pyengine_` prefix.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def _hit_rate(stats: dict) -> float | None:
    """The engine's prefix-cache hit rate, whatever its exact key (a 0..1 number)."""
    for key in ("prefix_cache_hit_rate", "prefix_hit_rate", "cache_hit_rate"):
        if isinstance(stats.get(key), (int, float)):
            return float(stats[key])
    for key, value in stats.items():
        if "hit" in key and "rate" in key and isinstance(value, (int, float)):
            return float(value)
    return None


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry if registry is not None else CollectorRegistry()
        p = "pyengine_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from request arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between consecutive tokens of a choice",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Time from request arrival to its last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge(p + "num_requests_running", "Sequences in the engine's running batch", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Sequences waiting for admission", registry=r)
        self.target_itl = Gauge(p + "target_itl_ms", "S11: the step time prompt chunks are sized to while decodes "
                                "run (--target-itl-ms, or the last derived one)", registry=r)
        self.kv_blocks_used = Gauge(p + "kv_cache_used_blocks", "KV-cache blocks in use", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Fraction of the KV-cache blocks in use", registry=r)
        self.prefix_hit_rate = Gauge(p + "prefix_cache_hit_rate", "Prefix-cache hit rate (0..1) so far",
                                     registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests (as in usage)",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens (as in usage)", registry=r)
        self.requests = Counter(p + "request_success", "Finished choices by finish reason",
                                ["finish_reason"], registry=r)
        self.errors = Counter(p + "request_errors", "Requests answered with an error, by HTTP status",
                              ["status"], registry=r)
        # S14 speculative decoding (vLLM's spec_decode_* names); counters follow the engine's totals
        self.spec = {name: Counter(p + "spec_decode_" + name, help_, registry=r) for name, help_ in (
            ("num_drafts", "Verifications of at least one draft token"),
            ("num_draft_tokens", "Draft tokens proposed and verified"),
            ("num_accepted_tokens", "Draft tokens accepted"))}
        self._spec_seen = dict.fromkeys(self.spec, 0)
        self.spec_mean_acceptance_length = Gauge(
            p + "spec_decode_mean_acceptance_length", "Tokens emitted per verification so far (1 + accepted / drafts)",
            registry=r)
        # S16: MoE models' routing over the engine's window of recent steps
        self.expert_tokens = Gauge(p + "moe_expert_tokens", "Tokens routed to each expert over the recent window",
                                   ["layer", "expert"], registry=r)
        self.expert_balance = Gauge(p + "moe_expert_load_balance", "Mean / max tokens per expert (1 = even)",
                                    ["layer"], registry=r)

    def observe_engine(self, engine) -> None:
        """Refresh the gauges from the engine (called by the engine loop between steps)."""
        stats = engine.stats() or {}
        if "running" in stats:
            self.running.set(stats["running"])
        if "waiting" in stats:
            self.waiting.set(stats["waiting"])
        if stats.get("target_itl_ms") is not None:
            self.target_itl.set(stats["target_itl_ms"])
        used = engine.num_used_blocks()
        self.kv_blocks_used.set(used)
        if stats.get("total_blocks"):
            self.kv_usage.set(used / stats["total_blocks"])
        rate = _hit_rate(stats)
        if rate is not None:
            self.prefix_hit_rate.set(rate)
        for name, counter in self.spec.items():
            total = stats.get("spec_decode_" + name)
            if isinstance(total, int) and total > self._spec_seen[name]:
                counter.inc(total - self._spec_seen[name])
                self._spec_seen[name] = total
        if isinstance(stats.get("spec_decode_mean_acceptance_length"), float):
            self.spec_mean_acceptance_length.set(stats["spec_decode_mean_acceptance_length"])
        for row in (stats.get("expert_load") or {}).get("layers", ()):
            for e, n in enumerate(row["tokens"]):
                self.expert_tokens.labels(str(row["layer"]), str(e)).set(n)
            if row["balance"] is not None:
                self.expert_balance.labels(str(row["layer"])).set(row["balance"])

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def stats_line(stats: dict, last: dict, seconds: float) -> str:
    """The periodic log line vLLM prints, from two `engine.stats()` snapshots `seconds` apart."""
    def rate(key: str) -> float:
        return (stats.get(key, 0) - last.get(key, 0)) / max(seconds, 1e-9)

    usage = stats.get("kv_cache_usage")
    hit = _hit_rate(stats)
    return (f"Avg prompt throughput: {rate('computed_prompt_tokens'):.1f} tokens/s, "
            f"Avg generation throughput: {rate('generation_tokens'):.1f} tokens/s, "
            f"Running: {stats.get('running', 0)} reqs, Waiting: {stats.get('waiting', 0)} reqs, "
            f"KV cache usage: {100 * (usage or 0):.1f}%, Prefix cache hit rate: {100 * (hit or 0):.1f}%")


def kv_capacity(num_blocks: int, block_size: int, max_model_len: int) -> str:
    """The ready line's KV part: blocks, block size, and sequences that fit at the full context at once."""
    full = num_blocks // -(-max_model_len // block_size)
    return (f"KV cache {num_blocks} blocks x {block_size} tokens, {full} sequence{'s' if full != 1 else ''} at the "
            f"full {max_model_len}-token context at once")
