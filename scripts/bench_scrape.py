"""The picker's CPU in scrape mode (``--data-source scrape``) against N endpoints serving a vLLM-shaped /metrics.

    .venv/bin/python scripts/bench_scrape.py [--endpoints 32] [--intervals 0.05 0.1 0.25 0.5 1] [--seconds 10]

One helper process serves every endpoint (an aiohttp server per port, the exposition vLLM's Prometheus logger
writes: request gauges, counters, 12 histograms of 22 buckets, lora_requests_info, the residency gauges of vLLM
PR #54830; ~35 kB, the adapter lists changing on every scrape). For each interval a ``loraplane-picker`` runs with
``--config peer:gie-lora-affinity`` and every endpoint; after a warm-up its CPU time (utime + stime of
/proc/<pid>/stat) is read over ``--seconds``. Prints one JSON object: per interval the picker's share of one core,
the scrapes per second the endpoints answered, the CPU per scrape, failed scrapes and the endpoints' process's
share of a core (when it saturates, the answered rate is its limit, not the picker's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
           80.0, 160.0, 640.0, 2560.0)
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
              "iteration_tokens_total", "request_params_max_tokens", "request_max_num_generation_tokens")


def exposition(pod: int, tick: int) -> str:
    """What pod ``pod`` serves at its ``tick``-th scrape."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    model = "meta-llama/Llama-3.1-8B-Instruct"
    for name, value in (("num_requests_running", 8 + tick % 5), ("num_requests_waiting", tick % 3),
                        ("kv_cache_usage_perc", 0.3 + (tick % 7) / 100)):
        Gauge(f"vllm:{name}", name, labels, registry=registry).labels(model, "0").set(value)
    for name in ("prompt_tokens", "generation_tokens", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits"):
        Counter(f"vllm:{name}", name, labels, registry=registry).labels(model, "0").inc(1000 + tick)
    for name in HISTOGRAMS:
        histogram = Histogram(f"vllm:{name}", name, labels, buckets=BUCKETS, registry=registry)
        for value in (0.003, 0.2, 3.0):
            histogram.labels(model, "0").observe(value)
    adapters = [f"tenant-{(pod * 7 + tick + k) % 500}" for k in range(3)]
    info = Gauge("vllm:lora_requests_info", "lora", ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                 registry=registry)
    info.labels("4", ",".join(adapters), ",".join(adapters)).set(1.7e9 + tick)
    info.labels("4", "", "").set(1.7e9 + tick - 1)
    loaded = Gauge("vllm:lora_adapter_loaded", "loaded", [*labels, "adapter_name", "level", "pinned"],
                   registry=registry)
    for k in range(16):
        level = "gpu" if k < 4 else "cpu"
        loaded.labels(model, "0", f"tenant-{(pod * 16 + k) % 500}", level, "false").set(1)
    Gauge("vllm:num_gpu_loaded_lora_adapters", "gpu", labels, registry=registry).labels(model, "0").set(4)
    Gauge("vllm:max_gpu_lora_adapters", "slots", labels, registry=registry).labels(model, "0").set(4)
    return generate_latest(registry).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def serve_pods(ports: list[int]) -> None:
    """Every endpoint (the helper process); GET /count on the first port says how many scrapes were answered."""
    texts = [[exposition(pod, tick) for tick in range(16)] for pod in range(len(ports))]
    served = [0] * len(ports)

    async def count(_request: web.Request) -> web.Response:
        return web.Response(text=str(sum(served)))

    for pod, port in enumerate(ports):
        async def metrics(_request: web.Request, pod: int = pod) -> web.Response:
            served[pod] += 1
            return web.Response(text=texts[pod][served[pod] % 16], content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/count", count)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def answered(port: int) -> int:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/count", timeout=5) as reply:
        return int(reply.read())


def scrape_errors(port: int) -> int:
    """The picker's failed scrapes so far (``loraplane_picker_scrapes_total{result="error"}``)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith('loraplane_picker_scrapes_total{result="error"}'):
                return int(float(line.split()[-1]))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoints", type=int, default=32)
    p.add_argument("--intervals", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5, 1.0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--serve", type=int, nargs="+", help=argparse.SUPPRESS)  # the helper process
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve_pods(args.serve))
        return 0
    ports = [free_port() for _ in range(args.endpoints)]
    pods = subprocess.Popen([sys.executable, __file__, "--serve", *map(str, ports)])
    sample = exposition(0, 0)
    results = []
    try:
        time.sleep(2.0 + args.endpoints * 0.05)
        for interval in args.intervals:
            metrics_port = free_port()
            command = [sys.executable, "-m", "loraplane.picker.cli", "--pool", "bench", "--data-source", "scrape",
                       "--config", "peer:gie-lora-affinity", "--scrape-interval", str(interval),
                       "--grpc-address", f"127.0.0.1:{free_port()}", "--health-address", "",
                       "--metrics-address", f"127.0.0.1:{metrics_port}",
                       "--log-level", "WARNING",
                       *[arg for i, port in enumerate(ports) for arg in ("--endpoint", f"pod-{i}=127.0.0.1:{port}")]]
            picker = subprocess.Popen(command)
            try:
                time.sleep(args.warmup + 2.0)
                cpu0, count0, t0 = cpu_seconds(picker.pid), answered(ports[0]), time.monotonic()
                helper0, errors0 = cpu_seconds(pods.pid), scrape_errors(metrics_port)
                time.sleep(args.seconds)
                cpu1, count1, t1 = cpu_seconds(picker.pid), answered(ports[0]), time.monotonic()
                helper1, errors1 = cpu_seconds(pods.pid), scrape_errors(metrics_port)
            finally:
                picker.terminate()
                picker.wait(10)
            rate = (count1 - count0) / (t1 - t0)
            results.append({"interval_s": interval, "core_share": round((cpu1 - cpu0) / (t1 - t0), 3),
                            "scrapes_per_s": round(rate, 1), "target_scrapes_per_s": round(args.endpoints / interval, 1),
                            "cpu_us_per_scrape": round((cpu1 - cpu0) / max(1, count1 - count0) * 1e6, 1),
                            "failed_scrapes": errors1 - errors0,
                            "endpoints_process_core_share": round((helper1 - helper0) / (t1 - t0), 3)})
    finally:
        pods.terminate()
        pods.wait(10)
    print(json.dumps({"endpoints": args.endpoints, "exposition_bytes": len(sample.encode()), "seconds": args.seconds,
                      "cpus": os.cpu_count(), "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
