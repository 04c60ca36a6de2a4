"""The level-triggered reconcile step: compare the target with one observation and start the next actions.

Every pass looks at the whole target and the whole observation and starts at most one action per adapter (fetch,
load, activate, offload, demote, pin, unpin, priority, unload); when an action ends, the next pass re-observes and goes on. So a missed
notice, a crashed runtime or a restarted sidecar all heal by themselves. Actions run concurrently (bounded), each
adapter backs off exponentially (capped, with jitter) after failures, and each adapter carries a status that says
why it is not where the target wants it. Nothing is unloaded or offloaded while it has requests in flight.

An adapter leaving the runtime (out of the target, or demoted to disk on a runtime that cannot keep it registered
there) is drained first: its report row says ``draining`` (routers stop sending it new requests), and only when that
report was published, ``drain_grace_s`` has passed since, and its requests in flight are done, is it unloaded. On a
runtime that can (``Capabilities.demote``), a disk-tier target demotes a registered adapter instead: it stays
servable (the runtime reads it back from local disk when a request needs it), so it is not drained. On a runtime that
keeps registered adapters servable from their path but cannot evict one (``Capabilities.disk_registered``: vLLM), a
disk-tier target is registered and not kept resident: loaded when it is not (after every warmer target, one at a
time), never unloaded for being disk-tier, and left to the runtime's LRU.

On a runtime whose tiers follow its own LRU (no ``tier_control``, loads activate: vLLM) a GPU- or host-tier target is
warmed once per target entry, not held there: once a load or activation put it at its tier, the runtime's LRU may
move its copy down (requests for other adapters take the slots) and the sidecar leaves it (``left_to_runtime``),
as the controller's plan is a prefetch. Re-asserting every drift was a one-token completion each, and each took a
GPU slot from another adapter: the twin's vLLM pods made 2-7x the simulator's GPU loads (docs/twin.md). Nor is such
an entry defended before the sidecar's own loads (``keep_resident`` names only the entries not left to the runtime).
A changed target entry (another revision, or from the disk tier to a warm one: GPU and host are one entry there,
``warm_entry``) or an unload warms it again, and an entry the controller
holds (``AdapterTarget.hold``: its rollout gates read the tier there) is warmed again whenever it drifts.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from loraplane.api import (
    ERROR_DIGEST_MISMATCH,
    ERROR_INCOMPATIBLE,
    ERROR_REFUSED,
    AdapterTarget,
    LoadCosts,
    TargetState,
    Tier,
)
from loraplane.sidecar import compat, peft
from loraplane.sidecar.artifacts import REFUSAL_REASONS, ArtifactError
from loraplane.sidecar.cache import CacheEntry, DiskCache, StageTimings
from loraplane.sidecar.drivers.base import (
    Observation,
    RuntimeAdapter,
    RuntimeDriver,
    RuntimeInfo,
    RuntimeRejected,
    RuntimeUnavailable,
)
from loraplane.sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)

#: Seconds between publishing an adapter's ``draining`` row and unloading it: about twice what the picker needs to
#: apply a change notice and for a request it routed just before to reach the runtime.
DEFAULT_DRAIN_GRACE_S = 1.0
#: On a runtime whose loads activate (vLLM), the longest a load or warm-up waits while adapters with requests in
#: flight fill every GPU slot (``Reconciler.step``): it would evict a running adapter, which the next step brings
#: back, evicting the next one (the twin's emulated vLLM pods made three times the simulator's loads from host
#: memory); after this long it goes ahead, so a busy pod still gets its revisions
SLOTS_BUSY_WAIT_S = 2.0


@dataclass
class BoundedWait:
    """A wait on a condition, at most ``limit_s`` from when it began to hold (a load held back by a busy runtime):
    after that the load goes ahead however busy the runtime stays."""

    limit_s: float = SLOTS_BUSY_WAIT_S
    #: when the condition began to hold (None: it does not hold now)
    since: float | None = None

    def holds(self, condition: bool, now: float) -> bool:
        """Wait still? True while ``condition`` has held for less than ``limit_s``; a condition that stops holding
        ends the wait (the next one starts afresh)."""
        if not condition:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        return now - self.since < self.limit_s


#: load-stage measurements each tier's mean in ``PodLoad.loadSeconds`` is taken over (the most recent ones)
LOAD_COST_SAMPLES = 16


class LoadCostMeter:
    """This pod's measured seconds to make an adapter servable, per tier it starts from: the mean of the last
    ``LOAD_COST_SAMPLES`` loads (``PodLoad.loadSeconds``, read by the picker's predicted-TTFT scorer)."""

    def __init__(self, samples: int = LOAD_COST_SAMPLES) -> None:
        """No measurement yet."""
        self._seconds: dict[Tier, deque[float]] = {t: deque(maxlen=samples) for t in (Tier.CPU, Tier.DISK, Tier.ABSENT)}

    def record(self, start: Tier, seconds: float) -> None:
        """An adapter held at ``start`` (``ABSENT``: not on the pod) took ``seconds`` to become servable: registered
        in the runtime after a fetch or a read from disk, or activated from host memory."""
        self._seconds[start].append(seconds)

    def costs(self) -> LoadCosts | None:
        """The means so far (None where a tier was never measured; None when nothing was)."""
        means = {t: sum(v) / len(v) if v else None for t, v in self._seconds.items()}
        if all(m is None for m in means.values()):
            return None
        return LoadCosts(cpu=means[Tier.CPU], disk=means[Tier.DISK], fetch=means[Tier.ABSENT])

#: Failures that mean "these bytes are not what the revision declares" (final for the revision).
_DIGEST_REASONS = frozenset({"DigestMismatch", "SizeMismatch", "ArtifactTooLarge"})
#: Failures that mean "this adapter cannot run here" (final for the revision).
_INCOMPATIBLE_REASONS = frozenset({
    ERROR_INCOMPATIBLE, "InvalidArtifact", "BaseModelMismatch", "RankTooLarge", "UnknownTargetModules", "DtypeUnsupported",
    "RankMismatch", "TargetModulesMismatch", "DtypeMismatch",
})


class Action(enum.StrEnum):
    """One step towards the target."""

    FETCH = "fetch"
    LOAD = "load"
    RELOAD = "reload"
    ACTIVATE = "activate"
    OFFLOAD = "offload"
    DEMOTE = "demote"
    PIN = "pin"
    UNPIN = "unpin"
    PRIORITY = "priority"
    UNLOAD = "unload"

    @property
    def removes(self) -> bool:
        """True for actions that take an adapter out of a tier (never while requests are in flight)."""
        return self in (Action.OFFLOAD, Action.DEMOTE, Action.UNLOAD)


#: Actions that put an adapter into the runtime's memory.
_PLACING = frozenset({Action.LOAD, Action.RELOAD, Action.ACTIVATE})


@dataclass
class AdapterStatus:
    """Why an adapter is not at its target, and when it may be tried again."""

    cache_key: str | None = None
    error: str | None = None
    reason: str | None = None
    failures: int = 0
    not_before: float = 0.0
    wanted_since: float | None = None


@dataclass
class LoadRecord:
    """What this sidecar put into the runtime under a served name."""

    cache_key: str
    artifact_digest: str
    adapter_digest: str


@dataclass
class Backoff:
    """Capped exponential backoff with jitter: ``base * 2^(n-1)`` up to ``cap``, times a factor in [0.5, 1)."""

    base_s: float = 0.5
    cap_s: float = 30.0
    rng: random.Random = field(default_factory=random.Random)

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th consecutive failure."""
        return min(self.cap_s, self.base_s * 2 ** (failures - 1)) * (0.5 + self.rng.random() / 2)


def _already_loaded(exc: RuntimeRejected) -> bool:
    """vLLM's (and the engine's) answer to loading a name it holds: 400 "... has already been loaded ..."."""
    return exc.status == 400 and "already been loaded" in str(exc).lower()


class ActionFailed(Exception):
    """An action failed with a reason word for the report."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def warm_entry(target: AdapterTarget) -> tuple[str, bool]:
    """What makes a target entry new for warm-once: its revision and whether it is warm (GPU or host tier). On a
    runtime whose LRU moves copies between its tiers, GPU and host are one entry: a plan moving an adapter between
    them re-warmed it, a completion and a load each time, for a copy the next request brings in anyway."""
    return target.cache_key, target.tier in (Tier.GPU, Tier.CPU)


