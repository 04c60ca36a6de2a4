"""The engine driver against a real engine over HTTP: content digests and the tenant priority keep-score weighs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn

from e2e.fixtures.processes import LOOPBACK, free_port, wait_for_port
from loraplane.api import AdapterTarget, TargetState, Tier, cache_key
from loraplane.engine.app import BuiltEngine, EngineOptions, build
from loraplane.engine.make_adapters import write_adapter
from loraplane.engine.model import LORA_MODULES, PRESETS
from loraplane.sidecar.artifacts import ArtifactSources, SourceConfig
from loraplane.sidecar.cache import DiskCache
from loraplane.sidecar.drivers import make_driver
from loraplane.sidecar.drivers.base import RuntimeDriver, RuntimeInfo
from loraplane.sidecar.metrics import SidecarMetrics
from loraplane.sidecar.reconcile import Action, Reconciler
from tests.sidecar.adapters import sha256_of, tar_dir, target_for


@contextlib.asynccontextmanager
async def served_engine(adapter_root: Path) -> AsyncIterator[tuple[BuiltEngine, str]]:
    """A tiny keep-score engine in this process, served over real HTTP on a free loopback port."""
    built = build(EngineOptions(max_loras=1, max_cpu_loras=2, eviction_policy="keep-score", adapter_root=adapter_root,
                                allow_runtime_lora_updating=True))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(built.app, host=LOOPBACK, port=port, log_level="warning"))
    serving = asyncio.ensure_future(server.serve())
    try:
        await asyncio.to_thread(wait_for_port, port, timeout=30)
        yield built, f"http://{LOOPBACK}:{port}"
    finally:
        server.should_exit = True
        await serving


async def _settle(reconciler: Reconciler, driver: RuntimeDriver, target: TargetState) -> list[Action]:
    """Step until nothing is left to do; every action started, in order."""
    actions = []
    for _ in range(10):
        started = reconciler.step(target, await driver.observe())
        if not started:
            return actions
        actions += [action for _, action in started]
        await reconciler.drain()
    raise AssertionError(f"still acting after 10 passes: {actions}")


async def test_engine_driver_sets_priority_on_load_and_when_the_target_changes(tmp_path: Path) -> None:
    artifacts, cache_dir = tmp_path / "artifacts", tmp_path / "cache"
    artifacts.mkdir()
    content_digest = write_adapter(tmp_path / "made", PRESETS["tiny"], 8, seed=3)
    archive = tar_dir(tmp_path / "made", artifacts / "gold.tar.gz")
    async with served_engine(cache_dir.parent) as (built, url):
        driver = make_driver("engine", url, RuntimeInfo(base_model=""))
        try:
            base = (await driver.observe()).info.base_model_digest
            assert base is not None
            made = target_for(archive.as_uri(), sha256_of(archive), adapter="gold", tier=Tier.CPU, dtype="float32",
                              modules=LORA_MODULES)
            gold = made.model_copy(update={"base_model_digest": base, "priority": 7,
                                           "cache_key": cache_key(base, "gold", "v1", made.artifact.digest)})
            cache = DiskCache(cache_dir, 1 << 30, ArtifactSources(SourceConfig(file_roots=(artifacts,))))
            reconciler = Reconciler(driver, cache, SidecarMetrics())

            def wish(t: AdapterTarget, generation: int) -> TargetState:
                return TargetState(pool="p", pod="pod-0", generation=generation, adapters=[t], updated_at=0.0)

            assert await _settle(reconciler, driver, wish(gold, 1)) == [Action.LOAD]  # the priority came with it
            held = (await driver.observe()).adapters[gold.served_name]
            assert (held.tier, held.priority, held.digest) == (Tier.CPU, 7, content_digest)
            assert built.engine.tiers.registered[gold.served_name].priority == 7  # what keep-score weighs

            demoted = gold.model_copy(update={"priority": -3})
            assert await _settle(reconciler, driver, wish(demoted, 2)) == [Action.PRIORITY]
            assert built.engine.tiers.registered[gold.served_name].priority == -3
        finally:
            await driver.close()


async def test_load_stages_are_measured_per_starting_tier_for_the_report(tmp_path: Path) -> None:
    artifacts, cache_dir = tmp_path / "artifacts", tmp_path / "cache"
    artifacts.mkdir()
    write_adapter(tmp_path / "made", PRESETS["tiny"], 8, seed=4)
    archive = tar_dir(tmp_path / "made", artifacts / "claims.tar.gz")
    async with served_engine(cache_dir.parent) as (_built, url):
        driver = make_driver("engine", url, RuntimeInfo(base_model=""))
        try:
            base = (await driver.observe()).info.base_model_digest
            assert base is not None
            made = target_for(archive.as_uri(), sha256_of(archive), adapter="claims", tier=Tier.GPU, dtype="float32",
                              modules=LORA_MODULES)
            gpu = made.model_copy(update={"base_model_digest": base,
                                          "cache_key": cache_key(base, "claims", "v1", made.artifact.digest)})
            cache = DiskCache(cache_dir, 1 << 30, ArtifactSources(SourceConfig(file_roots=(artifacts,))))
            reconciler = Reconciler(driver, cache, SidecarMetrics(), drain_grace_s=0.0)
            assert reconciler.load_costs.costs() is None  # nothing measured: the picker keeps its defaults

            def wish(*targets: AdapterTarget, generation: int) -> TargetState:
                return TargetState(pool="p", pod="pod-0", generation=generation, adapters=list(targets), updated_at=0.0)

            # fetched and registered (in host memory), then activated from there
            assert await _settle(reconciler, driver, wish(gpu, generation=1)) == [Action.LOAD, Action.ACTIVATE]
            first = reconciler.load_costs.costs()
            assert first is not None and first.fetch is not None and first.cpu is not None and first.disk is None
            assert 0 < first.cpu and 0 < first.fetch
            # unloaded (no drain grace here): only the disk cache holds it now
            assert await _settle(reconciler, driver, wish(generation=2)) == [Action.UNLOAD]
            assert Action.LOAD in await _settle(reconciler, driver, wish(gpu, generation=3))
            costs = reconciler.load_costs.costs()
            assert costs is not None and costs.disk is not None and 0 < costs.disk and costs.fetch == first.fetch
        finally:
            await driver.close()
