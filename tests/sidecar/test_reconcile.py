"""The reconcile step: which action comes next, in-flight protection, backoff and status reasons."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path

import pytest

from e2e.fixtures.processes import free_port
from loraplane.api import AdapterTarget, PodLoad, TargetState, Tier
from loraplane.sidecar.artifacts import ArtifactSources, SourceConfig
from loraplane.sidecar.cache import DiskCache, StageTimings
from loraplane.sidecar.drivers import make_driver
from loraplane.sidecar.drivers.base import Observation, RuntimeAdapter, RuntimeInfo
from loraplane.sidecar.drivers.vllm import VllmDriver
from loraplane.sidecar.metrics import SidecarMetrics
from loraplane.sidecar.reconcile import SLOTS_BUSY_WAIT_S, Action, Backoff, LoadRecord, Reconciler
from tests.sidecar.adapters import BASE_DIGEST, sha256_of, target_for, write_weights

INFO = RuntimeInfo(base_model="tiny", base_model_digest=BASE_DIGEST, max_lora_rank=16, max_loras=2, max_cpu_loras=4)


def make_reconciler(tmp_path: Path, runtime: str = "engine", clock=None, drain_grace_s: float = 0.0) -> Reconciler:
    """A reconciler whose driver points at a port nobody listens on (any runtime call fails for real)."""
    (tmp_path / "artifacts").mkdir(exist_ok=True)
    driver = make_driver(runtime, f"http://127.0.0.1:{free_port()}", INFO)
    sources = ArtifactSources(SourceConfig(file_roots=(tmp_path / "artifacts",)))
    cache = DiskCache(tmp_path / f"cache-{runtime}", 1 << 30, sources)
    kwargs = {"clock": clock} if clock else {}
    return Reconciler(driver, cache, SidecarMetrics(), backoff=Backoff(1.0, 8.0, random.Random(0)),
                      drain_grace_s=drain_grace_s, **kwargs)


class UnregisteringDriver(VllmDriver):
    """A runtime whose loads activate that can neither demote an adapter nor serve a registered one from disk: a
    disk-tier target drains and unloads it (no runtime loraplane drives is so now; vLLM was before it was driven as
    ``disk_registered``)."""

    capabilities = dataclasses.replace(VllmDriver.capabilities, disk_registered=False)


def unregistering(tmp_path: Path, **kw) -> Reconciler:
    r = make_reconciler(tmp_path, runtime="vllm", **kw)
    r.driver = UnregisteringDriver(f"http://127.0.0.1:{free_port()}", INFO, env={})
    return r


def observe(*held: RuntimeAdapter) -> Observation:
    return Observation(INFO, {h.served_name: h for h in held}, PodLoad())


def state(*targets) -> TargetState:
    return TargetState(pool="p", pod="pod-0", generation=1, adapters=list(targets), updated_at=0.0)


@pytest.fixture
def target(tmp_path: Path):
    (tmp_path / "artifacts").mkdir(exist_ok=True)
    weights = write_weights(tmp_path / "artifacts" / "w.safetensors")
    return lambda tier, **kw: target_for(f"file://{weights}", sha256_of(weights), tier=tier, **kw)


def cached(reconciler: Reconciler, t) -> None:
    entry = reconciler.cache.fetch(t, keep=(), timings=StageTimings())
    reconciler.loaded[t.served_name] = LoadRecord(t.cache_key, entry.artifact_digest, entry.adapter_digest)


def held(t_or_name, tier: Tier, reconciler: Reconciler | None = None, **kw) -> RuntimeAdapter:
    name = getattr(t_or_name, "served_name", t_or_name)
    digest = None
    if reconciler is not None and name in reconciler.loaded:
        digest = reconciler.loaded[name].adapter_digest
    return RuntimeAdapter(served_name=name, tier=tier, digest=kw.pop("digest", digest), **kw)


def test_next_action_walks_each_tier(tmp_path: Path, target) -> None:
    r = make_reconciler(tmp_path)
    gpu, cpu, disk = target(Tier.GPU, pinned=True), target(Tier.CPU), target(Tier.DISK)
    assert r.next_action(gpu, None) is Action.LOAD
    assert r.next_action(disk, None) is Action.FETCH
    cached(r, gpu)
    assert r.next_action(disk, None) is None
    assert r.next_action(gpu, held(gpu, Tier.CPU, r)) is Action.ACTIVATE
    assert r.next_action(gpu, held(gpu, Tier.DISK, r)) is Action.ACTIVATE
    assert r.next_action(gpu, held(gpu, Tier.GPU, r)) is Action.PIN
    assert r.next_action(gpu, held(gpu, Tier.GPU, r, pinned=True)) is None
    assert r.next_action(cpu, held(cpu, Tier.GPU, r, pinned=True)) is Action.UNPIN
    assert r.next_action(cpu, held(cpu, Tier.GPU, r)) is Action.OFFLOAD
    assert r.next_action(cpu, held(cpu, Tier.CPU, r)) is None
    assert r.next_action(cpu, held(cpu, Tier.CPU, r, priority=5)) is Action.PRIORITY  # the target says 0
    # the engine keeps a revision registered on disk: a disk target demotes it (still servable), never unloads it
    assert r.next_action(disk, held(disk, Tier.CPU, r)) is Action.DEMOTE
    assert r.next_action(disk, held(disk, Tier.GPU, r)) is Action.DEMOTE
    assert r.next_action(disk, held(disk, Tier.GPU, r, pinned=True)) is Action.UNPIN
    assert r.next_action(disk, held(disk, Tier.DISK, r)) is None
    # the runtime holds other bytes under this name: replace them
    assert r.next_action(gpu, held(gpu, Tier.GPU, digest="sha256:" + "e" * 64, pinned=True)) is Action.RELOAD


def test_vllm_cannot_offload_or_pin(tmp_path: Path, target) -> None:
    r = make_reconciler(tmp_path, runtime="vllm")
    gpu, cpu = target(Tier.GPU, pinned=True), target(Tier.CPU)
    cached(r, gpu)
    assert r.next_action(cpu, held(cpu, Tier.GPU, r)) is None
    assert r.next_action(gpu, held(gpu, Tier.GPU, r)) is None


def test_a_disk_target_stays_registered_on_vllm_demotes_on_the_engine_and_drains_where_neither_can(
    tmp_path: Path, target
) -> None:
    now = [100.0]

    async def run() -> None:
        vllm = make_reconciler(tmp_path, runtime="vllm", clock=lambda: now[0], drain_grace_s=1.0)
        other = unregistering(tmp_path, clock=lambda: now[0], drain_grace_s=1.0)
        engine = make_reconciler(tmp_path, clock=lambda: now[0], drain_grace_s=1.0)
        disk = target(Tier.DISK)
        assert vllm.next_action(disk, None) is Action.FETCH  # fetched first (not serialised with the loads) ...
        for r in (vllm, other, engine):
            cached(r, disk)
        assert vllm.next_action(disk, None) is Action.LOAD  # ... then registered
        assert other.next_action(disk, None) is None and engine.next_action(disk, None) is None
        # vLLM: registered, not kept resident: nothing to do at any tier, never drained, left out of keep_resident
        in_host = observe(held(disk, Tier.CPU, vllm))
        for tier in (Tier.GPU, Tier.CPU, Tier.DISK):
            assert vllm.next_action(disk, held(disk, tier, vllm)) is None
        assert vllm.step(state(disk), in_host) == [] and vllm.draining == {}
        assert vllm.driver._host_keep == frozenset()  # type: ignore[attr-defined]
        # a runtime that can neither: drained first (the row says draining, nothing unloaded yet), then unloaded
        assert other.next_action(disk, in_host.adapters[disk.served_name]) is Action.UNLOAD
        assert other.step(state(disk), in_host) == []
        assert other.draining == {disk.served_name: None}
        other.announced({disk.served_name})
        now[0] += 1.5
        assert other.step(state(disk), in_host) == [(disk.served_name, Action.UNLOAD)]
        assert engine.step(state(disk), observe(held(disk, Tier.CPU, engine))) == [(disk.served_name, Action.DEMOTE)]
        assert engine.draining == {}  # it stays servable: routers keep sending it requests
        busy = observe(held(disk, Tier.GPU, engine, in_flight=2))
        await engine.drain()  # (it fails: nobody listens) past its backoff
        now[0] += 10
        assert engine.step(state(disk), busy) == []  # never while requests are in flight
        assert engine.status[disk.served_name].reason == "RequestsInFlight"
        # more host-tier targets than host slots: the ones clipped to disk are demoted on the engine
        crowd = [target(Tier.CPU, adapter=f"t{i}") for i in range(5)]
        for t in crowd:
            cached(engine, t)
        all_in_host = observe(*(held(t, Tier.CPU, engine) for t in crowd))
        await engine.drain()
        started = engine.step(state(*crowd), all_in_host)
        assert started == [(crowd[4].served_name, Action.DEMOTE)]  # 4 host slots: the last by name goes to disk
        assert engine.draining == {}
        await engine.drain()
        for r in (vllm, other, engine):
            await r.cancel()

    asyncio.run(run())


def test_unknown_revision_is_verified_before_use(tmp_path: Path, target) -> None:
    """After a sidecar restart the engine's digest is checked against the fetched artifact first."""
    r = make_reconciler(tmp_path)
    gpu = target(Tier.GPU)
    assert r.next_action(gpu, held(gpu, Tier.GPU, digest="sha256:" + "e" * 64)) is Action.FETCH
    vllm = make_reconciler(tmp_path, runtime="vllm")
    vllm.cache.fetch(gpu, keep=(), timings=StageTimings())
    assert vllm.next_action(gpu, held(gpu, Tier.GPU)) is Action.RELOAD


