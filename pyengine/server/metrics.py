"""S19/S20 Prometheus metrics of one server: latency histograms, engine gauges, token counters.

Each app gets its own `CollectorRegistry` (never the process-global one), so tests and benchmarks can
build several apps in one process. Our names carry a `pyengine_` prefix; beside them the same measurements are
exported under vLLM v1's own names, labels and histogram buckets (`vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries_total`, `vllm:time_to_first_token_seconds`, ...), so a
gateway or dashboard written for vLLM scrapes pyengine unchanged (`VLLMMetrics`).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


# vLLM v1's buckets (vllm/v1/metrics/loggers.py), so histograms merge with a vLLM fleet's
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error")


class VLLMMetrics:
    """vLLM's metric names, each labelled `model_name` as vLLM labels them; fed by `ServerMetrics`."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        r, m, labels = registry, model_name, ["model_name"]

        def counter(name, help_, extra=()):
            c = Counter("vllm:" + name, help_, labels + list(extra), registry=r)
            return c if extra else c.labels(m)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches",
                             labels, registry=r).labels(m)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed",
                             labels, registry=r).labels(m)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage",
                              labels, registry=r).labels(m)
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed")
        success = counter("request_success", "Count of successfully processed requests", ["finished_reason"])
        self.success = {reason: success.labels(m, reason) for reason in VLLM_FINISH_REASONS}  # exported at 0
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds",
                              labels, buckets=VLLM_TTFT_BUCKETS, registry=r).labels(m)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds",
                             labels, buckets=VLLM_ITL_BUCKETS, registry=r).labels(m)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds",
                             labels, buckets=VLLM_REQUEST_LATENCY_BUCKETS, registry=r).labels(m)
        self.spec = {name: counter("spec_decode_" + name, help_) for name, help_ in (
            ("num_drafts", "Number of spec decoding drafts"),
            ("num_draft_tokens", "Number of draft tokens"),
            ("num_accepted_tokens", "Number of accepted tokens"))}
        self._seen = {"prefix_cache_query_tokens": 0, "prefix_cache_hit_tokens": 0, "num_preemptions": 0}

    def observe_stats(self, stats: dict, kv_usage: float | None) -> None:
        if "running" in stats:
            self.running.set(stats["running"])
        if "waiting" in stats:
            self.waiting.set(stats["waiting"])
        if kv_usage is not None:
            self.kv_usage.set(kv_usage)
        for key, counter in (("prefix_cache_query_tokens", self.prefix_queries),
                             ("prefix_cache_hit_tokens", self.prefix_hits), ("num_preemptions", self.preemptions)):
            total = stats.get(key)
            if isinstance(total, int) and total > self._seen[key]:
                counter.inc(total - self._seen[key])
                self._seen[key] = total


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
    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "pyengine"):
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.vllm = VLLMMetrics(r, model_name)
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
        usage = used / stats["total_blocks"] if stats.get("total_blocks") else None
        if usage is not None:
            self.kv_usage.set(usage)
        self.vllm.observe_stats(stats, usage)
        rate = _hit_rate(stats)
        if rate is not None:
            self.prefix_hit_rate.set(rate)
        for name, counter in self.spec.items():
            total = stats.get("spec_decode_" + name)
            if isinstance(total, int) and total > self._spec_seen[name]:
                counter.inc(total - self._spec_seen[name])
                self.vllm.spec[name].inc(total - self._spec_seen[name])
                self._spec_seen[name] = total
        if isinstance(stats.get("spec_decode_mean_acceptance_length"), float):
            self.spec_mean_acceptance_length.set(stats["spec_decode_mean_acceptance_length"])
        for row in (stats.get("expert_load") or {}).get("layers", ()):
            for e, n in enumerate(row["tokens"]):
                self.expert_tokens.labels(str(row["layer"]), str(e)).set(n)
            if row["balance"] is not None:
                self.expert_balance.labels(str(row["layer"])).set(row["balance"])

    # one call per event, so both names count the same thing
    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.vllm.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.vllm.itl.observe(seconds)

    def observe_finished(self, seconds: float | None, prompt_tokens: int, generation_tokens: int,
                         finish_reasons: list[str]) -> None:
        """A request's accounting; `seconds` (its end-to-end latency) is None when it did not finish normally."""
        if seconds is not None:
            self.e2e.observe(seconds)
            self.vllm.e2e.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.vllm.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.vllm.generation_tokens.inc(generation_tokens)
        for reason in finish_reasons:
            self.requests.labels(finish_reason=reason).inc()
            vllm_reason = reason if reason in self.vllm.success else ("stop" if reason == "tool_calls" else None)
            if vllm_reason is not None:
                self.vllm.success[vllm_reason].inc()

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
