"""The Envoy ``ext_proc`` exchange: one ``Exchange`` per HTTP request, one gRPC stream per exchange.

The exchange turns each ``ProcessingRequest`` into the ``ProcessingResponse``s the GIE endpoint-picker protocol
expects. Request bodies may arrive ``BUFFERED`` (one message) or ``FULL_DUPLEX_STREAMED`` (chunks, reassembled here
and sent back in chunks of at most 62,000 bytes). Client mistakes become ``ImmediateResponse``s (400, 404,
413, 429, 503), never stream errors.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import grpc
import numpy as np
from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError, Message

from loraplane.api import PriorityClass
from loraplane.picker.body import (
    ClientError,
    ParsedBody,
    parse_body,
    rewrite_request_model,
    rewrite_response_model,
)
from loraplane.picker.fairness import FairShare
from loraplane.picker.h2grpc import GrpcStatusError
from loraplane.picker.plugins import SchedulingRequest
from loraplane.picker.routes import Resolution, RouteResolver, UnknownModelError
from loraplane.picker.scheduler import Decision, Outcome, Scheduler, SchedulingError
from loraplane.picker.snapshot import InFlightTracker, PoolSnapshot
from loraplane.picker.telemetry import PickerMetrics, RequestStats

log = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
MAX_BODY_CHUNK = 62_000
FULL_DUPLEX = pm.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = pm.ProcessingMode.BUFFERED
NONE = pm.ProcessingMode.NONE

#: Replies are wire-encoded ``ProcessingResponse``s: the constant ones are encoded once, the routed ones from cached
#: pieces (see ``_routed``), so the hot path builds no protobuf objects.
Wire = bytes

_CONTINUE_REQUEST_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse()).SerializeToString()
_CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse()).SerializeToString()
_CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse()).SerializeToString()
_CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse()).SerializeToString()
_CONTINUE_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse()).SerializeToString()
_PRIORITY_OF_OBJECTIVE = {objective.value: objective.priority for objective in PriorityClass}


@dataclass
class PickerSettings:
    """Request-handling settings of one picker process."""

    max_body_bytes: int = 1 << 20
    #: request header whose value keeps a user on one side of a canary split (falls back to the fairness id)
    session_header: str = "x-session-id"
    #: rewrite the response's ``model`` back to the logical name the client sent
    rewrite_response_model: bool = True
    #: put the ordered fallback list in the destination header (GIE); off for plain Envoy ``ORIGINAL_DST``, which
    #: accepts one address only (the metadata always carries the whole list)
    destination_fallbacks: bool = True

    @cached_property
    def control_headers(self) -> frozenset[str]:
        """The request headers the picker reads (Envoy sends names in lower case)."""
        return frozenset({self.session_header.lower(), FAIRNESS_HEADER, OBJECTIVE_HEADER})


@dataclass
class PickerContext:
    """Everything an exchange needs, shared by all exchanges of a process."""

    scheduler: Scheduler
    snapshot: Callable[[], PoolSnapshot]
    resolver: Callable[[], RouteResolver]
    tracker: InFlightTracker
    rng: np.random.Generator
    metrics: PickerMetrics
    stats: RequestStats
    #: monotonic seconds, for decision time and TTFT
    clock: Callable[[], float]
    settings: PickerSettings = field(default_factory=PickerSettings)
    #: per-tenant fair share under saturation; None: off
    fairness: FairShare | None = None


def _header_value(header: core.HeaderValue) -> str:
    return header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value


@lru_cache(maxsize=8192)
def _header_option(key: str, value: str) -> core.HeaderValueOption:
    """A SET (overwrite or add) of one header; cached, as destinations and lengths repeat."""
    return core.HeaderValueOption(
        header=core.HeaderValue(key=key, raw_value=value.encode()),
        append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _set_headers(pairs: Iterable[tuple[str, str]]) -> pb.HeaderMutation:
    return pb.HeaderMutation(set_headers=[_header_option(k, v) for k, v in pairs])


def immediate_response(status: int, message: str, reason: str) -> Wire:
    """An ``ImmediateResponse`` in the reference EPP's wording: ``inference error: <code> - <message>``."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=_set_headers([("content-type", "text/plain"), (DROPPED_REASON_HEADER, reason)]),
            body=f"inference error: {status} - {message}".encode(),
            details=reason,
        )
    ).SerializeToString()


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(message: type[Message], field: str) -> bytes:
    """The wire key of a length-delimited (message or bytes) field."""
    return _varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


def _field(key: bytes, *parts: bytes) -> list[bytes]:
    """A length-delimited field holding ``parts`` concatenated, as pieces to join."""
    return [key, _varint(sum(map(len, parts))), *parts]


