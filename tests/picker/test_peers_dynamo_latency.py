"""The two newer peers' plugins on hand-built snapshots: Dynamo's LoRA allocation and filter
(``loraplane.picker.peers.dynamo``) and llm-d-router's predicted-latency routing (``loraplane.picker.peers.latency``)."""

from __future__ import annotations

import numpy as np
import pytest

from loraplane.api.vllm_metrics import LoadedAdapter
from loraplane.picker import peers
from loraplane.picker.peers.dynamo import (
    DynamoAllocator,
    DynamoLoraFilter,
    DynamoLoraParameters,
    _Entry,
    active_replica_counts,
    hrw_rank,
    min_cost_flow,
)
from loraplane.picker.peers.latency import PredictedLatencyFilter, PredictedLatencyParameters
from loraplane.picker.plugins import Cycle, PoolSaturatedError, SchedulingRequest
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from loraplane.picker.snapshot import EndpointState, PoolSnapshot

GPU = LoadedAdapter(True)


def endpoint(i: int, loaded: dict[str, LoadedAdapter] | None = None, queue: int = 0, busy: int = 0,
             kv: float = 0.0, slots: int = 4) -> EndpointState:
    return EndpointState(name=f"pod-{i}", address=f"10.0.0.{i + 1}:8000", queue_depth=queue, running=busy,
                         kv_utilization=kv, gpu_slots=slots, running_adapters=frozenset(),
                         waiting_adapters=frozenset(), loaded_adapters=loaded if loaded is not None else {},
                         gpu_loaded=len(loaded or {}))


def cycle(pool: PoolSnapshot, seed: int = 0) -> Cycle:
    n = pool.size
    return Cycle(np.ones(n, dtype=np.bool_), np.zeros(n), np.ones(n, dtype=np.bool_), rng=np.random.default_rng(seed))


def picked(keep: np.ndarray | None) -> int:
    assert keep is not None and int(keep.sum()) == 1
    return int(np.flatnonzero(keep)[0])


# --- Dynamo: replica counts, hysteresis, min-cost flow -----------------------------------------------------------


def test_replicas_follow_each_adapters_share_of_the_load() -> None:
    # 6 of 8 units of load over 8 slots: ceil(6) capped at the 4 workers; the other 2 units get 2 replicas
    assert active_replica_counts({"a": 6, "b": 2}, total_slots=8, workers=4) == {"a": 4, "b": 2}
    # more active adapters than slots: the most loaded keep one replica each, the rest are cut
    assert active_replica_counts({"a": 3, "b": 2, "c": 1}, total_slots=2, workers=4) == {"a": 1, "b": 1}
    # over the slots after rounding up: scaled down, every adapter keeps at least one
    counts = active_replica_counts({"a": 5, "b": 1, "c": 1}, total_slots=4, workers=4)
    assert sum(counts.values()) <= 4 + 1 and min(counts.values()) >= 1 and counts["a"] > counts["b"]


def test_scale_down_waits_out_the_cooldown_and_scale_up_is_immediate() -> None:
    allocator = DynamoAllocator(DynamoLoraParameters(scale_down_cooldown_ticks=3))
    assert allocator.hysteresis("a", 4, 1) == 4  # up at once
    allocator.tick = 10
    assert allocator.hysteresis("a", 2, 4) == 4  # first tick that asks: held
    allocator.tick = 12
    assert allocator.hysteresis("a", 2, 4) == 4  # two ticks later: still held
    allocator.tick = 13
    assert allocator.hysteresis("a", 2, 4) == 2  # three ticks: applied


def test_min_cost_flow_keeps_prior_hosts_and_respects_capacity() -> None:
    # a's cheapest new host is w0, but it is kept on w2 (negative cost); w0 holds one adapter only
    edges = {"a": [("w0", 1000), ("w1", 1001), ("w2", -248)], "b": [("w0", 1000), ("w1", 1001)]}
    assignment, overflow = min_cost_flow({"a": 1, "b": 1}, edges, {"w0": 1, "w1": 1, "w2": 1}, 10**9)
    assert assignment == {"a": {"w2"}, "b": {"w0"}} and overflow == 0
    # no room for a second replica of b anywhere it may go: one unit overflows
    assignment, overflow = min_cost_flow({"b": 2}, {"b": [("w0", 0)]}, {"w0": 1}, 10**9)
    assert assignment == {"b": {"w0"}} and overflow == 1


