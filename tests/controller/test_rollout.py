"""The rollout state machine, driven through every phase, gate failure and manual control."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from loraplane.api import AdapterRevision, Phase, RevisionCounters
from loraplane.api.runtime import AdapterResidency, Tier
from loraplane.controller.rollout import AdapterPlan, ProbeResult, canary_pods, reconcile_adapter
from tests.controller.world import T0, World, digest, revision, step


def _phases(revs: list[AdapterRevision]) -> dict[str, str]:
    return {r.spec.revision: r.status.phase.value for r in revs}


def _weights(plan: AdapterPlan) -> dict[str, int]:
    assert plan.route is not None
    return {w.revision: w.weight for w in plan.route.revisions}


def _healthy_traffic(world: World, *revs: AdapterRevision, requests: int = 100) -> None:
    for rev in revs:
        world.counters[rev.served_name] = RevisionCounters(requests=requests, errors=0, ttft_seconds_sum=requests * 0.05,
                                                           ttft_count=requests)


def _drive(world: World, revs: list[AdapterRevision], stop: Phase, name: str, limit: int = 30) -> list[str]:
    """Reconcile until ``name`` reaches ``stop``: sidecars comply, probes pass, traffic is healthy, time passes."""
    seen: list[str] = []
    target = next(r for r in revs if r.metadata.name == name)
    for _ in range(limit):
        plan = step(world, revs)
        label = target.status.phase.value + (f"({target.status.canary_step})" if target.status.phase is Phase.CANARY else "")
        if not seen or seen[-1] != label:
            seen.append(label)
        if target.status.phase is stop:
            return seen
        world.answer_probes(plan)
        _healthy_traffic(world, *revs)
        world.tick(30)
    raise AssertionError(f"{name} stuck at {seen}")


def _stable_v1(world: World) -> list[AdapterRevision]:
    revs = [revision("v1", n=1)]
    _drive(world, revs, Phase.STABLE, "claims-v1")
    return revs


def _v2_at(phase: Phase) -> tuple[World, list[AdapterRevision]]:
    """A stable v1 and a v2 driven to ``phase``."""
    world = World()
    revs = _stable_v1(world)
    revs.append(revision("v2", n=2, created=10))
    _drive(world, revs, phase, "claims-v2")
    return world, revs


def test_first_revision_goes_straight_to_stable_after_its_probe() -> None:
    world = World()
    revs = [revision("v1", n=1)]
    seen = _drive(world, revs, Phase.STABLE, "claims-v1")
    assert seen == ["Verifying", "Prewarming", "Activating", "Probing", "Stable"]
    plan = step(world, revs)
    assert _weights(plan) == {"v1": 100}
    assert revs[0].status.traffic_weight == 100
    conds = {c.type: c.status for c in revs[0].status.conditions}
    assert conds["Compatible"] == conds["Verified"] == conds["Prewarmed"] == conds["Activated"] == "True"
    assert conds["Probed"] == conds["Ready"] == "True"
    assert conds["Progressing"] == "False"
    assert plan.revisions["claims-v1"].rate_share == 1.0
    assert plan.events == []  # nothing changed: no event


def test_second_revision_passes_every_phase_and_retires_the_first() -> None:
    world = World()
    revs = _stable_v1(world)
    revs.append(revision("v2", n=2, created=10))
    seen = _drive(world, revs, Phase.STABLE, "claims-v2")
    assert seen == ["Verifying", "Prewarming", "Activating", "Probing", "Canary(0)", "Canary(1)", "Stable"]
    assert _phases(revs) == {"v1": "Retiring", "v2": "Stable"}
    plan = step(world, revs)
    assert _weights(plan) == {"v2": 100}
    v1 = plan.revisions["claims-v1"]
    assert v1.placed and set(v1.required.values()) == {Tier.CPU}  # CPU-warm for the rollback window
    world.tick(300)  # rollback window over: disk only
    assert set(step(world, revs).revisions["claims-v1"].required.values()) == {Tier.DISK}
    world.tick(100)  # eviction delay over
    plan = step(world, revs)
    assert revs[0].status.phase is Phase.RETIRED and not plan.revisions["claims-v1"].placed
    assert all("claims@v1" not in held for held in world.residency.values())


def test_canary_traffic_follows_the_steps() -> None:
    world, revs = _v2_at(Phase.CANARY)
    assert _weights(step(world, revs)) == {"v1": 90, "v2": 10}
    waiting = [r.status.model_copy(deep=True) for r in revs]
    world.tick(59)
    _healthy_traffic(world, *revs)
    plan = step(world, revs)
    assert _weights(plan) == {"v1": 90, "v2": 10} and revs[1].status.reason == "CanaryStep"
    assert [r.status for r in revs] == waiting  # waiting changes no status (no countdown): nothing to patch
    world.tick(1)
    plan = step(world, revs)
    assert _weights(plan) == {"v1": 50, "v2": 50} and revs[1].status.canary_step == 1
    assert (revs[0].status.traffic_weight, revs[1].status.traffic_weight) == (50, 50)
    assert plan.revisions["claims-v2"].required == {p: Tier.GPU for p in plan.revisions["claims-v2"].required}


def test_canary_waits_for_enough_traffic() -> None:
    world, revs = _v2_at(Phase.CANARY)
    world.counters.clear()
    world.tick(120)
    step(world, revs)
    assert revs[1].status.phase is Phase.CANARY and revs[1].status.reason == "WaitingForTraffic"
    assert "needs 10 requests, has 0" in (revs[1].status.message or "")


@pytest.mark.parametrize(
    ("canary", "reason"),
    [
        (RevisionCounters(requests=100, errors=30), "CanaryErrorRate"),
        (RevisionCounters(requests=100, ttft_seconds_sum=100 * 0.5, ttft_count=100), "CanaryLatency"),
    ],
)
def test_failed_canary_analysis_rolls_back(canary: RevisionCounters, reason: str) -> None:
    world, revs = _v2_at(Phase.CANARY)
    _healthy_traffic(world, revs[0])
    world.counters[revs[1].served_name] = canary
    world.tick(60)
    plan = step(world, revs)
    assert revs[1].status.phase is Phase.ROLLED_BACK and revs[1].status.reason == reason
    assert _weights(plan) == {"v1": 100}
    assert not plan.revisions["claims-v2"].placed
    assert any(e.type == "Warning" and e.reason == reason for e in plan.events)


def test_wrong_digest_stops_at_verifying_while_stable_keeps_all_traffic() -> None:
    world = World()
    revs = _stable_v1(world)
    bad = revision("v3", n=3, created=10)
    revs.append(bad)
    plan = step(world, revs)  # Pending -> Verifying; sidecars asked to fetch
    assert bad.status.phase is Phase.VERIFYING
    for pod in plan.revisions["claims-v3"].required:
        world.hold(pod, bad, Tier.ABSENT, digest=None, error="sha256 of download is sha256:dead...",
                   error_reason="DigestMismatch")
    plan = step(world, revs)
    assert bad.status.phase is Phase.FAILED and bad.status.reason == "DigestMismatch"
    assert bad.status.message is not None and bad.status.message.startswith("Verifying: ")
    assert _weights(plan) == {"v1": 100}
    assert {c.type: c.status for c in bad.status.conditions}["Verified"] == "False"


def test_a_pod_loading_other_bytes_fails_verification() -> None:
    world = World()
    rev = revision("v1", n=1)
    world.actual_digest[rev.served_name] = digest(99)
    step(world, [rev])
    step(world, [rev])
    assert rev.status.phase is Phase.FAILED and rev.status.reason == "DigestMismatch"


def test_transient_fetch_error_waits_and_says_why() -> None:
    world = World()
    rev = revision("v1", n=1)
    plan = step(world, [rev], apply=False)
    pod = next(iter(plan.revisions["claims-v1"].required))
    world.hold(pod, rev, Tier.ABSENT, digest=None, error="connection refused", error_reason="FetchFailed")
    step(world, [rev], apply=False)
    assert rev.status.phase is Phase.VERIFYING and rev.status.reason == "WaitingForDiskResidency"
    assert f"{pod} (absent, FetchFailed: connection refused)" in (rev.status.message or "")


def test_a_fetch_that_keeps_failing_fails_verifying_at_its_progress_deadline() -> None:
    world = World()
    rev = revision("v1", n=1, rollout={"progressDeadlineSeconds": 120})
    plan = step(world, [rev], apply=False)
    pod = next(iter(plan.revisions["claims-v1"].required))
    world.hold(pod, rev, Tier.ABSENT, digest=None, error="connection refused", error_reason="FetchFailed")
    world.tick(119)
    plan = step(world, [rev], apply=False)
    assert rev.status.phase is Phase.VERIFYING and rev.status.reason == "WaitingForDiskResidency"
    assert plan.next_due == T0 + timedelta(seconds=120)  # the controller comes back at the deadline
    world.tick(1)
    plan = step(world, [rev], apply=False)
    assert (rev.status.phase, rev.status.reason) == (Phase.FAILED, "ProgressDeadlineExceeded")
    assert f"not verified within 120s: canary pods not yet at disk with digest verified: {pod} (absent, " \
           "FetchFailed: connection refused)" in (rev.status.message or "")
    assert not plan.revisions["claims-v1"].placed and plan.route is None
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "ProgressDeadlineExceeded")]


def test_the_progress_deadline_defaults_to_ten_minutes() -> None:
    assert revision("v1").spec.rollout.progress_deadline_seconds == 600


@pytest.mark.parametrize(
    ("world", "needle"),
    [
        (World(base_digest=digest(77)), "serves base model"),
        (World(max_lora_rank=8), "max_lora_rank 8 < rank 16"),
    ],
)
def test_incompatible_revision_fails_with_the_reason(world: World, needle: str) -> None:
    rev = revision("v1", n=1)
    step(world, [rev])
    assert rev.status.phase is Phase.FAILED and rev.status.reason == "Incompatible"
    assert needle in (rev.status.message or "")


def test_sidecar_reported_incompatibility_fails_the_rollout() -> None:
    world = World()
    rev = revision("v1", n=1)
    plan = step(world, [rev], apply=False)
    for pod in plan.revisions["claims-v1"].required:
        world.hold(pod, rev, Tier.ABSENT, digest=None, error="dtype float32 not supported", error_reason="Incompatible")
    step(world, [rev])
    assert rev.status.phase is Phase.FAILED and rev.status.reason == "Incompatible"


def test_no_pods_means_pending_with_a_reason() -> None:
    world = World(pods=[])
    rev = revision("v1", n=1)
    step(world, [rev])
    assert rev.status.phase is Phase.PENDING and rev.status.reason == "NoPods"


def test_failed_probe_rolls_back_automatically() -> None:
    world = World()
    revs = _stable_v1(world)
    revs.append(revision("v4", n=4, created=10))
    _drive(world, revs, Phase.PROBING, "claims-v4")
    plan = step(world, revs)
    assert [p.served_name for p in plan.probes] == ["claims@v4"]
    world.answer_probes(plan, ok=False, message="served digest sha256:00.. does not match")
    plan = step(world, revs)
    assert revs[1].status.phase is Phase.ROLLED_BACK and revs[1].status.reason == "ProbeFailed"
    assert _weights(plan) == {"v1": 100}


def test_probe_results_from_before_the_phase_do_not_count() -> None:
    world = World()
    revs = [revision("v1", n=1)]
    _drive(world, revs, Phase.PROBING, "claims-v1")
    pod = canary_pods(revs[0], world.observe().pods)[0].name
    world.probes[("claims@v1", pod)] = ProbeResult(at=world.now - timedelta(seconds=1), ok=True, message="old")
    plan = step(world, revs)
    assert revs[0].status.phase is Phase.PROBING and [p.pod for p in plan.probes] == [pod]


def _probing_v1() -> tuple[World, list[AdapterRevision], str]:
    world = World()
    revs = [revision("v1", n=1)]
    _drive(world, revs, Phase.PROBING, "claims-v1")
    return world, revs, canary_pods(revs[0], world.observe().pods)[0].name


def test_a_404_from_a_pod_that_was_unloading_the_canary_is_not_its_failure() -> None:
    """The probe raced an unload (the report after it says draining, then gone): the 404 is discarded and the
    revision probed again once the pod holds it at GPU again; it was the revision's failure before."""
    world, revs, pod = _probing_v1()
    plan = step(world, revs, apply=False)
    world.tick(1)
    world.answer_probes(plan, ok=False, message="HTTP 404", status=404)
    world.hold(pod, revs[0], Tier.GPU, draining=True)
    world.reported_at[pod] = world.now + timedelta(seconds=1)
    plan = step(world, revs, apply=False)
    assert revs[0].status.phase is Phase.PROBING and plan.probes == []  # a draining row is not probed either
    assert [key for key, _ in plan.discarded_probes] == [("claims@v1", pod)]
    world.forget(plan)
    del world.residency[pod]["claims@v1"]
    plan = step(world, revs, apply=False)
    assert revs[0].status.phase is Phase.PROBING and revs[0].status.reason == "WaitingForProbe"
    assert plan.probes == [] and plan.discarded_probes == []
    world.hold(pod, revs[0], Tier.GPU)
    plan = step(world, revs, apply=False)
    assert [p.pod for p in plan.probes] == [pod]
    world.answer_probes(plan)
    step(world, revs, apply=False)
    assert revs[0].status.phase is Phase.STABLE


