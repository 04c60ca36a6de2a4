"""Flow control: requests whose every candidate endpoint is saturated wait in the picker instead of piling onto a pod.

A request plugin (type ``flow-control``). A held request keeps its ext_proc stream open; it waits in one of three
priority bands (gold: priority > 0, standard: 0, sheddable: < 0, as GIE and ``InferenceObjective`` priorities
have it) and, inside a band, in its fairness key's queue, keys taking turns (round-robin fair queuing). Dispatch
rounds go band by band, key by key, asking the scheduler again: a head request goes out as soon as one of its
candidates has room (the scheduler prefers a pod where its revision is warm), else that key's turn passes. A round
runs when a request completes (``response_complete``), every ``retryIntervalSeconds`` while anything waits
(fresher reports), and on arrival. Bounded: a band holds at most ``queueLimit`` requests and each waits at most
``deadlineSeconds``; then, in every band as llm-d-router v0.10 answers its flow control's refusals, 429 with
``x-llm-d-request-dropped-reason`` ``rejected-saturated`` (the band is full) or ``rejected-ttl-expired`` (the
deadline passed), or 503 ``rejected-no-endpoints`` when the deadline passes while the pool has no endpoints at all.
When the picker stops, every held request is answered 503 ``rejected-shutting-down`` (Envoy and clients may retry
it); nothing is left hanging. A request whose stream goes away while it waits leaves the queue, counted as
``rejected-context-cancelled`` (nobody is left to answer). Clock and wake-ups come from ``PluginRuntime`` (the event
loop in the picker, a fake clock in tests, the simulator's clock behind its admission seam).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram
from pydantic import Field

from loraplane.api import ApiModel
from loraplane.picker.lifecycle import Cancellable, InFlightRequest, PluginRuntime, RequestPlugin
from loraplane.picker.plugins import NoEndpointError, PluginKind, PluginType, SchedulingError, register


class Band(IntEnum):
    """Priority bands, served in this order."""

    GOLD = 0
    STANDARD = 1
    SHEDDABLE = 2

    @classmethod
    def of(cls, priority: int) -> Band:
        """The band of a request of ``priority`` (GIE convention)."""
        return cls.GOLD if priority > 0 else cls.SHEDDABLE if priority < 0 else cls.STANDARD

    @property
    def refusal_status(self) -> int:
        """What a request of this band refused by the queue (full, or past its deadline) gets while the pool has
        endpoints: 429 in every band, llm-d-router's backpressure (503 is for a pool with none)."""
        return 429

    @property
    def label(self) -> str:
        """The band's name in metrics and configs."""
        return self.name.lower()


class QueueLimits(ApiModel):
    """Most requests one band holds at once."""

    gold: int = Field(default=512, ge=0)
    standard: int = Field(default=512, ge=0)
    sheddable: int = Field(default=256, ge=0)


class Deadlines(ApiModel):
    """Longest wait per band, seconds (keep it below Envoy's ext_proc ``message_timeout``)."""

    gold: float = Field(default=2.0, gt=0)
    standard: float = Field(default=1.5, gt=0)
    sheddable: float = Field(default=1.0, gt=0)


class FlowControlParameters(ApiModel):
    """The ``flow-control`` plugin's parameters."""

    #: the off switch: false routes saturated requests at once (the reference EPP without flow control)
    enabled: bool = True
    queue_limit: QueueLimits = Field(default_factory=QueueLimits)
    deadline_seconds: Deadlines = Field(default_factory=Deadlines)
    #: while requests wait, a dispatch round at least this often (picks up fresher reports)
    retry_interval_seconds: float = Field(default=0.05, gt=0)
    #: head requests per round that may stay blocked before the round ends (bounds a round's cost)
    max_blocked_tries: int = Field(default=16, ge=1)


class Waiter(Protocol):
    """A held request, as the queue sees it (the ext_proc ``Exchange``, or the simulator's request)."""

    def try_dispatch(self) -> bool:
        """Schedule again: True when the request is gone from the queue's view (sent, or refused by the scheduler),
        False when every candidate is still saturated. A refused waiter may ``cancel`` itself meanwhile (the
        ext_proc exchange does, answering its refusal): the round goes on with the next."""
        ...

    def refuse(self, error: SchedulingError) -> None:
        """Answer the request with ``error`` (deadline, queue full at dispatch, picker stopping)."""
        ...


