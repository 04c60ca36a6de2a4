"""``PoolSnapshot.update_endpoint``: an in-place update must equal a snapshot rebuilt from the same endpoints."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.api import Tier
from loraplane.picker.plugins import SchedulingRequest
from loraplane.picker.scheduler import Scheduler
from loraplane.picker.snapshot import EndpointState, PoolSnapshot

DIGESTS = ("sha256:" + "a" * 64, "sha256:" + "b" * 64)
NAMES = ("gold@v1", "claims@v1", "claims@v2", "other@v1")
PRIORITIES = {"gold@v1": 10}
TIERS = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.ABSENT)


@st.composite
def endpoint_states(draw: st.DrawFn, i: int) -> EndpointState:
    residency = draw(st.dictionaries(st.sampled_from(NAMES), st.tuples(st.sampled_from(TIERS), st.sampled_from((*DIGESTS, None))), max_size=4))
    draining = draw(st.frozensets(st.sampled_from(sorted(residency)), max_size=2)) if residency else frozenset()
    return EndpointState(
        name=f"pod-{i}", address=f"10.0.0.{i}:8000", ready=draw(st.booleans()), stale=draw(st.booleans()),
        last_heard=draw(st.booleans()), received_at=draw(st.floats(0, 100)), queue_depth=draw(st.integers(0, 9)), active_tokens=draw(st.integers(0, 5000)),
        kv_utilization=draw(st.floats(0, 1)), recent_evictions=draw(st.integers(0, 3)),
        residency=residency, draining=draining,
    )


def indexed(pool: PoolSnapshot) -> tuple[object, ...]:
    """Everything a snapshot derives from its endpoints, in comparable form."""
    residency = {key: (e.indices.tolist(), e.levels.tolist(), e.level_of) for key, e in pool.residency.items()}
    draining = {key: idx.tolist() for key, idx in pool.draining.items()}
    heard = {key: idx.tolist() for key, idx in pool.last_heard_residency.items()}
    arrays = [a.tolist() for a in (pool.ready, pool.stale, pool.fresh, pool.queue_depth, pool.running, pool.active_tokens,
                                    pool.kv_utilization, pool.recent_evictions, pool.protected_warm, pool.unprotected,
                                    pool.last_heard, pool.unknown, pool.received_at)]
    return (pool.endpoints, residency, draining, heard, arrays, pool.all_ready, pool.any_stale, pool.any_unknown,
            pool.has_protected)


@settings(max_examples=60, deadline=None)
@given(st.tuples(*(endpoint_states(i) for i in range(4))), st.lists(st.tuples(st.integers(0, 3), st.data()), max_size=4))
def test_updates_in_place_equal_a_rebuild(initial: tuple[EndpointState, ...], updates: list[tuple[int, st.DataObject]]) -> None:
    pool = PoolSnapshot(initial, PRIORITIES)
    states = list(initial)
    for index, data in updates:
        states[index] = data.draw(endpoint_states(index))
        pool.update_endpoint(index, states[index])
        assert indexed(pool) == indexed(PoolSnapshot(states, PRIORITIES))
    assert pool.version == len(updates)


def test_decisions_follow_an_update_and_in_flight_is_kept() -> None:
    cold = {"claims@v1": (Tier.DISK, DIGESTS[0])}
    pool = PoolSnapshot([EndpointState(name=f"pod-{i}", address=f"10.0.0.{i}:8000", residency=cold) for i in (1, 2)])
    pool.in_flight[:] = [0, 3]
    scheduler = Scheduler.default()
    request = SchedulingRequest(served_name="claims@v1", digest=DIGESTS[0])
    assert scheduler.schedule(request, pool, np.random.default_rng(0)).endpoints[0] == "10.0.0.1:8000"
    pool.update_endpoint(1, EndpointState(name="pod-2", address="10.0.0.2:8000", residency={"claims@v1": (Tier.GPU, DIGESTS[0])}))
    decision = scheduler.schedule(request, pool, np.random.default_rng(0))  # the scheduler's cache saw the new version
    assert decision.endpoints[0] == "10.0.0.2:8000" and decision.outcome.value == "warm-gpu"
    assert pool.in_flight.tolist() == [0, 3]
    with pytest.raises(ValueError, match=r"not 10\.0\.0\.9:8000"):
        pool.update_endpoint(0, EndpointState(name="pod-1", address="10.0.0.9:8000"))
