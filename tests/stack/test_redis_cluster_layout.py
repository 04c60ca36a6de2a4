"""Keys laid out for Redis Cluster: every key and channel of a pool hashes to the pool's one slot (the hash tag
``{pool}``), so the components' multi-key commands -- MGET, pipelines, the sidecar's MULTI -- never cross slots.

Checked by computation over every name ``loraplane.api.keys`` spells, and for real against a ``redis-server`` in
cluster mode (one node holding all 16,384 slots): such a node refuses with CROSSSLOT any multi-key command whose
keys hash to different slots, as a sharded cluster would, so each component's own Redis code runs against it.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import ResponseError

from loraplane.api import (
    AdapterResidency,
    ResidencyReport,
    RouteEntry,
    Tier,
    WeightedRevision,
    keys,
)
from loraplane.controller.store import RedisStore
from loraplane.picker.snapshot import InFlightTracker
from loraplane.picker.state import PoolState, RedisSync
from loraplane.picker.telemetry import RequestStats
from loraplane.processes import LOOPBACK, ManagedProcess, free_port, redis_server_binary, wait_for_port
from loraplane.sidecar.bus import RedisBus

POOL = "pool-a"
DIGEST = "sha256:" + "1" * 64


def _names_of(pool: str) -> list[str]:
    """Every key, pattern and channel name ``loraplane.api.keys`` spells for ``pool`` (one pod, one replica)."""
    names = []
    for name, fn in inspect.getmembers(keys, inspect.isfunction):
        if name.startswith("_") or fn.__module__ != keys.__name__:
            continue
        params = list(inspect.signature(fn).parameters.values())[1:]
        names.append(fn(pool, *(1 if p.annotation in (int, "int") else "pod-1" for p in params)))
    return names


def test_every_key_and_channel_of_a_pool_hashes_to_the_pools_slot() -> None:
    names = _names_of(POOL)
    assert len(names) == len(set(names)) >= 14  # every function of the module, patterns included
    assert {key_slot(n.encode()) for n in names} == {key_slot(POOL.encode())}
    assert key_slot(keys.route_table("pool-b").encode()) != key_slot(keys.route_table(POOL).encode())


@pytest.fixture(scope="module")
def cluster_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    work: Path = tmp_path_factory.mktemp("cluster")
    port = free_port()
    process = ManagedProcess([redis_server_binary(), "--port", str(port), "--bind", LOOPBACK, "--save", "",
                              "--appendonly", "no", "--dir", str(work), "--cluster-enabled", "yes",
                              "--cluster-config-file", str(work / "nodes.conf"),
                              # the bus port defaults to port + 10,000, beyond 65,535 for a high free port
                              "--cluster-port", str(free_port())], work / "redis.log").start()
    try:
        wait_for_port(port, proc=process.proc)
        admin = redis.Redis(port=port)
        admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + 30
        while b"cluster_state:ok" not in admin.execute_command("CLUSTER", "INFO"):
            assert time.monotonic() < deadline, "the cluster node did not take its slots"
            time.sleep(0.05)
        yield port
    finally:
        process.stop()


@pytest.fixture
async def client(cluster_node: int) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis(port=cluster_node, socket_timeout=2)
    await c.flushall()
    yield c
    await c.aclose()


@pytest.mark.slow
async def test_a_cluster_node_refuses_commands_across_pools(client: aioredis.Redis) -> None:
    """The control: what the layout avoids is refused."""
    with pytest.raises(ResponseError, match="hash to the same slot"):  # CROSSSLOT
        await client.mget([keys.route_table(POOL), keys.route_table("pool-b")])


@pytest.mark.slow
async def test_every_components_redis_code_runs_on_a_cluster_node(client: aioredis.Redis, cluster_node: int) -> None:
    url = f"redis://{LOOPBACK}:{cluster_node}/0"
    # the sidecar: its report, the report index and the notice in one MULTI
    bus = RedisBus(url, POOL, "pod-1")
    report = ResidencyReport(pool=POOL, pod="pod-1", address="127.0.0.1:1", heartbeat_at=time.time(),
                             ttl_seconds=30, adapters=[AdapterResidency(served_name="claims@v1", tier=Tier.GPU,
                                                                        digest=DIGEST)])
    await bus.publish(report)
    await bus.close()
    # the controller: its writes, its reads (MGET over reports, rates, counters), its read-back and repair
    store = RedisStore(client, clock=time.time, writer="ctl@1")
    routes = {"claims": RouteEntry(revisions=[WeightedRevision(revision="v1", served_name="claims@v1", digest=DIGEST,
                                                                weight=100)])}
    assert await store.write_routes(POOL, routes, "tiny")
    assert await store.write_targets(POOL, {"pod-1": [], "pod-2": []}) == ["pod-1", "pod-2"]
    # the picker: its rates and counters in one pipeline, then a full load (MGET over the reports)
    state = PoolState(POOL, InFlightTracker(), time.time)
    sync = RedisSync(state, client, RequestStats(time.time), "picker-0")
    await sync.publish_once()
    await sync.load_all()
    assert state.synced and state.snapshot.addresses == ("127.0.0.1:1",)
    readings = await store.read(POOL)
    assert [r.pod for r in readings.reports] == ["pod-1"] and readings.rates is not None
    assert sorted(await store.load_written(POOL)) == ["pod-1", "pod-2"]
    await client.delete(keys.target_state(POOL, "pod-2"))
    assert await store.repair(POOL) == [keys.target_state(POOL, "pod-2")]
