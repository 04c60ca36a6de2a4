"""The policy-adapter layer: production code driven by the simulator, plus the registry of policy names.

loraplane's policy is three pieces of production code, unchanged:

- routing: ``loraplane.picker.scheduler.Scheduler`` with the picker's default config (or ``--picker-config``),
  scoring a ``PoolSnapshot`` built from the simulated pods as a sidecar's report would describe them;
- residency: ``loraplane.engine.policies.KeepScorePolicy`` choosing eviction victims;
- placement: ``loraplane.controller.placement.place`` run every reconcile period on the request rates the picker
  would publish, its GPU / CPU targets applied the way a sidecar applies a ``TargetState``.

The baselines are the peers' packaged picker configs (``picker/loraplane/picker/peers/<name>.yaml``) run by the same ``Scheduler``
over the pods' vLLM metrics as a peer's picker scrapes them (``loraplane.sim.peers``), plus round-robin
(``loraplane.sim.baselines``: no picker does it); their pods evict by vLLM's LRU (the engine's ``lru`` policy).
"""

from __future__ import annotations

import heapq
import math
import random
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from loraplane.api import TargetState, Tier
from loraplane.controller.pool import PoolPlan
from loraplane.engine.policies import EvictionPolicy, KeepScorePolicy, LruPolicy
from loraplane.engine.tiers import AdapterState
from loraplane.picker.flowcontrol import FlowControlParameters
from loraplane.picker.plugins import WAITED_OUT, SchedulingRequest
from loraplane.picker.prefix import PrefixCacheScorer
from loraplane.picker.scheduler import Decision, EndpointPickerConfig, Scheduler, SchedulingError, WaitKey
from loraplane.picker.snapshot import EndpointState, PoolSnapshot
from loraplane.sim.admission import OFF, QUEUES, FlowControlConfig
from loraplane.sim.baselines import ROUND_ROBIN, RoundRobin
from loraplane.sim.cluster import (
    VLLM,
    Admission,
    Eviction,
    Placement,
    Pod,
    Refused,
    Router,
    Scraper,
    SimConfig,
    Simulator,
)
from loraplane.sim.control import WATCH_S, Row, SimulatedController, adapter_digest, as_served_name
from loraplane.sim.peers import PEER_POLICIES, peer_router
from loraplane.sim.prefix import PickerPrefixSignal
from loraplane.sim.profile import Profile
from loraplane.sim.snapshot import SimSnapshot
from loraplane.sim.trace import Trace

LORAPLANE = "loraplane"
#: ``--max-num-batched-tokens`` of loraplane's vLLM pods: a smaller step budget bounds how long a step full of
#: lower-priority prefill keeps a gold request waiting (with ``--scheduling-policy priority`` gold goes first)
LORAPLANE_MAX_BATCHED_TOKENS = 2048
#: the baselines: round-robin and the peers' packaged picker configs
BASELINES = [ROUND_ROBIN, *PEER_POLICIES]
POLICY_NAMES = [LORAPLANE, *BASELINES]
#: how often the picker gets new sidecar reports (residency and load): the sidecar's default heartbeat. Its own
#: in-flight counts are always current.
REPORT_S = 1.0
#: the controller's reconcile period for placement
PLACEMENT_PERIOD_S = 10.0
#: the controller's ``--resync-seconds`` default (``ControllerConfig.resync_seconds``): how often the real controller
#: plans a pool. ``--loraplane-runtime vllm`` plans at this pace, as the twin's controller does: at 10 s the
#: simulator's registrations (placement moves) were half the twin's (hot-plus-burst, 16 pods: 25 against 60)
CONTROLLER_RESYNC_S = 2.0