@pytest.mark.parametrize("algorithm", ["mcf", "hrw"])
def test_the_allocator_places_within_the_slots_and_sticks(algorithm: str) -> None:
    params = DynamoLoraParameters(algorithm=algorithm, timestep_seconds=3)
    allocator = DynamoAllocator(params)
    workers = {f"pod-{i}": 2 for i in range(4)}
    for t in range(20):  # a busy adapter and three quiet ones
        for _ in range(10):
            allocator.arrive("hot", float(t))
        for name in ("q1", "q2", "q3"):
            allocator.arrive(name, float(t))
    allocator.recompute(20.0, workers, {})
    table = {a: list(e.workers) for a, e in allocator.table.items()}
    assert len(table["hot"]) > 1  # its share of the load earns it several replicas
    per_worker = {w: sum(w in ws for ws in table.values()) for w in workers}
    assert max(per_worker.values()) <= 2  # within each worker's GPU slots
    allocator.recompute(23.0, workers, {})  # the same demand: nothing moves
    assert {a: list(e.workers) for a, e in allocator.table.items()} == table


def test_the_filter_sends_an_adapter_to_its_replicas_where_it_is_loaded() -> None:
    dynamo = DynamoLoraFilter(DynamoLoraParameters(algorithm="hrw"))
    now = [0.0]
    dynamo.clock = lambda: now[0]
    pool = PoolSnapshot([endpoint(i) for i in range(4)])
    request = SchedulingRequest(served_name="a")
    picked(dynamo(request, pool, cycle(pool)))
    # the only adapter with load has all of it: a replica on every worker
    assert sorted(dynamo.allocator.table["a"].workers) == [e.name for e in pool.endpoints]
    # an adapter the table does not know, loaded nowhere: any available worker
    assert dynamo.allocator.route("b", ["pod-0", "pod-1"], {}) == ["pod-0", "pod-1"]
    # an inactive one: its pin only
    dynamo.allocator.table["c"] = _Entry(hrw_rank("c", ["pod-0", "pod-1"])[:1], False)
    assert dynamo.allocator.route("c", ["pod-0", "pod-1"], {}) == hrw_rank("c", ["pod-0", "pod-1"])[:1]
    # once loaded on pod-2 and pod-3 and placed there, only those two serve it, in turn
    dynamo.allocator.table["a"].workers = ["pod-2", "pod-3"]
    dynamo.allocator.table["a"].active = True
    dynamo.allocator.next_tick = 1e9
    warm = PoolSnapshot([endpoint(0), endpoint(1), endpoint(2, {"a": GPU}), endpoint(3, {"a": GPU})])
    chosen = {picked(dynamo(request, warm, cycle(warm))) for _ in range(6)}
    assert chosen == {2, 3}
    # loaded on pod-3 only: the replica set's loaded worker
    one = PoolSnapshot([endpoint(0), endpoint(1), endpoint(2), endpoint(3, {"a": GPU})])
    assert {picked(dynamo(request, one, cycle(one))) for _ in range(4)} == {3}


def test_the_busy_threshold_steers_stage_two_off_busy_workers() -> None:
    def picks(threshold: float | None) -> set[int]:
        dynamo = DynamoLoraFilter(DynamoLoraParameters(algorithm="hrw", busy_threshold=threshold))
        dynamo.clock = lambda: 0.0
        dynamo.allocator.arrive("a", 0.0)
        dynamo.allocator.table = {}
        dynamo.allocator.next_tick = 1e9
        dynamo.allocator.table["a"] = _Entry(["pod-0", "pod-1"], True)
        pool = PoolSnapshot([endpoint(0, {"a": GPU}, kv=0.95), endpoint(1, {"a": GPU}, kv=0.1)])
        return {picked(dynamo(SchedulingRequest(served_name="a"), pool, cycle(pool))) for _ in range(6)}

    assert picks(None) == {0, 1}  # Dynamo's default: no busy detection, round robin over both
    assert picks(0.9) == {1}


def test_the_packaged_dynamo_config_runs_the_plugin() -> None:
    config = EndpointPickerConfig.load(peers.PEER_PREFIX + "dynamo-lora")
    scheduler = Scheduler(config)
    assert any(isinstance(step.run, DynamoLoraFilter) for step in scheduler.filters)
    pool = PoolSnapshot([endpoint(i) for i in range(4)])
    decision = scheduler.schedule(SchedulingRequest(served_name="x"), pool, np.random.default_rng(0))
    assert len(decision.indices) == 1


