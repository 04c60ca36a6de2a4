"""The emulator's ``/metrics``: vLLM's series with vLLM's names and labels, written out by hand (Prometheus text).

Histograms take weighted observations (a run of identical steps observes its inter-token latency once per token
in one call). Series of vLLM 0.32, of vLLM's open residency PR stack (#51433 -> #54830 -> #54833) and the
emulator's own are listed in ``docs/emulator.md``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplane.api import Tier
from loraplane.api import vllm_metrics as names

if TYPE_CHECKING:
    from loraplane.emulator.engine import Engine

CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"

#: vLLM 0.32's bucket bounds (vllm/v1/metrics/buckets.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
#: the residency PR's adapter load histogram (its bounds are the emulator's choice: milliseconds to seconds)
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


@dataclass
class Histogram:
    """Cumulative-bucket histogram."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    count: int = 0
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float, times: int = 1) -> None:
        """``times`` observations of ``value``."""
        index = bisect_left(self.bounds, value)
        if index < len(self.bounds):
            self.counts[index] += times
        self.count += times
        self.total += value * times


@dataclass
class EngineStats:
    """Counters and histograms the engine feeds."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    lora_load: Histogram = field(default_factory=lambda: Histogram(LOAD_BUCKETS))
    #: adapters brought into a GPU slot, by the tier they came from ("cpu": host copy, "disk": read from disk)
    lora_loads: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "disk": 0})
    #: of those, the loads ``/v1/load_lora_adapter`` made (registrations; the rest: requests' loads)
    lora_api_loads: int = 0
    #: copies pushed out of a GPU slot while requests using them ran (vLLM's LRU spares none: the next step brings
    #: each back, pushing out the batch's next oldest)
    running_evictions: int = 0


def _labels(labels: dict[str, str]) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in sorted(labels.items())) + "}" if labels else ""


def _number(value: float) -> str:
    return repr(float(value))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples: Iterable[tuple[str, dict[str, str], float]]) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        self.lines += [f"{sample}{_labels(labels)} {_number(value)}" for sample, labels, value in samples]

    def gauge(self, name: str, help_text: str, labels: dict[str, str], value: float) -> None:
        self.family(name, "gauge", help_text, [(name, labels, value)])

    def counter(self, name: str, help_text: str, labels: dict[str, str], value: float) -> None:
        self.family(name, "counter", help_text, [(f"{name}_total", labels, value)])

    def histogram(self, name: str, help_text: str, labels: dict[str, str], hist: Histogram) -> None:
        samples, cumulative = [], 0
        for bound, count in zip(hist.bounds, hist.counts, strict=True):
            cumulative += count
            samples.append((f"{name}_bucket", {**labels, "le": _number(bound)}, float(cumulative)))
        samples.append((f"{name}_bucket", {**labels, "le": "+Inf"}, float(hist.count)))
        samples += [(f"{name}_count", labels, float(hist.count)), (f"{name}_sum", labels, hist.total)]
        self.family(name, "histogram", help_text, samples)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(engine: Engine, model_name: str, start_time: float, wall: Callable[[float], float]) -> str:
    """The exposition of ``engine``'s state; ``wall`` turns engine time into ``time.time()`` seconds."""
    stats = engine.stats
    out = _Writer()
    base = {"engine": "0", names.MODEL_NAME_LABEL: model_name}
    out.gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.", {}, start_time)
    out.gauge(names.RUNNING, "Number of requests in model execution batches.", base, len(engine.running))
    out.gauge(names.WAITING, "Number of requests waiting to be processed.", base, len(engine.waiting))
    out.gauge(names.KV_USAGE, "KV-cache usage. 1 means 100 percent usage.", base, engine.pool.usage)
    out.counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", base,
                stats.prefix_queries)
    out.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", base,
                stats.prefix_hits)
    out.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", base, stats.preemptions)
    out.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", base, stats.prompt_tokens)
    out.counter("vllm:generation_tokens", "Number of generation tokens processed.", base, stats.generation_tokens)
    out.family("vllm:request_success", "counter", "Count of successfully processed requests.",
               [("vllm:request_success_total", {**base, "finished_reason": reason}, float(count))
                for reason, count in stats.finished.items()])
    out.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", base,
                  stats.ttft)
    out.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", base, stats.itl)
    out.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", base,
                  stats.e2e)
    out.histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", base,
                  stats.queue)
    out.family(names.LORA_REQUESTS_INFO, "gauge", "Running stats on lora requests.",
               [(names.LORA_REQUESTS_INFO, {names.MAX_LORA_LABEL: str(engine.config.max_loras),
                                            names.RUNNING_ADAPTERS_LABEL: combo, names.WAITING_ADAPTERS_LABEL: combo},
                 wall(stamp)) for combo, stamp in engine.lora_requests_series().items()])
    # vLLM's open residency PR stack
    cache = engine.cache
    resident = [(lora, cache.tier(lora.int_id)) for lora in engine.registered.values()]
    out.family(names.LORA_ADAPTER_LOADED, "gauge", "LoRA adapters resident per level (1 = resident).",
               [(names.LORA_ADAPTER_LOADED, {names.ADAPTER_LABEL: lora.name, names.LEVEL_LABEL: tier.value,
                                             names.PINNED_LABEL: "false", "rank": str(lora.files.rank)}, 1.0)
                for lora, tier in resident if tier is not Tier.DISK])
    out.gauge(names.NUM_GPU_LOADED, "LoRA adapter copies in GPU slots.", base, len(cache.active))
    out.gauge(names.NUM_CPU_LOADED, "LoRA adapter copies in host memory (those in GPU slots too).", base,
              len(cache.host))
    out.gauge(names.MAX_GPU_ADAPTERS, "GPU LoRA slots (max_loras).", base, cache.max_loras)
    out.histogram("vllm:lora_adapter_load_seconds", "Histogram of LoRA adapter load time in seconds.", base,
                  stats.lora_load)
    # the emulator's own
    out.family("loraplane_emulator_lora_loads", "counter",
               "Adapters brought into a GPU slot, by the tier they came from.",
               [("loraplane_emulator_lora_loads_total", {**base, "tier": tier}, float(count))
                for tier, count in stats.lora_loads.items()])
    out.counter("loraplane_emulator_lora_api_loads",
                "Of the adapters brought into a GPU slot, those /v1/load_lora_adapter brought (not a request).", base,
                float(stats.lora_api_loads))
    out.counter("loraplane_emulator_running_lora_evictions",
                "Adapters pushed out of a GPU slot while requests using them were running.", base,
                float(stats.running_evictions))
    return out.text()
