"""Planning in proportion to what changed: one pool's ``plan_pool`` is run again only when its inputs moved.

``plan_pool`` is pure: the same revisions, reports, rates, counters and probes give the same plan. A pool at rest
(every revision Stable or terminal, no timed gate due) therefore keeps its last plan while

- its revisions are the same objects (the caller's ``revisions_token`` is unchanged),
- each fresh member pod's report says the same to planning (``PoolReadings.report_versions``: heartbeats, load
  figures and per-adapter counters are not read by planning),
- the same probe results are held,
- and every logical adapter's request rates are within ``hysteresis`` (relative, each window) of the rates its
  plan was made with: rates drift by a few per cent all the time, and a placement that follows every drift
  churns GPU slots (``PlacementConfig.stickiness`` is the same idea inside placement).

Anything else -- a revision in a rollout phase or being deleted, a gate due, a report whose residency changed,
a rate beyond the hysteresis -- plans the pool again, as does the ``full_plan_seconds`` period (so drift within
the hysteresis is planned for at that pace). A reused plan writes nothing: the caller only runs its
level-triggered repair of the Redis keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from loraplane.api import RequestRates
from loraplane.controller.pool import PoolInputs, PoolPlan, plan_pool
from loraplane.controller.rollout import ROLLOUT_PHASES

#: relative rate change (each window) below which an adapter's rates are taken as unchanged
DEFAULT_HYSTERESIS = 0.25
#: absolute rate change (requests/s) below which a change never counts (a trickle moving by a few per cent)
RATE_FLOOR = 0.01
#: seconds between two full plans of a pool at rest
DEFAULT_FULL_PLAN_SECONDS = 60.0


WINDOWS = ("5m", "1h", "24h")


def rates_moved(planned: RequestRates | None, now: RequestRates | None, names: Collection[str],
                hysteresis: float) -> list[str]:
    """The served names (of ``names``) whose rate in some window moved beyond ``hysteresis`` since ``planned``
    (appeared or went quiet included). Compared per revision, not per logical adapter: a little stricter where an
    adapter's revisions share its traffic, and no sums to make over 10,000 names."""
    moved = set()
    for window in WINDOWS:
        a = planned.windows.get(window, {}) if planned is not None else {}  # type: ignore[call-overload]
        b = now.windows.get(window, {}) if now is not None else {}  # type: ignore[call-overload]
        if a == b:
            continue
        for name in a.keys() | b.keys():
            old, new = a.get(name, 0.0), b.get(name, 0.0)
            change = abs(new - old)
            if change > RATE_FLOOR and change > hysteresis * max(old, new) and name in names:
                moved.add(name)
    return sorted(moved)


@dataclass
class _Memo:
    signature: tuple[Hashable, ...]
    plan: PoolPlan
    #: the rates the plan was made with
    rates: RequestRates | None
    #: the rates object last compared with them and found within the hysteresis (the same object: not compared)
    rates_source: RequestRates | None
    planned_at: float
    #: False when the pool must be planned every time (a rollout in progress, a deletion, a gate due)
    at_rest: bool
    #: the served names of the pool's revisions
    names: frozenset[str] = field(default_factory=frozenset)


@dataclass
class PlanOutcome:
    """One pool's plan and how it was come by."""

    plan: PoolPlan
    #: True: the last plan, reused (nothing it depends on changed); the caller writes nothing
    reused: bool
    #: why it was planned again ("" when reused)
    why: str = ""


def _at_rest(plan: PoolPlan) -> bool:
    if plan.next_due is not None or plan.probes:
        return False
    for outcome in plan.adapters.values():
        for rp in outcome.revisions.values():
            if rp.status.phase in ROLLOUT_PHASES or rp.finalize or rp.required:
                return False
    return True


class IncrementalPlanner:
    """Keeps each pool's last plan and plans again only when its inputs moved (see the module docstring)."""

    def __init__(self, hysteresis: float = DEFAULT_HYSTERESIS, full_plan_seconds: float = DEFAULT_FULL_PLAN_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hysteresis = hysteresis
        self.full_plan_seconds = full_plan_seconds
        self.clock = clock
        self._memo: dict[str, _Memo] = {}
        #: plans made and plans reused since start (for tests and the benchmark)
        self.planned = 0
        self.reused = 0

    def forget(self, pool: str | None = None) -> None:
        """Plan ``pool`` (every pool: None) from scratch next time (a new leader, written keys read back)."""
        if pool is None:
            self._memo.clear()
        else:
            self._memo.pop(pool, None)

    def _why(self, memo: _Memo | None, inputs: PoolInputs, signature: tuple[Hashable, ...], now: datetime) -> str:
        if memo is None:
            return "first plan"
        if not memo.at_rest:
            return "rollout in progress"
        if memo.signature != signature:
            return "inputs changed"
        if memo.plan.next_due is not None and memo.plan.next_due <= now:
            return "gate due"
        if self.clock() - memo.planned_at >= self.full_plan_seconds:
            return "full plan period"
        if inputs.rates is not memo.rates_source:
            moved = rates_moved(memo.rates, inputs.rates, memo.names, self.hysteresis)
            if moved:
                return f"rates of {len(moved)} revisions moved beyond the hysteresis"
            memo.rates_source = inputs.rates  # compared: the same object is not compared again (``memo.rates`` stays)
        return ""

    def plan(self, inputs: PoolInputs, revisions_token: Hashable,
             report_versions: Mapping[str, int]) -> PlanOutcome:
        """``plan_pool(inputs)``, or the pool's last plan when nothing it depends on moved. ``revisions_token``
        changes whenever the pool's revisions (specs, statuses, the set) do; ``report_versions`` as
        ``PoolReadings.report_versions``."""
        signature: tuple[Hashable, ...] = (
            revisions_token,
            tuple(sorted((r.pod, report_versions.get(r.pod, -1), r.ready) for r in inputs.reports)),
            frozenset(inputs.probes.items()),
        )
        memo = self._memo.get(inputs.pool)
        why = self._why(memo, inputs, signature, inputs.now)
        if memo is not None and not why:
            self.reused += 1
            return PlanOutcome(memo.plan, reused=True)
        plan = plan_pool(inputs)
        names = frozenset(r.served_name for r in inputs.revisions)
        self._memo[inputs.pool] = _Memo(signature, plan, inputs.rates, inputs.rates, self.clock(), _at_rest(plan),
                                        names)
        self.planned += 1
        return PlanOutcome(plan, reused=False, why=why)