def test_adapters_outside_the_target_are_unloaded_unless_busy(tmp_path: Path, target) -> None:
    async def run() -> None:
        r = make_reconciler(tmp_path)
        plan = r.plan(state(), observe(held("old@v1", Tier.GPU, pinned=True), held("other@v1", Tier.CPU)))
        assert plan == {"old@v1": (Action.UNPIN, None), "other@v1": (Action.UNLOAD, None)}
        busy = observe(held("other@v1", Tier.CPU, in_flight=3))
        assert r.step(state(), busy) == []
        assert r.status["other@v1"].reason == "RequestsInFlight"
        assert "3 requests in flight" in (r.status["other@v1"].error or "")

    asyncio.run(run())


def test_failures_back_off_exponentially_and_say_why(tmp_path: Path, target) -> None:
    now = [100.0]

    async def run() -> None:
        r = make_reconciler(tmp_path, clock=lambda: now[0])
        t = target(Tier.GPU)
        started = r.step(state(t), observe())
        assert started == [(t.served_name, Action.LOAD)]
        await r.drain()
        status = r.status[t.served_name]
        assert status.reason == "RuntimeUnavailable" and status.failures == 1
        assert "load failed" in (status.error or "")
        first_delay = status.not_before - now[0]
        assert 0.5 <= first_delay <= 1.0
        assert r.step(state(t), observe()) == []  # still backing off
        now[0] = status.not_before
        assert r.step(state(t), observe()) == [(t.served_name, Action.LOAD)]
        await r.drain()
        assert r.status[t.served_name].failures == 2
        # a new revision under the same name starts afresh
        t2 = target(Tier.GPU, revision="v1", rank=16)
        t2.cache_key = "sha256:" + "c" * 64
        r.step(state(t2), observe())
        await r.drain()
        assert r.status[t.served_name].failures == 1

    asyncio.run(run())