_PHASE_KEYS = {phase: _key(pb.ProcessingResponse, phase) for phase in ("request_headers", "request_body")}
_COMMON_KEY = _key(pb.BodyResponse, "response")  # HeadersResponse.response has the same number
assert _COMMON_KEY == _key(pb.HeadersResponse, "response")
_BODY_MUTATION_KEY = _key(pb.CommonResponse, "body_mutation")
_BODY_KEY = _key(pb.BodyMutation, "body")


@lru_cache(maxsize=8192)
def _destination_metadata(value: str) -> bytes:
    """The ``dynamic_metadata`` field of a routed response (``envoy.lb`` -> destination), encoded."""
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(LB_NAMESPACE)[DESTINATION_HEADER] = value
    return pb.ProcessingResponse(dynamic_metadata=metadata).SerializeToString()


@lru_cache(maxsize=8192)
def _routing_common(destination: str, content_length: int | None) -> bytes:
    """The encoded ``CommonResponse`` fields of a routed response: the destination (and length) headers, clear_route_cache."""
    pairs = [(DESTINATION_HEADER, destination)]
    if content_length is not None:
        pairs.append(("content-length", str(content_length)))
    return pb.CommonResponse(header_mutation=_set_headers(pairs), clear_route_cache=True).SerializeToString()


def _routed(phase: str, common: bytes, metadata: bytes, body: bytes | None = None) -> Wire:
    """``ProcessingResponse{<phase>: {response: common + body_mutation{body}}, dynamic_metadata}`` on the wire.

    Protobuf parsers merge repeated occurrences of a message field, so cached encoded pieces can be concatenated;
    the body is copied once (into the joined result) instead of into a message and out again.
    """
    inner = [common] if body is None else [common, *_field(_BODY_MUTATION_KEY, *_field(_BODY_KEY, body))]
    return b"".join([*_field(_PHASE_KEYS[phase], *_field(_COMMON_KEY, *inner)), metadata])