class EngineEviction:
    """Runs one of the engine's eviction policies on a simulated pod's adapters."""

    def __init__(self, policy: EvictionPolicy, trace: Trace, profile: Profile) -> None:
        self.policy = policy
        self.name = policy.name
        self._trace = trace
        self._reload_s = [profile.load_ms(Tier.DISK, a.nbytes) / 1e3 for a in trace.adapters]
        self._states: dict[tuple[int, int], AdapterState] = {}

    def _state(self, pod: Pod, adapter: int) -> AdapterState:
        key = (pod.index, adapter)
        state = self._states.get(key)
        if state is None:
            spec = self._trace.adapters[adapter]
            state = AdapterState(
                name=spec.name,
                path=Path(spec.name),
                digest=adapter_digest(spec.name),
                disk_bytes=spec.nbytes,
                nbytes=spec.nbytes,
                priority=self._trace.tenants[spec.tenant].priority,
                load_seconds=self._reload_s[adapter],
            )
            self._states[key] = state
        state.last_access = pod.last_use.get(adapter)
        state.hits = pod.uses.get(adapter, 0)
        state.tier_since = pod.loaded_at.get(adapter, 0.0)
        return state

    def victim(self, now: float, pod: Pod, tier: Tier, candidates: list[int], incoming: int) -> int | None:
        """The engine policy's choice among ``candidates``."""
        if not candidates:
            return None
        states = [self._state(pod, a) for a in candidates]
        chosen = self.policy.victim(states, now)
        return next(a for a, s in zip(candidates, states, strict=True) if s is chosen)


