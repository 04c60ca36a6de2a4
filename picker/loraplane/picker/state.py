"""The picker's view of the pool, kept from Redis without ever blocking a request on it.

``PoolState`` holds the current ``PoolSnapshot`` and ``RouteResolver``; requests read them as plain attributes.
``RedisSync`` fills it: a full load at start, then the sidecars' and controller's change notices (pub/sub), a full
resync every few seconds to cover missed notices, and a rebuild whenever a report passes its TTL. Reports age by
the picker's own receive time. When Redis is unreachable, or answers without a pod's report, the last reports stay
in use and age into "stale" on schedule; the pool keeps its members.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from loraplane.api import ResidencyReport, RouteTable, keys, read_payload_or_none, validation
from loraplane.api.routedeltas import read_route_table
from loraplane.api.routing import supersedes
from loraplane.api.runtime import MAX_REPORT_TTL_S
from loraplane.picker.body import ClientError
from loraplane.picker.prefix import PreciseIndex
from loraplane.picker.routes import Resolution, RouteResolver
from loraplane.picker.snapshot import EndpointState, InFlightTracker, PoolSnapshot, member_state
from loraplane.picker.telemetry import PickerMetrics, RequestStats
from loraplane.waits import sleep_or_stop

log = logging.getLogger(__name__)


class NotLoadedResolver(RouteResolver):
    """The resolver before the first full load from Redis: it does not know which models exist, so every request
    gets 503 ``not-ready`` (retryable), never the 404 of an unknown model (a restarted picker would otherwise refuse
    every model until it has read the route table)."""

    def __init__(self) -> None:
        super().__init__(None)

    def resolve(self, model: str, session_key: str | None, rng: np.random.Generator) -> Resolution:
        """Always ``ClientError(503)``."""
        raise ClientError(503, "the picker has not read the pool's route table yet", "not-ready")

    def served(self, served_name: str) -> Resolution | None:
        """Always ``ClientError(503)`` (a model-name rewrite header's revision is not known yet either)."""
        raise ClientError(503, "the picker has not read the pool's route table yet", "not-ready")


#: How long a member whose reports stopped stays in the pool (``--forget-seconds``), once another member is fresh.
FORGET_S = 300.0


class PoolState:
    """Current snapshot + resolver, rebuilt from the latest reports and route table.

    Reports are aged by the time this picker received them, on its own clock (``clock``), never by the sidecar's
    ``heartbeat_at``; their TTL counts up to ``max_ttl_s``. A report is fresh for its TTL, then last heard for
    ``stale_grace_s`` (routed to as heard), then stale but kept: its pod stays a member, and the revisions its last
    report held stay a fallback where no fresh pod holds them. Whether Redis is unreachable or answers without the
    pod's report (expired: the sidecar stalled, crashed or could not write), the pool keeps its members. A member
    leaves (without ``endpoints`` from discovery) only ``forget_s`` after its last report, and only while another
    member is fresh: a pool whose reports all stopped is a bus or sidecar fault, not every pod gone.
    """

    def __init__(
        self,
        pool: str,
        tracker: InFlightTracker,
        clock: Callable[[], float],
        endpoints: Sequence[tuple[str, str]] | None = None,
        metrics: PickerMetrics | None = None,
        stale_grace_s: float = 0.0,
        max_ttl_s: float = MAX_REPORT_TTL_S,
        forget_s: float = FORGET_S,
    ) -> None:
        """``endpoints`` ((pod, address) pairs) fixes membership; without it the reporting pods are the pool.
        ``stale_grace_s``: how long past its TTL a report still counts as last heard (``PoolSnapshot.from_reports``)."""
        self.pool = pool
        self.stale_grace_s = stale_grace_s
        self.max_ttl_s = max_ttl_s
        self.forget_s = forget_s
        self.tracker = tracker
        self.clock = clock
        self.endpoints = endpoints
        self.metrics = metrics
        self.reports: dict[str, ResidencyReport] = {}
        #: pod -> when this picker received its report (``clock``)
        self.received: dict[str, float] = {}
        self.resolver: RouteResolver = NotLoadedResolver()
        self.snapshot = PoolSnapshot([])
        self.synced = False
        self.next_expiry = float("inf")
        #: the pods whose report was stored since the snapshot was last built or updated
        self.changed: set[str] = set()
        #: what the snapshot was built from (routes and endpoints: a change needs a full rebuild), pod -> its index
        self._built_from: tuple[RouteResolver, Sequence[tuple[str, str]] | None] = (self.resolver, endpoints)
        self._index_of: dict[str, int] = {}
        #: a heap of (time, pod, receive time, TTL) at which a report changes state; ``next_expiry`` its earliest
        self._edges: list[tuple[float, str, float, float]] = []
        #: silent members kept because no member is fresh: the next fresh report lets them be forgotten
        self._holding_back = False
        #: pod -> the state it counts in (``loraplane_picker_endpoints``), and how many endpoints each state holds
        self._state_of: dict[str, str] = {}
        self._state_counts: collections.Counter[str] = collections.Counter()
        tracker.attach(self.snapshot)

    def set_routes(self, table: RouteTable | None) -> None:
        """Use a new route table (None: nothing is routable)."""
        self.resolver = RouteResolver(table)

    def update_routes(self, table: RouteTable) -> None:
        """Use a later generation of the route table, indexing only the names that changed (``RouteResolver.updated``):
        the new resolver is built aside and swapped in whole."""
        current = self.resolver
        self.resolver = current.updated(table) if type(current) is RouteResolver else RouteResolver(table)

    def set_endpoints(self, endpoints: Sequence[tuple[str, str]] | None) -> None:
        """Fix pool membership to these (pod, address) pairs (None: the reporting pods) and rebuild."""
        self.endpoints = endpoints
        self.rebuild()

    def set_report(self, report: ResidencyReport) -> None:
        """Store a pod's latest report; a new one (another heartbeat) is received now, the one already held (read
        again by a resync) keeps its receive time."""
        old = self.reports.get(report.pod)
        if old is None or old.heartbeat_at != report.heartbeat_at or report.pod not in self.received:
            self.received[report.pod] = self.clock()
            if report.ttl_seconds > self.max_ttl_s and self.metrics is not None:
                self.metrics.reports_ttl_capped.inc()
        self.reports[report.pod] = report
        self.changed.add(report.pod)

    def ttl(self, report: ResidencyReport) -> float:
        """The TTL ``report`` counts with: its own, up to ``max_ttl_s``."""
        return min(report.ttl_seconds, self.max_ttl_s)

    def age(self, pod: str, now: float | None = None) -> float:
        """Seconds since this picker received ``pod``'s report (inf: none)."""
        received = self.received.get(pod)
        return float("inf") if received is None else (self.clock() if now is None else now) - received

    def _forget(self, now: float) -> bool:
        """Drop the reports of members silent for ``forget_s`` while another member is fresh; True if any went."""
        silent = [pod for pod in self.reports if self.age(pod, now) > self.forget_s]
        self._holding_back = False
        if not silent:
            return False
        if not any(self.age(pod, now) <= self.ttl(r) for pod, r in self.reports.items()):
            self._holding_back = True
            return False  # every report stopped: Redis or the sidecars, not every pod gone; keep them all
        for pod in silent:
            log.warning("forgetting pod %s: no report for %.0f s while others report", pod, self.age(pod, now))
            del self.reports[pod]
            self.received.pop(pod, None)
        return True

    def rebuild(self) -> None:
        """Build a fresh snapshot from what is stored now."""
        now = self.clock()
        self._forget(now)
        resolver = self.resolver
        snapshot = PoolSnapshot.from_reports(self.reports.values(), now, resolver.priorities(), self.endpoints,
                                             self.stale_grace_s, resolver.staging_pods(), self.received,
                                             self.max_ttl_s)
        self.tracker.attach(snapshot)
        self.snapshot = snapshot
        self.changed.clear()
        self._built_from = (resolver, self.endpoints)
        self._index_of = {endpoint.name: i for i, endpoint in enumerate(snapshot.endpoints)}
        self._edges = []
        for pod in self.reports:
            self._push_edges(pod, now)
        heapq.heapify(self._edges)
        self._next_edge()
        self._state_of = {endpoint.name: self._endpoint_state(endpoint, now) for endpoint in snapshot.endpoints}
        self._state_counts = collections.Counter(self._state_of.values())
        if self.metrics is not None:
            self.metrics.snapshot_rebuilds.inc()
        self._set_gauges()

    def refresh(self) -> None:
        """Bring the snapshot up to date with the reports stored since it was built: in place, re-indexing only the
        pods whose report changed (``PoolSnapshot.update_endpoints``), when nothing else did (the same route
        priorities and staging pods, endpoints and members at the same addresses, no report past a state edge, no
        member to forget); otherwise a full ``rebuild``. Either way the snapshot equals one built from scratch; in
        place, a report notice or a route change costs what it changed, not the pool's size times its residency."""
        now = self.clock()
        updates = self._in_place_updates(now)
        if updates is None:
            self.rebuild()
            return
        self.snapshot.update_endpoints(updates)
        self.changed.clear()
        for _, endpoint in updates:
            self._push_edges(endpoint.name, now, heap=True)
            state = self._endpoint_state(endpoint, now)
            self._state_counts[self._state_of[endpoint.name]] -= 1
            self._state_counts[state] += 1
            self._state_of[endpoint.name] = state
        self._next_edge()
        if self.metrics is not None:
            self.metrics.snapshot_updates.inc()
        self._set_gauges()

    def _in_place_updates(self, now: float) -> list[tuple[int, EndpointState]] | None:
        """The (index, state) updates that bring the snapshot to ``now``, or None where only a rebuild can. Takes
        routes whose priorities and staging pods are the snapshot's as its own, and forgets silent members where a
        fresh report now allows it (``_forget``)."""
        built_resolver, built_endpoints = self._built_from
        if self.endpoints != built_endpoints:
            return None
        if self.resolver is not built_resolver:
            # the snapshot reads only the routes' priorities (gold protection) and staging pods
            if (self.resolver.priorities() != built_resolver.priorities()
                    or self.resolver.staging_pods() != built_resolver.staging_pods()):
                return None
            self._built_from = (self.resolver, built_endpoints)
        if now > self.next_expiry or (self._holding_back and self._forget(now)):
            return None
        addresses = self.snapshot.addresses
        updates = []
        for pod in self.changed:
            index = self._index_of.get(pod)
            report = self.reports.get(pod)
            if index is None or report is None:
                return None  # a new member (or one forgotten): the pool's membership changed
            address = addresses[index] if self.endpoints is not None else report.address
            if address != addresses[index]:
                return None
            updates.append((index, member_state(pod, address, report, now, self.received, self.stale_grace_s,
                                                self.max_ttl_s)))
        return updates

    def _push_edges(self, pod: str, now: float, heap: bool = False) -> None:
        """Queue the times ``pod``'s report changes state (fresh -> last heard -> stale -> forgotten), each with
        what it was computed from (a later report's entries supersede it)."""
        received, ttl = self.received[pod], self.ttl(self.reports[pod])
        for t in (received + ttl, received + ttl + self.stale_grace_s, received + self.forget_s):
            if t >= now:
                entry = (t, pod, received, ttl)
                heapq.heappush(self._edges, entry) if heap else self._edges.append(entry)

    def _next_edge(self) -> None:
        """Set ``next_expiry`` to the earliest queued state change still current (entries of replaced reports go)."""
        edges = self._edges
        while edges:
            _, pod, received, ttl = edges[0]
            report = self.reports.get(pod)
            if report is not None and self.received.get(pod) == received and self.ttl(report) == ttl:
                break
            heapq.heappop(edges)
        self.next_expiry = edges[0][0] if edges else math.inf

    def _endpoint_state(self, endpoint: EndpointState, now: float) -> str:
        """The ``loraplane_picker_endpoints`` state an endpoint counts in."""
        heard = self.reports.get(endpoint.name)
        if endpoint.stale or heard is None:
            return "stale"
        if not endpoint.ready:
            return "not-ready"
        if self.age(endpoint.name, now) > self.ttl(heard):
            return "in-grace"  # routed to as last heard, but not heard from: not fresh
        return "fresh"

    def _set_gauges(self) -> None:
        if self.metrics is not None:
            for name in ("fresh", "in-grace", "stale", "not-ready"):
                self.metrics.endpoints.labels(name).set(self._state_counts[name])

    def rebuild_if_expired(self) -> bool:
        """Rebuild when a report has changed state (past its TTL, its grace, ...) since the last build."""
        if self.clock() > self.next_expiry:
            self.rebuild()
            return True
        return False


def _parse_report(raw: bytes | str | None, pool: str) -> ResidencyReport | None:
    report = read_payload_or_none(ResidencyReport, raw, log)
    if report is not None and report.pool != pool:
        log.warning("ignoring a residency report for pool %s", report.pool)
        return None
    return report


class RedisSync:
    """Keeps a ``PoolState`` current from Redis and publishes the picker's rates and counters."""

    def __init__(
        self,
        state: PoolState,
        client: aioredis.Redis,
        stats: RequestStats,
        replica: str,
        resync_seconds: float = 5.0,
        publish_seconds: float = 10.0,
        block_sets: PreciseIndex | None = None,
    ) -> None:
        """Sync ``state`` from ``client``; publish ``stats`` as ``replica``; with ``block_sets`` (the precise
        prefix scorer's index) also the pods' published ``KvBlockSet``s."""
        self.state = state
        self.client = client
        self.stats = stats
        self.replica = replica
        self.resync_seconds = resync_seconds
        self.publish_seconds = publish_seconds
        pool = state.pool
        self.block_sets = block_sets
        self._channels = (keys.residency_changed_channel(pool), keys.routes_changed_channel(pool))
        self._blocks_channel = keys.kv_blocks_changed_channel(pool) if block_sets is not None else None

    async def load_all(self) -> None:
        """Read the route table and every report (one round trip each) and rebuild."""
        pool = self.state.pool
        await self._load_routes()
        if isinstance(self.state.resolver, NotLoadedResolver):  # Redis holds no table: nothing is routable yet
            self.state.set_routes(None)
        pods = sorted(p.decode() if isinstance(p, bytes) else p for p in await self.client.smembers(keys.residency_index(pool)))
        valid = [p for p in pods if validation.is_pod_name(p)]
        raws = await self.client.mget([keys.residency_report(pool, p) for p in valid]) if valid else []
        # a pod missing from Redis (emptied by a restart, its key expired: its sidecar stalled or cannot write) keeps
        # its last report, aged on this picker's clock: stale in time, never dropped for Redis's silence alone
        for report in (_parse_report(raw, pool) for raw in raws):
            if report is not None:
                self.state.set_report(report)
        self.state.rebuild()
        if self.block_sets is not None:
            await self.block_sets.refresh(self.client, pool, valid)
        self.state.synced = True

    async def _load_reports(self, pods: set[str]) -> None:
        """Read the reports of ``pods`` (those named in the notices of one drain) in one round trip."""
        valid = sorted(p for p in pods if validation.is_pod_name(p))
        if not valid:
            return
        pool = self.state.pool
        for raw in await self.client.mget([keys.residency_report(pool, p) for p in valid]):
            report = _parse_report(raw, pool)
            if report is not None:
                self.state.set_report(report)

    async def _load_blocks(self, pod: str) -> None:
        if self.block_sets is not None and validation.is_pod_name(pod):
            await self.block_sets.refresh(self.client, self.state.pool, [pod])

    async def _load_routes(self) -> None:
        """Catch up with the route table: the deltas after the generation in use when they chain onto it, else the
        snapshot and the deltas after it (``routedeltas.read_route_table``); applied whole or not at all."""
        current = self.state.resolver.table
        table = await read_route_table(self.client, self.state.pool, current)
        if table is None or table is current:
            return
        if not supersedes(table, current):
            log.warning("ignoring route table generation %d of %s: older than the one in use", table.generation,
                        table.writer)
            return
        self.state.update_routes(table)

    async def run(self, stop: asyncio.Event) -> None:
        """Follow change notices until ``stop`` is set; survive Redis outages on the last snapshot.

        The loops test ``stop`` rather than relying on cancellation alone: redis-py's read timeout can swallow a
        ``CancelledError`` that lands as it fires, and a loop that only ends when cancelled would then run on.
        """
        backoff = 0.2
        while not stop.is_set():
            try:
                await self._follow(stop)
            except (RedisError, OSError) as exc:
                self._count_error()
                log.warning("redis unavailable (%s); routing on the last snapshot", exc)
                await sleep_or_stop(stop, backoff)
                backoff = min(backoff * 2, 5.0)
            else:
                backoff = 0.2

    async def _follow(self, stop: asyncio.Event) -> None:
        pubsub = self.client.pubsub()
        try:
            await pubsub.subscribe(*self._channels, *([self._blocks_channel] if self._blocks_channel else []))
            await self.load_all()
            loop = asyncio.get_running_loop()
            next_resync = loop.time() + self.resync_seconds
            while not stop.is_set():
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.25)
                reported: set[str] = set()
                routes_changed = False
                while message is not None:  # drain what is queued: one read of the reports it names
                    channel = message["channel"].decode() if isinstance(message["channel"], bytes) else message["channel"]
                    data = message["data"].decode(errors="replace") if isinstance(message["data"], bytes) else str(message["data"])
                    if channel == self._blocks_channel:
                        await self._load_blocks(data)  # no snapshot rebuild: the index is read per request
                    elif channel == self._channels[0]:
                        reported.add(data)
                    else:
                        routes_changed = True
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0)
                await self._load_reports(reported)
                if routes_changed:
                    await self._load_routes()
                if loop.time() >= next_resync:
                    await self.load_all()
                    next_resync = loop.time() + self.resync_seconds
                elif routes_changed or reported:
                    self.state.refresh()
                else:
                    self.state.rebuild_if_expired()
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()

    async def expire_stale(self) -> None:
        """Turn reports stale on time even while Redis is down (the follow loop does it while Redis is up)."""
        while True:
            await asyncio.sleep(0.25)
            self.state.rebuild_if_expired()

    async def publish_once(self) -> None:
        """Write this replica's ``RequestRates`` and ``PickerCounters``, each under its own key: the controller sums
        the replicas' rates (with one shared key the last writer won, and two replicas published half the traffic).
        Rates live three periods (a replica that stopped leaves the sum soon, so a replacement under another name is
        not counted twice for long), the cumulative counters six (at least a minute)."""
        pool, replica = self.state.pool, self.replica
        rates_ttl = max(10, math.ceil(self.publish_seconds * 3))
        ttl = max(60, int(self.publish_seconds * 6))
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.set(keys.request_rates(pool, replica), self.stats.rates(pool, replica).to_json(), ex=rates_ttl)
            pipe.set(keys.picker_counters(pool, replica), self.stats.picker_counters(pool, replica).to_json(), ex=ttl)
            await pipe.execute()

    async def publish_forever(self) -> None:
        """Publish every ``publish_seconds``; errors are counted and retried next time."""
        while True:
            await asyncio.sleep(self.publish_seconds)
            try:
                await self.publish_once()
            except (RedisError, OSError) as exc:
                self._count_error()
                log.warning("could not publish rates/counters: %s", exc)

    def _count_error(self) -> None:
        if self.state.metrics is not None:
            self.state.metrics.redis_errors.inc()

