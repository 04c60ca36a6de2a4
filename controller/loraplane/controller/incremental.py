"""Planning in proportion to what changed: one pool's ``plan_pool`` is run again only when its inputs moved.

``plan_pool`` is pure: the same revisions, reports, rates, counters and probes give the same plan. A pool at rest
(every adapter at rest: no rollout phase, deletion, required holding, timed gate or probe outstanding) therefore
keeps its last plan while

- its revisions are the same objects (the caller's ``revisions_token`` is unchanged),
- each fresh member pod's report says the same to planning (``PoolReadings.report_versions``: heartbeats, load
  figures and per-adapter counters are not read by planning),
- the same probe results are held,
- and every logical adapter's request rates are within ``hysteresis`` (relative, each window) of the rates its
  plan was made with: rates drift by a few per cent all the time, and a placement that follows every drift
  churns GPU slots (``PlacementConfig.stickiness`` is the same idea inside placement).

A reused plan writes nothing: the caller only runs its level-triggered repair of the Redis keys. When something
moved, a few revisions whose rates moved beyond the hysteresis are placed again alone (``delta_plan``) while the
floor revisions (``plans_as_floor``) placed again alone since the last whole plan stay few (``few_enough``) where
the disks cannot hold every revision's holders (``Placement.deferred``): a sweep of new revisions moves a few of
them every pass, each part leaves the rest of the plan as it was, and the disk holders the pool's order moves
between them (from those swept to those yet to come) would all move at the next whole plan at once, each a
registration that stalls its pod's batch. A few adapters -- revisions added, changed or
deleted, rollouts in progress, new probe results, report rows that changed -- are planned again alone
(``plan_part``), each on what the rest of the pool leaves. A row that changed as the plan has it (``_as_planned``:
a sidecar registering its targets and unregistering what the plan took away, vLLM's LRU moving copies between
host memory and disk) is planned for only where it can move a make-before-break hold (``_holds_moved``): else
every plan that moved targets would plan again for each pod carrying it out. Anything else (a pod coming, going or
changing readiness or capacity, more than ``placement.DELTA_SHARE`` of the pool) plans the pool whole, as does the
``full_plan_seconds`` period (so drift within the hysteresis, and anything a part did not see, is planned for at
that pace).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import cast

from loraplane.api import AdapterRevision, AdapterRevisionStatus, AdapterTarget, RequestRates, ResidencyReport
from loraplane.api.runtime import Tier
from loraplane.controller.placement import (
    DEFAULT_FULL_PLAN_SECONDS,
    DEFAULT_HYSTERESIS,
    AdapterDemand,
    Placement,
    PodCapacity,
    Rates,
    few_enough,
    keep_until_replaced,
    place_again,
    plans_as_floor,
    rate_moved,
)
from loraplane.controller.pool import (
    DEFAULT_ADAPTER_BYTES,
    PoolInputs,
    PoolPlan,
    _observation,
    _rates_by_adapter,
    _target,
    adapter_demands,
    adapter_groups,
    collect,
    decide,
    fit_to_sidecars,
    plan_pool,
    pod_capacity,
    serves,
    serving_holders,
)
from loraplane.controller.rollout import ROLLOUT_PHASES, write_outcome
from loraplane.kube import Key

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
            if rate_moved(a.get(name, 0.0), b.get(name, 0.0), hysteresis) and name in names:
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
    #: the logical adapters ((namespace, adapter)) not at rest: planned again at every pass (``_active``)
    active: set[tuple[str, str]]
    #: (namespace, name) -> the revision object the plan was made from (a changed one is another object)
    revisions: dict[Key, AdapterRevision]
    #: the served names of the pool's revisions -> their logical adapter ((namespace, adapter))
    names: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: the served names whose rates moved beyond the hysteresis (found by ``_why``)
    moved: list[str] = field(default_factory=list)
    #: pod -> its report as the plan read it (``_PodView``)
    pods: dict[str, _PodView] = field(default_factory=dict)
    #: floor revisions (``plans_as_floor``) placed again alone (``delta_plan``) since the plan was made whole, where
    #: it deferred their further holders (``Placement.deferred``)
    drifted: int = 0

    @property
    def at_rest(self) -> bool:
        """Nothing needs planning again until an input moves."""
        return not self.active


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
    #: the objects whose statuses this plan decided ((namespace, name)); None: every object of the pool. A plan of
    #: a part (``plan_part``) decides only its adapters' revisions: the caller writes back only those statuses
    decided: set[Key] | None = None

    @property
    def kind(self) -> str:
        """How it was come by: ``reused``, ``delta``, ``part`` or ``whole``."""
        return ("reused" if self.reused else "delta" if self.delta else "part" if self.decided is not None
                else "whole")


def _active(plan: PoolPlan, adapters: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
    """Those of ``adapters`` not at rest in ``plan``: a rollout phase, a deletion, a required holding, a timed gate
    or a probe outstanding."""
    probed = {p.served_name for _, p in plan.probes}
    active = set()
    for key in adapters:
        outcome = plan.adapters.get(key)
        if outcome is None:
            continue
        if outcome.next_due is not None or any(
                rp.status.phase in ROLLOUT_PHASES or rp.finalize or rp.required or rp.served_name in probed
                for rp in outcome.revisions.values()):
            active.add(key)
    return active


#: what planning reads of one adapter's row in a report besides whether the pod serves it (``serves``): not its
#: tier beyond that (vLLM's LRU moves adapters between GPU and host memory with every request; an adapter not at
#: rest, whose rollout gates read its tiers, is planned again at every pass anyway), nor its request counters
_PLANNED_FIELDS = ("registered", "draining", "error", "error_reason", "digest", "adapter_digest", "bytes", "pinned")


@dataclass(frozen=True)
class _PodView:
    """One pod's report as a plan read it: its version (``PoolReadings.report_versions``), readiness, capacity and
    each served name's planned fields."""

    version: int
    ready: bool
    capacity: PodCapacity
    residency: dict[str, tuple[object, ...]]

    @classmethod
    def of(cls, report: ResidencyReport, version: int) -> _PodView:
        return cls(version, report.ready, pod_capacity(report),
                   {a.served_name: (serves(report, a), *(getattr(a, f) for f in _PLANNED_FIELDS))
                    for a in report.adapters})


