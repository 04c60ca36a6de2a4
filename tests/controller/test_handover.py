"""Make before break: a routed revision the placement moves keeps serving where it is until its new pod loaded it."""

from __future__ import annotations

from loraplane.api import ResidencyReport
from loraplane.api.runtime import AdapterResidency, Tier
from loraplane.controller.placement import AdapterDemand, Placement, Rates, keep_until_replaced
from loraplane.controller.pool import warm_holders


def _report(pod: str, **tiers: Tier) -> ResidencyReport:
    adapters = [AdapterResidency(served_name=name.replace("_", "@"), tier=tier) for name, tier in tiers.items()]
    return ResidencyReport(pool="pool", pod=pod, address="127.0.0.1:1", heartbeat_at=0.0, adapters=adapters)


DEMAND = AdapterDemand("tail@v1", bytes=1 << 20, rates=Rates(m5=5.0))
MOVED = Placement(pods={"pod-a": {}, "pod-b": {"tail@v1": Tier.GPU}})


def test_the_old_holder_keeps_it_while_the_new_pod_still_fetches() -> None:
    reports = [_report("pod-a", tail_v1=Tier.CPU), _report("pod-b", tail_v1=Tier.DISK)]
    plan = keep_until_replaced(MOVED, [DEMAND], warm_holders(reports))
    assert plan.tiers_of("tail@v1") == {"pod-a": Tier.CPU, "pod-b": Tier.GPU}


def test_the_old_holder_lets_go_once_the_new_pod_serves_it() -> None:
    reports = [_report("pod-a", tail_v1=Tier.CPU), _report("pod-b", tail_v1=Tier.CPU)]
    assert keep_until_replaced(MOVED, [DEMAND], warm_holders(reports)).tiers_of("tail@v1") == {"pod-b": Tier.GPU}


def test_unrouted_and_unserved_revisions_are_left_alone() -> None:
    unrouted = AdapterDemand("tail@v1", bytes=1 << 20, rates=Rates(), min_replicas=0)
    reports = [_report("pod-a", tail_v1=Tier.GPU), _report("pod-b")]
    assert keep_until_replaced(MOVED, [unrouted], warm_holders(reports)).tiers_of("tail@v1") == {"pod-b": Tier.GPU}
    nowhere = [_report("pod-a", tail_v1=Tier.DISK), _report("pod-b")]
    assert keep_until_replaced(MOVED, [DEMAND], warm_holders(nowhere)).tiers_of("tail@v1") == {"pod-b": Tier.GPU}
