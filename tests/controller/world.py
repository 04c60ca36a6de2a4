"""Test helpers: AdapterRevision objects and a pool whose sidecars obey the rollout's requirements at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from loraplane.api import AdapterRevision, RevisionCounters
from loraplane.api.runtime import AdapterResidency, Tier
from loraplane.controller.rollout import (
    AdapterPlan,
    Observation,
    PodObservation,
    ProbeResult,
    reconcile_adapter,
)

BASE_DIGEST = "sha256:" + "b" * 64
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def digest(n: int) -> str:
    """A distinct valid digest per number."""
    return f"sha256:{n:064x}"


def revision(
    rev: str,
    *,
    adapter: str = "claims",
    n: int = 1,
    created: int = 0,
    steps: list[dict[str, int]] | None = None,
    **spec: Any,
) -> AdapterRevision:
    """An AdapterRevision named ``<adapter>-<rev>`` with short defaults for tests."""
    rollout = {
        "canary": {"pods": 1},
        "steps": steps if steps is not None else [{"weight": 10, "pauseSeconds": 60}, {"weight": 50, "pauseSeconds": 60}],
        "analysis": {"minRequests": 10},
        "rollbackWindowSeconds": 300,
        "evictionDelaySeconds": 100,
    }
    rollout.update(spec.pop("rollout", {}))
    body = {
        "adapter": adapter,
        "revision": rev,
        "poolRef": {"name": "pool"},
        "baseModel": {"name": "base/model", "digest": BASE_DIGEST},
        "artifact": {"uri": f"oci://registry.local/{adapter}:{rev}", "digest": digest(n)},
        "lora": {"rank": 16, "alpha": 32, "targetModules": ["q_proj"]},
        "rollout": rollout,
        **spec,
    }
    meta = {"name": f"{adapter}-{rev}", "namespace": "default", "generation": 1,
            "creationTimestamp": (T0 + timedelta(seconds=created)).isoformat()}
    return AdapterRevision.model_validate({"metadata": meta, "spec": body})


@dataclass
class World:
    """A pool of pods whose residency follows the rollout's requirements, and a clock."""

    pods: list[str] = field(default_factory=lambda: ["pod-a", "pod-b", "pod-c"])
    now: datetime = T0
    residency: dict[str, dict[str, AdapterResidency]] = field(default_factory=dict)
    counters: dict[str, RevisionCounters] = field(default_factory=dict)
    probes: dict[tuple[str, str], ProbeResult] = field(default_factory=dict)
    max_lora_rank: int = 64
    base_digest: str = BASE_DIGEST
    #: served name -> the digest sidecars compute for it (default: the spec's digest)
    actual_digest: dict[str, str] = field(default_factory=dict)
    #: pod -> when its sidecar published the report observed (default: unknown)
    reported_at: dict[str, datetime] = field(default_factory=dict)

    def observe(self) -> Observation:
        return Observation(
            now=self.now,
            pods=[
                PodObservation(name=p, address=f"10.0.0.{i}:8000", base_model_digest=self.base_digest,
                               max_lora_rank=self.max_lora_rank, adapters=dict(self.residency.get(p, {})),
                               reported_at=self.reported_at.get(p))
                for i, p in enumerate(self.pods)
            ],
            counters=dict(self.counters),
            probes=dict(self.probes),
        )

    def tick(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def hold(self, pod: str, rev: AdapterRevision, tier: Tier, **kw: Any) -> None:
        kw.setdefault("digest", self.actual_digest.get(rev.served_name, rev.spec.artifact.digest))
        self.residency.setdefault(pod, {})[rev.served_name] = AdapterResidency(served_name=rev.served_name, tier=tier, **kw)

    def apply(self, revs: list[AdapterRevision], plan: AdapterPlan) -> None:
        """Sidecars: hold what the rollout requires, drop what is not placed."""
        by_name = {r.metadata.name: r for r in revs}
        for name, rp in plan.revisions.items():
            rev = by_name[name]
            for pod, tier in rp.required.items():
                self.hold(pod, rev, tier)
            if not rp.placed:
                for held in self.residency.values():
                    held.pop(rp.served_name, None)

    def answer_probes(self, plan: AdapterPlan, ok: bool = True, message: str = "200 OK",
                      status: int | None = None) -> None:
        for req in plan.probes:
            self.probes[(req.served_name, req.pod)] = ProbeResult(at=self.now, ok=ok, message=message, ttft_ms=12.0,
                                                                  status=status)

    def forget(self, plan: AdapterPlan) -> None:
        """The controller: drop the probe results the rollout discarded."""
        for key, result in plan.discarded_probes:
            if self.probes.get(key) == result:
                del self.probes[key]


def step(world: World, revs: list[AdapterRevision], *, apply: bool = True) -> AdapterPlan:
    """One reconcile: the plan's statuses are persisted into the objects (as the API server would hold them)."""
    plan = reconcile_adapter(revs, world.observe())
    for rev in revs:
        stored = plan.revisions[rev.metadata.name].status.to_json()
        rev.status = type(rev.status).from_json(stored)
    if apply:
        world.apply(revs, plan)
    return plan
