"""Reports aged by the picker's own receive time, TTLs bounded, and a pool that keeps its members when every
report stops (issue 31, items 2 and 5)."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from loraplane.api import AdapterResidency, PodLoad, ResidencyReport, Tier
from loraplane.picker.plugins import SchedulingRequest
from loraplane.picker.scheduler import Outcome, Scheduler
from loraplane.picker.snapshot import InFlightTracker
from loraplane.picker.state import PoolState
from loraplane.picker.telemetry import PickerMetrics
from tests.picker.conftest import BUFFERED, REQUEST_HEADERS, body, headers, make_context

DIGEST = "sha256:" + "a" * 64
ADAPTER = "claims@v1"
#: the sidecars' wall clock (``heartbeat_at``), unrelated to the picker's
WALL = 1_700_000_000.0


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _report(i: int, skew: float = 0.0, ttl: float = 3.0, holds: bool = True, **load: int) -> ResidencyReport:
    rows = [AdapterResidency(served_name=ADAPTER, tier=Tier.GPU, digest=DIGEST)] if holds else []
    return ResidencyReport(pool="pool", pod=f"pod-{i}", address=f"10.0.0.{i}:8000", heartbeat_at=WALL + skew,
                           ttl_seconds=ttl, adapters=rows, load=PodLoad(**load))


def _state(grace: float = 10.0, **kw: float) -> tuple[PoolState, Clock, PickerMetrics]:
    clock, metrics = Clock(), PickerMetrics(CollectorRegistry())
    return PoolState("pool", InFlightTracker(), clock, metrics=metrics, stale_grace_s=grace, **kw), clock, metrics


def _gauge(metrics: PickerMetrics) -> dict[str, float]:
    return {s.labels["state"]: s.value for m in metrics.endpoints.collect() for s in m.samples}


def test_a_sidecar_clock_600_s_ahead_or_120_s_behind_changes_nothing() -> None:
    """Aged by the sidecar's clock, a pod 600 s ahead stayed fresh ten minutes after its last report and one 120 s
    behind was stale on arrival; by the picker's receive time both are fresh for their TTL, then last heard for the
    grace, then stale."""
    state, clock, metrics = _state()
    state.set_report(_report(0, skew=600.0))
    state.set_report(_report(1, skew=-120.0))
    state.set_report(_report(2))
    state.rebuild()
    assert state.snapshot.stale.tolist() == [False] * 3
    assert _gauge(metrics) == {"fresh": 3, "in-grace": 0, "stale": 0, "not-ready": 0}
    clock.now = 3.5  # past the 3 s TTL: still routed to as last heard, but no longer counted fresh
    assert state.rebuild_if_expired()
    assert state.snapshot.stale.tolist() == [False] * 3
    assert _gauge(metrics) == {"fresh": 0, "in-grace": 3, "stale": 0, "not-ready": 0}
    clock.now = 13.5  # past TTL + grace, whatever each sidecar's clock said
    assert state.rebuild_if_expired()
    assert state.snapshot.stale.tolist() == [True] * 3
    assert _gauge(metrics) == {"fresh": 0, "in-grace": 0, "stale": 3, "not-ready": 0}


def test_a_report_read_again_keeps_its_age_and_a_new_heartbeat_renews_it() -> None:
    state, clock, _ = _state(grace=0.0)
    state.set_report(_report(0))
    clock.now = 2.0
    state.set_report(_report(0))  # the same report again (a resync): received at 0
    assert state.age("pod-0") == 2.0
    clock.now = 3.5
    state.rebuild()
    assert state.snapshot.stale.tolist() == [True]
    state.set_report(_report(0, skew=0.5))  # the sidecar's next heartbeat
    state.rebuild()
    assert state.snapshot.stale.tolist() == [False] and state.age("pod-0") == 0.0


def test_a_ttl_beyond_the_bound_counts_as_the_bound_and_is_counted() -> None:
    state, clock, metrics = _state(grace=0.0, max_ttl_s=60.0)
    state.set_report(_report(0, ttl=86_400.0))
    state.set_report(_report(0, ttl=86_400.0))  # read again: counted once
    clock.now = 59.0
    state.rebuild()
    assert state.snapshot.stale.tolist() == [False]
    clock.now = 61.0
    assert state.rebuild_if_expired() and state.snapshot.stale.tolist() == [True]
    assert metrics.reports_ttl_capped._value.get() == 1


def test_every_report_stopped_keeps_the_pool_routable_to_what_each_pod_held() -> None:
    """Every sidecar silent (stalled, or Redis refusing their writes) well past the grace: the members stay, each
    request goes to a pod whose last report held its revision, unsaturated (its load as last heard; unknown load
    would count as saturated and flow control would hold every request to its deadline)."""
    state, clock, _ = _state(grace=30.0)
    for i in range(3):
        state.set_report(_report(i, holds=i == 1, queue_depth=1))
    state.rebuild()
    clock.now = 1000.0
    state.rebuild()
    pool = state.snapshot
    assert len(pool) == 3 and pool.stale.all() and pool.last_heard.all() and not pool.any_unknown
    scheduler = Scheduler.default()
    for seed in range(20):
        decision = scheduler.schedule(SchedulingRequest(served_name=ADAPTER, digest=DIGEST), pool,
                                      np.random.default_rng(seed))
        assert decision.endpoints[0] == "10.0.0.1:8000" and decision.outcome is Outcome.COLD
        assert not decision.should_wait


def test_recovery_routes_to_the_silent_holder_not_to_a_fresh_pod_without_the_revision() -> None:
    """The first sidecar to write again does not hold the revision: its pod would answer 404 (issue 31: 11 engine
    404s around the recovery from a full Redis); the silent pods that held it keep it until a fresh one holds it."""
    state, clock, _ = _state(grace=30.0)
    for i in range(3):
        state.set_report(_report(i, holds=i != 0))
    state.rebuild()
    clock.now = 100.0
    state.set_report(_report(0, skew=100.0, holds=False))
    state.rebuild()
    scheduler, request = Scheduler.default(), SchedulingRequest(served_name=ADAPTER, digest=DIGEST)
    picks = {scheduler.schedule(request, state.snapshot, np.random.default_rng(s)).endpoints[0] for s in range(20)}
    assert picks == {"10.0.0.1:8000", "10.0.0.2:8000"}
    state.set_report(_report(0, skew=101.0, holds=True))  # it loaded the revision and said so
    state.rebuild()
    picks = {scheduler.schedule(request, state.snapshot, np.random.default_rng(s)).endpoints[0] for s in range(20)}
    assert picks == {"10.0.0.0:8000"}


def test_a_silent_member_is_forgotten_only_while_another_reports() -> None:
    state, clock, _ = _state(grace=30.0, forget_s=300.0)
    for i in range(2):
        state.set_report(_report(i))
    state.rebuild()
    clock.now = 1000.0
    state.rebuild()
    assert sorted(state.reports) == ["pod-0", "pod-1"]
    state.set_report(_report(1, skew=1000.0))
    state.rebuild()
    assert sorted(state.reports) == ["pod-1"] and state.snapshot.addresses == ("10.0.0.1:8000",)


def test_the_chosen_endpoints_report_age_is_observed_at_decision_time() -> None:
    ctx, state = make_context()
    clock = Clock()
    clock.now = 100.0
    state.clock = clock
    for report in list(state.reports.values()):
        state.received.pop(report.pod)
        state.set_report(report)  # received at 100 on the picker's clock
    state.rebuild()
    ctx.report_clock = clock
    clock.now = 102.5
    from loraplane.picker.extproc import Exchange

    exchange = Exchange(ctx)
    exchange.handle(headers(REQUEST_HEADERS, body_mode=BUFFERED))
    exchange.handle(body(b'{"model": "claims", "prompt": "hi"}'))
    assert exchange.director.destination is not None
    samples = {s.name: s.value for m in ctx.metrics.report_age.collect() for s in m.samples}
    assert samples["loraplane_picker_report_age_seconds_count"] == 1
    assert samples["loraplane_picker_report_age_seconds_sum"] == 2.5