def test_a_404_while_the_pod_still_holds_the_canary_fails_it_on_the_next_report() -> None:
    world, revs, pod = _probing_v1()
    plan = step(world, revs, apply=False)
    world.reported_at[pod] = world.now
    world.tick(1)
    world.answer_probes(plan, ok=False, message="HTTP 404", status=404)
    plan = step(world, revs, apply=False)  # the report is older than the probe: judged on the next one
    assert revs[0].status.phase is Phase.PROBING and "judged on its next report" in (revs[0].status.message or "")
    assert plan.probes == [] and plan.discarded_probes == []
    world.reported_at[pod] = world.now + timedelta(seconds=1)  # a report after the probe still holds it at GPU
    step(world, revs, apply=False)
    assert (revs[0].status.phase, revs[0].status.reason) == (Phase.ROLLED_BACK, "ProbeFailed")
    assert "HTTP 404" in (revs[0].status.message or "")


def test_manual_rollback_during_canary_returns_all_traffic_in_one_reconcile() -> None:
    world, revs = _v2_at(Phase.CANARY)
    revs[1].spec.rollback = True
    plan = step(world, revs)
    assert _weights(plan) == {"v1": 100}
    assert revs[1].status.phase is Phase.ROLLED_BACK and revs[1].status.reason == "ManualRollback"
    assert revs[1].status.traffic_weight == 0


