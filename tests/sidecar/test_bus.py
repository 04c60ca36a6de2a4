"""The Redis side against a real redis-server: target reads, reports with TTL and notices, outages."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from e2e.fixtures.processes import wait_for_port
from loraplane.api import (
    AdapterTarget,
    Artifact,
    LoraSpec,
    ResidencyReport,
    TargetState,
    Tier,
    cache_key,
    keys,
)
from loraplane.sidecar.bus import InvalidTarget, RedisBus, RedisRefused, RedisUnavailable
from loraplane.sidecar.reconcile import Backoff


def report(pod: str = "pod-0") -> ResidencyReport:
    return ResidencyReport(pool="pool-a", pod=pod, address="127.0.0.1:1", heartbeat_at=time.time(), ttl_seconds=2.5)


async def test_target_report_and_notices(redis_srv) -> None:
    bus = RedisBus(redis_srv.url, "pool-a", "pod-0")
    client = aioredis.Redis.from_url(redis_srv.url)
    try:
        assert await bus.read_target() is None  # no key: no instruction
        state = TargetState(pool="pool-a", pod="pod-0", generation=4, updated_at=1.0)
        await client.set(keys.target_state("pool-a", "pod-0"), state.to_json())
        assert (await bus.read_target()) == state

        pubsub = client.pubsub()
        await pubsub.subscribe(keys.residency_changed_channel("pool-a"))
        await pubsub.get_message(timeout=1)
        await bus.publish(report())
        stored = ResidencyReport.from_json(await client.get(keys.residency_report("pool-a", "pod-0")))
        assert stored.pod == "pod-0"
        assert 0 < await client.pttl(keys.residency_report("pool-a", "pod-0")) <= 2500
        assert await client.smembers(keys.residency_index("pool-a")) == {b"pod-0"}
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
        assert message is not None and message["data"] == b"pod-0"
        await pubsub.aclose()

        for bad in (b"{not json", TargetState(pool="pool-a", pod="pod-9", generation=1, updated_at=0).to_json(),
                    TargetState(pool="pool-a", pod="pod-0", generation=1, updated_at=0, schema_version=99).to_json()):
            await client.set(keys.target_state("pool-a", "pod-0"), bad)
            with pytest.raises(InvalidTarget):
                await bus.read_target()
    finally:
        await bus.close()
        await client.aclose()


async def test_a_target_by_reference_waits_whole_for_its_catalogue_entries(redis_srv) -> None:
    """A state naming a catalogue entry that is not there is refused whole (the service keeps its last good target,
    never acting on half of it); once the controller's repair writes the entry back, it is read resolved."""
    bus = RedisBus(redis_srv.url, "pool-a", "pod-0")
    client = aioredis.Redis.from_url(redis_srv.url)
    digest = "sha256:" + "a" * 64
    whole = TargetState(pool="pool-a", pod="pod-0", generation=5, updated_at=1.0, adapters=[AdapterTarget(
        served_name="claims@v1", adapter="claims", revision="v1", tier=Tier.GPU,
        artifact=Artifact(uri="oci://registry.local/claims:v1", digest=digest),
        lora=LoraSpec(rank=8, alpha=16, target_modules=["q_proj"]), base_model_digest="sha256:" + "b" * 64,
        cache_key=cache_key("sha256:" + "b" * 64, "claims", "v1", digest))])
    compact, specs = whole.by_reference()
    try:
        await client.set(keys.target_state("pool-a", "pod-0"), compact.to_json())
        with pytest.raises(InvalidTarget, match="claims@v1"):
            await bus.read_target()
        await client.set(keys.target_spec("pool-a", "claims@v1"), specs[0].to_json())
        assert await bus.read_target() == whole
    finally:
        await bus.close()
        await client.aclose()


async def test_watch_notifies_for_this_pod_and_after_resubscribing(redis_srv) -> None:
    bus = RedisBus(redis_srv.url, "pool-a", "pod-0", backoff=Backoff(0.05, 0.2))
    client = aioredis.Redis.from_url(redis_srv.url)
    notices: list[float] = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(bus.watch_targets(lambda: notices.append(time.monotonic()), stop))
    try:
        async def wait_for(count: int) -> None:
            for _ in range(100):
                if len(notices) >= count:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"{len(notices)} notices, expected {count}")

        await wait_for(1)  # the first subscription
        channel = keys.target_changed_channel("pool-a")
        await client.publish(channel, "pod-1")
        await client.publish(channel, "pod-0")
        await wait_for(2)
        await asyncio.sleep(0.2)
        assert len(notices) == 2  # pod-1's notice is not ours
        await client.client_kill_filter(_type="pubsub")
        await wait_for(3)  # resubscribed, and told to re-read
    finally:
        stop.set()
        await watcher
        await bus.close()
        await client.aclose()


async def test_outage_fails_fast_then_backs_off_and_recovers(redis_srv) -> None:
    now = [0.0]
    bus = RedisBus(redis_srv.url, "pool-a", "pod-0", backoff=Backoff(1.0, 4.0), clock=lambda: now[0],
                   socket_timeout_s=0.5)
    try:
        await bus.publish(report())
        assert bus.connected
        redis_srv.process.stop()
        with pytest.raises(RedisUnavailable):
            await bus.read_target()
        assert not bus.connected
        with pytest.raises(RedisUnavailable, match="next attempt"):
            await bus.publish(report())  # inside the backoff window: not even tried
        redis_srv.process.start()
        wait_for_port(redis_srv.port, proc=redis_srv.process.proc)
        now[0] += 5.0
        await bus.publish(report())
        assert bus.connected
    finally:
        await bus.close()


async def test_a_full_redis_refusing_the_report_is_a_refusal_not_an_outage(redis_srv, caplog) -> None:
    """Redis at ``maxmemory`` with ``noeviction`` answers every write with OOM: the sidecar says Redis refused it
    (issue 31: it logged "redis unreachable"), holds no backoff against the next heartbeat, and says so once."""
    bus = RedisBus(redis_srv.url, "pool-a", "pod-0")
    client = aioredis.Redis.from_url(redis_srv.url)
    try:
        await bus.publish(report())
        used = (await client.info("memory"))["used_memory"]
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", max(1, used - 4096))
        caplog.set_level("INFO", logger="loraplane.sidecar.bus")
        for _ in range(3):
            with pytest.raises(RedisRefused):
                await bus.publish(report())
        assert bus.refusals == 3 and bus.connected  # reachable: only the writes fail
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "redis refused the write (OutOfMemoryError" in warnings[0]
        assert not any("unreachable" in r.getMessage() for r in caplog.records)
        await client.config_set("maxmemory", 0)
        await bus.publish(report())  # no backoff window to wait out
        assert any("accepts writes again" in r.getMessage() for r in caplog.records)
    finally:
        await client.config_set("maxmemory", 0)
        await client.aclose()
        await bus.close()
