"""The Envoy ``ext_proc`` protocol: one ``Exchange`` per HTTP request, one gRPC stream per exchange.

The exchange translates: each ``ProcessingRequest`` becomes calls to the request's ``RequestDirector``
(``loraplane.picker.director``, which runs the request's phases) and the ``ProcessingResponse``s the GIE
endpoint-picker protocol expects. Bodies may arrive ``BUFFERED``, ``STREAMED`` or ``FULL_DUPLEX_STREAMED`` (the mode comes from the stream's
``protocol_config``, else from ``PickerSettings.body_mode``); split bodies are reassembled, and full-duplex bodies are
sent back in chunks of at most 62,000 bytes. Client mistakes become ``ImmediateResponse``s (400, 404, 413, 429,
503), never stream errors, and an ``ImmediateResponse`` ends the exchange (later messages get no reply). The replies'
wire bytes come from ``loraplane.picker.wire``; this module decides which reply, never how it is encoded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
import orjson
from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError

from loraplane.api import validation
from loraplane.api.headers import (
    DROPPED_REASON_HEADER,
    MODEL_NAME_REWRITE_HEADERS,
    first_present,
)
from loraplane.picker.body import (
    ClientError,
    outgoing_body,
    parse_request,
    request_path,
    rewrite_response_model,
)
from loraplane.picker.director import PickerContext, RequestDirector
from loraplane.picker.plugins import SchedulingRequest
from loraplane.picker.routes import Resolution
from loraplane.picker.scheduler import Decision, Outcome, SchedulingError
from loraplane.picker.transport import GrpcStatusError
from loraplane.picker.transport.grpc import GRPC_INVALID_ARGUMENT
from loraplane.picker.wire import (
    CLEAR_REQUEST_CHUNK,
    CLEAR_RESPONSE_CHUNK,
    CONTINUE_REQUEST_HEADERS,
    CONTINUE_REQUEST_TRAILERS,
    CONTINUE_RESPONSE_BODY,
    CONTINUE_RESPONSE_HEADERS,
    CONTINUE_RESPONSE_TRAILERS,
    LB_NAMESPACE,
    REMOVE_CONTENT_LENGTH,
    Wire,
    buffer_request_body,
    immediate,
    response_body,
    routed,
    streamed_body,
)

log = logging.getLogger(__name__)

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
#: the path the picker answers itself from the route table (the names a client may send; ``RouteResolver.model_cards``)
MODELS_PATH = "/v1/models"
FULL_DUPLEX = pm.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = pm.ProcessingMode.BUFFERED
STREAMED = pm.ProcessingMode.STREAMED
NONE = pm.ProcessingMode.NONE
#: the reference EPP's error codes: ``inference error: <Code> - <message>``
ERROR_CODES = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 413: "PayloadTooLarge",
               429: "ResourceExhausted", 500: "Internal", 503: "ServiceUnavailable"}

#: sends replies produced after ``Exchange.handle`` returned (a request the flow-control queue held)
Deliver = Callable[[list[Wire]], None]

def _header_value(header: core.HeaderValue) -> str:
    return header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value


def immediate_response(status: int, message: str, reason: str) -> Wire:
    """An ``ImmediateResponse`` in the reference EPP's wording: ``inference error: <Code> - <message>``."""
    return immediate(status, [("content-type", "text/plain"), (DROPPED_REASON_HEADER, reason)],
                     f"inference error: {ERROR_CODES.get(status, 'Unknown')} - {message}".encode(), reason)


def subset_hint(value: struct_pb2.Value) -> frozenset[str]:
    """The entries of a subset hint: a list of strings or one comma-separated string, each ``ip:port`` or ``ip``.

    Entries are normalised (``[v6]`` -> ``v6``); entries that are not strings, are empty or have a non-numeric port
    are dropped. An empty result means no endpoint is allowed (503).
    """
    if value.HasField("list_value"):
        raw = ",".join(v.string_value for v in value.list_value.values if v.HasField("string_value"))
    else:
        raw = value.string_value
    return frozenset(entry for part in raw.split(",") if (entry := _subset_entry(part.strip())))


def _subset_entry(text: str) -> str | None:
    """``host:port`` as given; a host without a port (``[v6]`` unbracketed); None when it does not parse."""
    try:
        host, port = validation.split_host_port(text)
    except ValueError:
        return None
    return host if port is None else text


