"""S18: the disaggregated server's /metrics — the server's own, plus per instance and per KV transfer.

    pyengine_instance_num_requests_running{rank, role}   sequences in that instance's running batch
    pyengine_instance_num_requests_waiting{rank, role}
    pyengine_instance_kv_cache_usage_ratio{rank, role}, pyengine_instance_kv_cache_used_blocks{rank, role}
    pyengine_instance_up{rank, role}                     1 alive, 0 declared dead by the router
    pyengine_kv_transfer_blocks_total / _bytes_total     blocks and bytes shipped prefill -> decode
    pyengine_kv_transfer_cached_blocks_total             prompt blocks the decode side already held (not shipped)
    pyengine_kv_transfer_seconds                         per transfer: the decode side's offer -> last block
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from pyengine.server.metrics import ServerMetrics

TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class DisaggMetrics(ServerMetrics):
    def __init__(self, registry=None, model_name: str = "pyengine"):
        super().__init__(registry, model_name)
        r, p, lab = self.registry, "pyengine_", ["rank", "role"]
        self.inst = {key: Gauge(p + name, help_, lab, registry=r) for key, name, help_ in (
            ("running", "instance_num_requests_running", "Sequences in the instance's running batch"),
            ("waiting", "instance_num_requests_waiting", "Sequences waiting in the instance"),
            ("kv_cache_usage", "instance_kv_cache_usage_ratio", "Fraction of the instance's KV blocks in use"),
            ("used_blocks", "instance_kv_cache_used_blocks", "KV blocks in use on the instance"),
            ("alive", "instance_up", "1 while the router counts the instance alive"))}
        self.xfer_blocks = Counter(p + "kv_transfer_blocks", "KV blocks shipped prefill -> decode", registry=r)
        self.xfer_bytes = Counter(p + "kv_transfer_bytes", "KV bytes shipped prefill -> decode", registry=r)
        self.xfer_cached = Counter(p + "kv_transfer_cached_blocks",
                                   "Prompt blocks the decode instance already held (not shipped)", registry=r)
        self.xfer_seconds = Histogram(p + "kv_transfer_seconds", "Time of one prompt's KV transfer",
                                      buckets=TRANSFER_BUCKETS, registry=r)

    def observe_engine(self, engine) -> None:
        super().observe_engine(engine)
        stats = engine.stats() or {}
        for inst in stats.get("instances", ()):
            labels = (str(inst["rank"]), inst["role"])
            for key, gauge in self.inst.items():
                if key in inst:
                    gauge.labels(*labels).set(float(inst[key]))
        while engine.transfers:
            t = engine.transfers.pop(0)
            self.xfer_blocks.inc(t["blocks"])
            self.xfer_bytes.inc(t["bytes"])
            self.xfer_cached.inc(t["cached"])
            self.xfer_seconds.observe(t["seconds"])
