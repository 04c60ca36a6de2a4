"""``loraplane bench picker``: scoring cost, and the picker behind a real Envoy against a naive baseline.

Prints one JSON object. Sections:

- ``scoring``: decision time (route resolution + scheduling) at 10 / 100 / 1,000 endpoints, 10,000 adapters.
- ``report_notices``: thread CPU per residency-report notice (parse, store, bring the snapshot up to date) at
  ``--report-pods`` pods holding 40 adapters each: a full snapshot rebuild against the in-place update.
- ``proto``: parse + serialise cost of one ext_proc exchange's messages with each proto package available.
- ``prefix``: thread CPU per request of the prefix scorer's work (hash the parsed body, match, record) per body size,
  next to scheduling without it, in this process (``--no-prefix-scorer`` runs the Envoy part without it).
- ``envoy``: a real Envoy with the ext_proc filter in front of Debian's nginx (one server block per endpoint, the
  sidecars' reports written to a real Redis). Open-loop offered loads at 1 KiB and 64 KiB bodies; added latency =
  (Envoy + picker) - (Envoy alone) from the same run. ``cpu_us_per_request`` and ``max_rps_one_core`` come from
  closed-loop ``wrk`` runs with the picker pinned to its own core (``max_rps_one_core`` = achieved req/s divided by
  the fraction of that core the picker used, i.e. extrapolated to a full core when something else was the limit),
  alternated with the naive baseline's ``--closed-rounds`` times: the medians, each run in ``closed_loop_runs``
  (one run each swung the naive baseline's CPU per request between 480 and 800 us on the same machine).
  Each closed-loop request's prompt starts with its own counter (one session per request, the same length): with
  one body for all, the prefix scorer would rightly keep every request on one endpoint until it saturates, and the
  run would measure the flow-control queue instead of the routing path.
- ``naive``: the same for ``loraplane.picker.naive``.
- ``frame_layers`` (``--frame-layers``): the picker's closed-loop CPU per request and max req/s on one core with its
  hand-written HTTP/2 frame layer (``hand``) and with the ``h2`` package's (``h2lib``), alternated in one run behind
  the same Envoy, each run's errors from a short open-loop check, and the medians' ratios.
- ``replicas`` (``--replicas N``): 1 and N picker replicas behind one Envoy, sharing their requests in flight
  through Redis (``loraplane.picker.replicas``), closed loop: CPU per request summed over the replicas, and
  ``max_rps_a_core_each`` = N / that CPU (every replica pinned to ``--picker-cpu`` here: the achieved rate of N
  replicas on one core cannot show scaling); ``max_rps_ratio`` = N replicas' over one's.

- ``route_churn`` (``--route-churn S``): the picker's open-loop rows at ``--churn-rates`` (1 KiB bodies) with a
  route table of ``--adapters`` names, quiet and with a route change every S seconds, alternated
  ``--closed-rounds`` times in one run: each change is one name's revisions re-weighted, written as the controller
  writes them (``RedisStore.write_routes``: one delta and the head, and the change notice), which the picker applies
  off its request path. ``added_p99_ms`` = churn p99 - quiet p99 (medians), with the changes written and their bytes.

Pinning: the picker (or the naive servicer) runs on ``--picker-cpu``; Envoy, nginx, wrk and this process's load
generator on ``--load-cpu``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from loraplane.api import (
    AdapterResidency,
    PodLoad,
    ResidencyReport,
    RouteEntry,
    RouteTable,
    Tier,
    WeightedRevision,
    keys,
)
from loraplane.helptext import HelpFormatter
from loraplane.picker.envoy import ExtProcModes, PickerEndpoint, direct_config, picker_config
from loraplane.picker.lifecycle import InFlightRequest, PluginRuntime
from loraplane.picker.plugins import SchedulingRequest
from loraplane.picker.prefix import PrefixCacheScorer, PrefixRouting, without_prefix_scorer
from loraplane.picker.routes import RouteResolver
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from loraplane.picker.snapshot import EndpointState, InFlightTracker, PoolSnapshot
from loraplane.picker.state import PoolState
from loraplane.picker.telemetry import PickerMetrics
from loraplane.processes import ManagedProcess, envoy_binary, free_port, start_redis, wait_for_port

LOOPBACK = "127.0.0.1"
POOL = "bench"
DIGEST = "sha256:" + "d" * 64
#: the reports are written once (no sidecars): the picker is told to count them with this TTL (two days)
REPORT_TTL_S = 172_800.0


# --- scoring ------------------------------------------------------------------------------------------------------


def _adapter(i: int) -> str:
    return f"adapter-{i}"


def _address(pod: int) -> str:
    return f"10.{pod // 65536}.{pod // 256 % 256}.{pod % 256}:8000"


def scoring(endpoint_counts: Sequence[int], adapters: int, decisions: int, seed: int = 0) -> list[dict[str, Any]]:
    """p50/p99 of resolve + schedule over a pool where each endpoint holds 40 adapters (4 GPU, 12 CPU, 24 disk), for
    adapters some endpoint holds (a request for one no endpoint holds waits in flow control: no endpoint can serve
    it)."""
    rng = np.random.default_rng(seed)
    table = RouteTable(pool=POOL, generation=1, updated_at=0.0, models={
        _adapter(i): RouteEntry(revisions=[WeightedRevision(revision="v1", served_name=f"{_adapter(i)}@v1", digest=DIGEST, weight=100)])
        for i in range(adapters)
    })
    resolver = RouteResolver(table)
    scheduler = Scheduler.default()
    rows = []
    for count in endpoint_counts:
        endpoints = []
        for e in range(count):
            held = rng.choice(adapters, 40, replace=False)
            tiers = [Tier.GPU] * 4 + [Tier.CPU] * 12 + [Tier.DISK] * 24
            endpoints.append(EndpointState(
                name=f"pod-{e}", address=_address(e),
                queue_depth=int(rng.integers(0, 4)), running=int(rng.integers(0, 8)),
                active_tokens=int(rng.integers(0, 4000)), kv_utilization=float(rng.random() * 0.7),
                residency={f"{_adapter(int(a))}@v1": (t, DIGEST) for a, t in zip(held, tiers, strict=True)},
            ))
        pool = PoolSnapshot(endpoints, resolver.priorities())
        pool.in_flight[:] = rng.integers(0, 10, count)
        held_somewhere = sorted({name[:-3] for e in endpoints for name in e.residency})  # "adapter-N@v1" -> "adapter-N"
        models = [held_somewhere[int(i)] for i in rng.integers(0, len(held_somewhere), decisions)]
        wall, cpu = np.empty(decisions), np.empty(decisions)
        for n, model in enumerate(models):
            w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            route = resolver.resolve(model, f"user-{n}", rng)
            scheduler.schedule(SchedulingRequest(route.served_name, route.digest, route.priority, route.tenant), pool, rng)
            cpu[n], wall[n] = time.thread_time_ns() - c0, time.perf_counter_ns() - w0
        rows.append({"endpoints": count, "adapters": adapters,
                     "p50_us": round(float(np.percentile(wall, 50)) / 1e3, 1),
                     "p99_us": round(float(np.percentile(wall, 99)) / 1e3, 1),
                     "cpu_p99_us": round(float(np.percentile(cpu, 99)) / 1e3, 1)})
    return rows


# --- report notices -----------------------------------------------------------------------------------------------


def _pod_report(pod: int, held: np.ndarray, heartbeat: float, rng: np.random.Generator) -> ResidencyReport:
    """A sidecar's report: 40 adapters (4 GPU, 12 CPU, 24 disk, their order shuffled per report) and its load."""
    order = rng.permutation(len(held))
    tiers = [Tier.GPU] * 4 + [Tier.CPU] * 12 + [Tier.DISK] * 24
    rows = [AdapterResidency(served_name=f"{_adapter(int(held[i]))}@v1", tier=tier, digest=DIGEST)
            for i, tier in zip(order, tiers, strict=True)]
    return ResidencyReport(pool=POOL, pod=f"pod-{pod}", address=_address(pod),
                           heartbeat_at=heartbeat, ttl_seconds=REPORT_TTL_S, adapters=rows,
                           load=PodLoad(queue_depth=int(rng.integers(0, 4)), running=int(rng.integers(0, 8)),
                                        max_gpu_slots=4))


