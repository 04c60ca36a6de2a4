"""The vllm driver's model of vLLM's LoRA caches and metrics, and the reconciler's placement rules for runtimes whose
loads activate. (The same behaviour against a real vLLM process: e2e/test_vllm_driver.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplane.api import AdapterTarget, Artifact, LoraSpec, TargetState, Tier
from loraplane.sidecar.drivers.base import RuntimeInfo
from loraplane.sidecar.drivers.vllm import (
    LoraCacheModel,
    VllmDriver,
    lora_last_served,
    lora_requests,
    parse_metrics,
    pod_load,
)
from loraplane.sidecar.reconcile import Reconciler
from loraplane.vllm_server import VllmOptions, start_vllm

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