class PickerRouter:
    """The picker's ``Scheduler`` over a snapshot of the simulated pods."""

    name = LORAPLANE

    def __init__(self, seed: int, trace: Trace, profile: Profile, scheduler: Scheduler,
                 staging: Callable[[], frozenset[str]] = frozenset, loads_on_demand: bool = True) -> None:
        """``staging``: the staging pods of the controller's last plan (its route table's ``staging_pods``);
        ``loads_on_demand``: the pods report that they serve a revision they do not hold (``SimConfig``)."""
        self.scheduler = scheduler
        self._loads_on_demand = loads_on_demand
        self._staging = staging
        #: the picker's prefix-cache scorer, fed each request's prefix blocks and where it went (prefix traces)
        self._now = 0.0
        scorer = scheduler.preparer(PrefixCacheScorer)
        self._prefix = (PickerPrefixSignal(scorer, trace, lambda: self._now)
                        if scorer is not None and trace.has_prefixes else None)  # fmt: skip
        self._last_request: SchedulingRequest | None = None
        self._last_rid = -1
        #: per request, the prompt tokens the picker counts in its pod's prefill queue (``Decision.prefill_tokens``:
        #: less the prefix it expects the pod to hold, on prefix traces); the simulator's ``counted_tokens``
        self.counted_tokens = array("i", trace.input_tokens)
        self._rng = np.random.default_rng(seed)
        self._kv = profile.kv_capacity_tokens
        self._inputs = trace.input_tokens
        names = self._names = [a.name for a in trace.adapters]
        self._digests = [adapter_digest(n) for n in names]
        prio = [trace.tenants[a.tenant].priority for a in trace.adapters]
        self._priorities = {n: p for n, p in zip(names, prio, strict=True) if p}
        self._requests = [
            SchedulingRequest(served_name=n, digest=d, priority=p, tenant=trace.tenants[a.tenant].name)
            for n, d, p, a in zip(names, self._digests, prio, trace.adapters, strict=True)
        ]
        self._snapshot: PoolSnapshot | None = None
        self._reported_at = -math.inf
        self._staged: frozenset[str] = frozenset()
        self._residency: dict[int, tuple[int, dict[str, tuple[Tier, str | None]]]] = {}
        #: tier -> per adapter, its residency row at that tier (a pod's report is made of these)
        self._rows: dict[Tier, list[tuple[str, tuple[Tier, str | None]]]] = {
            tier: [(n, (tier, d)) for n, d in zip(names, self._digests, strict=True)]
            for tier in (Tier.GPU, Tier.CPU, Tier.DISK)
        }
        #: the snapshot whose in-flight counts were last set, each pod's counts per name then, and (first-step end,
        #: pod) of pods whose count of requests without a first token drops at that time
        self._synced: PoolSnapshot | None = None
        #: held requests -> what their last decision saw (``Scheduler.still_waits``)
        self._waits: dict[int, WaitKey] = {}
        self._prune_at = 64
        self._flights: list[dict[str, int]] = []
        self._first_ends: list[tuple[float, int]] = []

    def _residency_of(self, pod: Pod) -> dict[str, tuple[Tier, str | None]]:
        cached = self._residency.get(pod.index)
        if cached is not None and cached[0] == pod.residency_version:
            return cached[1]
        rows, registered = self._rows, pod.registered
        if registered is None:
            held = dict(map(rows[Tier.DISK].__getitem__, pod.disk))
            held.update(map(rows[Tier.CPU].__getitem__, pod.cpu))
            held.update(map(rows[Tier.GPU].__getitem__, pod.gpu))
        else:  # vLLM: only its registered names not draining, at the tier of their copy (none: read from disk)
            serving = registered - pod.draining if pod.draining else registered
            held = dict(map(rows[Tier.DISK].__getitem__, serving))
            held.update(map(rows[Tier.CPU].__getitem__, pod.cpu & serving))
            held.update(map(rows[Tier.GPU].__getitem__, pod.gpu & serving))
        self._residency[pod.index] = (pod.residency_version, held)
        return held

    def _refresh(self, now: float, pods: list[Pod]) -> PoolSnapshot:
        """The snapshot of the latest reports, renewed every heartbeat: rebuilt when the staging pods changed,
        otherwise updated in place (``PoolSnapshot.update_endpoints``: every pod's load, the residency rows of the
        pods whose tiers changed; a rebuild passes over every row of every pod, at 256 pods most of a fleet run)."""
        snapshot = self._snapshot
        if snapshot is not None and now - self._reported_at < REPORT_S:
            return snapshot
        self._reported_at = now
        staging = self._staging()
        if snapshot is None or staging != self._staged:
            self._staged = staging
            snapshot = self._snapshot = SimSnapshot([self._endpoint(now, p) for p in pods], self._priorities, staging)
        else:  # every pod's load, re-indexing the residency of those whose tiers changed (O(their rows))
            snapshot.update_endpoints([(p.index, self._endpoint(now, p)) for p in pods])
        return snapshot

    def _endpoint(self, now: float, pod: Pod) -> EndpointState:
        """What ``pod``'s sidecar report says now."""
        return EndpointState(
            name=f"pod-{pod.index}",
            address=f"10.0.0.{pod.index + 1}:8000",
            queue_depth=len(pod.waiting),
            running=pod.num_running,
            active_tokens=pod.kv_reserved,
            kv_utilization=min(1.0, pod.kv_reserved / self._kv),
            recent_evictions=pod.recent_evictions(now),
            gpu_slots=pod.max_loras,
            residency=self._residency_of(pod),
            loads_on_demand=self._loads_on_demand,
        )

    def decide(self, now: float, rid: int, trace: Trace, pods: list[Pod]) -> Decision:
        """The scheduler's decision for request ``rid``; raises the picker's ``SchedulingError``s. The picker's own
        in-flight count, per endpoint and served name, is every request sent to a pod and not finished there."""
        snapshot = self._synced_snapshot(now, pods)
        request = self._requests[trace.adapter[rid]]
        if self._prefix is not None:
            self._now = now
            request = replace(request, prefix=self._prefix.request(rid), prompt_tokens=self._inputs[rid])
        self._last_request, self._last_rid = request, rid
        return self.scheduler.schedule(request, snapshot, self._rng)

    def _synced_snapshot(self, now: float, pods: list[Pod]) -> PoolSnapshot:
        snapshot = self._refresh(now, pods)
        self._sync_in_flight(snapshot, now, pods)
        return snapshot

    def _sent(self, decision: Decision) -> int:
        """The last decided request goes to the decision's primary endpoint (the prefix index learns it)."""
        prefix = self._last_request.prefix if self._last_request is not None else None
        if self._prefix is not None and prefix is not None:
            self._prefix.routed(prefix, decision.endpoints[0])
            self.counted_tokens[self._last_rid] = decision.prefill_tokens
        return decision.indices[0]

    def _sync_in_flight(self, snapshot: PoolSnapshot, now: float, pods: list[Pod]) -> None:
        """Give ``snapshot`` every pod's in-flight counts now: all of them into a new snapshot, else only those of
        the pods the simulator touched since (``Pod.touched_pods``, emptied here) and of those whose first step ended
        since (the same counts as setting them all: a fleet of 256 pods spent most of its time here, then 20 s of
        157 in a pass over every pod's ``touched`` at each decision)."""
        ends = self._first_ends
        touched = pods[0].touched_pods if pods else set()
        if not touched and snapshot is self._synced and (not ends or ends[0][0] > now):
            return  # nothing moved since the last decision (a queue's retries in one round)
        if snapshot is not self._synced:
            self._synced, self._flights = snapshot, [self._in_flight(p) for p in pods]
            snapshot.set_in_flight(self._flights, [p.awaiting_first_token(now) for p in pods],
                                   [p.awaiting_first_token_tokens(now, self.counted_tokens) for p in pods])
            touched.clear()
            ends.clear()
            ends.extend((p.run_first_end, p.index) for p in pods if p.run_admitted and now < p.run_first_end)
            heapq.heapify(ends)
            return
        flights = self._flights
        for i in sorted(touched):
            pod = pods[i]
            counts, before = self._in_flight(pod), flights[i]
            if counts != before:
                for name in before.keys() - counts.keys():
                    snapshot.note_in_flight(i, name, 0)
                for name, count in counts.items():
                    if before.get(name) != count:
                        snapshot.note_in_flight(i, name, count)
                snapshot.in_flight[i] = sum(counts.values())
                flights[i] = counts
            self._set_prefilling(snapshot, pod, now)
            if pod.run_admitted and now < pod.run_first_end:
                heapq.heappush(ends, (pod.run_first_end, i))
        touched.clear()
        while ends and ends[0][0] <= now:  # a first step ended: its requests have their first token
            self._set_prefilling(snapshot, pods[heapq.heappop(ends)[1]], now)

    def _set_prefilling(self, snapshot: PoolSnapshot, pod: Pod, now: float) -> None:
        snapshot.prefilling[pod.index] = pod.awaiting_first_token(now)
        snapshot.prefill_tokens[pod.index] = pod.awaiting_first_token_tokens(now, self.counted_tokens)

    def _in_flight(self, pod: Pod) -> dict[str, int]:
        """``pod``'s requests running or waiting, per served name."""
        names = self._names
        counts = {names[a]: n for a, n in pod.running_adapters.items()}
        for a, queued in pod.waiting_adapters.items():
            counts[names[a]] = counts.get(names[a], 0) + len(queued)
        return counts

    def pick(self, now: float, rid: int, trace: Trace, pods: list[Pod]) -> int:
        """The scheduler's primary endpoint for request ``rid``; its refusals (429 / 503) as ``Refused``."""
        try:
            return self._sent(self.decide(now, rid, trace, pods))
        except SchedulingError as exc:
            raise Refused(exc.status, exc.reason) from exc

    def choose(self, now: float, rid: int, sim: Simulator) -> int | None:
        """For flow control, as the picker's: the decision's primary endpoint, or ``None`` while the request should
        wait (``Decision.should_wait``: every candidate saturated, or none with room for its adapter: a GPU slot,
        no other fetch ahead; or none holding it); other refusals as ``Refused``."""
        key = self._waits.pop(rid, None)
        if key is not None and self.scheduler.still_waits(self._requests[sim.trace.adapter[rid]],
                                                          self._synced_snapshot(now, sim.pods), key):
            self._waits[rid] = key
            return None
        try:
            decision = self.decide(now, rid, sim.trace, sim.pods)
        except WAITED_OUT:
            return None
        except SchedulingError as exc:
            raise Refused(exc.status, exc.reason) from exc
        if decision.wait_key is None:
            return self._sent(decision)
        self._waits[rid] = decision.wait_key
        if len(self._waits) > self._prune_at:  # forget requests the queue refused meanwhile
            refused = sim.result.refused
            self._waits = {r: k for r, k in self._waits.items() if not refused[r]}
            self._prune_at = 2 * len(self._waits) + 64
        return None