def report_notices(pod_counts: Sequence[int], adapters: int, notices: int, seed: int = 0) -> list[dict[str, Any]]:
    """Thread CPU per residency-report notice in the picker's ``PoolState``: parse the report one pod published
    (its GPU set reshuffled, its load changed), store it and bring the snapshot up to date, with a full rebuild (the
    picker before stop 53) and in place (``PoolState.refresh``), alternated on the same notices; medians."""
    rng = np.random.default_rng(seed)
    rows = []
    for count in pod_counts:
        held = [rng.choice(adapters, 40, replace=False) for _ in range(count)]
        raws = [_pod_report(int(pod), held[int(pod)], 1.0 + n, rng).to_json()
                for n, pod in enumerate(rng.integers(0, count, notices))]
        timings: dict[str, list[float]] = {"rebuild": [], "in_place": []}
        for mode in ("rebuild", "in_place", "rebuild", "in_place"):
            state = PoolState(POOL, InFlightTracker(), time.monotonic, metrics=PickerMetrics(CollectorRegistry()),
                              max_ttl_s=REPORT_TTL_S)
            state.set_routes(None)
            for pod in range(count):
                state.set_report(_pod_report(pod, held[pod], 0.0, rng))
            state.rebuild()
            apply = state.rebuild if mode == "rebuild" else state.refresh
            for raw in raws:
                c0 = time.thread_time_ns()
                state.set_report(ResidencyReport.from_json(raw))
                apply()
                timings[mode].append((time.thread_time_ns() - c0) / 1e3)
        rebuild, in_place = (float(np.median(timings[m])) for m in ("rebuild", "in_place"))
        rows.append({"pods": count, "adapters_per_pod": 40, "rebuild_us": round(rebuild, 1),
                     "in_place_us": round(in_place, 1), "speedup": round(rebuild / in_place, 1),
                     "notices_per_s_one_core_in_place": round(1e6 / in_place)})
    return rows


# --- proto packages -----------------------------------------------------------------------------------------------


