"""The request director: one request's phases, in order, apart from the Envoy protocol that carries them.

``RequestDirector`` runs what llm-d-router's director runs, for one request:

1. **resolve** -- the body's ``model`` (or the model-name rewrite header) to a served revision, its tenant and
   priority (``resolve``), and an ``InferenceObjective`` that may lower the priority;
2. **prepare data** -- what every plugin reads, computed once: the ``SchedulingRequest`` with the prefix scorer's
   block hashes (``scheduling_request``);
3. **admit and schedule** -- the scheduler's decision, or a place in the flow-control queue while every candidate
   is saturated (``route``; the queue calls ``try_dispatch`` / ``refuse`` later);
4. **pre-request** -- the decision admitted through the request plugins and accounted as sent (in flight, rates);
5. **response** -- the response's status (``response_headers``), its first byte (``response_started``), the
   endpoint Envoy says served it (``moved``), and its end (``complete``).

The protocol handler (``loraplane.picker.extproc.Exchange``) calls these phases as Envoy's messages arrive and turns
their results into wire replies; the director never sees a protobuf message or a body mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm

from loraplane.api import PriorityClass
from loraplane.api.headers import (
    FAIRNESS_ID_HEADERS,
    MODEL_NAME_REWRITE_HEADERS,
    OBJECTIVE_HEADERS,
    first_present,
)
from loraplane.picker.body import PATH_HEADERS, ClientError, ParsedBody
from loraplane.picker.flowcontrol import FlowControl
from loraplane.picker.lifecycle import InFlightRequest, Lifecycle, PluginRuntime
from loraplane.picker.plugins import WAITED_OUT, SchedulingRequest
from loraplane.picker.routes import Resolution, RouteResolver, UnknownModelError
from loraplane.picker.scheduler import Decision, Scheduler, SchedulingError, WaitKey
from loraplane.picker.snapshot import InFlightTracker, PoolSnapshot
from loraplane.picker.telemetry import PickerMetrics, RequestStats

log = logging.getLogger(__name__)

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
    body_mode: int = pm.ProcessingMode.FULL_DUPLEX_STREAMED
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
    """Everything a request needs, shared by all requests of a process."""

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


#: what the director hands back for a request the queue held: its decision, or why it was refused
Later = Callable[[Decision | Exception], None]


class RequestDirector:
    """One request's phases (see the module). ``headers``: the request's control headers, lower-case names."""

    __slots__ = ("client_model", "ctx", "destination", "finished", "headers", "inflight", "later", "route",
                 "sent_at", "subset", "tenant", "wait_key", "waiting")

    def __init__(self, ctx: PickerContext, headers: Mapping[str, str]) -> None:
        self.ctx = ctx
        self.headers = headers
        #: the subset hint of Envoy's metadata: only these endpoints (``ip:port`` or ``ip``) may serve
        self.subset: frozenset[str] | None = None
        self.route: Resolution | None = None
        #: the model name the client sent
        self.client_model: str | None = None
        self.tenant = "none"
        self.destination: str | None = None
        self.sent_at: float | None = None
        #: what the request plugins see, once the request is sent
        self.inflight: InFlightRequest | None = None
        #: where a held request's fate goes (set by the protocol handler; without it a request is never held)
        self.later: Later | None = None
        #: while the flow-control queue holds the request: what it is routed with
        self.waiting: tuple[SchedulingRequest, Resolution | None] | None = None
        #: what its last decision saw (``Scheduler.still_waits``): until that changes, the queue's retries are free
        self.wait_key: WaitKey | None = None
        self.finished = False

    # --- 1. resolve -----------------------------------------------------------------------------------------------

    def resolve(self, parsed: ParsedBody, rewrite: str | None) -> Resolution:
        """The revision the request goes to.

        As llm-d-router applies its model-name rewrite: a route for the body's ``model`` (the route table is
        loraplane's rewrite rules) beats the gateway's rewrite header; without one, the header's value is the model
        name sent to the server and is never resolved as a logical name. It names a served revision of the table
        (routed with that revision's affinity, tenant and priority), the base model, or else nothing this pool
        serves (404, or as given with ``--unknown-models-to-base``).
        """
        model = self.client_model = parsed.model
        ctx = self.ctx
        resolver = ctx.resolver()
        if rewrite is None or resolver.has_route(model):
            session = self.headers.get(ctx.settings.session_header.lower()) or first_present(self.headers, FAIRNESS_ID_HEADERS)
            try:
                route = resolver.resolve(model, session, ctx.rng)
            except UnknownModelError as exc:
                if not ctx.settings.unknown_models_to_base:
                    raise ClientError(404, str(exc), "model-not-found") from None
                route = Resolution(model, None, None, None, "default", 0)
        else:
            if rewrite != model:
                ctx.metrics.model_rewrites.inc()
            found = resolver.served(rewrite)
            if found is not None:
                route = found
            elif rewrite == resolver.base_model or ctx.settings.unknown_models_to_base:
                route = Resolution(rewrite, None, None, None, "default", 0)
            else:
                raise ClientError(404, f"model {rewrite!r} (the model-name rewrite header's) is not served by this "
                                  "pool", "model-not-found")
        self.route = route
        self.tenant = route.tenant
        return route

    # --- 2. prepare data ------------------------------------------------------------------------------------------

    def prepare(self, parsed: ParsedBody, rewrite: str | None) -> tuple[Resolution, SchedulingRequest]:
        """Phases 1 and 2 for a parsed body: its route and what the plugins read."""
        route = self.resolve(parsed, rewrite)
        return route, self.scheduling_request(route, parsed)

    def scheduling_request(self, route: Resolution, parsed: ParsedBody) -> SchedulingRequest:
        """What the plugins read, computed once: the revision, its priority (an objective may lower it, never
        raise it), tenant, subset, and the prefix scorer's block hashes of the body."""
        priority = route.priority
        name = first_present(self.headers, OBJECTIVE_HEADERS)
        if name:
            objective = self.ctx.objectives().get(name)
            if objective is None:
                objective = _PRIORITY_OF_OBJECTIVE.get(name)
            if objective is not None:
                priority = min(priority, objective)
        request = SchedulingRequest(route.served_name, route.digest, priority, route.tenant, self.subset,
                                    prompt_tokens=parsed.prompt_tokens)
        return self.ctx.scheduler.read_body(request, parsed.document)

    def body_less_request(self) -> SchedulingRequest:
        """A request without a body to read (or one not parsed): scheduled like the base model's, within the subset."""
        return SchedulingRequest(subset=self.subset)

    # --- 3. admit and schedule, 4. pre-request ----------------------------------------------------------------------

    def route_request(self, request: SchedulingRequest, route: Resolution | None) -> Decision | None:
        """The decision, admitted and sent; None while the flow-control queue holds the request (its decision or
        refusal comes to ``later``). Raises the scheduler's and the queue's refusals."""
        if self.waiting is not None or self.destination is not None:
            raise ClientError(400, "a second request on one ext_proc stream")
        flow = self.ctx.flow_control if self.later is not None else None
        if flow is None:
            decision = self._decide(request, may_wait=False)
            assert decision is not None  # without may_wait the scheduler's answer or its error
            return self._send(request, route, decision)
        decision = None if flow.busy(request.priority) else self._decide(request, may_wait=True)
        if decision is None:
            flow.hold(self, request.priority, self.fairness_key(request))
            self.waiting = (request, route)
            return None
        return self._send(request, route, decision)

    def try_dispatch(self) -> bool:
        """The queue schedules the held request again: True when it is sent or refused, False while it must wait."""
        waiting = self.waiting
        if waiting is None or self.finished:
            return True
        request, route = waiting
        key = self.wait_key
        if key is not None and self.ctx.scheduler.still_waits(request, self.ctx.snapshot(), key):
            return False
        outcome: Decision | Exception
        try:
            decision = self._decide(request, may_wait=True)
            if decision is None:
                return False
            outcome = self._send(request, route, decision)
        except Exception as exc:
            outcome = exc
        self._answer(outcome)
        return True

    def refuse(self, error: SchedulingError) -> None:
        """The queue refuses the held request (deadline, picker stopping)."""
        self._answer(error)

    def _answer(self, outcome: Decision | Exception) -> None:
        """Out of the queue, then the outcome to ``later`` (a refusal also ends the request first: the queue counts
        a waiter refused while it was tried as refused, not cancelled)."""
        if isinstance(outcome, Exception):
            self.complete()
        self.waiting = None
        assert self.later is not None
        self.later(outcome)

    def fairness_key(self, request: SchedulingRequest) -> str:
        """Whose share of the queue the request takes: the fairness header's id, else its tenant."""
        return first_present(self.headers, FAIRNESS_ID_HEADERS) or request.tenant

    def _decide(self, request: SchedulingRequest, may_wait: bool) -> Decision | None:
        """The scheduler's decision; ``may_wait``: None instead when it should wait (every candidate saturated, none
        with room for the revision: ``Decision.should_wait``, or none holding it)."""
        ctx = self.ctx
        started = ctx.clock()
        try:
            decision = ctx.scheduler.schedule(request, ctx.snapshot(), ctx.rng)
        except WAITED_OUT:
            if may_wait:
                return None
            raise
        finally:
            ctx.metrics.decision_seconds.observe(ctx.clock() - started)
        self.wait_key = decision.wait_key
        return None if may_wait and decision.should_wait else decision

    def _send(self, request: SchedulingRequest, route: Resolution | None, decision: Decision) -> Decision:
        """Admit the decision through the request plugins and account it as sent."""
        ctx = self.ctx
        inflight = InFlightRequest(request, self.fairness_key(request), decision.endpoints[0],
                                   prefill_tokens=decision.prefill_tokens)
        ctx.plugins.admit(inflight, decision.saturated)
        ctx.metrics.decisions[decision.outcome].inc()
        self.destination = decision.endpoints[0]
        self.sent_at = ctx.clock()
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

    # --- 5. response ----------------------------------------------------------------------------------------------

    def response_headers(self, status: int) -> None:
        """The response's status is known: counted per tenant, and per revision with the time to it."""
        self.ctx.metrics.count_request(self.tenant, status)
        if self.route is not None and self.route.served_name is not None:
            ttft = self.ctx.clock() - self.sent_at if self.sent_at is not None else None
            self.ctx.stats.record_response(self.route.served_name, status, ttft)

    def response_started(self) -> None:
        """The response's first bytes are here (the first token of a streamed completion): tell the plugins once."""
        if self.inflight is not None and not self.finished:
            self.ctx.plugins.response_started(self.inflight)

    def moved(self, served: str) -> None:
        """Envoy reports the endpoint that served (a fallback, or its own choice): move the in-flight count there."""
        served = served.partition(",")[0].strip()
        if not served or self.inflight is None or served == self.destination or self.finished:
            return
        self.ctx.plugins.moved(self.inflight, served)
        self.destination = served
        self.ctx.metrics.destination_overrides.inc()

    def complete(self) -> None:
        """The request is over (response end, refusal, stream end or abort): out of the queue, its in-flight slot
        released, once."""
        if self.waiting is not None:
            self.waiting = None
            flow = self.ctx.flow_control
            if flow is not None:
                flow.cancel(self)
        if not self.finished:
            self.finished = True
            if self.inflight is not None:
                self.ctx.plugins.response_complete(self.inflight)
