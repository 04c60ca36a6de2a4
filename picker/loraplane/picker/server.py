"""Assemble and run the picker process: ext_proc + gRPC health, Redis sync, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from kubernetes import client as k8s
from prometheus_client import start_http_server

from loraplane.api import validation
from loraplane.api.runtime import MAX_REPORT_TTL_S
from loraplane.credentials import async_redis
from loraplane.picker.director import PickerContext, PickerSettings
from loraplane.picker.discovery import PoolDiscovery
from loraplane.picker.extproc import ExtProcHandler, ExtProcServicer
from loraplane.picker.lifecycle import FairShareParameters, FairSharePlugin
from loraplane.picker.prefix import PrefixCacheScorer
from loraplane.picker.replicas import SHARE_PERIOD_S, InFlightShare
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from loraplane.picker.scrape import MetricsScraper, ScrapedPool
from loraplane.picker.snapshot import InFlightTracker
from loraplane.picker.state import FORGET_S, PoolState, RedisSync
from loraplane.picker.telemetry import NoRequestStats, PickerMetrics, RequestStats
from loraplane.picker.transport import FrameLayer, GrpcStatusError, Routes, TransportLimits, start_server
from loraplane.waits import sleep_or_stop

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS = "liveness"
READINESS = "readiness"


@dataclass
class ServerOptions:
    """Everything ``loraplane-picker`` can be told."""

    pool: str
    redis_url: str
    replica: str = "picker-0"
    grpc_address: str = "127.0.0.1:9002"
    health_address: str | None = "127.0.0.1:9003"
    metrics_address: str | None = "127.0.0.1:9090"
    #: a YAML file, or ``"peer:<name>"`` (a packaged peer config); None: the packaged default
    config_path: Path | str | None = None
    endpoints: Sequence[tuple[str, str]] | None = None
    settings: PickerSettings = field(default_factory=PickerSettings)
    seed: int | None = None
    #: under saturation, refuse requests of fairness keys above this multiple of the average share (None: off)
    fair_share_factor: float | None = None
    #: follow this InferencePool's ready pods through the Kubernetes API (membership; reports still come from Redis)
    inference_pool: str | None = None
    namespace: str = "default"
    #: kubeconfig file; None: in-cluster config
    kubeconfig: Path | None = None
    #: "h2": the picker's own HTTP/2 gRPC transport (fast path); "grpcio": grpcio's asyncio server; "h2lib": the own
    #: transport with the ``h2`` package as its frame layer (for ``loraplane bench picker``)
    transport: str = "h2"
    #: message, header and stream limits of either transport
    limits: TransportLimits = field(default_factory=TransportLimits)
    resync_seconds: float = 5.0
    publish_seconds: float = 10.0
    #: seconds between sharing in-flight counts with the other replicas (0: not shared)
    share_in_flight_seconds: float = SHARE_PERIOD_S
    #: seconds past its TTL a report still counts as last heard (then the pod is stale: a fallback for what it held)
    stale_grace_seconds: float = 30.0
    #: the longest TTL a report counts with (reports are aged by the picker's receive time)
    max_report_ttl_seconds: float = MAX_REPORT_TTL_S
    #: seconds after its last report a silent member leaves the pool, once another member reports
    forget_seconds: float = FORGET_S
    #: where the pool's state comes from: ``redis`` (the sidecars' reports and the controller's route table) or
    #: ``scrape`` (each endpoint's vLLM /metrics, as the peers' pickers read them; no Redis, model names as given)
    data_source: str = "redis"
    #: scrape mode: seconds between scrapes of each endpoint, a scrape's timeout, when an endpoint turns stale
    scrape_interval: float = 0.05
    scrape_timeout: float = 1.0
    metrics_staleness_threshold: float = 2.0
    #: scrape mode: the path scraped on each endpoint
    metrics_path: str = "/metrics"
    #: scrape mode: names routed as base-model requests besides the pods' own ``model_name``
    base_models: Sequence[str] = ()


class HealthStatus:
    """gRPC health: ``liveness`` from the start, ``readiness`` and the ext_proc service once data is synced."""

    def __init__(self) -> None:
        """Live but not ready."""
        self.servicer = health_aio.HealthServicer()  # for the grpcio transport
        self.statuses: dict[str, int] = {}

    async def set(self, ready: bool) -> None:
        """Publish readiness."""
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        self.statuses[LIVENESS] = serving
        for name in (READINESS, EXT_PROC_SERVICE, ""):
            self.statuses[name] = serving if ready else not_serving
        for name, status in self.statuses.items():
            await self.servicer.set(name, status)


class HealthCheckHandler:
    """``grpc.health.v1.Health/Check`` on the picker's own HTTP/2 transport."""

    def __init__(self, health: HealthStatus) -> None:
        """Answer from ``health``."""
        self.health = health

    def on_message(self, message: bytes) -> list[bytes]:
        """SERVING / NOT_SERVING, or NOT_FOUND for a service nobody registered."""
        service = health_pb2.HealthCheckRequest.FromString(message).service
        status = self.health.statuses.get(service)
        if status is None:
            raise GrpcStatusError(5, f"unknown service {service!r}")
        return [health_pb2.HealthCheckResponse(status=status).SerializeToString()]

    def on_close(self) -> None:
        """Nothing to release."""


