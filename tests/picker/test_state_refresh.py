"""``PoolState.refresh``: a report notice updates the snapshot in place (only the pods whose report changed) and
the result always equals a snapshot built from scratch; anything else (a new member, a report past a state edge,
new routes) falls back to a full rebuild."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter

from loraplane.api import (
    AdapterResidency,
    PodLoad,
    ResidencyReport,
    RouteEntry,
    RouteTable,
    Tier,
    WeightedRevision,
)
from loraplane.bench.picker import report_notices
from loraplane.picker.snapshot import InFlightTracker
from loraplane.picker.state import PoolState
from loraplane.picker.telemetry import PickerMetrics
from tests.picker.test_snapshot_update import DIGESTS, NAMES, indexed

TIERS = (Tier.GPU, Tier.CPU, Tier.DISK)
TTL_S, GRACE_S, FORGET_S = 3.0, 1.0, 20.0


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _routes(generation: int) -> RouteTable:
    """Routes for every name; ``gold@v1`` has a positive priority in generations 2, 3, 6, 7, ... (the snapshot's
    protected count reads it): a new generation changes the snapshot's priorities or leaves them."""
    return RouteTable(pool="pool", generation=generation, updated_at=0.0, models={
        name.split("@")[0] + str(i): RouteEntry(priority=10 if name == "gold@v1" and generation % 4 >= 2 else 0, revisions=[
            WeightedRevision(revision="v", served_name=name, digest=DIGESTS[0], weight=100)])
        for i, name in enumerate(NAMES)
    })


@st.composite
def reports(draw: st.DrawFn, pod: int, heartbeat: float) -> ResidencyReport:
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=4))
    rows = [AdapterResidency(served_name=name, tier=draw(st.sampled_from(TIERS)), digest=draw(st.sampled_from(DIGESTS)),
                             draining=draw(st.booleans())) for name in names]
    load = PodLoad(queue_depth=draw(st.integers(0, 5)), running=draw(st.integers(0, 8)),
                   kv_utilization=draw(st.floats(0, 1)), max_gpu_slots=draw(st.integers(1, 4)))
    return ResidencyReport(pool="pool", pod=f"pod-{pod}", address=f"10.0.0.{pod}:8000", heartbeat_at=heartbeat,
                           ttl_seconds=TTL_S, ready=draw(st.booleans()), adapters=rows, load=load)


def _state() -> tuple[PoolState, Clock, PickerMetrics]:
    clock, metrics = Clock(), PickerMetrics(CollectorRegistry())
    state = PoolState("pool", InFlightTracker(), clock, metrics=metrics, stale_grace_s=GRACE_S, forget_s=FORGET_S)
    state.set_routes(_routes(2))
    return state, clock, metrics


def _from_scratch(state: PoolState) -> PoolState:
    """A second picker state holding the same reports, received at the same times, rebuilt in full."""
    other = PoolState("pool", InFlightTracker(), state.clock, metrics=PickerMetrics(CollectorRegistry()),
                      stale_grace_s=GRACE_S, forget_s=FORGET_S)
    other.resolver, other.endpoints = state.resolver, state.endpoints
    other.reports, other.received = dict(state.reports), dict(state.received)
    other.rebuild()
    return other


def _gauge(metrics: PickerMetrics) -> dict[str, float]:
    return {s.labels["state"]: s.value for m in metrics.endpoints.collect() for s in m.samples}


def _count(counter: Counter) -> float:
    return next(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("report", "report", "report", "wait", "routes")), st.integers(0, 5),
                          st.floats(0.0, 6.0), st.data()), min_size=1, max_size=12))
def test_refresh_always_equals_a_snapshot_built_from_scratch(events: list[tuple[str, int, float, st.DataObject]]) -> None:
    state, clock, metrics = _state()
    for pod in range(4):
        state.set_report(ResidencyReport(pool="pool", pod=f"pod-{pod}", address=f"10.0.0.{pod}:8000", heartbeat_at=0.0,
                                         ttl_seconds=TTL_S))
    state.rebuild()
    generation = 2
    for kind, pod, seconds, data in events:
        if kind == "report":  # pods 4 and 5 join the pool
            state.set_report(data.draw(reports(pod, clock.now)))
            state.refresh()
        elif kind == "wait":  # reports age past their TTL, grace or the forget horizon
            clock.now += seconds * (5 if pod == 0 else 1)
            if pod % 2:  # else the next notice is the first to see the time that passed
                state.rebuild_if_expired()
            else:
                continue
        else:
            generation += 1
            state.update_routes(_routes(generation))
            state.refresh()  # no report changed, but the routes did
        rebuilt = _from_scratch(state)
        assert indexed(state.snapshot) == indexed(rebuilt.snapshot)
        assert (state.next_expiry, _gauge(metrics)) == (rebuilt.next_expiry, _gauge(rebuilt.metrics))  # type: ignore[arg-type]
        assert state.snapshot.addresses == tuple(e.address for e in state.snapshot.endpoints)
    assert _count(metrics.snapshot_rebuilds) + _count(metrics.snapshot_updates) >= 1