def test_rollback_of_stable_restores_the_retiring_revision() -> None:
    world, revs = _v2_at(Phase.STABLE)
    revs[1].spec.rollback = True
    plan = step(world, revs)
    assert _phases(revs) == {"v1": "Stable", "v2": "RolledBack"}
    assert _weights(plan) == {"v1": 100}


def test_rollback_without_a_previous_revision_says_so() -> None:
    world = World()
    revs = _stable_v1(world)
    revs[0].spec.rollback = True
    plan = step(world, revs)
    assert revs[0].status.phase is Phase.STABLE and revs[0].status.reason == "NothingToRollBackTo"
    assert _weights(plan) == {"v1": 100}


def test_pause_holds_at_the_gate_and_resume_continues() -> None:
    world = World()
    revs = _stable_v1(world)
    revs.append(revision("v2", n=2, created=10, paused=True))
    for _ in range(3):
        step(world, revs)
        world.tick(30)
    assert revs[1].status.phase is Phase.PENDING and revs[1].status.reason == "Paused"
    assert {c.type: c.status for c in revs[1].status.conditions}["Paused"] == "True"
    revs[1].spec.paused = False
    _drive(world, revs, Phase.CANARY, "claims-v2")
    revs[1].spec.paused = True
    world.tick(600)
    _healthy_traffic(world, *revs)
    plan = step(world, revs)
    assert revs[1].status.phase is Phase.CANARY and revs[1].status.canary_step == 0
    assert _weights(plan) == {"v1": 90, "v2": 10}
    revs[1].spec.paused = False
    step(world, revs)
    assert revs[1].status.canary_step == 1