class ControllerPlacement:
    """The real controller's planning (``SimulatedController``: ``IncrementalPlanner`` on what the sidecars and
    the picker publish), each pod's targets applied as its sidecar applies a target state. It passes as the
    controller's work queue hands its pool out: after each pass (``SimulatedController.pass_seconds`` long) at the
    resync, ``period_s`` less up to 25 % (the manager's jitter), or ``WATCH_S`` after a pass that patched statuses
    (the watch hands the patched objects back, which queues the pool at once)."""

    def __init__(self, trace: Trace, config: SimConfig, period_s: float | None = None, seed: int = 0) -> None:
        """``period_s``: the resync (default: the controller's on vLLM pods, else ``PLACEMENT_PERIOD_S``)."""
        if period_s is None:
            period_s = CONTROLLER_RESYNC_S if config.loraplane_runtime == VLLM else PLACEMENT_PERIOD_S
        self.period_s = period_s
        self._rng = random.Random(seed)
        self._trace = trace
        #: vLLM pods: each pod's targets as last applied (adapter -> tier), what its sidecar registered
        self._vllm = config.loraplane_runtime == VLLM
        self._entries: list[dict[int, Tier]] = [{} for _ in range(config.pods)]
        #: vLLM pods: the warm-tier (GPU or host) entries their sidecars have not warmed yet, at their tier
        self._unwarmed: list[dict[int, Tier]] = [{} for _ in range(config.pods)]
        #: each pod's target state as last applied (the same object: its sidecar has nothing new to do)
        self._applied: list[TargetState | None] = [None] * config.pods
        #: each adapter's served name (the revision's) and back
        self._names = [as_served_name(a.name) for a in trace.adapters]
        self._index = {name: i for i, name in enumerate(self._names)}
        self.controller = SimulatedController(
            self._names, [(trace.tenants[a.tenant].name, trace.tenants[a.tenant].priority) for a in trace.adapters],
            [a.nbytes for a in trace.adapters], [f"pod-{i}" for i in range(config.pods)], config.max_loras,
            config.max_cpu_loras, config.disk_bytes, self._vllm, config.placement)
        self._counted = 0
        self._pods: list[Pod] = []
        #: pod index -> ((its residency version, its applied target state), its report rows then, the heartbeat whose
        #: report those rows are)
        self._row_cache: dict[int, tuple[tuple[int, TargetState | None], tuple[Row, ...], int]] = {}
        #: each pod's sidecar reports once a heartbeat (``REPORT_S``), at its own phase: the controller reads the rows
        #: of the pod's last report, not its state now
        self._phase = [self._rng.random() * REPORT_S for _ in range(config.pods)]
        self._now = 0.0
        self._previous: PoolPlan | None = None

    def staging(self) -> frozenset[str]:
        """The staging pods of the last plan (what the controller writes into the route table)."""
        return self._previous.placement.staging if self._previous is not None else frozenset()

    def _rows(self, index: int) -> tuple[Row, ...]:
        """Pod ``index``'s report rows as its sidecar builds them: what the runtime holds (vLLM: its registered
        names, at the tier of their copy, disk when none) and its targets not held (on disk: fetched, else
        absent)."""
        pod, names = self._pods[index], self._names
        key = (pod.residency_version, self._applied[index])
        cached = self._row_cache.get(index)
        heartbeat = math.floor((self._now - self._phase[index]) / REPORT_S)
        if cached is not None and cached[0] == key:  # unchanged up to now: what this heartbeat's report says too
            self._row_cache[index] = (key, cached[1], heartbeat)
            return cached[1]
        if cached is not None and cached[2] == heartbeat:  # changed since this heartbeat's report was written
            return cached[1]
        registered = pod.registered
        held = (pod.gpu | pod.cpu | pod.disk) if registered is None else registered
        rows = [(names[a], Tier.GPU if a in pod.gpu else Tier.CPU if a in pod.cpu else Tier.DISK, True,
                 a in pod.draining) for a in held]
        rows.extend((names[a], Tier.DISK if a in pod.disk else Tier.ABSENT, False, False)
                    for a in pod.planned - held)
        rows.sort()
        self._row_cache[index] = (key, tuple(rows), heartbeat)
        return self._row_cache[index][1]

    def apply(self, now: float, sim: Simulator) -> float:
        """Plan on the rates so far and bring each pod's GPU / CPU targets in; returns the seconds until the next
        pass."""
        arrival, adapter, names = self._trace.arrival, self._trace.adapter, self._names
        for rid in range(self._counted, sim.arrived):
            self.controller.record(float(arrival[rid]), names[adapter[rid]])
        self._counted = sim.arrived
        self._pods = sim.pods
        self._now = now
        self._previous = self.controller.plan(now, self._rows)
        sim.result.controller_plans = dict(self.controller.plans)
        for pod in sim.pods:
            state = self.controller.written.get(f"pod-{pod.index}")
            registered = pod.registered
            if (self._vllm and state is self._applied[pod.index] and registered is not None
                    and self._entries[pod.index].keys() <= registered):
                self._warm(sim, pod)
                continue  # nothing new for its sidecar: the same target state, every target registered
            self._applied[pod.index] = state
            planned = {self._index[t.served_name]: t.tier for t in (state.adapters if state is not None else ())}
            pod.planned = set(planned)
            if self._vllm:
                self._register(sim, pod, planned)
                continue
            for a, tier in planned.items():
                if tier is Tier.GPU:
                    sim.prefetch(pod, a)
                elif tier is Tier.CPU:
                    sim.stage_cpu(pod, a)
                else:
                    sim.stage_disk(pod, a)
        busy = self.controller.pass_seconds
        if self.controller.patched:
            return busy + WATCH_S
        return busy + self.period_s * (1 - 0.25 * self._rng.random())

    def _register(self, sim: Simulator, pod: Pod, targets: dict[int, Tier]) -> None:
        """What a vLLM pod's sidecar does with its new targets: registers each target it has not (a load, which
        activates, warms its entry), warms an entry that comes into the warm tiers (GPU or host) once (``_warm``),
        then leaves it to vLLM's LRU, and drains the adapters no longer targeted (unregistered after the drain grace:
        ``Simulator.drain``)."""
        if pod.registered is None:
            pod.registered = set()
        entries, unwarmed = self._entries[pod.index], self._unwarmed[pod.index]
        for adapter in entries.keys() - targets.keys():
            sim.drain(pod, adapter)
            unwarmed.pop(adapter, None)
        warm = (Tier.GPU, Tier.CPU)
        for adapter, tier in sorted(targets.items(), key=lambda item: item[1] not in warm):
            if adapter not in pod.registered:
                sim.register(pod, adapter, cold=tier not in warm)
                unwarmed.pop(adapter, None)
            elif tier in warm and entries.get(adapter) not in warm:  # GPU and host are one entry (warm_entry)
                unwarmed[adapter] = tier
            elif tier not in warm:
                unwarmed.pop(adapter, None)
            elif adapter in unwarmed:
                unwarmed[adapter] = tier
        self._entries[pod.index] = targets
        self._warm(sim, pod)

    def _warm(self, sim: Simulator, pod: Pod) -> None:
        """The sidecar's pass over the warm entries not warmed yet: one whose copy is on disk only (or in host memory,
        for a GPU-tier entry) is activated, a load that warms it; one whose copy is where it wants it is left, not
        warmed (``Reconciler._action``: its next pass looks again)."""
        unwarmed = self._unwarmed[pod.index]
        for adapter, tier in list(unwarmed.items()):
            if adapter not in pod.cpu or (tier is Tier.GPU and adapter not in pod.gpu):
                sim.prefetch(pod, adapter)
                del unwarmed[adapter]


