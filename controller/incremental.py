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
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from loraplane.api import RequestRates
from loraplane.api.runtime import Tier
from loraplane.controller.placement import (
    AdapterDemand,
    Placement,
    PodCapacity,
    Rates,
    keep_until_replaced,
    place,
)
from loraplane.controller.pool import (
    DEFAULT_ADAPTER_BYTES,
    PoolInputs,
    PoolPlan,
    _rates_by_adapter,
    _target,
    fit_to_sidecars,
    plan_pool,
    serving_holders,
)
from loraplane.controller.rollout import ROLLOUT_PHASES

#: relative rate change (each window) below which an adapter's rates are taken as unchanged
DEFAULT_HYSTERESIS = 0.25
#: absolute rate change (requests/s) below which a change never counts (a trickle moving by a few per cent)
RATE_FLOOR = 0.01
#: seconds between two full plans of a pool at rest
DEFAULT_FULL_PLAN_SECONDS = 60.0


WINDOWS = ("5m", "1h", "24h")


Windows = dict[str, dict[str, float]]


def windows_of(rates: RequestRates | None) -> Windows:
    """A copy of the rates' windows (a baseline to compare later rates with)."""
    return {w: dict(rates.windows.get(w, {})) for w in WINDOWS} if rates is not None else {}  # type: ignore[call-overload]


def rates_moved(planned: Windows, now: RequestRates | None, names: Collection[str], hysteresis: float) -> list[str]:
    """The served names (of ``names``) whose rate in some window moved beyond ``hysteresis`` since ``planned``
    (appeared or went quiet included). Compared per revision, not per logical adapter: a little stricter where an
    adapter's revisions share its traffic, and no sums to make over 10,000 names."""
    moved = set()
    for window in WINDOWS:
        a = planned.get(window, {})
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
    #: the rates the plan was made with (per window and served name)
    rates: Windows
    #: the rates object last compared with them and found within the hysteresis (the same object: not compared)
    rates_source: RequestRates | None
    planned_at: float
    #: False when the pool must be planned every time (a rollout in progress, a deletion, a gate due)
    at_rest: bool
    #: the served names of the pool's revisions
    names: frozenset[str] = field(default_factory=frozenset)
    #: the served names whose rates moved beyond the hysteresis (found by ``_why``)
    moved: list[str] = field(default_factory=list)


@dataclass
class PlanOutcome:
    """One pool's plan and how it was come by."""

    plan: PoolPlan
    #: True: the last plan, reused (nothing it depends on changed); the caller writes nothing
    reused: bool
    #: True: the last plan with the placement of a few revisions whose rates moved made again (``delta_plan``):
    #: only target states can differ from the last plan's; the caller writes those
    delta: bool = False
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
        #: plans made, reused and made again for a few revisions since start (for tests and the benchmark)
        self.planned = 0
        self.reused = 0
        self.deltas = 0
        #: at most this share of a pool's revisions (at least 8) moving beyond the hysteresis is placed again alone;
        #: more plans the pool whole
        self.delta_share = 0.02

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
                memo.moved = moved
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
        if memo is not None and memo.moved and len(memo.moved) <= max(8, len(memo.names) * self.delta_share):
            moved, memo.moved = memo.moved, []
            delta = delta_plan(memo.plan, inputs, moved)
            if delta is not None:
                plan, changed = delta
                for window, rates in memo.rates.items():  # the new baseline of the revisions placed again
                    now = inputs.rates.windows.get(window, {}) if inputs.rates else {}  # type: ignore[call-overload]
                    rates.update((name, now.get(name, 0.0)) for name in changed)
                memo.plan, memo.rates_source = plan, inputs.rates
                self.deltas += 1
                return PlanOutcome(plan, reused=False, why=f"placement of {len(changed)} revisions", delta=True)
        plan = plan_pool(inputs)
        names = frozenset(r.served_name for r in inputs.revisions)
        self._memo[inputs.pool] = _Memo(signature, plan, windows_of(inputs.rates), inputs.rates, self.clock(),
                                        _at_rest(plan), names)
        self.planned += 1
        return PlanOutcome(plan, reused=False, why=why)


