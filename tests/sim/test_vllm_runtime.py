"""loraplane's pods as vLLM behind its sidecar (``SimConfig.loraplane_runtime`` vllm): they serve only what the
sidecar registered, every registration is a load into a GPU slot, and the picker routes only to registered pods."""

from __future__ import annotations

import pytest

from loraplane.api import Tier
from loraplane.sim.cluster import _LOADED, VLLM, SimConfig, Simulator
from loraplane.sim.policies import LORAPLANE, ControllerPlacement, build_policy
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.trace import scenario
from tests.sim.conftest import ADAPTER_BYTES

CONFIG = SimConfig(pods=4, max_loras=4, max_cpu_loras=16, loraplane_runtime=VLLM)


def simulator(requests: int = 400) -> Simulator:
    trace = scenario("zipf-many", requests, seed=2, adapter_bytes=ADAPTER_BYTES)
    built = build_policy(LORAPLANE, 2, trace, LARGE_GPU, CONFIG)
    return Simulator(trace, CONFIG, built.pod_profile or LARGE_GPU, built.router, built.eviction, built.placement,
                     admission=built.admission, priority=built.priority)


def test_every_request_goes_to_a_pod_that_registered_its_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = simulator()
    sent = Simulator.dispatch
    unregistered: list[int] = []

    def dispatch(self: Simulator, rid: int, pod_index: int) -> None:
        registered = self.pods[pod_index].registered
        assert registered is not None
        if self.trace.adapter[rid] not in registered:
            unregistered.append(rid)
        sent(self, rid, pod_index)

    monkeypatch.setattr(Simulator, "dispatch", dispatch)
    result = sim.run()
    served = sum(1 for r in result.refused if r == 0)
    assert served > 100  # a burst beyond the pool: many wait out their deadline in the picker's queue
    assert unregistered == []
    # every pod registered exactly its last targets, and the pods hold fewer than every adapter
    placement = sim.placement
    assert isinstance(placement, ControllerPlacement)
    assert all(pod.registered is not None and len(pod.registered) < len(sim.trace.adapters) for pod in sim.pods)


def test_a_registration_is_a_load_into_a_gpu_slot_and_an_unregistered_copy_stays_until_lru_pushes_it_out() -> None:
    sim = simulator()
    pod = sim.pods[0]
    pod.registered = set()
    on_disk = next(a for a in range(len(sim.trace.adapters)) if a in pod.disk)
    sim.arrived = 1  # past the set-up: the load counts
    sim.register(pod, on_disk)  # the idle pod loads it at once, its engine busy until the load is done
    assert on_disk in pod.registered and on_disk in pod.gpu and sim.result.gpu_loads == 1
    assert sim.result.registration_loads == 1 and pod.busy
    sim.loads_done(pod, pod.event_time)
    assert not pod.busy
    sim.unregister(pod, on_disk)
    # vLLM's unload forgets the name only: the copy keeps its GPU slot and its host copy
    assert on_disk not in pod.registered and on_disk in pod.gpu and on_disk in pod.cpu
    # registered again, vLLM reads a second copy from disk: a load, not the old copy
    sim.register(pod, on_disk)
    assert on_disk in pod.registered and on_disk in pod.gpu and sim.result.gpu_loads == 2
    sim.loads_done(pod, pod.event_time)
    # the old copies are least recently used: the loads of others push them out
    sim.unregister(pod, on_disk)
    others = [a for a in range(len(sim.trace.adapters)) if a in pod.disk and a != on_disk][:pod.max_loras]
    for other in others:
        sim.register(pod, other)
        sim.loads_done(pod, pod.event_time)
    assert on_disk not in pod.gpu and on_disk in pod.cpu
    # an adapter not on disk yet is fetched first and registered when it lands
    pod.disk.discard(on_disk)
    sim.register(pod, on_disk)
    assert on_disk not in pod.registered and on_disk in pod.downloading
    sim._downloaded(pod, on_disk)
    assert on_disk in pod.registered and on_disk in pod.gpu and sim.result.gpu_loads == 3 + len(others)
    # before the first request the pool is set up at once (the twin onboards before it replays): no fetch, and
    # the load is a set-up load
    fresh = simulator()
    pod = fresh.pods[0]
    pod.registered = set()
    absent = next(a for a in range(len(fresh.trace.adapters)) if a not in pod.disk)
    fresh.register(pod, absent)
    assert absent in pod.registered and absent in pod.gpu and not pod.downloading
    assert fresh.result.gpu_loads == 0 and fresh.result.setup_loads == 1


