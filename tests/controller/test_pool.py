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
from loraplane.controller.placement import AdapterDemand, Placement, TenantBudget
from loraplane.controller.pool import (
    PoolInputs,
    canary_gpu_slots,
    fit_to_sidecars,
    plan_pool,
    summed_counters,
)
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
    # its rollout's gates read its tier on the canary pod: held there; a Stable revision's targets are a prefetch
    assert [t.hold for t in verifying] == [True]
    assert {t.hold for ts in plan.targets.values() for t in ts if t.served_name in ("hot@v1", "cold@v1")} == {False}
    assert plan.adapters[("default", "hot")].revisions["hot-v2"].status.phase == "Verifying"
    assert next(d for d in plan.demands if d.served_name == "hot@v1").bytes == 7 << 20  # the size sidecars report


def test_a_budget_that_keeps_a_revision_cold_is_visible_in_its_conditions() -> None:
    greedy = [_stable(revision("v1", adapter=f"a{i}", n=i + 1, tenant="greedy")) for i in range(3)]
    plan = plan_pool(PoolInputs(pool="pool", now=T0, revisions=greedy, reports=[_report("pod-0", gpu=4)],
                                budgets={"greedy": TenantBudget(gpu_bytes=0)}))
    conditions = {c.type: c for c in plan.adapters[("default", "a0")].revisions["a0-v1"].status.conditions}
    assert conditions["Placed"].status == "False" and "budget" in conditions["Placed"].message


def _vllm_report(pod: str, gpu: int = 4, host: int = 6) -> ResidencyReport:
    """A vLLM pod's report: loads activate, a disk-tier target is unloaded, ``host`` copies in all."""
    return ResidencyReport(pool="pool", pod=pod, address="10.0.0.9:8000", heartbeat_at=0.0, loads_activate=True,
                           load=PodLoad(max_gpu_slots=gpu, max_cpu_slots=host))


def test_a_vllm_pods_targets_are_cut_by_the_controller_never_a_canary() -> None:
    """Make-before-break holds beyond a vLLM pod's host copies, and GPU-tier targets in its landing slot: the
    controller cuts them (the sidecar would by name and priority, a canary among them), canaries first in line."""
    canaries = {f"c{i}@v1": Tier.GPU for i in range(3)}
    planned = Placement(pods={"pod-0": {**canaries, "hot@v1": Tier.GPU, "old@v1": Tier.CPU, "twin@v1": Tier.CPU,
                                        "fresh@v1": Tier.CPU},
                              "pod-1": {"twin@v1": Tier.GPU, "moved@v1": Tier.GPU, "moved2@v1": Tier.GPU}})
    kept = Placement(pods={"pod-0": {**planned.pods["pod-0"], "moved@v1": Tier.CPU, "moved2@v1": Tier.CPU},
                           "pod-1": dict(planned.pods["pod-1"])})
    demands = [AdapterDemand(name, 1, required={"pod-0": Tier.GPU}) for name in canaries]
    serving = {"hot@v1": {"pod-0"}, "old@v1": {"pod-0"}, "twin@v1": {"pod-0", "pod-1"}, "moved@v1": {"pod-0"},
               "moved2@v1": {"pod-0"}, **{name: {"pod-0"} for name in canaries}}
    fitted = fit_to_sidecars(kept, planned, [_vllm_report("pod-0"), _vllm_report("pod-1")], demands, serving)
    pod0 = fitted.pods["pod-0"]
    # GPU: 3 canaries fill the slots the sidecar keeps (4 less the landing slot); the hot replica goes to CPU
    assert [n for n, t in pod0.items() if t is Tier.GPU] == list(canaries)
    assert pod0["hot@v1"] is Tier.CPU and "GPU slot free" in fitted.notes["hot@v1"]
    # host (6 copies, 9 asked): the load not made yet, the copy another pod serves, the latest make-before-break hold
    assert {n for n, t in pod0.items() if t is Tier.DISK} == {"fresh@v1", "twin@v1", "moved2@v1"}
    assert (pod0["hot@v1"], pod0["old@v1"], pod0["moved@v1"]) == (Tier.CPU, Tier.CPU, Tier.CPU)
    assert "no host slot" in fitted.notes["fresh@v1"] and "moved2@v1" not in fitted.notes
    assert fitted.pods["pod-1"] == planned.pods["pod-1"]  # within its limits: as planned
    # an engine pod (disk-tier revisions stay registered) and a pod whose loads do not activate are left alone
    engine = _vllm_report("pod-0").model_copy(update={"loads_activate": False, "demotes_to_disk": True})
    assert fit_to_sidecars(kept, planned, [engine], demands, serving).pods["pod-0"] == kept.pods["pod-0"]


