"""The sidecar's main loop: target -> observe -> reconcile -> report, every heartbeat and on every change."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from loraplane.api import (
    AdapterResidency,
    PodLoad,
    ResidencyReport,
    ResidencySource,
    TargetState,
    Tier,
)
from loraplane.api.routing import supersedes
from loraplane.sidecar.bus import InvalidTarget, RedisBus, RedisUnavailable
from loraplane.sidecar.drivers.base import Observation, RuntimeInfo, RuntimeUnavailable
from loraplane.sidecar.kv_events import KvBlockTracker, subscribe
from loraplane.sidecar.metrics import AdapterSample
from loraplane.sidecar.reconcile import Reconciler

log = logging.getLogger(__name__)

_EVICTION_WINDOW_S = 60.0


@dataclass(frozen=True)
class SidecarConfig:
    """Identity and timing of one sidecar."""

    pool: str
    pod: str
    address: str
    runtime: str
    heartbeat_s: float = 1.0
    report_ttl_s: float = 5.0
    #: vLLM's KV-events publisher (``--kv-events-config`` endpoint); None: no prefix-cache block set
    kv_events_endpoint: str | None = None
    kv_events_max_blocks: int = 16_384


class Sidecar:
    """Drives one runtime into its target state and reports what it holds."""

    def __init__(
        self,
        config: SidecarConfig,
        reconciler: Reconciler,
        bus: RedisBus,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.reconciler = reconciler
        self.driver = reconciler.driver
        self.metrics = reconciler.metrics
        self.bus = bus
        self._wall_clock = wall_clock
        self._clock = clock
        self.target: TargetState | None = None
        self.target_error: str | None = None
        self.observation: Observation | None = None
        self.ready = False
        self.last_report: ResidencyReport | None = None
        self._wake = asyncio.Event()
        self._evictions: collections.deque[float] = collections.deque()
        self.kv_blocks = (KvBlockTracker(config.pool, config.pod, config.kv_events_max_blocks, config.report_ttl_s,
                                         wall_clock) if config.kv_events_endpoint else None)

    def wake(self) -> None:
        """Run a pass now (a change notice arrived, an action ended)."""
        self._wake.set()

    async def _refresh_target(self) -> None:
        try:
            target = await self.bus.read_target()
        except RedisUnavailable:
            return
        except InvalidTarget as exc:
            if self.target_error != str(exc):
                log.error("%s; keeping the last good target", exc)
            self.target_error = str(exc)
            return
        self.target_error = None
        if target is not None and not supersedes(target, self.target):
            log.warning("ignoring target generation %d of %s: older than the one applied", target.generation,
                        target.writer)
        elif target is not None:
            self.target = target
            self.reconciler.keep(target)

    async def _observe(self) -> Observation | None:
        try:
            observation = await self.driver.observe()
        except Exception as exc:  # unreachable, or an answer this sidecar cannot read: not ready either way
            if self.ready or not isinstance(exc, RuntimeUnavailable):
                log.warning("runtime not usable, reporting not ready: %r", exc)
            self.ready = False
            return None
        previous = self.observation
        if previous is not None:
            self._detect_restart(previous, observation)
            now = self._clock()
            self._evictions.extend(now for _ in self.reconciler.note_evictions(previous, observation))
        self.ready = True
        self.observation = observation
        return observation

    def _detect_restart(self, previous: Observation, current: Observation) -> None:
        old, new = previous.info.instance, current.info.instance
        ours = set(self.reconciler.loaded)
        restarted = (old is not None and new is not None and old != new) or (
            bool(ours) and not self.ready and not ours & set(current.adapters)
        )
        if restarted:
            log.warning("runtime restarted (instance %s -> %s): re-applying the target", old, new)
            self.metrics.runtime_restarts.inc()
            self.reconciler.reset()

    async def run_once(self) -> ResidencyReport:
        """One pass: read the target, observe the runtime, start actions, publish the report."""
        await self._refresh_target()
        observation = await self._observe()
        if observation is not None and self.target is not None:
            self.reconciler.step(self.target, observation)
        if self.target is not None:
            self.reconciler.cache.evict_unused({t.cache_key for t in self.target.adapters})
            if observation is not None and self.target.retired:
                held = {n for n, a in observation.adapters.items() if a.tier is not Tier.ABSENT}
                self.reconciler.cache.release(self.target.retired, held | set(self.target.by_name()) | self.reconciler.busy())
        report = self.build_report()
        self._export(report)
        try:
            await self.bus.publish(report)
            self.metrics.reports.inc()
        except RedisUnavailable:
            pass  # a draining row not published starts no grace: nothing leaves until routers could know
        else:
            self.reconciler.announced({a.served_name for a in report.adapters if a.draining})
        await self._publish_blocks(report)
        self.metrics.redis_connected.set(1 if self.bus.connected else 0)
        self.last_report = report
        return report

    async def _publish_blocks(self, report: ResidencyReport) -> None:
        """Publish the prefix-cache block set, keyed by the digests this report vouches for."""
        if self.kv_blocks is None:
            return
        self.kv_blocks.set_digests({a.served_name: a.digest for a in report.adapters})
        with contextlib.suppress(RedisUnavailable):
            await self.bus.publish_blocks(self.kv_blocks.block_set())

    def _recent_evictions(self) -> int:
        horizon = self._clock() - _EVICTION_WINDOW_S
        while self._evictions and self._evictions[0] < horizon:
            self._evictions.popleft()
        return len(self._evictions)

    def build_report(self) -> ResidencyReport:
        """This pod's ResidencyReport from the last observation, the cache and the per-adapter statuses."""
        observation = self.observation
        target = self.target.by_name() if self.target else {}
        held_all = observation.adapters if observation else {}
        entries = self.reconciler.cache.entries()
        adapters = []
        for name in sorted(set(target) | set(held_all)):
            t, held = target.get(name), held_all.get(name)
            entry = entries.get(t.cache_key) if t else None
            status = self.reconciler.status.get(name)
            row = AdapterResidency(served_name=name, tier=Tier.ABSENT, registered=False)
            if held is not None and held.tier is not Tier.ABSENT:
                artifact_digest, content_digest = self.reconciler.verified_digests(name, held) or (None, None)
                row = AdapterResidency(
                    served_name=name, tier=held.tier, digest=artifact_digest, adapter_digest=content_digest,
                    bytes=held.bytes or (entry.bytes if entry else 0), pinned=held.pinned, in_flight=held.in_flight,
                    hits=held.hits, loads=held.loads, evictions=held.evictions, last_access=held.last_access,
                    registered=True, draining=name in self.reconciler.draining,
                )
            elif entry is not None:
                row = AdapterResidency(served_name=name, tier=Tier.DISK, digest=entry.artifact_digest,
                                       adapter_digest=entry.adapter_digest, bytes=entry.bytes, registered=False)
            if status is not None and status.error is not None:
                row.error, row.error_reason = status.error, status.reason
            adapters.append(row)
        info = observation.info if observation else RuntimeInfo(base_model="")
        load = observation.load if observation else PodLoad()
        load = load.model_copy(update={"recent_evictions": self._recent_evictions(),
                                       "load_seconds": load.load_seconds or self.reconciler.load_costs.costs(),
                                       "max_disk_bytes": self.reconciler.cache.budget_bytes})
        return ResidencyReport(
            pool=self.config.pool,
            pod=self.config.pod,
            address=self.config.address,
            ready=self.ready,
            runtime=self.config.runtime,
            residency_inferred=self.driver.residency_source is ResidencySource.LRU_MODEL,
            residency_source=self.driver.residency_source,
            demotes_to_disk=self.driver.capabilities.serves_disk_tier,
            loads_activate=self.driver.capabilities.load_activates,
            base_model_digest=info.base_model_digest,
            max_lora_rank=info.max_lora_rank,
            target_generation=self.target.generation if self.target else None,
            heartbeat_at=self._wall_clock(),
            ttl_seconds=self.config.report_ttl_s,
            adapters=adapters,
            load=load,
        )

    def _export(self, report: ResidencyReport) -> None:
        target = self.target.by_name() if self.target else {}
        self.metrics.adapters = [
            AdapterSample(a.served_name, target[a.served_name].tenant if a.served_name in target else "unknown",
                          a.tier, a.pinned, a.hits, a.in_flight, a.bytes)
            for a in report.adapters
        ]
        counts = collections.Counter(a.tier for a in report.adapters)
        for tier in (Tier.GPU, Tier.CPU, Tier.DISK):
            self.metrics.resident.labels(tier.value).set(counts.get(tier, 0))
        self.metrics.runtime_ready.set(1 if report.ready else 0)

    async def run(self, stop: asyncio.Event) -> None:
        """Pass after pass until ``stop`` is set: every heartbeat, on change notices and when actions end."""
        watcher = asyncio.create_task(self.bus.watch_targets(self.wake, stop))
        events = (asyncio.create_task(subscribe(self.config.kv_events_endpoint, self.kv_blocks, stop))
                  if self.kv_blocks is not None and self.config.kv_events_endpoint else None)
        changed = self.reconciler.changed
        try:
            while not stop.is_set():
                self._wake.clear()
                changed.clear()
                await self.run_once()
                waits = [asyncio.create_task(e.wait()) for e in (self._wake, changed, stop)]
                drain_wait = self.reconciler.drain_wait()  # unload as soon as a drain grace ends
                timeout = self.config.heartbeat_s if drain_wait is None else min(self.config.heartbeat_s, drain_wait)
                try:
                    await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
        finally:
            for task in (watcher, events):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await self.reconciler.cancel()
