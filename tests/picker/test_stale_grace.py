"""Stale means not heard from, not absent everywhere: while reports are past their TTL (Redis paused or refusing
writes, a sidecar silent), requests keep going to the pods last known to hold their revision: as last heard within
the grace, and as a fallback (where no fresh pod holds the revision) after it."""

from __future__ import annotations

import numpy as np
import pytest
import redis.asyncio as aioredis

from e2e.fixtures.processes import RedisServer
from loraplane.api import AdapterResidency, ResidencyReport, Tier, keys
from loraplane.picker.body import ClientError
from loraplane.picker.plugins import SchedulingRequest
from loraplane.picker.routes import UnknownModelError
from loraplane.picker.scheduler import Outcome, Scheduler
from loraplane.picker.snapshot import InFlightTracker
from loraplane.picker.state import PoolState, RedisSync
from loraplane.picker.telemetry import RequestStats

DIGEST = "sha256:" + "a" * 64
ADAPTER = "claims@v1"


def _report(i: int, holds: bool) -> ResidencyReport:
    rows = [AdapterResidency(served_name=ADAPTER, tier=Tier.GPU, digest=DIGEST)] if holds else []
    return ResidencyReport(pool="pool", pod=f"pod-{i}", address=f"10.0.0.{i}:8000", heartbeat_at=0.0, ttl_seconds=3.0,
                           adapters=rows)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _destinations(grace: float, at: float) -> set[str]:
    clock = Clock()
    state = PoolState("pool", InFlightTracker(), clock, stale_grace_s=grace)
    for i in range(3):
        state.set_report(_report(i, holds=i == 1))
    state.rebuild()
    clock.now = at
    state.rebuild_if_expired()
    scheduler = Scheduler.default()
    picks = set()
    for seed in range(30):
        decision = scheduler.schedule(SchedulingRequest(served_name=ADAPTER, digest=DIGEST), state.snapshot,
                                      np.random.default_rng(seed))
        picks.add(decision.endpoints[0])
        assert decision.outcome is (Outcome.WARM_GPU if at < 3.0 + grace else Outcome.COLD)
    return picks


def test_within_the_grace_the_last_known_holder_keeps_the_traffic() -> None:
    assert _destinations(grace=30.0, at=1.0) == {"10.0.0.1:8000"}
    assert _destinations(grace=30.0, at=13.0) == {"10.0.0.1:8000"}  # 10 s past the TTL: still the holder


def test_past_the_grace_the_last_known_holder_is_the_fallback() -> None:
    """Every sidecar silent for longer than the grace: the pods still serve what they held (before issue 31 any pod
    was picked, most without the adapter: 404s)."""
    assert _destinations(grace=0.0, at=13.0) == {"10.0.0.1:8000"}
    assert _destinations(grace=30.0, at=40.0) == {"10.0.0.1:8000"}


async def test_an_emptied_redis_does_not_erase_what_the_picker_last_heard(redis_srv: RedisServer) -> None:
    """After a Redis restart the index and reports are gone until the sidecars' next heartbeats: a full resync
    in between keeps the last reports (within the grace) instead of an empty pool."""
    clock = Clock()
    state = PoolState("pool", InFlightTracker(), clock, stale_grace_s=30.0)
    client = aioredis.Redis.from_url(redis_srv.url)
    sync = RedisSync(state, client, RequestStats(clock), "picker-0")
    for i in range(2):
        report = _report(i, holds=i == 1)
        await client.set(keys.residency_report("pool", report.pod), report.to_json())
        await client.sadd(keys.residency_index("pool"), report.pod)
    await sync.load_all()
    assert sorted(state.reports) == ["pod-0", "pod-1"]
    await client.flushall()
    clock.now = 5.0
    await sync.load_all()
    assert sorted(state.reports) == ["pod-0", "pod-1"]
    assert state.snapshot.lookup(ADAPTER, DIGEST) is not None
    clock.now = 40.0
    await sync.load_all()
    assert sorted(state.reports) == ["pod-0", "pod-1"]  # past the grace, still not back in Redis: stale, kept
    assert state.snapshot.stale.all() and state.snapshot.last_heard_holders(ADAPTER, DIGEST) is not None
    clock.now = 1000.0
    await sync.load_all()
    assert sorted(state.reports) == ["pod-0", "pod-1"]  # nobody reports: never forgotten (issue 31, item 2)
    back = _report(1, holds=True).model_copy(update={"heartbeat_at": 1.0})
    await client.set(keys.residency_report("pool", back.pod), back.to_json())
    await client.sadd(keys.residency_index("pool"), back.pod)
    await sync.load_all()
    assert sorted(state.reports) == ["pod-1"]  # another pod reports again: the one silent for 1000 s is forgotten
    await client.aclose()


async def test_a_picker_that_has_not_read_redis_yet_answers_503_not_404(redis_srv: RedisServer) -> None:
    """A restarted picker does not know the models until its first full load: retryable 503, then the table."""
    state = PoolState("pool", InFlightTracker(), Clock())
    rng = np.random.default_rng(0)
    with pytest.raises(ClientError) as refused:
        state.resolver.resolve("claims", None, rng)
    assert (refused.value.status, refused.value.reason) == (503, "not-ready")
    with pytest.raises(ClientError) as refused:  # a model-name rewrite header's revision is not known yet either
        state.resolver.served("claims@v1")
    assert (refused.value.status, refused.value.reason) == (503, "not-ready")
    client = aioredis.Redis.from_url(redis_srv.url)
    await RedisSync(state, client, RequestStats(Clock()), "picker-0").load_all()  # Redis holds no table
    with pytest.raises(UnknownModelError):
        state.resolver.resolve("claims", None, rng)  # now known to be unknown: 404
    await client.aclose()