def test_digest_mismatch_is_final_and_named(tmp_path: Path, target) -> None:
    async def run() -> None:
        now = [1000.0]
        r = make_reconciler(tmp_path, clock=lambda: now[0])
        t = target(Tier.CPU)
        t.artifact.digest = "sha256:" + "d" * 64
        r.step(state(t), observe())
        await r.drain()
        status = r.status[t.served_name]
        assert status.reason == "DigestMismatch" and r.cache.entries() == {}
        assert status.not_before - now[0] > 7.0  # final: retried only at the backoff cap (8 s)

        bad_rank = target(Tier.CPU, revision="v2", rank=32)
        r.step(state(bad_rank), observe())
        await r.drain()
        assert r.status[bad_rank.served_name].reason == "Incompatible"
        assert "RankTooLarge" in (r.status[bad_rank.served_name].error or "")

    asyncio.run(run())


def test_backoff_is_capped() -> None:
    backoff = Backoff(base_s=1.0, cap_s=8.0, rng=random.Random(1))
    delays = [backoff.delay(n) for n in range(1, 10)]
    assert all(0.5 * min(8.0, 2 ** (n - 1)) <= d <= min(8.0, 2 ** (n - 1)) for n, d in enumerate(delays, 1))
    assert max(delays) <= 8.0