def test_newer_revision_supersedes_an_unfinished_one() -> None:
    world, revs = _v2_at(Phase.CANARY)
    revs.append(revision("v3", n=3, created=20))
    plan = step(world, revs)
    assert _phases(revs) == {"v1": "Stable", "v2": "RolledBack", "v3": "Verifying"}
    assert revs[1].status.reason == "Superseded"
    assert _weights(plan) == {"v1": 100}


def test_restart_resumes_from_status_without_repeating_or_skipping_a_gate() -> None:
    """A controller restart loses only memory (probe results): status alone decides the next step."""
    world, revs = _v2_at(Phase.CANARY)
    world.tick(30)
    # restart: objects re-read from the API server (JSON), in-memory probe results gone
    revs = [AdapterRevision.model_validate(json.loads(r.to_json())) for r in revs]
    world.probes.clear()
    _healthy_traffic(world, *revs)
    plan = step(world, revs)
    assert plan.probes == [] and plan.events == []  # the passed probe gate is not repeated
    assert revs[1].status.phase is Phase.CANARY and revs[1].status.canary_step == 0
    since = revs[1].status.phase_since
    assert since is not None and revs[1].status.message is not None  # the timer continues: the same due time
    assert f"for 60s, until {(since + timedelta(seconds=60)).isoformat(timespec='seconds')}" in revs[1].status.message
    world.tick(30)
    step(world, revs)
    assert revs[1].status.canary_step == 1  # and the step is not skipped either


