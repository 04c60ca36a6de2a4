"""What the simulated picker sees of residency and staging, as the real one sees the sidecars' reports and the route
table: a disk-cache entry the pod's target does not list is not held there (``registered: false``), and while the
plan stages idle revisions apart a request for a revision no pod holds goes to a staging pod, never to a gold pod."""

from __future__ import annotations

from loraplane.controller.placement import PlacementConfig
from loraplane.picker.scheduler import Decision, Scheduler
from loraplane.sim.cluster import Pod, SimConfig, Simulator
from loraplane.sim.policies import PickerRouter, build_policy, picker_config_for
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.trace import Adapter, Tenant, Trace, scenario
from tests.sim.conftest import ADAPTER_BYTES


def test_a_disk_cache_entry_outside_the_target_is_not_held() -> None:
    trace = Trace(name="one", tenants=[Tenant("t")], adapters=[Adapter("a@v1", 0, ADAPTER_BYTES)], arrival=[0.0],
                  adapter=[0], tenant=[0], input_tokens=[100], output_tokens=[10])
    router = PickerRouter(0, trace, LARGE_GPU, Scheduler(picker_config_for(LARGE_GPU)))
    cached, empty = Pod(0, 4, 16, disk={0}), Pod(1, 4, 16, disk=set())
    cached.planned = set()  # a plan that no longer lists it: only in the pod's disk cache
    cached.waiting.extend([0, 0, 0])  # the pod with the adapter in its cache is the busier one
    assert router.decide(0.0, 0, trace, [cached, empty]).indices[0] == 1  # only cached: no holder, least loaded
    cached.planned, cached.plan_version = {0}, cached.plan_version + 1  # its target lists it: registered there
    assert router.decide(5.0, 0, trace, [cached, empty]).indices[0] == 0


def _cold_decisions(share: float) -> list[tuple[frozenset[str], str]]:
    """(staging pods of the last plan, chosen pod) of every decision for a revision no pod's report held."""
    trace = scenario("hot-plus-burst", 6000, 0, LARGE_GPU.default_adapter_bytes)
    # disks that hold six adapters each: most of the sweep's revisions have room on no disk (fetched on use)
    config = SimConfig(disk_bytes=6 * LARGE_GPU.default_adapter_bytes, placement=PlacementConfig(staging_share=share))
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
