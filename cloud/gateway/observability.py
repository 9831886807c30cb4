"""Prometheus metrics of the cloud API and its engines.

Labels are the route, status, model, version and tier — never a tenant key or any secret. Engine gauges
(running/waiting sequences, KV-cache use, prefix-cache hit rate, speculative acceptance) are read from the
engines at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cloud.serving.engine_pool import EnginePool
from controlplane.fleet.devices import SyncCounts

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
KNOWN_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/inference",
    "/v1/models",
    "/healthz",
    "/readyz",
    "/metrics",
)


def route_label(path: str) -> str:
    """A bounded label: known routes as themselves, model lookups collapsed, anything else ``other``."""
    if path in KNOWN_ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model_id}"
    return "other"


class _EngineCollector(Collector):
    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "version", "tier"]
        families = {
            "running": GaugeMetricFamily("tierline_engine_running_sequences", "Sequences being decoded", labels=labels),
            "waiting": GaugeMetricFamily("tierline_engine_waiting_sequences", "Sequences queued", labels=labels),
            "kv": GaugeMetricFamily("tierline_engine_kv_cache_usage_ratio", "Share of KV blocks in use", labels=labels),
            "prefix": GaugeMetricFamily(
                "tierline_engine_prefix_cache_hit_ratio", "Prompt tokens served from the prefix cache", labels=labels
            ),
            "spec": GaugeMetricFamily(
                "tierline_engine_spec_acceptance_ratio",
                "Accepted share of speculative tokens",
                labels=[*labels, "method"],
            ),
        }
        # vLLM's names (label model_name), as model servers export them: one autoscaling rule reads both.
        vllm = {
            "vllm_waiting": GaugeMetricFamily(
                "vllm:num_requests_waiting", "Requests waiting in the engine's queue", labels=["model_name"]
            ),
            "vllm_running": GaugeMetricFamily(
                "vllm:num_requests_running", "Sequences being decoded", labels=["model_name"]
            ),
            "vllm_kv": GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1", labels=["model_name"]),
            "vllm_gpu_kv": GaugeMetricFamily(
                "vllm:gpu_cache_usage_perc", "KV-cache usage, 0 to 1 (vLLM's name before 0.10)", labels=["model_name"]
            ),
        }
        for served in self.pool.engines.values():
            snap = served.engine.snapshot()
            values = [served.model_id, str(served.version or ""), "cloud"]
            families["running"].add_metric(values, snap.running)
            families["waiting"].add_metric(values, snap.waiting)
            families["kv"].add_metric(values, snap.kv_usage)
            name = [served.model_id if served.version is None else f"{served.model_id}@{served.version}"]
            vllm["vllm_waiting"].add_metric(name, snap.waiting)
            vllm["vllm_running"].add_metric(name, snap.running)
            vllm["vllm_kv"].add_metric(name, snap.kv_usage)
            vllm["vllm_gpu_kv"].add_metric(name, snap.kv_usage)
            families["prefix"].add_metric(values, snap.prefix_hit_rate)
            for method, proposed in snap.spec_proposed.items():
                if proposed:
                    accepted = snap.spec_accepted.get(method, 0)
                    families["spec"].add_metric([*values, method], accepted / proposed)
        yield from families.values()
        yield from vllm.values()
        restarts = CounterMetricFamily(
            "tierline_engine_restarts", "Engine children restarted after they died", labels=["model"]
        )
        for model_id, count in sorted(self.pool.restart_counts.items()):
            restarts.add_metric([model_id], count)
        yield restarts


class Metrics:
    """One registry per app, so several apps in one process never collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        model_labels = ["model", "version", "tier"]
        self.requests = Counter(
            "tierline_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "tierline_request_latency_seconds",
            "End-to-end latency of inference requests",
            model_labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tierline_time_to_first_token_seconds",
            "Time to first token",
            model_labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "tierline_inter_token_latency_seconds",
            "Mean time between output tokens, per request",
            model_labels,
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.engine_latency = Histogram(
            "tierline_engine_latency_seconds",
            "The engine's own latency of inference requests (hand-over to last token); "
            "tierline_request_latency_seconds minus this is the API's overhead",
            model_labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "tierline_tokens", "Tokens in and out", [*model_labels, "direction"], registry=self.registry
        )
        self.usage_id_conflicts = Counter(
            "tierline_usage_id_conflicts",
            "Usage records not stored because their id is held by a record with a different payload "
            "(source: cloud = this server's metering, edge = a device's sync)",
            ["source"],
            registry=self.registry,
        )
        self.usage_clamped = Counter(
            "tierline_usage_clamped",
            "Device usage records dated outside the accepted window, booked at its edge (reported_at kept)",
            registry=self.registry,
        )
        self.usage_quarantined = Counter(
            "tierline_usage_quarantined",
            "Device usage records beyond what the device could have done (its model's context, its rate): stored "
            "in usage_quarantine, not billed (tierline billing quarantined lists them)",
            registry=self.registry,
        )
        for source in ("cloud", "edge"):  # exposed at 0 from the start, so an alert on an increase works
            self.usage_id_conflicts.labels(source)

    def count_edge_sync(self, counts: SyncCounts) -> None:
        """A device's sync: its conflicting, clamped and newly quarantined usage records."""
        if counts.conflicts:
            self.usage_id_conflicts.labels("edge").inc(counts.conflicts)
        if counts.clamped:
            self.usage_clamped.inc(counts.clamped)
        if counts.quarantined_ids:
            self.usage_quarantined.inc(len(counts.quarantined_ids))

    def watch(self, pool: EnginePool) -> None:
        self.registry.register(_EngineCollector(pool))

    def observe_request(
        self,
        model: str,
        version: int | None,
        prompt: int,
        completion: int,
        latency_s: float,
        ttft_s: float | None,
        engine_s: float | None = None,
    ) -> None:
        labels = (model, str(version or ""), "cloud")
        self.latency.labels(*labels).observe(latency_s)
        if engine_s is not None:
            self.engine_latency.labels(*labels).observe(engine_s)
        if ttft_s is not None:
            self.ttft.labels(*labels).observe(ttft_s)
            if completion > 1:
                self.itl.labels(*labels).observe(max(0.0, latency_s - ttft_s) / (completion - 1))
        self.tokens.labels(*labels, "in").inc(prompt)
        self.tokens.labels(*labels, "out").inc(completion)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_response(self, path: str, status: int) -> None:
        """Count one HTTP response by route and status (the app's ``on_response``: every response, the router's
        404 and 405 included)."""
        self.requests.labels(route_label(path), str(status)).inc()