def _pod_views(reports: Iterable[ResidencyReport], versions: Mapping[str, int]) -> dict[str, _PodView]:
    return {r.pod: _PodView.of(r, versions.get(r.pod, -1)) for r in reports}


def _revision_objects(revisions: Iterable[AdapterRevision]) -> dict[Key, AdapterRevision]:
    return {(r.metadata.namespace or "default", r.metadata.name): r for r in revisions}


def _adapter(rev: AdapterRevision) -> tuple[str, str]:
    return rev.metadata.namespace or "default", rev.spec.adapter


@dataclass
class _Part:
    """What ``IncrementalPlanner._part`` found: the adapters to plan again, the pods' changed views and the
    revision objects added or changed and removed."""

    adapters: set[tuple[str, str]]
    views: dict[str, _PodView]
    changed: list[Key]
    removed: list[Key]
    #: the served names among them whose rates moved beyond the hysteresis
    moved: list[str] = field(default_factory=list)
    #: every one of them is at rest and planned again only for its report rows or probe results: placed at the
    #: rates it was placed with, it keeps out of the pods' burst reserves as a whole plan does
    at_rest: bool = False


class IncrementalPlanner:
    """Keeps each pool's last plan and plans again only when its inputs moved (see the module docstring)."""

    def __init__(self, hysteresis: float = DEFAULT_HYSTERESIS, full_plan_seconds: float = DEFAULT_FULL_PLAN_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hysteresis = hysteresis
        self.full_plan_seconds = full_plan_seconds
        self.clock = clock
        self._memo: dict[str, _Memo] = {}
        #: plans made, reused, made again for a few revisions and for a few adapters since start (for tests and the
        #: benchmark)
        self.planned = 0
        self.reused = 0
        self.deltas = 0
        self.parts = 0

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

    def _part(self, memo: _Memo, inputs: PoolInputs, signature: tuple[Hashable, ...],
              revisions: dict[Key, AdapterRevision], versions: Mapping[str, int]) -> _Part | None:
        """The adapters to plan again alone (``plan_part``) -- those whose revisions were added, changed or deleted,
        those not at rest, those with new probe results, those whose rows in a report changed and those whose rates
        moved beyond the hysteresis -- and the changed pods' views; None where the pool must be planned whole: a pod
        came, went, changed readiness or capacity (every adapter's), the full plan period, or too many adapters
        (or floor revisions placed alone since the last whole plan, as ``delta_plan``'s)."""
        if memo.moved or self.clock() - memo.planned_at >= self.full_plan_seconds:
            return None
        if memo.pods.keys() != {r.pod for r in inputs.reports}:
            return None
        views: dict[str, _PodView] = {}
        touched: set[str] = set()
        carried_out: set[str] = set()
        for report in inputs.reports:
            old = memo.pods[report.pod]
            if versions.get(report.pod, -1) == old.version and report.ready == old.ready:
                continue
            view = views[report.pod] = _PodView.of(report, versions.get(report.pod, -1))
            if view.ready != old.ready or view.capacity != old.capacity:
                return None
            planned = memo.plan.placement.pods.get(report.pod, {})
            for n in view.residency.keys() | old.residency.keys():
                row, was = view.residency.get(n), old.residency.get(n)
                if row != was:
                    (carried_out if _as_planned(planned.get(n, Tier.ABSENT), row, was) else touched).add(n)
        touched |= _holds_moved(memo, views, carried_out - touched,
                                {r.pod for r in inputs.reports if r.demotes_to_disk})
        moved = (rates_moved(memo.rates, inputs.rates, memo.names, self.hysteresis)
                 if inputs.rates is not memo.rates_source else [])
        if moved and not few_enough(memo.drifted, len(memo.names)):
            return None
        if memo.signature[2] != signature[2]:
            probed = cast(frozenset[tuple[tuple[str, str], Hashable]], memo.signature[2]) ^ cast(
                frozenset[tuple[tuple[str, str], Hashable]], signature[2])
            touched.update(name for (name, _), _ in probed)
        changed = [key for key, rev in revisions.items() if memo.revisions.get(key) is not rev]
        removed = [key for key in memo.revisions if key not in revisions]
        part = set(memo.active)
        part.update(memo.names[name] for name in touched if name in memo.names)
        part.update(memo.names[name] for name in moved)
        part.update(_adapter(revisions[key]) for key in changed)
        part.update(_adapter(memo.revisions[key]) for key in removed)
        if not few_enough(len(part), len(memo.names)):  # of its adapters too
            return None
        at_rest = not (moved or changed or removed or memo.active)
        return _Part(part, views, changed, removed, moved, at_rest)

    def plan(self, inputs: PoolInputs, revisions_token: Hashable,
             report_versions: Mapping[str, int]) -> PlanOutcome:
        """``plan_pool(inputs)``, or the pool's last plan when nothing it depends on moved, or the last plan with a
        few adapters planned again (``plan_part``) or a few revisions placed again (``delta_plan``).
        ``revisions_token`` changes whenever the pool's revisions (specs, statuses, the set) do;
        ``report_versions`` as ``PoolReadings.report_versions``."""
        signature: tuple[Hashable, ...] = (
            revisions_token,
            tuple(sorted((r.pod, report_versions.get(r.pod, -1), r.ready) for r in inputs.reports)),
            frozenset(inputs.probes.items()),
        )
        memo = self._memo.get(inputs.pool)
        revisions = _revision_objects(inputs.revisions)
        if memo is not None and memo.signature[0] != revisions_token and _echoes(memo, revisions):
            memo.revisions = revisions
            memo.signature = (revisions_token, *memo.signature[1:])
        why = self._why(memo, inputs, signature, inputs.now)
        if memo is not None and not why:
            self.reused += 1
            return PlanOutcome(memo.plan, reused=True)
        if (memo is not None and memo.moved and few_enough(len(memo.moved), len(memo.names))
                and few_enough(memo.drifted, len(memo.names))):
            moved, memo.moved = memo.moved, []
            delta = delta_plan(memo.plan, inputs, moved)
            if delta is not None:
                plan, changed = delta
                self._rebase_rates(memo, inputs, changed)
                memo.plan, memo.rates_source = plan, inputs.rates
                if plan.placement.deferred:
                    memo.drifted += sum(plans_as_floor(d, inputs.placement) for d in plan.demands
                                        if d.served_name in changed)
                self.deltas += 1
                return PlanOutcome(plan, reused=False, why=f"placement of {len(changed)} revisions", delta=True)
        found = self._part(memo, inputs, signature, revisions, report_versions) if memo is not None else None
        if memo is not None and found is not None and not found.adapters:  # what moved is nothing planning reads
            memo.pods.update(found.views)
            memo.signature = signature
            self.reused += 1
            return PlanOutcome(memo.plan, reused=True)
        # a part plans at the rates its adapters were placed with, but for those that moved beyond the hysteresis
        part_inputs = (replace(inputs, rates=_at_baseline(inputs.rates, memo, set(found.moved)))
                       if memo is not None and found is not None else inputs)
        if (memo is not None and found is not None
                and (made := plan_part(memo.plan, part_inputs, found.adapters, found.at_rest)) is not None):
            part = found.adapters
            plan, again = made
            memo.pods.update(found.views)
            self._rebase_rates(memo, part_inputs, again)
            if found.moved:
                memo.rates_source = inputs.rates
                if plan.placement.deferred:
                    rebased = set(found.moved)
                    memo.drifted += sum(plans_as_floor(d, inputs.placement) for d in plan.demands
                                        if d.served_name in rebased)
            memo.active = (memo.active - part) | _active(plan, part)
            for key in found.removed + found.changed:  # the served names as the revisions are now
                if (old := memo.revisions.get(key)) is not None:
                    memo.names.pop(old.served_name, None)
            memo.names.update((revisions[key].served_name, _adapter(revisions[key])) for key in found.changed)
            memo.plan, memo.signature, memo.revisions = plan, signature, revisions
            self.parts += 1
            decided = {(key[0], name) for key in part if key in plan.adapters for name in plan.adapters[key].revisions}
            return PlanOutcome(plan, reused=False, why=f"{len(part)} adapters planned again alone", decided=decided)
        plan = plan_pool(inputs)
        names = {r.served_name: _adapter(r) for r in inputs.revisions}
        self._memo[inputs.pool] = _Memo(signature, plan, windows_of(inputs.rates), inputs.rates, self.clock(),
                                        _active(plan, plan.adapters), revisions, names,
                                        pods=_pod_views(inputs.reports, report_versions))
        self.planned += 1
        return PlanOutcome(plan, reused=False, why=why)

    @staticmethod
    def _rebase_rates(memo: _Memo, inputs: PoolInputs, names: Iterable[str]) -> None:
        """The rates of ``names`` as planned now (the baseline later rates are compared with)."""
        names = list(names)
        for window in WINDOWS:
            now = inputs.rates.windows.get(window, {}) if inputs.rates else {}  # type: ignore[call-overload]
            memo.rates.setdefault(window, {}).update((name, now.get(name, 0.0)) for name in names)


_REGISTERED, _DRAINING, _ERROR = (1 + _PLANNED_FIELDS.index(f) for f in ("registered", "draining", "error"))


def _as_planned(tier: Tier, row: tuple[object, ...] | None, was: tuple[object, ...] | None) -> bool:
    """Does a pod's row of a revision (``_PodView.residency``; None: no row) that changed from ``was`` agree with
    the plan's ``tier`` for it there, without an error before or after: a warm target registered (at whichever
    tier vLLM's LRU keeps it) or on its way there (a sidecar reports a new target absent, then on disk, then
    registered: only losing its registration is news), a disk target in either state, a revision the plan took
    away unregistered or draining? Such a change is the plan being carried out, or vLLM's LRU, not news to
    planning."""
    if any(r is not None and r[_ERROR] for r in (row, was)):
        return False

    def registered(r: tuple[object, ...] | None) -> bool:
        return r is not None and bool(r[_REGISTERED] or r[0])

    if tier in (Tier.GPU, Tier.CPU):
        return registered(row) or not registered(was)
    if tier is Tier.DISK:
        return True
    return row is None or bool(row[_DRAINING]) or not registered(row)


def _holds_moved(memo: _Memo, views: Mapping[str, _PodView], flipped: Iterable[str],
                 keeps_on_disk: Collection[str]) -> set[str]:
    """Of the served names whose report rows changed as the plan has them (``_as_planned``), those planning would
    place otherwise: what it reads of whether a pod serves them is ``keep_until_replaced``'s make-before-break, so
    those with a hold in flight (it may end now) and those whose planned holders all stopped serving them now while
    another pod serves them, or the reverse."""
    placement = memo.plan.placement
    held = {name for name, _ in placement.holds}
    now = {**memo.pods, **views}
    moved = set()
    for name in flipped:
        if name in held:
            moved.add(name)
            continue
        planned = {pod for pod, tier in placement.tiers_of(name).items()
                   if tier in (Tier.GPU, Tier.CPU) or (tier is Tier.DISK and pod in keeps_on_disk)}

        def orphaned(pods: Mapping[str, _PodView], name: str = name, planned: set[str] = planned) -> bool:
            serving = {pod for pod, view in pods.items() if (row := view.residency.get(name)) is not None and row[0]}
            return bool(serving) and not serving & planned

        if orphaned(memo.pods) != orphaned(now):
            moved.add(name)
    return moved


def _at_baseline(rates: RequestRates | None, memo: _Memo, moved: Collection[str]) -> RequestRates | None:
    """``rates`` with every revision the plan knows whose rates did not move beyond the hysteresis at the rates its
    placement was made with: a part planned for another reason (a report row, a rollout, a probe) must not pass on
    the drift the hysteresis holds back (in the simulator, hot-plus-burst: the parts' fresh rates changed replica
    counts, 269 target adds in 30,000 requests where whole plans made 11)."""
    if rates is None:
        return None
    windows = {}
    for window in WINDOWS:
        now = rates.windows.get(window, {})  # type: ignore[call-overload]
        planned = memo.rates.get(window, {})
        windows[window] = {**now, **{n: planned.get(n, 0.0) for n in memo.names if n not in moved}}
    return rates.model_copy(update={"windows": windows})


def _echoes(memo: _Memo, revisions: Mapping[Key, AdapterRevision]) -> bool:
    """Do ``revisions`` differ from those ``memo``'s plan was made from only by the statuses that plan decided (the
    controller's own status writes, handed back by the watch)? Then nothing planning reads changed: planning again
    would place the written adapters again alone, or the pool whole, on nothing new (in the twin, hot-plus-burst at
    16 pods: 37 whole plans and 79 parts in a minute, each status write answered by another plan)."""
    if revisions.keys() != memo.revisions.keys():
        return False
    decided = memo.plan.revisions
    for key, new in revisions.items():
        old = memo.revisions[key]
        if new is old:
            continue
        plan = decided.get(key)
        if (plan is None or new.status != plan.status or new.spec != old.spec or new.metadata.uid != old.metadata.uid
                or new.metadata.generation != old.metadata.generation
                or new.metadata.deletion_timestamp != old.metadata.deletion_timestamp):
            return False
    return True


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
    statuses = {name: (rev, by_served[name].status) for rev in revs if (name := rev.served_name) in changed}
    placement, targets, all_demands = _place_again(plan, inputs, changed, set(changed), statuses)
    return replace(plan, placement=placement, targets=targets, demands=all_demands, events=[], probes=[],
                   discarded_probes=[]), set(changed)


def plan_part(plan: PoolPlan, inputs: PoolInputs, adapters: Collection[tuple[str, str]],
              keep_reserve: bool = False) -> tuple[PoolPlan, set[str]] | None:
    """``plan`` with the logical ``adapters`` ((namespace, adapter): revisions added, changed or deleted, rollouts
    in progress) reconciled and placed again alone, on what the others leave of each pod: the others' statuses,
    targets and routes stay as they were. What a pool's reconcile does, for a part: the rollout runs with the whole
    pool's observation (canary GPU slots counted over every revision), placement with the residual capacity. None
    where placement spans the pool (tenant budgets, staging pods). Returns the plan and the served names placed
    again (before or now). ``keep_reserve``: as ``place_again``'s (the adapters are at rest, placed again at the
    rates they were placed with)."""
    if inputs.budgets or plan.placement.staging:
        return None
    wanted = set(adapters)
    groups = {key: revs for key, revs in adapter_groups(inputs.revisions).items() if key in wanted}
    decided = decide(inputs, groups, _observation(inputs))
    demands, by_served = adapter_demands(inputs, groups, decided)
    changed = {d.served_name: d for d in demands}
    before = {rp.served_name for key in wanted if key in plan.adapters for rp in plan.adapters[key].revisions.values()}
    placement, targets, all_demands = _place_again(plan, inputs, changed, before | set(changed), by_served,
                                                   keep_reserve)
    write_outcome(decided.values(), placement.notes, inputs.now)
    names = {adapter for _, adapter in wanted}
    kept = {key: outcome for key, outcome in plan.adapters.items() if key not in wanted}
    adapters = {**kept, **decided}
    # a route is keyed by the adapter's name: its entry is made again from every namespace's adapter of that name,
    # as the whole pool's plan makes it (in key order, the last one with a route)
    routes = {adapter: route for adapter, route in plan.routes.items() if adapter not in names}
    for key in sorted(k for k in adapters if k[1] in names):
        if (route := adapters[key].route) is not None:
            routes[key[1]] = route
    part = PoolPlan(adapters=adapters, targets=targets, routes=routes, placement=placement,
                    base_model=None, capacity=plan.capacity, demands=all_demands)
    collect(part, inputs.revisions, wanted, plan)
    return part, before | set(changed)


def _place_again(plan: PoolPlan, inputs: PoolInputs, changed: Mapping[str, AdapterDemand], again: set[str],
                 statuses: Mapping[str, tuple[AdapterRevision, AdapterRevisionStatus]], keep_reserve: bool = False,
                 ) -> tuple[Placement, dict[str, list[AdapterTarget]], list[AdapterDemand]]:
    """Place the ``changed`` demands alone on what the revisions not placed ``again`` (a superset of ``changed``:
    those leaving the plan too) leave of each pod, and merge: the placement, every pod's targets (a pod whose
    holdings did not change keeps its list) and the plan's demands. ``statuses``: served name -> (revision,
    status) of each changed demand."""
    before = plan.placement.pods
    planned, all_demands = place_again(plan.placement, plan.capacity, plan.demands, changed, again, inputs.placement,
                                       DEFAULT_ADAPTER_BYTES, keep_reserve)
    serving = serving_holders(inputs.reports, changed)
    placement = keep_until_replaced(planned, list(changed.values()), serving,
                                    {r.pod for r in inputs.reports if r.demotes_to_disk})
    # only the pods whose holdings changed are cut to their sidecars again (the others were, by the last plan)
    moved = {pod for pod, held in placement.pods.items() if held != before.get(pod)}
    serving.update(serving_holders(inputs.reports, {n for pod in moved for n in placement.pods[pod]} - changed.keys()))
    placement = fit_to_sidecars(placement, planned, [r for r in inputs.reports if r.ready and r.pod in moved],
                                all_demands, serving)
    targets = dict(plan.targets)
    for pod, held in placement.pods.items():
        if held == before.get(pod):
            continue
        old_targets = {t.served_name: t for t in plan.targets.get(pod, [])}
        targets[pod] = [
            old_targets[name] if name in old_targets and old_targets[name].tier is tier and name not in changed
            else _target(*(statuses.get(name) or _planned_status(plan, inputs, name)), tier)
            for name, tier in held.items() if tier is not Tier.ABSENT
        ]
    for pod in before.keys() - placement.pods.keys():
        targets.pop(pod, None)
    return placement, targets, all_demands


def _planned_status(plan: PoolPlan, inputs: PoolInputs, name: str) -> tuple[AdapterRevision, AdapterRevisionStatus]:
    """The revision served as ``name`` with the status ``plan`` gave it: one not placed again whose tier on a pod
    changed all the same (``fit_to_sidecars`` cut it, on a pod whose holdings the part changed)."""
    rev = next(r for r in inputs.revisions if r.served_name == name)
    return rev, plan.revisions[(rev.metadata.namespace or "default", rev.metadata.name)].status
