"""One pool's reconcile as a pure function: revisions + reports + rates + counters -> statuses, targets, routes.

``plan_pool`` runs the rollout state machine for every logical adapter of the pool, turns what each revision
needs into placement demands, runs placement (every placement rule lives in ``placement``), lets the rollout
finish its conditions with placement's notes, and builds every fresh pod's ``TargetState`` adapters and the
pool's route entries. Its outcome is keyed by object, ``(namespace, name)`` as the informers key them. The controller feeds it from the API server and Redis and writes back what changed; the
benchmark feeds it synthetic pools.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

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
from loraplane.api.runtime import Tier
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
            gpu_slots=r.load.max_gpu_slots,
        )
        for r in inputs.reports
    ]
    return Observation(now=inputs.now, pods=pods, counters=summed_counters(inputs.counters), probes=inputs.probes)


def _waiting_since(revisions: Sequence[AdapterRevision], now: datetime) -> datetime:
    """Since when the adapter's rollout waits in its phase (``now`` when none is rolling out)."""
    return min((r.status.phase_since or now for r in revisions if r.status.phase in ROLLOUT_PHASES), default=now)


def _reported_bytes(reports: Sequence[ResidencyReport]) -> dict[str, int]:
    """Served name -> the largest size any sidecar reports for it."""
    sizes: dict[str, int] = {}
    for report in reports:
        for a in report.adapters:
            if a.bytes > sizes.get(a.served_name, 0):
                sizes[a.served_name] = a.bytes
    return sizes


def _target(rev: AdapterRevision, status: AdapterRevisionStatus, tier: Tier) -> AdapterTarget:
    return AdapterTarget(
        served_name=rev.served_name,
        adapter=rev.spec.adapter,
        revision=rev.spec.revision,
        tier=tier,
        pinned=rev.spec.pinned and tier is Tier.GPU,
        artifact=rev.spec.artifact,
        lora=rev.spec.lora,
        base_model_digest=rev.spec.base_model.digest,
        cache_key=status.cache_key or "",
        tenant=rev.spec.tenant,
        priority=rev.spec.priority_class.priority,
    )


def serving_holders(reports: Sequence[ResidencyReport]) -> dict[str, set[str]]:
    """Served name -> the pods serving it now: those reporting it at GPU or CPU, and those whose runtime keeps
    disk-tier revisions registered (``demotes_to_disk``) reporting it registered at disk."""
    serving: dict[str, set[str]] = defaultdict(set)
    for report in reports:
        for held in report.adapters:
            if held.tier in (Tier.GPU, Tier.CPU) or (report.demotes_to_disk and held.tier is Tier.DISK and held.registered):
                serving[held.served_name].add(report.pod)
    return serving


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


def plan_pool(inputs: PoolInputs) -> PoolPlan:
    """Reconcile one pool (pure; see the module docstring)."""
    observation = _observation(inputs)
    groups: dict[tuple[str, str], list[AdapterRevision]] = defaultdict(list)
    for rev in inputs.revisions:
        groups[(rev.metadata.namespace or "default", rev.spec.adapter)].append(rev)
    observation.hold_gpu_slots(inputs.revisions)  # every canary's GPU slot, before any adapter is admitted
    reconciles = {key: AdapterReconcile(revs, observation) for key, revs in sorted(groups.items())}
    # the longest-waiting rollout first: admission into Activating (free canary GPU slots) is first come, first served
    adapters = {key: reconciles[key].decide()
                for key in sorted(reconciles, key=lambda k: (_waiting_since(groups[k], inputs.now), k))}
    adapters = {key: adapters[key] for key in reconciles}

    rates = _rates_by_adapter(inputs.rates, inputs.revisions)
    sizes = _reported_bytes(inputs.reports)
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

    pods = [pod_capacity(r) for r in inputs.reports if r.ready]
    previous = Placement(pods={pod: {a.served_name: a.tier for a in t.adapters} for pod, t in inputs.previous_targets.items()})
    placement = keep_until_replaced(place(pods, demands, previous, inputs.budgets, inputs.placement), demands,
                                    serving_holders(inputs.reports), {r.pod for r in inputs.reports if r.demotes_to_disk})
    for reconcile in reconciles.values():
        reconcile.finish(placement.notes)
    targets = {
        pod: [_target(*by_served[name], tier) for name, tier in held.items() if tier is not Tier.ABSENT]
        for pod, held in placement.pods.items()
    }
    routes = {adapter: outcome.route for (_, adapter), outcome in adapters.items() if outcome.route is not None}
    base_model = next((r.spec.base_model.name for r in inputs.revisions if r.spec.adapter in routes), None)
    plan = PoolPlan(adapters=adapters, targets=targets, routes=routes, placement=placement, base_model=base_model,
                    capacity=pods, demands=demands)
    for (namespace, _), outcome in adapters.items():
        plan.revisions.update({(namespace, name): rp for name, rp in outcome.revisions.items()})
        plan.events.extend(((namespace, e.object_name), e) for e in outcome.events)
        name_of = {rp.served_name: name for name, rp in outcome.revisions.items()}
        plan.probes.extend(((namespace, name_of[p.served_name]), p) for p in outcome.probes)
    plan.next_due = min((o.next_due for o in adapters.values() if o.next_due is not None), default=None)
    return plan