class Reconciler:
    """Starts actions that move the runtime towards the target; one action per adapter at a time."""

    def __init__(
        self,
        driver: RuntimeDriver,
        cache: DiskCache,
        metrics: SidecarMetrics,
        concurrency: int = 4,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        drain_grace_s: float = DEFAULT_DRAIN_GRACE_S,
    ) -> None:
        """``drain_grace_s`` <= 0 unloads leaving adapters at once, without announcing them as draining."""
        self.driver = driver
        self.cache = cache
        self.metrics = metrics
        #: measured load costs per starting tier (``PodLoad.loadSeconds`` in the report)
        self.load_costs = LoadCostMeter()
        self.backoff = backoff or Backoff()
        self._clock = clock
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.status: dict[str, AdapterStatus] = {}
        self.loaded: dict[str, LoadRecord] = {}
        self.evicted: set[str] = set()
        self.changed = asyncio.Event()
        self._task_action: dict[str, Action] = {}
        self._keep: frozenset[str] = frozenset()
        self._removed_by_us: set[str] = set()
        self.drain_grace_s = drain_grace_s
        #: adapters leaving the runtime -> when a report saying so was published (None: not yet)
        self.draining: dict[str, float | None] = {}
        #: served name -> the target entry (``warm_entry``) a load or activation last put at its tier
        self.warmed: dict[str, tuple[str, bool]] = {}
        #: loads and warm-ups waiting while adapters with requests in flight fill every GPU slot
        self._slots_wait = BoundedWait()
        #: disk-tier registrations waiting for the runtime's queue to empty
        self._queue_wait = BoundedWait()

    # --- identity ---------------------------------------------------------------------------------------------

    def verified_digests(self, name: str, held: RuntimeAdapter) -> tuple[str, str] | None:
        """(artifact digest, content digest) of what the runtime holds under ``name``, when the sidecar can vouch
        for it: the runtime's content digest equals a verified cache entry's, or (runtimes without digests) the
        sidecar loaded it itself."""
        record = self.loaded.get(name)
        if held.digest is None:
            if record is None:  # a runtime that names the directory it loaded (vLLM) may hold a verified entry
                record_entry = self._entry_at(name, held)
                return (record_entry.artifact_digest, record_entry.adapter_digest) if record_entry else None
            return record.artifact_digest, record.adapter_digest
        if record is not None and record.adapter_digest == held.digest:
            return record.artifact_digest, record.adapter_digest
        entry = next((e for e in self.cache.entries().values()
                      if e.served_name == name and e.adapter_digest == held.digest), None)
        return (entry.artifact_digest, entry.adapter_digest) if entry else None

    def _holds_target(self, target: AdapterTarget, held: RuntimeAdapter) -> bool | None:
        """True/False when the runtime does/does not hold exactly the target's revision; None when unknown yet."""
        record = self.loaded.get(target.served_name)
        if held.digest is None:
            if record is None and held.path is not None:  # e.g. a restarted sidecar: vLLM says where it loaded from
                entry = self._entry_at(target.served_name, held)
                if entry is not None:
                    return entry.cache_key == target.cache_key
                return None if self.cache.get(target.cache_key) is None else False
            return None if record is None else record.cache_key == target.cache_key
        entry = self.cache.get(target.cache_key)
        if entry is None:
            return None
        return entry.adapter_digest == held.digest

    def _entry_at(self, name: str, held: RuntimeAdapter) -> CacheEntry | None:
        """The verified cache entry of ``name`` whose directory the runtime says it loaded ``held`` from."""
        if held.path is None:
            return None
        return next((e for e in self.cache.entries().values() if e.served_name == name and str(e.path) == held.path),
                    None)

    # --- planning ---------------------------------------------------------------------------------------------

    def next_action(self, target: AdapterTarget, held: RuntimeAdapter | None) -> Action | None:
        """The one next step for a target adapter, or None when it is where it should be."""
        caps = self.driver.capabilities
        cached = self.cache.get(target.cache_key) is not None
        if held is not None and held.tier is not Tier.ABSENT:
            same = self._holds_target(target, held)
            if same is None:
                return Action.FETCH if not cached else Action.RELOAD
            if not same:
                return Action.RELOAD
        in_runtime = held is not None and held.tier in (Tier.GPU, Tier.CPU)
        if target.tier is Tier.DISK:
            if held is not None and held.pinned and caps.pin:
                return Action.UNPIN
            if caps.disk_registered:  # registered, not kept resident: the runtime's LRU ages its copy out
                registered = held is not None and held.tier is not Tier.ABSENT
                return None if registered else Action.LOAD if cached else Action.FETCH
            if in_runtime:
                return Action.DEMOTE if caps.demote else Action.UNLOAD
            return None if cached else Action.FETCH
        if held is None or held.tier is Tier.ABSENT:
            return Action.LOAD
        if caps.priority and held.priority is not None and held.priority != target.priority:
            return Action.PRIORITY
        want_pin = target.pinned and target.tier is Tier.GPU
        if caps.pin and held.pinned and not want_pin:
            return Action.UNPIN
        if held.tier is Tier.DISK or (target.tier is Tier.GPU and held.tier is Tier.CPU):
            return None if self.left_to_runtime(target) else Action.ACTIVATE
        if target.tier is Tier.CPU and held.tier is Tier.GPU and caps.tier_control:
            return Action.OFFLOAD
        if caps.pin and want_pin and not held.pinned:
            return Action.PIN
        return None

    def left_to_runtime(self, target: AdapterTarget) -> bool:
        """Was this target entry warmed already on a runtime whose LRU moves copies down, and need not be held
        (``AdapterTarget.hold``)? See the module doc."""
        caps = self.driver.capabilities
        return (caps.load_activates and not caps.tier_control and not target.hold
                and self.warmed.get(target.served_name) == warm_entry(target))

    @staticmethod
    def within_capacity(target: TargetState, info: RuntimeInfo, landing_slot: bool = False,
                        registers_disk: bool = False) -> tuple[dict[str, AdapterTarget], dict[str, str]]:
        """The target clipped to the runtime's slots, and why each clipped adapter was moved down.

        Asking for more GPU (or host) adapters than the runtime has slots would make every activation evict another
        wanted adapter, forever. Pinned adapters first, then higher priority, then by name, get the slots; the rest
        are kept one tier lower (GPU -> CPU -> disk). With ``landing_slot`` (a runtime whose loads activate) and
        host-tier targets, one GPU slot is left for loading and serving those (else each would evict a GPU target).

        With ``registers_disk`` too (disk-tier targets stay registered: ``Capabilities.disk_registered``), loading or
        serving a disk-tier target also lands in that GPU slot, and makes a copy in the host cache: while there are
        disk-tier targets, one host copy is left free of host-tier targets as well (else each such load or request
        would push a kept copy out). Disk-tier targets take no host slot themselves.
        """
        on_disk = registers_disk and any(t.tier is Tier.DISK for t in target.adapters)
        landing = landing_slot and (on_disk or any(t.tier is Tier.CPU for t in target.adapters))
        gpu_free = info.max_loras
        if landing and gpu_free is not None:
            gpu_free -= 1
        host_free = None if info.max_cpu_loras is None else max(info.max_cpu_loras, info.max_loras or 0)
        if landing_slot and on_disk and host_free is not None:
            host_free -= 1
        clipped: dict[str, AdapterTarget] = {}
        why: dict[str, str] = {}
        for t in sorted(target.adapters, key=lambda t: (not t.pinned, -t.priority, t.served_name)):
            tier = t.tier
            if tier is Tier.GPU and gpu_free is not None:
                if gpu_free <= 0:
                    tier, why[t.served_name] = Tier.CPU, f"all {info.max_loras} GPU slots go to other target adapters"
                gpu_free -= 1
            if tier is not Tier.DISK and host_free is not None:
                if host_free <= 0:
                    tier = Tier.DISK
                    why[t.served_name] = f"all {info.max_cpu_loras} host slots go to other target adapters"
                host_free -= 1
            clipped[t.served_name] = t if tier is t.tier else t.model_copy(update={"tier": tier, "pinned": False})
        return clipped, why

    def plan(self, target: TargetState, observation: Observation) -> dict[str, tuple[Action, AdapterTarget | None]]:
        """The next action of every adapter that needs one (target adapters and unwanted runtime adapters)."""
        wanted, _ = self._within_capacity(target, observation.info)
        actions: dict[str, tuple[Action, AdapterTarget | None]] = {}
        for name, t in wanted.items():
            action = self.next_action(t, observation.adapters.get(name))
            if action is not None:
                actions[name] = (action, t)
        for name, held in observation.adapters.items():
            if name in wanted or held.tier is Tier.ABSENT:
                continue
            pin = held.pinned and self.driver.capabilities.pin
            actions[name] = (Action.UNPIN if pin else Action.UNLOAD, None)
        return actions

    def _within_capacity(self, target: TargetState,
                         info: RuntimeInfo) -> tuple[dict[str, AdapterTarget], dict[str, str]]:
        caps = self.driver.capabilities
        return self.within_capacity(target, info, caps.load_activates, caps.disk_registered)

    def leaving(self, wanted: dict[str, AdapterTarget], observation: Observation) -> set[str]:
        """Adapters the runtime serves that the (clipped) target takes out of it: they are drained, then unloaded.

        A disk-tier target takes an adapter out only on a runtime that cannot keep it registered on disk (it stays
        servable else: ``demote``, ``disk_registered``)."""
        unloads_for_disk = not self.driver.capabilities.serves_disk_tier
        out = set()
        for name, held in observation.adapters.items():
            t = wanted.get(name)
            if held.tier is not Tier.ABSENT and (
                t is None or (unloads_for_disk and t.tier is Tier.DISK and held.tier in (Tier.GPU, Tier.CPU))
            ):
                out.add(name)
        return out

    def announced(self, names: set[str]) -> None:
        """A report marking ``names`` as draining was published: their grace starts now (if not started yet)."""
        now = self._clock()
        for name in names:
            if name in self.draining and self.draining[name] is None:
                self.draining[name] = now

    def _still_draining(self, name: str, now: float) -> bool:
        """True while a leaving adapter must not be unloaded yet: not announced, or announced too recently."""
        if name not in self.draining:
            return False
        since = self.draining[name]
        return since is None or now - since < self.drain_grace_s

    def drain_wait(self) -> float | None:
        """Seconds until the next announced drain grace ends (None when none is running)."""
        now = self._clock()
        ends = [since + self.drain_grace_s - now for since in self.draining.values() if since is not None]
        ends = [end for end in ends if end > 0]
        return min(ends) if ends else None

    # --- running ----------------------------------------------------------------------------------------------

    def busy(self) -> set[str]:
        """Adapters with an action in progress."""
        return {n for n, t in self._tasks.items() if not t.done()}

    def step(self, target: TargetState, observation: Observation) -> list[tuple[str, Action]]:
        """Start the next actions that are due; returns what was started."""
        now = self._clock()
        self._forget_stale_status(target, observation)
        planned = self.plan(target, observation)
        wanted_tiers, clipped = self._within_capacity(target, observation.info)
        # an entry left to the runtime's LRU is not defended either: touching it before each load to save its
        # copy took a GPU slot for it, the churn warm-once removed (docs/twin.md)
        for name, wanted in wanted_tiers.items():
            if wanted.tier not in (Tier.GPU, Tier.CPU):  # out of the warm tiers: a move back is a new entry
                self.warmed.pop(name, None)
        kept = {n: t for n, t in wanted_tiers.items() if not self.left_to_runtime(t)}
        self.driver.keep_resident({n for n, t in kept.items() if t.tier is Tier.GPU},
                                  {n for n, t in kept.items() if t.tier in (Tier.GPU, Tier.CPU)})
        if self.drain_grace_s > 0:
            self.draining = {n: self.draining.get(n) for n in self.leaving(wanted_tiers, observation)}
        for name, wanted in target.by_name().items():
            status = self.status.setdefault(name, AdapterStatus(cache_key=wanted.cache_key))
            if name not in planned:
                if status.wanted_since is not None and status.error is None:
                    self.metrics.activation.observe(now - status.wanted_since)
                status.wanted_since = None
                status.error = status.reason = None
                status.failures = 0
                if name in clipped:
                    status.error, status.reason = f"kept below its target tier: {clipped[name]}", "CapacityExceeded"
            elif status.wanted_since is None:
                status.wanted_since = now
        busy = self.busy()
        # an activation waits while an unload or offload is freeing a slot, or while a leaving adapter that fills the
        # last GPU slot is still draining (else the runtime would evict another wanted adapter for it)
        removing = any(self._task_action[n].removes for n in busy) or (
            self._gpu_full(observation)
            and any(observation.adapters[n].tier is Tier.GPU and self._still_draining(n, now) for n in self.draining)
        )
        started = []
        # a runtime whose loads activate (vLLM) places one adapter at a time (it serialises loads anyway), host-tier
        # targets before GPU-tier ones, so the GPU-tier ones are the most recently used when all are in
        serial = self.driver.capabilities.load_activates
        placing = serial and (any(self._task_action[n] in _PLACING for n in busy)
                              or self._slots_busy(observation, now))
        # disk-tier registrations (``disk_registered``) are the lowest priority: each waits until no warmer target
        # is being placed or due to be, and one at a time (each load takes the landing slot and a host copy); where
        # loads activate, also while requests wait in the runtime's queue (``queue_busy``)

        def registration(name: str, action: Action) -> bool:
            t = wanted_tiers.get(name)
            return action in _PLACING and t is not None and t.tier is Tier.DISK

        def warm_placement(name: str, action: Action) -> bool:
            t = wanted_tiers.get(name)
            return action in _PLACING and t is not None and t.tier is not Tier.DISK

        registering = any(registration(n, self._task_action[n]) for n in busy)
        # a pending registration on vLLM waits while requests wait in the runtime's queue: its load activates,
        # stalling the batch (~0.17 s for 80 MB from disk) while they wait for their first token, and no request
        # needs it yet
        queue_busy = self._queue_wait.holds(serial and observation.load.queue_depth > 0 and any(
            registration(n, a) for n, (a, _) in planned.items() if n not in busy), now)
        warming = any(warm_placement(n, self._task_action[n]) for n in busy) or any(
            warm_placement(n, a) and self.status.get(n, AdapterStatus()).not_before <= now
            for n, (a, _) in planned.items())

        def order(item: tuple[str, tuple[Action, AdapterTarget | None]]) -> tuple[bool, int]:
            action, t = item[1]
            rank = 0 if t is None or t.tier is Tier.CPU else 1 if t.tier is Tier.GPU else 2
            return not action.removes, rank

        # removals first: an activation waits while an unload or offload is freeing a slot
        for name, (action, t) in sorted(planned.items(), key=order):
            if name in busy:
                continue
            status = self.status.setdefault(name, AdapterStatus())
            if status.not_before > now:
                continue
            held = observation.adapters.get(name)
            if action is Action.UNLOAD and self._still_draining(name, now):
                continue
            if action.removes and held is not None and held.in_flight > 0:
                status.error = f"waiting for {held.in_flight} requests in flight before {action.value}"
                status.reason = "RequestsInFlight"
                continue
            if action is Action.ACTIVATE and removing:
                continue
            if registration(name, action):
                if warming or registering or queue_busy:
                    continue
                registering = True
            if serial and action in _PLACING:
                if placing:
                    continue
                placing = True
            self._start(name, action, t, observation, held)
            started.append((name, action))
            removing = removing or action.removes
        return started

    def _slots_busy(self, observation: Observation, now: float) -> bool:
        """Do adapters with requests in flight fill every GPU slot, for less than ``SLOTS_BUSY_WAIT_S`` so far?
        A load or warm-up then waits (see ``SLOTS_BUSY_WAIT_S``)."""
        slots = observation.info.max_loras
        full = slots is not None and sum(h.in_flight > 0 for h in observation.adapters.values()) >= slots
        return self._slots_wait.holds(full, now)

    @staticmethod
    def _gpu_full(observation: Observation) -> bool:
        slots = observation.info.max_loras
        return slots is not None and sum(h.tier is Tier.GPU for h in observation.adapters.values()) >= slots

    def _start(
        self, name: str, action: Action, target: AdapterTarget | None, obs: Observation, held: RuntimeAdapter | None
    ) -> None:
        self._task_action[name] = action
        work = self._work(name, action, target, obs, held)
        self._tasks[name] = asyncio.get_running_loop().create_task(self._run(name, action, work))

    async def _run(self, name: str, action: Action, work: Awaitable[None]) -> None:
        status = self.status.setdefault(name, AdapterStatus())
        try:
            async with self._slots:
                await work
        except (ActionFailed, ArtifactError, compat.Incompatible) as exc:
            self._failed(status, name, action, exc.reason, str(exc))
        except RuntimeRejected as exc:
            # a 400 on load is the runtime's own compatibility check (modules, shapes, rank), and so is vLLM's 500
            # from a server that stays healthy (the driver checked): final for the revision
            refused = action in (Action.LOAD, Action.RELOAD) and (exc.status == 400 or exc.status >= 500)
            reason = ERROR_INCOMPATIBLE if refused else f"{action.value.capitalize()}Rejected"
            self._failed(status, name, action, reason, f"the runtime refused it: {exc}")
        except RuntimeUnavailable as exc:
            self._failed(status, name, action, "RuntimeUnavailable", str(exc))
        except Exception as exc:
            log.exception("%s %s failed", action.value, name)
            self._failed(status, name, action, "InternalError", repr(exc))
        else:
            status.failures, status.not_before = 0, 0.0
            status.error = status.reason = None
        finally:
            self.changed.set()

    def _failed(self, status: AdapterStatus, name: str, action: Action, reason: str, message: str) -> None:
        final = ERROR_DIGEST_MISMATCH if reason in _DIGEST_REASONS else (
            ERROR_INCOMPATIBLE if reason in _INCOMPATIBLE_REASONS else (ERROR_REFUSED if reason in REFUSAL_REASONS else None)
        )
        if final is not None and final != reason:
            message, reason = f"{reason}: {message}", final
        status.failures += 1
        # final reasons are not retried: only a new revision (a new status) or a restarted runtime (reset) tries again
        delay = math.inf if final else self.backoff.delay(status.failures)
        status.not_before = self._clock() + delay
        status.error, status.reason = f"{action.value} failed: {message}", reason
        self.metrics.action_failures.labels(reason).inc()
        log.warning("%s %s failed (%s, attempt %d): %s", action.value, name, reason, status.failures, message)

    def _forget_stale_status(self, target: TargetState, observation: Observation) -> None:
        """Drop statuses of adapters that are gone, and of target adapters whose revision changed."""
        wanted, busy = target.by_name(), self.busy()
        for name, status in list(self.status.items()):
            t = wanted.get(name)
            if t is None:
                stale = name not in observation.adapters and name not in busy
            else:
                stale = status.cache_key is not None and status.cache_key != t.cache_key
            if stale:
                del self.status[name]

    async def _work(
        self, name: str, action: Action, target: AdapterTarget | None, obs: Observation, held: RuntimeAdapter | None
    ) -> None:
        driver = self.driver
        if action is Action.UNLOAD:
            await driver.unload(name)
            self.loaded.pop(name, None)
            self.warmed.pop(name, None)
            self._removed_by_us.add(name)
        elif action in (Action.OFFLOAD, Action.DEMOTE):
            await (driver.offload if action is Action.OFFLOAD else driver.demote)(name)
            self._removed_by_us.add(name)
        elif action in (Action.PIN, Action.UNPIN):
            await driver.set_pinned(name, action is Action.PIN)
        elif action is Action.PRIORITY:
            assert target is not None
            await driver.set_priority(name, target.priority)
        elif action is Action.ACTIVATE:
            assert target is not None
            self.metrics.cache_hits.labels(Tier.CPU.value if held and held.tier is Tier.CPU else Tier.DISK.value).inc()
            start = time.perf_counter()
            await driver.activate(name)
            seconds = time.perf_counter() - start
            self.metrics.h2d.observe(seconds)
            self.load_costs.record(Tier.CPU if held is not None and held.tier is Tier.CPU else Tier.DISK, seconds)
            self._count_promotion(name)
            self.warmed[name] = warm_entry(target)
        else:
            assert target is not None
            start, fetched = time.perf_counter(), self.cache.get(target.cache_key) is None
            entry = await self._ensure_cached(target, obs)
            if action is Action.FETCH:
                return
            if action is Action.RELOAD and held is not None and held.tier is not Tier.ABSENT:
                if held.in_flight:
                    raise ActionFailed("RequestsInFlight", f"{name} holds another revision with requests in flight")
                await driver.unload(name)
                self.loaded.pop(name, None)
                self._removed_by_us.add(name)
            if await self._load(name, target, entry):
                self._count_promotion(name)
                self.load_costs.record(Tier.ABSENT if fetched else Tier.DISK, time.perf_counter() - start)
            self.loaded[name] = LoadRecord(target.cache_key, entry.artifact_digest, entry.adapter_digest)
            self.warmed[name] = warm_entry(target)
            if driver.capabilities.priority:  # at once, so the runtime's eviction policy never weighs a default
                await driver.set_priority(name, target.priority)

    async def _load(self, name: str, target: AdapterTarget, entry: CacheEntry) -> bool:
        """Load the cache entry under ``name``; False when the runtime already held exactly this revision.

        A runtime answering "already loaded" (HTTP 400; the observation this pass planned from predates a load that
        just finished, or the runtime kept it across a sidecar restart) holds *something* under the name: the
        runtime is asked again, and the adapter is adopted when it is the target's revision, else replaced.
        """
        driver = self.driver
        start = time.perf_counter()
        try:
            await driver.load(name, entry.path)
        except RuntimeRejected as exc:
            if not _already_loaded(exc):
                raise
            held = (await driver.observe()).adapters.get(name)
            if held is not None and self._holds_target(target, held):
                log.info("%s was already loaded with the target's revision: adopted", name)
                return False
            if held is not None and held.in_flight:
                raise ActionFailed("RequestsInFlight", f"{name} holds another revision with requests in flight") from exc
            log.warning("%s was already loaded with other or unknown bytes: replacing them", name)
            await driver.unload(name)
            self._removed_by_us.add(name)
            start = time.perf_counter()
            await driver.load(name, entry.path)
        self.metrics.disk_load.observe(time.perf_counter() - start)
        return True

    def _count_promotion(self, name: str) -> None:
        after_eviction = name in self.evicted
        self.evicted.discard(name)
        self.metrics.promoted(after_eviction)

    async def _ensure_cached(self, target: AdapterTarget, obs: Observation) -> CacheEntry:
        compat.check_target(target, obs.info)
        entry = self.cache.get(target.cache_key)
        if entry is None:
            self.metrics.cache_misses.inc()
            timings = StageTimings()
            keep = set(self._keep)
            entry = await asyncio.to_thread(self.cache.fetch, target, keep, timings)
            for stage, histogram in (("resolve", self.metrics.resolve), ("download", self.metrics.download),
                                     ("verify", self.metrics.verify)):
                value = getattr(timings, stage)
                if value is not None:
                    histogram.observe(value)
        else:
            self.metrics.cache_hits.labels(Tier.DISK.value).inc()
        try:
            compat.check_files(target, peft.inspect(entry.path))
        except peft.InvalidAdapter as exc:
            raise ActionFailed("InvalidArtifact", str(exc)) from exc
        return entry

    def note_evictions(self, before: Observation, after: Observation) -> list[str]:
        """Count (and return) adapters that left GPU or host memory between two observations unasked."""
        evicted = []
        for name, old in before.adapters.items():
            if old.tier not in (Tier.GPU, Tier.CPU) or name in self._removed_by_us:
                continue
            new = after.adapters.get(name)
            if new is None or old.tier.warmer_than(new.tier):
                self.metrics.evictions.labels(old.tier.value).inc()
                self.evicted.add(name)
                evicted.append(name)
        self._removed_by_us.clear()
        return evicted

    def keep(self, target: TargetState) -> None:
        """Cache keys the disk cache must not evict (everything in the target)."""
        self._keep = frozenset(t.cache_key for t in target.adapters)

    def reset(self) -> None:
        """Forget backoffs and what was loaded and warmed (after a runtime restart)."""
        self.loaded.clear()
        self.warmed.clear()
        for status in self.status.values():
            status.failures, status.not_before = 0, 0.0

    async def drain(self) -> None:
        """Wait for the running actions."""
        tasks = [t for t in self._tasks.values() if not t.done()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def cancel(self) -> None:
        """Cancel the running actions (on shutdown)."""
        for task in self._tasks.values():
            task.cancel()
        await self.drain()