def h2_routes(ctx: PickerContext | None, health: HealthStatus) -> Routes:
    """The methods the picker's own HTTP/2 transport serves (health only when ``ctx`` is None: the health port)."""
    routes: dict[str, Callable[[], Any]] = {"/grpc.health.v1.Health/Check": lambda: HealthCheckHandler(health)}
    if ctx is not None:
        routes[f"/{EXT_PROC_SERVICE}/Process"] = lambda: ExtProcHandler(ctx)
    return routes


def grpcio_options(limits: TransportLimits) -> list[tuple[str, int]]:
    """grpcio's server options for the same limits as the picker's own transport."""
    return [
        ("grpc.so_reuseport", 1),
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", limits.max_message_bytes),
        ("grpc.max_metadata_size", limits.max_header_list_bytes),
        ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
        ("grpc.http2.max_frame_size", limits.max_frame_bytes),
    ]


def build_grpc_server(ctx: PickerContext | None, health: HealthStatus, addresses: Sequence[str],
                      limits: TransportLimits | None = None) -> tuple[grpc.aio.Server, list[int]]:
    """An asyncio gRPC server with the health service and (unless ``ctx`` is None) ext_proc on ``addresses``;
    returns the bound ports."""
    server = grpc.aio.server(options=grpcio_options(limits or TransportLimits()))
    if ctx is not None:
        server.add_generic_rpc_handlers((ExtProcServicer(ctx).rpc_handler(),))
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    ports = [server.add_insecure_port(address) for address in addresses]
    return server, ports


