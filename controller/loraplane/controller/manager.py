"""The controller process, in controller-runtime's shape: watch events -> per-pool work items -> reconcile.

Informers keep caches of AdapterRevisions, InferencePools and Pods; each change queues the pool it concerns (a
revision's ``spec.poolRef``, an InferencePool, the pools of a Pod's namespace) on a rate-limited ``WorkQueue``
(a key queued twice is reconciled once, never by two workers at once). A worker reconciles one pool from scratch
from the caches and Redis (``plan_pool``) and writes back what differs; it returns when the pool next needs to run
(the earliest rollout gate due), and the key is queued for then, or for its resync (``resync_seconds`` less up to
25 % jitter, so the pools' resyncs spread out) if that comes first: level-triggered, since reports, rates and
counters in Redis change without notice, and each reconcile also repairs the Redis keys it owns. An exception of
any kind in one pool is logged and that pool is retried with per-pool exponential backoff (reset on success), while
the other pools go on; a terminal error (the pool cannot be reconciled as written: an invalid selector, an invalid
revision) is recorded in the revisions' status and not retried until the objects change. As a safety net, every
``resync_seconds`` any known pool the queue holds no item for is queued.
Only the Lease holder reconciles, and it checks its lease again right before writing.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from loraplane.api import AdapterRevision, AdapterRevisionStatus, StatusRecord
from loraplane.controller.incremental import (
    DEFAULT_FULL_PLAN_SECONDS,
    DEFAULT_HYSTERESIS,
    IncrementalPlanner,
    PlanOutcome,
)
from loraplane.controller.kube import FINALIZER, KubeApi
from loraplane.controller.leader import LeaseElector
from loraplane.controller.metrics import ControllerMetrics
from loraplane.controller.placement import PlacementConfig, TenantBudget
from loraplane.controller.pool import PoolInputs, PoolPlan
from loraplane.controller.probe import HealthProber
from loraplane.controller.queue import ShutDown, WorkQueue
from loraplane.controller.rollout import Event, ProbeRequest, ProbeResult, record_terminal_error
from loraplane.controller.store import RedisStore
from loraplane.kube import Informer, Key, SelectorError, object_key, pool_members
from loraplane.waits import sleep_or_stop

log = logging.getLogger(__name__)

#: middle-generation collections between two full ones (``gc.set_threshold``'s third value; CPython's default is 10)
FULL_COLLECTION_EVERY = 100


@dataclass(frozen=True)
class ControllerConfig:
    """How the controller runs (flags of ``loraplane-controller``; placement settings from its config file)."""

    namespace: str | None = None
    resync_seconds: float = 2.0
    max_concurrent_probes: int = 8
    #: pools reconciled at the same time (a pool is never reconciled by two workers at once)
    workers: int = 2
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    budgets: dict[str, TenantBudget] = field(default_factory=dict)
    #: a pool at rest is planned again at least this often (``IncrementalPlanner``)
    full_plan_seconds: float = DEFAULT_FULL_PLAN_SECONDS
    #: relative rate change (each window) an adapter's rates must pass to plan its pool again
    rate_hysteresis: float = DEFAULT_HYSTERESIS


_tokens = itertools.count(1)


@dataclass
class _Revisions:
    """One pool's revisions as a reconcile read them."""

    #: (object, the revision with the status the state machine goes on from)
    revisions: list[tuple[dict[str, Any], AdapterRevision]] = field(default_factory=list)
    #: the statuses the objects hold
    stored: dict[Key, AdapterRevisionStatus] = field(default_factory=dict)
    objects: dict[Key, dict[str, Any]] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)
    #: a new number for every read (the planner's revisions token)
    token: int = 0


