"""The simulator plans its pods' host memory as the controller does: vLLM's host cache (``max_cpu_loras``) holds
the GPU-resident adapters too, and the spare host slots carry copies of GPU-placed adapters for spills."""

from __future__ import annotations

from loraplane.api import Tier
from loraplane.sim.cluster import SimConfig, Simulator
from loraplane.sim.policies import build_policy
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.trace import Adapter, Tenant, Trace
from tests.sim.conftest import ADAPTER_BYTES

ADAPTERS = 12
REQUESTS = 1200


def _trace() -> Trace:
    adapters = [Adapter(f"a{i}@v1", 0, ADAPTER_BYTES) for i in range(ADAPTERS)]
    # a skewed mix over two minutes: a few hot adapters, every one with some traffic
    chosen = [min(i % 7, i % 13) for i in range(REQUESTS)]
    arrival = [120.0 * i / REQUESTS for i in range(REQUESTS)]
    return Trace(name="host-placement", tenants=[Tenant("t")], adapters=adapters, arrival=arrival, adapter=chosen,
                 tenant=[0] * REQUESTS, input_tokens=[256] * REQUESTS, output_tokens=[16] * REQUESTS)


def test_the_plan_fits_the_host_cache_and_copies_gpu_adapters_to_spare_host_slots() -> None:
    trace, config = _trace(), SimConfig(pods=3, max_loras=2, max_cpu_loras=8)
    policy = build_policy("loraplane", 0, trace, LARGE_GPU, config)
    Simulator(trace, config, LARGE_GPU, policy.router, policy.eviction, policy.placement,
              admission=policy.admission).run()
    plan = policy.placement._previous  # type: ignore[attr-defined]
    assert plan is not None
    for pod, held in plan.pods.items():
        warm = [name for name, tier in held.items() if tier in (Tier.GPU, Tier.CPU)]
        assert len(warm) <= config.max_cpu_loras, (pod, held)  # GPU-resident ones take host slots too
    gpu, cpu = plan.replicas(Tier.GPU), plan.replicas(Tier.CPU)
    assert any(cpu.get(name, set()) - pods for name, pods in gpu.items())  # a host copy on a pod without the GPU one
