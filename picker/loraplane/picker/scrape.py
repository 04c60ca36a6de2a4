"""The scrape data source (``loraplane-picker --data-source scrape``): the pool as the peers' pickers see it.

What llm-d-router's ``metrics-data-source`` + ``core-metrics-extractor`` do, for the picker: every endpoint's
``/metrics`` is fetched every ``--scrape-interval`` (llm-d's ``--refresh-metrics-interval``, default 50 ms) over one
keep-alive aiohttp session, parsed (``loraplane.api.vllm_metrics.read_metrics``: the queue, running and KV series,
the newest ``vllm:lora_requests_info`` and the residency gauges of vLLM PR #54830) and written into the snapshot in
place (``PoolSnapshot.update_endpoint``). A scrape older than ``--metrics-staleness-threshold`` (llm-d: 2 s) makes
its endpoint stale; its last figures stay (as llm-d keeps them) and a pod that has not answered yet is stale with
none. The scrapes run as tasks on the picker's event loop, one per endpoint: a decision never waits for one.

No Redis: model names are routed as given (``PassthroughResolver``). A peer's users register their adapters on the
pods under their own names and the picker does not resolve them: every pod counts as serving every name
(``EndpointState.loads_on_demand``, as llm-d-router assumes: vLLM registers the adapters at start-up or resolves
them), and a name no pod serves gets vLLM's 404. A name the pods report as their base model (the ``model_name``
label of their metrics, or ``--base-model``) is a base-model request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import aiohttp
import numpy as np
from prometheus_client import CollectorRegistry, Counter

from loraplane.api.vllm_metrics import VllmMetrics, read_metrics
from loraplane.picker.routes import Resolution, RouteResolver
from loraplane.picker.snapshot import EndpointState, InFlightTracker, PoolSnapshot
from loraplane.picker.telemetry import PickerMetrics
from loraplane.waits import sleep_or_stop

log = logging.getLogger(__name__)

#: llm-d-router's defaults: ``--refresh-metrics-interval`` and ``--metrics-staleness-threshold``
SCRAPE_INTERVAL_S = 0.05
STALENESS_THRESHOLD_S = 2.0
#: how long one scrape may take before it counts as failed
SCRAPE_TIMEOUT_S = 1.0
#: how often membership and staleness are checked
_HOUSEKEEPING_S = 0.05


class PassthroughResolver(RouteResolver):
    """Routes every model name as given: the pods' base model(s) as base-model requests, any other name as the
    adapter the pods serve under it (no digest, tenant ``default``, priority 0)."""

    def __init__(self, base_models: Callable[[], frozenset[str]]) -> None:
        """``base_models``: the names that are base-model requests (read at each request)."""
        super().__init__(None)
        self._base_models = base_models

    def resolve(self, model: str, session_key: str | None, rng: np.random.Generator) -> Resolution:
        """``model`` unchanged."""
        return self.served(model)

    def served(self, served_name: str) -> Resolution:
        """Any name is served as given: a model-name rewrite header's too (there are no routes to beat it)."""
        if served_name in self._base_models():
            return Resolution(served_name, None, None, None, "default", 0)
        return Resolution(served_name, served_name, None, None, "default", 0)


@dataclass
class _Scraped:
    """One endpoint's last good scrape."""

    address: str
    metrics: VllmMetrics | None = None
    #: when it was taken (the pool's clock); -inf: never
    at: float = -math.inf


