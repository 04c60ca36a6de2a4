"""Prometheus metrics: vLLM's names where vLLM (or its open residency proposal) has one, ``loraplane_engine_*`` else."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplane.api import Tier

if TYPE_CHECKING:
    from loraplane.engine.core import Engine

_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_LOAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

#: TTFT label for the tier the request's adapter was in when the request arrived.
TIER_LABELS = {Tier.GPU: "L0", Tier.CPU: "L1", Tier.DISK: "L2"}


class EngineMetrics:
    """Counters and histograms the engine feeds, plus scrape-time gauges read from the engine's state."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.ttft_by_tier = Histogram("loraplane_engine_time_to_first_token_seconds",
                                      "Time to first token by the tier the adapter was in on arrival (L0 slot, L1 host, L2 disk; base = no adapter).",
                                      ["tier"], buckets=_TTFT_BUCKETS, registry=self.registry)
        self.load_seconds = Histogram("loraplane_engine_adapter_load_seconds",
                                      "Adapter load time by stage (disk_read, parse, host_to_device).", ["stage"],
                                      buckets=_LOAD_BUCKETS, registry=self.registry)
        self.evictions = Counter("loraplane_engine_adapter_evictions",
                                 "Adapters evicted, by the tier they left (gpu: slot -> host, cpu: host -> disk).", ["tier"],
                                 registry=self.registry)
        self.merges = Counter("loraplane_engine_lora_merges",
                              "Dynamic merge: adapters merged (merged copies built) and unmerged (copies dropped).",
                              ["action"], registry=self.registry)
        self.merge_seconds = Histogram("loraplane_engine_lora_merge_seconds",
                                       "Time to merge (build every merged copy of an adapter) or unmerge.",
                                       ["action"], buckets=_LOAD_BUCKETS, registry=self.registry)
        self.merged_steps = Counter("loraplane_engine_lora_merged_steps",
                                    "Steps with rows served from merged weights (pure: every row; mixed: other rows "
                                    "took the unmerged path).", ["batch"], registry=self.registry)
        self.merged_rows = Counter("loraplane_engine_lora_merged_rows",
                                   "Rows (tokens) served from merged weights.", registry=self.registry)
        ProcessCollector(registry=self.registry)

    def bind(self, engine: Engine, clock: Callable[[], float] = time.time) -> None:
        """Export the engine's live state at every scrape."""
        self.registry.register(_StateCollector(engine, self.model_name, clock))

    def first_token(self, tier: Tier | None, seconds: float) -> None:
        """Record one request's time to first token."""
        self.ttft.labels(self.model_name).observe(seconds)
        self.ttft_by_tier.labels("base" if tier is None else TIER_LABELS[tier]).observe(seconds)

    def load_stage(self, stage: str, seconds: float) -> None:
        """Record one adapter load stage."""
        self.load_seconds.labels(stage).observe(seconds)

    def evicted(self, tier: Tier) -> None:
        """Count one eviction from ``tier``."""
        self.evictions.labels(tier.value).inc()

    def merge_event(self, action: str, seconds: float) -> None:
        """One merge or unmerge and its time."""
        self.merges.labels(action).inc()
        self.merge_seconds.labels(action).observe(seconds)

    def merged_step(self, merged_rows: int, other_rows: int) -> None:
        """A step served ``merged_rows`` rows from merged weights and ``other_rows`` on the unmerged path."""
        if merged_rows:
            self.merged_steps.labels("mixed" if other_rows else "pure").inc()
            self.merged_rows.inc(merged_rows)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


class _StateCollector(Collector):
    def __init__(self, engine: Engine, model_name: str, clock: Callable[[], float]) -> None:
        self.engine = engine
        self.model_name = model_name
        self.clock = clock

    def collect(self) -> Iterable[Metric]:
        engine = self.engine
        tiers = engine.tiers
        for name, value, help_text in (
            ("vllm:num_requests_waiting", len(engine.waiting), "Requests waiting to be processed."),
            ("vllm:num_requests_running", len(engine.running), "Requests in the running batch."),
            ("vllm:kv_cache_usage_perc", engine.kv.usage(), "KV-cache usage (1 = 100 percent)."),
            ("vllm:max_gpu_lora_adapters", tiers.max_loras, "GPU LoRA slots (max_loras)."),
        ):
            # vLLM labels these with the data-parallel engine index too (one series per engine; this engine is one)
            gauge = GaugeMetricFamily(name, help_text, labels=["engine", "model_name"])
            gauge.add_metric(["0", self.model_name], value)
            yield gauge
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests (value: unix time).",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        running = sorted({r.adapter.name for r in engine.running if r.adapter is not None})
        waiting = sorted({r.adapter.name for r in engine.waiting if r.adapter is not None})  # may overlap, as in vLLM
        info.add_metric([str(tiers.max_loras), ",".join(running), ",".join(waiting)], self.clock())
        yield info
        loaded = GaugeMetricFamily("vllm:lora_adapter_loaded", "Adapters resident per level (1 = resident).",
                                   labels=["adapter_name", "level", "pinned"])
        for adapter in tiers.registered.values():
            if adapter.tier in (Tier.GPU, Tier.CPU):
                loaded.add_metric([adapter.name, adapter.tier.value, str(adapter.pinned).lower()], 1)
        yield loaded
        merged = GaugeMetricFamily("loraplane_engine_lora_merged_adapters",
                                   "Adapters served from merged weights now (1 each).", labels=["adapter_name"])
        for adapter in engine.merged_adapters():
            merged.add_metric([adapter.name], 1)
        yield merged
        weight_bytes = GaugeMetricFamily("loraplane_engine_adapter_weight_bytes",
                                         "Adapter weight bytes held per tier (a slot-resident adapter also counts in cpu).",
                                         labels=["tier"])
        for tier, value in tiers.bytes_by_tier().items():
            weight_bytes.add_metric([tier.value], value)
        yield weight_bytes
        for name, value, help_text in (
            ("loraplane_engine_lora_slot_bytes", engine.model.lora_slot_bytes(),
             "Preallocated stacked LoRA slot tensors (all layers, all slots)."),
            ("loraplane_engine_lora_temp_buffer_bytes", engine.lora_temp_buffer_bytes(),
             "Upper bound of LoRA temporary buffers per step (plan buffers + shrink intermediate)."),
            ("loraplane_engine_kv_cache_bytes", engine.kv.nbytes, "KV-cache buffers."),
            ("loraplane_engine_lora_merged_bytes", engine.model.merged_nbytes(),
             "Merged weight copies held (dynamic merge; the base weights are never written)."),
            ("loraplane_engine_adapters_registered", len(tiers.registered), "Adapters registered (any tier)."),
        ):
            gauge = GaugeMetricFamily(name, help_text)
            gauge.add_metric([], value)
            yield gauge
