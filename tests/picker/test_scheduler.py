"""The scheduling core: affinity-until-saturated, tiers with digest match, gold priority, seeded ties, fallbacks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from pydantic import ValidationError

from loraplane.api import AdapterResidency, PodLoad, ResidencyReport, Tier
from loraplane.picker.plugins import (
    Cycle,
    PrefillQueueParameters,
    RevisionNotServedError,
    SchedulingRequest,
    prefill_queue_scorer,
)
from loraplane.picker.scheduler import (
    EndpointPickerConfig,
    NoEndpointError,
    Outcome,
    PoolSaturatedError,
    Scheduler,
)
from loraplane.picker.snapshot import EndpointState, InFlightTracker, PoolSnapshot

DIGEST_A = "sha256:" + "a" * 64
DIGEST_B = "sha256:" + "b" * 64
ADAPTER = "claims@v1"


def pod(i: int, residency: dict[str, tuple[Tier, str | None]] | None = None, **load: object) -> EndpointState:
    """A simulated pod (it loads a revision it does not hold on demand) unless ``loads_on_demand=False``."""
    return EndpointState(name=f"pod-{i}", address=f"10.0.0.{i}:8000", residency=residency or {},  # type: ignore[arg-type]
                         **{"loads_on_demand": True, **load})


def request(**kw: object) -> SchedulingRequest:
    return SchedulingRequest(**{"served_name": ADAPTER, "digest": DIGEST_A, **kw})  # type: ignore[arg-type]


@pytest.fixture
def scheduler() -> Scheduler:
    return Scheduler.default()


def test_gpu_resident_pod_wins_while_below_saturation(scheduler: Scheduler) -> None:
    pool = PoolSnapshot([pod(1), pod(2, {ADAPTER: (Tier.GPU, DIGEST_A)}, queue_depth=3), pod(3)])
    pool.in_flight[:] = [0, 10, 0]  # busier, yet below the in-flight threshold of 16
    decision = scheduler.schedule(request(), pool, np.random.default_rng(0))
    assert decision.endpoints[0] == "10.0.0.2:8000"
    assert decision.outcome is Outcome.WARM_GPU and decision.tier is Tier.GPU


def test_tiers_rank_gpu_over_cpu_over_disk(scheduler: Scheduler) -> None:
    pool = PoolSnapshot(
        [pod(1, {ADAPTER: (Tier.DISK, DIGEST_A)}), pod(2, {ADAPTER: (Tier.CPU, DIGEST_A)}), pod(3, {ADAPTER: (Tier.GPU, DIGEST_A)}), pod(4)]
    )
    decision = scheduler.schedule(request(), pool, np.random.default_rng(0))
    assert decision.endpoints == ("10.0.0.3:8000", "10.0.0.2:8000", "10.0.0.1:8000")
    without_gpu = PoolSnapshot([pod(1, {ADAPTER: (Tier.DISK, DIGEST_A)}), pod(2, {ADAPTER: (Tier.CPU, DIGEST_A)}), pod(4)])
    assert scheduler.schedule(request(), without_gpu, np.random.default_rng(0)).outcome is Outcome.WARM_CPU


def test_a_different_digest_is_not_warm(scheduler: Scheduler) -> None:
    pool = PoolSnapshot([pod(1, {ADAPTER: (Tier.GPU, DIGEST_B)}), pod(2, {ADAPTER: (Tier.GPU, None)}), pod(3)])
    picks = Counter(scheduler.schedule(request(), pool, np.random.default_rng(s)).endpoints[0] for s in range(60))
    assert len(picks) == 3  # no affinity anywhere: ties broken at random
    assert scheduler.schedule(request(), pool, np.random.default_rng(0)).outcome is Outcome.COLD


ON_DISK = {ADAPTER: (Tier.DISK, DIGEST_A)}


def test_saturated_warm_pod_spills_to_least_loaded(scheduler: Scheduler) -> None:
    pool = PoolSnapshot([pod(1, {ADAPTER: (Tier.GPU, DIGEST_A)}), pod(2, ON_DISK), pod(3, ON_DISK), pod(4)])
    pool.in_flight[:] = [16, 5, 2, 0]  # pod 1 at its in-flight threshold; pod 4 cannot serve the revision
    decision = scheduler.schedule(request(), pool, np.random.default_rng(0))
    assert decision.endpoints[0] == "10.0.0.3:8000"
    assert decision.outcome is Outcome.SPILLED_SATURATED
    # queue depth or KV utilisation saturate too
    for load in ({"queue_depth": 5}, {"kv_utilization": 0.85}):
        pool = PoolSnapshot([pod(1, {ADAPTER: (Tier.GPU, DIGEST_A)}, **load), pod(2, ON_DISK)])
        assert scheduler.schedule(request(), pool, np.random.default_rng(0)).endpoints[0] == "10.0.0.2:8000"


def test_when_everything_is_saturated_load_wins_and_sheddable_is_refused(scheduler: Scheduler) -> None:
    pool = PoolSnapshot([pod(1, {ADAPTER: (Tier.GPU, DIGEST_A)}), pod(2, ON_DISK), pod(3, ON_DISK)])
    pool.in_flight[:] = [40, 30, 20]
    decision = scheduler.schedule(request(), pool, np.random.default_rng(0))
    assert decision.endpoints[0] == "10.0.0.3:8000"  # fail-open saturation filter, no affinity
    with pytest.raises(PoolSaturatedError) as info:
        scheduler.schedule(request(priority=-1), pool, np.random.default_rng(0))
    assert info.value.status == 429
    pool.in_flight[:] = [40, 30, 2]
    assert scheduler.schedule(request(priority=-1), pool, np.random.default_rng(0)).endpoints[0] == "10.0.0.3:8000"


def test_gold_warm_pods_are_avoided_by_cold_lower_priority_requests(scheduler: Scheduler) -> None:
    gold = "vip@v1"
    endpoints = [pod(1, {gold: (Tier.GPU, DIGEST_B)}), pod(2)]
    pool = PoolSnapshot(endpoints, priorities={gold: 10})
    pool.in_flight[:] = [0, 6]  # pod 1 is idler, but keeps gold warm
    standard = scheduler.schedule(request(), pool, np.random.default_rng(0))
    assert standard.endpoints[0] == "10.0.0.2:8000"
    gold_req = scheduler.schedule(request(served_name="other@v1", priority=10), pool, np.random.default_rng(0))
    assert gold_req.endpoints[0] == "10.0.0.1:8000"
    # without the priority map pod 1 is not protected
    unprotected = PoolSnapshot(endpoints)
    unprotected.in_flight[:] = [0, 6]
    assert scheduler.schedule(request(), unprotected, np.random.default_rng(0)).endpoints[0] == "10.0.0.1:8000"
    # a request whose own revision is GPU-warm on the gold pod may still use it
    shared = PoolSnapshot([pod(1, {gold: (Tier.GPU, DIGEST_B), ADAPTER: (Tier.GPU, DIGEST_A)}), pod(2)], {gold: 10})
    assert scheduler.schedule(request(), shared, np.random.default_rng(0)).endpoints[0] == "10.0.0.1:8000"


def test_ties_are_broken_by_the_seeded_rng(scheduler: Scheduler) -> None:
    pool = PoolSnapshot([pod(i) for i in range(1, 5)])
    first = [scheduler.schedule(request(), pool, rng).endpoints for rng in [np.random.default_rng(7)] * 50]
    again = [scheduler.schedule(request(), pool, rng).endpoints for rng in [np.random.default_rng(7)] * 50]
    assert first == again
    counts = Counter(e[0] for e in first)
    assert len(counts) == 4 and min(counts.values()) >= 5


def test_fallbacks_are_distinct_and_ordered_by_score(scheduler: Scheduler) -> None:
    pool = PoolSnapshot([pod(i) for i in range(1, 7)])
    pool.in_flight[:] = [5, 1, 4, 0, 3, 2]
    decision = scheduler.schedule(SchedulingRequest(), pool, np.random.default_rng(0))
    assert decision.endpoints == ("10.0.0.4:8000", "10.0.0.2:8000", "10.0.0.6:8000")
    assert decision.outcome is Outcome.BASE


def test_subset_hint_restricts_candidates(scheduler: Scheduler) -> None:
    pool = PoolSnapshot([pod(1, {ADAPTER: (Tier.GPU, DIGEST_A)}), pod(2), pod(3)])
    decision = scheduler.schedule(request(subset=frozenset({"10.0.0.3"})), pool, np.random.default_rng(0))
    assert decision.endpoints == ("10.0.0.3:8000",)
    with pytest.raises(NoEndpointError) as info:
        scheduler.schedule(request(subset=frozenset()), pool, np.random.default_rng(0))
    assert info.value.status == 503


def test_only_pods_holding_the_revision_serve_it_unless_none_does(scheduler: Scheduler) -> None:
    pool = PoolSnapshot([pod(1), pod(2, ON_DISK), pod(3)])
    assert scheduler.schedule(request(), pool, np.random.default_rng(0)).endpoints == ("10.0.0.2:8000",)
    nowhere = PoolSnapshot([pod(1), pod(2)])
    assert len(scheduler.schedule(request(), nowhere, np.random.default_rng(0)).endpoints) == 2  # either loads it
    # pods of a real runtime answer 404 for a revision they have not registered: neither is sent it
    real = [pod(1, loads_on_demand=False), pod(2, ON_DISK, loads_on_demand=False), pod(3, loads_on_demand=False)]
    assert scheduler.schedule(request(), PoolSnapshot(real), np.random.default_rng(0)).endpoints == ("10.0.0.2:8000",)
    with pytest.raises(RevisionNotServedError, match="would answer 404"):
        scheduler.schedule(request(), PoolSnapshot([real[0], real[2]]), np.random.default_rng(0))
    # nor when its one holder is not ready
    holder_down = [real[0], pod(2, ON_DISK, loads_on_demand=False, ready=False)]
    with pytest.raises(RevisionNotServedError):
        scheduler.schedule(request(), PoolSnapshot(holder_down), np.random.default_rng(0))


def test_a_draining_revision_is_never_warm_and_its_pod_serves_it_only_when_no_other_holds_it(scheduler: Scheduler) -> None:
    """A pod whose sidecar reports the revision draining is about to unload it: never warm there, and routed to
    only when no other candidate holds the revision (it still serves it for a moment, unlike a pod without it)."""
    leaving = {ADAPTER: (Tier.GPU, DIGEST_A)}
    pool = PoolSnapshot([pod(1, leaving, draining=frozenset({ADAPTER})), pod(2, ON_DISK), pod(3)])
    pool.in_flight[:] = [0, 8, 0]  # the draining pod is idler: only residency keeps requests off it
    decision = scheduler.schedule(request(), pool, np.random.default_rng(0))
    assert decision.endpoints == ("10.0.0.2:8000",) and decision.outcome is Outcome.COLD
    assert pool.lookup(ADAPTER, DIGEST_A).level_of == {1: 2}  # type: ignore[union-attr]
    only_draining = PoolSnapshot([pod(1, leaving, draining=frozenset({ADAPTER})), pod(2), pod(3)])
    for seed in range(20):
        decision = scheduler.schedule(request(), only_draining, np.random.default_rng(seed))
        assert decision.endpoints == ("10.0.0.1:8000",) and decision.outcome is Outcome.COLD
    # the other holder is not ready: the draining pod is still better than a pod without the revision
    other_down = PoolSnapshot([pod(1, leaving, draining=frozenset({ADAPTER})), pod(2, ON_DISK, ready=False), pod(3)])
    assert scheduler.schedule(request(), other_down, np.random.default_rng(0)).endpoints == ("10.0.0.1:8000",)
    # a draining gold revision protects nothing
    gold = PoolSnapshot([pod(1, {"vip@v1": (Tier.GPU, DIGEST_B)}, draining=frozenset({"vip@v1"})), pod(2)], {"vip@v1": 10})
    assert not gold.has_protected


def test_draining_rows_of_a_report_reach_the_snapshot(scheduler: Scheduler) -> None:
    rows = [AdapterResidency(served_name=ADAPTER, tier=Tier.GPU, digest=DIGEST_A, draining=True)]
    on_cpu = [AdapterResidency(served_name=ADAPTER, tier=Tier.CPU, digest=DIGEST_A)]
    pool = PoolSnapshot.from_reports([report("a", 1, 100.0, rows), report("b", 2, 100.0, on_cpu)], now=100.5)
    assert pool.endpoints[0].draining == {ADAPTER}
    decision = scheduler.schedule(request(), pool, np.random.default_rng(0))
    assert decision.endpoints == ("127.0.0.1:2",) and decision.outcome is Outcome.WARM_CPU


def test_not_ready_endpoints_are_never_picked(scheduler: Scheduler) -> None:
    pool = PoolSnapshot([pod(1, {ADAPTER: (Tier.GPU, DIGEST_A)}, ready=False), pod(2)])
    assert scheduler.schedule(request(), pool, np.random.default_rng(0)).endpoints == ("10.0.0.2:8000",)
    with pytest.raises(NoEndpointError):
        scheduler.schedule(request(), PoolSnapshot([pod(1, ready=False)]), np.random.default_rng(0))
    with pytest.raises(NoEndpointError):
        scheduler.schedule(request(), PoolSnapshot([]), np.random.default_rng(0))


def report(pod_name: str, port: int, heartbeat_at: float, adapters: list[AdapterResidency] | None = None, **load: int) -> ResidencyReport:
    return ResidencyReport(
        pool="pool", pod=pod_name, address=f"127.0.0.1:{port}", heartbeat_at=heartbeat_at, ttl_seconds=5,
        adapters=adapters or [], load=PodLoad(**load),
    )


def test_stale_reports_are_dropped_unless_they_last_held_what_no_fresh_pod_holds(scheduler: Scheduler) -> None:
    """A stale endpoint is never warm; it is kept (last heard) only for a revision no fresh endpoint holds, which a
    fresh pod without it would answer 404 (issue 31, item 2)."""
    warm = [AdapterResidency(served_name=ADAPTER, tier=Tier.GPU, digest=DIGEST_A)]
    reports = [report("a", 1, heartbeat_at=100.0, adapters=warm), report("b", 2, heartbeat_at=104.0)]
    fresh = PoolSnapshot.from_reports(reports, now=104.5)
    assert scheduler.schedule(request(), fresh, np.random.default_rng(0)).endpoints[0] == "127.0.0.1:1"
    later = PoolSnapshot.from_reports(reports, now=106.0)  # a's report is older than its TTL
    assert later.stale.tolist() == [True, False] and later.lookup(ADAPTER, DIGEST_A) is None
    assert later.last_heard.tolist() == [True, False] and later.last_heard_holders(ADAPTER, DIGEST_A).tolist() == [0]
    decision = scheduler.schedule(request(), later, np.random.default_rng(0))
    assert decision.endpoints == ("127.0.0.1:1",) and decision.outcome is Outcome.COLD
    b_holds = [report("a", 1, heartbeat_at=100.0, adapters=warm), report("b", 2, heartbeat_at=104.0, adapters=warm)]
    both = PoolSnapshot.from_reports(b_holds, now=106.0)
    assert scheduler.schedule(request(), both, np.random.default_rng(0)).endpoints == ("127.0.0.1:2",)
    all_stale = PoolSnapshot.from_reports(reports, now=200.0)
    assert scheduler.schedule(request(), all_stale, np.random.default_rng(0)).endpoints == ("127.0.0.1:1",)
    other = SchedulingRequest(served_name="other@v1", digest=DIGEST_A)
    with pytest.raises(RevisionNotServedError):  # held nowhere, and a sidecar's pod never loads on demand
        scheduler.schedule(other, all_stale, np.random.default_rng(0))
    discovered = PoolSnapshot.from_reports(reports, now=104.5, endpoints=[("b", "127.0.0.1:2"), ("c", "127.0.0.1:3")])
    assert discovered.addresses == ("127.0.0.1:2", "127.0.0.1:3") and discovered.stale.tolist() == [False, True]
    assert discovered.last_heard.tolist() == [False, False]  # c has no report: unknown


def test_in_flight_counts_survive_snapshot_rebuilds() -> None:
    tracker = InFlightTracker()
    first = PoolSnapshot([pod(1), pod(2)])
    tracker.attach(first)
    tracker.start("10.0.0.2:8000")
    tracker.start("10.0.0.2:8000")
    assert first.in_flight.tolist() == [0, 2]
    second = PoolSnapshot([pod(2), pod(3)])
    tracker.attach(second)
    assert second.in_flight.tolist() == [2, 0]
    tracker.finish("10.0.0.2:8000")
    tracker.finish("10.0.0.2:8000")
    tracker.finish("10.0.0.2:8000")  # never below zero
    assert second.in_flight.tolist() == [0, 0] and tracker.counts == {}


def test_config_errors_are_explained() -> None:
    with pytest.raises(ValidationError, match="unknown plugin type 'nope'"):
        EndpointPickerConfig.from_yaml("plugins: [{type: nope}]\nschedulingProfiles: [{plugins: [{pluginRef: nope}]}]")
    with pytest.raises(ValidationError, match="undefined plugin 'x'"):
        EndpointPickerConfig.from_yaml("plugins: [{type: queue-scorer}]\nschedulingProfiles: [{plugins: [{pluginRef: x}]}]")
    with pytest.raises(ValueError, match="mapping"):
        EndpointPickerConfig.from_yaml("- a")
    with pytest.raises(ValidationError):
        Scheduler.from_yaml("plugins: [{type: saturation-filter, parameters: {headroom: -1}}]\n"
                            "schedulingProfiles: [{plugins: [{pluginRef: saturation-filter}]}]")


def test_weights_and_parameters_come_from_the_config() -> None:
    load_only = Scheduler.from_yaml(
        """