class QueueFullError(SchedulingError):
    """The request's band already holds its limit (llm-d-router: rejected on capacity)."""

    status = 429
    reason = "rejected-saturated"


class QueueDeadlineError(SchedulingError):
    """The request waited its band's deadline and no candidate had room (llm-d-router: its TTL expired)."""

    status = 429
    reason = "rejected-ttl-expired"


class PickerStoppingError(SchedulingError):
    """The picker stopped while the request waited (retryable: another picker replica, or this one restarted)."""

    status = 503
    reason = "rejected-shutting-down"


#: the reason a request that went away while it waited is counted under (it gets no answer: its stream is gone)
CANCELLED_REASON = "rejected-context-cancelled"


def _refusal(error_type: type[SchedulingError], band: Band, message: str) -> SchedulingError:
    error = error_type(message)
    error.status = band.refusal_status
    return error


@dataclass(slots=True, eq=False)
class _Held:
    waiter: Waiter
    band: Band
    key: str
    since: float
    timer: Cancellable | None = None


class FlowControl(RequestPlugin):
    """The picker's queue (see the module docstring)."""

    def __init__(self, params: FlowControlParameters, runtime: PluginRuntime) -> None:
        """Empty bands; metrics in ``runtime.registry``."""
        self.params = params
        self.clock = runtime.clock
        self.call_later = runtime.call_later
        self.pool_size = runtime.pool_size
        #: per band: fairness key -> its held requests in arrival order; dict order is the keys' turn
        self._bands: list[dict[str, deque[_Held]]] = [{} for _ in Band]
        self._sizes = [0, 0, 0]
        self._held: dict[Waiter, _Held] = {}
        self._wake: Cancellable | None = None
        self._wake_soon = False
        #: the request a dispatch round is trying now (a ``cancel`` of it is the scheduler's refusal)
        self._trying: _Held | None = None
        self.stopped = False
        self.limits = (params.queue_limit.gold, params.queue_limit.standard, params.queue_limit.sheddable)
        self.deadlines = (params.deadline_seconds.gold, params.deadline_seconds.standard,
                          params.deadline_seconds.sheddable)
        length = Gauge("loraplane_picker_queue_length", "Requests waiting in the picker's flow-control queue",
                       ["band"], registry=runtime.registry)
        self._length = [length.labels(band.label) for band in Band]
        self.wait_seconds = Histogram(
            "loraplane_picker_queue_wait_seconds", "Time requests waited in the flow-control queue, by how it ended",
            ["band", "outcome"], registry=runtime.registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0),
        )
        self.refused = Counter("loraplane_picker_queue_refusals_total", "Requests the queue refused, by reason",
                               ["band", "reason"], registry=runtime.registry)

    @property
    def size(self) -> int:
        """Requests waiting now."""
        return len(self._held)

    def held_in(self, band: Band) -> int:
        """Requests waiting in ``band``."""
        return self._sizes[band]

    def busy(self, priority: int) -> bool:
        """Does a request of ``priority`` or above wait? (a new arrival then queues behind it)."""
        if not self._held:
            return False
        band = Band.of(priority)
        return any(self._sizes[b] for b in range(band + 1))

    def hold(self, waiter: Waiter, priority: int, key: str) -> None:
        """Queue ``waiter``; raises ``QueueFullError`` (or ``PickerStoppingError``) instead when it cannot wait."""
        band = Band.of(priority)
        if self.stopped:
            raise PickerStoppingError("the endpoint picker is stopping")
        if self._sizes[band] >= self.limits[band]:
            self.refused.labels(band.label, QueueFullError.reason).inc()
            raise _refusal(QueueFullError, band, f"the {band.label} queue is full ({self.limits[band]} requests)")
        held = _Held(waiter, band, key, self.clock())
        held.timer = self.call_later(self.deadlines[band], lambda: self._expire(held))
        queue = self._bands[band].get(key)
        if queue is None:
            queue = self._bands[band][key] = deque()
        queue.append(held)
        self._held[waiter] = held
        self._sizes[band] += 1
        self._length[band].inc()
        self._wake_after(0.0)

    def cancel(self, waiter: Waiter) -> None:
        """``waiter`` went away (its stream ended, or the scheduler refused it while it was tried): forget it."""
        held = self._held.get(waiter)
        if held is not None:
            refused = held is self._trying
            self._remove(held, "refused" if refused else "cancelled")
            if not refused:
                self.refused.labels(held.band.label, CANCELLED_REASON).inc()

    def response_complete(self, request: InFlightRequest) -> None:
        """A request finished somewhere: a dispatch round soon."""
        if self._held:
            self._wake_after(0.0)

    def dispatch(self) -> None:
        """One dispatch round: bands in order, keys in turn, until ``maxBlockedTries`` heads stayed blocked."""
        if self._wake is not None:
            self._wake.cancel()  # this round replaces the one that was due
        self._wake, self._wake_soon = None, False
        blocked = 0
        try:
            for band in Band:
                queues = self._bands[band]
                tried: set[str] = set()
                while queues and blocked < self.params.max_blocked_tries:
                    key = next(iter(queues))
                    if key in tried:
                        break  # every key's head in this band is blocked
                    held = queues[key][0]
                    self._trying = held
                    try:
                        gone = held.waiter.try_dispatch()
                    finally:
                        self._trying = None
                    if held.waiter not in self._held:
                        continue  # refused by the scheduler: answered, and out of the queue already (``cancel``)
                    if gone:
                        self._remove(held, "dispatched")
                    else:
                        blocked += 1
                        tried.add(key)
                        queues[key] = queues.pop(key)  # its turn passes
        finally:  # whatever a waiter did, the requests still waiting get their next round
            if self._held:
                self._wake_after(self.params.retry_interval_seconds)

    def stop(self) -> None:
        """The picker is stopping: answer every waiting request 503 ``rejected-shutting-down``, take no more."""
        self.stopped = True
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        for held in list(self._held.values()):
            self._remove(held, "stopped")
            self.refused.labels(held.band.label, PickerStoppingError.reason).inc()
            held.waiter.refuse(PickerStoppingError("the endpoint picker stopped while the request waited"))

    def _expire(self, held: _Held) -> None:
        if held.waiter not in self._held:
            return
        held.timer = None
        self._remove(held, "expired")
        band = held.band
        error: SchedulingError
        if self.pool_size is not None and self.pool_size() == 0:  # no capacity at all: unavailable, not backpressure
            error = NoEndpointError(f"the pool has no endpoints (waited the {band.label} deadline of "
                                    f"{self.deadlines[band]} s)")
        else:
            error = _refusal(QueueDeadlineError, band, f"no endpoint had room within the {band.label} deadline of "
                             f"{self.deadlines[band]} s")
        self.refused.labels(band.label, error.reason).inc()
        held.waiter.refuse(error)

    def _remove(self, held: _Held, outcome: str) -> None:
        del self._held[held.waiter]
        queues = self._bands[held.band]
        queue = queues[held.key]
        queue.remove(held)
        if not queue:
            del queues[held.key]
        elif outcome == "dispatched":
            queues[held.key] = queues.pop(held.key)  # fair share: the next key's turn
        self._sizes[held.band] -= 1
        self._length[held.band].dec()
        if held.timer is not None:
            held.timer.cancel()
        self.wait_seconds.labels(held.band.label, outcome).observe(self.clock() - held.since)

    def _wake_after(self, delay: float) -> None:
        if self.stopped:
            return
        if self._wake is not None:
            if self._wake_soon or delay > 0:
                return  # a round is already due at least as soon
            self._wake.cancel()
        self._wake = self.call_later(delay, self.dispatch)
        self._wake_soon = delay == 0


def _factory(params: FlowControlParameters, runtime: PluginRuntime) -> RequestPlugin:
    return FlowControl(params, runtime) if params.enabled else RequestPlugin()


register("flow-control", PluginType(PluginKind.REQUEST, FlowControlParameters, _factory))
