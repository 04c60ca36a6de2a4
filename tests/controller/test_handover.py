"""Make before break: a routed revision the placement moves keeps serving where it is until its new pod loaded it."""

from __future__ import annotations

from loraplane.api import PodLoad, ResidencyReport
from loraplane.api.runtime import AdapterResidency, Tier
from loraplane.controller.placement import AdapterDemand, Placement, Rates, keep_until_replaced
from loraplane.controller.pool import pod_capacity, serving_holders


def _report(pod: str, demotes_to_disk: bool = False, **tiers: Tier) -> ResidencyReport:
    adapters = [AdapterResidency(served_name=name.replace("_", "@"), tier=tier, registered=True)
                for name, tier in tiers.items()]
    return ResidencyReport(pool="pool", pod=pod, address="127.0.0.1:1", heartbeat_at=0.0, adapters=adapters,
                           demotes_to_disk=demotes_to_disk)


DEMAND = AdapterDemand("tail@v1", bytes=1 << 20, rates=Rates(m5=5.0))
MOVED = Placement(pods={"pod-a": {}, "pod-b": {"tail@v1": Tier.GPU}})


def test_the_old_holder_keeps_it_while_the_new_pod_still_fetches() -> None:
    reports = [_report("pod-a", tail_v1=Tier.CPU), _report("pod-b", tail_v1=Tier.DISK)]
    plan = keep_until_replaced(MOVED, [DEMAND], serving_holders(reports))
    assert plan.tiers_of("tail@v1") == {"pod-a": Tier.CPU, "pod-b": Tier.GPU}


def test_the_old_holder_lets_go_once_the_new_pod_serves_it() -> None:
    reports = [_report("pod-a", tail_v1=Tier.CPU), _report("pod-b", tail_v1=Tier.CPU)]
    assert keep_until_replaced(MOVED, [DEMAND], serving_holders(reports)).tiers_of("tail@v1") == {"pod-b": Tier.GPU}


def test_unrouted_and_unserved_revisions_are_left_alone() -> None:
    unrouted = AdapterDemand("tail@v1", bytes=1 << 20, rates=Rates(), min_replicas=0)
    reports = [_report("pod-a", tail_v1=Tier.GPU), _report("pod-b")]
    assert keep_until_replaced(MOVED, [unrouted], serving_holders(reports)).tiers_of("tail@v1") == {"pod-b": Tier.GPU}
    nowhere = [_report("pod-a", tail_v1=Tier.DISK), _report("pod-b")]
    assert keep_until_replaced(MOVED, [DEMAND], serving_holders(nowhere)).tiers_of("tail@v1") == {"pod-b": Tier.GPU}


ON_DISK = Placement(pods={"pod-a": {"tail@v1": Tier.DISK}, "pod-b": {}})


def test_a_runtime_that_keeps_disk_revisions_registered_serves_them_from_disk() -> None:
    """The engine demotes a disk-tier revision instead of unloading it: placement need not keep it in memory."""
    engine = [_report("pod-a", demotes_to_disk=True, tail_v1=Tier.CPU), _report("pod-b", demotes_to_disk=True)]
    keeps = {"pod-a", "pod-b"}
    assert keep_until_replaced(ON_DISK, [DEMAND], serving_holders(engine), keeps).tiers_of("tail@v1") == {
        "pod-a": Tier.DISK}
    # registered on disk there already: it serves it, and the plan may move its disk copy (it stays until then)
    demoted = [_report("pod-a", demotes_to_disk=True, tail_v1=Tier.DISK), _report("pod-b", demotes_to_disk=True)]
    assert serving_holders(demoted) == {"tail@v1": {"pod-a"}}
    moved = Placement(pods={"pod-a": {}, "pod-b": {"tail@v1": Tier.DISK}})
    assert keep_until_replaced(moved, [DEMAND], serving_holders(demoted), keeps).tiers_of("tail@v1") == {
        "pod-a": Tier.DISK, "pod-b": Tier.DISK}
    # a disk row only in the sidecar's cache is served by nobody
    cached = ResidencyReport(pool="pool", pod="pod-a", address="127.0.0.1:1", heartbeat_at=0.0, demotes_to_disk=True,
                             adapters=[AdapterResidency(served_name="tail@v1", tier=Tier.DISK, registered=False)])
    assert serving_holders([cached]) == {}


def test_a_runtime_that_unloads_disk_revisions_keeps_them_at_cpu() -> None:
    """vLLM (no demotes_to_disk): a disk target would unload the revision, so its holder keeps it at CPU, and a
    registered disk row there does not count as serving (unchanged from before the flag)."""
    vllm = [_report("pod-a", tail_v1=Tier.CPU), _report("pod-b")]
    assert keep_until_replaced(ON_DISK, [DEMAND], serving_holders(vllm)).tiers_of("tail@v1") == {"pod-a": Tier.CPU}
    assert serving_holders([_report("pod-a", tail_v1=Tier.DISK)]) == {}


def test_only_the_host_slots_beyond_the_gpu_ones_are_planned() -> None:
    """The host cache holds the GPU-resident adapters too: only the rest is planned for host-tier revisions (else
    the engine's sidecar would clip the plan's extra ones to disk by name, a rollout's canary included, and vLLM's
    LRU would drop host copies the plan counts on)."""
    load = PodLoad(max_gpu_slots=4, max_cpu_slots=6)
    engine = ResidencyReport(pool="pool", pod="pod-a", address="127.0.0.1:1", heartbeat_at=0.0, load=load,
                             demotes_to_disk=True)
    assert (pod_capacity(engine).gpu_slots, pod_capacity(engine).cpu_slots) == (4, 2)
    vllm = engine.model_copy(update={"demotes_to_disk": False})
    assert pod_capacity(vllm).cpu_slots == 2  # vLLM's --max-cpu-loras counts its GPU-resident adapters too
    # a host cache no larger than the GPU slots (the engine's default) still leaves one slot to prewarm into
    same = engine.model_copy(update={"load": PodLoad(max_gpu_slots=2, max_cpu_slots=2)})
    assert pod_capacity(same).cpu_slots == 1
    none = engine.model_copy(update={"load": PodLoad(max_gpu_slots=2, max_cpu_slots=0)})
    assert pod_capacity(none).cpu_slots == 0