# --- llm-d-router predicted latency -------------------------------------------------------------------------------


def latency(predicted: list[float], **kw: object) -> PredictedLatencyFilter:
    plugin = PredictedLatencyFilter(PredictedLatencyParameters(error_sigma=0.0, epsilon_explore_neg=0.0, **kw))
    plugin.predictor = lambda _request, _pool: np.asarray(predicted, dtype=np.float64)
    return plugin


def test_the_positive_tier_is_kept_and_least_headroom_is_preferred() -> None:
    pool = PoolSnapshot([endpoint(i, busy=3) for i in range(3)])
    plugin = latency([3.0, 1.9, 0.2])  # pod-0 misses the 2 s SLO; pod-1 is closest to it
    counts = np.bincount([picked(plugin(SchedulingRequest(served_name="a"), pool, cycle(pool, s)))
                          for s in range(300)], minlength=3)
    assert counts[0] == 0 and counts[1] > 5 * counts[2]
    most = latency([3.0, 1.9, 0.2], headroom_selection_strategy="most")
    counts = np.bincount([picked(most(SchedulingRequest(served_name="a"), pool, cycle(pool, s)))
                          for s in range(300)], minlength=3)
    assert counts[0] == 0 and counts[2] > 5 * counts[1]


def test_all_negative_prefers_an_idle_endpoint_then_the_least_deficit() -> None:
    idle = PoolSnapshot([endpoint(0, busy=2), endpoint(1), endpoint(2, busy=2)])
    assert {picked(latency([3.0, 9.0, 2.5])(SchedulingRequest(served_name="a"), idle, cycle(idle, s)))
            for s in range(20)} == {1}
    busy = PoolSnapshot([endpoint(i, busy=2) for i in range(3)])
    counts = np.bincount([picked(latency([3.0, 9.0, 2.5])(SchedulingRequest(served_name="a"), busy, cycle(busy, s)))
                          for s in range(300)], minlength=3)
    assert counts[2] > counts[0] > counts[1]


def test_the_admitter_refuses_only_sheddable_requests_nothing_can_serve_in_time() -> None:
    busy = PoolSnapshot([endpoint(i, busy=2, queue=4, kv=0.5) for i in range(2)])
    plugin = latency([5.0, 6.0])
    with pytest.raises(PoolSaturatedError):
        plugin(SchedulingRequest(served_name="a", priority=-1), busy, cycle(busy))
    assert plugin(SchedulingRequest(served_name="a"), busy, cycle(busy)) is not None  # priority 0: admitted
    # an endpoint that runs nothing (a queue of its own does not count) lets it in, as does a cold one
    queued = PoolSnapshot([endpoint(0, busy=2, queue=4, kv=0.5), endpoint(1, busy=0, queue=4, kv=0.5)])
    assert plugin(SchedulingRequest(served_name="a", priority=-1), queued, cycle(queued)) is not None
    cold = PoolSnapshot([endpoint(0, busy=2, queue=4, kv=0.5), endpoint(1, busy=2, queue=4, kv=0.01)])
    assert plugin(SchedulingRequest(served_name="a", priority=-1), cold, cycle(cold)) is not None
    off = latency([5.0, 6.0], admission=False)
    assert off(SchedulingRequest(served_name="a", priority=-1), busy, cycle(busy)) is not None


def test_the_analytic_predictor_reads_queues_and_residency() -> None:
    plugin = PredictedLatencyFilter(PredictedLatencyParameters())
    pool = PoolSnapshot([endpoint(0, {"a": GPU}), endpoint(1, {"a": GPU}, queue=10), endpoint(2, {})])
    predicted = plugin.predictor(SchedulingRequest(served_name="a"), pool)
    assert predicted[0] < predicted[1]  # a queue ahead
    assert predicted[0] < predicted[2]  # the adapter to fetch


def test_the_packaged_predicted_latency_config_runs_the_plugin() -> None:
    scheduler = Scheduler(EndpointPickerConfig.load(peers.PEER_PREFIX + "llmd-predicted-latency"))
    assert any(isinstance(step.run, PredictedLatencyFilter) for step in scheduler.filters)
    pool = PoolSnapshot([endpoint(i) for i in range(3)])
    assert len(scheduler.schedule(SchedulingRequest(served_name="a"), pool, np.random.default_rng(0)).indices) == 1