def delta_plan(plan: PoolPlan, inputs: PoolInputs, moved: Sequence[str]) -> tuple[PoolPlan, set[str]] | None:
    """``plan`` with the revisions of the adapters whose rates ``moved`` placed again alone, on what the other
    revisions leave of each pod (their replicas, slots and bytes kept as they are): the other revisions' targets,
    the routes and every status stay as they were (``Placed`` conditions catch up at the next full plan). None where
    that would not be the plan's rules applied to a part: tenant budgets or staging pods (they span the pool), a
    revision going quiet (idle revisions stage apart), one the plan did not place. Returns the plan and the served
    names placed again."""
    if inputs.budgets or plan.placement.staging:
        return None
    demands = {d.served_name: d for d in plan.demands}
    by_served = {rp.served_name: rp for rp in plan.revisions.values()}
    adapter_of = {r.served_name: r.spec.adapter for r in inputs.revisions}
    adapters = {adapter_of[n] for n in moved if n in adapter_of}
    revs = [r for r in inputs.revisions if r.spec.adapter in adapters]
    rates = _rates_by_adapter(inputs.rates, revs)
    changed: dict[str, AdapterDemand] = {}
    for rev in revs:
        old, rp = demands.get(rev.served_name), by_served.get(rev.served_name)
        if old is None or rp is None:
            continue
        new = replace(old, rates=rates.get(rev.spec.adapter, Rates()).scaled(rp.rate_share))
        if old.min_replicas > 0 and new.rates.m5 <= 0 and new.rates.h1 <= 0 and new.rates.h24 <= 0:
            return None
        changed[rev.served_name] = new
    if not changed:
        return None
    before = plan.placement.pods
    rest = {pod: {n: t for n, t in held.items() if n not in changed} for pod, held in before.items()}
    residual = []
    for cap in plan.capacity:
        held = rest.get(cap.name, {})
        gpu = [n for n, t in held.items() if t is Tier.GPU]
        cpu = [n for n, t in held.items() if t is Tier.CPU]

        def size(names: Iterable[str]) -> int:
            return sum(demands[n].bytes if n in demands else DEFAULT_ADAPTER_BYTES for n in names)

        residual.append(PodCapacity(
            cap.name, max(0, cap.gpu_slots - len(gpu)), max(0, cap.cpu_slots - len(cpu)),
            None if cap.gpu_bytes is None else max(0, cap.gpu_bytes - size(gpu)),
            None if cap.cpu_bytes is None else max(0, cap.cpu_bytes - size(cpu)),
            None if cap.disk_bytes is None else max(0, cap.disk_bytes - size(held))))
    previous = Placement(pods={pod: {n: t for n, t in held.items() if n in changed} for pod, held in before.items()})
    local = place(residual, list(changed.values()), previous, {}, inputs.placement)
    merged = {pod: {**rest.get(pod, {}), **local.pods.get(pod, {})} for pod in before.keys() | local.pods.keys()}
    notes = {**{n: why for n, why in plan.placement.notes.items() if n not in changed}, **local.notes}
    all_demands = [changed.get(d.served_name, d) for d in plan.demands]
    planned = Placement(pods=merged, notes=notes, staging=plan.placement.staging)
    serving = serving_holders(inputs.reports)
    placement = keep_until_replaced(planned, [changed[n] for n in changed], serving,
                                    {r.pod for r in inputs.reports if r.demotes_to_disk})
    placement = fit_to_sidecars(placement, planned, [r for r in inputs.reports if r.ready], all_demands, serving)
    revision_of = {r.served_name: r for r in inputs.revisions}
    targets = dict(plan.targets)
    for pod, held in placement.pods.items():
        if held == before.get(pod):
            continue
        old_targets = {t.served_name: t for t in plan.targets.get(pod, [])}
        targets[pod] = [
            old_targets[name] if name in old_targets and old_targets[name].tier is tier and name not in changed
            else _target(revision_of[name], by_served[name].status, tier)
            for name, tier in held.items() if tier is not Tier.ABSENT
        ]
    return replace(plan, placement=placement, targets=targets, demands=all_demands, events=[], probes=[],
                   discarded_probes=[]), set(changed)
