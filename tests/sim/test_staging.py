"""The simulated picker reads the controller's staging pods as the real one reads its route table: while the plan
stages idle revisions apart, a request for a revision no pod holds goes to a staging pod, never to a gold pod."""

from __future__ import annotations

from loraplane.controller.placement import PlacementConfig
from loraplane.picker.scheduler import Decision
from loraplane.sim.cluster import ON_DEMAND, Pod, SimConfig, Simulator
from loraplane.sim.policies import PickerRouter, build_policy
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.trace import Trace, scenario


def _cold_decisions(share: float) -> list[tuple[frozenset[str], str]]:
    """(staging pods of the last plan, chosen pod) of every decision for a revision no pod's report held."""
    trace = scenario("hot-plus-burst", 6000, 0, LARGE_GPU.default_adapter_bytes)
    # disks that hold six adapters each: most of the sweep's revisions have room on no disk (fetched on use); pods
    # that load on demand (vLLM pods serve only what their sidecar registered: the picker waits for a holder)
    config = SimConfig(disk_bytes=6 * LARGE_GPU.default_adapter_bytes, placement=PlacementConfig(staging_share=share),
                       loraplane_runtime=ON_DEMAND)
    policy = build_policy("loraplane", 0, trace, LARGE_GPU, config)
    router, placement = policy.router, policy.placement
    assert isinstance(router, PickerRouter) and placement is not None
    decide, cold = router.decide, []

    def recorded(now: float, rid: int, trace: Trace, pods: list[Pod]) -> Decision:
        decision = decide(now, rid, trace, pods)
        adapter = trace.adapters[trace.adapter[rid]]
        if router._snapshot is not None and router._snapshot.lookup(adapter.name, router._digests[trace.adapter[rid]]) is None:
            cold.append((placement.staging(), decision.endpoints[0]))  # type: ignore[attr-defined]
        return decision

    router.decide = recorded  # type: ignore[method-assign]
    Simulator(trace, config, policy.pod_profile or LARGE_GPU, router, policy.eviction, placement,
              admission=policy.admission, priority=policy.priority).run()
    return cold


def _pod_name(address: str) -> str:
    return f"pod-{int(address.split(':')[0].rsplit('.', 1)[1]) - 1}"


def test_revisions_no_pod_holds_go_to_the_staging_pods() -> None:
    cold = _cold_decisions(0.25)
    staged = [(staging, _pod_name(address)) for staging, address in cold if staging]
    assert len(staged) > 100  # the sweep's first requests, while idle revisions are staged apart
    assert {len(staging) for staging, _ in staged} == {2}
    assert all(pod in staging for staging, pod in staged), [p for s, p in staged if p not in s][:10]
    # without staging the same requests spread over the pool
    spread = {_pod_name(address) for staging, address in _cold_decisions(0.0)}
    assert len(spread) > 2
