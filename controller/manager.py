"""The controller process: informers in, ``plan_pool`` per pool, writes out (Redis, status, Events, finalizers).

Level-triggered: every change an informer sees, every finished probe and a periodic resync wake one reconcile of
every pool, computed from scratch from the API objects (their persisted status included) and Redis. Only the Lease
holder reconciles, and it checks its lease again right before writing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from redis.exceptions import RedisError

from loraplane.api import AdapterRevision, AdapterRevisionStatus
from loraplane.controller.kube import FINALIZER, Informer, KubeApi
from loraplane.controller.leader import LeaseElector
from loraplane.controller.metrics import ControllerMetrics
from loraplane.controller.placement import PlacementConfig, TenantBudget
from loraplane.controller.pool import PoolInputs, PoolPlan, plan_pool
from loraplane.controller.probe import HealthProber
from loraplane.controller.rollout import ProbeRequest, ProbeResult
from loraplane.controller.store import RedisStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControllerConfig:
    """How the controller runs (flags of ``loraplane-controller``; placement settings from its config file)."""

    namespace: str | None = None
    resync_seconds: float = 2.0
    max_concurrent_probes: int = 8
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    budgets: dict[str, TenantBudget] = field(default_factory=dict)


def pool_members(pools: dict[Any, dict[str, Any]], pods: dict[Any, dict[str, Any]], pool: str) -> set[str] | None:
    """Names of the Pods the InferencePool ``pool`` selects; None when no such InferencePool exists."""
    spec = next((p.get("spec", {}) for (_, name), p in pools.items() if name == pool), None)
    if spec is None:
        return None
    pool_ns = next(ns for (ns, name) in pools if name == pool)
    selector = spec.get("selector") or {}
    labels = selector.get("matchLabels", selector) if isinstance(selector, dict) else {}
    return {
        name
        for (ns, name), pod in pods.items()
        if ns == pool_ns and all(pod.get("metadata", {}).get("labels", {}).get(k) == v for k, v in labels.items())
    }


class Controller:
    """Reconciles every pool while this replica holds the lease."""

    def __init__(
        self,
        kube: KubeApi,
        store: RedisStore,
        prober: HealthProber,
        elector: LeaseElector | None,
        config: ControllerConfig,
        wall_clock: Callable[[], float] = time.time,
        metrics: ControllerMetrics | None = None,
    ) -> None:
        self.kube = kube
        self.store = store
        self.prober = prober
        self.elector = elector
        self.config = config
        self.wall_clock = wall_clock
        self.metrics = metrics
        self.informers: dict[str, Informer] = {}
        self.probe_results: dict[tuple[str, str], ProbeResult] = {}
        self._probing: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._probe_slots = asyncio.Semaphore(config.max_concurrent_probes)
        self._wake = asyncio.Event()
        self._was_leader = False
        #: completed reconciles (for tests and metrics)
        self.reconciles = 0

    def wake(self) -> None:
        """Ask for a reconcile soon."""
        self._wake.set()

    def is_leader(self) -> bool:
        return self.elector is None or self.elector.is_leader()

    async def run(self, stop: asyncio.Event) -> None:
        """Watch, elect and reconcile until ``stop``."""
        self.informers = self.kube.informers(self.config.namespace, self.wake)
        for informer in self.informers.values():
            informer.start()
        elector_task = asyncio.ensure_future(self.elector.run(stop)) if self.elector else None
        try:
            # informers retry (and log) until the API server answers; nothing is reconciled from a partial view
            waits = [asyncio.ensure_future(i.synced.wait()) for i in self.informers.values()]
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait([asyncio.ensure_future(asyncio.wait(waits)), stopping],
                               return_when=asyncio.FIRST_COMPLETED)
            for w in [*waits, stopping]:
                w.cancel()
            while not stop.is_set():
                await self._sleep(stop)
                await self.reconcile_once()
        finally:
            for informer in self.informers.values():
                informer.stop()
            for task in self._probing.values():
                task.cancel()
            if elector_task is not None:
                await elector_task

    async def _sleep(self, stop: asyncio.Event) -> None:
        waits = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(stop.wait())]
        await asyncio.wait(waits, timeout=self.config.resync_seconds, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        self._wake.clear()

    async def reconcile_once(self) -> None:
        """One level-triggered pass over every pool (nothing when not leader)."""
        leader = self.is_leader()
        if self.metrics:
            self.metrics.leader.set(1 if leader else 0)
        if not leader:
            self._was_leader = False
            return
        if not self._was_leader:
            self.store.targets.clear()  # another replica may have written meanwhile: read back from Redis
            self.store.routes.clear()
            self._was_leader = True
        started = time.perf_counter()
        by_pool: dict[str, list[tuple[dict[str, Any], AdapterRevision]]] = {}
        for obj in list(self.informers["revisions"].items.values()):
            try:
                rev = AdapterRevision.model_validate(obj)
            except ValidationError as exc:
                log.warning("skipping AdapterRevision %s: %s", obj.get("metadata", {}).get("name"), exc.errors()[:1])
                continue
            by_pool.setdefault(rev.spec.pool_ref.name, []).append((obj, rev))
        live = {rev.served_name for revs in by_pool.values() for _, rev in revs}
        self.probe_results = {k: r for k, r in self.probe_results.items() if k[0] in live}
        for pool in sorted(set(by_pool) | set(self.store.routes)):
            try:
                await self.reconcile_pool(pool, by_pool.get(pool, []))
            except (RedisError, OSError) as exc:
                log.warning("pool %s: redis unavailable (%s); retrying next pass", pool, exc)
        self.reconciles += 1
        if self.metrics:
            self.metrics.reconcile_seconds.observe(time.perf_counter() - started)

    async def reconcile_pool(self, pool: str, revisions: list[tuple[dict[str, Any], AdapterRevision]]) -> PoolPlan:
        now = self.wall_clock()
        readings = await self.store.read(pool)
        members = pool_members(self.informers["pools"].items, self.informers["pods"].items, pool)
        reports = [r for r in readings.reports if not r.is_stale(now) and (members is None or r.pod in members)]
        if pool not in self.store.targets:
            await self.store.load_written(pool)
        plan = plan_pool(
            PoolInputs(
                pool=pool,
                now=datetime.fromtimestamp(now, UTC),
                revisions=[rev for _, rev in revisions],
                reports=reports,
                rates=readings.rates,
                counters=readings.counters,
                previous_targets=self.store.written_targets(pool),
                probes=self.probe_results,
                placement=self.config.placement,
                budgets=self.config.budgets,
            )
        )
        if not self.is_leader():
            return plan
        writes_before, repairs_before = self.store.writes, self.store.repairs
        await self.store.repair(pool)  # what Redis lost or someone overwrote since the last pass comes back first
        # routes first: a revision leaves the route before any pod unloads it; one only enters it once warm
        await self.store.write_routes(pool, plan.routes, plan.base_model)
        deleting = [rev.served_name for _, rev in revisions if rev.metadata.deletion_timestamp is not None]
        await self.store.write_targets(pool, plan.targets, deleting)
        if self.metrics:
            self.metrics.redis_writes.inc(self.store.writes - writes_before)
            self.metrics.redis_repairs.inc(self.store.repairs - repairs_before)
        objects = {(o["metadata"].get("namespace") or "default", o["metadata"]["name"]): o for o, _ in revisions}
        for (namespace, _), outcome in plan.adapters.items():
            for name, rp in outcome.revisions.items():
                await self._write_back(objects[(namespace, name)], rp.status, finalize=rp.finalize)
            for event in outcome.events:
                await self._post_event(objects[(namespace, event.object_name)], event.type, event.reason, event.message)
            by_served = {rev.served_name: rev for _, rev in revisions if rev.metadata.namespace == namespace}
            for request in outcome.probes:
                self._start_probe(by_served[request.served_name], request)
        return plan

    async def _write_back(self, obj: dict[str, Any], status: AdapterRevisionStatus, finalize: bool) -> None:
        """Patch the status when it changed; add our finalizer, or remove it once the revision is unloaded."""
        try:
            stored = AdapterRevisionStatus.model_validate(obj.get("status") or {})
        except ValidationError:
            stored = None
        informer = self.informers["revisions"]
        try:
            if stored != status and obj["metadata"].get("deletionTimestamp") is None:
                obj = await self.kube.patch_status(obj["metadata"]["namespace"], obj["metadata"]["name"],
                                                   status.model_dump(mode="json", by_alias=True))
                informer.remember(obj)
                if self.metrics:
                    self.metrics.status_patches.inc()
            finalizers = list(obj["metadata"].get("finalizers") or [])
            deleting = obj["metadata"].get("deletionTimestamp") is not None
            if not deleting and FINALIZER not in finalizers:
                informer.remember(await self.kube.set_finalizers(obj, [*finalizers, FINALIZER]))
            elif deleting and finalize and FINALIZER in finalizers:
                await self.kube.set_finalizers(obj, [f for f in finalizers if f != FINALIZER])
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone or changed meanwhile: the next pass sees the new object
                log.warning("writing %s failed: %s %s", obj["metadata"]["name"], exc.status, exc.reason)

    async def _post_event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        try:
            await self.kube.event(obj, type_, reason, message)
        except ApiException as exc:
            log.warning("posting event %s on %s failed: %s", reason, obj["metadata"]["name"], exc.status)

    def _start_probe(self, rev: AdapterRevision, request: ProbeRequest) -> None:
        key = (request.served_name, request.pod)
        if key in self._probing:
            return

        async def run() -> None:
            try:
                async with self._probe_slots:
                    self.probe_results[key] = await self.prober.probe(rev, request.address, request.expected_digest)
            finally:
                self._probing.pop(key, None)
                self.wake()

        self._probing[key] = asyncio.ensure_future(run())

    async def aclose(self) -> None:
        """Cancel probes still running."""
        for task in list(self._probing.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
