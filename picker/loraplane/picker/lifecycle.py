"""Request plugins: the hooks around one request's life, as in the GIE / llm-d endpoint picker.

A scheduling cycle (filters, scorers, picker: ``loraplane.picker.scheduler``) chooses endpoints; request plugins
run around it, in config order:

- ``admit(request, saturated)`` after the cycle, before anything is sent: raise a ``SchedulingError`` to refuse;
- ``pre_request(request)`` once the endpoint is chosen and the request is about to go out (GIE's PreRequest);
- ``response_started(request)`` at most once, when its response starts coming back: the first response body chunk
  Envoy sends (for a streamed completion, the first token), or the response headers when Envoy sends no body for it
  (``response_body_mode: NONE``, or headers ending the stream); a request whose response never reaches the picker
  (response messages skipped, aborted before any) goes from ``pre_request`` straight to ``response_complete``;
- ``response_complete(request)`` when its response ends, or the stream ends or is aborted (GIE's
  ResponseComplete). Envoy reporting another endpoint served it is ``response_complete`` on the old endpoint and
  ``pre_request`` on the new one.

In-flight accounting is one (always present, first), per-tenant fair share another, the flow-control queue
(``loraplane.picker.flowcontrol``) a third, so ``extproc.py`` speaks only the protocol.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry
from pydantic import Field

from loraplane.api import ApiModel
from loraplane.picker.fairness import FairShare
from loraplane.picker.plugins import (
    REGISTRY,
    PluginKind,
    PluginType,
    SchedulingError,
    SchedulingRequest,
    register,
)
from loraplane.picker.snapshot import InFlightTracker


class Cancellable(Protocol):
    """What ``call_later`` returns (``asyncio.TimerHandle`` has this shape)."""

    def cancel(self) -> None:
        """Stop the call from happening."""
        ...


#: ``call_later(delay_seconds, callback)``: a wake-up on the process's clock (the event loop's, or a test's)
CallLater = Callable[[float, Callable[[], None]], Cancellable]


def loop_call_later(delay: float, callback: Callable[[], None]) -> Cancellable:
    """``call_later`` on the running event loop."""
    return asyncio.get_running_loop().call_later(delay, callback)


class _Timer:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualTimers:
    """A clock and ``call_later`` that someone else drives (tests, the simulator's event loop).

    ``run_due(now)`` moves the clock to ``now`` and runs every callback due by then, in time order (callbacks may
    schedule more); ``next_due()`` says when the next one is.
    """

    def __init__(self, now: float = 0.0) -> None:
        """Start the clock at ``now``."""
        self.now = now
        self._due: list[tuple[float, int, Callable[[], None], _Timer]] = []
        self._seq = itertools.count()

    def clock(self) -> float:
        """The current time."""
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable:
        """Run ``callback`` once the clock reaches now + ``delay``."""
        timer = _Timer()
        heapq.heappush(self._due, (self.now + delay, next(self._seq), callback, timer))
        return timer

    def next_due(self) -> float:
        """When the earliest pending callback is due (``inf`` when none is)."""
        while self._due and self._due[0][3].cancelled:
            heapq.heappop(self._due)
        return self._due[0][0] if self._due else math.inf

    def run_due(self, now: float) -> None:
        """Advance to ``now``, running what is due on the way."""
        while self.next_due() <= now:
            at, _, callback, timer = heapq.heappop(self._due)
            self.now = max(self.now, at)
            if not timer.cancelled:
                callback()
        self.now = max(self.now, now)


@dataclass
class PluginRuntime:
    """What request plugins may use: injected so tests and the simulator drive them on their own clock."""

    tracker: InFlightTracker
    #: monotonic seconds
    clock: Callable[[], float]
    call_later: CallLater = loop_call_later
    #: where plugins register their Prometheus metrics
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    #: how many endpoints the pool has now (flow control tells a full pool from an empty one); None: not known
    pool_size: Callable[[], int] | None = None


@dataclass(slots=True)
class InFlightRequest:
    """One request as request plugins see it."""

    scheduling: SchedulingRequest
    #: ``x-llm-d-inference-fairness-id`` (or its alias ``x-gateway-inference-fairness-id``), else the route's tenant
    fairness_key: str
    #: where it was sent (None until ``pre_request``)
    endpoint: str | None = None
    #: its response has started (``response_started`` ran): no longer waiting for its first token
    responding: bool = False
    #: the prompt tokens its endpoint's prefill queue counts until its first token (``Decision.prefill_tokens``)
    prefill_tokens: int = 0


class RequestPlugin:
    """Base of request plugins: every hook does nothing unless overridden."""

    def admit(self, request: InFlightRequest, saturated: bool) -> None:
        """The cycle chose endpoints (``saturated``: every candidate was); raise ``SchedulingError`` to refuse."""

    def pre_request(self, request: InFlightRequest) -> None:
        """``request.endpoint`` is chosen and the request is about to be sent."""

    def response_started(self, request: InFlightRequest) -> None:
        """The response from ``request.endpoint`` started (its first token, for a streamed completion)."""

    def response_complete(self, request: InFlightRequest) -> None:
        """The request sent to ``request.endpoint`` is over (response end, stream end or abort)."""


class InFlightAccounting(RequestPlugin):
    """The picker's own in-flight count per endpoint and served name, and how many of those have no first token yet
    (fresher than any report): the in-flight and prefill-queue scorers and the GPU-slot room check
    (``PoolSnapshot.has_room``) read them."""

    def __init__(self, tracker: InFlightTracker) -> None:
        """Count into ``tracker``."""
        self.tracker = tracker

    def pre_request(self, request: InFlightRequest) -> None:
        """One more in flight at the endpoint (and waiting for its first token, unless its response started)."""
        assert request.endpoint is not None
        scheduling = request.scheduling
        self.tracker.start(request.endpoint, scheduling.served_name, not request.responding, request.prefill_tokens)

    def response_started(self, request: InFlightRequest) -> None:
        """One fewer waiting for its first token."""
        assert request.endpoint is not None
        self.tracker.first_token(request.endpoint, request.prefill_tokens)

    def response_complete(self, request: InFlightRequest) -> None:
        """One fewer in flight (and waiting for its first token, if its response never started)."""
        assert request.endpoint is not None
        scheduling = request.scheduling
        self.tracker.finish(request.endpoint, scheduling.served_name, not request.responding, request.prefill_tokens)


class FairShareExceededError(SchedulingError):
    """The pool is saturated and the request's fairness key holds more than its share."""

    status = 429
    reason = "rejected-fairness"


class FairShareParameters(ApiModel):
    """How far above the average in-flight share a key may go while the pool is saturated."""

    factor: float = Field(default=2.0, gt=1)


class FairSharePlugin(RequestPlugin):
    """Refuses (429) a non-gold request of a key above its fair share while every candidate is saturated."""

    def __init__(self, params: FairShareParameters) -> None:
        """Count in-flight requests per fairness key."""
        self.share = FairShare(params.factor)

    def admit(self, request: InFlightRequest, saturated: bool) -> None:
        """Refuse while saturated and over share."""
        key = request.fairness_key
        if saturated and request.scheduling.priority <= 0 and self.share.over_share(key):
            raise FairShareExceededError(f"the pool is saturated and fairness key {key!r} is above its fair share")

    def pre_request(self, request: InFlightRequest) -> None:
        """One more in flight for the key."""
        self.share.start(request.fairness_key)

    def response_complete(self, request: InFlightRequest) -> None:
        """One fewer."""
        self.share.finish(request.fairness_key)


class Lifecycle:
    """The request plugins of one process, in order; in-flight accounting first."""

    def __init__(self, runtime: PluginRuntime, plugins: Iterable[RequestPlugin] = ()) -> None:
        """Run ``plugins`` after the in-flight accounting of ``runtime.tracker``."""
        self.runtime = runtime
        self.plugins: list[RequestPlugin] = [InFlightAccounting(runtime.tracker), *plugins]
        self._index_hooks()

    def _index_hooks(self) -> None:
        """Keep, per hook, the plugins that override it (a hook nobody overrides costs nothing)."""

        def overriding(hook: str) -> list[Callable[..., None]]:
            default = getattr(RequestPlugin, hook)
            return [getattr(p, hook) for p in self.plugins if getattr(type(p), hook) is not default]

        self._admit = overriding("admit")
        self._pre = overriding("pre_request")
        self._started = overriding("response_started")
        self._complete = overriding("response_complete")

    @classmethod
    def from_specs(cls, runtime: PluginRuntime, specs: Iterable[tuple[str, dict[str, object]]]) -> Lifecycle:
        """Instantiate the request plugins named by ``(type, parameters)`` pairs (a config profile's order)."""
        plugins = []
        for type_name, parameters in specs:
            kind = REGISTRY[type_name]
            plugins.append(kind.factory(kind.parameters.model_validate(parameters), runtime))
        return cls(runtime, plugins)

    def find(self, kind: type[RequestPlugin]) -> RequestPlugin | None:
        """The first plugin of ``kind`` (e.g. the flow-control queue), or None."""
        return next((p for p in self.plugins if isinstance(p, kind)), None)

    def add(self, plugin: RequestPlugin) -> None:
        """Append a plugin (e.g. one the command line turned on)."""
        self.plugins.append(plugin)
        self._index_hooks()

    def admit(self, request: InFlightRequest, saturated: bool) -> None:
        """Every plugin's ``admit`` (the first refusal wins)."""
        for hook in self._admit:
            hook(request, saturated)

    def pre_request(self, request: InFlightRequest) -> None:
        """Every plugin's ``pre_request``."""
        for hook in self._pre:
            hook(request)

    def response_started(self, request: InFlightRequest) -> None:
        """Every plugin's ``response_started``, once per request (later calls do nothing)."""
        if request.responding:
            return
        for hook in self._started:
            hook(request)
        request.responding = True

    def response_complete(self, request: InFlightRequest) -> None:
        """Every plugin's ``response_complete``."""
        for hook in self._complete:
            hook(request)

    def moved(self, request: InFlightRequest, endpoint: str) -> None:
        """Envoy reports ``endpoint`` served it, not the one chosen: complete on the old, start on the new (with its
        whole prompt to prefill: the prefix expected was the chosen one's)."""
        self.response_complete(request)
        request.endpoint = endpoint
        request.prefill_tokens = request.scheduling.prompt_tokens
        self.pre_request(request)


register("fair-share", PluginType(PluginKind.REQUEST, FairShareParameters, lambda params, _runtime: FairSharePlugin(params)))