async def serve(options: ServerOptions, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set (or SIGTERM/SIGINT)."""
    metrics = PickerMetrics()
    tracker = InFlightTracker()
    metrics.watch_in_flight(tracker)
    state: PoolState | ScrapedPool
    if options.data_source == "scrape":
        state = ScrapedPool(tracker, time.monotonic, options.endpoints, metrics, options.metrics_staleness_threshold,
                            options.base_models)
    else:
        state = PoolState(options.pool, tracker, time.monotonic, options.endpoints, metrics,
                          options.stale_grace_seconds, options.max_report_ttl_seconds, options.forget_seconds)
    stats = NoRequestStats(time.time) if isinstance(state, ScrapedPool) else RequestStats(time.time)
    scheduler = Scheduler(EndpointPickerConfig.load(options.config_path))
    ctx = PickerContext(
        scheduler=scheduler,
        snapshot=lambda: state.snapshot,
        resolver=lambda: state.resolver,
        tracker=tracker,
        rng=np.random.default_rng(options.seed),
        metrics=metrics,
        stats=stats,
        clock=time.monotonic,
        settings=options.settings,
        report_clock=state.clock,
    )
    if options.fair_share_factor:
        ctx.plugins.add(FairSharePlugin(FairShareParameters(factor=options.fair_share_factor)))
    health = HealthStatus()
    await health.set(False)
    addresses = [options.grpc_address] + ([options.health_address] if options.health_address else [])
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    stop_serving = await _start_transport(options, ctx, health)
    if options.metrics_address:
        host, port = validation.parse_host_port(options.metrics_address)
        start_http_server(port, host, registry=metrics.registry)
    client = sync = None
    share: InFlightShare | None = None
    if isinstance(state, ScrapedPool):
        scraper = MetricsScraper(state, options.scrape_interval, options.scrape_timeout, options.metrics_path,
                                 registry=metrics.registry)
        tasks = [asyncio.create_task(scraper.run(stop))]
        log.info("picker listening on %s (pool %s, scraping %d endpoints every %g s)", ", ".join(addresses),
                 options.pool, len(state.members), options.scrape_interval)
    else:
        client = async_redis(options.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        prefix = scheduler.preparer(PrefixCacheScorer)
        block_sets = prefix.precise_index if prefix is not None else None
        sync = RedisSync(state, client, stats, options.replica, options.resync_seconds, options.publish_seconds,
                         block_sets)
        log.info("picker listening on %s (pool %s)", ", ".join(addresses), options.pool)
        tasks = [asyncio.create_task(coro) for coro in (sync.run(stop), sync.expire_stale(), sync.publish_forever())]
        if options.share_in_flight_seconds > 0:
            share = InFlightShare(client, options.pool, options.replica, tracker, time.time,
                                  options.share_in_flight_seconds)
            tasks.append(asyncio.create_task(share.run(stop)))
    discovery = _start_discovery(options, state)
    if discovery is not None:
        ctx.objectives = discovery.objective_priorities
    try:
        while not (state.synced and (discovery is None or discovery.synced)) and not stop.is_set():
            await sleep_or_stop(stop, 0.05)
        await health.set(state.synced)
        gc.freeze()  # start-up objects (modules, config, first snapshot) are never traversed by collections again
        await stop.wait()
    finally:
        await health.set(False)
        if discovery is not None:
            discovery.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if sync is not None:
            with contextlib.suppress(Exception):
                await sync.publish_once()
        if share is not None:
            with contextlib.suppress(Exception):
                await share.withdraw()
        if (flow := ctx.flow_control) is not None:
            flow.stop()  # every waiting request gets 503 rejected-shutting-down before the connections close
        await stop_serving()
        if client is not None:
            await client.aclose()


def _start_discovery(options: ServerOptions, state: PoolState | ScrapedPool) -> PoolDiscovery | None:
    if options.inference_pool is None:
        return None
    from kubernetes import config as kube_config

    if options.kubeconfig is not None:
        api_client = kube_config.new_client_from_config(str(options.kubeconfig))
    else:
        kube_config.load_incluster_config()
        api_client = k8s.ApiClient()
    state.set_endpoints([])  # nothing is routable until the pool's pods are known
    discovery = PoolDiscovery(api_client, options.namespace, options.inference_pool, state.set_endpoints)
    discovery.start()
    return discovery


async def _start_transport(options: ServerOptions, ctx: PickerContext, health: HealthStatus) -> Callable[[], Awaitable[None]]:
    """ext_proc and health on the gRPC address; health only on the health address."""
    listeners: list[tuple[PickerContext | None, str]] = [(ctx, options.grpc_address)]
    if options.health_address:
        listeners.append((None, options.health_address))
    if options.transport == "grpcio":
        grpc_servers = [build_grpc_server(served, health, [address], options.limits)[0] for served, address in listeners]
        for grpc_server in grpc_servers:
            await grpc_server.start()

        async def stop_grpcio() -> None:
            await asyncio.gather(*(grpc_server.stop(grace=2.0) for grpc_server in grpc_servers))

        return stop_grpcio
    layer: FrameLayer = "h2lib" if options.transport == "h2lib" else "hand"
    servers = [await start_server(h2_routes(served, health), *validation.parse_host_port(address), limits=options.limits,
                                  frame_layer=layer) for served, address in listeners]

    async def stop() -> None:
        await asyncio.gather(*(server.close() for server in servers))

    return stop