def test_the_picker_sees_only_registered_adapters() -> None:
    sim = simulator()
    router = build_policy(LORAPLANE, 2, sim.trace, LARGE_GPU, CONFIG).router
    pod = sim.pods[0]
    pod.registered = {0, 1}
    pod.cpu, pod.gpu = {1, 2}, {2}
    rows = router._residency_of(pod)  # type: ignore[attr-defined]
    names = [a.name for a in sim.trace.adapters]
    assert {name: tier for name, (tier, _) in rows.items()} == {names[0]: Tier.DISK, names[1]: Tier.CPU}
    # pods that load on demand report every adapter on their disk
    pod.registered = None
    pod.residency_version += 1
    assert len(router._residency_of(pod)) == len(pod.disk)  # type: ignore[attr-defined]


def test_vllm_pods_are_planned_at_the_controllers_resync() -> None:
    from loraplane.controller.manager import ControllerConfig
    from loraplane.sim.policies import CONTROLLER_RESYNC_S

    assert simulator().placement.period_s == CONTROLLER_RESYNC_S == ControllerConfig().resync_seconds  # type: ignore[union-attr]


def test_disk_tier_registrations_load_one_a_step_after_the_requests_waiting_in_the_queue() -> None:
    """As ``Reconciler.step`` holds them on vLLM: the load of a disk-tier registration (no request needs it yet, and
    it stalls the batch) waits while requests wait in the pod's queue, ``SLOTS_BUSY_WAIT_S`` at most, and they go one
    at a time (one a step), not several stalling one step together; warm targets' loads never wait for the queue."""
    from loraplane.sidecar.reconcile import SLOTS_BUSY_WAIT_S

    sim = simulator()
    placement = sim.placement
    assert isinstance(placement, ControllerPlacement)
    pod = sim.pods[0]
    pod.registered = set()
    pod.busy, pod.event_time = True, 0.0  # mid-step: the loads wait for the next one
    sim.arrived = 1
    pod.waiting.append(0)  # a request waits
    warm, cold, idle_cold, next_cold = sorted(pod.disk)[:4]
    placement._register(sim, pod, {warm: Tier.GPU, cold: Tier.DISK})
    assert pod.cold_loads == {cold}
    load_s = sim._load_s[warm][2]
    assert sim._placement_loads(pod, 1.0) == load_s and warm in pod.gpu and cold not in pod.gpu
    assert sim._placement_loads(pod, 1.0 + SLOTS_BUSY_WAIT_S / 2) == 0.0 and cold not in pod.gpu
    assert sim._placement_loads(pod, 1.1 + SLOTS_BUSY_WAIT_S) == load_s and cold in pod.gpu
    pod.waiting.clear()
    placement._register(sim, pod, {warm: Tier.GPU, cold: Tier.DISK, idle_cold: Tier.DISK, next_cold: Tier.DISK})
    assert sim._placement_loads(pod, 5.0) == load_s and idle_cold in pod.gpu and next_cold not in pod.gpu
    assert sim._placement_loads(pod, 5.1) == load_s and next_cold in pod.gpu
    assert sim.result.registration_loads == 4
    # a pod with nothing to run makes the next one when its engine has made this one, not at its next request
    last, after = sorted(pod.disk)[4:6]
    placement._register(sim, pod, {warm: Tier.GPU, last: Tier.DISK, after: Tier.DISK})
    pod.busy, sim._heap[:] = False, []
    sim._begin(pod, 6.0)
    assert last in pod.gpu and after not in pod.gpu and [e[2:4] for e in sim._heap] == [(_LOADED, pod.index)]
    assert pod.busy and pod.event_time == 6.0 + load_s


def test_the_controller_plans_on_each_pods_last_report_not_its_state_now() -> None:
    """A sidecar writes its report once a heartbeat (``REPORT_S``): a tier that moved since stays unseen by the
    controller's passes until the pod's next heartbeat (the simulator's controller, reading every change live, planned
    four times as often as the real one on zipf-many)."""
    from loraplane.sim.policies import REPORT_S

    sim = simulator()
    placement = sim.placement
    assert isinstance(placement, ControllerPlacement)
    pod = sim.pods[0]
    pod.registered = set(sorted(pod.disk)[:2])
    placement._pods = sim.pods
    phase = placement._phase[0]
    placement._now = phase + 0.1  # just after pod-0's heartbeat
    before = placement._rows(0)
    adapter = min(pod.registered)
    pod.gpu.add(adapter)
    pod.residency_version += 1
    placement._now = phase + 0.9
    assert placement._rows(0) == before
    placement._now = phase + REPORT_S + 0.1
    after = placement._rows(0)
    assert after != before and any(row[0] == placement._names[adapter] and row[1] is Tier.GPU for row in after)
    # a pass that found no change vouches for the next heartbeat's report; a change after it waits for the one after
    placement._now = phase + 2 * REPORT_S + 0.1
    assert placement._rows(0) == after
    pod.gpu.discard(adapter)
    pod.residency_version += 1
    placement._now = phase + 2 * REPORT_S + 0.5
    assert placement._rows(0) == after