def test_evictions_are_counted_only_when_unasked(tmp_path: Path) -> None:
    r = make_reconciler(tmp_path)
    before = observe(held("a@v1", Tier.GPU), held("b@v1", Tier.CPU), held("c@v1", Tier.GPU))
    after = observe(held("a@v1", Tier.CPU), held("c@v1", Tier.GPU))
    assert sorted(r.note_evictions(before, after)) == ["a@v1", "b@v1"]
    assert r.evicted == {"a@v1", "b@v1"}


def test_activation_waits_for_a_running_unload_but_not_for_a_blocked_one(tmp_path: Path, target) -> None:
    async def run() -> None:
        r = make_reconciler(tmp_path)
        gpu = target(Tier.GPU)
        cached(r, gpu)
        free = observe(held(gpu, Tier.CPU, r), held("old@v1", Tier.GPU))
        assert r.step(state(gpu), free) == [("old@v1", Action.UNLOAD)]
        await r.drain()
        r2 = make_reconciler(tmp_path)
        cached(r2, gpu)
        blocked = observe(held(gpu, Tier.CPU, r2), held("old@v1", Tier.GPU, in_flight=1))
        assert r2.step(state(gpu), blocked) == [(gpu.served_name, Action.ACTIVATE)]
        await r2.drain()

    asyncio.run(run())


def test_targets_beyond_the_slots_are_kept_a_tier_lower(tmp_path: Path, target) -> None:
    """Three GPU targets on two slots would evict each other forever: the third waits in host memory."""
    pinned = target(Tier.GPU, adapter="zeta", pinned=True)
    important = target(Tier.GPU, adapter="beta")
    important.priority = 10
    ordinary = target(Tier.GPU, adapter="alpha")
    host = target(Tier.CPU, adapter="gamma")
    info = RuntimeInfo(base_model="tiny", max_loras=2, max_cpu_loras=3)
    clipped, why = Reconciler.within_capacity(state(ordinary, important, pinned, host), info)
    assert {n: t.tier for n, t in clipped.items()} == {
        pinned.served_name: Tier.GPU, important.served_name: Tier.GPU, ordinary.served_name: Tier.CPU,
        host.served_name: Tier.DISK,
    }
    assert "GPU slots" in why[ordinary.served_name] and "host slots" in why[host.served_name]

    async def run() -> None:
        r = make_reconciler(tmp_path)
        for t in (ordinary, important, pinned):
            cached(r, t)
        limited = Observation(info, {t.served_name: held(t, Tier.CPU, r) for t in (ordinary, important, pinned)},
                              PodLoad())
        started = dict(r.step(state(ordinary, important, pinned), limited))
        assert ordinary.served_name not in started and len(started) == 2
        assert r.status[ordinary.served_name].reason == "CapacityExceeded"
        await r.drain()

    asyncio.run(run())


