"""What the picker reports: Prometheus metrics, per-revision request rates and canary-analysis counters."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter

from loraplane.api import PickerCounters, RequestRates, RevisionCounters
from loraplane.api.routing import RateWindow
from loraplane.picker.scheduler import Outcome
from loraplane.picker.snapshot import InFlightTracker

WINDOWS: dict[RateWindow, int] = {"5m": 300, "1h": 3600, "24h": 86400}
_BUCKET_SECONDS = 60


class PickerMetrics:
    """The picker's Prometheus metrics, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        """Create the metrics (in ``registry``, a fresh one by default)."""
        self.registry = registry or CollectorRegistry()
        self.decision_seconds = Histogram(
            "loraplane_picker_decision_duration_seconds",
            "Time from a parsed request to a chosen endpoint (resolution + scheduling)",
            buckets=(25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3),
            registry=self.registry,
        )
        decisions = PromCounter(
            "loraplane_picker_decisions_total", "Scheduling decisions by outcome", ["outcome"], registry=self.registry
        )
        self.decisions = {outcome: decisions.labels(outcome.value) for outcome in Outcome}
        self.requests = PromCounter(
            "loraplane_picker_requests_total",
            "Requests by the route's tenant (unknown models count as tenant 'none') and HTTP status class",
            ["tenant", "status_class"],
            registry=self.registry,
        )
        self._request_children: dict[tuple[str, int], PromCounter] = {}
        self.endpoints = Gauge(
            "loraplane_picker_endpoints",
            "Endpoints in the current snapshot by state: fresh (report within its TTL, by the picker's receive time), "
            "in-grace (past its TTL, still routed to as last heard), stale, not-ready",
            ["state"], registry=self.registry,
        )
        self.report_age = Histogram(
            "loraplane_picker_report_age_seconds",
            "Age of what the picker knew of the chosen endpoint at decision time, since it received it: the "
            "sidecar's residency report, or (--data-source scrape) the last scrape of its metrics",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
            registry=self.registry,
        )
        self.reports_ttl_capped = PromCounter(
            "loraplane_picker_reports_ttl_capped_total",
            "Reports whose ttlSeconds exceeded --max-report-ttl-seconds (aged with that bound instead)",
            registry=self.registry,
        )
        self.snapshot_rebuilds = PromCounter(
            "loraplane_picker_snapshot_rebuilds_total", "Pool snapshot rebuilds", registry=self.registry
        )
        self.snapshot_updates = PromCounter(
            "loraplane_picker_snapshot_updates_total",
            "Pool snapshot updates in place (only the pods whose report changed re-indexed)", registry=self.registry
        )
        self.model_rewrites = PromCounter(
            "loraplane_picker_model_rewrites_total",
            "Requests sent to the server under the model name of the gateway's x-llm-d-model-name-rewrite header "
            "(or x-gateway-model-name-rewrite), the body's model having no route",
            registry=self.registry,
        )
        self.destination_overrides = PromCounter(
            "loraplane_picker_destination_overrides_total",
            "Requests Envoy reports served by another endpoint than the picker's first choice (a fallback or its own)",
            registry=self.registry,
        )
        self.redis_errors = PromCounter(
            "loraplane_picker_redis_errors_total", "Failed Redis operations (the last snapshot stays in use)",
            registry=self.registry,
        )

    def watch_in_flight(self, tracker: InFlightTracker) -> None:
        """Export ``tracker``'s totals: the requests in flight, and those of them whose response has not started."""
        Gauge("loraplane_picker_in_flight_requests", "Requests the picker sent whose response has not ended",
              registry=self.registry).set_function(lambda: sum(tracker.counts.values()))
        Gauge("loraplane_picker_requests_awaiting_first_token",
              "Requests the picker sent whose response has not started (queued for or in prefill at their pod)",
              registry=self.registry).set_function(lambda: sum(tracker.prefilling.values()))

    def count_request(self, tenant: str, status: int) -> None:
        """One request finished (or was refused) with HTTP ``status``."""
        key = (tenant, status // 100)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(tenant, f"{status // 100}xx")
        child.inc()


class RequestStats:
    """Per-served-revision request rates over rolling windows and cumulative canary counters.

    Requests are counted in one-minute buckets kept for 24 h; a window's rate divides the requests in the buckets
    it covers by the time those buckets span (at most the time since the first request).
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        """``clock`` returns unix seconds."""
        self.clock = clock
        self._buckets: deque[tuple[int, Counter[str]]] = deque()
        self._since: float | None = None
        self.counters: dict[str, RevisionCounters] = {}

    def record_request(self, served_name: str) -> None:
        """A request was routed to ``served_name``."""
        now = self.clock()
        if self._since is None:
            self._since = now
        minute = int(now // _BUCKET_SECONDS)
        if not self._buckets or self._buckets[-1][0] != minute:
            self._buckets.append((minute, Counter()))
            horizon = minute - WINDOWS["24h"] // _BUCKET_SECONDS
            while self._buckets and self._buckets[0][0] <= horizon:
                self._buckets.popleft()
        self._buckets[-1][1][served_name] += 1
        self._counter(served_name).requests += 1

    def record_response(self, served_name: str, status: int, ttft_seconds: float | None) -> None:
        """The model server answered with ``status`` after ``ttft_seconds`` (non-2xx counts as an error)."""
        counters = self._counter(served_name)
        if not 200 <= status < 300:
            counters.errors += 1
        if ttft_seconds is not None:
            counters.ttft_seconds_sum += max(0.0, ttft_seconds)
            counters.ttft_count += 1

    def _counter(self, served_name: str) -> RevisionCounters:
        counters = self.counters.get(served_name)
        if counters is None:
            counters = self.counters[served_name] = RevisionCounters()
        return counters

    def rates(self, pool: str, replica: str | None = None) -> RequestRates:
        """Requests per second per served name for each window, as of now (counted by ``replica``)."""
        now = self.clock()
        minute = int(now // _BUCKET_SECONDS)
        windows: dict[RateWindow, dict[str, float]] = {}
        up = max(1.0, now - self._since) if self._since is not None else 1.0
        for window, seconds in WINDOWS.items():
            first = minute - seconds // _BUCKET_SECONDS
            total: Counter[str] = Counter()
            for bucket_minute, counts in self._buckets:
                if bucket_minute > first:
                    total.update(counts)
            span = min(now - (first + 1) * _BUCKET_SECONDS, up)  # the buckets counted cover exactly this long
            windows[window] = {name: count / span for name, count in total.items()}
        return RequestRates(pool=pool, replica=replica, published_at=now, windows=windows)

    def picker_counters(self, pool: str, replica: str) -> PickerCounters:
        """This replica's cumulative counters."""
        revisions = {name: c.model_copy() for name, c in self.counters.items()}
        return PickerCounters(pool=pool, replica=replica, published_at=self.clock(), revisions=revisions)


class NoRequestStats(RequestStats):
    """Counts nothing: the scrape data source publishes no rates, and routes model names clients choose (counting
    per name would let clients grow the picker's memory without bound)."""

    def record_request(self, served_name: str) -> None:
        """Nothing."""

    def record_response(self, served_name: str, status: int, ttft_seconds: float | None) -> None:
        """Nothing."""
