"""Placement: which served revisions each pod of a pool should hold, and at which tier.

A pure function of the pool's capacity, the adapters' demands and the previous placement (see
``docs/controller.md`` "Placement"). The controller calls it on every reconcile and the simulator reuses it; it
does no I/O and reads no clock.

The plan, in order:

1. rollout requirements (``AdapterDemand.required``: canary pods, retiring revisions) are placed first;
2. GPU replicas by marginal value: an adapter's k-th replica is worth ``score / k`` where the score is its steady
   request rate (bursts excluded) times a priority weight; pinned adapters come first. Below ``gpu_min_rate`` an
   adapter plans like an idle one (its warm policy's floor, and only where the slots left hold every adapter with
   a trickle of traffic: ``floors_fit``); a gold one with traffic gets ``gold_min_replicas``.
   Existing replicas are kept while their value, raised by ``stickiness``, still earns them a slot, so a small
   change in rates moves few adapters; a first replica goes to a pod already holding the revision. Capacity is
   counted in slots and bytes; ``burst_slots_per_pod`` GPU slots per pod are kept free for bursts; a pod left far
   above the pool's mean load (``balance_ratio``) gets further replicas of its busiest adapters in free slots;
3. one-off bursts (5 min rate far above the 1 h / 24 h rates) get a replica in the reserved burst slots only, so
   they never evict a hot adapter: where they are held, else where gold load is lightest;
4. host-memory slots, in one pass by worth: adapters without a GPU replica but with traffic or a ``cpu`` /
   ``gpu-preferred`` warm policy get a CPU replica, on a pod already holding them (a held revision is never copied
   to another pod for it); a revision that loses its GPU or CPU place on a pod is demoted to CPU there, not
   dropped (both worth their score); GPU-placed adapters with traffic get ``host_copies`` CPU copies on other pods,
   each worth the adapter's steady rate beyond ``replica_rate`` (the traffic that may spill off one pod);
5. every demand ends up on at least ``min_replicas`` pods (disk tier where nothing warmer was placed), on
   ``traffic_holders`` pods while every pod stages (idle revisions too: a sweep's burst spreads), a busy one on
   more in proportion to its share of the traffic (``holder_spread``, on pods with GPU slots free, where the
   revisions with traffic outnumber the GPU slots), as far as the
   pods' disk caches (``PodCapacity.disk_bytes``) hold them: real demand first, then idle revisions, then
   trickles; a revision no disk has room for is fetched on its first request.

Staging pods (``staging_share`` of the pods; off by default: spreading a sweep over its ``traffic_holders`` beats
it): where the pool has gold revisions, the other pods' GPU slots hold ``gold_min_replicas`` of each, slots are scarce (the pool needs at least those slots less one
free each: what its traffic asks for, at least the gold minimum) and some revision is idle, idle revisions (no
traffic in 24 h) are staged (steps 4 and 5) on ``staging_share`` of the pods only, the same ones from plan to plan
(those holding the most idle revisions in the previous plan), named in the plan (``Placement.staging``; the route
table sends a revision no pod holds there), so a sweep of new revisions loads and prefills there, not next to every
gold replica. While that cold traffic shows (revisions below ``gpu_min_rate`` held only on staging pods carry
``gpu_min_rate`` or more) the staging pods are shielded: the other pods keep no burst slot and hold the gold
replicas, a gold revision is held on a staging pod at no tier except a GPU replica the other pods have no room for
(one replica per staging pod at most: its other slots are for the cold traffic's own loads), and no floor replica of
a non-gold revision takes a GPU slot anywhere. These rules are the named predicates of
``loraplane.controller.staging``.

``keep_until_replaced`` (make before break) runs after ``place``: a routed revision the plan moves keeps its
current holders serving it (at CPU, or at disk where the runtime keeps disk-tier revisions registered) until a
newly planned pod serves it.

Tenant budgets cap the bytes a tenant holds at the GPU and CPU tiers across the pool.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from loraplane.api import WarmPolicy
from loraplane.api.runtime import Tier
from loraplane.controller.staging import Staging, floors_fit, is_floor, is_idle


@dataclass(frozen=True)
class PodCapacity:
    """What one pod can hold (from its sidecar's report): slots, and optionally bytes, per tier."""

    name: str
    gpu_slots: int
    cpu_slots: int
    gpu_bytes: int | None = None
    cpu_bytes: int | None = None
    #: bytes its local disk cache holds (every revision it holds at any tier is on its disk); None: unbounded
    disk_bytes: int | None = None
    #: GPU slots kept free for bursts; None: ``PlacementConfig.burst_slots_per_pod`` on a pod with more slots than
    #: that (``burst_reserve``). A part's residual pod (``place_again``) carries what is left of its pod's reserve
    gpu_reserve: int | None = None


def burst_reserve(pod: PodCapacity, config: PlacementConfig) -> int:
    """The GPU slots ``pod`` keeps free of steady replicas for bursts."""
    if pod.gpu_reserve is not None:
        return pod.gpu_reserve
    return config.burst_slots_per_pod if pod.gpu_slots > config.burst_slots_per_pod else 0


def host_slots(max_cpu_slots: int, max_gpu_slots: int) -> int:
    """Host-memory slots to plan for CPU-tier revisions on a runtime whose host cache (vLLM's ``--max-cpu-loras``)
    also holds its GPU-resident adapters: the slots beyond the GPU ones, and one where the runtime has any (a host
    cache no larger than the GPU slots, the engine's default, would otherwise leave no room to prewarm a revision,
    and every rollout there would wait at Prewarming)."""
    return max(min(1, max_cpu_slots), max_cpu_slots - max_gpu_slots)


@dataclass(frozen=True)
class Rates:
    """An adapter's request rates (requests/s) over the picker's 5 min, 1 h and 24 h windows."""

    m5: float = 0.0
    h1: float = 0.0
    h24: float = 0.0

    def scaled(self, factor: float) -> Rates:
        """The same rates times ``factor`` (a canary's share of its adapter's traffic)."""
        return Rates(self.m5 * factor, self.h1 * factor, self.h24 * factor)


@dataclass(frozen=True)
class AdapterDemand:
    """One served revision the pool should hold, and how much it is asked for."""

    served_name: str
    bytes: int
    rates: Rates = Rates()
    tenant: str = "default"
    priority: int = 0
    warm_policy: WarmPolicy = WarmPolicy.GPU_PREFERRED
    pinned: bool = False
    #: pods that must hold it at (at least) the given tier whatever the rates say (set by the rollout)
    required: Mapping[str, Tier] = field(default_factory=dict)
    #: pods it may be placed on (compatible base model, rank); None: every pod
    eligible: frozenset[str] | None = None
    #: pods that must hold it at some tier, disk included
    min_replicas: int = 1


@dataclass(frozen=True)
class TenantBudget:
    """The most adapter bytes one tenant may hold across the pool, per tier (None: no limit)."""

    gpu_bytes: int | None = None
    cpu_bytes: int | None = None


@dataclass(frozen=True)
class PlacementConfig:
    """Tunables of the placement (defaults in ``docs/controller.md``)."""

    #: requests/s one pod serves for one adapter before the adapter gets another GPU replica
    replica_rate: float = 4.0
    #: an existing replica keeps its slot unless a newcomer is worth this much more (0.25 = 25 %)
    stickiness: float = 0.25
    #: a 5 min rate above ``burst_ratio`` x max(1 h, 24 h) is a burst, not steady demand
    burst_ratio: float = 4.0
    #: below this 5 min rate (requests/s) nothing counts as a burst
    burst_min_rate: float = 0.05
    #: GPU slots per pod kept free of hot adapters for bursts (only on pods with more slots than this)
    burst_slots_per_pod: int = 1
    #: score multiplier for priority > 0 (gold) and < 0 (sheddable)
    gold_weight: float = 4.0
    sheddable_weight: float = 0.5
    #: below this steady rate (requests/s) an adapter gets no planned GPU replica (pinned and required ones
    #: excepted): it waits in host memory and the engine loads it on demand
    gpu_min_rate: float = 0.2
    #: GPU replicas a gold (priority > 0) adapter with traffic gets at least, so its requests always have a second
    #: warm pod when one is busy
    gold_min_replicas: int = 2
    #: a pod whose planned load (requests/s its GPU replicas carry) is above this multiple of the pool's mean, and
    #: above ``replica_rate``, gets a further replica of its busiest adapters in free GPU slots elsewhere
    balance_ratio: float = 1.0
    #: host-memory (CPU tier) copies each GPU-placed adapter with traffic gets on pods without its GPU replica, each
    #: worth its steady rate beyond ``replica_rate`` against the other host-slot claims: a burst to it can spill
    #: to a pod where it is a host->GPU copy away, not a read from disk (0: none)
    host_copies: int = 0
    #: share of the pool's pods (rounded down; 0, the default: none) that stage the idle revisions (no traffic in
    #: 24 h) in host memory and on disk, so the cold traffic a sweep of new revisions brings lands on them; while that traffic
    #: shows they hold no gold revision (see the module docstring). Only where the pool has gold revisions, the
    #: other pods' GPU slots hold ``gold_min_replicas`` of each and slots are scarce (docs/controller.md, "Staging
    #: pods")
    staging_share: float = 0.0
    #: pods that hold each revision at some tier (disk included: step 5) where their disk caches have room and every
    #: pod stages (no staging pods apart), so while one holder's GPU slots are all busy with other revisions the
    #: picker can send a request to another holder (a read from its disk) instead of holding it; idle revisions too,
    #: so the burst a sweep of them brings spreads over their holders
    traffic_holders: int = 3
    #: holders (step 5, as ``traffic_holders``) of a revision with traffic, in proportion to its share of the pool's
    #: steady traffic: ``ceil(holder_spread x share x pods)``, so a busy revision's bursts (a few times its mean on
    #: real arrivals) spread over pods enough to prefill them, where a fixed count left its holders queueing while
    #: pods without it idled; only where the revisions with traffic outnumber the GPU slots (``PoolTraffic``); 0: off
    holder_spread: float = 8.0
    #: the most pods ``holder_spread`` puts a revision on (a revision with a fifth of a 500-pod fleet's traffic is
    #: not registered on 800 pods, nor does its rate moving rewrite them all)
    max_spread_holders: int = 16


@dataclass
class Placement:
    """The plan: pod -> served name -> tier. ``notes`` says why a demand got less than it asked for."""

    pods: dict[str, dict[str, Tier]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    #: the staging pods while some stage apart (``staging_share``): where traffic of a revision no pod holds goes
    #: (``RouteTable.staging_pods``); empty while every pod stages
    staging: frozenset[str] = frozenset()
    #: the disks could not hold ``traffic_holders`` of every revision, so the floors' further holders came after
    #: every floor, in the pool's order (``_Planner.place_disk``): a part placed again alone leaves the rest's
    #: holders as they are, and a whole plan moves them between revisions
    deferred: bool = False
    #: (served name, pod) entries kept by make-before-break (``keep_until_replaced``) beyond what was placed: the
    #: revision's traffic stays there until a pod the plan keeps serving it serves it too
    holds: frozenset[tuple[str, str]] = frozenset()

    def tiers_of(self, served_name: str) -> dict[str, Tier]:
        """Pod -> tier for one served name."""
        return {pod: held[served_name] for pod, held in self.pods.items() if served_name in held}

    def replicas(self, tier: Tier) -> dict[str, set[str]]:
        """Served name -> pods holding it at exactly ``tier``."""
        out: dict[str, set[str]] = {}
        for pod, held in self.pods.items():
            for name, t in held.items():
                if t is tier:
                    out.setdefault(name, set()).add(pod)
        return out


def is_burst(rates: Rates, config: PlacementConfig) -> bool:
    """True when the 5 min rate is a one-off spike far above the adapter's steady rate."""
    steady = max(rates.h1, rates.h24)
    return rates.m5 >= config.burst_min_rate and rates.m5 > config.burst_ratio * steady


def plans_as_floor(d: AdapterDemand, config: PlacementConfig) -> bool:
    """Does ``d`` plan like an idle adapter (``staging.is_floor``: below ``gpu_min_rate``, not pinned)? Its GPU
    replica is its warm policy's floor at most, and its disk holders come after real demand's."""
    return not d.pinned and steady_rate(d.rates, config) < config.gpu_min_rate


def steady_rate(rates: Rates, config: PlacementConfig) -> float:
    """The rate placement plans GPU replicas for: bursts excluded, otherwise the highest window."""
    if is_burst(rates, config):
        return max(rates.h1, rates.h24)
    return max(rates.m5, rates.h1, rates.h24)


def replicas_needed(rate: float, config: PlacementConfig) -> int:
    """GPU replicas an adapter's steady rate asks for (0 for no traffic)."""
    return math.ceil(rate / config.replica_rate - 1e-9) if rate > 0 else 0


class _Pool:
    """Mutable bookkeeping of one planning run: free capacity, load and assignments."""

    def __init__(self, pods: Iterable[PodCapacity], config: PlacementConfig) -> None:
        self.caps = {p.name: p for p in pods}
        self.reserved = {p.name: burst_reserve(p, config) for p in self.caps.values()}
        self.held: dict[str, dict[str, Tier]] = {name: {} for name in self.caps}
        #: served name -> pod -> tier (the same as ``held``, indexed the other way)
        self.where: dict[str, dict[str, Tier]] = {}
        self.slots_used = {tier: dict.fromkeys(self.caps, 0) for tier in (Tier.GPU, Tier.CPU)}
        self.bytes_used = {tier: dict.fromkeys(self.caps, 0) for tier in (Tier.GPU, Tier.CPU)}
        #: pod -> bytes of every revision it holds, at any tier (each is in its local disk cache)
        self.disk_used = dict.fromkeys(self.caps, 0)
        #: pods with a free slot per tier (GPU: beyond the burst reserve), so a full pool is skipped at once
        self.roomy = {tier: {p for p in self.caps if self.room(p, tier) > 0} for tier in (Tier.GPU, Tier.CPU)}

    def room(self, pod: str, tier: Tier) -> int:
        reserve = self.reserved[pod] if tier is Tier.GPU else 0
        return self.slot_limit(pod, tier) - reserve - self.slots_used[tier][pod]

    def _track(self, pod: str, tier: Tier) -> None:
        if self.room(pod, tier) > 0:
            self.roomy[tier].add(pod)
        else:
            self.roomy[tier].discard(pod)

    def slot_limit(self, pod: str, tier: Tier) -> int:
        cap = self.caps[pod]
        return cap.gpu_slots if tier is Tier.GPU else cap.cpu_slots

    def byte_limit(self, pod: str, tier: Tier) -> int | None:
        cap = self.caps[pod]
        return cap.gpu_bytes if tier is Tier.GPU else cap.cpu_bytes

    def fits(self, pod: str, tier: Tier, size: int, *, reserve: int = 0) -> bool:
        """True when ``pod`` has a free ``tier`` slot (beyond ``reserve`` kept ones) and the bytes for ``size``."""
        if tier is Tier.DISK:
            limit = self.caps[pod].disk_bytes
            return limit is None or self.disk_used[pod] + size <= limit
        if self.slots_used[tier][pod] + 1 > self.slot_limit(pod, tier) - reserve:
            return False
        limit = self.byte_limit(pod, tier)
        return limit is None or self.bytes_used[tier][pod] + size <= limit

    def fits_instead(self, pod: str, tier: Tier, size: int, freed: int, *, reserve: int = 0) -> bool:
        """True when ``size`` fits on ``pod`` once one held adapter of ``freed`` bytes is dropped."""
        if self.slots_used[tier][pod] > self.slot_limit(pod, tier) - reserve:
            return False
        limit = self.byte_limit(pod, tier)
        return limit is None or self.bytes_used[tier][pod] - freed + size <= limit

    def put(self, pod: str, name: str, tier: Tier, size: int) -> None:
        self.remove(pod, name, size)
        self.held[pod][name] = tier
        self.where.setdefault(name, {})[pod] = tier
        self.disk_used[pod] += size
        if tier is not Tier.DISK:
            self.slots_used[tier][pod] += 1
            self.bytes_used[tier][pod] += size
            self._track(pod, tier)

    def remove(self, pod: str, name: str, size: int) -> None:
        tier = self.held[pod].pop(name, None)
        self.where.get(name, {}).pop(pod, None)
        if tier is not None:
            self.disk_used[pod] -= size
        if tier is not None and tier is not Tier.DISK:
            self.slots_used[tier][pod] -= 1
            self.bytes_used[tier][pod] -= size
            self._track(pod, tier)


@dataclass(frozen=True)
class PoolTraffic:
    """What ``holder_spread`` reads of the whole pool: its steady traffic (requests/s) and whether its revisions with
    traffic outnumber its GPU slots (where they do not, each has its GPU replicas and more holders only cost loads:
    every registration activates into a slot)."""

    rate: float
    contended: bool
    #: the demands planned are a part of the pool placed again alone (``place_again``): each keeps the disk holders
    #: it had before any of them takes a further one (``_Planner.place_disk``)
    part: bool = False

    @classmethod
    def of(cls, pods: Iterable[PodCapacity], rates: Iterable[float], part: bool = False) -> PoolTraffic:
        """The traffic of ``rates`` (each revision's steady rate) on ``pods``."""
        busy = [r for r in rates if r > 0]
        return cls(sum(busy), len(busy) > sum(p.gpu_slots for p in pods), part)

    @classmethod
    def of_demands(cls, pods: Iterable[PodCapacity], demands: Iterable[AdapterDemand],
                   config: PlacementConfig) -> PoolTraffic:
        """The traffic of the whole pool's ``demands`` on its ``pods`` (``steady_rate`` of each), for a part of it
        placed again alone (``place_again``)."""
        return cls.of(pods, (steady_rate(d.rates, config) for d in demands), part=True)


@dataclass
class _Entry:
    demand: AdapterDemand
    #: steady request rate (``steady_rate``: bursts excluded)
    rate: float
    score: float
    need: int
    burst: bool
    gpu: set[str] = field(default_factory=set)
    forced_gpu: set[str] = field(default_factory=set)

    @property
    def share(self) -> float:
        """Load one replica carries."""
        return self.score / max(1, len(self.gpu))

    def marginal(self, k: int) -> float:
        """Value of holding ``k`` GPU replicas' k-th replica."""
        return self.score / k

    @property
    def gold(self) -> bool:
        return self.demand.priority > 0

    @property
    def pinned(self) -> bool:
        return self.demand.pinned


#: kinds of host-tier claim, in the order they win at equal worth (``_Planner.place_host_tier``)
_CPU_REPLICA, _DEMOTED, _HOST_COPY = range(3)


class _Planner:
    def __init__(
        self,
        pods: Iterable[PodCapacity],
        demands: Iterable[AdapterDemand],
        previous: Placement | None,
        budgets: Mapping[str, TenantBudget],
        config: PlacementConfig,
        traffic: PoolTraffic | None = None,
    ) -> None:
        self.config = config
        self.pool = _Pool(pods, config)
        self.budgets = budgets
        self.tenant_bytes: dict[Tier, dict[str, int]] = {Tier.GPU: {}, Tier.CPU: {}}
        self.previous = {pod: held for pod, held in (previous.pods if previous else {}).items() if pod in self.pool.caps}
        self.previous_by_name: dict[str, dict[str, Tier]] = {}
        for pod, held in self.previous.items():
            for name, tier in held.items():
                self.previous_by_name.setdefault(name, {})[pod] = tier
        self.notes: dict[str, str] = {}
        #: the floors' further holders were deferred (``Placement.deferred``)
        self.deferred = False
        #: pod -> steady request rate its GPU replicas carry (an adapter's score split over its replicas)
        self.load = dict.fromkeys(self.pool.caps, 0.0)
        #: the same, counting gold (priority > 0) adapters only
        self.gold_load = dict.fromkeys(self.pool.caps, 0.0)
        #: (per-replica value with stickiness, served name, version): the cheapest GPU replica to evict first
        self.victims: list[tuple[float, str, int]] = []
        self.versions: dict[str, int] = {}
        self.entries: dict[str, _Entry] = {}
        for d in demands:
            weight = config.gold_weight if d.priority > 0 else config.sheddable_weight if d.priority < 0 else 1.0
            rate = steady_rate(d.rates, config)
            if rate >= config.gpu_min_rate:
                need = replicas_needed(rate, config)
                if d.priority > 0:
                    need = max(need, config.gold_min_replicas)
            else:  # idle or a trickle: the warm policy's floor, behind every adapter with real demand
                need = 1 if d.pinned or d.warm_policy is WarmPolicy.GPU_PREFERRED else 0
            # a tiny positive score for idle floors keeps them behind every adapter with traffic
            score = rate * weight if rate > 0 else 1e-9 * weight
            self.entries[d.served_name] = _Entry(d, rate, score, need, is_burst(d.rates, config))
        #: the pool's traffic, which ``spread_holders`` shares out
        self.traffic = traffic or PoolTraffic.of(self.pool.caps.values(), [e.rate for e in self.entries.values()])
        free = sum(cap.gpu_slots - self.pool.reserved[pod] for pod, cap in self.pool.caps.items())
        if not floors_fit(self.entries.values(), free, config):
            for e in self.entries.values():
                if is_floor(e, config):
                    e.need = 0
        gpu_slots = {pod: cap.gpu_slots for pod, cap in self.pool.caps.items()}
        #: the staging pods and their shield (``staging``)
        self.staging = Staging.of(gpu_slots, self.entries, self.previous_by_name, config)
        if self.staging.shielded:
            for pod, cap in self.pool.caps.items():
                self.pool.reserved[pod] = self.staging.gpu_reserve(pod, cap.gpu_slots, self.pool.reserved[pod])
            self.pool.roomy[Tier.GPU] = {p for p in self.pool.caps if self.pool.room(p, Tier.GPU) > 0}

    # -- helpers -------------------------------------------------------------------------------------------------
    def eligible(self, e: _Entry) -> list[str]:
        allowed = e.demand.eligible
        return [p for p in self.pool.caps if allowed is None or p in allowed]

    def previously(self, name: str, tiers: tuple[Tier, ...]) -> list[str]:
        return sorted(p for p, tier in self.previous_by_name.get(name, {}).items() if tier in tiers)

    def budget_allows(self, e: _Entry, tier: Tier) -> bool:
        budget = self.budgets.get(e.demand.tenant)
        limit = None if budget is None else budget.gpu_bytes if tier is Tier.GPU else budget.cpu_bytes
        used = self.tenant_bytes[tier].get(e.demand.tenant, 0)
        return limit is None or used + e.demand.bytes <= limit

    def charge(self, e: _Entry, tier: Tier, sign: int) -> None:
        if tier in (Tier.GPU, Tier.CPU):
            bucket = self.tenant_bytes[tier]
            bucket[e.demand.tenant] = bucket.get(e.demand.tenant, 0) + sign * e.demand.bytes

    def add_gpu(self, e: _Entry, pod: str) -> None:
        self.unload_share(e)
        self.pool.put(pod, e.demand.served_name, Tier.GPU, e.demand.bytes)
        e.gpu.add(pod)
        self.charge(e, Tier.GPU, +1)
        self.load_share(e)
        self.bump(e)

    def drop_gpu(self, e: _Entry, pod: str) -> None:
        self.unload_share(e)
        self.pool.remove(pod, e.demand.served_name, e.demand.bytes)
        e.gpu.discard(pod)
        self.charge(e, Tier.GPU, -1)
        self.load_share(e)
        self.bump(e)

    def unload_share(self, e: _Entry) -> None:
        self.load_share(e, -1.0)

    def load_share(self, e: _Entry, sign: float = 1.0) -> None:
        share = sign * e.share
        for pod in e.gpu:
            self.load[pod] += share
            if e.demand.priority > 0:
                self.gold_load[pod] += share

    # -- steps ---------------------------------------------------------------------------------------------------
    def required_order(self) -> list[tuple[_Entry, str, Tier]]:
        """Every rollout requirement, those the previous plan already met first (a canary keeps the slot it holds:
        a newcomer never takes it from under a gate in progress, e.g. between an activation and its probe), then
        the others, each group in demand order."""
        held: list[tuple[_Entry, str, Tier]] = []
        new: list[tuple[_Entry, str, Tier]] = []
        for e in self.entries.values():
            for pod, tier in sorted(e.demand.required.items()):
                if pod not in self.pool.caps or tier is Tier.ABSENT:
                    continue
                before = self.previous.get(pod, {}).get(e.demand.served_name)
                (held if before is not None and before.level <= tier.level else new).append((e, pod, tier))
        return held + new

    def place_required(self) -> None:
        for e, pod, tier in self.required_order():
            name = e.demand.served_name
            if tier is Tier.GPU:
                if not self.pool.fits(pod, Tier.GPU, e.demand.bytes):
                    self.evict_for(e, pod, ignore_value=True)
                if self.pool.fits(pod, Tier.GPU, e.demand.bytes):
                    self.add_gpu(e, pod)
                    e.forced_gpu.add(pod)
                    continue
                self.notes[name] = f"pod {pod} has no GPU room for a required replica"
                # one tier lower, as a sidecar clips it: the canary pod keeps the revision (never a 404 there)
                tier = Tier.CPU if self.pool.fits(pod, Tier.CPU, e.demand.bytes) else Tier.DISK
            elif not self.pool.fits(pod, tier, e.demand.bytes):
                self.notes[name] = f"pod {pod} has no {tier.value} room for a required replica"
                tier = Tier.DISK
            self.pool.put(pod, name, tier, e.demand.bytes)
            self.charge(e, tier, +1)

    def hot_order(self) -> list[_Entry]:
        return sorted(
            self.entries.values(),
            key=lambda e: (not e.demand.pinned, -e.score, e.demand.served_name),
        )

    def keep_previous_gpu(self) -> None:
        """Keep existing GPU replicas that their (sticky) value still justifies, best first."""
        sticky = 1.0 + self.config.stickiness
        for e in self.hot_order():
            keep_limit = max(e.need, replicas_needed(e.score * sticky, self.config) if e.need else 0)
            for pod in self.previously(e.demand.served_name, (Tier.GPU,)):
                if len(e.gpu) >= keep_limit:
                    break
                if pod in e.gpu or not self.takes_gpu_slot(e, pod):
                    continue
                if self.pool.fits(pod, Tier.GPU, e.demand.bytes, reserve=self.pool.reserved[pod]):
                    if self.budget_allows(e, Tier.GPU):
                        self.add_gpu(e, pod)

    def is_eligible(self, e: _Entry, pod: str) -> bool:
        return not self.staging.shields(e, pod) and self.may_run(e, pod)

    def may_run(self, e: _Entry, pod: str) -> bool:
        """The demand's own eligibility (compatible base model, rank)."""
        return e.demand.eligible is None or pod in e.demand.eligible

    def takes_gpu_slot(self, e: _Entry, pod: str) -> bool:
        """True when a (non-burst) GPU replica of ``e`` may be planned on ``pod``: eligible, and, while the staging
        pods are shielded, no floor replica of a non-gold revision anywhere (on a staging pod it would take a slot
        the cold traffic's own loads need, elsewhere it would draw that traffic to the gold adapters' pods)."""
        return self.is_eligible(e, pod) and not self.staging.floor_barred(e)

    def add_gpu_replicas(self) -> None:
        """Grant further replicas by marginal value, evicting weaker replicas when the pool is full."""
        heap: list[tuple[float, str]] = []
        for e in self.entries.values():
            if len(e.gpu) < e.need:
                priority = float("inf") if e.demand.pinned else e.marginal(len(e.gpu) + 1)
                heapq.heappush(heap, (-priority, e.demand.served_name))
        while heap:
            _, name = heapq.heappop(heap)
            e = self.entries[name]
            if not self.budget_allows(e, Tier.GPU):
                self.notes[name] = f"tenant {e.demand.tenant} GPU budget exhausted"
                continue
            pod = self.least_loaded(e) or self.evict_for(e, None, ignore_value=e.demand.pinned)
            if pod is None:
                if not e.gpu:
                    self.notes[name] = "no GPU slot free for it"
                continue
            self.add_gpu(e, pod)
            if len(e.gpu) < e.need:
                heapq.heappush(heap, (-e.marginal(len(e.gpu) + 1), name))

    def spread_load(self) -> None:
        """Further GPU replicas, in free slots only (never evicting), for the adapters of a pod whose planned load is
        far above the pool's mean, while each one lowers the busiest pod's load.

        Replicas kept from earlier plans were placed on the rates of their time (an idle start places every adapter
        alike), so two hot adapters can share a pod while another pod carries little; the router keeps each
        adapter's traffic on its warm pods, so only another warm replica moves it. A pod the adapter held on GPU in
        the previous plan is preferred, so a replica added here is kept, not moved, by the next plan.
        """
        cfg = self.config
        load = self.load
        for _ in range(sum(self.pool.room(p, Tier.GPU) for p in self.pool.caps)):
            busiest = max(load, key=lambda p: (load[p], p))
            if load[busiest] <= max(cfg.replica_rate, cfg.balance_ratio * sum(load.values()) / len(load)):
                return
            best: tuple[float, str, str] | None = None
            for name, tier in self.pool.held[busiest].items():
                e = self.entries[name]
                # an adapter below ``gpu_min_rate`` carries next to none of the load (an idle floor's score is
                # 1e-9): its replica lowered the peak by a rounding error, so every free slot took one
                if tier is not Tier.GPU or e.rate < cfg.gpu_min_rate or not self.budget_allows(e, Tier.GPU):
                    continue
                pod = self.spread_target(e)
                if pod is None:
                    continue
                share = e.score / (len(e.gpu) + 1)
                peak = max(load[busiest] - (e.share - share), load[pod] + share)
                if peak < load[busiest] and (best is None or (peak, name) < best[:2]):
                    best = (peak, name, pod)
            if best is None:
                return
            self.add_gpu(self.entries[best[1]], best[2])

    def spread_target(self, e: _Entry) -> str | None:
        """Where a spreading replica of ``e`` goes: a pod that held it on GPU before, else the least-loaded one."""
        was = self.previous_by_name.get(e.demand.served_name, {})
        fitting = [
            p for p in self.pool.roomy[Tier.GPU]
            if self.takes_gpu_slot(e, p) and e.demand.served_name not in self.pool.held[p]
            and self.pool.fits(p, Tier.GPU, e.demand.bytes, reserve=self.pool.reserved[p])
        ]  # fmt: skip
        return min(fitting, key=lambda p: (was.get(p) is not Tier.GPU, self.load[p], p), default=None)

    def least_loaded(self, e: _Entry) -> str | None:
        """The least-loaded pod with room; an adapter's first GPU replica goes where it was CPU-warm, else where it
        was on disk, if it fits. A gold replica goes to a shielded staging pod only when no other pod has room.

        Promoting in place never leaves the adapter on no serving pod: a first replica elsewhere would drop the CPU
        replica while the new pod still fetches, and requests routed in between would find it nowhere.
        """
        load = self.load
        was = self.previous_by_name.get(e.demand.served_name, {}) if not e.gpu else {}
        best: tuple[bool, int, float, int, str] | None = None
        for pod in self.pool.roomy[Tier.GPU]:
            if not self.may_run(e, pod) or self.staging.floor_barred(e) or pod in e.gpu:
                continue
            if e.demand.served_name in self.pool.held[pod]:
                continue
            if not self.pool.fits(pod, Tier.GPU, e.demand.bytes, reserve=self.pool.reserved[pod]):
                continue
            shielded = self.staging.shields(e, pod)
            key = (shielded, was.get(pod, Tier.ABSENT).level, load[pod], self.pool.slots_used[Tier.GPU][pod], pod)
            if best is None or key < best:
                best = key
        return None if best is None else best[4]

    def evict_for(self, e: _Entry, only_pod: str | None, *, ignore_value: bool) -> str | None:
        """Free a GPU slot for ``e`` by dropping the least valuable replica worth less than ``e``'s next one.

        With ``only_pod`` the slot must be on that pod (a rollout requirement); otherwise on any eligible pod.
        Returns the pod with the freed slot, or None when no replica may make way.
        """
        wanted = e.marginal(len(e.gpu) + 1)
        found = self.victim_on(e, only_pod) if only_pod else self.cheapest_victim(e, wanted, ignore_value)
        if found is None:
            return None
        victim, pod = found
        self.drop_gpu(victim, pod)
        return pod

    def evictable(self, victim: _Entry, pod: str, e: _Entry, reserve: int) -> bool:
        return (
            victim is not e
            and not victim.demand.pinned
            and pod not in victim.forced_gpu
            and self.pool.fits_instead(pod, Tier.GPU, e.demand.bytes, victim.demand.bytes, reserve=reserve)
        )

    def victim_on(self, e: _Entry, pod: str) -> tuple[_Entry, str] | None:
        held = [self.entries[n] for n, t in self.pool.held[pod].items() if t is Tier.GPU]
        ok = [v for v in held if self.evictable(v, pod, e, reserve=0)]
        best = min(ok, key=lambda v: (v.marginal(len(v.gpu)), v.demand.served_name), default=None)
        return None if best is None else (best, pod)

    def cheapest_victim(self, e: _Entry, wanted: float, ignore_value: bool) -> tuple[_Entry, str] | None:
        """Walk replicas from the least valuable up (a lazy heap) until one can make room for ``e``."""
        popped: list[tuple[float, str, int]] = []
        found = None
        while self.victims:
            value, name, version = self.victims[0]
            if version != self.versions[name]:
                heapq.heappop(self.victims)
                continue
            if not ignore_value and value >= wanted:
                break
            popped.append(heapq.heappop(self.victims))
            victim = self.entries[name]
            for pod in sorted(victim.gpu):
                if pod not in e.gpu and self.takes_gpu_slot(e, pod) and e.demand.served_name not in self.pool.held[pod]:
                    if self.evictable(victim, pod, e, reserve=self.pool.reserved[pod]):
                        found = (victim, pod)
                        break
            if found:
                break
        for item in popped:
            heapq.heappush(self.victims, item)
        return found

    def bump(self, e: _Entry) -> None:
        """Record ``e``'s new per-replica value (with the stickiness bonus) in the victims heap."""
        name = e.demand.served_name
        self.versions[name] = self.versions.get(name, 0) + 1
        if e.gpu and not e.demand.pinned:
            value = e.marginal(len(e.gpu)) * (1.0 + self.config.stickiness)
            heapq.heappush(self.victims, (value, name, self.versions[name]))

    def place_bursts(self) -> None:
        """Give each burst big enough for a GPU replica one in a reserved burst slot, never evicting.

        It goes where it was on GPU, else on CPU, else on disk (promoted in place: a move would unload or fetch
        while requests are routed to the old holder), else on the pod carrying the least gold load.
        """
        bursts = sorted(
            (e for e in self.entries.values() if e.burst and not e.gpu and e.demand.rates.m5 >= self.config.gpu_min_rate),
            key=lambda e: -e.demand.rates.m5,
        )
        for e in bursts:
            if not self.budget_allows(e, Tier.GPU):
                continue
            was = self.previous_by_name.get(e.demand.served_name, {})
            candidates = [p for p in self.eligible(e) if self.pool.fits(p, Tier.GPU, e.demand.bytes)]
            if not candidates:
                self.notes[e.demand.served_name] = "burst: no burst slot free"
                continue
            pod = min(candidates, key=lambda p: (was.get(p, Tier.ABSENT).level, self.gold_load[p], self.load[p], p))
            self.add_gpu(e, pod)

    def place_host_tier(self) -> None:
        """Host-memory (CPU tier) slots by traffic: each claim is worth its adapter's score, best first.

        Three kinds of claim compete for the same slots: a CPU replica for an adapter with traffic or a warm
        policy but no GPU replica (``cpu_pod_for``), keeping a revision that leaves a pod's GPU or CPU tier there at
        CPU (demotion instead of a drop: the pod keeps serving requests already routed there, and it is the
        cheapest copy to warm up again; only for demands with ``min_replicas`` > 0), both worth their adapter's
        score, and up to ``host_copies`` CPU copies of each GPU-placed adapter with traffic (``host_copy_pod``),
        worth ``host_copy_worth``. At equal worth a CPU replica comes before a demotion, and a demotion before a
        copy.
        """
        claims: list[tuple[float, int, str, str]] = []  # (-worth, kind, served name, pod or "")
        for e in self.entries.values():
            name = e.demand.served_name
            if not e.gpu and (e.score > 1e-6 or e.demand.warm_policy is not WarmPolicy.ON_DEMAND or e.demand.pinned):
                if not any(t is Tier.CPU for t in self.tiers(e).values()):
                    claims.append((-e.score, _CPU_REPLICA, name, ""))
            if e.gpu and e.score > 1e-6:
                worth = self.host_copy_worth(e)
                claims.extend((-worth, _HOST_COPY, name, "") for _ in range(self.config.host_copies))
            if e.demand.min_replicas > 0:
                hosts = self.staging.hosts(e)
                for pod, tier in self.previous_by_name.get(name, {}).items():
                    if tier in (Tier.GPU, Tier.CPU) and name not in self.pool.held[pod] and pod in hosts:
                        if self.is_eligible(e, pod):
                            claims.append((-e.score, _DEMOTED, name, pod))
        by_use = [(self.pool.slots_used[Tier.CPU][p], p) for p in self.pool.roomy[Tier.CPU]]
        heapq.heapify(by_use)
        for _, kind, name, pod in sorted(claims):
            e = self.entries[name]
            if not self.budget_allows(e, Tier.CPU):
                if kind == _CPU_REPLICA:
                    self.notes.setdefault(name, f"tenant {e.demand.tenant} CPU budget exhausted")
                continue
            if kind == _CPU_REPLICA:
                target = self.cpu_pod_for(e, by_use)
            elif kind == _DEMOTED:
                target = pod if name not in self.pool.held[pod] and self.pool.fits(pod, Tier.CPU, e.demand.bytes) else None
            else:
                target = self.host_copy_pod(e)
            if target is not None:
                self.pool.put(target, name, Tier.CPU, e.demand.bytes)
                self.charge(e, Tier.CPU, +1)
                heapq.heappush(by_use, (self.pool.slots_used[Tier.CPU][target], target))

    def cpu_pod_for(self, e: _Entry, by_use: list[tuple[int, str]]) -> str | None:
        """A pod that already holds it (GPU, CPU, then disk: no fetch) if one has room, else, for a revision no pod
        holds yet, the eligible pod with the fewest CPU adapters; for an idle revision only the staging pods count.

        A held revision is never copied to another pod for its CPU replica: the fetch would cost download time and
        disk space for a host-memory copy, and requests keep going to the holder meanwhile.
        """
        hosts = self.staging.hosts(e)
        holders = [p for p in self.previously(e.demand.served_name, (Tier.GPU, Tier.CPU, Tier.DISK)) if p in hosts]
        if holders:
            was = self.previous_by_name[e.demand.served_name]
            for pod in sorted(holders, key=lambda p: was[p].level):
                if pod in self.pool.roomy[Tier.CPU] and self.is_eligible(e, pod):
                    if self.pool.fits(pod, Tier.CPU, e.demand.bytes):
                        return pod
            return None
        skipped, found = [], None
        while by_use:
            used, pod = heapq.heappop(by_use)
            if used != self.pool.slots_used[Tier.CPU][pod] or pod not in self.pool.roomy[Tier.CPU]:
                continue  # stale entry; a fresh one was pushed when the pod changed
            skipped.append((used, pod))
            if pod in hosts and self.is_eligible(e, pod) and self.pool.fits(pod, Tier.CPU, e.demand.bytes):
                found = pod
                break
        for item in skipped:
            heapq.heappush(by_use, item)
        return found

    def host_copy_worth(self, e: _Entry) -> float:
        """A host copy is worth the traffic that may spill off its adapter's GPU replicas: its steady rate beyond
        what one pod serves for it (``replica_rate``), weighted like its score. A copy of an adapter one pod serves
        takes only the host slots nothing else wants; one of a busier adapter comes before any colder adapter's
        CPU replica or demotion."""
        if e.rate <= 0:  # an idle floor (its score is a tiny positive number, whatever its weight): nothing spills
            return 0.0
        return max(0.0, e.rate - self.config.replica_rate) * e.score / e.rate

    def host_copy_pod(self, e: _Entry) -> str | None:
        """Where ``e``'s next host copy goes, if it has fewer than ``host_copies`` CPU copies: a pod without it that
        held it in the last plan (no fetch) first, then the least loaded; None when it has them or none has room."""
        held = self.tiers(e)
        if sum(tier is Tier.CPU for tier in held.values()) >= self.config.host_copies:
            return None
        was = self.previous_by_name.get(e.demand.served_name, {})
        candidates = [
            p for p in self.pool.roomy[Tier.CPU]
            if p not in held and self.is_eligible(e, p) and self.pool.fits(p, Tier.CPU, e.demand.bytes)
        ]
        return min(candidates, key=lambda p: (p not in was, self.load[p], p), default=None)

    def tiers(self, e: _Entry) -> dict[str, Tier]:
        return dict(self.pool.where.get(e.demand.served_name, {}))

    def disk_order(self, e: _Entry) -> tuple[int, float, str]:
        """Who gets the disk floor first where disks fill up: revisions with real demand (``gpu_min_rate`` or more,
        by score), then idle ones (new revisions: a sweep yet to come), then those with a trickle (by score)."""
        rank = 0 if not is_floor(e, self.config) else 1 if is_idle(e) else 2
        return rank, -e.score, e.demand.served_name

    def spread_holders(self, e: _Entry) -> int:
        """Pods ``e`` is held on for its share of the pool's traffic (``holder_spread``; at most every pod). The
        holders it had stay while its share, raised by ``stickiness``, still asks for them: a share moving a little
        across a step registers and unregisters nothing."""
        traffic = self.traffic
        if self.config.holder_spread <= 0 or e.rate <= 0 or not traffic.contended:
            return 0
        pods = len(self.pool.caps)
        asked = self.config.holder_spread * e.rate / traffic.rate * pods
        held = len(self.previous_by_name.get(e.demand.served_name, ()))
        wanted = max(math.ceil(asked - 1e-9), min(held, math.ceil(asked * (1.0 + self.config.stickiness) - 1e-9)))
        return min(pods, self.config.max_spread_holders, wanted)

    @staticmethod
    def disk_candidates(order: list[tuple[int, str]], counts: Mapping[str, int], previous: Collection[str],
                        wanted: int, eligible: Callable[[str], bool]) -> list[tuple[int, str]]:
        """Up to ``wanted`` (revisions held, pod) of the ``eligible`` pods: those that held it before first, then
        the rest; each by (revisions held, name)."""
        if wanted <= 0:
            return []
        candidates = sorted((counts[p], p) for p in previous if eligible(p))[:wanted]
        if len(candidates) < wanted:
            for n, p in order:
                if p not in previous and eligible(p):
                    candidates.append((n, p))
                    if len(candidates) == wanted:
                        break
        return candidates

    def place_disk(self) -> None:
        """Every demand on at least ``min_replicas`` pods where disk caches have room, on ``traffic_holders`` while
        every pod stages (a second holder for the picker when the first has no GPU slot free) and on more for its
        share of the traffic (``spread_holders``): fill up with the disk tier (an idle revision on the staging pods
        only; where it was before, else on the pod holding the fewest): revisions with real demand first, then idle
        ones (a sweep yet to come), then trickles. Where the disks cannot hold ``traffic_holders`` of every revision
        (``disks_hold_holders``: a sweep of more than a thousand), every idle revision's and trickle's floor comes
        before any of their further holders: a revision held nowhere waits for a fetch on its first request, a
        missing further holder only spreads less. A revision no disk has room for is left to be fetched on its first
        request.

        A part placed again alone (``PoolTraffic.part``: a few revisions whose rates moved) competes only for the
        room its own revisions' holders leave, so by this order a revision whose traffic just started (a trickle of
        a few requests) would hand its further holders to one whose traffic ended minutes ago (more requests in the
        hour): two unregistrations and two registrations, each a load into a GPU slot that stalls the pod's batch,
        for a revision nobody asks for. There each keeps the holders it had before any takes a further one; holders
        move between revisions in whole plans only, by the whole pool's order."""
        counts = {pod: len(held) for pod, held in self.pool.held.items()}
        every_pod_stages = not self.staging.apart
        # every pod by (revisions held, name), kept in order as revisions are placed: the candidates of a revision
        # are the first that qualify, found without sorting the pool for each of (10,000) revisions
        order = sorted((n, pod) for pod, n in counts.items())
        entries = sorted(self.entries.values(), key=self.disk_order)
        defer = self.deferred = every_pod_stages and not self.disks_hold_holders(entries)
        later = []
        for e in entries:
            floor = e.demand.min_replicas
            wanted, spread = floor, 0
            if floor > 0 and every_pod_stages and (e.rate > 0 or not e.demand.required):  # not a rollout's
                if defer and is_floor(e, self.config):
                    later.append(e)
                else:
                    wanted, spread = max(floor, self.config.traffic_holders), self.spread_holders(e)
            if floor and not self.hold_on_disk(e, wanted, spread, order, counts):
                # held nowhere: that is the reason to give, over any earlier note
                eligible = self.disk_eligible(e, ())
                self.notes[e.demand.served_name] = ("no disk room" if any(map(eligible, self.pool.caps))
                                                    else "no eligible pod")
        for e in later if self.traffic.part else ():  # a part: each keeps its holders first (above)
            self.hold_on_disk(e, max(e.demand.min_replicas, self.config.traffic_holders), self.spread_holders(e),
                              order, counts, only_previous=True)
        for e in later:
            self.hold_on_disk(e, max(e.demand.min_replicas, self.config.traffic_holders), self.spread_holders(e),
                              order, counts)

    def disks_hold_holders(self, entries: Iterable[_Entry]) -> bool:
        """Whether the pool's free disk bytes hold ``traffic_holders`` copies of every revision (as far as it is not
        held already): then each gets them in one go, in the disk order, as it always did."""
        caps, used = self.pool.caps, self.pool.disk_used
        if any(cap.disk_bytes is None for cap in caps.values()):
            return True
        free = sum(max(0, (cap.disk_bytes or 0) - used[pod]) for pod, cap in caps.items())
        holders, where = self.config.traffic_holders, self.pool.where
        need = sum(max(0, max(holders, e.demand.min_replicas) - len(where.get(e.demand.served_name, ())))
                   * e.demand.bytes for e in entries if e.demand.min_replicas)
        return need <= free

    def disk_eligible(self, e: _Entry, placed: Collection[str]) -> Callable[[str], bool]:
        """Whether a pod may hold ``e`` on disk besides those in ``placed`` (room aside)."""
        caps, hosts, allowed = self.pool.caps, self.staging.hosts(e), e.demand.eligible  # an idle revision: staging pods only

        def eligible(p: str) -> bool:
            return p in caps and p not in placed and p in hosts and (allowed is None or p in allowed)

        return eligible

    def hold_on_disk(self, e: _Entry, wanted: int, spread: int, order: list[tuple[int, str]],
                     counts: dict[str, int], only_previous: bool = False) -> dict[str, Tier]:
        """``e`` on ``wanted`` pods at least (on disk where it is held nowhere warmer), and on ``spread`` where the
        further ones have GPU slots free; ``order`` and ``counts`` follow what is placed; ``only_previous``: on pods
        that held it in the previous plan only. Returns its holders."""
        placed = self.tiers(e)
        missing = wanted - len(placed)
        # holders beyond ``wanted`` for its share of the traffic, on pods the plan leaves GPU slots free
        extra = spread - max(wanted, len(placed))
        if missing <= 0 and extra <= 0:
            return placed
        previous = set(self.previously(e.demand.served_name, (Tier.GPU, Tier.CPU, Tier.DISK)))
        eligible, size, fits = self.disk_eligible(e, placed), e.demand.bytes, self.pool.fits

        def room(p: str) -> bool:
            return eligible(p) and fits(p, Tier.DISK, size) and (not only_previous or p in previous)

        candidates = self.disk_candidates(order, counts, previous, missing, room)
        if extra > 0:
            taken, gpu_room = {p for _, p in candidates}, self.pool.roomy[Tier.GPU]

            def spare(p: str) -> bool:
                return p in gpu_room and p not in taken and room(p)

            candidates += self.disk_candidates(order, counts, previous, extra, spare)
        for n, pod in candidates:
            self.pool.put(pod, e.demand.served_name, Tier.DISK, size)
            placed[pod] = Tier.DISK
            del order[bisect.bisect_left(order, (n, pod))]
            bisect.insort(order, (n + 1, pod))
            counts[pod] = n + 1
        return placed

    def run(self) -> Placement:
        self.place_required()
        self.keep_previous_gpu()
        self.add_gpu_replicas()
        self.spread_load()
        self.place_bursts()
        self.place_host_tier()
        self.place_disk()
        pods = {pod: dict(sorted(held.items())) for pod, held in sorted(self.pool.held.items())}
        return Placement(pods=pods, notes=self.notes, staging=self.staging.routed, deferred=self.deferred)


def place(
    pods: Iterable[PodCapacity],
    demands: Iterable[AdapterDemand],
    previous: Placement | None = None,
    budgets: Mapping[str, TenantBudget] | None = None,
    config: PlacementConfig | None = None,
    traffic: PoolTraffic | None = None,
) -> Placement:
    """Plan which served revisions each pod holds at which tier (pure; see the module docstring). ``traffic``: the
    whole pool's when ``pods`` and ``demands`` are part of it (planned alone), else theirs."""
    return _Planner(pods, demands, previous, budgets or {}, config or PlacementConfig(), traffic).run()


#: relative rate change (each window) below which an adapter's rates are taken as unchanged
DEFAULT_HYSTERESIS = 0.25
#: absolute rate change (requests/s) below which a change never counts (a trickle moving by a few per cent)
RATE_FLOOR = 0.01
#: seconds between two full plans of a pool at rest
DEFAULT_FULL_PLAN_SECONDS = 60.0
#: at most this share of a pool's revisions (at least 8) moving beyond the hysteresis is placed again alone; more
#: plans the pool whole, as do more floor revisions (``plans_as_floor``) placed again alone since the last whole plan
#: where it deferred their further holders (``Placement.deferred``)
DELTA_SHARE = 0.02


def rate_moved(old: float, new: float, hysteresis: float) -> bool:
    """Did a rate move beyond ``hysteresis`` (relative) and ``RATE_FLOOR`` (absolute), appearing or going quiet
    included? Rates drift by a few per cent all the time, and a placement that follows every drift churns GPU
    slots."""
    change = abs(new - old)
    return change > RATE_FLOOR and change > hysteresis * max(old, new)


def few_enough(moved: int, revisions: int) -> bool:
    """May ``moved`` of a pool's ``revisions`` be placed again alone (``place_again``) rather than the pool whole?"""
    return moved <= max(8, revisions * DELTA_SHARE)


def place_again(before: Placement, capacity: Sequence[PodCapacity], demands: Sequence[AdapterDemand],
                changed: Mapping[str, AdapterDemand], again: Collection[str], config: PlacementConfig,
                unknown_bytes: int, keep_reserve: bool = False) -> tuple[Placement, list[AdapterDemand]]:
    """``before`` with the ``changed`` demands placed again alone, on what the revisions not placed ``again`` (a
    superset of ``changed``: those leaving the plan too) leave of each pod (their replicas, slots and bytes kept
    as they are), and merged; with the pool's demands now. ``unknown_bytes``: the size of a held revision
    ``demands`` does not name. ``keep_reserve``: the pods' burst reserves stay free of their steady replicas, as in
    a whole plan (for revisions placed again at the rates they were placed with: otherwise a part took the slots a
    whole plan keeps for bursts, an adapter at 16 requests/s got 4 GPU replicas where the whole plan gives 2, and
    the next whole plan took them back, two registrations each); else they may take them (new revisions, rates
    that moved: the reserve's slots serve them until the next whole plan re-balances)."""
    by_name = {d.served_name: d for d in demands}
    rest = {pod: {n: t for n, t in held.items() if n not in again} for pod, held in before.pods.items()}

    def size(names: Iterable[str]) -> int:
        return sum(by_name[n].bytes if n in by_name else unknown_bytes for n in names)

    residual = []
    for cap in capacity:
        held = rest.get(cap.name, {})
        gpu = [n for n, t in held.items() if t is Tier.GPU]
        cpu = [n for n, t in held.items() if t is Tier.CPU]
        # the pod's burst reserve, less the reserved slots the others fill
        reserve = burst_reserve(cap, config)
        left = max(0, reserve - max(0, len(gpu) - (cap.gpu_slots - reserve))) if keep_reserve else None
        residual.append(PodCapacity(
            cap.name, max(0, cap.gpu_slots - len(gpu)), max(0, cap.cpu_slots - len(cpu)),
            None if cap.gpu_bytes is None else max(0, cap.gpu_bytes - size(gpu)),
            None if cap.cpu_bytes is None else max(0, cap.cpu_bytes - size(cpu)),
            None if cap.disk_bytes is None else max(0, cap.disk_bytes - size(held)),
            gpu_reserve=left))
    previous = Placement(pods={pod: {n: t for n, t in held.items() if n in changed}
                               for pod, held in before.pods.items()})
    all_demands = [changed.get(n, d) for d in demands if (n := d.served_name) not in again or n in changed]
    all_demands += [d for n, d in changed.items() if n not in by_name]
    traffic = PoolTraffic.of_demands(capacity, all_demands, config)
    local = place(residual, list(changed.values()), previous, {}, config, traffic)
    merged = {pod: {**rest.get(pod, {}), **local.pods.get(pod, {})} for pod in before.pods.keys() | local.pods.keys()}
    notes = {**{n: why for n, why in before.notes.items() if n not in again}, **local.notes}
    holds = frozenset(h for h in before.holds if h[0] not in again)
    return Placement(pods=merged, notes=notes, staging=before.staging, deferred=before.deferred,
                     holds=holds), all_demands


def gpu_loads(previous: Placement, new: Placement) -> int:
    """How many (pod, served name) GPU replicas ``new`` adds that ``previous`` did not have: the churn."""
    before = previous.replicas(Tier.GPU)
    return sum(len(pods - before.get(name, set())) for name, pods in new.replicas(Tier.GPU).items())


def minimum_gpu_loads(previous: Placement, ideal: Placement) -> int:
    """The fewest GPU loads any placement with ``ideal``'s replica count per adapter needs, starting from ``previous``."""
    before = previous.replicas(Tier.GPU)
    return sum(max(0, len(pods) - len(before.get(name, set()))) for name, pods in ideal.replicas(Tier.GPU).items())


def keep_until_replaced(placement: Placement, demands: Iterable[AdapterDemand],
                        serving: Mapping[str, Iterable[str]], keeps_on_disk: Collection[str] = frozenset()) -> Placement:
    """Make before break: a routed revision (``min_replicas`` > 0) the plan moves stays on the pods that serve it now
    (``serving``: served name -> pods where a request for it is served now) until a pod the plan keeps serving it
    serves it too; otherwise requests routed in between would find it on no pod (404).

    The plan keeps a pod serving a revision at GPU or CPU, and at disk on the pods in ``keeps_on_disk`` (their runtime
    keeps a disk-tier revision registered and reads it back on a request: ``ResidencyReport.demotes_to_disk``); a
    kept revision stays at disk on those pods and at CPU on the others (where a disk target would unload it)."""
    pods = {pod: dict(held) for pod, held in placement.pods.items()}
    demands = list(demands)
    names = {d.served_name for d in demands}
    planned_serving: dict[str, set[str]] = {}
    for pod, tiers in pods.items():
        for name, tier in tiers.items():
            if name in names and (tier in (Tier.GPU, Tier.CPU) or (tier is Tier.DISK and pod in keeps_on_disk)):
                planned_serving.setdefault(name, set()).add(pod)
    holds = {h for h in placement.holds if h[0] not in names}
    for demand in demands:
        now = set(serving.get(demand.served_name, ())) & pods.keys()
        if demand.min_replicas and now and not now & planned_serving.get(demand.served_name, set()):
            for pod in now:
                pods[pod][demand.served_name] = Tier.DISK if pod in keeps_on_disk else Tier.CPU
                holds.add((demand.served_name, pod))
    return replace(placement, pods=pods, holds=frozenset(holds))
