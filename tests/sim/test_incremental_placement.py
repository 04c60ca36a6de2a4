"""The simulator's placement is the real controller's planning (``SimulatedController``): its ``IncrementalPlanner``
on the reports the simulated pods' sidecars would publish, the rates the picker's ``RequestStats`` counts, its own
statuses written back onto the revisions and the target states it wrote.

(It had a model of the planner before, which planned only on rate changes: the twin made twice its target adds.)
"""

from __future__ import annotations

import pytest

from loraplane.api import Phase, Tier
from loraplane.controller.pool import plan_pool
from loraplane.sim.cluster import VLLM, SimConfig, Simulator
from loraplane.sim.control import PATCH_S, PLAN_S_PER_REVISION, POOL, WATCH_S
from loraplane.sim.policies import LORAPLANE, ControllerPlacement, build_policy
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.trace import scenario
from tests.sim.conftest import ADAPTER_BYTES

CONFIG = SimConfig(pods=4, max_loras=4, max_cpu_loras=16, loraplane_runtime=VLLM)


def _simulator(name: str, requests: int) -> tuple[Simulator, ControllerPlacement]:
    trace = scenario(name, requests, seed=2, adapter_bytes=ADAPTER_BYTES)
    built = build_policy(LORAPLANE, 2, trace, LARGE_GPU, CONFIG)
    sim = Simulator(trace, CONFIG, built.pod_profile or LARGE_GPU, built.router, built.eviction, built.placement,
                    admission=built.admission, priority=built.priority)
    assert isinstance(sim.placement, ControllerPlacement)
    return sim, sim.placement


def test_the_pods_report_what_their_sidecars_would() -> None:
    """A vLLM pod's rows: its registered revisions at the tier of their copy (disk: none in memory), draining ones
    flagged; its targets not registered yet as fetched (disk) or not (absent), neither registered."""
    sim, placement = _simulator("zipf-many", 50)
    pod = sim.pods[0]
    names = placement._names
    pod.registered, pod.gpu, pod.cpu, pod.disk = {0, 1, 2, 3}, {0}, {0, 1}, {0, 1, 2, 3, 4}
    pod.draining, pod.planned = {3}, {0, 1, 2, 4, 5}
    placement._pods = sim.pods
    assert set(placement._rows(0)) == {
        (names[0], Tier.GPU, True, False), (names[1], Tier.CPU, True, False), (names[2], Tier.DISK, True, False),
        (names[3], Tier.DISK, True, True), (names[4], Tier.DISK, False, False), (names[5], Tier.ABSENT, False, False)}


def test_the_simulator_plans_with_the_controllers_own_planner() -> None:
    """Over a run: every pod's sidecar applied the target state the controller last wrote, the planner kept its plan
    or planned a part at most passes, the revisions carry the statuses it decided (Stable, counted residency), and
    a whole plan made from scratch on the same revisions keeps every one Stable."""
    sim, placement = _simulator("hot-plus-burst", 1500)
    sim.run()
    controller = placement.controller
    planner = controller.planner
    assert planner.planned >= 1 and planner.reused + planner.parts + planner.deltas > planner.planned
    for pod in sim.pods:
        state = controller.written[f"pod-{pod.index}"]
        assert pod.planned == {placement._index[t.served_name] for t in state.adapters}
        assert pod.registered is not None and pod.planned - pod.draining <= pod.registered | pod.registering
    assert {r.status.phase for r in controller.revisions} == {Phase.STABLE}
    assert any(r.status.residency.gpu > 0 for r in controller.revisions)
    assert controller.plans.total() * placement.period_s >= sim.trace.duration
    assert sim.result.controller_plans == controller.plans and {"whole", "reused"} <= controller.plans.keys()
    last = placement._previous
    assert last is not None and last.targets.keys() <= controller.written.keys()
    assert all(r.pool_ref.name == POOL for r in (rev.spec for rev in controller.revisions))
    assert controller.last_inputs is not None
    whole = plan_pool(controller.last_inputs)
    assert {rp.status.phase for rp in whole.revisions.values()} == {Phase.STABLE}


def test_it_passes_as_the_controllers_work_queue_hands_out_its_pool() -> None:
    """A pass takes its planning and its status patches; one that patched statuses is followed by one ``WATCH_S``
    after (the watch hands the objects back, which queues the pool at once), any other by one after the resync less
    up to 25 % (the manager's jitter)."""
    sim, placement = _simulator("hot-plus-burst", 200)
    start = float(sim.trace.arrival[0])
    first = placement.apply(start, sim)  # the first plan decides and writes every revision's status
    revisions = len(sim.trace.adapters)
    assert placement.controller.patched == revisions
    assert first == pytest.approx((PLAN_S_PER_REVISION + PATCH_S) * revisions + WATCH_S)
    now, quiet = start, []
    for _ in range(6):  # the pods register their targets: a few passes plan the adapters they concern again
        now += WATCH_S
        after = placement.apply(now, sim)
        busy = placement.controller.pass_seconds
        if placement.controller.patched:
            assert after == busy + WATCH_S and busy >= PATCH_S * placement.controller.patched
        else:
            quiet.append(after - busy)
    assert quiet and all(0.75 * placement.period_s <= resync <= placement.period_s for resync in quiet)


def test_the_sidecars_warm_once_activates_an_entry_only_while_its_copy_is_on_disk(monkeypatch) -> None:
    """As the vLLM sidecar's reconciler: a registered revision whose target comes into a warm tier is activated (a
    load) only while its copy is on disk; one whose copy is in host memory already is left, and looked at again at
    each pass until vLLM's LRU drops it to disk; then it is warmed, once."""
    sim, placement = _simulator("hot-plus-burst", 50)
    pod = sim.pods[0]
    pod.registered, pod.gpu, pod.cpu, pod.disk = {0, 1}, set(), {0}, {0, 1}
    placement._entries[0] = {0: Tier.DISK, 1: Tier.DISK}
    asked: list[int] = []
    monkeypatch.setattr(sim, "prefetch", lambda _pod, adapter: asked.append(adapter))
    placement._register(sim, pod, {0: Tier.CPU, 1: Tier.CPU})
    assert asked == [1]
    placement._warm(sim, pod)
    assert asked == [1]
    pod.cpu.discard(0)
    placement._warm(sim, pod)
    placement._warm(sim, pod)
    assert asked == [1, 0]
