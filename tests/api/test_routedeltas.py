"""The route table written by change (``routedeltas``), against a real redis-server with the controller's writer.

A table larger than ``route_snapshot_bytes`` is written as one delta per change (bytes in proportion to the change);
a reader catches up from its own generation, and a lost or reordered delta is never half applied: the reader
falls back to the snapshot plus what chains onto it, and the controller's repair rewrites the table whole.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from e2e.fixtures.processes import RedisServer
from loraplane.api import RouteEntry, RouteTable, WeightedRevision, keys
from loraplane.api.routedeltas import RouteDelta, RouteHead, apply, diff, read_route_table
from loraplane.controller.store import RedisStore
from loraplane.picker.routes import RouteResolver
from loraplane.picker.snapshot import InFlightTracker
from loraplane.picker.state import PoolState, RedisSync
from loraplane.picker.telemetry import RequestStats

POOL = "p"


def _entry(name: str, version: str = "v1", weight: int = 100) -> RouteEntry:
    revisions = [WeightedRevision(revision=version, served_name=f"{name}@{version}", digest="sha256:" + "1" * 64,
                                  weight=weight)]
    if weight < 100:
        revisions.append(WeightedRevision(revision="v0", served_name=f"{name}@v0", digest="sha256:" + "2" * 64,
                                          weight=100 - weight))
    return RouteEntry(revisions=revisions)


def _models(n: int) -> dict[str, RouteEntry]:
    return {f"adapter-{i:04d}": _entry(f"adapter-{i:04d}") for i in range(n)}


async def _store(redis_srv: RedisServer, n: int = 300) -> tuple[RedisStore, aioredis.Redis, dict[str, RouteEntry]]:
    client = aioredis.Redis.from_url(redis_srv.url)
    store = RedisStore(client, clock=time.time, writer="ctl@1", route_snapshot_bytes=1024)
    models = _models(n)
    assert await store.write_routes(POOL, models, "base")
    return store, client, models


def test_diff_and_apply_round_trip() -> None:
    old = RouteTable(pool=POOL, generation=4, models=_models(5), updated_at=1.0, writer="w", base_model="b")
    models = dict(old.models)
    del models["adapter-0001"]
    models["adapter-0002"] = _entry("adapter-0002", "v2", 30)
    models["new"] = _entry("new")
    new = RouteTable(pool=POOL, generation=5, models=models, updated_at=2.0, writer="w", base_model="b",
                     staging_pods=["pod-1"])
    delta = diff(old, new)
    assert (sorted(delta.upserts), delta.removes, delta.staging_pods) == (["adapter-0002", "new"], ["adapter-0001"],
                                                                        ["pod-1"])
    applied = apply(old, [delta])
    assert applied is not None and applied.models == new.models and applied.staging_pods == ["pod-1"]
    assert applied.generation == 5 and old.generation == 4 and "adapter-0001" in old.models  # old left as it was
    assert applied.models["adapter-0000"] is old.models["adapter-0000"]  # untouched entries are shared


def test_a_table_made_by_apply_names_its_change_so_a_reader_compares_nothing() -> None:
    """``changed_names`` of a table ``apply`` made from the one held is the deltas' names, whatever the rest of the
    table holds (10,000 names: O(the change), not O(the table)); compared with any other table, every name is."""
    from loraplane.api.routedeltas import changed_names

    old = RouteTable(pool=POOL, generation=7, models=_models(50), updated_at=1.0, writer="w")
    same_again = RouteDelta(pool=POOL, generation=8, base=7, writer="w", updated_at=2.0,
                            upserts={"adapter-0003": _entry("adapter-0003")}, removes=["adapter-0009"])
    applied = apply(old, [same_again])
    assert applied is not None
    # the upsert equals the entry held: a comparison would not see it; the delta names it (indexed again: harmless)
    assert changed_names(old, applied) == {"adapter-0003", "adapter-0009"}
    rebuilt = RouteTable(pool=POOL, generation=8, models=dict(applied.models), updated_at=2.0, writer="w")
    assert changed_names(old, rebuilt) == {"adapter-0009"}  # no record of how it was made: compared
    assert applied == rebuilt  # the record is not part of the table


def test_a_delta_that_does_not_chain_is_not_applied_at_all() -> None:
    old = RouteTable(pool=POOL, generation=4, models=_models(3), updated_at=1.0, writer="w")
    step5 = old.model_copy(update={"generation": 5, "models": {**old.models, "x": _entry("x")}})
    step6 = step5.model_copy(update={"generation": 6, "models": {**step5.models, "y": _entry("y")}})
    d5, d6 = diff(old, step5), diff(step5, step6)
    assert apply(old, [d6]) is None  # 5 lost
    assert apply(old, [d6, d5]) is None  # reordered
    assert apply(old, [d5.model_copy(update={"writer": "other"})]) is None  # another writer's
    assert apply(old, [d5, d6]) == step6


async def test_a_change_of_a_large_table_writes_kilobytes(redis_srv: RedisServer) -> None:
    store, client, models = await _store(redis_srv)
    snapshot_bytes = store.bytes_written
    assert snapshot_bytes > 30_000
    before = store.bytes_written
    models["adapter-0007"] = _entry("adapter-0007", "v2", 10)
    assert await store.write_routes(POOL, models, "base")
    assert store.bytes_written - before < 1_000
    assert RouteDelta.from_json(await client.get(keys.route_delta(POOL, 2))).upserts == {
        "adapter-0007": models["adapter-0007"]}
    head = RouteHead.from_json(await client.get(keys.route_head(POOL)))
    assert (head.generation, head.snapshot) == (2, 1)
    assert RouteTable.from_json(await client.get(keys.route_table(POOL))).generation == 1  # the snapshot stays
    table = await read_route_table(client, POOL)
    assert table is not None and table.generation == 2 and table.models == models
    await client.aclose()


async def test_deltas_add_up_to_a_new_snapshot(redis_srv: RedisServer) -> None:
    store, client, models = await _store(redis_srv, n=40)
    snapshot_bytes = len(await client.get(keys.route_table(POOL)))
    for i in range(40):
        models[f"adapter-{i:04d}"] = _entry(f"adapter-{i:04d}", "v2", 50)
        assert await store.write_routes(POOL, models, "base")
    head = RouteHead.from_json(await client.get(keys.route_head(POOL)))
    assert head.generation == 41 and 1 < head.snapshot <= 41
    # no more delta bytes after the snapshot than the snapshot itself
    after = await client.mget([keys.route_delta(POOL, g) for g in range(head.snapshot + 1, head.generation + 1)])
    assert sum(len(raw) for raw in after) <= snapshot_bytes * 1.5
    assert (await read_route_table(client, POOL)).models == models  # type: ignore[union-attr]
    await client.aclose()


async def test_a_restarted_chain_keeps_its_first_delta_so_readers_need_not_parse_the_table(
        redis_srv: RedisServer) -> None:
    """Where the writer starts a new chain (the table written whole again: deltas added up, the chain grew long or
    old), it writes the change as a delta too: a reader holding the generation before catches up by it, without
    reading the megabytes of the table (here: without the table key at all)."""
    store, client, models = await _store(redis_srv, n=40)
    for i in range(40):
        before = await read_route_table(client, POOL)
        models[f"adapter-{i:04d}"] = _entry(f"adapter-{i:04d}", "v2", 50)
        assert await store.write_routes(POOL, models, "base")
        head = RouteHead.from_json(await client.get(keys.route_head(POOL)))
        if head.snapshot == head.generation:  # this change restarted the chain
            break
    else:
        raise AssertionError("the chain never restarted")
    assert before is not None and before.generation == head.generation - 1
    await client.delete(keys.route_table(POOL))
    caught_up = await read_route_table(client, POOL, before)
    assert caught_up is not None and caught_up.generation == head.generation and caught_up.models == models
    await client.aclose()


async def test_a_reader_catches_up_from_its_generation_and_never_sees_half_a_change(redis_srv: RedisServer) -> None:
    store, client, models = await _store(redis_srv)
    reader = await read_route_table(client, POOL)
    assert reader is not None and reader.generation == 1
    models["adapter-0001"] = _entry("adapter-0001", "v2", 20)
    models["adapter-0002"] = _entry("adapter-0002", "v2", 20)
    del models["adapter-0003"]
    await store.write_routes(POOL, models, "base")
    seen: list[RouteTable] = []
    get = client.get

    async def watching_get(name: str) -> bytes | None:  # what a reader holds between its round trips
        seen.append(reader)
        return await get(name)

    client.get = watching_get  # type: ignore[method-assign]
    caught_up = await read_route_table(client, POOL, reader)
    assert caught_up is not None and caught_up.generation == 2 and caught_up.models == models
    assert reader.generation == 1 and "adapter-0003" in reader.models  # the table in use was never edited
    assert all(t is reader for t in seen)
    await client.aclose()


@pytest.mark.parametrize("damage", ["lost", "reordered"])
async def test_a_lost_or_reordered_delta_is_repaired(redis_srv: RedisServer, damage: str) -> None:
    store, client, models = await _store(redis_srv)
    reader = await read_route_table(client, POOL)
    for name in ("adapter-0010", "adapter-0011", "adapter-0012"):
        models[name] = _entry(name, "v2", 50)
        await store.write_routes(POOL, models, "base")  # generations 2, 3, 4
    if damage == "lost":
        await client.delete(keys.route_delta(POOL, 3))
    else:  # 3 and 4 swapped under their keys
        three, four = await client.mget([keys.route_delta(POOL, 3), keys.route_delta(POOL, 4)])
        await client.mset({keys.route_delta(POOL, 3): four, keys.route_delta(POOL, 4): three})
    assert reader is not None
    partial = await read_route_table(client, POOL, reader)
    # nothing after the gap is applied: generation 2 whole (from the snapshot + delta 2), never 4 with 3 missing
    assert partial is not None and partial.generation == 2
    assert partial.models["adapter-0010"] == models["adapter-0010"]
    assert partial.models["adapter-0011"] == _entry("adapter-0011")
    repaired = await store.repair(POOL)
    assert repaired == [keys.route_table(POOL)]
    head = RouteHead.from_json(await client.get(keys.route_head(POOL)))
    assert head.generation == head.snapshot > 4  # the table whole again, above every copy
    fixed = await read_route_table(client, POOL, partial)
    assert fixed is not None and fixed.models == models and fixed.generation == head.generation
    assert await store.repair(POOL) == []
    await client.aclose()


async def test_a_new_controller_reads_the_chain_back_and_writes_whole(redis_srv: RedisServer) -> None:
    store, client, models = await _store(redis_srv)
    models["adapter-0005"] = _entry("adapter-0005", "v2", 50)
    await store.write_routes(POOL, models, "base")
    successor = RedisStore(client, clock=time.time, writer="ctl@2", route_snapshot_bytes=1024)
    await successor.load_written(POOL)
    assert successor.routes[POOL] is not None and successor.routes[POOL].models == models  # type: ignore[union-attr]
    assert await successor.repair(POOL) == []  # the chain as read is what it goes on from
    models["adapter-0006"] = _entry("adapter-0006", "v2", 50)
    await successor.write_routes(POOL, models, "base")
    head = RouteHead.from_json(await client.get(keys.route_head(POOL)))
    assert (head.generation, head.snapshot, head.writer) == (3, 3, "ctl@2")  # its own chain starts whole
    await client.aclose()


async def test_a_table_written_whole_by_hand_is_read_as_before(redis_srv: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_srv.url)
    table = RouteTable(pool=POOL, generation=7, models=_models(2), updated_at=1.0)
    await client.set(keys.route_table(POOL), table.to_json())
    assert await read_route_table(client, POOL) == table
    await asyncio.sleep(0)
    await client.aclose()


async def test_the_picker_follows_the_deltas_indexing_only_what_changed(redis_srv: RedisServer) -> None:
    store, client, models = await _store(redis_srv)
    state = PoolState(POOL, InFlightTracker(), time.time)
    sync = RedisSync(state, aioredis.Redis.from_url(redis_srv.url), RequestStats(time.time), "picker-0",
                     resync_seconds=60, publish_seconds=60)
    stop = asyncio.Event()
    task = asyncio.create_task(sync.run(stop))
    try:
        deadline = time.monotonic() + 5
        while state.resolver.generation != 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        first = state.resolver
        assert "adapter-0004@v1" in first.priorities()
        models["adapter-0004"] = _entry("adapter-0004", "v2", 40)
        await store.write_routes(POOL, models, "base")
        while state.resolver.generation != 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        now = state.resolver
        assert now.table is not None and now.table.models == models
        assert {r.logical for r in (now.served("adapter-0004@v2"), now.served("adapter-0004@v0")) if r} == {
            "adapter-0004"}
        assert now.served("adapter-0004@v1") is None and first.served("adapter-0004@v1") is not None
        assert now.priorities() == RouteResolver(now.table).priorities()
        assert now._routes["adapter-0005"] is first._routes["adapter-0005"]  # taken over, not indexed again
        assert now._routes == RouteResolver(now.table)._routes
    finally:
        stop.set()
        await task
        await client.aclose()