plugins:
- {type: residency-affinity-scorer}
- {type: in-flight-scorer}
- {type: max-score-picker, parameters: {maxEndpoints: 1}}
schedulingProfiles:
- plugins: [{pluginRef: residency-affinity-scorer, weight: 0}, {pluginRef: in-flight-scorer}, {pluginRef: max-score-picker}]
"""
    )
    pool = PoolSnapshot([pod(1, {ADAPTER: (Tier.GPU, DIGEST_A)}), pod(2)])
    pool.in_flight[:] = [3, 0]
    assert load_only.schedule(request(), pool, np.random.default_rng(0)).endpoints == ("10.0.0.2:8000",)


def test_the_warm_pod_with_fewer_requests_awaiting_their_first_token_wins(scheduler: Scheduler) -> None:
    warm = {ADAPTER: (Tier.GPU, DIGEST_A)}
    pool = PoolSnapshot([pod(1, warm), pod(2, warm), pod(3)])
    pool.in_flight[:] = [4, 4, 0]  # the same in flight and the same (old) reports: only the fresh signal differs
    pool.prefilling[:] = [3, 0, 0]  # pod 1 has three requests whose response has not started yet
    pool.prefill_tokens[:] = [3_000, 0, 0]  # of 1,000 tokens each
    picks = {scheduler.schedule(request(), pool, np.random.default_rng(seed)).endpoints[0] for seed in range(20)}
    assert picks == {"10.0.0.2:8000"}


def _prefill_scores(pool: PoolSnapshot, unsaturated: list[bool] | None = None, **params: object) -> list[float] | None:
    scorer = prefill_queue_scorer(PrefillQueueParameters.model_validate(params))
    n = pool.size
    below = np.ones(n, dtype=np.bool_) if unsaturated is None else np.asarray(unsaturated)
    scores = scorer(request(), pool, Cycle(np.ones(n, dtype=np.bool_), np.zeros(n), below))
    return None if scores is None else [round(float(s), 4) for s in scores]


def test_the_prefill_queue_score_is_relative_by_default_and_absolute_with_a_capacity() -> None:
    warm = {ADAPTER: (Tier.GPU, DIGEST_A)}
    pool = PoolSnapshot([pod(1, warm), pod(2, warm), pod(3, warm)])
    pool.prefilling[:] = [1, 2, 20]
    assert _prefill_scores(pool) == [1.0, 0.9474, 0.0]  # min-max: one request more than the least costs little here
    pool.prefilling[:] = [0, 1, 1]
    assert _prefill_scores(pool) == [1.0, 0.0, 0.0]  # ...and a whole score here
    assert _prefill_scores(pool, capacity=8) == [1.0, 0.875, 0.875]
    pool.prefilling[:] = [9, 16, 40]
    assert _prefill_scores(pool, capacity=8) == [0.0, 0.0, 0.0]
    pool.prefilling[:] = [1, 1, 1]
    assert _prefill_scores(pool) is None  # all equal: no preference
    assert _prefill_scores(pool, capacity=8) == [0.875, 0.875, 0.875]


def test_the_prefill_queue_score_counts_only_where_the_revision_is_warm_when_asked() -> None:
    pool = PoolSnapshot([pod(1, {ADAPTER: (Tier.GPU, DIGEST_A)}), pod(2, {ADAPTER: (Tier.CPU, DIGEST_A)}),
                         pod(3, {ADAPTER: (Tier.DISK, DIGEST_A)}), pod(4), pod(5, {ADAPTER: (Tier.GPU, DIGEST_B)})])
    pool.prefilling[:] = [4, 0, 0, 0, 0]
    assert _prefill_scores(pool, capacity=8, warmOnly=True) == [0.5, 1.0, 0.0, 0.0, 0.0]
    assert _prefill_scores(pool, warmOnly=True) == [0.0, 1.0, 0.0, 0.0, 0.0]
    # an idle pod that would have to load the revision from disk no longer outscores a GPU-warm one with a queue
    assert _prefill_scores(pool, capacity=8) == [0.5, 1.0, 1.0, 1.0, 1.0]
    # a saturated warm pod scores nothing, as with tier affinity
    below = [False, True, True, True, True]
    assert _prefill_scores(pool, below, capacity=8, warmOnly=True) == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_the_prefill_queue_scorer_rejects_a_capacity_that_is_not_positive() -> None:
    with pytest.raises(ValidationError):
        PrefillQueueParameters.model_validate({"capacity": 0})


def test_a_revision_no_pod_holds_goes_to_the_staging_pods(scheduler: Scheduler) -> None:
    gold = {"vip@v1": (Tier.GPU, DIGEST_B)}
    endpoints = [pod(1, gold), pod(2, gold), pod(3), pod(4, ON_DISK)]
    staged = PoolSnapshot(endpoints, priorities={"vip@v1": 1}, staging={"pod-3", "pod-9"})
    staged.in_flight[:] = [0, 0, 12, 0]  # the staging pod is the busiest, not saturated
    cold = request(served_name="sweep-7@v1")
    picks = {scheduler.schedule(cold, staged, np.random.default_rng(s)).endpoints[0] for s in range(20)}
    assert picks == {"10.0.0.3:8000"}
    # a revision some pod holds still goes to its holder
    assert scheduler.schedule(request(), staged, np.random.default_rng(0)).endpoints[0] == "10.0.0.4:8000"
    # without staging pods a cold revision may go anywhere (here: the idle pod without gold)
    anywhere = PoolSnapshot(endpoints, priorities={"vip@v1": 1})
    anywhere.in_flight[:] = [0, 0, 12, 0]
    assert scheduler.schedule(cold, anywhere, np.random.default_rng(0)).endpoints[0] == "10.0.0.4:8000"
    # a staging pod that cannot serve (not ready) leaves the choice to the other filters (fail open)
    down = PoolSnapshot([*endpoints[:2], pod(3, ready=False), endpoints[3]], {"vip@v1": 1}, {"pod-3"})
    assert scheduler.schedule(cold, down, np.random.default_rng(0)).endpoints[0] == "10.0.0.4:8000"
    assert PoolSnapshot(endpoints, staging={"pod-9"}).staging is None  # names no member: any pod
    # a staging pod of a real runtime does not load it either: the pods that do (here pod 4 only)
    real_staging = [*endpoints[:2], pod(3, loads_on_demand=False), pod(4)]
    staged = PoolSnapshot(real_staging, priorities={"vip@v1": 1}, staging={"pod-3"})
    assert {scheduler.schedule(cold, staged, np.random.default_rng(s)).endpoints[0] for s in range(20)} == {
        "10.0.0.4:8000"}
