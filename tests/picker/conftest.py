"""Shared builders: a picker context over an in-memory pool, and ext_proc message helpers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable

import grpc
import numpy as np
import pytest
from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from loraplane.api import (
    AdapterResidency,
    PodLoad,
    ResidencyReport,
    RouteEntry,
    RouteTable,
    Tier,
    WeightedRevision,
)
from loraplane.api.routing import RevisionRole
from loraplane.picker.director import PickerContext, PickerSettings
from loraplane.picker.scheduler import Scheduler
from loraplane.picker.server import HealthStatus, build_grpc_server, h2_routes
from loraplane.picker.snapshot import InFlightTracker
from loraplane.picker.state import PoolState
from loraplane.picker.telemetry import PickerMetrics, RequestStats
from loraplane.picker.transport import start_server

POOL = "pool"
DIGEST_V1 = "sha256:" + "1" * 64
DIGEST_V2 = "sha256:" + "2" * 64
ADDRESSES = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")


def route_table(canary_weight: int = 0) -> RouteTable:
    revisions = [WeightedRevision(revision="v1", served_name="claims@v1", digest=DIGEST_V1, weight=100 - canary_weight)]
    if canary_weight:
        revisions.append(WeightedRevision(revision="v2", served_name="claims@v2", digest=DIGEST_V2,
                                          weight=canary_weight, role=RevisionRole.CANARY))
    return RouteTable(pool=POOL, generation=1, base_model="base-llm", updated_at=0.0,
                      models={"claims": RouteEntry(tenant="acme", revisions=revisions)})


def reports(now: float, warm_pod: int = 1, **load: int) -> list[ResidencyReport]:
    out = []
    for i, address in enumerate(ADDRESSES):
        tier = Tier.GPU if i == warm_pod else Tier.CPU if i == 2 else None
        adapters = [AdapterResidency(served_name="claims@v1", tier=tier, digest=DIGEST_V1)] if tier else []
        out.append(ResidencyReport(pool=POOL, pod=f"pod-{i}", address=address, heartbeat_at=now, ttl_seconds=60,
                                   adapters=adapters, load=PodLoad(**load)))
    return out


def make_context(settings: PickerSettings | None = None, canary_weight: int = 0,
                 scheduler: Scheduler | None = None) -> tuple[PickerContext, PoolState]:
    tracker = InFlightTracker()
    state = PoolState(POOL, tracker, time.time)
    state.set_routes(route_table(canary_weight))
    for report in reports(time.time()):
        state.set_report(report)
    state.rebuild()
    ctx = PickerContext(
        scheduler=scheduler or Scheduler.default(),
        snapshot=lambda: state.snapshot,
        resolver=lambda: state.resolver,
        tracker=tracker,
        rng=np.random.default_rng(0),
        metrics=PickerMetrics(),
        stats=RequestStats(time.time),
        clock=time.monotonic,
        settings=settings or PickerSettings(),
    )
    return ctx, state


def headers(pairs: Iterable[tuple[str, str]], end_of_stream: bool = False, body_mode: int | None = None,
            subset: list[str] | None = None) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=core.HeaderMap(headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]),
        end_of_stream=end_of_stream,
    ))
    if body_mode is not None:
        request.protocol_config.request_body_mode = body_mode
        request.protocol_config.response_body_mode = body_mode
    if subset is not None:
        hint = request.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        hint.get_or_create_list("x-gateway-destination-endpoint-subset").extend(subset)
    return request


REQUEST_HEADERS = [(":method", "POST"), (":path", "/v1/completions"), ("content-type", "application/json")]


def body(data: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


def response_headers(status: int, content_type: str = "application/json", end_of_stream: bool = False) -> pb.ProcessingRequest:
    pairs = [(":status", str(status)), ("content-type", content_type), ("content-length", "10")]
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(
        headers=core.HeaderMap(headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]),
        end_of_stream=end_of_stream,
    ))


def response_body(data: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


FULL_DUPLEX = pm.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = pm.ProcessingMode.BUFFERED
STREAMED = pm.ProcessingMode.STREAMED


def set_headers(pairs: Iterable[tuple[str, str]]) -> pb.HeaderMutation:
    """A header mutation setting (overwriting) each pair, as the protocol's replies carry it."""
    return pb.HeaderMutation(set_headers=[
        core.HeaderValueOption(header=core.HeaderValue(key=k, raw_value=v.encode()),
                               append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD) for k, v in pairs])


def routed_response(phase: str, destination: str, content_length: int | None = None,
                    new_body: bytes | None = None) -> pb.ProcessingResponse:
    """The routed reply the protocol wants, built the ordinary way: destination header (and length), the same
    value in the ``envoy.lb`` metadata, ``clear_route_cache``, and the replaced body if any."""
    pairs = [("x-gateway-destination-endpoint", destination)]
    if content_length is not None:
        pairs.append(("content-length", str(content_length)))
    common = pb.CommonResponse(clear_route_cache=True, header_mutation=set_headers(pairs))
    if new_body is not None:
        common.body_mutation.body = new_body
    response = pb.ProcessingResponse()
    response.dynamic_metadata.get_or_create_struct("envoy.lb")["x-gateway-destination-endpoint"] = destination
    getattr(response, phase).response.CopyFrom(common)
    return response


async def eventually(check: Callable[[], bool], within: float = 5.0) -> None:
    """Wait until ``check()`` holds (fails after ``within`` seconds)."""
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def header_map(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {o.header.key: (o.header.raw_value.decode() or o.header.value) for o in mutation.set_headers}


class Picker:
    """A picker serving on a real gRPC port, and a real grpcio client stub to talk to it."""

    def __init__(self, ctx: PickerContext, state: PoolState, health: HealthStatus, channel: grpc.aio.Channel,
                 port: int) -> None:
        self.ctx, self.state, self.health, self.channel, self.port = ctx, state, health, channel, port
        self.stub = pb_grpc.ExternalProcessorStub(channel)

    async def exchange(self, *messages: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """Send all messages on one stream (half-closing after), return every response."""
        call = self.stub.Process(iter(messages))
        return [response async for response in call]


@contextlib.asynccontextmanager
async def serve_picker(transport: str, settings: PickerSettings | None = None,
                       scheduler: Scheduler | None = None) -> AsyncIterator[Picker]:
    """The picker on ``transport`` ("h2": its own HTTP/2 server, "h2lib": that server framed by the ``h2`` package,
    "grpcio": grpcio's asyncio server), on a free port; ``scheduler``: another config than the packaged one."""
    ctx, state = make_context(settings, scheduler=scheduler)
    health = HealthStatus()
    await health.set(True)
    own = transport in ("h2", "h2lib")
    if own:
        server = await start_server(h2_routes(ctx, health), "127.0.0.1", 0, reuse_port=False,
                                    frame_layer="h2lib" if transport == "h2lib" else "hand")
        port = server.port
    else:
        grpc_server, ports = build_grpc_server(ctx, health, ["127.0.0.1:0"])
        await grpc_server.start()
        port = ports[0]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Picker(ctx, state, health, channel, port)
    finally:
        await channel.close()
        if own:
            await server.close()
        else:
            await grpc_server.stop(None)


@pytest.fixture(params=["h2", "grpcio"])
async def picker(request: pytest.FixtureRequest) -> AsyncIterator[Picker]:
    """The picker on both transports: its own HTTP/2 server and grpcio's asyncio server."""
    async with serve_picker(request.param) as served:
        yield served