class Exchange:
    """The state of one HTTP request as it passes through Envoy."""

    __slots__ = (
        "body",
        "ctx",
        "destination",
        "fairness_key",
        "finished",
        "headers",
        "request_body_mode",
        "response_body_mode",
        "route",
        "sent_at",
        "subset",
        "tenant",
    )

    def __init__(self, ctx: PickerContext) -> None:
        """Start an exchange; nothing is sent until Envoy's first message."""
        self.ctx = ctx
        self.headers: dict[str, str] = {}
        self.request_body_mode = BUFFERED
        self.response_body_mode = NONE
        self.body = bytearray()
        self.subset: frozenset[str] | None = None
        self.route: Resolution | None = None
        self.destination: str | None = None
        self.sent_at: float | None = None
        self.tenant = "none"
        self.fairness_key: str | None = None
        self.finished = False

    # --- dispatch -----------------------------------------------------------------------------------------------

    def handle(self, request: pb.ProcessingRequest) -> list[Wire]:
        """The encoded responses to one message from Envoy (none while a streamed body is being collected)."""
        try:
            self._observe_context(request)
            phase = request.WhichOneof("request")
            if phase == "request_headers":
                return self._on_request_headers(request.request_headers)
            if phase == "request_body":
                return self._on_request_body(request.request_body)
            if phase == "request_trailers":
                return [*self._schedule_if_pending(), _CONTINUE_REQUEST_TRAILERS]
            if phase == "response_headers":
                return self._on_response_headers(request.response_headers)
            if phase == "response_body":
                return self._on_response_body(request.response_body)
            if phase == "response_trailers":
                self.close()
                return [_CONTINUE_RESPONSE_TRAILERS]
            raise ClientError(400, f"unexpected ext_proc message {phase!r}")
        except ClientError as exc:
            return [self._refuse(exc.status, exc.message, exc.reason)]
        except SchedulingError as exc:
            return [self._refuse(exc.status, str(exc), exc.reason)]
        except Exception:
            log.exception("internal error while processing a request")
            return [self._refuse(500, "internal error in the endpoint picker", "internal")]

    def close(self) -> None:
        """The request is over (response end, stream end or abort): release its in-flight slot."""
        if not self.finished:
            self.finished = True
            if self.destination is not None:
                self.ctx.tracker.finish(self.destination)
            if self.fairness_key is not None and self.ctx.fairness is not None:
                self.ctx.fairness.finish(self.fairness_key)

    def _refuse(self, status: int, message: str, reason: str) -> Wire:
        self.ctx.metrics.count_request(self.tenant, status)
        if status in (429, 503):
            self.ctx.metrics.decisions[Outcome.REJECTED].inc()
        self.close()
        return immediate_response(status, message, reason)

    def _observe_context(self, request: pb.ProcessingRequest) -> None:
        if request.HasField("protocol_config"):
            self.request_body_mode = request.protocol_config.request_body_mode
            self.response_body_mode = request.protocol_config.response_body_mode
        if request.HasField("metadata_context") and SUBSET_NAMESPACE in request.metadata_context.filter_metadata:
            hint = request.metadata_context.filter_metadata[SUBSET_NAMESPACE]
            if SUBSET_KEY in hint.fields:
                value = hint.fields[SUBSET_KEY]
                items = value.list_value.values if value.HasField("list_value") else [value]
                self.subset = frozenset(
                    v.string_value.rpartition(":")[0].strip("[]") or v.string_value for v in items if v.string_value
                )

    # --- request path -------------------------------------------------------------------------------------------

    def _on_request_headers(self, message: pb.HttpHeaders) -> list[Wire]:
        wanted = self.ctx.settings.control_headers
        for header in message.headers.headers:
            if header.key in wanted:
                self.headers[header.key] = _header_value(header)
        if message.end_of_stream or self.request_body_mode == NONE:
            return [self._route_without_body()]
        if self.request_body_mode == FULL_DUPLEX:
            return []  # answer once the whole body is in
        return [_CONTINUE_REQUEST_HEADERS]

    def _on_request_body(self, message: pb.HttpBody) -> list[Wire]:
        chunk = message.body
        if message.end_of_stream and not self.body:
            body = chunk  # the whole body in one message (BUFFERED): no reassembly copy
        else:
            self.body += chunk
            body = bytes(self.body) if message.end_of_stream else b""
        limit = self.ctx.settings.max_body_bytes
        if max(len(self.body), len(body)) > limit:
            raise ClientError(413, f"request body exceeds the limit of {limit} bytes", "body-too-large")
        if not message.end_of_stream:
            if self.request_body_mode == FULL_DUPLEX:
                return []
            raise ClientError(400, "request body must be sent BUFFERED or FULL_DUPLEX_STREAMED")
        return self._route_with_body(body)

    def _schedule_if_pending(self) -> list[Wire]:
        return self._route_with_body(bytes(self.body)) if self.destination is None else []

    def _route_without_body(self) -> Wire:
        decision = self._schedule(SchedulingRequest(subset=self.subset), None)
        return _routed("request_headers", self._common(decision, None), _destination_metadata(",".join(decision.endpoints)))

    def _route_with_body(self, body: bytes) -> list[Wire]:
        parsed = parse_body(body, self.ctx.settings.max_body_bytes)
        route = self._resolve(parsed)
        decision = self._schedule(self._scheduling_request(route), route)
        new_body = body if route.served_name is None else rewrite_request_model(body, parsed, route.served_name)
        metadata = _destination_metadata(",".join(decision.endpoints))
        if self.request_body_mode == FULL_DUPLEX:
            head = _routed("request_headers", self._common(decision, len(new_body)), metadata)
            return [head, *_streamed_body(new_body)]
        if new_body is body:
            return [_routed("request_body", self._common(decision, None), metadata)]
        return [_routed("request_body", self._common(decision, len(new_body)), metadata, new_body)]

    def _resolve(self, parsed: ParsedBody) -> Resolution:
        headers = self.headers
        session = headers.get(self.ctx.settings.session_header.lower()) or headers.get(FAIRNESS_HEADER)
        try:
            route = self.ctx.resolver().resolve(parsed.model, session, self.ctx.rng)
        except UnknownModelError as exc:
            raise ClientError(404, str(exc), "model-not-found") from None
        self.route = route
        self.tenant = route.tenant
        return route

    def _scheduling_request(self, route: Resolution) -> SchedulingRequest:
        priority = route.priority
        objective = self.headers.get(OBJECTIVE_HEADER)
        if objective in _PRIORITY_OF_OBJECTIVE:
            priority = min(priority, _PRIORITY_OF_OBJECTIVE[objective])  # a header may lower priority, never raise it
        return SchedulingRequest(route.served_name, route.digest, priority, route.tenant, self.subset)

    def _schedule(self, request: SchedulingRequest, route: Resolution | None) -> Decision:
        ctx = self.ctx
        started = ctx.clock()
        decision = ctx.scheduler.schedule(request, ctx.snapshot(), ctx.rng)
        now = ctx.clock()
        ctx.metrics.decision_seconds.observe(now - started)
        if ctx.fairness is not None:
            key = self.headers.get(FAIRNESS_HEADER) or request.tenant
            if decision.saturated and request.priority <= 0 and ctx.fairness.over_share(key):
                raise ClientError(429, f"the pool is saturated and fairness key {key!r} is above its fair share",
                                  "rejected-fairness")
            ctx.fairness.start(key)
            self.fairness_key = key
        ctx.metrics.decisions[decision.outcome].inc()
        self.destination = decision.endpoints[0]
        self.sent_at = now
        ctx.tracker.start(self.destination)
        if route is not None and route.served_name is not None:
            ctx.stats.record_request(route.served_name)
        return decision

    def _common(self, decision: Decision, content_length: int | None) -> bytes:
        value = ",".join(decision.endpoints) if self.ctx.settings.destination_fallbacks else decision.endpoints[0]
        return _routing_common(value, content_length)

    # --- response path ------------------------------------------------------------------------------------------

    @property
    def _rewrites_response(self) -> bool:
        return self.ctx.settings.rewrite_response_model and self.route is not None and self.route.served_name is not None

    def _on_response_headers(self, message: pb.HttpHeaders) -> list[Wire]:
        status = 0
        for header in message.headers.headers:
            if header.key == ":status":
                status = int(_header_value(header) or 0)
        self.ctx.metrics.count_request(self.tenant, status)
        if self.route is not None and self.route.served_name is not None:
            ttft = self.ctx.clock() - self.sent_at if self.sent_at is not None else None
            self.ctx.stats.record_response(self.route.served_name, status, ttft)
        if message.end_of_stream:
            self.close()
        if self._rewrites_response and self.response_body_mode != BUFFERED:
            return [_REMOVE_CONTENT_LENGTH]
        return [_CONTINUE_RESPONSE_HEADERS]

    def _on_response_body(self, message: pb.HttpBody) -> list[Wire]:
        chunk = message.body
        if message.end_of_stream:
            self.close()
        route = self.route
        if not self._rewrites_response or route is None or route.served_name is None:
            if self.response_body_mode == FULL_DUPLEX:
                return list(_streamed_body(chunk, message.end_of_stream, response=True))
            return [_CONTINUE_RESPONSE_BODY]
        new = rewrite_response_model(chunk, route.served_name, route.logical)
        if self.response_body_mode == FULL_DUPLEX:
            return list(_streamed_body(new, message.end_of_stream, response=True))
        if new == chunk:
            return [_CONTINUE_RESPONSE_BODY]
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(body=new))
        if self.response_body_mode == BUFFERED:
            common.header_mutation.CopyFrom(_set_headers([("content-length", str(len(new)))]))
        return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=common)).SerializeToString()]