def test_a_leaving_adapter_is_unloaded_only_after_its_announced_grace_and_its_requests(tmp_path: Path) -> None:
    """Draining: no unload before a report said so, before the grace since that report, or with requests in flight."""
    now = [100.0]

    async def run() -> None:
        r = make_reconciler(tmp_path, clock=lambda: now[0], drain_grace_s=1.0)
        idle = observe(held("old@v1", Tier.GPU))
        assert r.step(state(), idle) == [] and r.draining == {"old@v1": None}
        now[0] += 60.0
        assert r.step(state(), idle) == []  # never announced: the grace has not even started
        assert r.drain_wait() is None
        r.announced({"old@v1"})
        now[0] += 0.9
        assert r.step(state(), idle) == []
        assert r.drain_wait() == pytest.approx(0.1)
        now[0] += 0.2
        assert r.step(state(), observe(held("old@v1", Tier.GPU, in_flight=2))) == []
        assert r.status["old@v1"].reason == "RequestsInFlight"
        assert r.step(state(), idle) == [("old@v1", Action.UNLOAD)]
        await r.drain()

    asyncio.run(run())


def test_draining_covers_demotion_to_disk_and_ends_when_the_target_takes_it_back(tmp_path: Path, target) -> None:
    async def run() -> None:
        r = unregistering(tmp_path, drain_grace_s=1.0)  # a disk target unloads
        disk, cpu = target(Tier.DISK), target(Tier.CPU)
        cached(r, disk)
        assert r.step(state(disk), observe(held(disk, Tier.CPU, r))) == []
        assert set(r.draining) == {disk.served_name}
        r.announced({disk.served_name})
        assert r.step(state(cpu), observe(held(cpu, Tier.CPU, r))) == []
        assert r.draining == {}
        assert r.step(state(disk), observe(held(disk, Tier.DISK, r))) == []  # not in the runtime: nothing to drain
        assert r.draining == {}
        off = make_reconciler(tmp_path, drain_grace_s=0.0)  # 0: unload at once, never reported draining
        assert off.step(state(), observe(held("old@v1", Tier.CPU))) == [("old@v1", Action.UNLOAD)]
        assert off.draining == {}
        await off.drain()

    asyncio.run(run())


def test_activation_waits_for_a_draining_adapter_only_when_it_holds_the_last_gpu_slot(tmp_path: Path, target) -> None:
    now = [100.0]

    async def run() -> None:
        r = make_reconciler(tmp_path, clock=lambda: now[0], drain_grace_s=1.0)
        gpu, keep = target(Tier.GPU), target(Tier.GPU, adapter="keep")
        cached(r, gpu)
        cached(r, keep)
        full = observe(held(gpu, Tier.CPU, r), held("old@v1", Tier.GPU), held(keep, Tier.GPU, r))
        assert r.step(state(gpu, keep), full) == []  # activating now would evict keep@v1 instead of old@v1
        r.announced({"old@v1"})
        now[0] += 1.0
        assert r.step(state(gpu, keep), full) == [("old@v1", Action.UNLOAD)]
        await r.drain()
        free = observe(held(gpu, Tier.CPU, r), held("old@v1", Tier.GPU))
        r2 = make_reconciler(tmp_path, clock=lambda: now[0], drain_grace_s=1.0)
        cached(r2, gpu)
        assert r2.step(state(gpu), free) == [(gpu.served_name, Action.ACTIVATE)]  # a free slot: no need to wait
        await r2.drain()

    asyncio.run(run())