def test_a_report_notice_updates_in_place_and_anything_else_rebuilds() -> None:
    state, clock, metrics = _state()
    for pod in range(3):
        state.set_report(ResidencyReport(pool="pool", pod=f"pod-{pod}", address=f"10.0.0.{pod}:8000", heartbeat_at=0.0,
                                         ttl_seconds=TTL_S))
    state.rebuild()
    snapshot, version = state.snapshot, state.snapshot.version
    rows = [AdapterResidency(served_name="gold@v1", tier=Tier.GPU, digest=DIGESTS[0])]
    clock.now = 1.0
    state.set_report(ResidencyReport(pool="pool", pod="pod-1", address="10.0.0.1:8000", heartbeat_at=1.0,
                                     ttl_seconds=TTL_S, adapters=rows))
    state.refresh()
    assert state.snapshot is snapshot and snapshot.version == version + 1
    assert snapshot.lookup("gold@v1", DIGESTS[0]).indices.tolist() == [1]  # type: ignore[union-attr]
    assert snapshot.protected_warm.tolist() == [0, 1, 0]
    assert (_count(metrics.snapshot_updates), _count(metrics.snapshot_rebuilds)) == (1, 1)
    # a new member: a rebuild, with it
    state.set_report(ResidencyReport(pool="pool", pod="pod-3", address="10.0.0.3:8000", heartbeat_at=1.0,
                                     ttl_seconds=TTL_S))
    state.refresh()
    assert state.snapshot is not snapshot and len(state.snapshot) == 4
    assert (_count(metrics.snapshot_updates), _count(metrics.snapshot_rebuilds)) == (1, 2)
    # pods 0 and 2 are past their TTL by now: a notice from pod 1 must not leave them counted as fresh
    snapshot = state.snapshot
    clock.now = 3.5
    state.set_report(ResidencyReport(pool="pool", pod="pod-1", address="10.0.0.1:8000", heartbeat_at=3.5,
                                     ttl_seconds=TTL_S, adapters=rows))
    state.refresh()
    assert state.snapshot is not snapshot
    assert indexed(state.snapshot) == indexed(_from_scratch(state).snapshot)
    # every report silent past the forget horizon (all kept: a bus fault, not every pod gone), then one reports
    clock.now = 30.0
    state.rebuild_if_expired()
    assert len(state.snapshot) == 4
    state.set_report(ResidencyReport(pool="pool", pod="pod-1", address="10.0.0.1:8000", heartbeat_at=30.0,
                                     ttl_seconds=TTL_S, adapters=rows))
    state.refresh()
    assert state.snapshot.addresses == ("10.0.0.1:8000",)
    # a pod that moved to another address
    snapshot = state.snapshot
    state.set_report(ResidencyReport(pool="pool", pod="pod-1", address="10.0.0.9:8000", heartbeat_at=30.5,
                                     ttl_seconds=TTL_S, adapters=rows))
    state.refresh()
    assert state.snapshot is not snapshot and "10.0.0.9:8000" in state.snapshot.addresses


def test_a_renewed_report_moves_its_state_change_later() -> None:
    """Reports renewed in place push their TTL edge out: no rebuild when the edge of the reports they replaced
    passes."""
    state, clock, metrics = _state()
    for pod in range(2):
        state.set_report(ResidencyReport(pool="pool", pod=f"pod-{pod}", address=f"10.0.0.{pod}:8000", heartbeat_at=0.0,
                                         ttl_seconds=TTL_S))
    state.rebuild()
    assert state.next_expiry == TTL_S
    clock.now = 2.0
    for pod in range(2):
        state.set_report(ResidencyReport(pool="pool", pod=f"pod-{pod}", address=f"10.0.0.{pod}:8000", heartbeat_at=2.0,
                                         ttl_seconds=TTL_S))
    state.refresh()
    assert state.next_expiry == 2.0 + TTL_S
    clock.now = 3.5
    assert not state.rebuild_if_expired()
    assert _gauge(metrics)["fresh"] == 2 and _count(metrics.snapshot_rebuilds) == 1


def test_the_benchmark_times_both_ways_on_the_same_notices() -> None:
    [row] = report_notices([6], adapters=200, notices=8)
    assert row["pods"] == 6 and row["rebuild_us"] > 0 and row["in_place_us"] > 0