class TerminalError(Exception):
    """A pool cannot be reconciled as its objects are written; retrying cannot help until they change."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _pool_of(obj: dict[str, Any] | None) -> str | None:
    """The pool an AdapterRevision object names (read leniently: the object may not validate)."""
    ref = ((obj or {}).get("spec") or {}).get("poolRef") or {}
    name = ref.get("name") if isinstance(ref, dict) else None
    return name if isinstance(name, str) and name else None


def _namespace(obj: dict[str, Any]) -> str:
    return obj.get("metadata", {}).get("namespace") or "default"


def _phase_label(status: AdapterRevisionStatus) -> str:
    """``Canary step 2``, ``Stable`` ... as people read a status."""
    step = f" step {status.canary_step + 1}" if status.phase.value == "Canary" and status.canary_step is not None else ""
    return f"{status.phase.value}{step}"


class Controller:
    """Reconciles every pool, one work item per pool, while this replica holds the lease."""

    def __init__(
        self,
        kube: KubeApi,
        store: RedisStore,
        prober: HealthProber,
        elector: LeaseElector | None,
        config: ControllerConfig,
        wall_clock: Callable[[], float] = time.time,
        metrics: ControllerMetrics | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.kube = kube
        self.store = store
        self.prober = prober
        self.elector = elector
        self.config = config
        self.wall_clock = wall_clock
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.queue: WorkQueue[str] = WorkQueue(monotonic)
        self.informers: dict[str, Informer] = {}
        #: pool -> (served name, pod) -> the latest probe result
        self.probe_results: dict[str, dict[tuple[str, str], ProbeResult]] = {}
        self._probing: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._probe_slots = asyncio.Semaphore(config.max_concurrent_probes)
        #: the last of the background Event posts (each waits for the one before: Events go out in order)
        self._events_posted: asyncio.Future[None] | None = None
        self._was_leader = False
        #: revision -> the pool it was last seen in (a changed poolRef queues the old pool too), and the reverse
        self._pool_of: dict[Key, str] = {}
        self._revisions_in: dict[str, set[Key]] = {}
        #: revision -> (resourceVersion, the parsed object or why it does not validate): parsed once per version
        self._parsed: dict[Key, tuple[str, AdapterRevision | str]] = {}
        #: pool -> its terminal error (not retried by the resync; any change of its objects clears it)
        self.terminal: dict[str, TerminalError] = {}
        #: revision -> (uid, the status this replica last wrote or confirmed): the status the state machine goes on
        #: from. One found changed by someone else is not trusted (see ``_trusted``). Each is recorded in Redis too
        #: (``StatusRecord``, before the status is written), where a replica that becomes leader reads it back.
        self.written: dict[Key, tuple[str, AdapterRevisionStatus]] = {}
        #: pools whose status records this replica read back since it became leader
        self._records_read: set[str] = set()
        #: completed pool reconciles (for tests and metrics)
        self.reconciles = 0
        self.planner = IncrementalPlanner(config.rate_hysteresis, config.full_plan_seconds, monotonic)
        #: pool -> a count of the changes of its revisions (watch events, this replica's own writes)
        self._epoch: dict[str, int] = {}
        #: pool -> (its epoch then, the revisions as the last reconcile read them: parsed, trusted, stored statuses)
        self._read_revisions: dict[str, tuple[int, _Revisions]] = {}
        if elector is not None:
            elector.on_change = self._leadership_changed

    def is_leader(self) -> bool:
        return self.elector is None or self.elector.is_leader()

    # -- work items from watch events ----------------------------------------------------------------------------
    def enqueue(self, pool: str) -> None:
        """Queue one pool (a change concerns it: its terminal error, if any, is forgotten)."""
        self.terminal.pop(pool, None)
        self._touch(pool)
        self.queue.add(pool)

    def _touch(self, pool: str) -> None:
        """The pool's revisions (may) have changed: the next reconcile reads them again."""
        self._epoch[pool] = self._epoch.get(pool, 0) + 1

    def pools(self) -> set[str]:
        """Every pool the controller knows: named by a revision, or with keys it wrote."""
        named = {_pool_of(obj) for obj in self.informers["revisions"].items.values()} if self.informers else set()
        return {p for p in named if p is not None} | set(self.store.routes) | set(self.store.targets)

    def enqueue_all(self, missing_only: bool = False) -> None:
        """Queue every known pool (with ``missing_only``, those the queue holds no item for) but those whose terminal
        error nothing has changed since."""
        for pool in sorted(self.pools()):
            if pool not in self.terminal and not (missing_only and self.queue.knows(pool)):
                self.queue.add(pool)

    def _index(self, key: Key, pool: str | None) -> str | None:
        """File revision ``key`` under ``pool`` (None: under none); returns the pool it was filed under before."""
        old = self._pool_of.pop(key, None)
        if old is not None:
            self._revisions_in.get(old, set()).discard(key)
        if pool is not None:
            self._pool_of[key] = pool
            self._revisions_in.setdefault(pool, set()).add(key)
        return old

    def _revision_changed(self, kind: str, obj: dict[str, Any] | None) -> None:
        if obj is None:  # listed
            for key, o in self.informers["revisions"].items.items():
                self._index(key, _pool_of(o))
            for named in self.pools():
                self._touch(named)
            self.enqueue_all()
            return
        key = object_key(obj)
        pool = None if kind == "DELETED" else _pool_of(obj)
        if kind == "DELETED":
            self._parsed.pop(key, None)
            self.written.pop(key, None)
        old = self._index(key, pool)
        for concerned in {p for p in (old, pool) if p is not None}:
            self.enqueue(concerned)

    def _pool_changed(self, kind: str, obj: dict[str, Any] | None) -> None:
        if obj is None:
            self.enqueue_all()
        else:
            self.enqueue(obj["metadata"]["name"])

    def _pod_changed(self, kind: str, obj: dict[str, Any] | None) -> None:
        if obj is None:
            self.enqueue_all()
            return
        namespace = _namespace(obj)
        for ns, name in list(self.informers["pools"].items):
            if (ns or "default") == namespace:
                self.enqueue(name)

    def _leadership_changed(self, leading: bool) -> None:
        if leading:
            self.enqueue_all()

    # -- the run loop --------------------------------------------------------------------------------------------
    async def watch(self, stop: asyncio.Event) -> None:
        """Start the informers and wait until each has listed once (or ``stop``): nothing is reconciled from a
        partial view. Informers retry (and log) until the API server answers."""
        handlers = {"revisions": self._revision_changed, "pools": self._pool_changed, "pods": self._pod_changed}
        self.informers = self.kube.informers(self.config.namespace, handlers)
        for informer in self.informers.values():
            informer.start()
        waits = [asyncio.ensure_future(i.synced.wait()) for i in self.informers.values()]
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([asyncio.ensure_future(asyncio.wait(waits)), stopping], return_when=asyncio.FIRST_COMPLETED)
        for w in [*waits, stopping]:
            w.cancel()

    async def run(self, stop: asyncio.Event) -> None:
        """Watch, elect and reconcile until ``stop``."""
        elector_task = asyncio.ensure_future(self.elector.run(stop)) if self.elector else None
        workers: list[asyncio.Task[None]] = []
        try:
            await self.watch(stop)
            self._freeze_caches()
            workers = [asyncio.ensure_future(self._work()) for _ in range(max(1, self.config.workers))]
            self.enqueue_all()
            while not stop.is_set():
                await sleep_or_stop(stop, self.config.resync_seconds)
                self.enqueue_all(missing_only=True)  # the safety net: a pool no item is queued for
        finally:
            self.queue.shut_down()
            for worker in workers:
                with contextlib.suppress(asyncio.CancelledError):
                    await worker
            for informer in self.informers.values():
                informer.stop()
            for task in self._probing.values():
                task.cancel()
            if elector_task is not None:
                await elector_task

    async def _work(self) -> None:
        """One worker: take a pool, reconcile it, queue it again as the outcome says."""
        while True:
            try:
                pool = await self.queue.get()
            except ShutDown:
                return
            try:
                await self.process(pool)
            finally:
                self.queue.done(pool)

    async def process(self, pool: str) -> None:
        """Reconcile one pool and requeue it: at its next due time or resync on success, after its backoff on an
        error, never on a terminal error. No exception of a pool's reconcile escapes (the other pools and the process go on)."""
        try:
            after = await self.reconcile(pool)
        except TerminalError as exc:
            self.queue.forget(pool)
            self.terminal[pool] = exc
            log.warning("pool %s: %s (%s); not retried until its objects change", pool, exc.message, exc.reason)
            await self._record_terminal(self._revision_objects(pool), exc.reason, exc.message)
            self._count_error()
        except Exception as exc:
            delay = self.queue.add_rate_limited(pool)
            log.warning("pool %s: reconcile failed (%s: %s); retrying in %.2fs", pool, type(exc).__name__, exc, delay)
            self._count_error()
        else:
            self.queue.forget(pool)
            resync = self.config.resync_seconds * (1 - 0.25 * self.rng.random())
            if after is not None and after <= resync:
                self.queue.add_after(pool, after)
            else:
                self.queue.add_after(pool, resync, background=True)  # yields to changes and due gates

    def _count_error(self) -> None:
        if self.metrics:
            self.metrics.reconcile_errors.inc()

    # -- one pool ------------------------------------------------------------------------------------------------
    def _acting(self) -> bool:
        """True while leader; a replica that just became leader forgets what it wrote (it reads Redis back)."""
        leader = self.is_leader()
        if self.metrics:
            self.metrics.leader.set(1 if leader else 0)
        if leader and not self._was_leader:
            self.store.targets.clear()  # another replica may have written meanwhile: read back from Redis
            self.store.routes.clear()
            self.written.clear()  # ... and the statuses: the last leader's records, read back per pool
            self._records_read.clear()
            self.planner.forget()
            self._read_revisions.clear()
        self._was_leader = leader
        return leader

    def _revision_objects(self, pool: str) -> list[dict[str, Any]]:
        items = self.informers["revisions"].items
        return [items[k] for k in sorted(self._revisions_in.get(pool, ())) if k in items]

    def _freeze_caches(self) -> None:
        """Parse every listed revision, then keep full collections rare and off what lives now: a full collection
        traverses every cached revision (~70 objects each) and stalls every pool, and a due gate, for 0.1-0.4 s
        with a thousand of them. ``gc.freeze`` moves the start-up objects out of the collector's reach (what of
        them is freed later is freed by reference counting as usual); ``FULL_COLLECTION_EVERY`` young-generation
        collections instead of CPython's 10 must pass before the next full one."""
        for obj in list(self.informers["revisions"].items.values()):
            self._parse(obj)
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)

    def _parse(self, obj: dict[str, Any]) -> AdapterRevision | str:
        """The AdapterRevision, or why it does not validate (parsed once per resourceVersion)."""
        key, version = object_key(obj), str(obj["metadata"].get("resourceVersion", ""))
        hit = self._parsed.get(key)
        if hit is not None and version and hit[0] == version:
            return hit[1]
        try:
            parsed: AdapterRevision | str = AdapterRevision.model_validate(obj)
        except ValidationError as exc:
            parsed = f"the revision does not validate: {exc.errors()[:1]}"
        self._parsed[key] = (version, parsed)
        return parsed

    def members(self, pool: str, namespaces: Iterable[str]) -> set[str] | None:
        """Names of the ready pods the InferencePools named ``pool`` in ``namespaces`` select (the one membership
        rule, ``loraplane.kube.pool_members``); None when no such InferencePool exists."""
        wanted = set(namespaces)
        objects = [o for (ns, name), o in self.informers["pools"].items.items()
                   if name == pool and (ns or "default") in wanted]
        if not objects:
            return None
        pods = self.informers["pods"].items
        try:
            return {m.name for o in objects for m in pool_members(o, pods)}
        except SelectorError as exc:
            raise TerminalError("InvalidPoolSelector", f"InferencePool {pool}: {exc}") from exc

    async def reconcile(self, pool: str) -> float | None:
        """Reconcile one pool (nothing when not leader); returns in how many seconds it is next due, if ever."""
        if not self._acting():
            return None
        started = time.perf_counter()
        if pool not in self._records_read:
            await self._read_records(pool)
        epoch = self._epoch.get(pool, 0)
        cached = self._read_revisions.get(pool)
        if cached is not None and cached[0] == epoch:
            read = cached[1]  # nothing changed them since: not walked again (10,000 of them take milliseconds)
        else:
            read = await self._read(pool)
            self._read_revisions[pool] = (epoch, read)
        revisions, stored = read.revisions, read.stored
        probes = self.probe_results.get(pool, {})
        self.probe_results[pool] = {k: r for k, r in probes.items() if k[0] in read.live}
        now = self.wall_clock()
        outcome = await self._plan(pool, read, now)
        if outcome is not None and outcome.reused:
            await self._repair(pool)  # level-triggered still: what Redis lost comes back
        elif outcome is not None and outcome.delta:  # a few revisions placed again: only target states change
            await self._repair(pool)
            writes_before = self.store.writes
            await self.store.write_targets(pool, outcome.plan.targets)
            if self.metrics:
                self.metrics.redis_writes.inc(self.store.writes - writes_before)
        elif outcome is not None:
            plan = outcome.plan
            self._forget_probes(pool, plan)
            await self._write(pool, plan, read.objects, revisions, stored, outcome.decided)
        self.reconciles += 1
        if self.metrics:
            self.metrics.reconcile_seconds.observe(time.perf_counter() - started)
        if outcome is None or outcome.plan.next_due is None:
            return None
        return max(0.0, outcome.plan.next_due.timestamp() - self.wall_clock())

    async def _read_records(self, pool: str) -> None:
        """Take the pool's status records from Redis as this replica's own (a new leader's first pass): a status
        someone patched while no replica led, or while the lead changed hands, is not trusted either."""
        for record in await self.store.read_status_records(pool):
            self.written.setdefault((record.namespace, record.name), (record.uid, record.status))
        self._records_read.add(pool)

    async def _read(self, pool: str) -> _Revisions:
        """The pool's revisions as the state machine goes on from them (``_trusted``); invalid ones recorded."""
        read = _Revisions()
        invalid: list[tuple[dict[str, Any], str]] = []
        overwritten: list[tuple[dict[str, Any], Event]] = []
        for obj in self._revision_objects(pool):
            parsed = self._parse(obj)
            if isinstance(parsed, str):
                invalid.append((obj, parsed))
                continue
            read.stored[object_key(obj)] = parsed.status
            trusted, event = self._trusted(obj, parsed)
            read.revisions.append((obj, trusted))
            if event is not None:
                overwritten.append((obj, event))
        if overwritten:
            self._record_events(overwritten)
        for obj, why in invalid:  # terminal for that object only: recorded, and the rest of the pool goes on
            await self._record_terminal([obj], "InvalidSpec", why)
        read.objects = {object_key(o): o for o, _ in read.revisions}
        read.live = {rev.served_name for _, rev in read.revisions}
        read.token = next(_tokens)
        return read

    async def _repair(self, pool: str) -> None:
        writes_before, repairs_before = self.store.writes, self.store.repairs
        await self.store.check(pool)
        if self.metrics and self.store.repairs != repairs_before:
            self.metrics.redis_writes.inc(self.store.writes - writes_before)
            self.metrics.redis_repairs.inc(self.store.repairs - repairs_before)

    def _trusted(self, obj: dict[str, Any], rev: AdapterRevision) -> tuple[AdapterRevision, Event | None]:
        """The revision with the status the state machine may go on from: the one this replica last wrote (or
        confirmed) when the stored one differs from it, for nobody else writes a revision's status; a status patched
        by someone else (``phase: Stable`` during a canary) is never acted on, and the reconcile writes the record
        back. A new leader starts from the records in Redis (``_read_records``); only a revision with none (never
        written by a controller that records) is taken as stored."""
        key, uid = object_key(obj), str(obj["metadata"].get("uid", ""))
        record = self.written.get(key)
        if record is None or record[0] != uid or record[1] == rev.status:
            return rev, None
        ours = record[1]
        log.warning("%s/%s: status changed by another writer (phase %s, ours %s); restoring ours", key[0] or "default",
                    key[1], rev.status.phase.value, ours.phase.value)
        if self.metrics:
            self.metrics.status_repairs.inc()
        event = Event(rev.metadata.name, "Warning", "StatusOverwritten",
                      f"status (phase {_phase_label(rev.status)}) was not written by the controller; restored "
                      f"{_phase_label(ours)}: phases change only through the rollout's gates")
        return rev.model_copy(update={"status": ours}), event

    async def _plan(self, pool: str, read: _Revisions, now: float) -> PlanOutcome | None:
        revisions = [rev for _, rev in read.revisions]
        readings = await self.store.read(pool)
        members = self.members(pool, {rev.metadata.namespace or "default" for rev in revisions})
        reports = [r for r in readings.reports if not r.is_stale(now) and (members is None or r.pod in members)]
        if pool not in self.store.targets:
            await self.store.load_written(pool)
            self.planner.forget(pool)
        outcome = self.planner.plan(
            PoolInputs(
                pool=pool,
                now=datetime.fromtimestamp(now, UTC),
                revisions=revisions,
                reports=reports,
                rates=readings.rates,
                counters=readings.counters,
                previous_targets=self.store.written_targets(pool),
                probes=self.probe_results[pool],
                placement=self.config.placement,
                budgets=self.config.budgets,
            ),
            (pool, read.token),
            readings.report_versions,
        )
        if self.metrics:
            self.metrics.plans.labels(outcome.kind).inc()
        if not outcome.reused:
            log.debug("pool %s planned: %s", pool, outcome.why)
        return outcome if self.is_leader() else None

    async def _write(self, pool: str, plan: PoolPlan, objects: dict[Key, dict[str, Any]],
                     revisions: list[tuple[dict[str, Any], AdapterRevision]],
                     stored: dict[Key, AdapterRevisionStatus], decided: set[Key] | None = None) -> None:
        """Write what ``plan`` changed: routes, target states, the statuses of the objects it ``decided`` (None:
        every object), its events and probes."""
        writes_before, repairs_before = self.store.writes, self.store.repairs
        # what Redis lost or someone overwrote since the last pass comes back first (a plan of a part: where cheap)
        await (self.store.repair(pool) if decided is None else self.store.check(pool))
        # routes first: a revision leaves the route before any pod unloads it; one only enters it once warm
        await self.store.write_routes(pool, plan.routes, plan.base_model, plan.placement.staging)
        deleting = [rev.served_name for _, rev in revisions if rev.metadata.deletion_timestamp is not None]
        await self.store.write_targets(pool, plan.targets, deleting)
        if self.metrics:
            self.metrics.redis_writes.inc(self.store.writes - writes_before)
            self.metrics.redis_repairs.inc(self.store.repairs - repairs_before)
        # one object's writes stay in order; different objects' go out side by side (each call blocks a thread),
        # after the pass's status records, all in one pipeline
        writes = [(objects[key], rp) for key, rp in plan.revisions.items() if decided is None or key in decided]
        await self.store.write_status_records([r for obj, rp in writes if (r := self._record_of(obj, rp.status))])
        await asyncio.gather(*(self._write_back(obj, rp.status, finalize=rp.finalize, stored=stored[object_key(obj)],
                                                recorded=True) for obj, rp in writes))
        if plan.events:
            self._record_events([(objects[key], event) for key, event in plan.events])
        for key, request in plan.probes:
            self._start_probe(pool, next(rev for o, rev in revisions if object_key(o) == key), request)

    async def _record_terminal(self, objects: list[dict[str, Any]], reason: str, message: str) -> None:
        """Record a terminal error in each object's status (a ``Reconciled=False`` condition) when not yet there."""
        if not self.is_leader():
            return
        for obj in objects:
            try:
                stored = AdapterRevisionStatus.model_validate(obj.get("status") or {})
            except ValidationError:
                stored = AdapterRevisionStatus()
            record = self.written.get(object_key(obj))
            base = record[1] if record is not None and record[0] == str(obj["metadata"].get("uid", "")) else stored
            status = base.model_copy(update={"conditions": list(base.conditions)})
            generation = obj.get("metadata", {}).get("generation")
            record_terminal_error(status, reason, message, datetime.fromtimestamp(self.wall_clock(), UTC),
                                  generation if isinstance(generation, int) else None)
            await self._write_back(obj, status, finalize=False, add_finalizer=False, stored=stored)

    def _record_of(self, obj: dict[str, Any], status: AdapterRevisionStatus) -> StatusRecord | None:
        """The status record to write before ``status`` goes to ``obj`` (None: recorded already, or not recorded)."""
        key, uid = object_key(obj), str(obj["metadata"].get("uid", ""))
        pool, deleting = _pool_of(obj), obj["metadata"].get("deletionTimestamp") is not None
        if self.written.get(key) == (uid, status) or pool is None or deleting:
            return None
        return StatusRecord(pool=pool, namespace=_namespace(obj), name=key[1], uid=uid, status=status)

    async def _write_back(self, obj: dict[str, Any], status: AdapterRevisionStatus, finalize: bool,
                          add_finalizer: bool = True, stored: AdapterRevisionStatus | None = None,
                          recorded: bool = False) -> None:
        """Patch the status when it differs from ``stored`` (the object's, parsed), its status record written first
        (``recorded``: already); add our finalizer, or remove it once the revision is unloaded."""
        informer = self.informers["revisions"]
        key, uid = object_key(obj), str(obj["metadata"].get("uid", ""))
        pool, deleting = _pool_of(obj), obj["metadata"].get("deletionTimestamp") is not None
        try:
            if not recorded and (record := self._record_of(obj, status)) is not None:
                await self.store.write_status_records([record])
            if stored != status and not deleting:
                obj = await self.kube.patch_status(_namespace(obj), obj["metadata"]["name"],
                                                   status.model_dump(mode="json", by_alias=True))
                informer.remember(obj)
                self._touch_object(obj)
                if self.metrics:
                    self.metrics.status_patches.inc()
            deleting = obj["metadata"].get("deletionTimestamp") is not None  # as the patched object says
            if not deleting:
                self.written[key] = (uid, status)  # what the object holds now, as this replica wrote or confirmed it
            finalizers = list(obj["metadata"].get("finalizers") or [])
            if add_finalizer and not deleting and FINALIZER not in finalizers:
                informer.remember(await self.kube.set_finalizers(obj, [*finalizers, FINALIZER]))
                self._touch_object(obj)
            elif deleting and finalize and FINALIZER in finalizers:
                await self.kube.set_finalizers(obj, [f for f in finalizers if f != FINALIZER])
                if pool is not None:
                    await self.store.forget_status_record(pool, _namespace(obj), key[1])
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone or changed meanwhile: the next pass sees the new object
                log.warning("writing %s failed: %s %s", obj["metadata"]["name"], exc.status, exc.reason)

    def _touch_object(self, obj: dict[str, Any]) -> None:
        pool = _pool_of(obj)
        if pool is not None:
            self._touch(pool)

    def _record_events(self, events: list[tuple[dict[str, Any], Event]]) -> None:
        """Post Events in the background, one at a time and in the order recorded (as client-go's recorder does):
        a reconcile, and the due gates of its pool queued behind it, never wait for them."""
        previous = self._events_posted

        async def post() -> None:
            if previous is not None:
                await previous
            for obj, event in events:
                try:
                    await self.kube.event(obj, event.type, event.reason, event.message)
                except Exception as exc:  # logged; the Events after it still go out
                    log.warning("posting event %s on %s failed: %s", event.reason, obj["metadata"]["name"], exc)

        self._events_posted = asyncio.ensure_future(post())

    def _forget_probes(self, pool: str, plan: PoolPlan) -> None:
        """Drop the probe results the rollout found judged nothing (a 404 from a pod that was unloading the
        revision), unless a newer result replaced one meanwhile: the revision is probed again once its pod holds it."""
        results = self.probe_results.get(pool, {})
        for key, result in plan.discarded_probes:
            if results.get(key) == result:
                del results[key]
                log.info("probe of %s on %s discarded: %s while the pod was not holding it", key[0], key[1],
                         result.message)

    def _start_probe(self, pool: str, rev: AdapterRevision, request: ProbeRequest) -> None:
        key = (request.served_name, request.pod)
        if key in self._probing:
            return

        async def run() -> None:
            try:
                async with self._probe_slots:
                    result = await self.prober.probe(rev, request.address, request.expected_digest)
                    self.probe_results.setdefault(pool, {})[key] = result
            finally:
                self._probing.pop(key, None)
                self.queue.add(pool)

        self._probing[key] = asyncio.ensure_future(run())

    async def aclose(self) -> None:
        """Cancel probes still running; post the Events still queued."""
        for task in list(self._probing.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._events_posted is not None:
            await self._events_posted
