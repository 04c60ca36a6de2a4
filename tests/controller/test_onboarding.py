"""Onboarding many first revisions at once into a pool short of GPU slots: every revision must end Stable.

A pool simulation at the level of ``plan_pool``: sidecars hold exactly what the last target states ask (the
engine's: a disk-tier revision stays registered), and each health probe is answered after the sidecars applied the
targets of the pass that asked for it (the race the live stack loses: a canary evicted by its own pass's plan
answers its probe with the runtime's 404).
"""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

import pytest

from loraplane.api import AdapterRevision, Phase, PodLoad, ResidencyReport, TargetState
from loraplane.api.runtime import AdapterResidency, Tier
from loraplane.controller.placement import PlacementConfig
from loraplane.controller.pool import PoolInputs, PoolPlan, plan_pool
from loraplane.controller.rollout import ProbeResult
from loraplane.sidecar.drivers.base import RuntimeInfo
from loraplane.sidecar.reconcile import Reconciler
from tests.controller.world import BASE_DIGEST, T0, revision

PODS = ("pod-0", "pod-1", "pod-2")


class Pool:
    """Pods that hold exactly what their target states say, and a clock."""

    def __init__(self, revisions: list[AdapterRevision], gpu_slots: int = 2, cpu_slots: int = 4,
                 seed: int = 0, pods: tuple[str, ...] = PODS, load_chance: float = 0.3) -> None:
        self.revisions = revisions
        self.pods, self.load_chance = pods, load_chance
        #: False: probes go unanswered (a slow probe)
        self.answering = True
        self.now = T0
        self.gpu_slots, self.cpu_slots = gpu_slots, cpu_slots
        self.held: dict[str, dict[str, Tier]] = {pod: {} for pod in pods}
        self.rng = random.Random(seed)
        self.targets: dict[str, TargetState] = {}
        self.probes: dict[tuple[str, str], ProbeResult] = {}
        #: the most revisions that held a canary requirement at GPU on one pod in one plan
        self.required_gpu_peak = 0

    def clip(self, state: TargetState) -> dict[str, Tier]:
        """The target as the pod's sidecar applies it (the engine's: as written)."""
        return {t.served_name: t.tier for t in state.adapters}

    def serves(self, pod: str, served_name: str) -> bool:
        """True when a request for ``served_name`` is served on ``pod`` (the engine: registered at any tier)."""
        tier = self.held[pod].get(served_name)
        return tier is not None and tier is not Tier.ABSENT

    def digest(self, served_name: str) -> str:
        return next(r.spec.artifact.digest for r in self.revisions if r.served_name == served_name)

    def report(self, pod: str, i: int) -> ResidencyReport:
        return ResidencyReport(
            pool="pool", pod=pod, address=f"10.0.0.{i}:8000", base_model_digest=BASE_DIGEST, max_lora_rank=64,
            heartbeat_at=self.now.timestamp(), demotes_to_disk=True,
            adapters=[AdapterResidency(served_name=n, tier=t, digest=self.digest(n), bytes=1 << 20, registered=True)
                      for n, t in sorted(self.held[pod].items())],
            load=PodLoad(max_gpu_slots=self.gpu_slots, max_cpu_slots=self.cpu_slots + self.gpu_slots),
        )

    def step(self) -> PoolPlan:
        plan = plan_pool(PoolInputs(
            pool="pool", now=self.now, revisions=self.revisions,
            reports=[self.report(pod, i) for i, pod in enumerate(self.pods)],
            previous_targets=self.targets, probes=self.probes, placement=PlacementConfig(),
        ))
        by_key = {(r.metadata.namespace, r.metadata.name): r for r in self.revisions}
        for key, rp in plan.revisions.items():
            by_key[key].status = type(rp.status).from_json(rp.status.to_json())
        for pod in self.pods:
            required = sum(1 for rp in plan.revisions.values() if rp.required.get(pod) is Tier.GPU)
            self.required_gpu_peak = max(self.required_gpu_peak, required)
        self.targets = {pod: TargetState(pool="pool", pod=pod, generation=1, adapters=adapters, updated_at=0.0)
                        for pod, adapters in plan.targets.items()}
        # the sidecars apply the new targets: removals and demotions at once, each load or promotion in its own
        # time (a fetch, a load, an activation: some passes each) ...
        for pod, state in self.targets.items():
            wanted = self.clip(state)
            held = self.held[pod]
            for name in [n for n in held if n not in wanted]:
                del held[name]
            for name, tier in wanted.items():
                now = held.get(name)
                if now is not None and tier.level >= now.level:
                    held[name] = tier
                elif self.rng.random() < self.load_chance:
                    held[name] = tier
        # ... and only then does each probe of this pass arrive at its pod
        for _, request in plan.probes if self.answering else ():
            ok = self.serves(request.pod, request.served_name)
            self.probes[(request.served_name, request.pod)] = ProbeResult(
                at=self.now, ok=ok, message="200" if ok else "HTTP 404", ttft_ms=5.0, status=200 if ok else 404)
        self.now += timedelta(seconds=0.5)
        return plan