def picker_config_for(profile: Profile, path: Path | None = None) -> EndpointPickerConfig:
    """The picker config loraplane runs with: the file given, else the packaged default with its saturation
    thresholds scaled to the pod's batch capacity (in flight: half of ``max_num_seqs``, waiting: an eighth; never
    below the defaults, which are sized for the small reference engine)."""
    config = EndpointPickerConfig.load(path)
    if path is not None:
        return config
    default = config.saturation_detector
    thresholds = default.model_copy(
        update={
            "in_flight_threshold": max(default.in_flight_threshold, profile.max_num_seqs / 2),
            "queue_threshold": max(default.queue_threshold, profile.max_num_seqs / 8),
        }
    )
    return config.model_copy(update={"saturation_detector": thresholds})


def shipped_flow_control(config: EndpointPickerConfig) -> FlowControlConfig | None:
    """The picker's own queue as ``config``'s profile runs it (its ``flow-control`` plugin, when enabled), else None:
    what loraplane runs in the simulator unless told otherwise."""
    for type_name, parameters in Scheduler(config).request_plugins:
        if type_name == "flow-control":
            params = FlowControlParameters.model_validate(parameters)
            if params.enabled:
                return FlowControlConfig(queue="picker", parameters=params)
    return None


def loraplane_pod_profile(profile: Profile) -> Profile:
    """``profile`` with the vLLM arguments the chart gives loraplane's pods (``modelServer.scheduling``): a
    prefill budget of ``LORAPLANE_MAX_BATCHED_TOKENS`` a step (never above the profile's own)."""
    return replace(profile, max_batched_tokens=min(profile.max_batched_tokens, LORAPLANE_MAX_BATCHED_TOKENS))


