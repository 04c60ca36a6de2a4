"""The controller's Redis writes are level-triggered: a lost or overwritten key comes back on the next pass.

Against a real redis-server: keys deleted (as by a Redis restart) or replaced by a forged copy are rewritten by
``RedisStore.repair`` with a generation above both copies; an untouched store writes nothing; readers refuse an
older generation from the same writer.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from e2e.fixtures.processes import RedisServer
from loraplane import api
from loraplane.api import (
    AdapterResidency,
    AdapterTarget,
    PickerCounters,
    RequestRates,
    ResidencyReport,
    RouteEntry,
    RouteTable,
    TargetSpec,
    TargetState,
    Tier,
    WeightedRevision,
    keys,
)
from loraplane.api.routing import supersedes
from loraplane.controller.store import SPEC_EXPIRY_SECONDS, RedisStore

POOL = "p"
ROUTES = {"claims": RouteEntry(revisions=[WeightedRevision(revision="v1", served_name="claims@v1",
                                                            digest="sha256:" + "1" * 64, weight=100)])}



def _target(adapter: str, tier: Tier) -> AdapterTarget:
    digest = "sha256:" + "a" * 64
    return AdapterTarget(served_name=f"{adapter}@v1", adapter=adapter, revision="v1", tier=tier,
                         artifact=api.Artifact(uri=f"oci://registry.local/{adapter}:v1", digest=digest),
                         lora=api.LoraSpec(rank=8, alpha=16, target_modules=["q_proj"]),
                         base_model_digest="sha256:" + "b" * 64,
                         cache_key=api.cache_key("sha256:" + "b" * 64, adapter, "v1", digest))


async def _written(redis_srv: RedisServer) -> tuple[RedisStore, aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_srv.url)
    store = RedisStore(client, clock=lambda: 1000.0, writer="ctl@1")
    assert await store.write_routes(POOL, ROUTES, "tiny")
    assert await store.write_targets(POOL, {"pod-a": [], "pod-b": []}) == ["pod-a", "pod-b"]
    return store, client


async def test_an_untouched_store_is_not_rewritten(redis_srv: RedisServer) -> None:
    store, client = await _written(redis_srv)
    writes = store.writes
    assert await store.repair(POOL) == []
    assert store.writes == writes
    await client.aclose()


async def test_lost_keys_come_back_with_a_higher_generation_and_a_notice(redis_srv: RedisServer) -> None:
    store, client = await _written(redis_srv)
    pubsub = client.pubsub()
    await pubsub.subscribe(keys.routes_changed_channel(POOL), keys.target_changed_channel(POOL))
    await client.flushall()  # what a Redis restart without persistence leaves
    repaired = await store.repair(POOL)
    assert sorted(repaired) == sorted([keys.route_table(POOL), keys.target_state(POOL, "pod-a"),
                                       keys.target_state(POOL, "pod-b")])
    table = RouteTable.from_json(await client.get(keys.route_table(POOL)))
    assert (table.models, table.generation, table.writer) == (ROUTES, 2, "ctl@1")
    assert TargetState.from_json(await client.get(keys.target_state(POOL, "pod-a"))).generation == 2
    notices = []
    for _ in range(10):  # subscription confirmations come first (and read as None)
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if message is not None:
            notices.append(message["data"])
    assert sorted(notices) == [b"2", b"pod-a", b"pod-b"]
    assert await store.repair(POOL) == []  # repaired once, then stable
    await pubsub.aclose()
    await client.aclose()


async def test_a_forged_copy_is_overwritten_above_its_generation(redis_srv: RedisServer) -> None:
    store, client = await _written(redis_srv)
    forged = RouteTable(pool=POOL, generation=999, models={"claims": RouteEntry(revisions=[WeightedRevision(
        revision="evil", served_name="claims@evil", digest="sha256:" + "e" * 64, weight=100)])}, updated_at=1.0)
    await client.set(keys.route_table(POOL), forged.to_json())
    await client.set(keys.target_state(POOL, "pod-b"), b"not json")
    assert sorted(await store.repair(POOL)) == [keys.route_table(POOL), keys.target_state(POOL, "pod-b")]
    table = RouteTable.from_json(await client.get(keys.route_table(POOL)))
    assert table.models == ROUTES and table.generation == 1000
    assert TargetState.from_json(await client.get(keys.target_state(POOL, "pod-b"))).generation == 2
    # the next change continues above the repaired generation
    assert await store.write_routes(POOL, {}, "tiny")
    assert RouteTable.from_json(await client.get(keys.route_table(POOL))).generation == 1001
    await client.aclose()


def test_readers_refuse_an_older_generation_from_the_same_writer_only() -> None:
    def table(generation: int, writer: str | None) -> RouteTable:
        return RouteTable(pool=POOL, generation=generation, updated_at=0.0, writer=writer)

    assert not supersedes(table(4, "ctl@1"), table(5, "ctl@1"))
    assert supersedes(table(5, "ctl@1"), table(5, "ctl@1"))
    assert supersedes(table(1, "ctl@2"), table(5, "ctl@1"))  # a restarted controller starts its own sequence
    assert supersedes(table(1, None), table(5, "ctl@1"))
    assert supersedes(table(1, "ctl@1"), None)


async def test_the_staging_pods_alone_rewrite_the_route_table(redis_srv: RedisServer) -> None:
    store, client = await _written(redis_srv)
    assert await store.write_routes(POOL, ROUTES, "tiny", {"pod-b", "pod-a"})
    table = RouteTable.from_json(await client.get(keys.route_table(POOL)))
    assert (table.staging_pods, table.generation, table.models) == (["pod-a", "pod-b"], 2, ROUTES)
    assert not await store.write_routes(POOL, ROUTES, "tiny", ["pod-a", "pod-b"])  # unchanged: no write
    assert await store.write_routes(POOL, ROUTES, "tiny")  # staging over: every pod again
    assert RouteTable.from_json(await client.get(keys.route_table(POOL))).staging_pods == []
    await client.aclose()


async def test_the_pools_rates_are_every_picker_replicas_summed(redis_srv: RedisServer) -> None:
    """Issue 31, item 1: each picker replica publishes the rates of the requests it routed under its own key; the
    controller plans with their sum (one shared key kept the last writer's half: 12 req/s read as 6)."""
    client = aioredis.Redis.from_url(redis_srv.url)
    store = RedisStore(client, clock=lambda: 1000.0, writer="ctl@1")
    try:
        assert (await store.read(POOL)).rates is None
        for replica, rate, at in (("picker-0", 6.02, 10.0), ("picker-1", 5.98, 11.0)):
            rates = RequestRates(pool=POOL, replica=replica, published_at=at,
                                 windows={"5m": {"claims@v1": rate}, "1h": {"claims@v1": rate / 2, "other@v1": 1.0}})
            await client.set(keys.request_rates(POOL, replica), rates.to_json())
            await client.set(keys.picker_counters(POOL, replica),
                             PickerCounters(pool=POOL, replica=replica, published_at=at).to_json())
        await client.set(keys.picker_counters(POOL, "picker-2"),  # a replica whose rates expired: counted as none
                         PickerCounters(pool=POOL, replica="picker-2", published_at=9.0).to_json())
        readings = await store.read(POOL)
        assert readings.rates is not None and readings.rates.replica is None
        assert readings.rates.windows["5m"] == {"claims@v1": 12.0}
        assert readings.rates.windows["1h"] == {"claims@v1": 6.0, "other@v1": 2.0}
        assert readings.rates.published_at == 11.0
        assert sorted(r.replica or "" for r in readings.replica_rates) == ["picker-0", "picker-1"]
    finally:
        await client.aclose()


async def test_check_counts_keys_between_thorough_comparisons_of_a_large_pool(redis_srv: RedisServer) -> None:
    """``check`` on a pool above ``thorough_bytes``: a lost key comes back at once (one EXISTS finds it missing), a key
    overwritten in place at the next thorough comparison (``thorough_seconds``); a small pool is compared each time."""
    now = [1000.0]
    client = aioredis.Redis.from_url(redis_srv.url)
    store = RedisStore(client, clock=lambda: now[0], writer="ctl@1")
    await store.write_routes(POOL, ROUTES, "tiny")
    await store.write_targets(POOL, {"pod-a": [], "pod-b": []})
    assert await store.check(POOL) == []  # compared: small
    store.thorough_bytes, store.thorough_seconds = 0, 10.0
    await client.set(keys.target_state(POOL, "pod-a"), b"forged")
    assert await store.check(POOL) == []  # within the period: counted only
    await client.delete(keys.target_state(POOL, "pod-b"))
    assert sorted(await store.check(POOL)) == [keys.target_state(POOL, "pod-a"), keys.target_state(POOL, "pod-b")]
    await client.set(keys.target_state(POOL, "pod-a"), b"forged again")
    assert await store.check(POOL) == []
    now[0] += 10
    assert await store.check(POOL) == [keys.target_state(POOL, "pod-a")]
    await client.aclose()


async def test_targets_are_written_by_reference_each_spec_once_and_a_lost_spec_comes_back(
        redis_srv: RedisServer) -> None:
    """A target state names its entries by reference: each revision's catalogue entry is written once however many
    pods hold it, a pod's change writes only its state, an entry no state names expires, and ``repair`` writes a
    lost entry back (a sidecar missing it keeps its last good target until then)."""
    client = aioredis.Redis.from_url(redis_srv.url)
    store = RedisStore(client, clock=lambda: 1000.0, writer="ctl@1")
    claims, legal = _target("claims", Tier.GPU), _target("legal", Tier.CPU)
    try:
        await store.write_targets(POOL, {"pod-a": [claims, legal], "pod-b": [claims]})
        assert store.writes == 2 + 2  # two states, two catalogue entries
        stored = TargetState.from_json(await client.get(keys.target_state(POOL, "pod-b")))
        assert stored.adapters == [] and stored.tiers() == {"claims@v1": Tier.GPU}
        assert TargetSpec.from_json(await client.get(keys.target_spec(POOL, "claims@v1"))) == claims.spec(POOL)
        writes = store.writes
        await store.write_targets(POOL, {"pod-a": [claims, legal], "pod-b": [claims, legal.model_copy(
            update={"tier": Tier.DISK})]})
        assert store.writes == writes + 1  # pod-b's state alone: its new entry's spec is in the catalogue already
        await store.write_targets(POOL, {"pod-a": [claims], "pod-b": [claims]})
        assert 0 < await client.ttl(keys.target_spec(POOL, "legal@v1")) <= SPEC_EXPIRY_SECONDS  # named by none
        assert await client.ttl(keys.target_spec(POOL, "claims@v1")) == -1
        await client.delete(keys.target_spec(POOL, "claims@v1"))
        assert await store.repair(POOL) == [keys.target_spec(POOL, "claims@v1")]
        assert TargetSpec.from_json(await client.get(keys.target_spec(POOL, "claims@v1"))) == claims.spec(POOL)
        # a new leader reads the states back whole, through the catalogue
        leader = RedisStore(client, clock=lambda: 1001.0, writer="ctl@2")
        assert (await leader.load_written(POOL))["pod-a"].adapters == [claims]
    finally:
        await client.aclose()


async def test_a_deleted_revision_is_retired_on_the_pods_that_hold_it_only(redis_srv: RedisServer) -> None:
    """``retired`` per pod: the revisions being deleted that the pod's last state named or its report lists (its
    disk cache included), until its report no longer lists them; a pod that never held it is not written."""
    client = aioredis.Redis.from_url(redis_srv.url)
    store = RedisStore(client, clock=lambda: 1000.0, writer="ctl@1")
    claims, legal = _target("claims", Tier.GPU), _target("legal", Tier.CPU)
    try:
        await store.write_targets(POOL, {"pod-a": [claims, legal], "pod-b": [claims], "pod-c": [claims]})
        # pod-c's sidecar still has legal in its disk cache (a target of long ago): its report says so
        row = AdapterResidency(served_name="legal@v1", tier=Tier.DISK)
        for pod, rows in (("pod-a", [row]), ("pod-b", []), ("pod-c", [row])):
            report = ResidencyReport(pool=POOL, pod=pod, address="10.0.0.1:8000", heartbeat_at=999.0,
                                     ttl_seconds=60.0, adapters=rows)
            await client.set(keys.residency_report(POOL, pod), report.to_json())
            await client.sadd(keys.residency_index(POOL), pod)
        await store.read(POOL)
        written = await store.write_targets(POOL, {"pod-a": [claims], "pod-b": [claims], "pod-c": [claims]},
                                            retired=["legal@v1"])
        assert written == ["pod-a", "pod-c"]  # pod-b never held it: not rewritten
        assert store.targets[POOL]["pod-c"].retired == ["legal@v1"]
        again = ResidencyReport(pool=POOL, pod="pod-c", address="10.0.0.1:8000", heartbeat_at=1000.0, ttl_seconds=60.0)
        await client.set(keys.residency_report(POOL, "pod-c"), again.to_json())  # released from its disk cache
        await store.read(POOL)
        assert await store.write_targets(POOL, {"pod-a": [claims], "pod-b": [claims], "pod-c": [claims]},
                                         retired=["legal@v1"]) == ["pod-c"]
        assert store.targets[POOL]["pod-c"].retired == [] and store.targets[POOL]["pod-a"].retired == ["legal@v1"]
    finally:
        await client.aclose()
