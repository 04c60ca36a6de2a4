"""The simulator's admission seam backed by the picker's own flow-control queue (``loraplane.picker.flowcontrol``).

``PickerFlowControl`` runs the same ``FlowControl`` plugin the picker runs behind Envoy, on the simulator's clock:
its deadlines and dispatch wake-ups are ``ManualTimers`` callbacks, run when the simulator calls ``expire`` at
``next_deadline`` (or on any other call that passes their time). A held request is dispatched by asking the
router's chooser again, as the picker asks its scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loraplane.picker.flowcontrol import Deadlines, FlowControl, FlowControlParameters, QueueLimits
from loraplane.picker.lifecycle import ManualTimers, PluginRuntime
from loraplane.picker.plugins import SchedulingError
from loraplane.picker.snapshot import InFlightTracker
from loraplane.sim.admission import Chooser, FlowControlConfig
from loraplane.sim.cluster import Refused, Simulator


def picker_parameters(config: FlowControlConfig) -> FlowControlParameters:
    """The picker plugin's parameters for the simulator's flow-control bounds."""
    gold, standard, sheddable = config.queue_limit
    gold_s, standard_s, sheddable_s = config.deadline_s
    return FlowControlParameters(
        queue_limit=QueueLimits(gold=gold, standard=standard, sheddable=sheddable),
        deadline_seconds=Deadlines(gold=gold_s, standard=standard_s, sheddable=sheddable_s),
        max_blocked_tries=config.max_blocked_tries,
    )


@dataclass(eq=False)
class _Held:
    """One simulated request as the picker's queue sees it (its ``Waiter``)."""

    gate: PickerFlowControl
    rid: int
    sim: Simulator

    def try_dispatch(self) -> bool:
        try:
            pod = self.gate.choose(self.gate.timers.now, self.rid, self.sim)
        except Refused as refusal:
            self.sim.refuse(self.rid, refusal.status)
            return True
        if pod is None:
            return False
        self.sim.dispatch(self.rid, pod)
        return True

    def refuse(self, error: SchedulingError) -> None:
        self.sim.refuse(self.rid, error.status)


class PickerFlowControl:
    """The ``Admission`` seam (``loraplane.sim.cluster``) with the picker's queue behind it."""

    name = "picker-flow-control"

    def __init__(self, choose: Chooser, priority_of: Callable[[int], int], tenant_of: Callable[[int], int],
                 config: FlowControlConfig | None = None) -> None:  # fmt: skip
        self.choose = choose
        self._priority_of = priority_of
        self._tenant_of = tenant_of
        self.timers = ManualTimers()
        runtime = PluginRuntime(InFlightTracker(), self.timers.clock, self.timers.call_later)
        self.queue = FlowControl(picker_parameters(config or FlowControlConfig()), runtime)

    @property
    def held(self) -> int:
        """Requests waiting in the queue."""
        return self.queue.size

    def arrive(self, now: float, rid: int, sim: Simulator) -> None:
        """Dispatch ``rid`` when nothing of its band or above waits and a candidate has room; else hold or refuse."""
        self.timers.run_due(now)
        priority = self._priority_of(rid)
        held = _Held(self, rid, sim)
        if not self.queue.busy(priority) and held.try_dispatch():
            return
        try:
            self.queue.hold(held, priority, str(self._tenant_of(rid)))
        except SchedulingError as refusal:
            sim.refuse(rid, refusal.status)
            return
        self.timers.run_due(now)  # the round a hold asks for, now: next_deadline never moves earlier than reported

    def capacity_freed(self, now: float, sim: Simulator) -> None:
        """Requests finished: a dispatch round now."""
        self.timers.run_due(now)
        if self.queue.size:
            self.queue.dispatch()

    def expire(self, now: float, sim: Simulator) -> None:
        """Run the queue's timers due by ``now`` (deadlines, retry rounds)."""
        self.timers.run_due(now)

    def next_deadline(self) -> float:
        """When the queue next needs the clock (a deadline or a dispatch round)."""
        return self.timers.next_due()