def test_a_vllm_pod_registering_disk_tier_targets_keeps_a_landing_slot_and_a_host_copy_for_them() -> None:
    """A vLLM sidecar now registers disk-tier targets (``demotes_to_disk``): loading one, and each request for one,
    takes a GPU slot and makes a host copy. So the controller keeps the landing slot for them (as for host-tier
    targets) and, while the pod has any, one host copy free of host-tier targets: exactly what the sidecar keeps
    (``Reconciler.within_capacity``), so it cuts nothing by its own order. Disk-tier entries take no host slot."""
    from loraplane.api import TargetState
    from loraplane.controller.pool import _target
    from loraplane.sidecar.drivers.base import RuntimeInfo
    from loraplane.sidecar.reconcile import Reconciler

    report = _vllm_report("pod-0", gpu=4, host=6).model_copy(update={"demotes_to_disk": True})
    canary = "c0@v1"
    demands = [AdapterDemand(canary, 1, required={"pod-0": Tier.GPU})]
    disk = {f"d{i}@v1": Tier.DISK for i in range(8)}

    def fitted(held: dict[str, Tier]) -> dict[str, Tier]:
        plan = Placement(pods={"pod-0": held})
        pods = fit_to_sidecars(plan, plan, [report], demands, {}).pods["pod-0"]
        # the sidecar applies it as it is
        revisions = {n: _stable(revision("v1", adapter=n[:-3], n=i + 1)) for i, n in enumerate(pods)}
        targets = [_target(revisions[n], revisions[n].status, t) for n, t in pods.items()]
        state = TargetState(pool="pool", pod="pod-0", generation=1, updated_at=0.0, adapters=targets)
        _, clipped = Reconciler.within_capacity(state, RuntimeInfo(base_model="m", max_loras=4, max_cpu_loras=6),
                                                landing_slot=True, registers_disk=True)
        assert clipped == {}, clipped
        return pods

    gpu = {canary: Tier.GPU, "g1@v1": Tier.GPU, "g2@v1": Tier.GPU, "g3@v1": Tier.GPU}
    # GPU-tier and disk-tier targets only: the last GPU-tier one no rollout requires keeps the landing slot free
    pods = fitted({**gpu, **disk})
    assert [n for n, t in pods.items() if t is Tier.GPU] == [canary, "g1@v1", "g2@v1"] and pods["g3@v1"] is Tier.CPU
    assert all(pods[n] is Tier.DISK for n in disk)  # eight registrations, no host slot taken
    # a full host cache (6 copies): one copy is left for loading and serving the registrations
    pods = fitted({**gpu, "h1@v1": Tier.CPU, "h2@v1": Tier.CPU, **disk})
    assert sum(t in (Tier.GPU, Tier.CPU) for t in pods.values()) == 5 and pods[canary] is Tier.GPU
    # without disk-tier targets a host cache may be full (nothing is loaded beside the kept copies)
    pods = fitted({**gpu, "h1@v1": Tier.CPU, "h2@v1": Tier.CPU})
    assert sum(t in (Tier.GPU, Tier.CPU) for t in pods.values()) == 6


def test_admission_leaves_the_landing_slot_of_a_pod_whose_loads_activate() -> None:
    assert canary_gpu_slots(_vllm_report("p", gpu=4)) == 3
    assert canary_gpu_slots(_vllm_report("p", gpu=1)) == 1  # at least one: a canary activates by its own load
    assert canary_gpu_slots(_report("pod-0", gpu=4)) == 4  # the engine: every slot
