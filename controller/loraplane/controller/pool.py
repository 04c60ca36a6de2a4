"""One pool's reconcile as a pure function: revisions + reports + rates + counters -> statuses, targets, routes.

``plan_pool`` runs the rollout state machine for every logical adapter of the pool, turns what each revision
needs into placement demands, runs placement (every placement rule lives in ``placement``), writes the rollout's
outcomes and placement's notes into the statuses once (``write_outcome``), and builds every fresh pod's
``TargetState`` adapters and the pool's route entries. Its outcome is keyed by object, ``(namespace, name)`` as the informers key them. The controller feeds it from the API server and Redis and writes back what changed; the
benchmark feeds it synthetic pools.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from loraplane.api import (
    AdapterRevision,
    AdapterRevisionStatus,
    AdapterTarget,
    PickerCounters,
    RequestRates,
    ResidencyReport,
    RevisionCounters,
    RouteEntry,
    TargetState,
)
from loraplane.api.runtime import AdapterResidency, Tier
from loraplane.controller.placement import (
    AdapterDemand,
    Placement,
    PlacementConfig,
    PodCapacity,
    Rates,
    TenantBudget,
    host_slots,
    keep_until_replaced,
    place,
)
from loraplane.controller.rollout import (
    ROLLOUT_PHASES,
    AdapterPlan,
    AdapterReconcile,
    Event,
    Observation,
    PodObservation,
    ProbeRequest,
    ProbeResult,
    RevisionPlan,
    write_outcome,
)
from loraplane.kube import Key

#: Adapter size assumed when neither a sidecar nor the artifact says (64 MiB: a rank-16 adapter of an 8B model).
DEFAULT_ADAPTER_BYTES = 64 << 20


@dataclass(frozen=True)
class PoolInputs:
    """Everything one reconcile of one pool reads."""

    pool: str
    now: datetime
    revisions: Sequence[AdapterRevision]
    #: fresh reports of the pool's member pods
    reports: Sequence[ResidencyReport]
    rates: RequestRates | None = None
    counters: Sequence[PickerCounters] = ()
    #: pod -> the target state the controller last wrote
    previous_targets: Mapping[str, TargetState] = field(default_factory=dict)
    probes: Mapping[tuple[str, str], ProbeResult] = field(default_factory=dict)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    budgets: Mapping[str, TenantBudget] = field(default_factory=dict)


@dataclass
class PoolPlan:
    """What the pool should look like: per-adapter rollout outcomes, each fresh pod's targets, the routes."""

    adapters: dict[tuple[str, str], AdapterPlan]
    targets: dict[str, list[AdapterTarget]]
    routes: dict[str, RouteEntry]
    placement: Placement
    base_model: str | None
    #: what placement was given (so a caller can compare with a from-scratch plan)
    capacity: list[PodCapacity] = field(default_factory=list)
    demands: list[AdapterDemand] = field(default_factory=list)
    #: (namespace, name) of each AdapterRevision -> its plan
    revisions: dict[Key, RevisionPlan] = field(default_factory=dict)
    #: the events to post and the probes to send, each with the object it is about
    events: list[tuple[Key, Event]] = field(default_factory=list)
    probes: list[tuple[Key, ProbeRequest]] = field(default_factory=list)
    #: the earliest time a timed gate of the pool is due (reconcile again then)
    next_due: datetime | None = None
    #: probe results to forget, keyed (served name, pod) (``AdapterPlan.discarded_probes``)
    discarded_probes: list[tuple[tuple[str, str], ProbeResult]] = field(default_factory=list)


def summed_counters(counters: Sequence[PickerCounters]) -> dict[str, RevisionCounters]:
    """Served name -> counters summed over every picker replica."""
    total: dict[str, RevisionCounters] = {}
    for replica in counters:
        for name, c in replica.revisions.items():
            t = total.setdefault(name, RevisionCounters())
            t.requests += c.requests
            t.errors += c.errors
            t.ttft_seconds_sum += c.ttft_seconds_sum
            t.ttft_count += c.ttft_count
    return total


