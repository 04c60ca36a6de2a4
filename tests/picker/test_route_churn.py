"""``bench picker --route-churn``'s writer: the table written whole once, then each change as the controller writes
it (one delta and the head), which a reader catches up on from the table it holds."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis
from redis import asyncio as aioredis

from loraplane.api import keys
from loraplane.api.routedeltas import read_route_table
from loraplane.bench.picker import POOL, RouteChurn
from loraplane.processes import start_redis


def test_route_churn_writes_each_change_as_a_delta_a_reader_applies(tmp_path: Path) -> None:
    server = start_redis(tmp_path)
    churn = RouteChurn(server.url, adapters=2_000, interval=0.02)
    try:
        churn.start()

        async def read(current: object = None) -> object:
            client = aioredis.Redis.from_url(server.url)
            try:
                return await read_route_table(client, POOL, current)  # type: ignore[arg-type]
            finally:
                await client.aclose()

        first = asyncio.run(read())
        assert first is not None and len(first.models) == 2_001  # type: ignore[attr-defined]
        whole = churn.table_bytes
        with churn.churning():
            deadline = time.monotonic() + 30
            while churn.changes < 5 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert churn.changes >= 5
        # each change is a delta and the head: a small fraction of the table written whole
        assert churn.bytes_written / churn.changes < whole / 20
        latest = asyncio.run(read(first))
        assert latest.generation == first.generation + churn.changes  # type: ignore[attr-defined]
        changed = latest.models[f"adapter-{(churn.changes - 1) % 2_000}"]  # type: ignore[attr-defined]
        assert [r.revision for r in changed.revisions] == ["v1", "v2"]
        assert asyncio.run(read()) == latest  # from the snapshot and the chain after it: the same table
        assert redis.Redis.from_url(server.url).exists(keys.route_delta(POOL, latest.generation))  # type: ignore[attr-defined]
    finally:
        churn.close()
        server.stop()