class ScrapedPool:
    """The pool's snapshot and resolver from scraped vLLM metrics; the same attributes requests read as ``PoolState``
    (``snapshot``, ``resolver``, ``synced``, ``set_endpoints``)."""

    def __init__(self, tracker: InFlightTracker, clock: Callable[[], float],
                 endpoints: Sequence[tuple[str, str]] | None = None, metrics: PickerMetrics | None = None,
                 staleness_s: float = STALENESS_THRESHOLD_S, base_models: Iterable[str] = ()) -> None:
        """``endpoints``: (pod, address) pairs (None: none until ``set_endpoints``, from discovery); ``clock``: the
        clock scrapes are stamped and aged with; ``base_models``: names routed as the base model besides those the
        pods report."""
        self.tracker = tracker
        self.clock = clock
        self.metrics = metrics
        self.staleness_s = staleness_s
        self.configured_base_models = frozenset(base_models)
        self.resolver: RouteResolver = PassthroughResolver(self.base_models)
        self.snapshot = PoolSnapshot([])
        tracker.attach(self.snapshot)
        self._scraped: dict[str, _Scraped] = {}
        self._members: list[tuple[str, str]] = []
        self._base_models = self.configured_base_models
        #: pods scraped (or failed) at least once since they joined; synced once every member has been tried
        self._tried: set[str] = set()
        self.synced = False
        self.set_endpoints(endpoints or [])

    def base_models(self) -> frozenset[str]:
        """The names routed as base-model requests."""
        return self._base_models

    @property
    def members(self) -> list[tuple[str, str]]:
        """The (pod, address) pairs scraped."""
        return list(self._members)

    def set_endpoints(self, endpoints: Sequence[tuple[str, str]] | None) -> None:
        """The pool's members (discovery calls this on every change); a pod keeps its last scrape while its address
        stays the same."""
        members = list(endpoints or [])
        self._members = members
        scraped = {}
        for pod, address in members:
            known = self._scraped.get(pod)
            scraped[pod] = known if known is not None and known.address == address else _Scraped(address)
        self._scraped = scraped
        self._tried &= set(scraped)
        self._rebuild()

    def _rebuild(self) -> None:
        now = self.clock()
        snapshot = PoolSnapshot([self._state(pod, s, now) for pod, s in self._scraped.items()])
        self.tracker.attach(snapshot)
        self.snapshot = snapshot
        self._refresh_base_models()
        self._check_synced()
        if self.metrics is not None:
            self.metrics.snapshot_rebuilds.inc()
        self._count_states()

    def _state(self, pod: str, scraped: _Scraped, now: float) -> EndpointState:
        m = scraped.metrics
        stale = now - scraped.at > self.staleness_s
        if m is None:
            return EndpointState(name=pod, address=scraped.address, stale=True, loads_on_demand=True)
        return EndpointState(
            name=pod, address=scraped.address, stale=stale, received_at=scraped.at, queue_depth=m.waiting,
            running=m.running,
            kv_utilization=m.kv_usage, gpu_slots=m.max_gpu_adapters, running_adapters=m.running_adapters,
            waiting_adapters=m.waiting_adapters, loaded_adapters=m.loaded, gpu_loaded=m.gpu_loaded,
            loads_on_demand=True,
        )

    def record(self, pod: str, address: str, metrics: VllmMetrics) -> None:
        """A good scrape of ``pod`` at ``address`` (ignored when the pod left or moved meanwhile). Without a
        ``lora_requests_info`` series the last adapter lists are kept (llm-d-router #1467)."""
        scraped = self._scraped.get(pod)
        if scraped is None or scraped.address != address:
            return
        previous = scraped.metrics
        if not metrics.has_lora_info and previous is not None and previous.has_lora_info:
            metrics = VllmMetrics(metrics.waiting, metrics.running, metrics.kv_usage, previous.running_adapters,
                                  previous.waiting_adapters, metrics.max_gpu_adapters or previous.max_gpu_adapters,
                                  metrics.loaded, metrics.gpu_loaded, metrics.model_names, True)
        scraped.metrics, scraped.at = metrics, self.clock()
        if previous is None or previous.model_names != metrics.model_names:
            self._refresh_base_models()
        self._tried.add(pod)
        self._update(pod, scraped)
        self._check_synced()

    def failed(self, pod: str, address: str, reason: str) -> None:
        """A scrape of ``pod`` failed (its last figures stay until they turn stale)."""
        if pod in self._scraped and pod not in self._tried:
            log.info("scrape of %s (%s) failed: %s", pod, address, reason)
        self._tried.add(pod)
        self._check_synced()

    def expire(self) -> None:
        """Mark endpoints whose last scrape passed the staleness threshold stale (and fresh ones fresh)."""
        now, snapshot = self.clock(), self.snapshot
        updates = []
        for pod, scraped in self._scraped.items():
            stale = now - scraped.at > self.staleness_s
            index = snapshot.index_by_address.get(scraped.address)
            if index is not None and snapshot.endpoints[index].stale != stale:
                updates.append((index, self._state(pod, scraped, now)))
        if updates:
            snapshot.update_endpoints(updates)
            self._count_states()

    def _update(self, pod: str, scraped: _Scraped) -> None:
        snapshot = self.snapshot
        index = snapshot.index_by_address.get(scraped.address)
        if index is None or snapshot.endpoints[index].name != pod:
            self._rebuild()
            return
        was_stale = snapshot.endpoints[index].stale
        snapshot.update_endpoint(index, self._state(pod, scraped, self.clock()))
        if was_stale:
            self._count_states()

    def _refresh_base_models(self) -> None:
        names = set(self.configured_base_models)
        for scraped in self._scraped.values():
            if scraped.metrics is not None:
                names |= scraped.metrics.model_names
        self._base_models = frozenset(names)

    def _check_synced(self) -> None:
        if not self.synced and len(self._tried) >= len(self._scraped):
            self.synced = True

    def _count_states(self) -> None:
        if self.metrics is None:
            return
        snapshot = self.snapshot
        stale = int(np.count_nonzero(snapshot.stale))
        self.metrics.endpoints.labels("fresh").set(snapshot.size - stale)
        self.metrics.endpoints.labels("stale").set(stale)
        self.metrics.endpoints.labels("not-ready").set(0)