def _rates_by_adapter(rates: RequestRates | None, revisions: Sequence[AdapterRevision]) -> dict[str, Rates]:
    """Logical adapter -> its rates over all its revisions (a canary's traffic is the adapter's traffic)."""
    if rates is None:
        return {}
    adapter_of = {r.served_name: r.spec.adapter for r in revisions}
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for i, window in enumerate(("5m", "1h", "24h")):
        for served, rate in rates.windows.get(window, {}).items():  # type: ignore[call-overload]
            if served in adapter_of:
                sums[adapter_of[served]][i] += rate
    return {a: Rates(*v) for a, v in sums.items()}


def _observation(inputs: PoolInputs) -> Observation:
    pods = [
        PodObservation(
            name=r.pod,
            address=r.address,
            ready=r.ready,
            base_model_digest=r.base_model_digest,
            max_lora_rank=r.max_lora_rank,
            adapters=r.by_name(),
            gpu_slots=canary_gpu_slots(r),
            reported_at=datetime.fromtimestamp(r.heartbeat_at, UTC),
        )
        for r in inputs.reports
    ]
    return Observation(now=inputs.now, pods=pods, counters=summed_counters(inputs.counters), probes=inputs.probes)


def _waiting_since(revisions: Sequence[AdapterRevision], now: datetime) -> datetime:
    """Since when the adapter's rollout waits in its phase (``now`` when none is rolling out)."""
    return min((r.status.phase_since or now for r in revisions if r.status.phase in ROLLOUT_PHASES), default=now)


def _reported_bytes(reports: Sequence[ResidencyReport], names: Collection[str] | None = None) -> dict[str, int]:
    """Served name (of ``names``; None: every one) -> the largest size any sidecar reports for it."""
    sizes: dict[str, int] = {}
    for report in reports:
        for a in report.adapters:
            if a.bytes > sizes.get(a.served_name, 0) and (names is None or a.served_name in names):
                sizes[a.served_name] = a.bytes
    return sizes


#: (id of a revision, tier, cache key) -> (that revision, its target): a revision unchanged from plan to plan keeps
#: its target objects (10,000 revisions' targets are not validated again each plan, and compare by identity)
_TARGETS: dict[tuple[int, Tier, str | None, bool], tuple[AdapterRevision, AdapterTarget]] = {}
_TARGETS_KEPT = 1 << 17


def clear_target_cache() -> None:
    """Forget every cached target (a process that plans other pools from now on: the benchmark's second half)."""
    _TARGETS.clear()


def _target(rev: AdapterRevision, status: AdapterRevisionStatus, tier: Tier) -> AdapterTarget:
    key = (id(rev), tier, status.cache_key, status.phase in ROLLOUT_PHASES)
    hit = _TARGETS.get(key)
    if hit is not None and hit[0] is rev:
        return hit[1]
    if len(_TARGETS) >= _TARGETS_KEPT:
        _TARGETS.clear()
    target = _TARGETS[key] = (rev, _new_target(rev, status, tier))
    return target[1]


def _new_target(rev: AdapterRevision, status: AdapterRevisionStatus, tier: Tier) -> AdapterTarget:
    return AdapterTarget(
        served_name=rev.served_name,
        adapter=rev.spec.adapter,
        revision=rev.spec.revision,
        tier=tier,
        pinned=rev.spec.pinned and tier is Tier.GPU,
        hold=status.phase in ROLLOUT_PHASES,  # its canary pods' tiers are what the rollout's gates read
        artifact=rev.spec.artifact,
        lora=rev.spec.lora,
        base_model_digest=rev.spec.base_model.digest,
        cache_key=status.cache_key or "",
        tenant=rev.spec.tenant,
        priority=rev.spec.priority_class.priority,
    )


def serving_holders(reports: Sequence[ResidencyReport], names: Collection[str] | None = None) -> dict[str, set[str]]:
    """Served name (of ``names``; None: every one) -> the pods serving it now: those reporting it at GPU or CPU, and
    those whose runtime keeps disk-tier revisions registered (``demotes_to_disk``) reporting it registered at disk."""
    serving: dict[str, set[str]] = defaultdict(set)
    for report in reports:
        for held in report.adapters:
            if names is not None and held.served_name not in names:
                continue
            if serves(report, held):
                serving[held.served_name].add(report.pod)
    return serving


