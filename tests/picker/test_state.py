"""The Redis-fed pool state against a real redis-server: notices, TTL staleness, outages, published rates/counters."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from e2e.fixtures.processes import RedisServer
from loraplane.api import AdapterResidency, PickerCounters, RequestRates, ResidencyReport, Tier, keys
from loraplane.picker.snapshot import InFlightTracker
from loraplane.picker.state import PoolState, RedisSync
from loraplane.picker.telemetry import RequestStats
from tests.picker.conftest import DIGEST_V1, POOL, route_table


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


async def write_report(client: aioredis.Redis, pod: str, port: int, heartbeat_at: float, warm: bool = False) -> None:
    adapters = [AdapterResidency(served_name="claims@v1", tier=Tier.GPU, digest=DIGEST_V1)] if warm else []
    report = ResidencyReport(pool=POOL, pod=pod, address=f"127.0.0.1:{port}", heartbeat_at=heartbeat_at, ttl_seconds=5,
                             adapters=adapters)
    await client.set(keys.residency_report(POOL, pod), report.to_json())
    await client.sadd(keys.residency_index(POOL), pod)
    await client.publish(keys.residency_changed_channel(POOL), pod)


async def eventually(check: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_state_follows_redis_and_survives_outages(redis_srv: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_srv.url)
    clock = FakeClock()
    await client.set(keys.route_table(POOL), route_table().to_json())
    await write_report(client, "pod-a", 1, clock.now)
    await client.set(keys.residency_report(POOL, "bad"), b"{not a report")
    newer = ResidencyReport(pool=POOL, pod="newer", address="127.0.0.1:9", heartbeat_at=clock.now, ttl_seconds=5,
                            schema_version=2)
    await client.set(keys.residency_report(POOL, "newer"), newer.to_json())
    await client.sadd(keys.residency_index(POOL), "bad", "newer", "Not_A_Pod")
    state = PoolState(POOL, InFlightTracker(), clock)
    stats = RequestStats(clock)
    sync = RedisSync(state, aioredis.Redis.from_url(redis_srv.url, socket_timeout=1), stats, "picker-0",
                     resync_seconds=60, publish_seconds=60)
    stop = asyncio.Event()
    task = asyncio.create_task(sync.run(stop))
    try:
        await eventually(lambda: state.synced)
        assert state.snapshot.addresses == ("127.0.0.1:1",)  # the invalid and the schema-2 report were skipped
        assert state.resolver.generation == 1
        # a change notice is applied without waiting for a resync
        await write_report(client, "pod-b", 2, clock.now, warm=True)
        await eventually(lambda: len(state.snapshot) == 2)
        assert state.snapshot.lookup("claims@v1", DIGEST_V1) is not None
        # the controller names staging pods: the next snapshot marks them, for revisions no pod holds
        assert state.snapshot.staging is None
        staged = route_table().model_copy(update={"generation": 2, "staging_pods": ["pod-b", "pod-gone"]})
        await client.set(keys.route_table(POOL), staged.to_json())
        await client.publish(keys.routes_changed_channel(POOL), "2")
        await eventually(lambda: state.snapshot.staging is not None)
        assert dict(zip(state.snapshot.addresses, state.snapshot.staging.tolist(), strict=True)) == {
            "127.0.0.1:1": False, "127.0.0.1:2": True}
        # reports older than their TTL turn stale on time
        clock.now += 10
        await eventually(lambda: bool(state.snapshot.stale.all()))
        assert state.snapshot.lookup("claims@v1", DIGEST_V1) is None
        # Redis goes away: the last snapshot stays in use
        await write_report(client, "pod-b", 2, clock.now, warm=True)
        await eventually(lambda: not state.snapshot.stale.all())
        before = state.snapshot
        redis_srv.process.stop()
        await asyncio.sleep(0.5)
        assert state.snapshot.addresses == before.addresses
        # back again (empty): routes and reports are re-read
        redis_srv.restart()
        await client.aclose()
        client = aioredis.Redis.from_url(redis_srv.url)
        await client.set(keys.route_table(POOL), route_table(canary_weight=10).to_json())
        await write_report(client, "pod-c", 3, clock.now)
        await eventually(lambda: "127.0.0.1:3" in state.snapshot.addresses, within=10)
        assert "claims@v2" in state.resolver.priorities()
        # rates and counters are published in the contract's shapes
        stats.record_request("claims@v1")
        stats.record_response("claims@v1", 500, 0.25)
        await sync.publish_once()
        rates = RequestRates.from_json(await client.get(keys.request_rates(POOL, "picker-0")))
        assert rates.windows["5m"]["claims@v1"] > 0 and rates.replica == "picker-0"
        counters = PickerCounters.from_json(await client.get(keys.picker_counters(POOL, "picker-0")))
        assert counters.revisions["claims@v1"].errors == 1 and counters.revisions["claims@v1"].ttft_count == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)  # the follow loop ends on stop, with no cancellation
        await client.aclose()
        await sync.client.aclose()


def test_rates_cover_their_windows() -> None:
    clock = FakeClock()
    stats = RequestStats(clock)
    for _ in range(600):
        stats.record_request("a@v1")
        clock.now += 1.0  # 1 request/s for 10 minutes
    rates = stats.rates(POOL).windows
    assert 0.9 <= rates["5m"]["a@v1"] <= 1.1
    assert 0.9 <= rates["1h"]["a@v1"] <= 1.1  # up for 10 min only: divided by uptime, not the hour
    clock.now += 3600
    later = stats.rates(POOL).windows
    assert "a@v1" not in later["5m"] and "a@v1" not in later["1h"]
    assert later["24h"]["a@v1"] > 0
