"""Prometheus metrics of one server (its own registry: no process-global state)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TYPICAL_MISSES = (1, 2, 4, 8, 16, 32, 64)


class ServerMetrics:
    """Request counters and latency histograms, plus engine and expert-hierarchy gauges read from
    the engine client at scrape time."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("hearth_requests", "Finished HTTP/gRPC requests", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("hearth_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("hearth_inter_token_latency_seconds", "Time between consecutive streamed tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("hearth_request_duration_seconds", "Time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("hearth_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("hearth_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("hearth_cached_prompt_tokens", "Prompt tokens served from cache", registry=r)
        self.aborted = Counter("hearth_aborted_requests", "Requests aborted (client gone)", registry=r)
        self.rejected = Counter("hearth_rejected_requests", "Requests refused because the queue was full",
                                registry=r)
        r.register(_EngineCollector(client))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges read from the engine client's latest statistics when Prometheus scrapes."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def describe(self) -> list:
        return []

    def collect(self):
        stats = self.client.stats() if self.client.ready else {}
        yield _gauge("hearth_ready", "1 when the model is loaded and serving", 1.0 if self.client.ready else 0.0)
        yield _gauge("hearth_queue_length", "Requests waiting for the engine", stats.get("waiting", 0))
        yield _gauge("hearth_running_requests", "Requests the engine is running", stats.get("running", 0))
        yield _gauge("hearth_in_flight_requests", "Requests accepted and not finished", stats.get("in_flight", 0))
        free, total = stats.get("kv_blocks_free", 0), stats.get("kv_blocks_total", 0)
        cached = stats.get("kv_blocks_cached", 0)  # kept for prefix reuse, evicted on demand: not in use
        yield _gauge("hearth_kv_cache_usage_ratio", "Share of KV blocks held by running requests",
                     (1 - (free + cached) / total) if total else 0)
        yield _gauge("hearth_kv_cache_cached_ratio", "Share of KV blocks kept for prefix reuse",
                     cached / total if total else 0)
        memory = stats.get("memory")
        if memory:
            family = GaugeMetricFamily("hearth_memory_bytes", "Bytes held, by device and use (weights, kv_cache, "
                                       "expert_pool, expert_cache)", labels=["device", "use"])
            for row in memory:
                family.add_metric([row["device"], row["use"]], row["bytes"])
            yield family
        if "replicas" in stats:
            yield from _replica_metrics(stats["replicas"])
            yield _gauge("hearth_router_route_seconds", "Mean time the router took to choose a replica (hashing "
                         "the prompt's blocks included)", stats.get("route_seconds_mean", 0.0))
        experts = stats.get("experts")
        if not experts:
            return
        yield _gauge("hearth_expert_cache_slots", "Expert cache slots on the device", experts["slots"])
        yield _gauge("hearth_expert_cache_hit_ratio", "Share of routed experts found in the cache",
                     experts["hit_rate"])
        for name, help_text in (("hits", "Routed experts found in the cache"),
                                ("misses", "Routed experts not in the cache"),
                                ("fills", "Experts copied into the cache"), ("cpu", "Experts computed on the CPU"),
                                ("evictions", "Experts evicted from the cache")):
            yield _counter(f"hearth_expert_{name}", help_text, experts.get(name, 0))
        yield _counter("hearth_expert_fill_bytes", "Bytes copied into the expert cache", experts.get("fill_bytes", 0))
        if "b_p" in experts:
            yield _gauge("hearth_bandwidth_link_bytes_per_second", "B_P: host-to-device expert fill bandwidth",
                         experts["b_p"])
            yield _gauge("hearth_bandwidth_host_bytes_per_second", "B_H: CPU expert bandwidth", experts["b_h"])
        qtable = experts.get("qtable")
        if qtable:
            family = GaugeMetricFamily("hearth_qtable_fills", "Fills the q table plans for m misses", labels=["m"])
            for m in _TYPICAL_MISSES:
                if m < len(qtable):
                    family.add_metric([str(m)], qtable[m])
            yield family


def _replica_metrics(replicas: dict[str, dict[str, Any]]):
    """Per-replica gauges of a router: rotation, load, speed, and each executor's live bandwidths
    and q table (as its monitor last set them)."""
    labels = ["replica", "node"]
    families = {
        "healthy": GaugeMetricFamily("hearth_replica_healthy", "1 while the replica is in rotation", labels=labels),
        "in_flight": GaugeMetricFamily("hearth_replica_in_flight_requests", "Requests routed and not finished",
                                       labels=labels),
        "decode_tok_s": GaugeMetricFamily("hearth_replica_decode_tokens_per_second",
                                          "Moving average of finished requests' decode speed", labels=labels),
        "b_p": GaugeMetricFamily("hearth_replica_bandwidth_link_bytes_per_second", "B_P behind the q table",
                                 labels=labels),
        "b_h": GaugeMetricFamily("hearth_replica_bandwidth_host_bytes_per_second", "B_H behind the q table",
                                 labels=labels),
        "hit_rate": GaugeMetricFamily("hearth_replica_expert_cache_hit_ratio", "Expert cache hit ratio",
                                      labels=labels),
        "updates": CounterMetricFamily("hearth_replica_bandwidth_updates", "q tables pushed by the monitor",
                                       labels=labels),
        "prompt_tokens": CounterMetricFamily("hearth_replica_prompt_tokens", "Prompt tokens of the requests "
                                             "the replica finished", labels=labels),
        "cached_prompt_tokens": CounterMetricFamily("hearth_replica_cached_prompt_tokens", "Of those, tokens "
                                                    "served from its prefix cache", labels=labels),
        "prefix_hit": GaugeMetricFamily("hearth_replica_prefix_hit_ratio", "Share of its prompt tokens served "
                                        "from its prefix cache", labels=labels),
        "prefix_blocks": GaugeMetricFamily("hearth_replica_prefix_cached_blocks", "Blocks its prefix cache "
                                           "holds, as it last published them", labels=labels),
    }
    qtable = GaugeMetricFamily("hearth_replica_qtable_fills", "Fills the q table plans for m misses",
                               labels=[*labels, "m"])
    for rid, r in replicas.items():
        key = [rid, str(r.get("node", ""))]
        executor = r.get("executor") or {}
        experts = executor.get("experts") or {}
        values = {"healthy": 1.0 if r.get("healthy") else 0.0, "in_flight": r.get("in_flight", 0),
                  "decode_tok_s": r.get("decode_tok_s", 0.0), "b_p": experts.get("b_p"), "b_h": experts.get("b_h"),
                  "hit_rate": experts.get("hit_rate"), "updates": executor.get("bandwidth_updates"),
                  "prompt_tokens": r.get("prompt_tokens"), "cached_prompt_tokens": r.get("cached_prompt_tokens"),
                  "prefix_hit": r["cached_prompt_tokens"] / r["prompt_tokens"] if r.get("prompt_tokens") else None,
                  "prefix_blocks": r.get("prefix_blocks")}
        for name, value in values.items():
            if value is not None:
                families[name].add_metric(key, float(value))
        for m in _TYPICAL_MISSES:
            if m < len(experts.get("qtable") or ()):
                qtable.add_metric([*key, str(m)], experts["qtable"][m])
    yield from families.values()
    yield qtable


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=float(value))


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_text, value=float(value))