def test_a_refused_artifact_is_final_and_keeps_its_cause(tmp_path: Path, target) -> None:
    async def run() -> None:
        now = [1000.0]
        r = make_reconciler(tmp_path, clock=lambda: now[0])
        outside = tmp_path / "elsewhere.safetensors"
        outside.write_bytes(b"x")
        for revision, uri in (("v1", f"file://{outside}"), ("v2", f"file://{tmp_path}/missing/outside.safetensors")):
            t = target_for(uri, "sha256:" + "e" * 64, revision=revision)
            r.step(state(t), observe())
            await r.drain()
            status = r.status[t.served_name]
            assert status.reason == "ArtifactRefused", status
            assert "FileOutsideRoots" in (status.error or "")  # the same answer whether the file exists or not
            assert status.not_before - now[0] > 7.0  # final: retried only at the backoff cap (8 s)

    asyncio.run(run())


def loads_only_after_the_bounded_wait(r: Reconciler, wanted: AdapterTarget, observed: Observation,
                                     now: list[float]) -> None:
    """``wanted``'s load waits while ``observed`` holds (at the start and half-way through ``SLOTS_BUSY_WAIT_S``)
    and goes once the wait is over; ``now`` is ``r``'s clock."""
    assert (wanted.served_name, Action.LOAD) not in r.step(state(wanted), observed)
    now[0] = SLOTS_BUSY_WAIT_S / 2
    assert (wanted.served_name, Action.LOAD) not in r.step(state(wanted), observed)
    now[0] = SLOTS_BUSY_WAIT_S + 0.1
    assert (wanted.served_name, Action.LOAD) in r.step(state(wanted), observed)


def test_on_vllm_a_load_waits_a_bounded_while_requests_fill_every_gpu_slot(tmp_path: Path, target) -> None:
    """vLLM's load activates into a GPU slot: with every slot held by an adapter with requests in flight it would
    evict a running one, which the next step brings back, evicting the next. The load waits for a slot to free, at
    most ``SLOTS_BUSY_WAIT_S``; with a slot not busy it goes at once."""

    async def run() -> None:
        now = [0.0]
        r = make_reconciler(tmp_path, runtime="vllm", clock=lambda: now[0])
        wanted = target(Tier.GPU)
        busy = observe(held("a@v1", Tier.GPU, in_flight=1), held("b@v1", Tier.GPU, in_flight=2))  # max_loras 2
        loads_only_after_the_bounded_wait(r, wanted, busy, now)
        await r.drain()
        r2 = make_reconciler(tmp_path, runtime="vllm", clock=lambda: now[0])
        one_free = observe(held("a@v1", Tier.GPU, in_flight=1), held("b@v1", Tier.GPU))
        assert (wanted.served_name, Action.LOAD) in r2.step(state(wanted), one_free)
        await r2.drain()

    asyncio.run(run())


def test_on_vllm_a_disk_tier_registration_waits_a_bounded_while_requests_wait_in_the_queue(tmp_path: Path,
                                                                                          target) -> None:
    """A disk-tier registration's load activates into a GPU slot on vLLM, stalling the batch, and no request needs
    it yet: it waits while the runtime's queue holds requests, at most ``SLOTS_BUSY_WAIT_S``; with the queue empty
    it goes at once, and a warm target never waits for the queue."""

    async def run() -> None:
        now = [0.0]
        queued = Observation(INFO, {}, PodLoad(queue_depth=3))
        disk = target(Tier.DISK)
        r = make_reconciler(tmp_path, runtime="vllm", clock=lambda: now[0])
        cached(r, disk)
        loads_only_after_the_bounded_wait(r, disk, queued, now)
        await r.drain()
        idle = make_reconciler(tmp_path, runtime="vllm", clock=lambda: now[0])
        cached(idle, disk)
        assert (disk.served_name, Action.LOAD) in idle.step(state(disk), observe())
        await idle.drain()
        warm = make_reconciler(tmp_path, runtime="vllm", clock=lambda: now[0])
        gpu = target(Tier.GPU)
        assert (gpu.served_name, Action.LOAD) in warm.step(state(gpu), queued)
        await warm.drain()

    asyncio.run(run())
