"""Envoy against the picker's stream limit: with ``--max-concurrent-streams 4`` (and the picker cluster told the same,
as ``picker_config`` does) and 24 requests held open at once (each holds an ext_proc stream until its response ends),
Envoy opens more connections to the picker: every request succeeds, none meets REFUSED_STREAM, also on a connection
whose first streams go out before the picker's SETTINGS arrive.

Real Redis (a report and a route table written as the sidecar and the controller would), a real echo backend, the
real picker CLI and Envoy.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from e2e.fixtures.picker import STATIC_REPORT_TTL_S, gateway
from e2e.fixtures.processes import LOOPBACK, ManagedProcess, free_port, start_redis, wait_for_port
from loraplane.api import (
    AdapterResidency,
    ResidencyReport,
    RouteEntry,
    RouteTable,
    Tier,
    WeightedRevision,
    keys,
)

pytestmark = pytest.mark.slow

POOL = "pool-streams"
DIGEST = "sha256:" + "f" * 64


def established(port: int) -> int:
    """Established TCP connections accepted on ``port`` (from /proc/net/tcp)."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for line in lines if line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "01")


def test_envoy_opens_more_connections_instead_of_failing_at_the_stream_limit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    redis_server = start_redis(tmp_path)
    port = free_port()
    backend = ManagedProcess([sys.executable, "-m", "e2e.fixtures.echo_backend", "--port", str(port), "--pod", "pod-a"],
                             tmp_path / "backend.log").start()
    try:
        wait_for_port(port, proc=backend.proc)
        client = redis.Redis.from_url(redis_server.url)
        client.set(keys.route_table(POOL), RouteTable(pool=POOL, generation=1, updated_at=time.time(), models={
            "claims": RouteEntry(revisions=[WeightedRevision(revision="v1", served_name="claims@v1", digest=DIGEST,
                                                             weight=100)])}).to_json())
        report = ResidencyReport(pool=POOL, pod="pod-a", address=f"{LOOPBACK}:{port}", heartbeat_at=time.time(),
                                 ttl_seconds=STATIC_REPORT_TTL_S, adapters=[AdapterResidency(served_name="claims@v1", tier=Tier.GPU, digest=DIGEST)])
        client.set(keys.residency_report(POOL, "pod-a"), report.to_json())
        client.sadd(keys.residency_index(POOL), "pod-a")
        gateways = gateway(tmp_path, POOL, redis_server.url, max_concurrent_streams=4)
        gw = next(gateways)
        try:
            def post(i: int) -> int:
                response = httpx.post(f"{gw.url}/v1/completions", timeout=30,
                                      json={"model": "claims", "prompt": f"p{i}", "sleep_s": 1.5})
                return response.status_code

            most, done = 0, threading.Event()

            def watch() -> None:
                nonlocal most
                while not done.wait(0.05):
                    most = max(most, established(gw.picker_port))

            watcher = threading.Thread(target=watch)
            watcher.start()
            with ThreadPoolExecutor(24) as pool:
                statuses = list(pool.map(post, range(24)))
            done.set()
            watcher.join()
            print(f"\n[24 concurrent requests, picker stream limit 4] statuses {sorted(set(statuses))}, "
                  f"at most {most} Envoy connections to the picker")
            assert statuses == [200] * 24
            assert most >= 6  # 24 streams held at once, 4 per connection
        finally:
            gateways.close()
    finally:
        backend.stop()
        redis_server.stop()
