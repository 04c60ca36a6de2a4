"""plan_pool: rollout outcomes turned into placement demands, target states and routes; pool membership."""

from __future__ import annotations

from datetime import timedelta

from loraplane.api import (
    AdapterRevision,
    AdapterRevisionStatus,
    PickerCounters,
    PodLoad,
    RequestRates,
    ResidencyReport,
    RevisionCounters,
)
from loraplane.api.runtime import AdapterResidency, Tier
from loraplane.controller.placement import TenantBudget
from loraplane.controller.pool import PoolInputs, plan_pool, summed_counters
from tests.controller.world import BASE_DIGEST, T0, revision


def _stable(rev: AdapterRevision) -> AdapterRevision:
    rev.status = AdapterRevisionStatus(phase="Stable", traffic_weight=100, phase_since=T0)
    return rev


def _report(pod: str, held: dict[str, tuple[Tier, str]] | None = None, gpu: int = 2) -> ResidencyReport:
    return ResidencyReport(
        pool="pool", pod=pod, address=f"10.0.0.{pod[-1]}:8000", base_model_digest=BASE_DIGEST, max_lora_rank=64,
        heartbeat_at=0.0, adapters=[AdapterResidency(served_name=n, tier=t, digest=d, bytes=7 << 20)
                                    for n, (t, d) in (held or {}).items()],
        load=PodLoad(max_gpu_slots=gpu, max_cpu_slots=4),
    )


def test_counters_are_summed_over_picker_replicas() -> None:
    replicas = [PickerCounters(pool="pool", replica=f"p{i}", published_at=0.0,
                               revisions={"a@v1": RevisionCounters(requests=10, errors=i, ttft_seconds_sum=1.0,
                                                                   ttft_count=10)}) for i in range(3)]
    total = summed_counters(replicas)["a@v1"]
    assert (total.requests, total.errors, total.ttft_count, total.ttft_seconds_sum) == (30, 3, 30, 3.0)


def test_plan_pool_builds_targets_and_routes_from_rollouts_and_rates() -> None:
    hot = _stable(revision("v1", adapter="hot", n=1, pinned=True, priorityClass="gold", tenant="acme"))
    cold = _stable(revision("v1", adapter="cold", n=2, warmPolicy="on-demand"))
    new = revision("v2", adapter="hot", n=3, created=5)  # Pending: not routable yet
    reports = [_report("pod-0", {"hot@v1": (Tier.GPU, hot.spec.artifact.digest)}), _report("pod-1"), _report("pod-2")]
    rates = RequestRates(pool="pool", published_at=0.0,
                         windows={"5m": {"hot@v1": 9.0}, "1h": {"hot@v1": 9.0}, "24h": {"hot@v1": 9.0}})
    plan = plan_pool(PoolInputs(pool="pool", now=T0 + timedelta(seconds=10), revisions=[hot, cold, new],
                                reports=reports, rates=rates))
    assert {name: [w.served_name for w in e.revisions] for name, e in plan.routes.items()} == {
        "hot": ["hot@v1"], "cold": ["cold@v1"]}
    assert plan.routes["hot"].priority == 10 and plan.routes["hot"].tenant == "acme"
    hot_pods = {pod for pod, targets in plan.targets.items() for t in targets if t.served_name == "hot@v1"}
    assert len(hot_pods) == 3  # ceil(9 / 4) replicas for 9 requests/s
    key = plan.adapters[("default", "hot")].revisions["hot-v1"].status.cache_key
    assert key and {(t.tier, t.pinned, t.cache_key) for ts in plan.targets.values() for t in ts
                    if t.served_name == "hot@v1"} == {(Tier.GPU, True, key)}
    assert {t.tier for ts in plan.targets.values() for t in ts if t.served_name == "cold@v1"} == {Tier.DISK}
    verifying = [t for ts in plan.targets.values() for t in ts if t.served_name == "hot@v2"]
    assert [t.tier for t in verifying] == [Tier.DISK]  # Pending -> Verifying: fetched on its one canary pod
    assert plan.adapters[("default", "hot")].revisions["hot-v2"].status.phase == "Verifying"
    assert next(d for d in plan.demands if d.served_name == "hot@v1").bytes == 7 << 20  # the size sidecars report


def test_a_budget_that_keeps_a_revision_cold_is_visible_in_its_conditions() -> None:
    greedy = [_stable(revision("v1", adapter=f"a{i}", n=i + 1, tenant="greedy")) for i in range(3)]
    plan = plan_pool(PoolInputs(pool="pool", now=T0, revisions=greedy, reports=[_report("pod-0", gpu=4)],
                                budgets={"greedy": TenantBudget(gpu_bytes=0)}))
    conditions = {c.type: c for c in plan.adapters[("default", "a0")].revisions["a0-v1"].status.conditions}
    assert conditions["Placed"].status == "False" and "budget" in conditions["Placed"].message