def runtime_priorities(trace: Trace) -> array:
    """Per request, the ``priority`` the picker writes into its body (``--runtime-priority``): minus its tenant's
    priority, since vLLM serves lower values first."""
    negated = [-t.priority for t in trace.tenants]
    return array("q", (negated[t] for t in trace.tenant))


def loraplane_queue(profile: Profile, picker_config: Path | None, flow_control: FlowControlConfig | None) -> str:
    """Which queue loraplane runs in front of its picker (``sim``, ``picker`` or ``off``), for the report."""
    chosen = flow_control or shipped_flow_control(picker_config_for(profile, picker_config))
    return OFF if chosen is None else chosen.queue


@dataclass
class Policy:
    """What one named policy runs: a router, an eviction policy and optionally a placement."""

    router: Router
    eviction: Eviction
    placement: Placement | None = None
    admission: Admission | None = None
    #: per request, the vLLM ``priority`` its pod schedules it by (``Simulator.priority``); ``None``: ``fcfs``
    priority: Sequence[int] | None = None
    #: the profile its pods run with, where their vLLM arguments differ from the profile's defaults
    pod_profile: Profile | None = None
    #: reads the pods' metrics on its own clock (the peers' routers)
    scraper: Scraper | None = None
    #: per request, the prompt tokens its router counts in a pod's prefill queue (``Simulator.counted_tokens``)
    counted_tokens: Sequence[int] | None = None