def serves(report: ResidencyReport, held: AdapterResidency) -> bool:
    """Does ``report``'s pod serve ``held`` now: at GPU or CPU, or registered at disk where its runtime keeps
    disk-tier revisions registered (``demotes_to_disk``)?"""
    return held.tier in (Tier.GPU, Tier.CPU) or (report.demotes_to_disk and held.tier is Tier.DISK
                                                 and bool(held.registered))


def pod_capacity(report: ResidencyReport) -> PodCapacity:
    """What a pod can hold, from its report. The runtime's host cache holds its GPU-resident adapters too (vLLM's
    ``--max-cpu-loras`` counts them; so does the engine's), so only the slots beyond the GPU ones are planned for
    host-tier revisions (``host_slots``): planning more would have vLLM's LRU drop host copies the plan counts on,
    and the engine's sidecar (``demotes_to_disk``) clip the extra ones to disk by name, ahead of the plan's own
    order (rollout requirements first), so a canary clipped so waits forever."""
    load = report.load
    cpu_slots = host_slots(load.max_cpu_slots, load.max_gpu_slots)
    return PodCapacity(report.pod, load.max_gpu_slots, cpu_slots, load.max_gpu_bytes, load.max_cpu_bytes,
                       load.max_disk_bytes)


def canary_gpu_slots(report: ResidencyReport) -> int:
    """GPU slots the revisions between Activating and Canary may hold on a pod (admission into Activating): its
    runtime's, less the landing slot a sidecar whose loads activate keeps free of GPU-tier targets (vLLM: every load
    takes a GPU slot, so only ``max_loras - 1`` GPU-tier targets are kept from LRU), at least one."""
    slots = report.load.max_gpu_slots
    return max(1, slots - 1) if report.loads_activate and slots > 1 else slots


