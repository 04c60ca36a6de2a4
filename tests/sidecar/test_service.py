"""The sidecar's pass against a real Redis when the runtime is down: not ready, target kept, report published."""

from __future__ import annotations

import functools
import http.server
import threading
import time
from pathlib import Path

import redis.asyncio as aioredis

from e2e.fixtures.processes import free_port
from loraplane.api import LoadCosts, ResidencyReport, TargetState, Tier, keys
from loraplane.sidecar.artifacts import ArtifactSources, SourceConfig
from loraplane.sidecar.bus import RedisBus
from loraplane.sidecar.cache import DiskCache, StageTimings
from loraplane.sidecar.drivers import make_driver
from loraplane.sidecar.drivers.base import RuntimeInfo
from loraplane.sidecar.metrics import SidecarMetrics
from loraplane.sidecar.reconcile import Reconciler
from loraplane.sidecar.service import Sidecar, SidecarConfig
from tests.sidecar.adapters import sha256_of, target_for, write_weights


async def test_unreachable_runtime_is_reported_not_ready(tmp_path: Path, redis_srv) -> None:
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    weights = write_weights(artifacts / "w.safetensors")
    disk_target = target_for(f"file://{weights}", sha256_of(weights), tier=Tier.DISK)
    cache = DiskCache(tmp_path / "cache", 1 << 30, ArtifactSources(SourceConfig(file_roots=(artifacts,))))
    cache.fetch(disk_target, keep=(), timings=StageTimings())
    metrics = SidecarMetrics()
    driver = make_driver("engine", f"http://127.0.0.1:{free_port()}", RuntimeInfo(base_model=""))
    bus = RedisBus(redis_srv.url, "pool-a", "pod-0")
    sidecar = Sidecar(SidecarConfig("pool-a", "pod-0", "10.0.0.1:8000", "engine"), Reconciler(driver, cache, metrics),
                      bus)
    client = aioredis.Redis.from_url(redis_srv.url)
    try:
        state = TargetState(pool="pool-a", pod="pod-0", generation=7, adapters=[disk_target], updated_at=time.time())
        await client.set(keys.target_state("pool-a", "pod-0"), state.to_json())
        report = await sidecar.run_once()
        assert not report.ready and report.target_generation == 7
        stored = ResidencyReport.from_json(await client.get(keys.residency_report("pool-a", "pod-0")))
        assert not stored.ready and stored.address == "10.0.0.1:8000"
        row = stored.by_name()[disk_target.served_name]
        assert row.tier is Tier.DISK and row.digest == disk_target.artifact.digest and row.registered is False
        assert row.adapter_digest == cache.get(disk_target.cache_key).adapter_digest
        assert "sidecar_runtime_ready 0.0" in metrics.render().decode()

        await client.delete(keys.target_state("pool-a", "pod-0"))
        await sidecar.run_once()
        assert sidecar.target == state  # a missing key is no instruction: the last good target stays
        assert sidecar.build_report().load.load_seconds is None  # nothing measured: the picker's defaults apply
        sidecar.reconciler.load_costs.record(Tier.DISK, 0.3)  # the sidecar's own load-stage measurement
        sidecar.reconciler.load_costs.record(Tier.DISK, 0.5)
        assert sidecar.build_report().load.load_seconds == LoadCosts(disk=0.4)
    finally:
        await driver.close()
        await bus.close()
        await client.aclose()


async def test_an_unreadable_runtime_answer_means_not_ready(tmp_path: Path, redis_srv) -> None:
    """A runtime that answers garbage (here: a plain file server) is not ready; the sidecar keeps running."""
    (tmp_path / "admin").mkdir()
    (tmp_path / "admin" / "adapters").write_text("{not json")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cache = DiskCache(tmp_path / "cache", 1 << 20, ArtifactSources(SourceConfig()))
    driver = make_driver("engine", f"http://127.0.0.1:{server.server_address[1]}", RuntimeInfo(base_model=""))
    bus = RedisBus(redis_srv.url, "pool-a", "pod-0")
    sidecar = Sidecar(SidecarConfig("pool-a", "pod-0", "10.0.0.1:8000", "engine"),
                      Reconciler(driver, cache, SidecarMetrics()), bus)
    try:
        assert not (await sidecar.run_once()).ready
        assert not (await sidecar.run_once()).ready
    finally:
        server.shutdown()
        server.server_close()
        await driver.close()
        await bus.close()
