"""The vllm driver's model of vLLM's LoRA caches and metrics, and the reconciler's placement rules for runtimes whose
loads activate. (The same behaviour against a real vLLM process: e2e/test_vllm_driver.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from loraplane.api import AdapterTarget, Artifact, LoraSpec, TargetState, Tier
from loraplane.emulator.engine import EngineConfig
from loraplane.sidecar.drivers.base import Observation, RuntimeInfo
from loraplane.sidecar.drivers.vllm import (
    LoraCacheModel,
    RuntimeResponse,
    VllmDriver,
    lora_last_served,
    lora_requests,
    parse_metrics,
    pod_load,
)
from loraplane.sidecar.reconcile import Reconciler
from loraplane.vllm_server import VllmOptions, start_vllm

if TYPE_CHECKING:
    from tests.emulator.conftest import Emulator

METRICS = "\n".join([
    'vllm:num_requests_waiting{engine="0",model_name="m"} 3',
    'vllm:num_requests_waiting{engine="1",model_name="m"} 4',
    'vllm:num_requests_running{engine="0",model_name="m"} 5',
    'vllm:num_requests_running{engine="1",model_name="m"} 1',
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2',
    'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6',
    'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="a,b"} 100.0',
    'vllm:lora_requests_info{max_lora="2",running_lora_adapters="b",waiting_lora_adapters="b"} 300.0',
    'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 200.0',
    "",
])


def test_counts_are_summed_over_engines_and_the_newest_series_says_who_is_busy() -> None:
    samples = parse_metrics(METRICS)
    load = pod_load(samples, RuntimeInfo(base_model="m", max_loras=2, max_cpu_loras=4))
    assert (load.queue_depth, load.running, load.kv_utilization) == (7, 6, 0.6)
    assert (load.max_gpu_slots, load.max_cpu_slots) == (2, 4)
    assert lora_requests(samples) == ({"b"}, {"b"})
    assert lora_last_served(samples) == {"a": 100.0, "b": 300.0}


def tiers(model: LoraCacheModel, *names: str) -> list[Tier]:
    return [model.tier(n) for n in names]


def test_the_model_follows_vllms_two_lru_caches() -> None:
    model = LoraCacheModel(gpu_slots=2, host_slots=3)
    for at, name in enumerate("abc"):
        model.load(name, float(at))
    assert tiers(model, "a", "b", "c") == [Tier.CPU, Tier.GPU, Tier.GPU]  # every load activates
    model.touch("a", 3.0)
    model.load("d", 4.0)  # the host cache holds 3: b (least recently used) falls out
    assert tiers(model, "a", "b", "c", "d") == [Tier.GPU, Tier.DISK, Tier.CPU, Tier.GPU]
    model.unload("d")
    assert model.unloaded_copies() == (1, 1)  # unloading keeps the copy and its slot
    model.touch("c", 5.0)
    model.load("e", 6.0)  # a falls out (older than the unloaded copy)
    assert tiers(model, "a", "c", "e") == [Tier.DISK, Tier.GPU, Tier.GPU] and model.unloaded_copies() == (0, 1)
    model.touch("c", 2.0)  # a metric older than what the model knows changes nothing
    assert model.ranked()[0].name == "e"


def test_kept_adapters_are_touched_so_a_load_pushes_out_another_copy() -> None:
    model = LoraCacheModel(gpu_slots=2, host_slots=3)
    for at, name in enumerate(["hot", "x", "warm"]):
        model.load(name, float(at))
    # GPU: warm, x (hot was pushed to host); loading "new" would push hot out of the host cache
    assert model.pushed_out("new", gpu_keep=(), host_keep={"hot", "warm"}, fresh=True) == {"hot"}
    plan = model.touches_before("new", gpu_keep=(), host_keep={"hot", "warm"}, fresh=True)
    assert plan == ["hot"]
    model.touch("hot", 3.0)
    assert model.pushed_out("new", gpu_keep=(), host_keep={"hot", "warm"}, fresh=True) == set()
    # hot and warm in the GPU, x in host: a load would evict hot's slot unless hot is touched first
    model.touch("warm", 4.0)
    assert model.pushed_out("new", gpu_keep={"hot"}, host_keep={"hot"}, fresh=True) == {"hot"}
    assert model.touches_before("new", gpu_keep={"hot"}, host_keep={"hot"}, fresh=True) == ["hot"]


def _target(name: str, tier: Tier) -> AdapterTarget:
    digest = "sha256:" + "a" * 64
    return AdapterTarget(served_name=f"{name}@v1", adapter=name, revision="v1", tier=tier,
                         artifact=Artifact(uri="file:///x", digest=digest), lora=LoraSpec(rank=8, alpha=8, target_modules=["q_proj"]),
                         base_model_digest=digest, cache_key="k-" + name)


def test_a_runtime_whose_loads_activate_keeps_one_gpu_slot_for_host_tier_loads() -> None:
    info = RuntimeInfo(base_model="m", max_loras=2, max_cpu_loras=4)
    target = TargetState(pool="p", pod="q", generation=1, updated_at=0.0,
                         adapters=[_target("a", Tier.GPU), _target("b", Tier.GPU), _target("c", Tier.CPU)])
    wanted, _ = Reconciler.within_capacity(target, info)
    assert [wanted[n].tier for n in ("a@v1", "b@v1")] == [Tier.GPU, Tier.GPU]
    wanted, why = Reconciler.within_capacity(target, info, landing_slot=True)
    assert [wanted[n].tier for n in ("a@v1", "b@v1", "c@v1")] == [Tier.GPU, Tier.CPU, Tier.CPU]
    assert "b@v1" in why
    only_gpu = TargetState(pool="p", pod="q", generation=1, updated_at=0.0,
                           adapters=[_target("a", Tier.GPU), _target("b", Tier.GPU)])
    wanted, _ = Reconciler.within_capacity(only_gpu, info, landing_slot=True)
    assert all(t.tier is Tier.GPU for t in wanted.values())  # no host-tier loads: every slot is usable


def test_disk_tier_registrations_land_in_the_landing_slot_and_a_host_copy_but_take_no_host_slot() -> None:
    """On vLLM a disk-tier target is registered: loading it, and each request for it, takes the least recently used
    GPU slot and makes a host copy. So with disk-tier targets the landing slot is kept (as for host-tier ones) and
    one host copy is left free of host-tier targets; the registrations themselves take no host slot."""
    info = RuntimeInfo(base_model="m", max_loras=2, max_cpu_loras=4)

    def tiers(*targets: AdapterTarget, registers_disk: bool = True) -> dict[str, Tier]:
        state = TargetState(pool="p", pod="q", generation=1, updated_at=0.0, adapters=list(targets))
        wanted, _ = Reconciler.within_capacity(state, info, landing_slot=True, registers_disk=registers_disk)
        return {name[:-3]: t.tier for name, t in wanted.items()}

    gpu_and_disk = (_target("a", Tier.GPU), _target("b", Tier.GPU), _target("d", Tier.DISK))
    assert tiers(*gpu_and_disk) == {"a": Tier.GPU, "b": Tier.CPU, "d": Tier.DISK}
    assert tiers(*gpu_and_disk, registers_disk=False) == {"a": Tier.GPU, "b": Tier.GPU, "d": Tier.DISK}
    full_host = (_target("a", Tier.GPU), *(_target(f"c{i}", Tier.CPU) for i in range(3)))
    assert tiers(*full_host) == {"a": Tier.GPU, "c0": Tier.CPU, "c1": Tier.CPU, "c2": Tier.CPU}
    assert tiers(*full_host, _target("d", Tier.DISK))["c2"] is Tier.DISK  # one host copy left for the registrations
    many = tiers(_target("a", Tier.GPU), _target("c", Tier.CPU), *(_target(f"d{i}", Tier.DISK) for i in range(9)))
    assert (many["a"], many["c"]) == (Tier.GPU, Tier.CPU)


def test_a_vllm_with_a_lora_resolver_is_neither_driven_nor_started(tmp_path: Path) -> None:
    limits = RuntimeInfo(base_model="", max_loras=1)
    with pytest.raises(ValueError, match="VLLM_LORA_RESOLVER_CACHE_DIR"):
        VllmDriver("http://127.0.0.1:1", limits, env={"VLLM_LORA_RESOLVER_CACHE_DIR": "/adapters"})
    with pytest.raises(ValueError, match="VLLM_PLUGINS"):
        VllmDriver("http://127.0.0.1:1", limits, env={"VLLM_PLUGINS": "lora_filesystem_resolver"})
    VllmDriver("http://127.0.0.1:1", limits, env={"VLLM_PLUGINS": "loraplane_kernels"})  # not a resolver
    options = VllmOptions(model=tmp_path, env={"VLLM_LORA_RESOLVER_HF_REPO_LIST": "org/repo"})
    with pytest.raises(ValueError, match="VLLM_LORA_RESOLVER_HF_REPO_LIST"):
        start_vllm(options, tmp_path / "vllm.log", python=tmp_path / "python")
    assert not (tmp_path / "vllm.log").exists()  # nothing was started


def test_a_restarted_sidecar_adopts_what_vllm_loaded_from_its_verified_entry(tmp_path: Path) -> None:
    """vLLM's /v1/models says which directory each adapter came from: the verified cache entry of the target's
    revision is adopted (no reload, which would leave a second copy in vLLM), another directory is replaced."""
    from loraplane.sidecar.cache import StageTimings
    from loraplane.sidecar.drivers.base import RuntimeAdapter
    from loraplane.sidecar.reconcile import Action
    from tests.sidecar.adapters import sha256_of, target_for, write_weights
    from tests.sidecar.test_reconcile import make_reconciler

    (tmp_path / "artifacts").mkdir()
    weights = write_weights(tmp_path / "artifacts" / "w.safetensors")
    target = target_for(f"file://{weights}", sha256_of(weights), tier=Tier.GPU)
    r = make_reconciler(tmp_path, runtime="vllm")
    entry = r.cache.fetch(target, keep=(), timings=StageTimings())
    ours = RuntimeAdapter(served_name=target.served_name, tier=Tier.GPU, path=str(entry.path))
    assert r.next_action(target, ours) is None
    assert r.verified_digests(target.served_name, ours) == (entry.artifact_digest, entry.adapter_digest)
    other = RuntimeAdapter(served_name=target.served_name, tier=Tier.GPU, path=str(tmp_path / "elsewhere"))
    assert r.next_action(target, other) is Action.RELOAD
    assert r.verified_digests(target.served_name, other) is None


class EmulatedVllm(VllmDriver):
    """The vllm driver with its HTTP calls answered in process by loraplane's vLLM emulator (vLLM 0.32's adapter
    semantics: loads activate, two LRU caches, 404 for names it has not registered), recording each call."""

    def __init__(self, emu: Emulator, limits: RuntimeInfo) -> None:
        super().__init__("http://emulator", limits, env={})
        self.emu = emu
        #: (path, lora_name or model) of every POST
        self.calls: list[tuple[str, str]] = []

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> RuntimeResponse:
        if method == "POST" and body is not None:
            self.calls.append((path, str(body.get("lora_name") or body.get("model"))))
        answer = await self.emu.http.request(method, path, json=body)
        return RuntimeResponse(answer.status_code, answer.content)

    def posted(self, path: str) -> list[str]:
        return [name for p, name in self.calls if p == path]


async def _converge(r: Reconciler, driver: EmulatedVllm, target: TargetState, passes: int = 60) -> Observation:
    """Reconcile passes (observe, step, wait for the actions) until a pass starts nothing."""
    for _ in range(passes):
        observation = await driver.observe()
        if not r.step(target, observation) and not r.busy():
            return observation
        await r.drain()
    raise AssertionError(f"no convergence after {passes} passes: {r.status}")


def test_a_disk_tier_target_on_vllm_ends_registered_and_is_never_unloaded_for_being_disk_tier(tmp_path: Path) -> None:
    """vLLM serves a registered adapter whose copy LRU pushed out (it reads it back from its path), but cannot be
    told to evict one: a disk-tier target is registered, not kept resident. It is loaded when it is not (after the
    GPU- and host-tier targets), a registered one moved to disk is not unloaded, and its copy is left to LRU while
    the kept adapters stay where the target wants them. Before, a disk-tier target was only fetched (vLLM's 404 for
    every request routed to it) and a registered one moved to disk was unloaded."""
    from tests.emulator.conftest import emulator
    from tests.sidecar.adapters import sha256_of, target_for, write_weights
    from tests.sidecar.test_reconcile import INFO, make_reconciler, state

    (tmp_path / "artifacts").mkdir()

    def published(adapter: str, tier: Tier, seed: int) -> AdapterTarget:
        weights = write_weights(tmp_path / "artifacts" / f"{adapter}.safetensors", seed=seed)
        return target_for(f"file://{weights}", sha256_of(weights), adapter=adapter, tier=tier)

    hot, warm = published("hot", Tier.GPU, 0), published("warm", Tier.CPU, 1)
    cold = [published(f"cold{i}", Tier.DISK, 2 + i) for i in range(3)]
    names = [t.served_name for t in (hot, warm, *cold)]

    async def run() -> None:
        async with emulator(tmp_path / "emu", EngineConfig(max_loras=2, max_cpu_loras=4), shapes=None) as emu:
            r = make_reconciler(tmp_path)
            driver = r.driver = EmulatedVllm(emu, INFO)

            def registered() -> set[str]:
                return set(emu.engine.registered)

            observation = await _converge(r, driver, state(hot, warm, *cold))
            assert registered() == set(names)  # every disk-tier target registered: a request is served, not 404
            loads = driver.posted("/v1/load_lora_adapter")
            assert sorted(loads) == sorted(names)
            assert set(loads[-3:]) == {t.served_name for t in cold}  # after the GPU- and host-tier targets
            assert driver.posted("/v1/unload_lora_adapter") == []
            assert all(r.status[n].error is None for n in names), r.status
            # the GPU- and host-tier targets were warmed by their loads and are left to vLLM's LRU from then on:
            # not defended by touches before the disk-tier registrations (each touch of a host copy took a GPU slot)
            assert r.left_to_runtime(hot) and r.left_to_runtime(warm)
            assert driver._gpu_keep == frozenset() and driver._host_keep == frozenset()
            assert not {hot.served_name, warm.served_name} & set(driver.posted("/v1/completions"))
            truth = emu.engine.cache

            # a request for a disk-tier revision is served (vLLM reads it from its path), and nothing is unloaded
            answer = await emu.http.post("/v1/completions", json={"model": cold[0].served_name, "prompt": "hi",
                                                                   "max_tokens": 2})
            assert answer.status_code == 200, answer.text
            # the GPU-tier target goes to disk: it stays registered (no drain, no unload), no longer kept resident
            demoted = hot.model_copy(update={"tier": Tier.DISK})
            await _converge(r, driver, state(demoted, warm, *cold))
            assert driver.posted("/v1/unload_lora_adapter") == [] and r.draining == {}
            assert registered() == set(names)
            assert driver._gpu_keep == frozenset() and driver._host_keep == frozenset()
            # its copy ages out by LRU: requests for the other disk-tier revisions push it out of the GPU and host
            warm_ups = len(driver.posted("/v1/completions"))
            for t in cold:
                await emu.http.post("/v1/completions", json={"model": t.served_name, "prompt": "hi", "max_tokens": 2})
            observation = await _converge(r, driver, state(demoted, warm, *cold))
            assert truth.tier(emu.engine.registered[hot.served_name].int_id) is not Tier.GPU
            # so does the host-tier target's, warmed once already: the sidecar leaves it to vLLM's LRU instead of
            # warming it again (a one-token completion that would take a GPU slot from another adapter)
            assert observation.adapters[warm.served_name].tier is Tier.DISK and r.left_to_runtime(warm)
            assert warm.served_name not in driver.posted("/v1/completions")[warm_ups:]
            # one the controller holds (a rollout gate reads its tier) is warmed again whenever it drifts
            held_warm = warm.model_copy(update={"hold": True})
            observation = await _converge(r, driver, state(demoted, held_warm, *cold))
            assert observation.adapters[warm.served_name].tier is not Tier.DISK
            assert driver._host_keep == {warm.served_name}  # and defended before the sidecar's own loads
            assert warm.served_name in driver.posted("/v1/completions")[warm_ups:]
            # a move between the warm tiers is no new entry (vLLM's LRU moves copies between them anyway) ...
            promoted = warm.model_copy(update={"tier": Tier.GPU})
            observation = await _converge(r, driver, state(demoted, promoted, *cold))
            assert r.left_to_runtime(promoted)
            # ... a move from the disk tier to a warm one is, and warms it again
            warm_ups = len(driver.posted("/v1/completions"))
            for t in cold:  # its copy leaves the host cache
                await emu.http.post("/v1/completions", json={"model": t.served_name, "prompt": "hi", "max_tokens": 2})
            await _converge(r, driver, state(demoted, warm.model_copy(update={"tier": Tier.DISK}), *cold))
            observation = await _converge(r, driver, state(demoted, promoted, *cold))
            assert observation.adapters[warm.served_name].tier is not Tier.DISK
            assert warm.served_name in driver.posted("/v1/completions")[warm_ups:]
            assert driver.posted("/v1/unload_lora_adapter") == []
            await r.cancel()

    asyncio.run(run())


def test_a_kept_adapter_vllm_no_longer_has_does_not_fail_the_load(tmp_path: Path) -> None:
    """Before a load the driver touches the kept GPU adapters LRU would push out; one vLLM has unloaded meanwhile
    (the keep set is from the last pass) answers 404. That is nothing to keep, not a failed load: the load goes on
    (before, it failed and backed off: `load X failed (LoadRejected): The model Y does not exist` in the twin)."""
    from tests.emulator.conftest import emulator
    from tests.sidecar.adapters import write_peft_dir

    async def run() -> None:
        async with emulator(tmp_path / "emu", EngineConfig(max_loras=2, max_cpu_loras=4), shapes=None) as emu:
            driver = EmulatedVllm(emu, RuntimeInfo(base_model="m", max_loras=2, max_cpu_loras=4))
            paths = {}
            for i, name in enumerate(("kept", "other", "new")):
                paths[name] = tmp_path / name
                write_peft_dir(paths[name], seed=i)
            for name in ("kept", "other"):
                await driver.load(name, paths[name])
            driver.keep_resident({"kept"}, {"kept"})
            # unloaded behind the driver's back: its keep set and replayed caches still have it in a GPU slot, the
            # least recently used one, so loading "new" would push it out and the driver touches it first
            answer = await emu.http.post("/v1/unload_lora_adapter", json={"lora_name": "kept"})
            assert answer.status_code == 200
            await driver.load("new", paths["new"])
            assert "kept" in driver.posted("/v1/completions")  # it was tried (404) and skipped
            assert "new" in emu.engine.registered
            await driver.close()

    asyncio.run(run())


#: the residency series (vLLM's open PR stack, or loraplane's plugin) a vLLM without them does not export
RESIDENCY_SERIES = ("vllm:lora_adapter_", "vllm:num_gpu_loaded_lora_adapters", "vllm:num_cpu_loaded_lora_adapters",
                    "vllm:max_gpu_lora_adapters", "loraplane_vllm_")


class StockVllm(EmulatedVllm):
    """The emulated vLLM less every residency series on its /metrics: vLLM 0.32 as released, or with loraplane's
    plugin and ``LORAPLANE_VLLM_RESIDENCY=0``."""

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> RuntimeResponse:
        answer = await super()._request(method, path, body)
        if path != "/metrics":
            return answer
        kept = [line for line in answer.text.splitlines()
                if not any(name in line.split("{")[0] for name in RESIDENCY_SERIES)]
        return RuntimeResponse(answer.status_code, "\n".join(kept).encode())


async def test_without_residency_series_the_report_says_lru_model_and_inferred(tmp_path: Path, redis_srv) -> None:
    """The sidecar prefers vLLM's residency series and falls back to its LRU model only when /metrics has none: the
    published report says which (``residency_source`` lru-model and ``residency_inferred``, else vllm-metrics and
    not inferred), and the fallback's tiers are the model's."""
    import redis.asyncio as aioredis

    from loraplane.api import ResidencyReport, ResidencySource, keys
    from loraplane.sidecar.bus import RedisBus
    from loraplane.sidecar.service import Sidecar, SidecarConfig
    from tests.emulator.conftest import emulator
    from tests.sidecar.adapters import sha256_of, target_for, write_weights
    from tests.sidecar.test_reconcile import INFO, make_reconciler

    client = aioredis.Redis.from_url(redis_srv.url)
    names = ("hot@v1", "warm@v1")

    async def published(driver_type: type[EmulatedVllm], pod: str) -> ResidencyReport:
        (tmp_path / pod / "artifacts").mkdir(parents=True)
        weights = {name: write_weights(tmp_path / pod / "artifacts" / f"{name}.safetensors", seed=i)
                   for i, name in enumerate(("hot", "warm"))}
        hot = target_for(f"file://{weights['hot']}", sha256_of(weights["hot"]), adapter="hot", tier=Tier.GPU)
        warm = target_for(f"file://{weights['warm']}", sha256_of(weights["warm"]), adapter="warm", tier=Tier.CPU)
        assert (hot.served_name, warm.served_name) == names
        async with emulator(tmp_path / pod, EngineConfig(max_loras=2, max_cpu_loras=4), shapes=None) as emu:
            r = make_reconciler(tmp_path / pod, runtime="vllm")
            driver = r.driver = driver_type(emu, INFO)
            bus = RedisBus(redis_srv.url, "pool-a", pod)
            sidecar = Sidecar(SidecarConfig("pool-a", pod, "10.0.0.1:8000", "vllm"), r, bus)
            target = TargetState(pool="pool-a", pod=pod, generation=1, adapters=[hot, warm], updated_at=0.0)
            await client.set(keys.target_state("pool-a", pod), target.to_json())
            try:
                for _ in range(30):
                    await sidecar.run_once()
                    if not r.busy() and set(emu.engine.registered) == set(names):
                        break
                    await r.drain()
                await sidecar.run_once()
                raw = await client.get(keys.residency_report("pool-a", pod))
                assert raw is not None
                stored = ResidencyReport.from_json(raw)
                rows = stored.by_name()
                assert all(rows[name].registered for name in names), rows
                assert {n: row.tier for n, row in rows.items()} == {n: driver.cache.tier(n) for n in rows}
                return stored
            finally:
                await r.cancel()
                await driver.close()
                await bus.close()

    try:
        exact = await published(EmulatedVllm, "pod-exact")
        assert exact.residency_source is ResidencySource.VLLM_METRICS and not exact.residency_inferred
        inferred = await published(StockVllm, "pod-stock")
        assert inferred.residency_source is ResidencySource.LRU_MODEL and inferred.residency_inferred
        assert inferred.by_name()["hot@v1"].tier is Tier.GPU  # the model's: hot's load took a GPU slot
    finally:
        await client.aclose()