def scrape_offset(address: str, interval_s: float) -> float:
    """Where in each scrape interval the endpoint at ``address`` is scraped: a fixed offset in [0, interval_s) from
    a hash of its address, as Prometheus spreads its targets. Scraped in step, every endpoint's figures would age
    together and the least loaded one take every request for a whole interval; spread, each ages on its own (and
    the scrapes' work spreads over the interval). The simulator's peers are scraped at the same offsets
    (``loraplane.sim.cluster.ScrapeSchedule``)."""
    digest = hashlib.blake2b(address.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 * interval_s


def until_offset(now: float, interval_s: float, offset_s: float) -> float:
    """Seconds from ``now`` to the next time ``offset_s`` into an interval (after a slow scrape the next slot, not a
    burst to catch up)."""
    wait = (offset_s - now) % interval_s
    return wait if wait > 0 else interval_s


class MetricsScraper:
    """Scrapes every member of a ``ScrapedPool`` every ``interval_s``, each at its own offset in the interval (one
    task per endpoint, one keep-alive session); a scrape that takes longer delays only its own endpoint's next
    one."""

    def __init__(self, pool: ScrapedPool, interval_s: float = SCRAPE_INTERVAL_S, timeout_s: float = SCRAPE_TIMEOUT_S,
                 path: str = "/metrics", scheme: str = "http", registry: CollectorRegistry | None = None) -> None:
        """Scrape ``pool``'s members at ``scheme://<address><path>``; with ``registry``, count scrapes there
        (``loraplane_picker_scrapes_total{result}``)."""
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("the scrape interval and timeout must be > 0")
        self.pool = pool
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.path = path if path.startswith("/") else "/" + path
        self.scheme = scheme
        #: scrapes done, by result (``ok``, ``error``)
        self.counts = {"ok": 0, "error": 0}
        #: the clock the scrape loops keep their slots by, and how they wait for the next (tests give them fakes)
        self.clock: Callable[[], float] = time.monotonic
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
        self._counter = (Counter("loraplane_picker_scrapes", "Scrapes of the endpoints' /metrics by result",
                                 ["result"], registry=registry) if registry is not None else None)

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape until ``stop`` is set, following the pool's membership."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=True) as session:
            try:
                while not stop.is_set():
                    wanted = set(self.pool.members)
                    for key in [k for k in tasks if k not in wanted]:
                        tasks.pop(key).cancel()
                    for key in wanted - tasks.keys():
                        tasks[key] = asyncio.create_task(self._follow(session, *key))
                    self.pool.expire()
                    await sleep_or_stop(stop, min(_HOUSEKEEPING_S, self.interval_s))
            finally:
                for task in tasks.values():
                    task.cancel()
                await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def _follow(self, session: aiohttp.ClientSession, pod: str, address: str) -> None:
        """Scrape ``pod`` at once, then at its own offset in every interval (``scrape_offset``)."""
        url = f"{self.scheme}://{address}{self.path}"
        offset = scrape_offset(address, self.interval_s)
        while True:
            await self.scrape_once(session, pod, address, url)
            await self.sleep(until_offset(self.clock(), self.interval_s, offset))

    async def scrape_once(self, session: aiohttp.ClientSession, pod: str, address: str, url: str | None = None) -> None:
        """One scrape of ``pod`` (recorded in the pool, or counted as failed)."""
        url = url or f"{self.scheme}://{address}{self.path}"
        try:
            async with session.get(url) as response:
                body = await response.read()
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
            metrics = read_metrics(body.decode("utf-8", "replace"))
        except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
            self._count("error")
            self.pool.failed(pod, address, repr(exc))
            return
        self._count("ok")
        self.pool.record(pod, address, metrics)

    def _count(self, result: str) -> None:
        self.counts[result] += 1
        if self._counter is not None:
            self._counter.labels(result).inc()


@contextlib.asynccontextmanager
async def scraping(pool: ScrapedPool, interval_s: float = SCRAPE_INTERVAL_S,
                   timeout_s: float = SCRAPE_TIMEOUT_S) -> AsyncIterator[MetricsScraper]:
    """Scrape ``pool`` in the background for the duration of the block (tests and tools)."""
    stop = asyncio.Event()
    scraper = MetricsScraper(pool, interval_s, timeout_s)
    task = asyncio.create_task(scraper.run(stop))
    try:
        yield scraper
    finally:
        stop.set()
        await task
