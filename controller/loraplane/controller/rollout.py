"""The rollout state machine: pure, level-triggered logic over one logical adapter's revisions.

``reconcile_adapter(revisions, observation)`` takes every ``AdapterRevision`` of one logical adapter in one pool
(their specs and the statuses last written) and what the pool reports now (sidecars' residency, the picker's
counters, health-probe results), and returns each revision's desired status, the events to post, the adapter's
route entry, what placement must hold where, which probes to send and when a timed gate is next due. It does no
I/O and reads no clock, so the same input always gives the same output and a restarted controller continues from
the persisted status: a gate is passed exactly when the phase moves past it (see ``docs/rollout.md``).

Every condition of a revision's status is written here. ``AdapterReconcile.decide`` returns the adapter's outcome
(gates, route, what placement must hold); once placement ran, ``write_outcome`` combines each outcome with
placement's notes into the ``Reconciled``, ``Ready`` and ``Placed`` conditions, the one place placement's result
reaches a status. ``plan_pool`` does both around placement; ``reconcile_adapter`` with no placement notes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from loraplane.api import (
    ERROR_DIGEST_MISMATCH,
    FINAL_ERROR_REASONS,
    AdapterRevision,
    AdapterRevisionStatus,
    Condition,
    Phase,
    ResidencyCounts,
    RevisionCounters,
    RevisionRole,
    RouteEntry,
    TrafficStep,
    WarmPolicy,
    WeightedRevision,
    cache_key,
)
from loraplane.api.runtime import AdapterResidency, Tier

#: Phases a revision moves through before it is stable, in order.
ROLLOUT_PHASES = (Phase.PENDING, Phase.VERIFYING, Phase.PREWARMING, Phase.ACTIVATING, Phase.PROBING, Phase.CANARY)
#: The condition each gate sets when it passes.
GATE_CONDITIONS = {
    Phase.PENDING: "Compatible",
    Phase.VERIFYING: "Verified",
    Phase.PREWARMING: "Prewarmed",
    Phase.ACTIVATING: "Activated",
    Phase.PROBING: "Probed",
    Phase.CANARY: "CanaryAnalysis",
}
#: The tier the canary pods must report (digest matching) for a gate to pass.
_GATE_TIERS = {Phase.VERIFYING: Tier.DISK, Phase.PREWARMING: Tier.CPU, Phase.ACTIVATING: Tier.GPU}
#: Phases whose revision holds a GPU slot on each of its canary pods (admitted at the end of Prewarming).
SLOT_PHASES = (Phase.ACTIVATING, Phase.PROBING, Phase.CANARY)
#: the runtime's answer to a request naming a model it has not registered (vLLM, the engine)
HTTP_NOT_FOUND = 404


@dataclass(frozen=True)
class PodObservation:
    """One pod of the pool as its fresh residency report describes it."""

    name: str
    address: str
    ready: bool = True
    base_model_digest: str | None = None
    max_lora_rank: int | None = None
    adapters: Mapping[str, AdapterResidency] = field(default_factory=dict)
    #: GPU slots its canaries may hold (``canary_gpu_slots``: the runtime's, less the landing slot a runtime whose
    #: loads activate keeps free); None: not bounded (admission off)
    gpu_slots: int | None = None
    #: when its sidecar published the report (``heartbeat_at``); None: unknown
    reported_at: datetime | None = None


@dataclass(frozen=True)
class ProbeResult:
    """The outcome of one health probe sent straight to one pod."""

    at: datetime
    ok: bool
    message: str
    ttft_ms: float | None = None
    #: the HTTP status the pod answered with; None: no answer (or a result from before this field)
    status: int | None = None


#: names ``Observation.held`` looks up pod by pod before it indexes every pod's adapters
_HELD_LOOKUPS = 32


@dataclass(frozen=True)
class Observation:
    """What the pool looks like now."""

    now: datetime
    pods: Sequence[PodObservation]
    #: served name -> counters summed over the picker replicas
    counters: Mapping[str, RevisionCounters] = field(default_factory=dict)
    #: (served name, pod) -> the latest probe result
    probes: Mapping[tuple[str, str], ProbeResult] = field(default_factory=dict)
    _compatible: dict[tuple[str, int], tuple[list[PodObservation], str]] = field(
        default_factory=dict, compare=False, repr=False)
    #: served name -> what the pods report of it: the names looked up one by one, then (``_held_all``) every name
    _held: dict[str, list[AdapterResidency]] = field(default_factory=dict, compare=False, repr=False)
    _held_all: dict[str, list[AdapterResidency]] | None = field(default=None, compare=False, repr=False)
    #: pod -> served names of the revisions holding a canary GPU slot there (``hold_gpu_slots``, ``admit``)
    _slot_holders: dict[str, set[str]] = field(default_factory=dict, compare=False, repr=False)
    _slots_counted: set[str] = field(default_factory=set, compare=False, repr=False)
    #: id of a ``compatible`` list -> (that list, its pods' names): one set per base model and rank, not per revision
    _names: dict[int, tuple[list[PodObservation], frozenset[str]]] = field(default_factory=dict, compare=False,
                                                                          repr=False)

    def names(self, pods: list[PodObservation]) -> frozenset[str]:
        """The names of ``pods`` (a list ``compatible`` returned), computed once per list."""
        hit = self._names.get(id(pods))
        if hit is None or hit[0] is not pods:
            hit = self._names[id(pods)] = (pods, frozenset(p.name for p in pods))
        return hit[1]

    def held(self, served_name: str) -> list[AdapterResidency]:
        """What the pods report of ``served_name`` (one entry per pod that holds it at any tier): looked up pod by
        pod for the first names asked (a reconcile of a few adapters), then indexed once (of the whole pool)."""
        if self._held_all is not None:
            return self._held_all.get(served_name, [])
        hit = self._held.get(served_name)
        if hit is None and len(self._held) < _HELD_LOOKUPS:
            hit = self._held[served_name] = [held for pod in self.pods
                                              if (held := pod.adapters.get(served_name)) is not None]
        if hit is not None:
            return hit
        index: dict[str, list[AdapterResidency]] = {}
        for pod in self.pods:
            for name, held in pod.adapters.items():
                index.setdefault(name, []).append(held)
        object.__setattr__(self, "_held_all", index)  # a cache on a frozen observation
        return index.get(served_name, [])

    def compatible(self, rev: AdapterRevision) -> tuple[list[PodObservation], str]:
        """``compatible_pods`` for the revision, computed once per base model digest and rank."""
        key = (rev.spec.base_model.digest, rev.spec.lora.rank)
        if key not in self._compatible:
            self._compatible[key] = compatible_pods(rev, self.pods)
        return self._compatible[key]

    # -- canary GPU slots: admission into Activating -------------------------------------------------------------
    def hold_gpu_slots(self, revisions: Sequence[AdapterRevision]) -> None:
        """Count the canary GPU slots ``revisions`` hold as their persisted status says (each revision once: the
        pool's reconcile counts every revision before any adapter decides)."""
        for rev in revisions:
            if rev.status.phase not in SLOT_PHASES or rev.metadata.deletion_timestamp is not None:
                continue  # holds no slot (the phase first: a served name is computed)
            if rev.served_name in self._slots_counted:
                continue
            self._slots_counted.add(rev.served_name)
            for pod in canary_pods(rev, self.compatible(rev)[0]):
                self._slot_holders.setdefault(pod.name, set()).add(rev.served_name)

    def full_pods(self, served_name: str, pods: Sequence[PodObservation]) -> list[PodObservation]:
        """Those of ``pods`` whose GPU slots are all held by other revisions' canaries."""
        return [p for p in pods if p.gpu_slots is not None
                and len(self._slot_holders.get(p.name, set()) - {served_name}) >= p.gpu_slots]

    def admit(self, served_name: str, pods: Sequence[PodObservation]) -> None:
        """``served_name`` holds a canary GPU slot on each of ``pods`` from now on."""
        for pod in pods:
            self._slot_holders.setdefault(pod.name, set()).add(served_name)

    def release(self, served_name: str) -> None:
        """``served_name`` holds no canary GPU slot any more (it left Activating, Probing and Canary)."""
        for holders in self._slot_holders.values():
            holders.discard(served_name)


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post on one AdapterRevision."""

    object_name: str
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class ProbeRequest:
    """Send the revision's health probe to this pod; the response must carry ``expected_digest``."""

    served_name: str
    pod: str
    address: str
    #: the content digest the pod's sidecar reports for the verified revision; None: it reports none (vLLM)
    expected_digest: str | None


@dataclass
class RevisionPlan:
    """What one revision needs: its status, and how placement should treat it."""

    name: str
    served_name: str
    status: AdapterRevisionStatus
    #: False: hold it nowhere (unloaded everywhere)
    placed: bool = False
    #: pod -> the tier the rollout requires there
    required: dict[str, Tier] = field(default_factory=dict)
    #: share of the adapter's request rates placement plans for
    rate_share: float = 0.0
    warm_policy: WarmPolicy = WarmPolicy.ON_DEMAND
    #: compatible pods
    eligible: frozenset[str] = frozenset()
    #: the object is being deleted and every pod has unloaded it: drop the finalizer
    finalize: bool = False


@dataclass
class AdapterPlan:
    """The outcome of reconciling one logical adapter."""

    revisions: dict[str, RevisionPlan]
    route: RouteEntry | None
    events: list[Event]
    probes: list[ProbeRequest]
    #: the earliest time a timed gate (a canary pause, a retiring revision's window) changes its verdict
    next_due: datetime | None = None
    #: probe results that judged nothing (a 404 from a pod whose sidecar no longer held the revision), keyed
    #: (served name, pod): the caller forgets them, so the revision is probed again once the pod holds it
    discarded_probes: list[tuple[tuple[str, str], ProbeResult]] = field(default_factory=list)


@dataclass(frozen=True)
class _Verdict:
    kind: Literal["advance", "wait", "fail"]
    reason: str
    message: str
    phase: Phase = Phase.FAILED


def _advance(message: str = "") -> _Verdict:
    return _Verdict("advance", "Passed", message)


def _wait(reason: str, message: str) -> _Verdict:
    return _Verdict("wait", reason, message)


def _fail(phase: Phase, reason: str, message: str) -> _Verdict:
    return _Verdict("fail", reason, message, phase)


def compatible_pods(rev: AdapterRevision, pods: Sequence[PodObservation]) -> tuple[list[PodObservation], str]:
    """Ready pods whose base model and max rank fit the revision, and why the others do not."""
    good, why = [], []
    for pod in pods:
        if not pod.ready:
            continue
        if pod.base_model_digest is not None and pod.base_model_digest != rev.spec.base_model.digest:
            why.append(f"{pod.name} serves base model {pod.base_model_digest}, not {rev.spec.base_model.digest}")
        elif pod.max_lora_rank is not None and rev.spec.lora.rank > pod.max_lora_rank:
            why.append(f"{pod.name} has max_lora_rank {pod.max_lora_rank} < rank {rev.spec.lora.rank}")
        else:
            good.append(pod)
    return good, "; ".join(why)


def canary_pods(rev: AdapterRevision, eligible: Sequence[PodObservation]) -> list[PodObservation]:
    """The revision's canary pods: a stable choice (rendezvous hashing) of ``canary.pods`` or ``fraction`` of them."""
    target = rev.spec.rollout.canary
    count = target.pods if target.pods is not None else math.ceil((target.fraction or 0) * len(eligible))
    count = max(1, min(count, len(eligible)))

    served = rev.served_name

    def rank(pod: PodObservation) -> bytes:
        return hashlib.sha256(f"{served}\x1f{pod.name}".encode()).digest()

    return sorted(sorted(eligible, key=rank)[:count], key=lambda p: p.name)


def _counts(rev: AdapterRevision, obs: Observation) -> ResidencyCounts:
    counts = ResidencyCounts()
    for held in obs.held(rev.served_name):
        if held.digest == rev.spec.artifact.digest:
            if held.tier is Tier.GPU:
                counts.gpu += 1
            elif held.tier is Tier.CPU:
                counts.cpu += 1
            elif held.tier is Tier.DISK:
                counts.disk += 1
    return counts


def _set_condition(
    status: AdapterRevisionStatus, type_: str, value: bool | None, reason: str, message: str, now: datetime,
    generation: int | None,
) -> None:
    """Set a condition, keeping its transition time when its status did not change."""
    text = "Unknown" if value is None else "True" if value else "False"
    for i, cond in enumerate(status.conditions):
        if cond.type == type_:
            if (cond.status, cond.reason, cond.message, cond.observed_generation) == (text, reason, message, generation):
                return  # unchanged: no new object to validate
            since = cond.last_transition_time if cond.status == text else now
            status.conditions[i] = Condition(
                type=type_, status=text, reason=reason, message=message, last_transition_time=since,
                observed_generation=generation,
            )
            return
    status.conditions.append(
        Condition(type=type_, status=text, reason=reason, message=message, last_transition_time=now,
                  observed_generation=generation)
    )


def record_terminal_error(status: AdapterRevisionStatus, reason: str, message: str, now: datetime,
                          generation: int | None) -> None:
    """Record an error the controller does not retry (the objects must change first): ``Reconciled=False``."""
    _set_condition(status, "Reconciled", False, reason, message, now, generation)


class AdapterReconcile:
    """One logical adapter's rollout: ``decide`` (see the module docstring)."""

    def __init__(self, revisions: Sequence[AdapterRevision], obs: Observation) -> None:
        self.obs = obs
        self.revs = sorted(revisions, key=lambda r: (r.metadata.creation_timestamp or obs.now, r.metadata.name))
        # conditions are replaced, never edited in place, so a copy of the list is enough
        self.status = {r.metadata.name: r.status.model_copy(update={"conditions": list(r.status.conditions)})
                       for r in self.revs}
        self.events: list[Event] = []
        self.probes: list[ProbeRequest] = []
        self.discarded: list[tuple[tuple[str, str], ProbeResult]] = []
        self.plans: dict[str, RevisionPlan] = {}
        self.due: datetime | None = None
        self.route_entry: RouteEntry | None = None
        self.eligible: dict[str, list[PodObservation]] = {}
        self.incompatible: dict[str, str] = {}
        for r in self.revs:
            self.eligible[r.metadata.name], self.incompatible[r.metadata.name] = obs.compatible(r)
        obs.hold_gpu_slots(self.revs)

    # -- transitions ---------------------------------------------------------------------------------------------
    def phase(self, rev: AdapterRevision) -> Phase:
        return self.status[rev.metadata.name].phase

    def move(self, rev: AdapterRevision, phase: Phase, reason: str, message: str, *, step: int | None = None) -> None:
        st = self.status[rev.metadata.name]
        if st.phase in SLOT_PHASES and phase not in SLOT_PHASES:
            self.obs.release(rev.served_name)
        st.phase, st.canary_step, st.phase_since = phase, step, self.obs.now
        st.reason, st.message = reason, message
        warning = phase in (Phase.FAILED, Phase.ROLLED_BACK)
        shown = f"{phase.value}" + (f" step {step + 1}" if step is not None else "")
        self.events.append(
            Event(rev.metadata.name, "Warning" if warning else "Normal", reason, f"{shown}: {message}".rstrip(": "))
        )

    def note(self, rev: AdapterRevision, reason: str, message: str) -> None:
        st = self.status[rev.metadata.name]
        st.reason, st.message = reason, message

    def condition(self, rev: AdapterRevision, type_: str, value: bool | None, reason: str, message: str = "") -> None:
        _set_condition(self.status[rev.metadata.name], type_, value, reason, message, self.obs.now,
                      rev.metadata.generation)

    def elapsed(self, rev: AdapterRevision) -> float:
        since = self.status[rev.metadata.name].phase_since
        return math.inf if since is None else (self.obs.now - since).total_seconds()

    def due_after(self, rev: AdapterRevision, seconds: float) -> None:
        """Note that ``rev``'s verdict changes ``seconds`` after it entered its phase (if that is still ahead)."""
        since = self.status[rev.metadata.name].phase_since
        if since is None:
            return
        at = since + timedelta(seconds=seconds)
        if at > self.obs.now and (self.due is None or at < self.due):
            self.due = at

    def canary_step(self, rev: AdapterRevision) -> TrafficStep | None:
        """The canary step the status points at; None when the spec no longer has it."""
        index = self.status[rev.metadata.name].canary_step or 0
        steps = rev.spec.rollout.steps
        return steps[index] if index < len(steps) else None

    # -- gates ---------------------------------------------------------------------------------------------------
    def gate(self, rev: AdapterRevision, stable: AdapterRevision | None) -> _Verdict:
        phase = self.phase(rev)
        if phase is Phase.PENDING:
            return self.gate_compatible(rev)
        if phase is Phase.PREWARMING:
            verdict = self.gate_residency(rev, Tier.CPU)
            return self.gate_gpu_slot(rev, verdict) if verdict.kind == "advance" else verdict
        if phase is Phase.VERIFYING:
            return self.deadline(rev, self.gate_residency(rev, Tier.DISK))
        if phase in _GATE_TIERS:
            return self.gate_residency(rev, _GATE_TIERS[phase])
        if phase is Phase.PROBING:
            return self.gate_probe(rev)
        return self.gate_canary(rev, stable)

    def gate_compatible(self, rev: AdapterRevision) -> _Verdict:
        name = rev.metadata.name
        if not any(p.ready for p in self.obs.pods):
            return _wait("NoPods", f"no ready pod reports in pool {rev.spec.pool_ref.name}")
        if not self.eligible[name]:
            return _fail(Phase.FAILED, "Incompatible", self.incompatible[name])
        return _advance(f"{len(self.eligible[name])} compatible pods")

    def gate_residency(self, rev: AdapterRevision, tier: Tier) -> _Verdict:
        waiting = []
        for pod in canary_pods(rev, self.eligible[rev.metadata.name]):
            held = pod.adapters.get(rev.served_name)
            if held is not None and held.error_reason in FINAL_ERROR_REASONS:
                return _fail(Phase.FAILED, held.error_reason, f"{pod.name}: {held.error or held.error_reason}")
            if held is not None and held.digest is not None and held.digest != rev.spec.artifact.digest:
                return _fail(
                    Phase.FAILED, ERROR_DIGEST_MISMATCH,
                    f"{pod.name} loaded digest {held.digest}, spec says {rev.spec.artifact.digest}",
                )
            if held is None or held.digest is None or not held.tier.level <= tier.level:
                state = "absent" if held is None else held.tier.value
                if held is not None and held.error:
                    state += f", {held.error_reason or 'Error'}: {held.error}"
                waiting.append(f"{pod.name} ({state})")
        if waiting:
            return _wait(f"WaitingFor{tier.value.capitalize()}Residency",
                         f"canary pods not yet at {tier.value} with digest verified: {', '.join(waiting)}")
        return _advance(f"canary pods hold {rev.served_name} at {tier.value} with digest {rev.spec.artifact.digest}")

    def deadline(self, rev: AdapterRevision, verdict: _Verdict) -> _Verdict:
        """Verifying's progress deadline: still waiting ``progressDeadlineSeconds`` after it began fails the revision
        with what it waited for (a fetch that keeps failing retries forever in the sidecar)."""
        if verdict.kind != "wait":
            return verdict
        limit = rev.spec.rollout.progress_deadline_seconds
        if self.status[rev.metadata.name].phase_since is not None and self.elapsed(rev) >= limit:
            return _fail(Phase.FAILED, "ProgressDeadlineExceeded", f"not verified within {limit}s: {verdict.message}")
        self.due_after(rev, limit)
        return verdict

    def gate_gpu_slot(self, rev: AdapterRevision, prewarmed: _Verdict) -> _Verdict:
        """Admission into Activating: each canary pod has a GPU slot no other revision's canary holds (revisions
        between Activating and Canary hold theirs until they leave those phases), so placement never takes a
        canary's slot for another canary (which would unload it before its probe). Revisions wait in line, the
        longest-waiting first (``plan_pool`` decides adapters in that order)."""
        pods = canary_pods(rev, self.eligible[rev.metadata.name])
        full = self.obs.full_pods(rev.served_name, pods)
        if full:
            shown = ", ".join(f"{p.name} ({p.gpu_slots} of {p.gpu_slots})" for p in full)
            return _wait("WaitingForGpuSlot", f"prewarmed; canary GPU slots all held by other revisions' canaries "
                                              f"on {shown}")
        self.obs.admit(rev.served_name, pods)
        return prewarmed

    def gate_probe(self, rev: AdapterRevision) -> _Verdict:
        """Each canary pod's probe, sent while the pod's report holds the revision at GPU (digest verified, not
        draining). A 404 (the runtime has not registered the name) is the revision's failure only while the pod's
        sidecar still says it holds it: judged on the first report published after the probe; when that report
        (or the latest one) says it is draining or gone, the result is discarded and the revision probed again once
        the pod holds it (a canary the pod was unloading when the probe came is not a broken revision)."""
        since = self.status[rev.metadata.name].phase_since
        pending = []
        for pod in canary_pods(rev, self.eligible[rev.metadata.name]):
            key = (rev.served_name, pod.name)
            result = self.obs.probes.get(key)
            if result is not None and since is not None and result.at < since:
                result = None
            held = pod.adapters.get(rev.served_name)
            holds = (held is not None and held.tier is Tier.GPU and held.digest == rev.spec.artifact.digest
                     and not held.draining)
            if result is not None and not result.ok and result.status == HTTP_NOT_FOUND:
                if not holds:
                    self.discarded.append((key, result))
                    result = None
                elif pod.reported_at is not None and pod.reported_at <= result.at:
                    pending.append(f"{pod.name} (answered {HTTP_NOT_FOUND}: judged on its next report)")
                    continue
            if result is None:
                pending.append(pod.name)
                if holds:
                    assert held is not None
                    self.probes.append(ProbeRequest(rev.served_name, pod.name, pod.address, held.adapter_digest))
            elif not result.ok:
                return _fail(Phase.ROLLED_BACK, "ProbeFailed", f"{pod.name}: {result.message}")
        if pending:
            return _wait("WaitingForProbe", f"health probe pending on {', '.join(pending)}")
        return _advance("health probe passed on every canary pod")

    def gate_canary(self, rev: AdapterRevision, stable: AdapterRevision | None) -> _Verdict:
        st = self.status[rev.metadata.name]
        steps = rev.spec.rollout.steps
        step = self.canary_step(rev)
        if step is None:  # the steps were shortened under a running canary: nothing left to wait for
            return _advance(f"spec.rollout.steps has no step {(st.canary_step or 0) + 1} any more")
        if st.phase_since is not None and self.elapsed(rev) < step.pause_seconds:
            self.due_after(rev, step.pause_seconds)
            # the due time, not a countdown: a waiting canary's status stays the same (nothing to patch)
            due = st.phase_since + timedelta(seconds=step.pause_seconds)
            return _wait("CanaryStep", f"step {(st.canary_step or 0) + 1}/{len(steps)} at {step.weight}% for "
                                       f"{step.pause_seconds}s, until {due.isoformat(timespec='seconds')}")
        analysis = rev.spec.rollout.analysis
        canary = self.obs.counters.get(rev.served_name, RevisionCounters())
        base = self.obs.counters.get(stable.served_name, RevisionCounters()) if stable else RevisionCounters()
        if canary.requests < analysis.min_requests:
            return _wait("WaitingForTraffic",
                         f"canary analysis needs {analysis.min_requests} requests, has {canary.requests}")
        canary_errors = canary.errors / canary.requests if canary.requests else 0.0
        base_errors = base.errors / base.requests if base.requests else 0.0
        if canary_errors - base_errors > analysis.max_error_rate_increase:
            return _fail(Phase.ROLLED_BACK, "CanaryErrorRate",
                         f"error rate {canary_errors:.3f} vs stable {base_errors:.3f} "
                         f"(allowed increase {analysis.max_error_rate_increase})")
        if canary.ttft_count and base.ttft_count:
            ratio = (canary.ttft_seconds_sum / canary.ttft_count) / max(base.ttft_seconds_sum / base.ttft_count, 1e-9)
            if ratio > analysis.max_ttft_ratio:
                return _fail(Phase.ROLLED_BACK, "CanaryLatency",
                             f"mean TTFT {ratio:.2f}x stable (allowed {analysis.max_ttft_ratio}x)")
        return _advance(f"analysis passed at {step.weight}% ({canary.requests} canary requests)")

    # -- the adapter ---------------------------------------------------------------------------------------------
    def decide(self) -> AdapterPlan:
        """Gates, route and what placement must hold; the ``Ready``/``Placed`` conditions wait for ``write_outcome``."""
        live = [r for r in self.revs if r.metadata.deletion_timestamp is None]
        stable = self.current_stable(live)
        stable = self.manual_rollback_of_stable(stable, live)
        candidate = self.candidate(live, stable)
        if candidate is not None:
            stable = self.progress(candidate, stable)
        self.age_retiring(live)
        self.route_entry = self.route(live, stable, candidate)
        for rev in self.revs:
            self.plan(rev)
        return AdapterPlan(self.plans, self.route_entry, self.events, self.probes, self.due, self.discarded)

    def current_stable(self, live: list[AdapterRevision]) -> AdapterRevision | None:
        stables = [r for r in live if self.phase(r) is Phase.STABLE]
        stable = max(stables, key=lambda r: self.status[r.metadata.name].phase_since or self.obs.now, default=None)
        for other in stables:
            if other is not stable:
                self.move(other, Phase.RETIRING, "Superseded", f"{stable.metadata.name if stable else ''} is stable")
        if stable is None and any(r.metadata.deletion_timestamp for r in self.revs if r.status.phase is Phase.STABLE):
            stable = self.restore_previous(live, "StableDeleted", "the stable revision was deleted")
        return stable

    def restore_previous(self, live: list[AdapterRevision], reason: str, message: str) -> AdapterRevision | None:
        retiring = [r for r in live if self.phase(r) is Phase.RETIRING]
        previous = max(retiring, key=lambda r: self.status[r.metadata.name].phase_since or self.obs.now, default=None)
        if previous is not None:
            self.move(previous, Phase.STABLE, reason, message)
        return previous

    def manual_rollback_of_stable(self, stable: AdapterRevision | None, live: list[AdapterRevision]) -> AdapterRevision | None:
        if stable is None or not stable.spec.rollback:
            return stable
        previous = self.restore_previous(live, "RolledBackTo", f"{stable.metadata.name} was rolled back")
        if previous is None:
            self.note(stable, "NothingToRollBackTo", "spec.rollback is set but no previous revision is still warm")
            return stable
        self.move(stable, Phase.ROLLED_BACK, "ManualRollback", f"spec.rollback set; {previous.metadata.name} is stable")
        return previous

    def candidate(self, live: list[AdapterRevision], stable: AdapterRevision | None) -> AdapterRevision | None:
        """The newest revision still rolling out; older unfinished ones are superseded by it."""
        rolling = [r for r in live if self.phase(r) in ROLLOUT_PHASES]
        if not rolling:
            return None
        newest = rolling[-1]
        for older in rolling[:-1]:
            self.move(older, Phase.ROLLED_BACK, "Superseded", f"{newest.metadata.name} replaces it")
        return newest

    def progress(self, rev: AdapterRevision, stable: AdapterRevision | None) -> AdapterRevision | None:
        """Move the candidate through every gate the observation lets it pass; returns the stable revision."""
        if rev.spec.rollback:
            self.move(rev, Phase.ROLLED_BACK, "ManualRollback", "spec.rollback set; all traffic back to stable")
            return stable
        self.condition(rev, "Paused", rev.spec.paused, "Paused" if rev.spec.paused else "Running")
        for _ in range(len(ROLLOUT_PHASES) + len(rev.spec.rollout.steps)):
            if rev.spec.paused:
                self.note(rev, "Paused", f"spec.paused is set; holding at {self.phase(rev).value}")
                return stable
            phase = self.phase(rev)
            verdict = self.gate(rev, stable)
            if verdict.kind == "wait":
                self.note(rev, verdict.reason, verdict.message)
                self.condition(rev, "Progressing", True, verdict.reason, verdict.message)
                return stable
            gate = GATE_CONDITIONS[phase]
            if verdict.kind == "fail":
                self.condition(rev, gate, False, verdict.reason, verdict.message)
                self.condition(rev, "Progressing", False, verdict.reason, verdict.message)
                self.move(rev, verdict.phase, verdict.reason, f"{phase.value}: {verdict.message}")
                return stable
            self.condition(rev, gate, True, "Passed", verdict.message)
            if self.next_phase(rev, phase, stable):
                if stable is not None:
                    self.move(stable, Phase.RETIRING, "Superseded", f"{rev.metadata.name} is stable")
                self.condition(rev, "Progressing", False, "Promoted", "rollout complete")
                return rev
        return stable

    def next_phase(self, rev: AdapterRevision, phase: Phase, stable: AdapterRevision | None) -> bool:
        """Move past a passed gate; True when the revision became stable."""
        steps = rev.spec.rollout.steps
        if phase is Phase.PROBING and (stable is None or not steps):
            self.move(rev, Phase.STABLE, "Promoted", "no stable revision to compare with" if stable is None else "")
            return True
        if phase is Phase.PROBING:
            self.move(rev, Phase.CANARY, "CanaryStep", f"{steps[0].weight}% of traffic", step=0)
            return False
        if phase is Phase.CANARY:
            nxt = (self.status[rev.metadata.name].canary_step or 0) + 1
            if nxt >= len(steps):
                self.move(rev, Phase.STABLE, "Promoted", "every canary step passed")
                return True
            self.move(rev, Phase.CANARY, "CanaryStep", f"{steps[nxt].weight}% of traffic", step=nxt)
            return False
        following = ROLLOUT_PHASES[ROLLOUT_PHASES.index(phase) + 1]
        self.move(rev, following, "GatePassed", f"{GATE_CONDITIONS[phase]}")
        return False

    def age_retiring(self, live: list[AdapterRevision]) -> None:
        for rev in live:
            if self.phase(rev) is not Phase.RETIRING:
                continue
            rollout = rev.spec.rollout
            if self.elapsed(rev) >= rollout.rollback_window_seconds + rollout.eviction_delay_seconds:
                self.move(rev, Phase.RETIRED, "Evicted", "rollback window and eviction delay are over")
            else:
                self.due_after(rev, rollout.rollback_window_seconds + rollout.eviction_delay_seconds)

    def route(
        self, live: list[AdapterRevision], stable: AdapterRevision | None, candidate: AdapterRevision | None
    ) -> RouteEntry | None:
        weights: list[tuple[AdapterRevision, int, RevisionRole]] = []
        canary_weight = 0
        if candidate is not None and self.phase(candidate) is Phase.CANARY:
            step = self.canary_step(candidate)
            canary_weight = step.weight if step is not None else 0
        if stable is not None:
            weights.append((stable, 100 - canary_weight if candidate and canary_weight else 100, RevisionRole.STABLE))
            if canary_weight and candidate is not None:
                weights.append((candidate, canary_weight, RevisionRole.CANARY))
        for rev in self.revs:
            self.status[rev.metadata.name].traffic_weight = next((w for r, w, _ in weights if r is rev), 0)
        if not weights:
            return None
        owner = stable or weights[0][0]
        return RouteEntry(
            tenant=owner.spec.tenant,
            priority=owner.spec.priority_class.priority,
            revisions=[
                WeightedRevision(revision=r.spec.revision, served_name=r.served_name, digest=r.spec.artifact.digest,
                                 weight=w, role=role)
                for r, w, role in weights
                if w > 0
            ],
        )

    def plan(self, rev: AdapterRevision) -> None:
        name = rev.metadata.name
        st = self.status[name]
        served = rev.served_name
        st.observed_generation = rev.metadata.generation
        st.served_name = served
        st.cache_key = cache_key(rev.spec.base_model.digest, rev.spec.adapter, rev.spec.revision,
                                 rev.spec.artifact.digest)
        st.residency = _counts(rev, self.obs)
        eligible = self.eligible[name]
        plan = RevisionPlan(name, served, st, eligible=self.obs.names(eligible))
        self.plans[name] = plan
        if rev.metadata.deletion_timestamp is not None:
            plan.finalize = not self.obs.held(served)
            return
        phase = st.phase
        if phase in (Phase.STABLE, Phase.CANARY):
            plan.placed, plan.rate_share, plan.warm_policy = True, 1.0, rev.spec.warm_policy
        if phase in _GATE_TIERS or phase in (Phase.PROBING, Phase.CANARY):
            plan.placed = True
            tier = _GATE_TIERS.get(phase, Tier.GPU)
            plan.required = {p.name: tier for p in canary_pods(rev, eligible)}
        if phase is Phase.RETIRING:
            self.due_after(rev, rev.spec.rollout.rollback_window_seconds)
            warm = self.elapsed(rev) < rev.spec.rollout.rollback_window_seconds
            plan.placed = True
            plan.required = {
                p.name: Tier.CPU if warm else Tier.DISK
                for p in self.obs.pods
                if served in p.adapters and p.name in plan.eligible
            }


def write_outcome(outcomes: Iterable[AdapterPlan], placement_notes: Mapping[str, str], now: datetime) -> None:
    """Combine the rollout's ``outcomes`` with placement's notes (served name -> why it got less than it asked) into
    each revision's status: ``Reconciled``, ``Ready`` (serving a share of the traffic), and ``Placed`` on every placed
    revision, False with placement's note where it got less."""
    for outcome in outcomes:
        for rp in outcome.revisions.values():
            st = rp.status
            generation = st.observed_generation  # its revision's, set by ``decide``
            _set_condition(st, "Reconciled", True, "Reconciled", "", now, generation)
            _set_condition(st, "Ready", st.traffic_weight > 0, "Serving" if st.traffic_weight else st.phase.value,
                           f"{st.traffic_weight}% of traffic", now, generation)
            if rp.placed:
                note = placement_notes.get(rp.served_name)
                _set_condition(st, "Placed", note is None, "Placed" if note is None else "CapacityOrBudget", note or "",
                               now, generation)


def reconcile_adapter(revisions: Sequence[AdapterRevision], observation: Observation) -> AdapterPlan:
    """Reconcile every revision of one logical adapter in one pool, without placement notes (pure; see the module
    docstring)."""
    plan = AdapterReconcile(revisions, observation).decide()
    write_outcome([plan], {}, observation.now)
    return plan
