"""The Envoy ``ext_proc`` exchange: one ``Exchange`` per HTTP request, one gRPC stream per exchange.

The exchange turns each ``ProcessingRequest`` into the ``ProcessingResponse``s the GIE endpoint-picker protocol
expects. Bodies may arrive ``BUFFERED``, ``STREAMED`` or ``FULL_DUPLEX_STREAMED`` (the mode comes from the stream's
``protocol_config``, else from ``PickerSettings.body_mode``); split bodies are reassembled, and full-duplex bodies are
sent back in chunks of at most 62,000 bytes. Client mistakes become ``ImmediateResponse``s (400, 404, 413, 429,
503), never stream errors, and an ``ImmediateResponse`` ends the exchange (later messages get no reply). The replies'
wire bytes come from ``loraplane.picker.wire``; this module decides which reply, never how it is encoded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import grpc
import numpy as np
import orjson
from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError

from loraplane.api import PriorityClass, validation
from loraplane.api.headers import (
    DROPPED_REASON_HEADER,
    FAIRNESS_ID_HEADERS,
    MODEL_NAME_REWRITE_HEADERS,
    OBJECTIVE_HEADERS,
)
from loraplane.picker.body import (
    PATH_HEADERS,
    ClientError,
    ParsedBody,
    parse_body,
    request_path,
    rewrite_request_model,
    rewrite_response_model,
    set_request_field,
    validate_api_fields,
)
from loraplane.picker.flowcontrol import FlowControl
from loraplane.picker.lifecycle import InFlightRequest, Lifecycle, PluginRuntime
from loraplane.picker.plugins import PoolSaturatedError, SchedulingRequest
from loraplane.picker.routes import Resolution, RouteResolver, UnknownModelError
from loraplane.picker.scheduler import Decision, Outcome, Scheduler, SchedulingError
from loraplane.picker.snapshot import InFlightTracker, PoolSnapshot
from loraplane.picker.telemetry import PickerMetrics, RequestStats
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

_PRIORITY_OF_OBJECTIVE = {objective.value: objective.priority for objective in PriorityClass}


@dataclass
class PickerSettings:
    """Request-handling settings of one picker process."""

    max_body_bytes: int = 1 << 20
    #: request header whose value keeps a user on one side of a canary split (falls back to the fairness id)
    session_header: str = "x-session-id"
    #: rewrite the response's ``model`` back to the logical name the client sent
    rewrite_response_model: bool = True
    #: send the ordered fallback list as the destination (GIE); off for plain Envoy ``ORIGINAL_DST``, which accepts
    #: one address only (the header and the metadata always carry the same value)
    destination_fallbacks: bool = True
    #: the body mode assumed when Envoy sends no ``protocol_config`` (the reference EPP's streaming default)
    body_mode: int = FULL_DUPLEX
    #: route model names the route table does not know like the base model (the reference EPP's behaviour) instead
    #: of refusing them with 404
    unknown_models_to_base: bool = False
    #: do not parse request bodies (not OpenAI JSON): forward them untouched, scheduled like base-model requests
    passthrough_parser: bool = False
    #: a non-SSE response body is collected for the ``model`` rewrite up to this size, then passed through as is
    max_response_rewrite_bytes: int = 16 << 20
    #: write the request's priority into the body as vLLM's ``priority`` (lower served first: minus the GIE
    #: priority), replacing whatever the client sent; for pools whose runtimes run ``--scheduling-policy priority``
    runtime_priority: bool = False

    @cached_property
    def control_headers(self) -> frozenset[str]:
        """The request headers the picker reads, in lower case (names are compared case-insensitively)."""
        return frozenset({self.session_header.lower(), *FAIRNESS_ID_HEADERS, *OBJECTIVE_HEADERS,
                          *MODEL_NAME_REWRITE_HEADERS, *PATH_HEADERS})


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
    #: InferenceObjective name -> priority (from the cluster's ``InferenceObjective`` resources)
    objectives: Callable[[], Mapping[str, int]] = dict
    #: the request plugins (in-flight accounting first); None: those the scheduler's profile names
    lifecycle: Lifecycle | None = None
    #: the clock the snapshot's ``received_at`` reads (the pool state's): the chosen endpoint's report age is
    #: observed at each decision (``loraplane_picker_report_age_seconds``); None: not observed
    report_clock: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        if self.lifecycle is None:
            runtime = PluginRuntime(self.tracker, self.clock, registry=self.metrics.registry,
                                    pool_size=lambda: self.snapshot().size)
            self.lifecycle = self.scheduler.lifecycle(runtime)

    @property
    def flow_control(self) -> FlowControl | None:
        """The flow-control queue, when the config turns it on."""
        found = self.plugins.find(FlowControl)
        return found if isinstance(found, FlowControl) else None

    @property
    def plugins(self) -> Lifecycle:
        """The request plugins (always set after construction)."""
        assert self.lifecycle is not None
        return self.lifecycle


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
    """The state of one HTTP request as it passes through Envoy."""

    __slots__ = (
        "body",
        "body_size",
        "client_model",
        "ctx",
        "deferred",
        "deliver",
        "destination",
        "ended",
        "finished",
        "headers",
        "inflight",
        "request_body_mode",
        "response_body_mode",
        "response_held",
        "response_names",
        "response_sse",
        "route",
        "sent_at",
        "subset",
        "tenant",
        "waiting",
    )

    def __init__(self, ctx: PickerContext) -> None:
        """Start an exchange; nothing is sent until Envoy's first message."""
        self.ctx = ctx
        self.headers: dict[str, str] = {}
        self.request_body_mode = ctx.settings.body_mode
        self.response_body_mode = ctx.settings.body_mode
        #: the request body's chunks so far, joined once at its end (a bytearray grown chunk by chunk copies it
        #: twice more)
        self.body: list[bytes] = []
        self.body_size = 0
        self.subset: frozenset[str] | None = None
        self.route: Resolution | None = None
        #: the model name the client sent (the response is rewritten back to it)
        self.client_model: str | None = None
        #: (name in the response, name to put back) while the response's ``model`` is rewritten; None: no rewrite
        self.response_names: tuple[str, str] | None = None
        self.response_sse = False
        #: a non-SSE response collected for the rewrite (a JSON document may be split anywhere)
        self.response_held = bytearray()
        self.destination: str | None = None
        self.sent_at: float | None = None
        self.tenant = "none"
        #: what the request plugins see, once the request is sent
        self.inflight: InFlightRequest | None = None
        #: set by the transport: replies produced later (without it a saturated request is never held)
        self.deliver: Deliver | None = None
        #: while the flow-control queue holds the request: what it needs to be routed
        self.waiting: tuple[SchedulingRequest, Resolution | None, Callable[[Decision], list[Wire]]] | None = None
        #: replies to later messages while the request waits (sent after the routed reply, in order)
        self.deferred: list[Wire] = []
        self.finished = False
        #: an ImmediateResponse was sent: the exchange is over, later messages get no reply
        self.ended = False

    # --- dispatch -----------------------------------------------------------------------------------------------

    def handle(self, request: pb.ProcessingRequest) -> list[Wire]:
        """The encoded responses to one message from Envoy (none while a streamed body is being collected)."""
        if self.ended:
            return []
        if self.waiting is not None:
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

    # --- flow control (the queue calls these while the request waits) ------------------------------------------

    def try_dispatch(self) -> bool:
        """Schedule the waiting request again; True when it is sent or refused, False while still saturated."""
        waiting = self.waiting
        if waiting is None or self.ended:
            return True
        request, route, then = waiting
        try:
            decision = self._decide(request, may_wait=True)
            if decision is None:
                return False
            replies = then(self._send(request, route, decision))
        except Exception as exc:
            replies = [self._refusal(exc)]
        self._resume(replies)
        return True

    def refuse(self, error: SchedulingError) -> None:
        """The queue refuses the waiting request (deadline, picker stopping)."""
        self._resume([self._refusal(error)])

    def _resume(self, replies: list[Wire]) -> None:
        self.waiting = None
        deferred, self.deferred = self.deferred, []
        if not self.ended:
            replies += deferred
        assert self.deliver is not None
        self.deliver(replies)

    def close(self) -> None:
        """The request is over (response end, stream end or abort): release its in-flight slot."""
        if self.waiting is not None:
            self.waiting = None
            flow = self.ctx.flow_control
            if flow is not None:
                flow.cancel(self)
        if not self.finished:
            self.finished = True
            if self.inflight is not None:
                self.ctx.plugins.response_complete(self.inflight)

    def _refuse(self, status: int, message: str, reason: str) -> Wire:
        self.ctx.metrics.count_request(self.tenant, status)
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
                self.subset = subset_hint(hint.fields[SUBSET_KEY])
            if LB_NAMESPACE in metadata and SERVED_KEY in (lb := metadata[LB_NAMESPACE]).fields:
                self._follow_served(lb.fields[SERVED_KEY].string_value)

    def _follow_served(self, served: str) -> None:
        """Envoy reports the endpoint that served (a fallback, or its own choice): move the in-flight count there."""
        served = served.partition(",")[0].strip()
        if not served or self.inflight is None or served == self.destination or self.finished:
            return
        self.ctx.plugins.moved(self.inflight, served)
        self.destination = served
        self.ctx.metrics.destination_overrides.inc()

    # --- request path -------------------------------------------------------------------------------------------

    def _on_request_headers(self, message: pb.HttpHeaders) -> list[Wire]:
        wanted = self.ctx.settings.control_headers
        for header in message.headers.headers:
            key = header.key
            # Envoy sends names in lower case; another gateway may not (llm-d-router lower-cases every name)
            if key in wanted or (not key.islower() and (key := key.lower()) in wanted):
                self.headers[key] = _header_value(header)
        if message.end_of_stream and (request_path(self.headers) or "").partition("?")[0] == MODELS_PATH:
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
        pending = self.destination is None and self.waiting is None
        return self._route_with_body(b"".join(self.body), True) if pending else []

    def _route_without_body(self) -> list[Wire]:
        def routed_headers(decision: Decision) -> list[Wire]:
            destination = self._destination_value(decision)
            return [routed("request_headers", destination)]

        return self._route(SchedulingRequest(subset=self.subset), None, routed_headers)

    def _route_with_body(self, body: bytes, reassembled: bool) -> list[Wire]:
        """Schedule on the whole body; ``reassembled``: earlier chunks were held back, so the body goes out whole."""
        if self.ctx.settings.passthrough_parser:
            request, route, new_body = SchedulingRequest(subset=self.subset), None, body
        else:
            rewrite = self._header(MODEL_NAME_REWRITE_HEADERS) or None
            parsed = parse_body(body, self.ctx.settings.max_body_bytes, model_optional=rewrite is not None)
            validate_api_fields(parsed.document, request_path(self.headers))
            route = self._resolve(parsed, rewrite)
            request = self._scheduling_request(route, parsed)
            target = route.served_name or route.logical
            new_body = body if target == parsed.model else rewrite_request_model(body, parsed, target)
            if target != parsed.model and parsed.model and self.ctx.settings.rewrite_response_model:
                self.response_names = (target, parsed.model)
            if self.ctx.settings.runtime_priority:
                new_body = set_request_field(new_body, "priority", -request.priority)
        return self._route(request, route, lambda decision: self._routed_body(decision, body, new_body, reassembled))

    def _routed_body(self, decision: Decision, body: bytes, new_body: bytes, reassembled: bool) -> list[Wire]:
        destination = self._destination_value(decision)
        if self.request_body_mode == FULL_DUPLEX:
            return [routed("request_headers", destination, len(new_body)), *streamed_body(new_body)]
        if new_body is body and not reassembled:
            return [routed("request_body", destination)]
        return [routed("request_body", destination, len(new_body), new_body)]

    def _header(self, names: tuple[str, ...]) -> str | None:
        """The first of ``names`` the request carries (the current llm-d name before its deprecated alias), as
        llm-d-router reads them: a present name wins even when its value is empty."""
        headers = self.headers
        for name in names:
            if name in headers:
                return headers[name]
        return None

    def _resolve(self, parsed: ParsedBody, rewrite: str | None) -> Resolution:
        """The revision the request goes to.

        As llm-d-router applies its model-name rewrite: a route for the body's ``model`` (the route table is
        loraplane's rewrite rules) beats the gateway's rewrite header; without one, the header's value is the model
        name sent to the server and is never resolved as a logical name. It names a served revision of the table
        (routed with that revision's affinity, tenant and priority), the base model, or else nothing this pool
        serves (404, or as given with ``--unknown-models-to-base``).
        """
        model = self.client_model = parsed.model
        resolver = self.ctx.resolver()
        if rewrite is None or resolver.has_route(model):
            session = self.headers.get(self.ctx.settings.session_header.lower()) or self._header(FAIRNESS_ID_HEADERS)
            try:
                route = resolver.resolve(model, session, self.ctx.rng)
            except UnknownModelError as exc:
                if not self.ctx.settings.unknown_models_to_base:
                    raise ClientError(404, str(exc), "model-not-found") from None
                route = Resolution(model, None, None, None, "default", 0)
        else:
            if rewrite != model:
                self.ctx.metrics.model_rewrites.inc()
            found = resolver.served(rewrite)
            if found is not None:
                route = found
            elif rewrite == resolver.base_model or self.ctx.settings.unknown_models_to_base:
                route = Resolution(rewrite, None, None, None, "default", 0)
            else:
                raise ClientError(404, f"model {rewrite!r} (the model-name rewrite header's) is not served by this "
                                  "pool", "model-not-found")
        self.route = route
        self.tenant = route.tenant
        return route

    def _scheduling_request(self, route: Resolution, parsed: ParsedBody) -> SchedulingRequest:
        priority = route.priority
        name = self._header(OBJECTIVE_HEADERS)
        if name:
            objective = self.ctx.objectives().get(name)
            if objective is None:
                objective = _PRIORITY_OF_OBJECTIVE.get(name)
            if objective is not None:
                priority = min(priority, objective)  # an objective may lower priority, never raise it
        prefix_scorer = self.ctx.scheduler.prefix
        prefix = (None if prefix_scorer is None
                  else prefix_scorer.hash_request(route.served_name, route.digest, parsed.document))
        return SchedulingRequest(route.served_name, route.digest, priority, route.tenant, self.subset, prefix)

    def _route(self, request: SchedulingRequest, route: Resolution | None,
               then: Callable[[Decision], list[Wire]]) -> list[Wire]:
        """Schedule and send; with flow control on, a request with no unsaturated candidate waits in the queue."""
        if self.waiting is not None or self.destination is not None:
            raise ClientError(400, "a second request on one ext_proc stream")
        flow = self.ctx.flow_control if self.deliver is not None else None
        if flow is None:
            decision = self._decide(request, may_wait=False)
            assert decision is not None  # without may_wait the scheduler's answer or its error
            return then(self._send(request, route, decision))
        decision = None if flow.busy(request.priority) else self._decide(request, may_wait=True)
        if decision is None:
            flow.hold(self, request.priority, self._fairness_key(request))
            self.waiting = (request, route, then)
            return []
        return then(self._send(request, route, decision))

    def _fairness_key(self, request: SchedulingRequest) -> str:
        return self._header(FAIRNESS_ID_HEADERS) or request.tenant

    def _decide(self, request: SchedulingRequest, may_wait: bool) -> Decision | None:
        """The scheduler's decision; ``may_wait``: None instead when it should wait (every candidate saturated, or
        none with room for the revision: ``Decision.should_wait``)."""
        ctx = self.ctx
        started = ctx.clock()
        try:
            decision = ctx.scheduler.schedule(request, ctx.snapshot(), ctx.rng)
        except PoolSaturatedError:
            if may_wait:
                return None
            raise
        finally:
            ctx.metrics.decision_seconds.observe(ctx.clock() - started)
        return None if may_wait and decision.should_wait else decision

    def _send(self, request: SchedulingRequest, route: Resolution | None, decision: Decision) -> Decision:
        """Admit the decision through the request plugins and account it as sent."""
        ctx = self.ctx
        now = ctx.clock()
        inflight = InFlightRequest(request, self._fairness_key(request), decision.endpoints[0])
        ctx.plugins.admit(inflight, decision.saturated)
        ctx.metrics.decisions[decision.outcome].inc()
        self.destination = decision.endpoints[0]
        self.sent_at = now
        self.inflight = inflight
        ctx.plugins.pre_request(inflight)
        if route is not None and route.served_name is not None:
            ctx.stats.record_request(route.served_name)
        if ctx.report_clock is not None and decision.indices:
            snapshot = ctx.snapshot()
            index = decision.indices[0]
            if index < snapshot.size and (received := float(snapshot.received_at[index])) == received:  # not NaN
                ctx.metrics.report_age.observe(ctx.report_clock() - received)
        return decision

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
        self.ctx.metrics.count_request(self.tenant, status)
        if self.route is not None and self.route.served_name is not None:
            ttft = self.ctx.clock() - self.sent_at if self.sent_at is not None else None
            self.ctx.stats.record_response(self.route.served_name, status, ttft)
        if message.end_of_stream or self.response_body_mode == NONE:
            self._response_started()  # no response body will come through the picker
        if message.end_of_stream:
            self.close()
        if self.response_names is not None and self.response_body_mode != BUFFERED:
            return [REMOVE_CONTENT_LENGTH]
        return [CONTINUE_RESPONSE_HEADERS]

    def _on_response_body(self, message: pb.HttpBody) -> list[Wire]:
        chunk, end = message.body, message.end_of_stream
        self._response_started()
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

    def _response_started(self) -> None:
        """The response's first bytes are here (the first token of a streamed completion): tell the plugins once."""
        if self.inflight is not None and not self.finished:
            self.ctx.plugins.response_started(self.inflight)

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
        return self.exchange.waiting is not None

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
                while exchange.waiting is not None or not later.empty():  # held by flow control: wait for its fate
                    for response in await later.get():
                        yield response
        finally:
            exchange.close()

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        """The handler to register: requests are decoded by grpcio, replies are already encoded (no serializer)."""
        method = grpc.stream_stream_rpc_method_handler(self.Process, request_deserializer=pb.ProcessingRequest.FromString)
        return grpc.method_handlers_generic_handler(pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name,
                                                    {"Process": method})
