"""The shortcuts that let the simulator run a fleet (256 pods, 10,000 adapters) change nothing: what they keep up
to date incrementally equals what recounting everything gives, at every decision."""

from __future__ import annotations

import numpy as np
import pytest

from loraplane.api import Tier
from loraplane.picker.plugins import SchedulingRequest
from loraplane.picker.scheduler import Scheduler, WaitKey
from loraplane.picker.snapshot import EndpointState, PoolSnapshot, _holds
from loraplane.sim.cluster import ON_DEMAND, Pod, SimConfig
from loraplane.sim.policies import PickerRouter
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.runner import simulate
from loraplane.sim.snapshot import SimSnapshot
from loraplane.sim.trace import scenario
from tests.sim.conftest import ADAPTER_BYTES, NO_QUEUE


def _check_recounted(router: PickerRouter, snapshot: PoolSnapshot, now: float, pods: list[Pod]) -> None:
    """``snapshot``'s in-flight figures are what setting every pod's afresh gives (what the router did at every
    decision before: ``PoolSnapshot.set_in_flight``)."""
    by_name: dict[str, dict[int, int]] = {}
    for i, pod in enumerate(pods):
        counts = router._in_flight(pod)
        assert snapshot.in_flight[i] == sum(counts.values()), (i, now)
        assert snapshot.prefilling[i] == pod.awaiting_first_token(now), (i, now)
        assert snapshot.adapters_in_flight[i] == len(counts) and snapshot._names_at[i] == set(counts), (i, now)
        residency = snapshot.endpoints[i].residency
        assert snapshot.fetching[i] == sum(1 for n in counts if not _holds(residency.get(n))), (i, now)
        for name, count in counts.items():
            by_name.setdefault(name, {})[i] = count
    assert snapshot.in_flight_by_name == by_name


@pytest.mark.parametrize(
    ("name", "requests", "config", "flow_control"),
    [
        ("hot-plus-burst", 1000, SimConfig(pods=2, max_loras=2, max_cpu_loras=4), None),  # overloaded: long queues
        ("hot-plus-burst", 1000, SimConfig(pods=6, max_loras=2, max_cpu_loras=4), NO_QUEUE),  # no picker queue
        ("hot-plus-burst", 1000, SimConfig(pods=2, max_loras=2, max_cpu_loras=4, loraplane_runtime=ON_DEMAND), None),
        # pods that load on demand: on vLLM pods (the default) this fleet's queues stay short
        ("fleet", 600, SimConfig(pods=8, max_loras=4, max_cpu_loras=16, loraplane_runtime=ON_DEMAND), None),
    ],
)
def test_in_flight_counts_kept_by_touched_pods_equal_a_full_recount(
    monkeypatch: pytest.MonkeyPatch, name: str, requests: int, config: SimConfig, flow_control: object
) -> None:
    trace = scenario(name, requests, seed=5, adapter_bytes=ADAPTER_BYTES)
    sync = PickerRouter._sync_in_flight
    checked = []

    def checking(router: PickerRouter, snapshot: PoolSnapshot, now: float, pods: list[Pod]) -> None:
        sync(router, snapshot, now, pods)
        _check_recounted(router, snapshot, now, pods)
        checked.append(int(snapshot.in_flight.sum()))

    monkeypatch.setattr(PickerRouter, "_sync_in_flight", checking)
    result = simulate(trace, config, LARGE_GPU, "loraplane", seed=5, flow_control=flow_control)  # type: ignore[arg-type]
    assert len(checked) >= requests and max(checked) > 2 * config.pods  # queues built up: the counts moved
    assert int(np.count_nonzero(np.asarray(result.refused) == 0)) > 0


def test_the_simulators_snapshot_reindexes_changed_rows_as_the_pickers_does() -> None:
    """Random tier changes on 6 endpoints of 40 revisions (some gold, some rows without a digest, some absent):
    after each in-place update ``SimSnapshot`` holds the residency index and protected counts that
    ``PoolSnapshot`` (which re-indexes every row) holds, and both equal a snapshot built afresh."""
    rng = np.random.default_rng(7)
    names = [f"a{i}@v1" for i in range(40)]
    priorities = {n: 1 for n in names[::5]}
    tiers = [Tier.GPU, Tier.CPU, Tier.DISK, Tier.ABSENT]

    def endpoint(i: int) -> EndpointState:
        held = rng.choice(len(names), size=int(rng.integers(0, 12)), replace=False)
        residency = {
            names[h]: (tiers[int(rng.integers(0, 4))], None if rng.random() < 0.1 else f"sha256:{h}") for h in held
        }
        return EndpointState(name=f"pod-{i}", address=f"10.0.0.{i + 1}:8000", residency=residency, gpu_slots=4)

    first = [endpoint(i) for i in range(6)]
    fast, full = SimSnapshot(first, priorities), PoolSnapshot(first, priorities)
    moved = 0
    for _ in range(300):
        updates = [(int(i), endpoint(int(i))) for i in rng.choice(6, size=int(rng.integers(1, 4)), replace=False)]
        fast.update_endpoints(updates)
        full.update_endpoints(updates)
        fresh = PoolSnapshot(fast.endpoints, priorities)
        for snapshot in (fast, full):
            assert snapshot.residency.keys() == fresh.residency.keys()
            for key, entry in fresh.residency.items():
                assert snapshot.residency[key].level_of == entry.level_of
                assert np.array_equal(snapshot.residency[key].indices, entry.indices)
                assert np.array_equal(snapshot.residency[key].levels, entry.levels)
            assert np.array_equal(snapshot.protected_warm, fresh.protected_warm)
        moved += int(fresh.protected_warm.sum())
    assert moved > 0


def test_a_held_requests_retries_skip_the_decision_only_while_it_would_still_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The picker's queue retries its held heads after each completion; in the simulator (as in the picker) a retry
    is a whole decision only once a pod the request could use changed (``Scheduler.still_waits``). Each retry it
    skipped is decided anyway here: every one of them would have waited."""
    trace = scenario("hot-plus-burst", 1000, seed=5, adapter_bytes=ADAPTER_BYTES)
    still_waits = Scheduler.still_waits
    skipped = []

    def checking(scheduler: Scheduler, request: SchedulingRequest, pool: PoolSnapshot, key: WaitKey) -> bool:
        waits = still_waits(scheduler, request, pool, key)
        if waits:
            assert scheduler.schedule(request, pool, np.random.default_rng(0)).should_wait
            skipped.append(request.served_name)
        return waits

    monkeypatch.setattr(Scheduler, "still_waits", checking)
    simulate(trace, SimConfig(pods=2, max_loras=2, max_cpu_loras=4), LARGE_GPU, "loraplane", seed=5)
    assert len(skipped) > 100