def fit_to_sidecars(placement: Placement, planned: Placement, reports: Sequence[ResidencyReport],
                    demands: Sequence[AdapterDemand], serving: Mapping[str, set[str]]) -> Placement:
    """Each pod's targets cut to what its sidecar holds, choosing here what gives way, so that the sidecar never
    clips them by its own order (pinned, priority, name), which knows nothing of rollout gates.

    ``placement`` is ``planned`` (``place``'s plan, which fits the slots ``pod_capacity`` gives) after
    ``keep_until_replaced``, whose make-before-break holds take host slots beyond it on a pod whose runtime unloads
    a disk-tier revision (vLLM). There the sidecar would clip the extra ones to disk, i.e. unload them, by its own
    order: a canary between its activation and its probe among them (its probe then gets the runtime's 404). Here:

    - GPU, on a pod whose loads activate (``loads_activate``) and that has host-tier targets (or disk-tier ones its
      runtime keeps registered, ``demotes_to_disk``: vLLM's sidecar registers them, and loading or serving one takes
      a GPU slot too): at most ``max_gpu_slots - 1`` GPU-tier targets (the sidecar keeps the last slot free for
      loads); the last the plan placed that no rollout requires go to CPU.
    - Host (GPU + CPU tiers, ``max(max_cpu_slots, max_gpu_slots)`` as the sidecar counts them), on a pod that does
      not keep disk-tier revisions registered, and one fewer on a pod whose loads activate and that registers its
      disk-tier targets, while it has any (each load of one, and each request for one, makes a host copy: the
      sidecar leaves one copy free of host-tier targets for it; disk-tier registrations take no host slot
      themselves): no rollout requirement gives way. First to go (to disk) are the
      plan's entries the pod does not serve yet (a load not made: nothing routed there is lost), then those whose
      revision another pod serves now and keeps serving in the plan, then the make-before-break holds (the latest
      first: their revision's traffic has no pod until its new one serves it), then the plan's other entries;
      within each, the last placed first. (Both cuts are ``Reconciler.within_capacity``'s, in the plan's order.)
    """
    required = {d.served_name: d.required for d in demands}
    pods = {pod: dict(held) for pod, held in placement.pods.items()}
    notes = dict(placement.notes)
    warm = (Tier.GPU, Tier.CPU)
    for report in reports:
        held = pods.get(report.pod)
        if held is None:
            continue
        pod, load = report.pod, report.load
        before = planned.pods.get(pod, {})
        kept = [n for n, t in held.items() if t in warm and before.get(n) is not t]

        def needed(name: str, pod: str = pod) -> bool:
            return pod in required.get(name, {})

        gpu = [n for n, t in held.items() if t is Tier.GPU]
        excess = len(gpu) - (load.max_gpu_slots - 1)
        # disk-tier targets its sidecar registers (vLLM): they load and are served through the landing slot too
        on_disk = report.loads_activate and report.demotes_to_disk and any(t is Tier.DISK for t in held.values())
        if report.loads_activate and excess > 0 and (on_disk or any(t is Tier.CPU for t in held.values())):
            for name in [n for n in reversed(gpu) if not needed(n)][:excess]:
                held[name] = Tier.CPU
                notes.setdefault(name, f"pod {pod} keeps a GPU slot free for loads (its runtime's loads activate)")
        if report.demotes_to_disk and not on_disk:
            continue
        host = [n for n, t in held.items() if t in warm]
        over = len(host) - (max(load.max_cpu_slots, load.max_gpu_slots) - (1 if on_disk else 0))
        if over <= 0:
            continue

        def served_elsewhere(name: str, pod: str = pod) -> bool:
            return any(p != pod and pods[p].get(name) in warm for p in serving.get(name, ()) if p in pods)

        own = [n for n in reversed(host) if n not in kept and not needed(n)]
        new = [n for n in own if pod not in serving.get(n, ())]
        elsewhere = [n for n in own if n not in new and served_elsewhere(n)]
        rest = [n for n in own if n not in new and n not in elsewhere]
        for name in [*new, *elsewhere, *reversed(kept), *rest][:over]:
            held[name] = Tier.DISK
            if name not in kept:
                notes.setdefault(name, f"pod {pod} has no host slot left for it")
    return replace(placement, pods=pods, notes=notes)


def plan_pool(inputs: PoolInputs) -> PoolPlan:
    """Reconcile one pool (pure; see the module docstring)."""
    groups = adapter_groups(inputs.revisions)
    observation = _observation(inputs)
    adapters = decide(inputs, groups, observation)
    demands, by_served = adapter_demands(inputs, groups, adapters)
    pods = [pod_capacity(r) for r in inputs.reports if r.ready]
    previous = Placement(pods={pod: {a.served_name: a.tier for a in t.adapters} for pod, t in inputs.previous_targets.items()})
    planned = place(pods, demands, previous, inputs.budgets, inputs.placement)
    serving = serving_holders(inputs.reports)
    placement = keep_until_replaced(planned, demands, serving, {r.pod for r in inputs.reports if r.demotes_to_disk})
    placement = fit_to_sidecars(placement, planned, [r for r in inputs.reports if r.ready], demands, serving)
    write_outcome(adapters.values(), placement.notes, inputs.now)
    targets = {
        pod: [_target(*by_served[name], tier) for name, tier in held.items() if tier is not Tier.ABSENT]
        for pod, held in placement.pods.items()
    }
    routes = {adapter: outcome.route for (_, adapter), outcome in adapters.items() if outcome.route is not None}
    plan = PoolPlan(adapters=adapters, targets=targets, routes=routes, placement=placement, base_model=None,
                    capacity=pods, demands=demands)
    collect(plan, inputs.revisions)
    return plan


def adapter_groups(revisions: Iterable[AdapterRevision]) -> dict[tuple[str, str], list[AdapterRevision]]:
    """The revisions by logical adapter, ``(namespace, adapter)``."""
    groups: dict[tuple[str, str], list[AdapterRevision]] = defaultdict(list)
    for rev in revisions:
        groups[(rev.metadata.namespace or "default", rev.spec.adapter)].append(rev)
    return groups