def bench_request_path(body_sizes: Sequence[int] = (1024, 65536), rounds: int = 400,
                       endpoints: int = 4) -> list[dict[str, Any]]:
    """Thread CPU per request (median, microseconds) of the picker's prefix work with the default profile: hashing
    the parsed body, scheduling with the match, and recording where it went; next to scheduling the same request
    with a profile without the scorer, alternated in one run. The same completion body every request (as the
    Envoy rows of ``loraplane bench picker`` send), so after the first every block matches on one pod."""
    import orjson

    digest = "sha256:" + "d" * 64
    pool = PoolSnapshot([EndpointState(name=f"pod-{i}", address=f"10.0.0.{i + 1}:8000",
                                       residency={"claims@v1": (Tier.GPU if i == 0 else Tier.CPU, digest)})
                         for i in range(endpoints)])
    config = EndpointPickerConfig.load()
    with_prefix, without = Scheduler(config), Scheduler(without_prefix_scorer(config))
    scorer = with_prefix.preparer(PrefixCacheScorer)
    assert scorer is not None and without.preparer(PrefixCacheScorer) is None
    recorder = PrefixRouting(scorer, PluginRuntime(None, time.monotonic))  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    rows = []
    for size in body_sizes:
        prompt = "x" * max(0, size - 60)
        document = orjson.loads(orjson.dumps({"model": "claims", "max_tokens": 16, "prompt": prompt}))
        on, off = np.empty(rounds), np.empty(rounds)
        for n in range(rounds):
            start = time.thread_time_ns()
            request = with_prefix.read_body(SchedulingRequest("claims@v1", digest), document)
            decision = with_prefix.schedule(request, pool, rng)
            recorder.pre_request(InFlightRequest(request, "t", decision.endpoints[0]))
            on[n] = time.thread_time_ns() - start
            start = time.thread_time_ns()
            without.schedule(SchedulingRequest("claims@v1", digest), pool, rng)
            off[n] = time.thread_time_ns() - start
        on_us, off_us = float(np.median(on)) / 1e3, float(np.median(off)) / 1e3
        rows.append({"body_bytes": size, "blocks": len(request.prefix.hashes) if request.prefix else 0,
                     "with_prefix_us": round(on_us, 1), "without_us": round(off_us, 1),
                     "added_us": round(on_us - off_us, 1)})
    return rows