class VllmPool(Pool):
    """Pods whose runtime is vLLM, as their sidecars drive it: a load activates (the sidecar keeps one GPU slot free
    of GPU-tier targets while it has host-tier ones), the host cache holds ``max(max_cpu_loras, max_loras)`` copies.
    With ``registers_disk`` (sidecars now) a disk-tier target is registered, not kept resident: it is served from
    disk, and the sidecar keeps the landing slot and one host copy for loading and serving those; without (sidecars
    before), a disk-tier target is unloaded. Each sidecar cuts its target to those limits by its own order
    (``Reconciler.within_capacity``: pinned, priority, name) before applying it; a probe gets vLLM's 404 when the
    name is not registered."""

    def __init__(self, *args: Any, registers_disk: bool = True, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.registers_disk = registers_disk
        #: the most targets one sidecar had to cut by its own order in one pass (the controller's cut leaves none)
        self.clipped_peak = 0

    def report(self, pod: str, i: int) -> ResidencyReport:
        report = super().report(pod, i)
        report.demotes_to_disk, report.loads_activate = self.registers_disk, True
        report.load.max_cpu_slots = max(self.cpu_slots, self.gpu_slots)
        for row in report.adapters:
            row.registered = self.serves(pod, row.served_name)
        return report

    def clip(self, state: TargetState) -> dict[str, Tier]:
        info = RuntimeInfo(base_model="base", max_loras=self.gpu_slots, max_cpu_loras=self.cpu_slots)
        wanted, why = Reconciler.within_capacity(state, info, landing_slot=True, registers_disk=self.registers_disk)
        self.clipped_peak = max(self.clipped_peak, len(why))
        return {name: t.tier for name, t in wanted.items()}

    def serves(self, pod: str, served_name: str) -> bool:
        tier = self.held[pod].get(served_name)
        return tier in (Tier.GPU, Tier.CPU) or (self.registers_disk and tier is Tier.DISK)


def _phases(revisions: list[AdapterRevision]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in revisions:
        counts[r.status.phase.value] = counts.get(r.status.phase.value, 0) + 1
    return counts


def test_a_sweep_of_first_revisions_into_scarce_gpu_slots_ends_all_stable() -> None:
    revisions = [revision("v1", adapter=f"a{i:03d}", n=i + 1, warmPolicy="gpu-preferred") for i in range(60)]
    pool = Pool(revisions, gpu_slots=2, cpu_slots=4)
    waited_for_slot = set()
    for _ in range(400):
        pool.step()
        waited_for_slot |= {r.metadata.name for r in revisions if r.status.reason == "WaitingForGpuSlot"}
        if all(r.status.phase in (Phase.STABLE, Phase.ROLLED_BACK, Phase.FAILED) for r in revisions):
            break
    print(f"ONBOARDING {{'revisions': {len(revisions)}, 'phases': {_phases(revisions)}, "
          f"'waited_for_gpu_slot': {len(waited_for_slot)}, 'required_gpu_peak': {pool.required_gpu_peak}}}")
    stranded = {r.metadata.name: f"{r.status.phase.value} {r.status.reason}: {r.status.message}"
                for r in revisions if r.status.phase is not Phase.STABLE}
    assert stranded == {}
    # admission held the canaries' GPU requirements within the pods' slots, and the queue was visible
    assert pool.required_gpu_peak <= pool.gpu_slots
    assert waited_for_slot


def test_admission_into_activating_is_first_come_first_served_and_says_why_it_waits() -> None:
    """One pod with one GPU slot: the first revision takes it; two later ones wait prewarmed (``WaitingForGpuSlot``,
    the pod named) and are admitted in the order they started waiting, not by name."""
    first = revision("v1", adapter="a", n=1)
    pool = Pool([first], gpu_slots=1, pods=("pod-0",), load_chance=1.0)
    pool.answering = False  # its probe is slow
    while first.status.phase is not Phase.ACTIVATING:
        pool.step()
    late, later = revision("v1", adapter="z", n=2), revision("v1", adapter="m", n=3)
    pool.revisions.append(late)
    for _ in range(4):
        pool.step()
    pool.revisions.append(later)
    for _ in range(4):
        pool.step()
    assert first.status.phase is Phase.PROBING  # its probe is out: nothing took its slot meanwhile
    for waiting in (late, later):
        assert (waiting.status.phase, waiting.status.reason) == (Phase.PREWARMING, "WaitingForGpuSlot")
        assert "pod-0 (1 of 1)" in (waiting.status.message or "")
    conditions = {c.type: c for c in late.status.conditions}
    assert conditions["Progressing"].reason == "WaitingForGpuSlot"
    pool.answering = True
    order = []
    for _ in range(40):
        pool.step()
        for rev in (late, later):
            if rev.status.phase is Phase.ACTIVATING and rev.metadata.name not in order:
                order.append(rev.metadata.name)
        if all(r.status.phase is Phase.STABLE for r in pool.revisions):
            break
    assert order == ["z-v1", "m-v1"]
    assert all(r.status.phase is Phase.STABLE for r in pool.revisions)
    assert pool.required_gpu_peak == 1


@pytest.mark.parametrize("registers_disk", [True, False], ids=["disk-registered", "disk-unloaded"])
@pytest.mark.parametrize("seed", range(3))
def test_a_sweep_into_vllm_pods_ends_all_stable(seed: int, registers_disk: bool) -> None:
    """The twin's failure, in small: vLLM pods (4 GPU slots, 16 host copies) and 120 first revisions. Promoted
    revisions move off their canary pod (its GPU slots go to the next canaries) and make-before-break keeps them
    there at CPU until their new pod serves them: beyond the pod's host copies, where its sidecar cut the target by
    its own order and unloaded a canary between its activation and its probe (RolledBack ProbeFailed HTTP 404, or
    a canary left in Probing for good). Now the controller cuts each pod's target itself and no canary gives way:
    with sidecars that unload disk-tier targets (before) and with sidecars that register them (now)."""
    revisions = [revision("v1", adapter=f"a{(i * 37) % 120:03d}", n=i + 1, warmPolicy="gpu-preferred",
                          priorityClass=("gold", "standard", "sheddable")[i % 3]) for i in range(120)]
    pool = VllmPool(revisions, gpu_slots=4, cpu_slots=16, seed=seed, registers_disk=registers_disk)
    for _ in range(600):
        pool.step()
        if all(r.status.phase in (Phase.STABLE, Phase.ROLLED_BACK, Phase.FAILED) for r in revisions):
            break
    print(f"ONBOARDING-VLLM {{'seed': {seed}, 'registers_disk': {registers_disk}, 'phases': {_phases(revisions)}, "
          f"'required_gpu_peak': {pool.required_gpu_peak}, 'clipped_peak': {pool.clipped_peak}}}")
    stranded = {r.metadata.name: f"{r.status.phase.value} {r.status.reason}: {r.status.message}"
                for r in revisions if r.status.phase is not Phase.STABLE}
    assert stranded == {}
    # admission left the landing slot: at most 3 canaries hold GPU on a pod at once
    assert pool.required_gpu_peak <= pool.gpu_slots - 1
    # the controller cut each pod's target to what its sidecar keeps (the landing slot, and with disk-tier
    # registrations one host copy too): no sidecar had to cut one by its own order
    assert pool.clipped_peak == 0
    # sidecars that register disk-tier targets: every Stable revision is served somewhere (at disk at least), so no
    # request gets vLLM's 404; sidecars that unloaded them left those beyond the pool's host copies nowhere
    unserved = [r.served_name for r in revisions if not any(pool.serves(pod, r.served_name) for pod in pool.pods)]
    assert len(unserved) == (0 if registers_disk else len(revisions) - len(PODS) * 16)
