"""The predicted-TTFT cost model: its ordering in the regimes that matter, and affinity-until-saturated falling out."""

from __future__ import annotations

import numpy as np

from loraplane.api import LoadCosts, PodLoad, ResidencyReport, Tier
from loraplane.picker.plugins import PredictedTtftParameters, SchedulingRequest, predicted_ttft
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from loraplane.picker.snapshot import EndpointState, PoolSnapshot, endpoint_from_report

DIGEST = "sha256:" + "a" * 64
REQUEST = SchedulingRequest("claims@v1", DIGEST)
PARAMS = PredictedTtftParameters()  # 16 batch slots, 0.5 s per slot turn, CPU 0.02 s, disk 0.25 s, fetch 3 s


def pod(i: int, tier: Tier | None, running: int = 0, queue: int = 0) -> EndpointState:
    residency = {"claims@v1": (tier, DIGEST)} if tier is not None else {}
    return EndpointState(name=f"pod-{i}", address=f"10.0.0.{i}:8000", running=running, queue_depth=queue,
                         residency=residency)


def ranking(*pods: EndpointState) -> list[str]:
    ttft = predicted_ttft(PARAMS, REQUEST, PoolSnapshot(list(pods)))
    return [pods[i].name for i in np.argsort(ttft, kind="stable")]


def test_an_idle_pool_orders_by_tier() -> None:
    assert ranking(pod(0, None), pod(1, Tier.DISK), pod(2, Tier.CPU), pod(3, Tier.GPU)) == [
        "pod-3", "pod-2", "pod-1", "pod-0"]


def test_warm_but_saturated_keeps_the_request_while_its_queue_is_shorter_than_a_cold_load() -> None:
    # 16 running + 40 waiting: ~1.3 s of queue on the warm pod, against a 3 s fetch on the idle cold pod
    assert ranking(pod(0, Tier.GPU, running=16, queue=40), pod(1, None)) == ["pod-0", "pod-1"]


def test_cold_idle_wins_once_the_warm_queue_outgrows_the_load() -> None:
    # 16 running + 120 waiting: ~3.8 s of queue, more than the 3 s fetch
    assert ranking(pod(0, Tier.GPU, running=16, queue=120), pod(1, None)) == ["pod-1", "pod-0"]
    # a CPU-resident idle pod is cheap to activate: it wins long before
    assert ranking(pod(0, Tier.GPU, running=16, queue=4), pod(1, Tier.CPU)) == ["pod-1", "pod-0"]


def test_a_load_costs_more_where_it_stalls_a_full_batch() -> None:
    busy, quiet = pod(0, Tier.DISK, running=12), pod(1, Tier.DISK, running=0)
    assert ranking(busy, quiet) == ["pod-1", "pod-0"]  # neither queues: the stall decides


def test_measured_load_costs_from_the_report_replace_the_defaults() -> None:
    def report(name: str, disk: float | None) -> ResidencyReport:
        from loraplane.api import AdapterResidency

        return ResidencyReport(pool="p", pod=name, address=f"10.0.1.{len(name)}:8000", heartbeat_at=0.0,
                               adapters=[AdapterResidency(served_name="claims@v1", tier=Tier.DISK, digest=DIGEST)],
                               load=PodLoad(load_seconds=LoadCosts(disk=disk)))

    slow, unmeasured = endpoint_from_report(report("slow", 5.0)), endpoint_from_report(report("unmeasured-x", None))
    ttft = predicted_ttft(PARAMS, REQUEST, PoolSnapshot([slow, unmeasured]))
    assert ttft.tolist() == [5.0, PARAMS.disk_load_seconds]
    # a slow disk costs more than fetching elsewhere
    assert ranking(slow, pod(2, None))[0] == "pod-2"


def test_as_a_scorer_it_routes_by_prediction_and_the_old_scorers_stay_selectable() -> None:
    config = EndpointPickerConfig.load()
    cost = Scheduler(config, "predicted-ttft")
    affinity = Scheduler(config)
    pool = PoolSnapshot([pod(0, Tier.GPU, running=16, queue=120), pod(1, Tier.CPU)])
    rng = np.random.default_rng(0)
    assert cost.schedule(REQUEST, pool, rng).endpoints[0] == "10.0.0.1:8000"
    lighter = PoolSnapshot([pod(0, Tier.GPU, running=3), pod(1, Tier.CPU)])
    assert cost.schedule(REQUEST, lighter, rng).endpoints[0] == "10.0.0.0:8000"
    assert affinity.schedule(REQUEST, lighter, rng).endpoints[0] == "10.0.0.0:8000"
