"""A vLLM-shaped /metrics exposition for the scrape tests (the families and label sets vLLM 0.32's Prometheus
logger writes, histograms included, and the residency gauges of vLLM PR #54830)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
           80.0, 160.0, 640.0, 2560.0)
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
              "iteration_tokens_total", "request_params_max_tokens", "request_max_num_generation_tokens")


def exposition(model: str = "base-llm", waiting: int = 0, running: int = 0, kv: float = 0.0, max_lora: int = 4,
               lora_info: Iterable[tuple[Iterable[str], Iterable[str], float]] | None = (((), (), 1.0),),
               loaded: Mapping[str, tuple[str, bool]] | None = None, gpu_loaded: int | None = None,
               max_gpu: int | None = None, engines: int = 1) -> str:
    """The text vLLM would serve: ``lora_info`` is the ``lora_requests_info`` series ever set (running adapters,
    waiting adapters, timestamp; None: none), ``loaded`` adapter -> (level, pinned) for ``vllm:lora_adapter_loaded``
    (None: the gauges of vLLM PR #54830 are not exported)."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    gauges = {name: Gauge(f"vllm:{name}", name, labels, registry=registry)
              for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
    for engine in range(engines):
        gauges["num_requests_running"].labels(model, str(engine)).set(running / engines)
        gauges["num_requests_waiting"].labels(model, str(engine)).set(waiting / engines)
        gauges["kv_cache_usage_perc"].labels(model, str(engine)).set(kv)
    for name in ("prompt_tokens", "generation_tokens", "num_preemptions", "prefix_cache_queries",
                 "prefix_cache_hits"):
        Counter(f"vllm:{name}", name, labels, registry=registry).labels(model, "0").inc(1234)
    success = Counter("vllm:request_success", "success", [*labels, "finished_reason"], registry=registry)
    for reason in ("stop", "length", "abort"):
        success.labels(model, "0", reason).inc(7)
    for name in HISTOGRAMS:
        histogram = Histogram(f"vllm:{name}", name, labels, buckets=BUCKETS, registry=registry)
        for value in (0.003, 0.2, 3.0):
            histogram.labels(model, "0").observe(value)
    Gauge("vllm:cache_config_info", "cache", ["block_size", "num_gpu_blocks", "cache_dtype"],
          registry=registry).labels("16", "8192", "auto").set(1)
    if lora_info is not None:
        info = Gauge("vllm:lora_requests_info", "lora", ["max_lora", "running_lora_adapters",
                                                          "waiting_lora_adapters"], registry=registry)
        for busy, queued, stamp in lora_info:
            info.labels(str(max_lora), ",".join(busy), ",".join(queued)).set(stamp)
    if loaded is not None:
        resident = Gauge("vllm:lora_adapter_loaded", "loaded", [*labels, "adapter_name", "level", "pinned"],
                         registry=registry)
        for name, (level, pinned) in loaded.items():
            resident.labels(model, "0", name, level, str(pinned).lower()).set(1)
            if level == "gpu":  # vLLM's host cache holds the GPU-resident adapters too
                resident.labels(model, "0", name, "cpu", str(pinned).lower()).set(1)
        gpu = sum(1 for level, _ in loaded.values() if level == "gpu") if gpu_loaded is None else gpu_loaded
        Gauge("vllm:num_gpu_loaded_lora_adapters", "gpu", labels, registry=registry).labels(model, "0").set(gpu)
        Gauge("vllm:num_cpu_loaded_lora_adapters", "cpu", labels, registry=registry).labels(model, "0").set(len(loaded))
    if max_gpu is not None:
        Gauge("vllm:max_gpu_lora_adapters", "slots", labels, registry=registry).labels(model, "0").set(max_gpu)
    return generate_latest(registry).decode()