class Exchange:
    """One HTTP request as Envoy's messages carry it: body modes, reassembly, the replies on the wire; its phases
    are the ``director``'s."""

    __slots__ = (
        "body",
        "body_size",
        "ctx",
        "deferred",
        "deliver",
        "director",
        "ended",
        "headers",
        "path",
        "request_body_mode",
        "response_body_mode",
        "response_held",
        "response_names",
        "response_sse",
        "then",
    )

    def __init__(self, ctx: PickerContext) -> None:
        """Start an exchange; nothing is sent until Envoy's first message."""
        self.ctx = ctx
        self.headers: dict[str, str] = {}
        #: the request's path (from its headers)
        self.path: str | None = None
        self.director = RequestDirector(ctx, self.headers)
        self.request_body_mode = ctx.settings.body_mode
        self.response_body_mode = ctx.settings.body_mode
        #: the request body's chunks so far, joined once at its end (a bytearray grown chunk by chunk copies it
        #: twice more)
        self.body: list[bytes] = []
        self.body_size = 0
        #: (name in the response, name to put back) while the response's ``model`` is rewritten; None: no rewrite
        self.response_names: tuple[str, str] | None = None
        self.response_sse = False
        #: a non-SSE response collected for the rewrite (a JSON document may be split anywhere)
        self.response_held = bytearray()
        #: set by the transport: replies produced later (without it a saturated request is never held)
        self.deliver: Deliver | None = None
        #: while the flow-control queue holds the request: the replies its decision will make
        self.then: Callable[[Decision], list[Wire]] | None = None
        #: replies to later messages while the request waits (sent after the routed reply, in order)
        self.deferred: list[Wire] = []
        #: an ImmediateResponse was sent: the exchange is over, later messages get no reply
        self.ended = False

    @property
    def waiting(self) -> bool:
        """The flow-control queue holds the request."""
        return self.director.waiting is not None

    # --- dispatch -----------------------------------------------------------------------------------------------

    def handle(self, request: pb.ProcessingRequest) -> list[Wire]:
        """The encoded responses to one message from Envoy (none while a streamed body is being collected)."""
        if self.ended:
            return []
        if self.waiting:
            replies = self._handle(request)
            if self.ended:  # refused while it waited (a second request): the refusal is the only answer, now
                self.deferred = []
                return replies
            self.deferred += replies
            return []
        return self._handle(request)

    def _handle(self, request: pb.ProcessingRequest) -> list[Wire]:
        try:
            self._observe_context(request)
            phase = request.WhichOneof("request")
            if phase == "request_headers":
                return self._on_request_headers(request.request_headers)
            if phase == "request_body":
                return self._on_request_body(request.request_body)
            if phase == "request_trailers":
                return [*self._schedule_if_pending(), CONTINUE_REQUEST_TRAILERS]
            if phase == "response_headers":
                return self._on_response_headers(request.response_headers)
            if phase == "response_body":
                return self._on_response_body(request.response_body)
            if phase == "response_trailers":
                self.close()
                return [*self._flush_held_response(False), CONTINUE_RESPONSE_TRAILERS]
            raise ClientError(400, f"unexpected ext_proc message {phase!r}")
        except Exception as exc:
            return [self._refusal(exc)]

    def _refusal(self, exc: Exception) -> Wire:
        """The one place a request is refused: client mistakes, scheduling and queue refusals, internal errors."""
        if isinstance(exc, ClientError):
            return self._refuse(exc.status, exc.message, exc.reason)
        if isinstance(exc, SchedulingError):
            return self._refuse(exc.status, str(exc), exc.reason)
        log.error("internal error while processing a request", exc_info=exc)
        return self._refuse(500, "internal error in the endpoint picker", "internal")

    def _decided_later(self, outcome: Decision | Exception) -> None:
        """The queue let the held request go (its decision) or refused it: send the replies it makes, then those
        deferred meanwhile."""
        then, self.then = self.then, None
        try:
            if isinstance(outcome, Exception):
                raise outcome
            assert then is not None
            replies = then(outcome)
        except Exception as exc:
            replies = [self._refusal(exc)]
        deferred, self.deferred = self.deferred, []
        if not self.ended:
            replies += deferred
        assert self.deliver is not None
        self.deliver(replies)

    def close(self) -> None:
        """The request is over (response end, stream end or abort): the director releases it."""
        self.director.complete()

    def _refuse(self, status: int, message: str, reason: str) -> Wire:
        self.ctx.metrics.count_request(self.director.tenant, status)
        if status in (429, 503):
            self.ctx.metrics.decisions[Outcome.REJECTED].inc()
        self.close()
        self.ended = True
        return immediate_response(status, message, reason)

    def _observe_context(self, request: pb.ProcessingRequest) -> None:
        if request.HasField("protocol_config"):
            self.request_body_mode = request.protocol_config.request_body_mode
            self.response_body_mode = request.protocol_config.response_body_mode
        if request.HasField("metadata_context"):
            metadata = request.metadata_context.filter_metadata
            if SUBSET_NAMESPACE in metadata and SUBSET_KEY in (hint := metadata[SUBSET_NAMESPACE]).fields:
                self.director.subset = subset_hint(hint.fields[SUBSET_KEY])
            if LB_NAMESPACE in metadata and SERVED_KEY in (lb := metadata[LB_NAMESPACE]).fields:
                self.director.moved(lb.fields[SERVED_KEY].string_value)

    # --- request path -------------------------------------------------------------------------------------------

    def _on_request_headers(self, message: pb.HttpHeaders) -> list[Wire]:
        wanted = self.ctx.settings.control_headers
        for header in message.headers.headers:
            key = header.key
            # Envoy sends names in lower case; another gateway may not (llm-d-router lower-cases every name)
            if key in wanted or (not key.islower() and (key := key.lower()) in wanted):
                self.headers[key] = _header_value(header)
        self.path = request_path(self.headers)
        if message.end_of_stream and (self.path or "").partition("?")[0] == MODELS_PATH:
            cards = self.ctx.resolver().model_cards(int(time.time()))
            if cards is not None:  # without a route table (a peer's passthrough) a pod answers, as the reference's
                self.close()
                self.ended = True
                return [immediate(200, [("content-type", "application/json")],
                                  orjson.dumps({"object": "list", "data": cards}), "models")]
        mode = self.request_body_mode
        if message.end_of_stream or mode == NONE:
            return self._route_without_body()
        if mode == FULL_DUPLEX:
            return []  # answer once the whole body is in
        if mode == STREAMED:
            # Envoy would forward the headers before the body arrives: ask for the body BUFFERED (allow_mode_override)
            self.request_body_mode = BUFFERED
            return [buffer_request_body(self.response_body_mode)]
        return [CONTINUE_REQUEST_HEADERS]

    def _on_request_body(self, message: pb.HttpBody) -> list[Wire]:
        chunk = message.body
        reassembled = bool(self.body)
        if message.end_of_stream and not reassembled:
            body = chunk  # the whole body in one message (BUFFERED): no reassembly copy
        else:
            if chunk:
                self.body.append(chunk)
                self.body_size += len(chunk)
            body = b"".join(self.body) if message.end_of_stream else b""
        limit = self.ctx.settings.max_body_bytes
        if max(self.body_size, len(body)) > limit:
            raise ClientError(413, f"request body exceeds the limit of {limit} bytes", "body-too-large")
        if not message.end_of_stream:
            # full duplex: answer at the end; otherwise each chunk is answered, and held back until the whole is known
            return [] if self.request_body_mode == FULL_DUPLEX else [CLEAR_REQUEST_CHUNK]
        return self._route_with_body(body, reassembled)

    def _schedule_if_pending(self) -> list[Wire]:
        pending = self.director.destination is None and not self.waiting
        return self._route_with_body(b"".join(self.body), True) if pending else []

    def _route_without_body(self) -> list[Wire]:
        def routed_headers(decision: Decision) -> list[Wire]:
            return [routed("request_headers", self._destination_value(decision))]

        return self._route(self.director.body_less_request(), None, routed_headers)

    def _route_with_body(self, body: bytes, reassembled: bool) -> list[Wire]:
        """Schedule on the whole body; ``reassembled``: earlier chunks were held back, so the body goes out whole."""
        director, settings = self.director, self.ctx.settings
        if settings.passthrough_parser:
            request, route, new_body = director.body_less_request(), None, body
        else:
            rewrite = first_present(self.headers, MODEL_NAME_REWRITE_HEADERS) or None
            parsed = parse_request(body, settings.max_body_bytes, self.path, model_optional=rewrite is not None)
            route, request = director.prepare(parsed, rewrite)
            target = route.served_name or route.logical
            new_body = outgoing_body(body, parsed, target, -request.priority if settings.runtime_priority else None)
            if target != parsed.model and parsed.model and settings.rewrite_response_model:
                self.response_names = (target, parsed.model)
        return self._route(request, route, lambda decision: self._routed_body(decision, body, new_body, reassembled))

    def _route(self, request: SchedulingRequest, route: Resolution | None,
               then: Callable[[Decision], list[Wire]]) -> list[Wire]:
        """The director's decision as replies; none yet while the flow-control queue holds the request."""
        director = self.director
        director.later = self._decided_later if self.deliver is not None else None
        decision = director.route_request(request, route)
        if decision is None:
            self.then = then
            return []
        return then(decision)

    def _routed_body(self, decision: Decision, body: bytes, new_body: bytes, reassembled: bool) -> list[Wire]:
        destination = self._destination_value(decision)
        if self.request_body_mode == FULL_DUPLEX:
            return [routed("request_headers", destination, len(new_body)), *streamed_body(new_body)]
        if new_body is body and not reassembled:
            return [routed("request_body", destination)]
        return [routed("request_body", destination, len(new_body), new_body)]

    def _destination_value(self, decision: Decision) -> str:
        """The one value the header and the ``envoy.lb`` metadata both carry (the protocol forbids them to differ)."""
        return ",".join(decision.endpoints) if self.ctx.settings.destination_fallbacks else decision.endpoints[0]

    # --- response path ------------------------------------------------------------------------------------------

    def _on_response_headers(self, message: pb.HttpHeaders) -> list[Wire]:
        status = 0
        for header in message.headers.headers:
            if header.key == ":status":
                status = int(_header_value(header) or 0)
            elif header.key == "content-type":
                self.response_sse = "text/event-stream" in _header_value(header)
        self.director.response_headers(status)
        if message.end_of_stream or self.response_body_mode == NONE:
            self.director.response_started()  # no response body will come through the picker
        if message.end_of_stream:
            self.close()
        if self.response_names is not None and self.response_body_mode != BUFFERED:
            return [REMOVE_CONTENT_LENGTH]
        return [CONTINUE_RESPONSE_HEADERS]

    def _on_response_body(self, message: pb.HttpBody) -> list[Wire]:
        chunk, end = message.body, message.end_of_stream
        self.director.response_started()
        if end:
            self.close()
        names = self.response_names
        full_duplex = self.response_body_mode == FULL_DUPLEX
        if names is not None and self.response_sse:  # events are rewritten one chunk at a time
            new = rewrite_response_model(chunk, *names)
            if full_duplex:
                return list(streamed_body(new, end, response=True))
            return [CONTINUE_RESPONSE_BODY] if new == chunk else [response_body(new, False)]
        if names is None:
            return list(streamed_body(chunk, end, response=True)) if full_duplex else [CONTINUE_RESPONSE_BODY]
        if end and not self.response_held and not full_duplex:  # the whole body in one message (BUFFERED)
            new = rewrite_response_model(chunk, *names)
            return [CONTINUE_RESPONSE_BODY] if new == chunk else [response_body(new, self.response_body_mode == BUFFERED)]
        self.response_held += chunk
        if end or len(self.response_held) > self.ctx.settings.max_response_rewrite_bytes:
            return self._flush_held_response(end)
        return [] if full_duplex else [CLEAR_RESPONSE_CHUNK]

    def _flush_held_response(self, end: bool) -> list[Wire]:
        """Send the collected response: rewritten when it ended, as is when it outgrew the limit (rewrite stops)."""
        names = self.response_names
        if names is None or (not self.response_held and not end):
            return []
        held = bytes(self.response_held)
        self.response_held.clear()
        if end:
            held = rewrite_response_model(held, *names)
        else:
            self.response_names = None  # too large to hold: the rest passes through untouched
        if self.response_body_mode == FULL_DUPLEX:
            return list(streamed_body(held, end, response=True))
        return [response_body(held, end and self.response_body_mode == BUFFERED)]


