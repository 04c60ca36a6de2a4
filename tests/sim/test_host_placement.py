"""The simulator plans its pods' host memory as the controller does: vLLM's host cache (``max_cpu_loras``) holds
the GPU-resident adapters too, and the spare host slots carry copies of GPU-placed adapters for spills."""

from __future__ import annotations

from loraplane.api import Tier
from loraplane.controller.placement import Placement as PlacementPlan
from loraplane.controller.placement import PlacementConfig
from loraplane.sim.cluster import SimConfig, Simulator
from loraplane.sim.policies import build_policy
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.trace import Adapter, Tenant, Trace
from tests.sim.conftest import ADAPTER_BYTES

REQUESTS = 1200


def _trace(adapters: int) -> Trace:
    # a skewed mix over two minutes: a few hot adapters, every one with some traffic
    chosen = [min(i % adapters, (i * 7) % adapters, (i * 13) % adapters) for i in range(REQUESTS)]
    arrival = [120.0 * i / REQUESTS for i in range(REQUESTS)]
    return Trace(name="host-placement", tenants=[Tenant("t")],
                 adapters=[Adapter(f"a{i}@v1", 0, ADAPTER_BYTES) for i in range(adapters)], arrival=arrival,
                 adapter=chosen, tenant=[0] * REQUESTS, input_tokens=[256] * REQUESTS, output_tokens=[16] * REQUESTS)


def _last_plan(adapters: int, config: SimConfig) -> PlacementPlan:
    trace = _trace(adapters)
    policy = build_policy("loraplane", 0, trace, LARGE_GPU, config)
    Simulator(trace, config, LARGE_GPU, policy.router, policy.eviction, policy.placement,
              admission=policy.admission).run()
    plan = policy.placement._previous.placement  # type: ignore[attr-defined]
    assert plan is not None
    return plan


def test_the_plan_fits_the_host_cache_that_holds_the_gpu_resident_adapters_too() -> None:
    config = SimConfig(pods=3, max_loras=2, max_cpu_loras=8)
    plan = _last_plan(40, config)  # more adapters with traffic than the pool's host memory holds
    for pod, held in plan.pods.items():
        warm = [name for name, tier in held.items() if tier in (Tier.GPU, Tier.CPU)]
        assert len(warm) <= config.max_cpu_loras, (pod, held)


def test_gpu_placed_adapters_get_host_copies_in_the_spare_host_slots() -> None:
    config = SimConfig(pods=3, max_loras=2, max_cpu_loras=8, placement=PlacementConfig(host_copies=1))
    plan = _last_plan(6, config)  # the controller's default is no host copies
    gpu, cpu = plan.replicas(Tier.GPU), plan.replicas(Tier.CPU)
    assert gpu
    for name, pods in gpu.items():
        assert cpu.get(name, set()) - pods, (name, plan.pods)  # a host copy on a pod without its GPU replica