def test_restart_during_probing_probes_again_but_nothing_else() -> None:
    world = World()
    revs = [revision("v1", n=1)]
    _drive(world, revs, Phase.PROBING, "claims-v1")
    world.probes.clear()
    revs = [AdapterRevision.model_validate(json.loads(r.to_json())) for r in revs]
    plan = step(world, revs)
    assert revs[0].status.phase is Phase.PROBING and len(plan.probes) == 1 and plan.events == []


def test_reconcile_is_idempotent() -> None:
    world, revs = _v2_at(Phase.ACTIVATING)
    world.residency.clear()  # sidecars have not acted yet: the gate waits
    first = reconcile_adapter(revs, world.observe())
    second = reconcile_adapter(revs, world.observe())
    assert [p.status for p in first.revisions.values()] == [p.status for p in second.revisions.values()]
    step(world, revs, apply=False)
    again = reconcile_adapter(revs, world.observe())
    assert again.events == []
    assert [p.status for p in again.revisions.values()] == [r.status for r in revs]


def test_deleted_revision_is_unloaded_and_finalized_only_when_no_pod_holds_it() -> None:
    world, revs = _v2_at(Phase.STABLE)
    revs[1].metadata.deletion_timestamp = world.now
    plan = step(world, revs, apply=False)
    assert _phases(revs)["v1"] == "Stable" and _weights(plan) == {"v1": 100}
    assert not plan.revisions["claims-v2"].placed and not plan.revisions["claims-v2"].finalize
    world.apply(revs, plan)
    assert step(world, revs).revisions["claims-v2"].finalize


def test_canary_pods_are_a_stable_choice() -> None:
    world = World(pods=[f"pod-{i}" for i in range(10)])
    rev = revision("v1", n=1, rollout={"canary": {"fraction": 0.25}})
    pods = world.observe().pods
    chosen = [p.name for p in canary_pods(rev, pods)]
    assert len(chosen) == 3
    assert [p.name for p in canary_pods(rev, list(reversed(pods)))] == chosen
    assert [p.name for p in canary_pods(rev, [p for p in pods if p.name != "pod-9" or "pod-9" in chosen])] == chosen


def test_residency_counts_only_matching_digests() -> None:
    world = World()
    rev = revision("v1", n=1)
    world.hold("pod-a", rev, Tier.GPU)
    world.hold("pod-b", rev, Tier.CPU)
    world.residency.setdefault("pod-c", {})[rev.served_name] = AdapterResidency(
        served_name=rev.served_name, tier=Tier.GPU, digest=digest(5))
    step(world, [rev], apply=False)
    assert (rev.status.residency.gpu, rev.status.residency.cpu) == (1, 1)
    assert rev.status.served_name == "claims@v1" and rev.status.cache_key and rev.status.observed_generation == 1


def test_probe_expects_the_content_digest_the_sidecar_reports() -> None:
    world = World()
    revs = [revision("v1", n=1)]
    _drive(world, revs, Phase.PROBING, "claims-v1")
    pod = canary_pods(revs[0], world.observe().pods)[0].name
    world.hold(pod, revs[0], Tier.GPU, adapter_digest=digest(4242))
    plan = step(world, revs)
    assert [(p.pod, p.expected_digest) for p in plan.probes] == [(pod, digest(4242))]


def test_steps_shortened_under_a_running_canary_promote_instead_of_failing() -> None:
    world, revs = _v2_at(Phase.CANARY)
    world.tick(60)
    _healthy_traffic(world, *revs)
    step(world, revs)
    assert revs[1].status.canary_step == 1
    revs[1].spec.rollout.steps = revs[1].spec.rollout.steps[:1]
    revs[1].spec.paused = True
    assert _weights(step(world, revs)) == {"v1": 100}  # paused on a step that no longer exists: no canary share
    revs[1].spec.paused = False
    plan = step(world, revs)
    assert revs[1].status.phase is Phase.STABLE and _weights(plan) == {"v2": 100}


def test_a_refused_artifact_fails_the_rollout_with_the_sidecars_cause() -> None:
    world = World()
    rev = revision("v1", n=1)
    plan = step(world, [rev], apply=False)
    pod = next(iter(plan.revisions["claims-v1"].required))
    world.hold(pod, rev, Tier.ABSENT, digest=None, error_reason="ArtifactRefused",
               error="fetch failed: InternalAddress: 127.0.0.1:6379 resolves to internal address 127.0.0.1")
    plan = step(world, [rev])
    assert rev.status.phase is Phase.FAILED and rev.status.reason == "ArtifactRefused"
    assert "InternalAddress: 127.0.0.1:6379" in (rev.status.message or "")
    assert any(e.type == "Warning" and e.reason == "ArtifactRefused" for e in plan.events)
