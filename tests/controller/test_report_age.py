"""Issue 31, item 5, the controller's side: reports are aged by when the controller received them, never by the
sidecar's clock, and their TTL counts up to ``MAX_REPORT_TTL_S``.

A sidecar whose clock runs 600 s ahead looked fresh to the controller long after it died; one 120 s behind was
dropped from every plan while it served; and a probe's 404 was judged against a report time on the sidecar's clock.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from e2e.fixtures.processes import RedisServer
from loraplane.api import ResidencyReport, keys
from loraplane.api.runtime import MAX_REPORT_TTL_S
from loraplane.controller.store import RedisStore

POOL = "p"


async def _publish(client: aioredis.Redis, pod: str, heartbeat_at: float, ttl_seconds: float = 5.0) -> None:
    report = ResidencyReport(pod=pod, pool=POOL, address=f"10.0.0.{len(pod)}:8000", heartbeat_at=heartbeat_at,
                             ttl_seconds=ttl_seconds)
    await client.sadd(keys.residency_index(POOL), pod)
    await client.set(keys.residency_report(POOL, pod), report.to_json())


async def _read(store: RedisStore) -> dict[str, ResidencyReport]:
    return {r.pod: r for r in (await store.read(POOL)).reports}


async def test_a_sidecar_clock_ahead_or_behind_ages_its_report_from_when_the_controller_received_it(
    redis_srv: RedisServer,
) -> None:
    now = [1000.0]
    client = aioredis.Redis.from_url(redis_srv.url)
    store = RedisStore(client, clock=lambda: now[0], writer="ctl@1")
    try:
        await _publish(client, "ahead", 1600.0)  # 600 s ahead of the controller
        await _publish(client, "behind", 880.0)  # 120 s behind
        reports = await _read(store)
        assert {pod: r.heartbeat_at for pod, r in reports.items()} == {"ahead": 1000.0, "behind": 1000.0}
        assert not any(r.is_stale(now[0]) for r in reports.values())  # the one behind is planned for: it serves

        now[0] = 1003.0  # read again, no new heartbeat: the receive time stays
        reports = await _read(store)
        assert {r.heartbeat_at for r in reports.values()} == {1000.0}
        assert not any(r.is_stale(now[0]) for r in reports.values())

        now[0] = 1010.0  # both sidecars silent past their 5 s TTL: both stale (the one ahead too)
        reports = await _read(store)
        assert all(r.is_stale(now[0]) for r in reports.values())

        await _publish(client, "behind", 890.0)  # a new heartbeat, still 120 s behind: received now, fresh
        reports = await _read(store)
        assert reports["behind"].heartbeat_at == 1010.0 and not reports["behind"].is_stale(now[0])
        assert reports["ahead"].is_stale(now[0])
    finally:
        await client.aclose()


async def test_a_ttl_beyond_the_bound_counts_as_the_bound(redis_srv: RedisServer) -> None:
    now = [1000.0]
    client = aioredis.Redis.from_url(redis_srv.url)
    store = RedisStore(client, clock=lambda: now[0], writer="ctl@1")
    try:
        await _publish(client, "forever", 1000.0, ttl_seconds=86_400.0)
        assert (await _read(store))["forever"].heartbeat_at == 1000.0
        now[0] += MAX_REPORT_TTL_S - 1
        assert not (await _read(store))["forever"].is_stale(now[0])
        now[0] += 2
        assert (await _read(store))["forever"].is_stale(now[0])
    finally:
        await client.aclose()