_REMOVE_CONTENT_LENGTH = pb.ProcessingResponse(response_headers=pb.HeadersResponse(
    response=pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=["content-length"]))
)).SerializeToString()


def _streamed_body(body: bytes, end_of_stream: bool = True, response: bool = False) -> Iterable[Wire]:
    """Body mutations for ``FULL_DUPLEX_STREAMED`` mode, at most ``MAX_BODY_CHUNK`` bytes each."""
    pieces = [body[i : i + MAX_BODY_CHUNK] for i in range(0, len(body), MAX_BODY_CHUNK)] or [b""]
    for n, piece in enumerate(pieces):
        mutation = pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=piece, end_of_stream=end_of_stream and n == len(pieces) - 1)
        )
        body_response = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
        message = pb.ProcessingResponse(response_body=body_response) if response else pb.ProcessingResponse(
            request_body=body_response
        )
        yield message.SerializeToString()


class ExtProcHandler:
    """One ``Process`` call on the picker's own HTTP/2 transport (``loraplane.picker.h2grpc``)."""

    def __init__(self, ctx: PickerContext) -> None:
        """A fresh exchange per call."""
        self.exchange = Exchange(ctx)

    def on_message(self, message: bytes) -> list[bytes]:
        """Decode a ``ProcessingRequest``, answer with encoded ``ProcessingResponse``s."""
        try:
            request = pb.ProcessingRequest.FromString(message)
        except DecodeError:
            raise GrpcStatusError(3, "not a ProcessingRequest") from None  # INVALID_ARGUMENT: Envoy's bug, not the client's
        return self.exchange.handle(request)

    def on_close(self) -> None:
        """Release the exchange's in-flight slot."""
        self.exchange.close()


class ExtProcServicer:
    """``envoy.service.ext_proc.v3.ExternalProcessor/Process`` over grpcio's asyncio server."""

    def __init__(self, ctx: PickerContext) -> None:
        """Serve exchanges against ``ctx``."""
        self.ctx = ctx

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest], _context: object) -> AsyncIterator[Wire]:
        """One bidirectional stream per HTTP request."""
        exchange = Exchange(self.ctx)
        try:
            async for request in request_iterator:
                for response in exchange.handle(request):
                    yield response
        finally:
            exchange.close()

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        """The handler to register: requests are decoded by grpcio, replies are already encoded (no serializer)."""
        method = grpc.stream_stream_rpc_method_handler(self.Process, request_deserializer=pb.ProcessingRequest.FromString)
        return grpc.method_handlers_generic_handler(pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name,
                                                    {"Process": method})