def proto_costs(rounds: int = 3000) -> dict[str, float | None]:
    """Microseconds to parse a 1 KiB request-body ProcessingRequest and build + serialise the routed response."""
    from envoy.config.core.v3 import base_pb2 as core
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    body = json.dumps({"model": "claims", "prompt": "x" * 980}).encode()
    wire = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)).SerializeToString()

    def xds() -> None:
        request = pb.ProcessingRequest.FromString(wire)
        header = core.HeaderValueOption(header=core.HeaderValue(key="x-gateway-destination-endpoint", raw_value=b"10.0.0.1:8000"))
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[header]), clear_route_cache=True)
        common.body_mutation.body = request.request_body.body
        pb.ProcessingResponse(request_body=pb.BodyResponse(response=common)).SerializeToString()

    results: dict[str, float | None] = {"xds_protos_us": _time_us(xds, rounds), "envoy_data_plane_us": None}
    try:
        from envoy_data_plane.envoy.config.core import v3 as edp_core
        from envoy_data_plane.envoy.service.ext_proc import v3 as edp
    except ImportError:
        return results

    def betterproto() -> None:
        request = edp.ProcessingRequest().parse(wire)
        header = edp_core.HeaderValueOption(header=edp_core.HeaderValue(key="x-gateway-destination-endpoint", raw_value=b"10.0.0.1:8000"))
        common = edp.CommonResponse(header_mutation=edp.HeaderMutation(set_headers=[header]), clear_route_cache=True,
                                    body_mutation=edp.BodyMutation(body=request.request_body.body))
        bytes(edp.ProcessingResponse(request_body=edp.BodyResponse(response=common)))

    results["envoy_data_plane_us"] = _time_us(betterproto, max(100, rounds // 10))
    return results


def _time_us(fn: Any, rounds: int) -> float:
    for _ in range(min(100, rounds)):
        fn()
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return round((time.perf_counter() - start) / rounds * 1e6, 2)


# --- processes ----------------------------------------------------------------------------------------------------


def _pinned(args: Sequence[str], cpu: int | None) -> list[str]:
    return ["taskset", "-c", str(cpu), *args] if cpu is not None else list(args)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- load ---------------------------------------------------------------------------------------------------------


class _HttpConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; completes a future per response."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None:
            return
        head = bytes(self.buffer[:end]).lower()
        length = 0
        for line in head.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        if len(self.buffer) < end + 4 + length:
            return
        status = int(head.split(b" ", 2)[1])
        del self.buffer[: end + 4 + length]
        waiter, self.waiter = self.waiter, None
        if not waiter.done():
            waiter.set_result(status)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(0)


async def _open_loop(port: int, request: bytes, rate: float, duration: float) -> dict[str, float]:
    """Send ``request`` at ``rate``/s for ``duration`` s on as many keep-alive connections as needed."""
    loop = asyncio.get_running_loop()
    idle: list[_HttpConnection] = []
    latencies: list[float] = []
    errors = 0
    tasks: set[asyncio.Task[None]] = set()

    async def one() -> None:
        nonlocal errors
        conn = idle.pop() if idle else None
        if conn is None or conn.transport is None or conn.transport.is_closing():
            _, conn = await loop.create_connection(_HttpConnection, LOOPBACK, port)
        assert conn.transport is not None
        conn.waiter = loop.create_future()
        start = time.perf_counter()
        conn.transport.write(request)
        status = await conn.waiter
        if status == 200:
            latencies.append(time.perf_counter() - start)
            idle.append(conn)
        else:
            errors += 1
            conn.transport.close()

    total = int(rate * duration)
    begin = loop.time()
    for n in range(total):
        delay = begin + n / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
    elapsed = loop.time() - begin
    for conn in idle:
        if conn.transport is not None:
            conn.transport.close()
    values = np.asarray(latencies) * 1e3 if latencies else np.asarray([float("nan")])
    return {"achieved_rps": len(latencies) / elapsed, "p50_ms": float(np.percentile(values, 50)),
            "p99_ms": float(np.percentile(values, 99)), "errors": errors}


def _http_request(port: int, body: bytes) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nhost: {LOOPBACK}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-session-id: bench\r\n\r\n").encode() + body


def _body(size: int) -> bytes:
    base = {"model": "claims", "max_tokens": 16, "prompt": ""}
    filler = size - len(json.dumps(base))
    return json.dumps({**base, "prompt": "x" * max(0, filler)}).encode()


def _wrk(port: int, body_file: Path, seconds: int, connections: int, cpu: int | None, workdir: Path) -> float:
    script = workdir / "post.lua"
    script.write_text(  # the prompt's first 8 characters become a per-request counter (see the module docstring)
        f'wrk.method = "POST"\nlocal f = io.open("{body_file}", "rb")\nlocal body = f:read("*a")\nf:close()\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        'local head, tail = body:match(\'^(.-"prompt": ")(.*)$\')\ntail = tail:sub(9)\nlocal n = 0\n'
        'request = function()\n  n = n + 1\n'
        '  return wrk.format(nil, nil, nil, head .. string.format("%08d", n % 100000000) .. tail)\nend\n'
    )
    prefix = ["taskset", "-c", str(cpu)] if cpu is not None else []
    out = subprocess.run([*prefix, "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(script),
                          f"http://{LOOPBACK}:{port}/v1/completions"], capture_output=True, text=True, timeout=seconds + 60)
    for line in out.stdout.splitlines():
        if "requests in" in line:
            return float(line.split()[0])
    raise RuntimeError(f"wrk failed: {out.stdout}{out.stderr}")


# --- the Envoy benchmark ------------------------------------------------------------------------------------------


@dataclass
class _Stack:
    workdir: Path
    backends: list[int]
    redis_url: str
    args: argparse.Namespace
    started: list[ManagedProcess] = field(default_factory=list)

    def start(self, args: Sequence[str], name: str, port: int, cpu: int | None) -> ManagedProcess:
        proc = ManagedProcess(_pinned(args, cpu), self.workdir / f"{name}.log").start()
        self.started.append(proc)
        wait_for_port(port, proc=proc.proc, timeout=30)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            proc.stop()

    def envoy(self, config: dict[str, Any], name: str) -> tuple[ManagedProcess, int]:
        listen = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
        path = self.workdir / f"{name}.json"
        path.write_text(json.dumps(config))
        args = [envoy_binary(), "-c", str(path), "--concurrency", "1", "-l", "error", "--base-id", str(listen)]
        return self.start(args, name, listen, self.args.load_cpu), listen

    def picker(self, naive: bool, transport: str = "h2", replica: str = "picker-0") -> tuple[ManagedProcess, int]:
        port = free_port()
        if naive:
            args = [sys.executable, "-m", "loraplane.picker.naive", "--address", f"{LOOPBACK}:{port}",
                    *(x for b in self.backends for x in ("--endpoint", f"{LOOPBACK}:{b}"))]
        else:
            args = [sys.executable, "-m", "loraplane.picker.cli", "--pool", POOL, "--redis-url", self.redis_url,
                    "--grpc-address", f"{LOOPBACK}:{port}", "--health-address", "", "--metrics-address", "",
                    "--no-destination-fallbacks", "--no-response-rewrite", "--log-level", "WARNING",
                    "--transport", transport, "--max-report-ttl-seconds", str(REPORT_TTL_S), "--replica", replica]
            config = EndpointPickerConfig.load().with_parameters("flow-control", enabled=self.args.flow_control)
            if not self.args.prefix_scorer:
                config = without_prefix_scorer(config)
            config_path = self.workdir / "picker-config.yaml"
            config_path.write_text(config.to_yaml())
            args += ["--config", str(config_path)]
        proc = self.start(args, "naive" if naive else replica, port, self.args.picker_cpu)
        time.sleep(1.0)  # first Redis sync
        return proc, port


def _nginx(work: Path, count: int, cpu: int | None) -> tuple[ManagedProcess, list[int]]:
    ports = [free_port() for _ in range(count)]
    servers = "\n".join(
        f"server {{ listen {LOOPBACK}:{p}; location / {{ default_type application/json; "
        f"return 200 '{{\"model\":\"claims@v1\",\"pod\":{i}}}'; }} }}" for i, p in enumerate(ports))
    conf = work / "nginx.conf"
    conf.write_text(
        f"worker_processes 1; daemon off; pid {work}/nginx.pid; error_log {work}/nginx-error.log;\n"
        f"events {{ worker_connections 4096; }}\n"
        f"http {{ access_log off; client_body_buffer_size 256k; client_max_body_size 4m; keepalive_requests 1000000;\n"
        f"client_body_temp_path {work}/body; proxy_temp_path {work}/proxy; fastcgi_temp_path {work}/fcgi;\n"
        f"uwsgi_temp_path {work}/uwsgi; scgi_temp_path {work}/scgi;\n{servers}\n}}\n")
    proc = ManagedProcess(_pinned(["nginx", "-c", str(conf), "-p", str(work)], cpu), work / "nginx.log").start()
    for port in ports:
        wait_for_port(port, proc=proc.proc)
    return proc, ports


def _fill_redis(url: str, backends: Sequence[int]) -> None:
    import redis

    client = redis.Redis.from_url(url)
    table = RouteTable(pool=POOL, generation=1, updated_at=time.time(), models={
        "claims": RouteEntry(revisions=[WeightedRevision(revision="v1", served_name="claims@v1", digest=DIGEST, weight=100)])})
    client.set(keys.route_table(POOL), table.to_json())
    for i, backend in enumerate(backends):
        tier = Tier.GPU if i == 0 else Tier.CPU
        report = ResidencyReport(pool=POOL, pod=f"nginx-{i}", address=f"{LOOPBACK}:{backend}",
                                 heartbeat_at=time.time(), ttl_seconds=REPORT_TTL_S,
                                 adapters=[AdapterResidency(served_name="claims@v1", tier=tier, digest=DIGEST)])
        client.set(keys.residency_report(POOL, report.pod), report.to_json())
        client.sadd(keys.residency_index(POOL), report.pod)
    client.close()


def _rows(stack: _Stack, listen: int, direct: dict[tuple[int, int], dict[str, float]]) -> list[dict[str, Any]]:
    rows = []
    for size in stack.args.body_sizes:
        body = _body(size)
        for rate in stack.args.rates:
            got = asyncio.run(_open_loop(listen, _http_request(listen, body), rate, stack.args.duration))
            base = direct[(rate, size)]
            rows.append({"offered_rps": rate, "body_bytes": size, "achieved_rps": round(got["achieved_rps"], 1),
                         "added_p50_ms": round(got["p50_ms"] - base["p50_ms"], 3),
                         "added_p99_ms": round(got["p99_ms"] - base["p99_ms"], 3),
                         "p50_ms": round(got["p50_ms"], 3), "p99_ms": round(got["p99_ms"], 3),
                         "errors": int(got["errors"])})
    return rows


def _closed_loop(stack: _Stack, proc: ManagedProcess, listen: int) -> dict[str, float]:
    body_file = stack.workdir / "body-1k.json"
    body_file.write_bytes(_body(1024))
    _wrk(listen, body_file, 2, stack.args.connections, stack.args.load_cpu, stack.workdir)  # warm-up
    cpu0 = _cpu_seconds(proc.pid)
    requests = _wrk(listen, body_file, stack.args.closed_seconds, stack.args.connections, stack.args.load_cpu,
                    stack.workdir)
    cpu = _cpu_seconds(proc.pid) - cpu0
    rps = requests / stack.args.closed_seconds
    utilisation = cpu / stack.args.closed_seconds
    return {"cpu_us_per_request": round(cpu / requests * 1e6, 1),
            "max_rps_one_core": round(rps / max(utilisation, 1e-9) if utilisation < 0.95 else rps, 1),
            "closed_loop_rps": round(rps, 1), "picker_core_utilisation": round(utilisation, 3)}


def _churn_models(adapters: int) -> dict[str, RouteEntry]:
    """The bench's route (``claims``) and ``adapters`` names, one revision each."""
    models = {"claims": RouteEntry(revisions=[WeightedRevision(revision="v1", served_name="claims@v1", digest=DIGEST,
                                                               weight=100)])}
    for i in range(adapters):
        models[_adapter(i)] = RouteEntry(revisions=[
            WeightedRevision(revision="v1", served_name=f"{_adapter(i)}@v1", digest=DIGEST, weight=100)])
    return models


def _churned(base: dict[str, RouteEntry], adapters: int, change: int) -> dict[str, RouteEntry]:
    """``base`` after ``change`` changes: name ``change - 1`` (mod ``adapters``) has its traffic split between two
    revisions by a weight that differs from change to change (the others are ``base``'s own entries)."""
    models = dict(base)
    name, split = _adapter((change - 1) % adapters), 1 + change % 99
    models[name] = RouteEntry(revisions=[
        WeightedRevision(revision="v1", served_name=f"{name}@v1", digest=DIGEST, weight=100 - split),
        WeightedRevision(revision="v2", served_name=f"{name}@v2", digest=DIGEST, weight=split)])
    return models


async def _write_churn(redis_url: str, adapters: int, interval: float, signals: dict[str, Any]) -> None:
    """The writer process's loop: the table whole, then a change every ``interval`` s while ``go`` is set."""
    from redis import asyncio as aioredis

    from loraplane.controller.store import RedisStore

    client = aioredis.Redis.from_url(redis_url)
    store = RedisStore(client, time.time, writer="bench-route-churn")
    base = _churn_models(adapters)
    await store.write_routes(POOL, base, None)
    signals["table_bytes"].value = store.bytes_written
    signals["ready"].set()
    change = 0
    while not signals["quit"].is_set():
        if not signals["go"].is_set():
            signals["idle"].set()
            await asyncio.sleep(0.01)
            continue
        signals["idle"].clear()
        next_at = time.monotonic()
        while signals["go"].is_set():
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            change += 1
            before = store.bytes_written
            await store.write_routes(POOL, _churned(base, adapters, change) if adapters else base, None)
            with signals["changes"].get_lock():
                signals["changes"].value += 1
                signals["bytes"].value += store.bytes_written - before
    await client.aclose()


def _churn_process(redis_url: str, adapters: int, interval: float, signals: dict[str, Any]) -> None:
    os.nice(19)  # a controller runs on another machine: here it takes only what the load CPU leaves idle
    asyncio.run(_write_churn(redis_url, adapters, interval, signals))


class RouteChurn:
    """Route changes written as the controller writes them (``RedisStore``: a delta and the head per change) by a
    process of their own, as a controller is: the whole table once (``start``), then one change every ``interval``
    seconds while ``churning``. (A writer thread in the load generator's process held its GIL for milliseconds per
    change and showed up as the picker's latency.)"""

    def __init__(self, redis_url: str, adapters: int, interval: float) -> None:
        import multiprocessing

        self._context = multiprocessing.get_context("spawn")
        self._signals: dict[str, Any] = {
            **{name: self._context.Event() for name in ("ready", "go", "idle", "quit")},
            "changes": self._context.Value("q", 0), "bytes": self._context.Value("q", 0),
            "table_bytes": self._context.Value("q", 0, lock=False)}
        self._process = self._context.Process(target=_churn_process, name="route-churn", daemon=True,
                                              args=(redis_url, adapters, interval, self._signals))

    @property
    def changes(self) -> int:
        """Changes written so far."""
        return int(self._signals["changes"].value)

    @property
    def bytes_written(self) -> int:
        """Bytes of the changes written so far (deltas, heads; a whole table where the store chose one)."""
        return int(self._signals["bytes"].value)

    @property
    def table_bytes(self) -> int:
        """Bytes of the first write: the table whole and its head."""
        return int(self._signals["table_bytes"].value)

    def start(self) -> None:
        """Start the writer; returns once it wrote the table whole (the snapshot the changes chain onto)."""
        self._process.start()
        if not self._signals["ready"].wait(timeout=120):
            raise RuntimeError("the route churn writer did not write its table within 120 s")

    @contextlib.contextmanager
    def churning(self) -> Any:
        """Changes every ``interval`` seconds inside the block; the one under way is written whole after it."""
        self._signals["idle"].clear()
        self._signals["go"].set()
        try:
            yield
        finally:
            self._signals["go"].clear()
            self._signals["idle"].wait(timeout=60)

    def close(self) -> None:
        """Stop the writer."""
        self._signals["go"].clear()
        self._signals["quit"].set()
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()


def _route_churn(stack: _Stack, listen: int) -> dict[str, Any]:
    """The picker behind ``listen`` at ``--churn-rates``, quiet and churning, alternated ``--closed-rounds`` times."""
    args = stack.args
    churn = RouteChurn(stack.redis_url, args.adapters, args.route_churn)
    churn.start()
    time.sleep(1.0)  # the picker reads the new table (its notice, else its resync)
    rows = []
    try:
        request = _http_request(listen, _body(1024))
        for rate in args.churn_rates:
            runs: dict[str, list[dict[str, float]]] = {"quiet": [], "churn": []}
            changes = bytes_written = 0
            for _ in range(args.closed_rounds):
                runs["quiet"].append(asyncio.run(_open_loop(listen, request, rate, args.duration)))
                before = (churn.changes, churn.bytes_written)
                with churn.churning():
                    runs["churn"].append(asyncio.run(_open_loop(listen, request, rate, args.duration)))
                changes += churn.changes - before[0]
                bytes_written += churn.bytes_written - before[1]
            med = {side: {key: float(np.median([r[key] for r in got])) for key in ("p50_ms", "p99_ms", "achieved_rps")}
                   for side, got in runs.items()}
            rows.append({"offered_rps": rate, "body_bytes": 1024,
                         "quiet_p99_ms": round(med["quiet"]["p99_ms"], 3), "churn_p99_ms": round(med["churn"]["p99_ms"], 3),
                         "added_p99_ms": round(med["churn"]["p99_ms"] - med["quiet"]["p99_ms"], 3),
                         "quiet_p50_ms": round(med["quiet"]["p50_ms"], 3), "churn_p50_ms": round(med["churn"]["p50_ms"], 3),
                         "achieved_rps": {side: round(m["achieved_rps"], 1) for side, m in med.items()},
                         "errors": {side: int(sum(r["errors"] for r in got)) for side, got in runs.items()},
                         "changes": changes, "bytes_per_change": round(bytes_written / max(1, changes)),
                         "runs": {side: [{k: round(v, 3) for k, v in r.items()} for r in got] for side, got in runs.items()}})
    finally:
        churn.close()
    return {"interval_s": args.route_churn, "adapters": args.adapters, "rows": rows}


#: the closed-loop figures each side reports: the median over the rounds
CLOSED_LOOP_FIGURES = ("cpu_us_per_request", "max_rps_one_core", "closed_loop_rps", "picker_core_utilisation")


def _closed_loop_rounds(stack: _Stack, running: dict[str, tuple[ManagedProcess, int]],
                        results: dict[str, Any]) -> dict[str, Any]:
    """Closed-loop runs of every side in turn, ``--closed-rounds`` times (one side's run never sees the machine in
    another state than the other's); each side gets the medians and its ``closed_loop_runs``."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in running}
    for _ in range(stack.args.closed_rounds):
        for name, (proc, listen) in running.items():
            runs[name].append(_closed_loop(stack, proc, listen))
    out = {}
    for name, rows in runs.items():
        medians = {key: round(float(np.median([r[key] for r in rows])), 3 if key == "picker_core_utilisation" else 1)
                   for key in CLOSED_LOOP_FIGURES}
        out[name] = {**results[name], **medians, "closed_loop_runs": rows}
    return out


#: ``--transport`` of the picker for each frame layer
FRAME_LAYER_TRANSPORTS = {"hand": "h2", "h2lib": "h2lib"}


def _frame_layers(stack: _Stack, modes: ExtProcModes) -> dict[str, Any]:
    """Closed-loop CPU and max req/s of the picker with each frame layer, alternated ``--frame-layer-rounds`` times."""
    runs: dict[str, list[dict[str, float]]] = {layer: [] for layer in FRAME_LAYER_TRANSPORTS}
    for _ in range(stack.args.frame_layer_rounds):
        for layer, transport in FRAME_LAYER_TRANSPORTS.items():
            proc, picker_port = stack.picker(False, transport)
            envoy, listen = stack.envoy(picker_config(free_port(), picker_port, free_port(), modes), f"envoy-{layer}")
            check = asyncio.run(_open_loop(listen, _http_request(listen, _body(1024)), 200, 1.0))
            runs[layer].append({**_closed_loop(stack, proc, listen), "errors": int(check["errors"])})
            envoy.stop()
            proc.stop()
    out: dict[str, Any] = {}
    for layer, rows in runs.items():
        out[layer] = {key: round(float(np.median([r[key] for r in rows])), 1)
                      for key in ("cpu_us_per_request", "max_rps_one_core")}
        out[layer].update(errors=sum(int(r["errors"]) for r in rows), runs=rows)
    out["h2lib_over_hand_cpu_us"] = round(out["h2lib"]["cpu_us_per_request"] / out["hand"]["cpu_us_per_request"], 2)
    out["hand_over_h2lib_max_rps"] = round(out["hand"]["max_rps_one_core"] / out["h2lib"]["max_rps_one_core"], 2)
    return out


def _replica_runs(stack: _Stack, modes: ExtProcModes) -> dict[str, Any]:
    """1 and ``--replicas`` pickers behind one Envoy (sharing their requests in flight), closed loop, alternated
    ``--closed-rounds`` times: the replicas' CPU per request summed, and the req/s they would reach with a core each
    (replicas / CPU per request: on a machine with fewer cores than replicas the achieved rate cannot show it)."""
    counts = sorted({1, stack.args.replicas})
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in counts}
    body_file = stack.workdir / "body-1k.json"
    body_file.write_bytes(_body(1024))
    seconds = stack.args.closed_seconds
    for _ in range(stack.args.closed_rounds):
        for n in counts:
            pickers = [stack.picker(False, replica=f"picker-{i}") for i in range(n)]
            envoy, listen = stack.envoy(picker_config(free_port(), [PickerEndpoint(port) for _, port in pickers],
                                                      free_port(), modes), f"envoy-replicas-{n}")
            _wrk(listen, body_file, 2, stack.args.connections, stack.args.load_cpu, stack.workdir)  # warm-up
            cpu0 = [_cpu_seconds(proc.pid) for proc, _ in pickers]
            requests = _wrk(listen, body_file, seconds, stack.args.connections, stack.args.load_cpu, stack.workdir)
            cpu = sum(_cpu_seconds(proc.pid) - c for (proc, _), c in zip(pickers, cpu0, strict=True))
            runs[n].append({"cpu_us_per_request": round(cpu / max(requests, 1) * 1e6, 1),
                            "closed_loop_rps": round(requests / seconds, 1),
                            "max_rps_a_core_each": round(n * max(requests, 1) / max(cpu, 1e-9), 1)})
            envoy.stop()
            for proc, _ in pickers:
                proc.stop()
    out: dict[str, Any] = {str(n): {key: round(float(np.median([r[key] for r in rows])), 1) for key in rows[0]}
                           | {"runs": rows} for n, rows in runs.items()}
    top = str(counts[-1])
    out["max_rps_ratio"] = round(out[top]["max_rps_a_core_each"] / out["1"]["max_rps_a_core_each"], 2)
    return out


def envoy_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """The ``envoy``, ``cpu_us_per_request``, ``max_rps_one_core`` and ``naive`` parts."""
    with tempfile.TemporaryDirectory(prefix="loraplane-bench-picker-") as tmp:
        work = Path(tmp)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {args.load_cpu})  # this process generates the open-loop load
        nginx, backends = _nginx(work, args.endpoints, args.load_cpu)
        redis_server = start_redis(work)
        stack = _Stack(work, backends, redis_server.url, args, [nginx, redis_server.process])
        try:
            _fill_redis(redis_server.url, backends)
            envoy_direct, direct_port = stack.envoy(direct_config(free_port(), backends[0], free_port()), "envoy-direct")
            direct = {(rate, size): asyncio.run(_open_loop(direct_port, _http_request(direct_port, _body(size)), rate, args.duration))
                      for size in args.body_sizes for rate in args.rates}
            envoy_direct.stop()
            modes = ExtProcModes(response_header_mode="SKIP", response_body_mode="NONE")
            results: dict[str, Any] = {}
            running: dict[str, tuple[ManagedProcess, int]] = {}
            for name, naive in (("picker", False), ("naive", True)):
                proc, picker_port = stack.picker(naive)
                _, listen = stack.envoy(picker_config(free_port(), picker_port, free_port(), modes), f"envoy-{name}")
                running[name] = (proc, listen)
                results[name] = {"envoy": _rows(stack, listen, direct)}
            results.update(_closed_loop_rounds(stack, running, results))
            if args.route_churn > 0:
                results["route_churn"] = _route_churn(stack, running["picker"][1])
            for proc, _listen in running.values():
                proc.stop()
            if args.frame_layers:
                results["frame_layers"] = _frame_layers(stack, modes)
            if args.replicas > 1:
                results["replicas"] = _replica_runs(stack, modes)
            results["envoy_alone"] = [{"offered_rps": r, "body_bytes": s, "p50_ms": round(v["p50_ms"], 3),
                                       "p99_ms": round(v["p99_ms"], 3)} for (r, s), v in direct.items()]
            return results
        finally:
            stack.stop_all()


def parser() -> argparse.ArgumentParser:
    """Flags of ``loraplane bench picker``."""
    p = argparse.ArgumentParser(prog="loraplane bench picker", description=__doc__.split("\n\n")[0] if __doc__ else None,
                                formatter_class=HelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object (always on; kept for symmetry)")
    p.add_argument("--quick", action="store_true", help="shorter runs (smoke test; numbers are noisier)")
    p.add_argument("--scoring-only", action="store_true", help="skip the Envoy part")
    p.add_argument("--decisions", type=int, default=5000, help="scoring decisions timed per pool size")
    p.add_argument("--adapters", type=int, default=10_000, help="adapters in the scoring route table")
    p.add_argument("--report-pods", type=int, nargs="+", default=[32, 128, 512],
                   help="pool sizes of the report_notices section")
    p.add_argument("--endpoints", type=int, default=4, help="nginx server blocks behind Envoy (pool endpoints)")
    p.add_argument("--rates", type=int, nargs="+", default=[100, 200, 500, 1000], help="open-loop request rates (req/s)")
    p.add_argument("--body-sizes", type=int, nargs="+", default=[1024, 65536], help="request body sizes (bytes)")
    p.add_argument("--duration", type=float, default=6.0, help="seconds per open-loop row")
    p.add_argument("--closed-seconds", type=int, default=8, help="seconds of the closed-loop wrk run")
    p.add_argument("--connections", type=int, default=16, help="wrk connections in the closed-loop run")
    p.add_argument("--closed-rounds", type=int, default=3,
                   help="closed-loop runs per side, the picker's and the naive baseline's alternated (medians reported)")
    p.add_argument("--flow-control", action=argparse.BooleanOptionalAction, default=True,
                   help="the picker runs with its flow-control queue on (it stays empty: no endpoint saturates)")
    p.add_argument("--prefix-scorer", action=argparse.BooleanOptionalAction, default=True,
                   help="the picker runs the default config's prefix-cache-scorer (hashing every body)")
    p.add_argument("--frame-layers", action="store_true",
                   help="add frame_layers: the picker with its own HTTP/2 frame layer and with the h2 package's")
    p.add_argument("--frame-layer-rounds", type=int, default=3, help="alternated runs per frame layer")
    p.add_argument("--replicas", type=int, default=0,
                   help="also run this many picker replicas behind one Envoy against one, alternated --closed-rounds "
                        "times (the replicas section: CPU per request summed over them, req/s with a core each)")
    p.add_argument("--route-churn", type=float, default=0.0, metavar="S",
                   help="also run route_churn: the picker quiet and with a route change every S seconds (0.1 in issue "
                        "34's target) in a table of --adapters names, written as the controller writes them")
    p.add_argument("--churn-rates", type=int, nargs="+", default=[500], help="open-loop rates of route_churn (req/s)")
    p.add_argument("--picker-cpu", type=int, default=1, help="CPU the picker (or the naive baseline) is pinned to")
    p.add_argument("--load-cpu", type=int, default=0, help="CPU the load generator, Envoy and nginx are pinned to")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print one JSON object."""
    args = parser().parse_args(argv)
    if args.quick:
        args.decisions, args.duration, args.closed_seconds, args.rates, args.closed_rounds = 1000, 2.0, 3, [100, 500], 1
    if os.cpu_count() == 1:
        args.picker_cpu = args.load_cpu = 0
    out: dict[str, Any] = {"scoring": scoring((10, 100, 1000), args.adapters, args.decisions),
                           "report_notices": report_notices(args.report_pods, args.adapters, 100 if args.quick else 400),
                           "proto": proto_costs(),
                           "prefix": bench_request_path(args.body_sizes, 100 if args.quick else 400)}
    if not args.scoring_only:
        for tool in ("nginx", "wrk", "redis-server", "taskset"):
            if shutil.which(tool) is None:
                print(f"loraplane bench picker: {tool} is not installed", file=sys.stderr)
                return 2
        results = envoy_benchmark(args)
        picker = results["picker"]
        out.update({"envoy": picker["envoy"], "cpu_us_per_request": picker["cpu_us_per_request"],
                    "max_rps_one_core": picker["max_rps_one_core"], "closed_loop_rps": picker["closed_loop_rps"],
                    "picker_core_utilisation": picker["picker_core_utilisation"],
                    "closed_loop_runs": picker["closed_loop_runs"], "naive": results["naive"],
                    "envoy_alone": results["envoy_alone"]})
        for section in ("frame_layers", "replicas", "route_churn"):
            if section in results:
                out[section] = results[section]
    out["machine"] = {"cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