def build_policy(
    name: str,
    seed: int,
    trace: Trace,
    profile: Profile,
    config: SimConfig,
    picker_config: Path | None = None,
    flow_control: FlowControlConfig | None = None,
    chart_pods: bool = True,
) -> Policy:
    """The named policy, ready for a ``Simulator``; ``flow_control`` puts a flow-control queue (the simulator's
    or the picker's, ``FlowControlConfig.queue``, or none) in front of loraplane's picker; None: the picker config's
    own (``shipped_flow_control``). The baselines have no queue, as in the field. ``chart_pods``: loraplane's pods
    run as the chart starts them (``priority`` queues, ``loraplane_pod_profile``), else vLLM's defaults."""
    if name == LORAPLANE:
        endpoint_picker_config = picker_config_for(profile, picker_config)
        scheduler = Scheduler(endpoint_picker_config)
        placement = ControllerPlacement(trace, config, seed=seed)
        vllm = config.loraplane_runtime == VLLM
        router = PickerRouter(seed, trace, profile, scheduler, placement.staging, loads_on_demand=not vllm)
        admission = None
        if flow_control is None:
            flow_control = shipped_flow_control(endpoint_picker_config)
        if flow_control is not None and flow_control.queue != OFF:
            tenants = trace.tenants
            admission = QUEUES[flow_control.queue](
                router.choose, lambda rid: tenants[trace.tenant[rid]].priority, trace.tenant.__getitem__, flow_control
            )
        return Policy(
            router, EngineEviction(LruPolicy() if vllm else KeepScorePolicy(), trace, profile), placement, admission,
            runtime_priorities(trace) if chart_pods else None, loraplane_pod_profile(profile) if chart_pods else None,
            counted_tokens=router.counted_tokens,
        )
    eviction = EngineEviction(LruPolicy(), trace, profile)
    if name == ROUND_ROBIN:
        return Policy(RoundRobin(seed), eviction)
    if name not in PEER_POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    peer = peer_router(name, seed, trace, profile, config.scrape_interval_s)
    return Policy(peer, eviction, scraper=peer)