class ExtProcHandler:
    """One ``Process`` call on the picker's own HTTP/2 transport (``loraplane.picker.transport``)."""

    def __init__(self, ctx: PickerContext) -> None:
        """A fresh exchange per call."""
        self.exchange = Exchange(ctx)

    def on_message(self, message: bytes) -> list[bytes]:
        """Decode a ``ProcessingRequest``, answer with encoded ``ProcessingResponse``s."""
        try:
            request = pb.ProcessingRequest.FromString(message)
        except DecodeError:
            raise GrpcStatusError(GRPC_INVALID_ARGUMENT, "not a ProcessingRequest") from None  # Envoy's bug, not the client's
        return self.exchange.handle(request)

    def bind(self, push: Deliver) -> None:
        """The transport's way to send replies later (a request the flow-control queue held)."""
        self.exchange.deliver = push

    @property
    def replies_pending(self) -> bool:
        """The request waits in the flow-control queue: its answer is still to be pushed (a client's half-close
        does not end the call before it)."""
        return self.exchange.waiting

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
        later: asyncio.Queue[list[Wire]] = asyncio.Queue()
        exchange.deliver = later.put_nowait
        try:
            async for request in request_iterator:
                for response in exchange.handle(request):
                    yield response
                while exchange.waiting or not later.empty():  # held by flow control: wait for its fate
                    for response in await later.get():
                        yield response
        finally:
            exchange.close()

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        """The handler to register: requests are decoded by grpcio, replies are already encoded (no serializer)."""
        method = grpc.stream_stream_rpc_method_handler(self.Process, request_deserializer=pb.ProcessingRequest.FromString)
        return grpc.method_handlers_generic_handler(pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name,
                                                    {"Process": method})
