"""Picker replicas that decide as one: each adds the others' published requests in flight to its own, so the load,
the revisions in flight and the GPU-slot room a replica routes on are the pool's, not its share's."""

from __future__ import annotations

import numpy as np
import pytest
import redis.asyncio as aioredis

from loraplane.api import EndpointInFlight, PickerInFlight, keys
from loraplane.picker.plugins import SchedulingRequest
from loraplane.picker.replicas import InFlightShare, summed
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from loraplane.picker.snapshot import EndpointState, InFlightTracker, PoolSnapshot
from loraplane.processes import RedisServer

POOL = "pool"
A, B = "10.0.0.1:8000", "10.0.0.2:8000"


LEAST_IN_FLIGHT = """
plugins:
- type: in-flight-scorer
- type: max-score-picker
  parameters: {maxEndpoints: 1}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: in-flight-scorer, weight: 1}, {pluginRef: max-score-picker}]
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pool() -> PoolSnapshot:
    return PoolSnapshot([EndpointState(name=f"pod-{i}", address=a, gpu_slots=2) for i, a in enumerate((A, B))])


def replica(client: aioredis.Redis, name: str, clock: Clock) -> tuple[InFlightTracker, PoolSnapshot, InFlightShare]:
    tracker, snapshot = InFlightTracker(), pool()
    tracker.attach(snapshot)
    return tracker, snapshot, InFlightShare(client, POOL, name, tracker, clock)


@pytest.fixture
async def client(redis_srv: RedisServer):
    c = aioredis.Redis.from_url(redis_srv.url)
    await c.flushdb()
    yield c
    await c.aclose()


async def test_each_replica_routes_on_its_own_counts_plus_the_others(client: aioredis.Redis) -> None:
    clock = Clock()
    mine, seen_by_0, share_0 = replica(client, "picker-0", clock)
    theirs, seen_by_1, share_1 = replica(client, "picker-1", clock)
    for name in ("a@v1", "a@v1", "b@v1"):
        theirs.start(A, name, prompt_tokens=100)
    mine.start(A, "c@v1", prompt_tokens=7)
    await share_1.once()
    await share_0.once()  # finds picker-1's key, adds its counts
    assert seen_by_0.in_flight.tolist() == [4.0, 0.0]
    assert seen_by_0.prefilling.tolist() == [4.0, 0.0]
    assert seen_by_0.prefill_tokens.tolist() == [307.0, 0.0]  # the prompts queued there, from both replicas
    assert seen_by_0.adapters_in_flight.tolist() == [3.0, 0.0]  # a, b (picker-1's) and c (its own)
    assert set(seen_by_0.in_flight_by_name) == {"a@v1", "b@v1", "c@v1"}
    assert not seen_by_0.room_at(0, "d@v1")  # two GPU slots, three revisions in flight: no room for a fourth
    assert mine.counts == {A: 1}  # its own counts stay its own (what it publishes)
    mine.start(A, "a@v1")  # immediate on its own side, on top of the others'
    assert seen_by_0.in_flight[0] == 5.0 and seen_by_0.in_flight_by_name["a@v1"] == {0: 3}
    await share_1.once()  # picker-1 has not discovered picker-0 yet: it rescans every discover_s
    assert seen_by_1.in_flight.tolist() == [3.0, 0.0]
    clock.now += share_1.discover_s
    await share_0.once()  # publishes its second request
    await share_1.once()
    assert seen_by_1.in_flight.tolist() == [5.0, 0.0]
    for name in ("a@v1", "a@v1", "b@v1"):
        theirs.finish(A, name, prefilling=True, prompt_tokens=100)
    await share_1.once()
    await share_0.once()
    assert seen_by_0.in_flight.tolist() == [2.0, 0.0] and set(seen_by_0.in_flight_by_name) == {"a@v1", "c@v1"}
    assert seen_by_0.prefilling.tolist() == [2.0, 0.0] and seen_by_0.prefill_tokens.tolist() == [7.0, 0.0]


async def test_a_rebuilt_snapshot_gets_the_others_counts_too(client: aioredis.Redis) -> None:
    clock = Clock()
    mine, _, share_0 = replica(client, "picker-0", clock)
    theirs, _, share_1 = replica(client, "picker-1", clock)
    theirs.start(B, "a@v1")
    await share_1.once()
    await share_0.once()
    rebuilt = pool()
    mine.attach(rebuilt)
    assert rebuilt.in_flight.tolist() == [0.0, 1.0] and rebuilt.in_flight_by_name == {"a@v1": {1: 1}}


async def test_a_replicas_decision_counts_the_others_requests(client: aioredis.Redis) -> None:
    """picker-0 has 3 requests in flight at pod A, picker-1 one at pod B. Least in flight, picker-1 picks B (1
    against A's 3) when it counts picker-0's; on its own counts alone it would pick A (0 against 1)."""
    scheduler = Scheduler(EndpointPickerConfig.from_yaml(LEAST_IN_FLIGHT))
    clock = Clock()
    first, _, share_0 = replica(client, "picker-0", clock)
    second, seen_by_1, share_1 = replica(client, "picker-1", clock)
    for _ in range(3):
        first.start(A, "a@v1")
    second.start(B, "a@v1")
    await share_0.once()
    await share_1.once()
    decision = scheduler.schedule(SchedulingRequest("a@v1"), seen_by_1, np.random.default_rng(0))
    assert decision.endpoints[0] == B
    assert seen_by_1.in_flight.tolist() == [3.0, 1.0]


async def test_a_withdrawn_replica_counts_nothing_and_unreadable_redis_drops_the_others(
        client: aioredis.Redis, redis_srv: RedisServer) -> None:
    clock = Clock()
    _, seen_by_0, share_0 = replica(client, "picker-0", clock)
    theirs, _, share_1 = replica(client, "picker-1", clock)
    theirs.start(A, "a@v1")
    await share_1.once()
    await share_0.once()
    assert seen_by_0.in_flight[0] == 1.0
    await share_1.withdraw()
    await share_0.once()
    assert seen_by_0.in_flight[0] == 0.0
    await share_1.once()
    await share_0.once()
    assert seen_by_0.in_flight[0] == 1.0
    share_0.client = aioredis.Redis(port=1, socket_connect_timeout=0.2)  # nothing listens there
    await share_0.tick()
    assert seen_by_0.in_flight[0] == 1.0  # kept for a key's life
    clock.now += share_0.ttl_ms / 1000
    await share_0.tick()
    assert seen_by_0.in_flight[0] == 0.0 and not share_0.tracker.remote
    await share_0.client.aclose()


def test_summed_adds_counts_per_address_and_name() -> None:
    parts = [PickerInFlight(pool=POOL, replica=f"picker-{i}", published_at=0.0,
                            endpoints={A: EndpointInFlight(requests=2, prefilling=1, prefill_tokens=90,
                                                            by_name={"a@v1": 2})})
             for i in range(2)]
    total = summed(parts)
    assert total == {A: EndpointInFlight(requests=4, prefilling=2, prefill_tokens=180, by_name={"a@v1": 4})}
    assert parts[0].endpoints[A].requests == 2  # the parts are not changed
    assert keys.picker_in_flight(POOL, "picker-0").startswith(keys.route_table(POOL).removesuffix(":routes"))
