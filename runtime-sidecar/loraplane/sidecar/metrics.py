"""The sidecar's Prometheus metrics (own registry, served on its own port).

Fixed-cardinality families carry at most a ``tier`` label. Per-adapter series exist only for the top-K adapters by
requests; every other adapter is folded into its tenant's ``adapter="_other"`` series. For runtimes that do not
export them (vLLM today), the proposed vLLM residency gauges ``vllm:lora_adapter_loaded{adapter_name, level,
pinned}`` are re-exported from the sidecar's (inferred) view so other endpoint pickers can use them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplane.api import Tier

_STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
OTHER = "_other"


@dataclass(frozen=True)
class AdapterSample:
    """One adapter as the last observation saw it (input of the per-adapter collector)."""

    served_name: str
    tenant: str
    tier: Tier
    pinned: bool
    hits: int
    in_flight: int
    bytes: int


class _AdapterCollector(Collector):
    def __init__(self, metrics: SidecarMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        samples, top_k = self._metrics.adapters, self._metrics.top_k
        ranked = sorted(samples, key=lambda s: (-s.hits, s.served_name))
        top = {s.served_name for s in ranked[:top_k]}
        hits = CounterMetricFamily("adapter_requests", "Requests served per adapter (top-K; others per tenant).",
                                   labels=["adapter", "tenant"])
        in_flight = GaugeMetricFamily("adapter_in_flight_requests", "Requests in flight per adapter (top-K).",
                                      labels=["adapter", "tenant"])
        weight_bytes = GaugeMetricFamily("adapter_resident_bytes", "Adapter weight bytes at their tier (top-K).",
                                         labels=["adapter", "tenant", "tier"])
        folded: dict[tuple[str, ...], float] = {}
        for s in samples:
            adapter = s.served_name if s.served_name in top else OTHER
            for family, labels, value in ((hits, (adapter, s.tenant), s.hits),
                                          (in_flight, (adapter, s.tenant), s.in_flight),
                                          (weight_bytes, (adapter, s.tenant, s.tier.value), s.bytes)):
                key = (family.name, *labels)
                folded[key] = folded.get(key, 0.0) + value
        for family in (hits, in_flight, weight_bytes):
            for key, total in sorted(folded.items()):
                if key[0] == family.name:
                    family.add_metric(list(key[1:]), total)
            yield family
        if not self._metrics.reexport_residency:
            return
        loaded = GaugeMetricFamily("vllm:lora_adapter_loaded",
                                   "1 for each adapter resident in the runtime (re-exported by the loraplane sidecar).",
                                   labels=["adapter_name", "level", "pinned"])
        for s in samples:
            if s.tier in (Tier.GPU, Tier.CPU):
                loaded.add_metric([s.served_name, s.tier.value, str(s.pinned).lower()], 1.0)
        yield loaded


class SidecarMetrics:
    """Every metric the sidecar exports."""

    def __init__(self, top_k: int = 20, reexport_residency: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.top_k = top_k
        self.reexport_residency = reexport_residency
        self.adapters: list[AdapterSample] = []
        r = self.registry
        self.cache_hits = Counter("adapter_cache_hits", "Promotions served from a warmer tier than remote (cpu: "
                                  "host -> GPU; disk: local cache -> runtime).", ["tier"], registry=r)
        self.cache_misses = Counter("adapter_cache_misses", "Loads that had to fetch the artifact remotely.",
                                    registry=r)
        self.resident = Gauge("adapter_resident_count", "Adapters per tier (disk: in the cache, not in the runtime).",
                              ["tier"], registry=r)
        self.resolve = Histogram("adapter_resolve_seconds", "Artifact resolve time (connect, manifest) before "
                                 "the first byte.", buckets=_STAGE_BUCKETS, registry=r)
        self.download = Histogram("adapter_remote_download_seconds", "Artifact transfer time.",
                                  buckets=_STAGE_BUCKETS, registry=r)
        self.verify = Histogram("adapter_verify_seconds", "sha256 verification time.", buckets=_STAGE_BUCKETS,
                                registry=r)
        self.disk_load = Histogram("adapter_disk_load_seconds", "Runtime load from the local cache (read, parse).",
                                   buckets=_STAGE_BUCKETS, registry=r)
        self.h2d = Histogram("adapter_h2d_seconds", "Host-to-device activation time.", buckets=_STAGE_BUCKETS,
                             registry=r)
        self.activation = Histogram("adapter_activation_seconds", "From the target asking for a warmer tier to the "
                                    "adapter being there.", buckets=_STAGE_BUCKETS, registry=r)
        self.evictions = Counter("adapter_evictions", "Adapters that left a tier without the sidecar asking "
                                 "(runtime eviction) or were evicted from the disk cache.", ["tier"], registry=r)
        self.reload_after_eviction = Counter("adapter_reload_after_eviction", "Loads or activations of an adapter "
                                             "the runtime had evicted.", registry=r)
        self.thrash_ratio = Gauge("adapter_thrash_ratio", "Reloads after eviction / all loads and activations.",
                                  registry=r)
        self.runtime_ready = Gauge("sidecar_runtime_ready", "1 when the runtime answered the last observation.",
                                   registry=r)
        self.redis_connected = Gauge("sidecar_redis_connected", "1 when the last Redis operation succeeded.",
                                     registry=r)
        self.runtime_restarts = Counter("sidecar_runtime_restarts", "Runtime restarts detected.", registry=r)
        self.reports = Counter("sidecar_reports_published", "Residency reports written to Redis.", registry=r)
        self.action_failures = Counter("sidecar_action_failures", "Failed reconcile actions by reason.", ["reason"],
                                       registry=r)
        self._promotions = 0
        self._reloads = 0
        r.register(_AdapterCollector(self))

    def promoted(self, after_eviction: bool) -> None:
        """Count one load or activation (and whether it re-fetched something the runtime had evicted)."""
        self._promotions += 1
        if after_eviction:
            self._reloads += 1
            self.reload_after_eviction.inc()
        self.thrash_ratio.set(self._reloads / self._promotions)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