def decide(inputs: PoolInputs, groups: Mapping[tuple[str, str], list[AdapterRevision]],
           observation: Observation) -> dict[tuple[str, str], AdapterPlan]:
    """Run the rollout of each adapter of ``groups``: their outcomes, in ``groups``' order sorted (their ``Ready`` and
    ``Placed`` conditions wait for placement: ``write_outcome``)."""
    observation.hold_gpu_slots(inputs.revisions)  # every canary's GPU slot, before any adapter is admitted
    reconciles = {key: AdapterReconcile(revs, observation) for key, revs in sorted(groups.items())}
    # the longest-waiting rollout first: admission into Activating (free canary GPU slots) is first come, first served
    adapters = {key: reconciles[key].decide()
                for key in sorted(reconciles, key=lambda k: (_waiting_since(groups[k], inputs.now), k))}
    return {key: adapters[key] for key in reconciles}


def adapter_demands(inputs: PoolInputs, groups: Mapping[tuple[str, str], list[AdapterRevision]],
                    adapters: Mapping[tuple[str, str], AdapterPlan],
                    ) -> tuple[list[AdapterDemand], dict[str, tuple[AdapterRevision, AdapterRevisionStatus]]]:
    """What placement must hold for each placed revision of ``adapters``, and served name -> (revision, status)."""
    revisions = [rev for key in adapters for rev in groups[key]]
    rates = _rates_by_adapter(inputs.rates, revisions)
    sizes = _reported_bytes(inputs.reports, {rev.served_name for rev in revisions})
    by_served: dict[str, tuple[AdapterRevision, AdapterRevisionStatus]] = {}
    demands = []
    for key, outcome in adapters.items():
        for rev in groups[key]:
            rp = outcome.revisions[rev.metadata.name]
            if not rp.placed:
                continue
            by_served[rp.served_name] = (rev, rp.status)
            demands.append(
                AdapterDemand(
                    served_name=rp.served_name,
                    bytes=sizes.get(rp.served_name) or rev.spec.artifact.size_bytes or DEFAULT_ADAPTER_BYTES,
                    rates=rates.get(rev.spec.adapter, Rates()).scaled(rp.rate_share),
                    tenant=rev.spec.tenant,
                    priority=rev.spec.priority_class.priority,
                    warm_policy=rp.warm_policy,
                    pinned=rev.spec.pinned and rp.rate_share > 0,
                    required=rp.required,
                    eligible=rp.eligible,
                    min_replicas=1 if rp.rate_share > 0 else 0,
                )
            )
    return demands, by_served


def collect(plan: PoolPlan, revisions: Sequence[AdapterRevision],
            part: Collection[tuple[str, str]] | None = None, before: PoolPlan | None = None) -> None:
    """Fill ``plan``'s per-object outcomes, events and probes from its adapters, its base model and its next due
    time. For a plan of a ``part`` of the adapters made on ``before``: the objects of the others are ``before``'s
    (not walked again), and only the part's adapters contribute events and probes."""
    plan.events, plan.probes, plan.discarded_probes = [], [], []
    if part is None or before is None:
        plan.revisions = {}
        walked: Collection[tuple[str, str]] = plan.adapters.keys()
    else:
        plan.revisions = dict(before.revisions)
        for key in part:
            if (old := before.adapters.get(key)) is not None:
                for name in old.revisions:
                    plan.revisions.pop((key[0], name), None)
        walked = [key for key in part if key in plan.adapters]
    for key in walked:
        outcome = plan.adapters[key]
        namespace = key[0]
        plan.revisions.update({(namespace, name): rp for name, rp in outcome.revisions.items()})
        plan.events.extend(((namespace, e.object_name), e) for e in outcome.events)
        name_of = {rp.served_name: name for name, rp in outcome.revisions.items()}
        plan.probes.extend(((namespace, name_of[p.served_name]), p) for p in outcome.probes)
        plan.discarded_probes.extend(outcome.discarded_probes)
    plan.base_model = next((r.spec.base_model.name for r in revisions if r.spec.adapter in plan.routes), None)
    plan.next_due = min((o.next_due for o in plan.adapters.values() if o.next_due is not None), default=None)
