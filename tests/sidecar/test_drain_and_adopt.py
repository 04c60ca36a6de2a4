"""Against a real engine over HTTP (and a real Redis): a leaving adapter is reported draining before it is unloaded,
and a load the engine answers "already loaded" is adopted (same revision) or replaced (other bytes), never final."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import redis.asyncio as aioredis

from loraplane.api import (
    AdapterResidency,
    AdapterTarget,
    PodLoad,
    ResidencyReport,
    TargetState,
    Tier,
    cache_key,
    keys,
)
from loraplane.engine.app import BuiltEngine
from loraplane.engine.make_adapters import write_adapter
from loraplane.engine.model import LORA_MODULES, PRESETS
from loraplane.sidecar.artifacts import ArtifactSources, SourceConfig
from loraplane.sidecar.bus import RedisBus
from loraplane.sidecar.cache import DiskCache, StageTimings
from loraplane.sidecar.drivers import make_driver
from loraplane.sidecar.drivers.base import Observation, RuntimeDriver, RuntimeInfo
from loraplane.sidecar.metrics import SidecarMetrics
from loraplane.sidecar.reconcile import Action, Reconciler
from loraplane.sidecar.service import Sidecar, SidecarConfig
from tests.sidecar.adapters import sha256_of, tar_dir, target_for
from tests.sidecar.test_engine_driver import served_engine

POOL, POD = "pool-a", "pod-0"


@contextlib.asynccontextmanager
async def engine_with_artifact(
    tmp_path: Path, preset: str = "tiny"
) -> AsyncIterator[tuple[BuiltEngine, RuntimeDriver, AdapterTarget]]:
    """A real engine over HTTP, its driver, and the CPU-tier target of a real adapter made for ``preset``'s shapes
    (an artifact below ``tmp_path/artifacts``)."""
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    write_adapter(tmp_path / "made", PRESETS[preset], 8, seed=3)
    archive = tar_dir(tmp_path / "made", artifacts / "support.tar.gz")
    async with served_engine(tmp_path) as (built, url):
        driver = make_driver("engine", url, RuntimeInfo(base_model=""))
        try:
            base = (await driver.observe()).info.base_model_digest
            assert base is not None
            made = target_for(archive.as_uri(), sha256_of(archive), tier=Tier.CPU, dtype="float32",
                              modules=LORA_MODULES)
            yield built, driver, made.model_copy(update={
                "base_model_digest": base, "cache_key": cache_key(base, "support", "v1", made.artifact.digest)})
        finally:
            await driver.close()


def _cache(tmp_path: Path) -> DiskCache:
    return DiskCache(tmp_path / "cache", 1 << 30, ArtifactSources(SourceConfig(file_roots=(tmp_path / "artifacts",))))


def _wish(generation: int, *targets: AdapterTarget) -> TargetState:
    return TargetState(pool=POOL, pod=POD, generation=generation, adapters=list(targets), updated_at=time.time())


async def test_a_leaving_adapter_is_reported_draining_then_unloaded_after_the_grace(tmp_path: Path, redis_srv) -> None:
    now = [1000.0]
    async with engine_with_artifact(tmp_path) as (built, driver, support):
        bus = RedisBus(redis_srv.url, POOL, POD)
        client = aioredis.Redis.from_url(redis_srv.url)
        notices = client.pubsub()
        try:
            reconciler = Reconciler(driver, _cache(tmp_path), SidecarMetrics(), clock=lambda: now[0],
                                    drain_grace_s=1.0)
            sidecar = Sidecar(SidecarConfig(POOL, POD, "10.0.0.1:8000", "engine"), reconciler, bus,
                              clock=lambda: now[0])
            registered = built.engine.tiers.registered

            async def settle() -> ResidencyReport:
                report = await sidecar.run_once()
                await reconciler.drain()
                return report

            await client.set(keys.target_state(POOL, POD), _wish(1, support).to_json())
            for _ in range(5):
                await settle()
            assert support.served_name in registered

            await notices.subscribe(keys.residency_changed_channel(POOL))
            await notices.get_message(timeout=1.0)  # the subscribe confirmation
            await client.set(keys.target_state(POOL, POD), _wish(2).to_json())
            report = await settle()
            row = report.by_name()[support.served_name]
            assert row.draining and row.tier is Tier.CPU and support.served_name in registered
            stored = ResidencyReport.from_json(await client.get(keys.residency_report(POOL, POD)))
            assert stored.by_name()[support.served_name].draining  # published with its change notice
            notice = await notices.get_message(ignore_subscribe_messages=True, timeout=2.0)
            assert notice is not None and notice["data"] == POD.encode()

            now[0] += 0.5
            await settle()
            assert support.served_name in registered  # within the grace: still served
            assert reconciler.drain_wait() == 0.5
            now[0] += 0.5
            await settle()  # the grace is over and nothing is in flight: unloaded
            assert support.served_name not in registered
            assert support.served_name not in (await settle()).by_name()
        finally:
            await notices.aclose()
            await client.aclose()
            await bus.close()


async def test_already_loaded_is_adopted_when_it_is_the_target_revision(tmp_path: Path) -> None:
    """The observation a pass planned from predates a load that finished (or a restarted sidecar): the engine's 400
    "already loaded" is no incompatibility."""
    async with engine_with_artifact(tmp_path) as (_, driver, support):
        cache = _cache(tmp_path)
        entry = cache.fetch(support, keep=(), timings=StageTimings())
        await driver.load(support.served_name, entry.path)
        before = await driver.observe()
        reconciler = Reconciler(driver, cache, SidecarMetrics())
        stale = Observation(before.info, {}, PodLoad())
        assert reconciler.step(_wish(1, support), stale) == [(support.served_name, Action.LOAD)]
        await reconciler.drain()
        status = reconciler.status[support.served_name]
        assert (status.reason, status.error) == (None, None)
        assert reconciler.loaded[support.served_name].cache_key == support.cache_key
        held = (await driver.observe()).adapters[support.served_name]
        assert held.digest == entry.adapter_digest and held.loads == before.adapters[support.served_name].loads
        assert reconciler.step(_wish(1, support), await driver.observe()) == []


async def test_already_loaded_with_other_bytes_is_replaced(tmp_path: Path) -> None:
    async with engine_with_artifact(tmp_path) as (_, driver, support):
        cache = _cache(tmp_path)
        entry = cache.fetch(support, keep=(), timings=StageTimings())
        write_adapter(tmp_path / "other", PRESETS["tiny"], 8, seed=4)
        await driver.load(support.served_name, tmp_path / "other")
        stale = await driver.observe()
        assert stale.adapters[support.served_name].digest != entry.adapter_digest
        stale.adapters.clear()
        reconciler = Reconciler(driver, cache, SidecarMetrics())
        assert reconciler.step(_wish(1, support), stale) == [(support.served_name, Action.LOAD)]
        await reconciler.drain()
        assert reconciler.status[support.served_name].reason is None
        assert (await driver.observe()).adapters[support.served_name].digest == entry.adapter_digest


async def test_a_refused_load_is_still_incompatible(tmp_path: Path) -> None:
    """Only "already loaded" is adopted: other 400s on load (here: tensor shapes of another model) stay final."""
    async with engine_with_artifact(tmp_path, preset="small") as (_, driver, support):
        reconciler = Reconciler(driver, _cache(tmp_path), SidecarMetrics())
        reconciler.step(_wish(1, support), await driver.observe())
        await asyncio.wait_for(reconciler.drain(), 30)
        status = reconciler.status[support.served_name]
        assert status.reason == "Incompatible" and "HTTP 400" in (status.error or ""), status.error


async def test_a_disk_row_says_whether_the_runtime_has_the_revision_registered(tmp_path: Path, redis_srv) -> None:
    async with engine_with_artifact(tmp_path) as (built, driver, support):
        bus = RedisBus(redis_srv.url, POOL, POD)
        client = aioredis.Redis.from_url(redis_srv.url)
        try:
            reconciler = Reconciler(driver, _cache(tmp_path), SidecarMetrics(), drain_grace_s=0.0)
            sidecar = Sidecar(SidecarConfig(POOL, POD, "10.0.0.1:8000", "engine"), reconciler, bus)

            async def row(generation: int, target: AdapterTarget) -> AdapterResidency:
                await client.set(keys.target_state(POOL, POD), _wish(generation, target).to_json())
                for _ in range(4):
                    await sidecar.run_once()
                    await reconciler.drain()
                return (await sidecar.run_once()).by_name()[target.served_name]

            loaded = await row(1, support)
            assert (loaded.tier, loaded.registered) == (Tier.CPU, True)
            engine = built.engine
            async with engine.lock:  # the engine evicts it from host memory: still registered, read back on a request
                engine.tiers.drop_host(engine.tiers.registered[support.served_name])
            evicted = (await sidecar.run_once()).by_name()[support.served_name]
            assert (evicted.tier, evicted.registered) == (Tier.DISK, True)
            back = await row(2, support)  # its target is host memory: read back from disk
            assert (back.tier, back.registered) == (Tier.CPU, True)
            on_disk = support.model_copy(update={"tier": Tier.DISK})
            demoted = await row(3, on_disk)  # the engine keeps it registered: demoted, not drained and unloaded
            assert (demoted.tier, demoted.registered, demoted.draining) == (Tier.DISK, True, False)
            assert demoted.evictions == evicted.evictions  # asked for, not an eviction
            assert support.served_name in engine.tiers.registered and sidecar.last_report is not None
            assert sidecar.last_report.demotes_to_disk
            await engine.remove_adapter(support.served_name)  # gone from the runtime: only in the cache
            cached = await row(3, on_disk)
            assert (cached.tier, cached.registered) == (Tier.DISK, False)
            assert support.served_name not in engine.tiers.registered
        finally:
            await client.aclose()
            await bus.close()
