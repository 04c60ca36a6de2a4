"""The room term: a pod whose in-flight requests already use its GPU slots for other adapters (or that is fetching
another revision it lacks) has no room for a new one; a spill prefers a pod with room, and with none the decision
says so (flow control then holds the request)."""

from __future__ import annotations

import numpy as np

from loraplane.api import AdapterResidency, PodLoad, ResidencyReport, Tier
from loraplane.picker.lifecycle import InFlightRequest, Lifecycle, PluginRuntime
from loraplane.picker.plugins import SchedulingRequest
from loraplane.picker.scheduler import Scheduler
from loraplane.picker.snapshot import EndpointState, InFlightTracker, PoolSnapshot, endpoint_from_report

DIGEST = "sha256:" + "a" * 64
CLAIMS = SchedulingRequest("claims@v1", DIGEST)


def pod(i: int, tier: Tier | None, slots: int = 2) -> EndpointState:
    residency = {"claims@v1": (tier, DIGEST)} if tier is not None else {}
    return EndpointState(name=f"pod-{i}", address=f"10.0.0.{i}:8000", gpu_slots=slots, residency=residency)


def room_for_claims(pool: PoolSnapshot) -> list[bool]:
    room = pool.has_room(CLAIMS.served_name, CLAIMS.digest)
    return [True] * pool.size if room is None else room.tolist()


def send(tracker: InFlightTracker, address: str, *names: str) -> None:
    for name in names:
        tracker.start(address, name)


def test_a_pod_running_max_loras_other_adapters_has_no_room() -> None:
    pool = PoolSnapshot([pod(0, Tier.CPU), pod(1, Tier.CPU)])
    tracker = InFlightTracker()
    tracker.attach(pool)
    send(tracker, "10.0.0.0:8000", "a@v1", "b@v1")  # both of pod-0's slots taken by other adapters
    assert room_for_claims(pool) == [False, True]
    assert not pool.room_at(0, "claims@v1", DIGEST) and pool.room_at(1, "claims@v1", DIGEST)
    tracker.start("10.0.0.0:8000", "claims@v1")  # now one of its requests runs there: it joins that batch
    assert room_for_claims(pool) == [True, True] and pool.room_at(0, "claims@v1", DIGEST)
    tracker.finish("10.0.0.0:8000", "claims@v1")
    tracker.finish("10.0.0.0:8000", "a@v1")  # a slot frees
    assert pool.has_room("claims@v1", DIGEST) is None
    assert pool.in_flight.tolist() == [1.0, 0.0] and pool.adapters_in_flight.tolist() == [1.0, 0.0]


def test_counts_carry_over_to_a_rebuilt_snapshot_and_unreported_slots_never_block() -> None:
    tracker = InFlightTracker()
    send(tracker, "10.0.0.0:8000", "a@v1", "b@v1")
    rebuilt = PoolSnapshot([pod(0, Tier.GPU), pod(1, None)])
    tracker.attach(rebuilt)
    assert rebuilt.adapters_in_flight.tolist() == [2.0, 0.0]
    assert not rebuilt.room_at(0, "c@v1")
    held = {name: (Tier.GPU, DIGEST) for name in ("a@v1", "b@v1")}  # not fetching: it holds both
    unreported = PoolSnapshot([EndpointState(name="pod-0", address="10.0.0.0:8000", residency=held)])
    tracker.attach(unreported)
    assert unreported.has_room("c@v1") is None


def test_a_pod_fetching_one_revision_it_lacks_has_no_room_for_another_it_lacks() -> None:
    pool = PoolSnapshot([pod(0, None, slots=4), pod(1, None, slots=4), pod(2, Tier.DISK, slots=4)])
    tracker = InFlightTracker()
    tracker.attach(pool)
    tracker.start("10.0.0.0:8000", "other@v1")  # pod-0 holds no other@v1: it is fetching it
    tracker.start("10.0.0.2:8000", "other@v1")  # pod-2 too, but it holds claims: its load needs no fetch
    assert room_for_claims(pool) == [False, True, True]
    assert not pool.room_at(0, "claims@v1", DIGEST) and pool.room_at(2, "claims@v1", DIGEST)
    # the next report shows pod-0 holding other@v1: the fetch is over
    pool.update_endpoint(0, EndpointState(name="pod-0", address="10.0.0.0:8000", gpu_slots=4,
                                          residency={"other@v1": (Tier.GPU, "sha256:" + "b" * 64)}))
    assert pool.has_room("claims@v1", DIGEST) is None


def test_the_default_config_spills_to_a_pod_with_room_and_flags_a_decision_without_room() -> None:
    scheduler = Scheduler.default()
    rng = np.random.default_rng(0)
    # pod-0 holds claims on CPU but runs two other adapters in both its slots; pod-1 holds it on disk, idle
    pool = PoolSnapshot([pod(0, Tier.CPU), pod(1, Tier.DISK)])
    tracker = InFlightTracker()
    tracker.attach(pool)
    send(tracker, "10.0.0.0:8000", "a@v1", "b@v1")
    decision = scheduler.schedule(CLAIMS, pool, rng)
    assert decision.indices[0] == 1 and decision.room and not decision.should_wait
    send(tracker, "10.0.0.1:8000", "c@v1", "d@v1")  # no pod has room now: the best one goes, flagged
    decision = scheduler.schedule(CLAIMS, pool, rng)
    assert decision.indices[0] == 0 and not decision.room and decision.should_wait and not decision.saturated


def test_in_flight_accounting_counts_per_served_name_and_moves_with_the_request() -> None:
    tracker = InFlightTracker()
    lifecycle = Lifecycle(PluginRuntime(tracker, clock=lambda: 0.0))
    request = InFlightRequest(CLAIMS, "t", "10.0.0.0:8000")
    lifecycle.pre_request(request)
    assert tracker.by_name == {"10.0.0.0:8000": {"claims@v1": 1}}
    lifecycle.moved(request, "10.0.0.1:8000")
    assert tracker.by_name == {"10.0.0.1:8000": {"claims@v1": 1}} and tracker.counts == {"10.0.0.1:8000": 1}
    lifecycle.response_complete(request)
    assert tracker.by_name == {} and tracker.counts == {}


def test_the_report_gives_the_pods_gpu_slots() -> None:
    report = ResidencyReport(pool="p", pod="pod-0", address="10.0.0.0:8000", heartbeat_at=0.0,
                             adapters=[AdapterResidency(served_name="claims@v1", tier=Tier.GPU, digest=DIGEST)],
                             load=PodLoad(max_gpu_slots=3))
    assert endpoint_from_report(report).gpu_slots == 3
    assert PoolSnapshot([endpoint_from_report(report)]).slot_limit.tolist() == [3.0]
