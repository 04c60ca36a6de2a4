"""Admission in front of routing: an in-simulator stand-in for the picker's flow control.

``SimFlowControl`` implements the simulator's ``Admission`` seam (``loraplane.sim.cluster``) the way the picker's
flow-control layer is specified: a request whose best endpoint is saturated waits in priority bands (gold,
standard, sheddable) with round-robin fair queuing over tenants inside a band, bounded by a per-band queue limit and
a deadline, then is refused (429 in every band, as the picker answers while the pool has endpoints). Held
requests are dispatched when requests finish, by asking the router again (loraplane's picker prefers a pod where
the revision is warm). It is the simulator's own model, not the picker's code. ``PickerFlowControl`` runs the picker's own queue (``loraplane.picker.flowcontrol``)
behind the same seam, on the simulator's clock; ``FlowControlConfig.queue`` chooses.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplane.picker.flowcontrol import Band, Deadlines, FlowControl, FlowControlParameters, QueueLimits
from loraplane.picker.lifecycle import InFlightRequest, ManualTimers, PluginRuntime
from loraplane.picker.plugins import SchedulingError, SchedulingRequest
from loraplane.picker.snapshot import InFlightTracker
from loraplane.sim.cluster import Refused, Simulator

#: a chooser answers the pod for a request now, or ``None`` when every candidate is saturated (hold it); it raises
#: ``Refused`` when the request can never be placed
Chooser = Callable[[float, int, Simulator], int | None]


@dataclass(frozen=True)
class FlowControlConfig:
    """Bounds of the queue, per band."""

    #: most requests held at once in each band (gold, standard, sheddable)
    queue_limit: tuple[int, int, int] = (512, 512, 256)
    #: longest wait before refusal, seconds, per band
    deadline_s: tuple[float, float, float] = (1.5, 1.5, 1.0)
    #: most held requests looked at per dispatch round that stay blocked (bounds a round's cost)
    max_blocked_tries: int = 8
    #: ``sim``: ``SimFlowControl``; ``picker``: the picker's own queue (``PickerFlowControl``); ``off``: no queue
    queue: str = "sim"
    #: the picker's queue with these parameters (a picker config's ``flow-control`` plugin) instead of the above
    parameters: FlowControlParameters | None = None

    def __post_init__(self) -> None:
        if self.queue not in (*QUEUES, OFF):
            raise ValueError(f"unknown flow-control queue {self.queue!r}; choose from {', '.join([*QUEUES, OFF])}")


@dataclass
class _BandQueue:
    """One band: per tenant, its held (request, deadline) in arrival order, and the tenants in round-robin order."""

    by_tenant: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)
    turn: deque[int] = field(default_factory=deque)
    size: int = 0

    def push(self, tenant: int, rid: int, deadline: float) -> None:
        queue = self.by_tenant.get(tenant)
        if queue is None:
            queue = self.by_tenant[tenant] = deque()
            self.turn.append(tenant)
        queue.append((rid, deadline))
        self.size += 1

    def pop_head(self, tenant: int) -> int:
        queue = self.by_tenant[tenant]
        rid, _ = queue.popleft()
        self.size -= 1
        if not queue:
            del self.by_tenant[tenant]
            self.turn.remove(tenant)
        return rid


class SimFlowControl:
    """The in-simulator flow-control queue (see the module docstring)."""

    name = "sim-flow-control"

    def __init__(self, choose: Chooser, priority_of: Callable[[int], int], tenant_of: Callable[[int], int],
                 config: FlowControlConfig | None = None) -> None:  # fmt: skip
        self.config = config or FlowControlConfig()
        self._choose = choose
        self._priority_of = priority_of
        self._tenant_of = tenant_of
        self._bands = [_BandQueue() for _ in Band]

    @property
    def held(self) -> int:
        """Requests waiting in the queue."""
        return sum(b.size for b in self._bands)

    def held_in(self, band: Band) -> int:
        """Requests waiting in ``band``."""
        return self._bands[band].size

    def arrive(self, now: float, rid: int, sim: Simulator) -> None:
        """Dispatch ``rid`` when nothing of its band or above waits and its endpoint has room; else hold or refuse."""
        band = Band.of(self._priority_of(rid))
        if not any(self._bands[b].size for b in range(band + 1)):
            try:
                pod = self._choose(now, rid, sim)
            except Refused as refusal:
                sim.refuse(rid, refusal.status)
                return
            if pod is not None:
                sim.dispatch(rid, pod)
                return
        queue = self._bands[band]
        if queue.size >= self.config.queue_limit[band]:
            sim.refuse(rid, band.refusal_status)
            return
        queue.push(self._tenant_of(rid), rid, now + self.config.deadline_s[band])

    def capacity_freed(self, now: float, sim: Simulator) -> None:
        """Dispatch held requests, bands in order and tenants in turn, until ``max_blocked_tries`` stay blocked."""
        blocked = 0
        for band in Band:
            queue = self._bands[band]
            tried: set[int] = set()
            while queue.turn and blocked < self.config.max_blocked_tries:
                tenant = queue.turn[0]
                if tenant in tried:
                    break  # every tenant's head of this band is blocked
                rid = queue.by_tenant[tenant][0][0]
                try:
                    pod = self._choose(now, rid, sim)
                except Refused as refusal:
                    queue.pop_head(tenant)
                    sim.refuse(rid, refusal.status)
                    continue
                if pod is None:
                    blocked += 1
                    tried.add(tenant)
                    queue.turn.rotate(-1)
                    continue
                queue.pop_head(tenant)
                sim.dispatch(rid, pod)
                if tenant in queue.by_tenant:
                    queue.turn.remove(tenant)
                    queue.turn.append(tenant)  # fair share: the next tenant's turn

    def expire(self, now: float, sim: Simulator) -> None:
        """Refuse every held request whose deadline has passed."""
        for band in Band:
            queue = self._bands[band]
            for tenant in list(queue.turn):
                held = queue.by_tenant[tenant]
                while held and held[0][1] <= now:
                    sim.refuse(queue.pop_head(tenant), band.refusal_status)

    def next_deadline(self) -> float:
        """The earliest deadline of a held request."""
        return min((q[0][1] for b in self._bands for q in b.by_tenant.values()), default=math.inf)


#: what ``response_complete`` is told finished (the queue reads nothing of it)
_FINISHED = InFlightRequest(SchedulingRequest(), "")


class _SimWaiter:
    """A request held in the picker's queue: dispatching it asks the chooser again on the simulator's clock."""

    __slots__ = ("gate", "rid")

    def __init__(self, gate: PickerFlowControl, rid: int) -> None:
        self.gate = gate
        self.rid = rid

    def try_dispatch(self) -> bool:
        return self.gate.offer(self.rid)

    def refuse(self, error: SchedulingError) -> None:
        self.gate.refuse(self.rid, error.status)


class PickerFlowControl:
    """The picker's ``FlowControl`` request plugin behind the simulator's ``Admission`` seam: its clock and
    wake-ups are ``ManualTimers`` that the simulator moves; dispatch rounds run on finishes (as the picker's
    ``response_complete`` does) and at its own wake-ups (retry interval, deadlines)."""

    name = "picker-flow-control"

    def __init__(self, choose: Chooser, priority_of: Callable[[int], int], tenant_of: Callable[[int], int],
                 config: FlowControlConfig | None = None) -> None:  # fmt: skip
        config = config or FlowControlConfig(queue="picker")
        self._choose = choose
        self._priority_of = priority_of
        self._tenant_of = tenant_of
        self._timers = ManualTimers()
        self._sim: Simulator | None = None
        limits, deadlines = config.queue_limit, config.deadline_s
        params = config.parameters or FlowControlParameters(
            queue_limit=QueueLimits(gold=limits[0], standard=limits[1], sheddable=limits[2]),
            deadline_seconds=Deadlines(gold=deadlines[0], standard=deadlines[1], sheddable=deadlines[2]),
            max_blocked_tries=config.max_blocked_tries,
        )
        runtime = PluginRuntime(InFlightTracker(), self._timers.clock, self._timers.call_later)
        self.queue = FlowControl(params, runtime)

    @property
    def held(self) -> int:
        """Requests waiting in the picker's queue."""
        return self.queue.size

    def held_in(self, band: Band) -> int:
        """Requests waiting in ``band``."""
        return self.queue.held_in(band)

    def offer(self, rid: int) -> bool:
        """The waiter's ``try_dispatch``: True when ``rid`` was sent or refused, False while it must wait."""
        sim = self._sim
        assert sim is not None
        try:
            pod = self._choose(sim.now, rid, sim)
        except Refused as refusal:
            sim.refuse(rid, refusal.status)
            return True
        if pod is None:
            return False
        sim.dispatch(rid, pod)
        return True

    def refuse(self, rid: int, status: int) -> None:
        """The waiter's ``refuse``."""
        assert self._sim is not None
        self._sim.refuse(rid, status)

    def _advance(self, now: float, sim: Simulator) -> None:
        self._sim = sim
        self._timers.run_due(now)

    def arrive(self, now: float, rid: int, sim: Simulator) -> None:
        """As the picker: straight through unless its band or a higher one waits or it must wait; else hold."""
        self._advance(now, sim)
        priority = self._priority_of(rid)
        if not self.queue.busy(priority) and self.offer(rid):
            return
        try:
            self.queue.hold(_SimWaiter(self, rid), priority, str(self._tenant_of(rid)))
        except SchedulingError as exc:
            sim.refuse(rid, exc.status)
        self._timers.run_due(now)  # the round ``hold`` asks for at once

    def capacity_freed(self, now: float, sim: Simulator) -> None:
        """A finish: the picker's ``response_complete`` (a dispatch round at once)."""
        self._advance(now, sim)
        self.queue.response_complete(_FINISHED)
        self._timers.run_due(now)

    def expire(self, now: float, sim: Simulator) -> None:
        """Run the queue's wake-ups due by ``now`` (deadlines, retry rounds)."""
        self._advance(now, sim)

    def next_deadline(self) -> float:
        """The queue's next wake-up."""
        return self._timers.next_due()


#: ``FlowControlConfig.queue`` for no queue in front of loraplane's picker
OFF = "off"
#: ``FlowControlConfig.queue`` -> the gate it builds
QUEUES: dict[str, Callable[..., SimFlowControl | PickerFlowControl]] = {
    "sim": SimFlowControl,
    "picker": PickerFlowControl,
}
