"""The peers' plugins (``loraplane.picker.peers``) on hand-built snapshots, and their packaged configs."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.api.vllm_metrics import LoadedAdapter
from loraplane.picker import peers
from loraplane.picker.cli import parser
from loraplane.picker.peers.plugins import (
    LeastFilterParameters,
    LoraAffinityFilterParameters,
    LoraAffinityParameters,
    LoraLoadStateParameters,
    LowQueueParameters,
    _least,
    least_request_scorer,
    lora_affinity_filter,
    lora_affinity_scorer,
    lora_load_state_scorer,
    low_queue_filter,
    rendezvous_hash,
)
from loraplane.picker.plugins import Cycle, SchedulingRequest, _NoParameters
from loraplane.picker.prefix import PrefixCacheParameters, PrefixCacheScorer
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from loraplane.picker.snapshot import EndpointState, PoolSnapshot

GPU, CPU = LoadedAdapter(True), LoadedAdapter(False)


def endpoint(i: int, running: set[str] = frozenset(), waiting: set[str] = frozenset(), slots: int = 4,
             loaded: dict[str, LoadedAdapter] | None = None, gpu_loaded: int | None = None, queue: int = 0,
             kv: float = 0.0, busy: int = 0) -> EndpointState:
    if gpu_loaded is None and loaded is not None:
        gpu_loaded = sum(1 for state in loaded.values() if state.gpu)
    return EndpointState(name=f"pod-{i}", address=f"10.0.0.{i + 1}:8000", queue_depth=queue, running=busy,
                         kv_utilization=kv, gpu_slots=slots, running_adapters=frozenset(running),
                         waiting_adapters=frozenset(waiting), loaded_adapters=loaded, gpu_loaded=gpu_loaded or 0)


def cycle(pool: PoolSnapshot, rng: np.random.Generator | None = None,
          candidates: np.ndarray | None = None) -> Cycle:
    n = pool.size
    keep = np.ones(n, dtype=np.bool_) if candidates is None else candidates
    return Cycle(keep, np.zeros(n), np.ones(n, dtype=np.bool_), rng=rng)


def scores(scorer, name: str | None, pool: PoolSnapshot, **kw) -> list[float]:  # type: ignore[no-untyped-def]
    return [round(v, 6) for v in scorer(SchedulingRequest(served_name=name), pool, cycle(pool, **kw)).tolist()]


# --- lora-affinity-scorer ------------------------------------------------------------------------------------------


def test_lora_affinity_tiers_running_room_waiting_none() -> None:
    pool = PoolSnapshot([
        endpoint(0, running={"a"}, waiting={"a"}),                                  # listed as running: 1.0
        endpoint(1, running={"b"}, waiting={"b"}),                                  # room (1 distinct < 4): 0.8
        endpoint(2, running={"b", "c", "d"}, waiting={"a", "b", "c", "d"}, slots=3),  # no room, waiting: 0.6
        endpoint(3, running={"b", "c", "d"}, waiting={"b", "c", "d"}, slots=3),      # no room: 0
        endpoint(4, slots=0),                                                       # max_lora unknown: no room
    ])
    scorer = lora_affinity_scorer(LoraAffinityParameters())
    assert scores(scorer, "a", pool) == [1.0, 0.8, 0.6, 0.0, 0.0]
    assert scores(scorer, None, pool) == [0.8, 0.8, 0.0, 0.0, 0.0]  # the base model is in no list


def test_pr_2625_counts_distinct_adapters_where_v0_10_0_summed_both_lists() -> None:
    """vLLM lists every busy adapter in both lists: with two busy adapters and max_lora 4 v0.10.0 counted 4 (no
    room), PR #2625 counts 2 (room)."""
    pool = PoolSnapshot([endpoint(0, running={"a", "b"}, waiting={"a", "b"}), endpoint(1, running={"c"}, waiting={"c"})])
    fixed = lora_affinity_scorer(LoraAffinityParameters(capacity_check="distinct"))
    released = lora_affinity_scorer(LoraAffinityParameters(capacity_check="listed"))
    assert scores(fixed, "x", pool) == [0.8, 0.8]
    assert scores(released, "x", pool) == [0.0, 0.8]
    assert LoraAffinityParameters().capacity_check == "distinct"  # the default is the merged fix


# --- lora-load-state-scorer ----------------------------------------------------------------------------------------


NO_BONUS = LoraLoadStateParameters(placement_bonus=0.0, headroom_bonus=0.0)


def test_load_state_tiers_without_bonuses() -> None:
    pool = PoolSnapshot([
        endpoint(0, loaded={"a": GPU, "b": CPU}),                                   # GPU resident: 1.0
        endpoint(1, loaded={"a": CPU, "b": GPU}),                                   # host cache only: 0.7
        endpoint(2, loaded={"b": GPU}),                                             # a free slot: 0.6
        endpoint(3, running={"b", "c"}, waiting={"b", "c"}, slots=3,
                 loaded={"b": GPU, "c": GPU, "d": GPU}),                            # d idle, unpinned: 0.3
        endpoint(4, running={"b", "c"}, waiting={"b", "c"}, slots=3,
                 loaded={"b": GPU, "c": GPU, "d": LoadedAdapter(True, pinned=True)}),  # all busy or pinned: 0
        endpoint(5, slots=4),                                                       # no residency gauges
    ])
    assert scores(lora_load_state_scorer(NO_BONUS), "a", pool) == [1.0, 0.7, 0.6, 0.3, 0.0, 0.6]


def test_load_state_bonuses_placement_home_and_headroom() -> None:
    pool = PoolSnapshot([endpoint(i, loaded={}) for i in range(4)])
    params = LoraLoadStateParameters()
    got = scores(lora_load_state_scorer(params), "adapter-x", pool)
    hashes = [rendezvous_hash("adapter-x", f"pod-{i}") for i in range(4)]
    home = int(np.argmax(hashes))
    scale = 1 - 0.06
    expected = [round(0.6 * scale + 0.03 * 1.0 + (0.03 if i == home else 0.0), 6) for i in range(4)]
    assert got == expected
    # among the candidates only: with the home filtered out, the next best hash gets the bonus
    keep = np.ones(4, dtype=np.bool_)
    keep[home] = False
    second = max((h, i) for i, h in enumerate(hashes) if i != home)[1]
    got = scores(lora_load_state_scorer(params), "adapter-x", pool, candidates=keep)
    assert got[second] == pytest.approx(0.6 * scale + 0.03 + 0.03)
    # no placement bonus where the adapter is already in a GPU slot of its home
    warm = PoolSnapshot([endpoint(i, loaded={"adapter-x": GPU} if i == home else {}) for i in range(4)])
    got = scores(lora_load_state_scorer(params), "adapter-x", warm)
    assert got[home] == pytest.approx(1.0 * scale + 0.03 * 0.75)


def test_rendezvous_is_fnv_64a_over_adapter_zero_byte_endpoint() -> None:
    assert rendezvous_hash("", "") == 0xAF63BD4C8601B7DF  # FNV-64a of the single zero byte
    assert rendezvous_hash("a", "b") != rendezvous_hash("b", "a")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["gpu", "cpu", "free", "idle", "full", "none"]),
                          st.integers(0, 4), st.booleans()), min_size=2, max_size=8))
def test_load_state_bonuses_never_cross_tiers(rows: list[tuple[str, int, bool]]) -> None:
    endpoints, tier_of = [], []
    order = {"gpu": 4, "cpu": 3, "free": 2, "none": 2, "idle": 1, "full": 0}
    for i, (tier, extra_free, _) in enumerate(rows):
        slots = 4
        if tier == "gpu":
            loaded = {"a": GPU, **{f"o{k}": GPU for k in range(3 - min(extra_free, 3))}}
        elif tier == "cpu":
            loaded = {"a": CPU, **{f"o{k}": GPU for k in range(4 - min(extra_free, 4))}}
        elif tier == "free":
            loaded = {f"o{k}": GPU for k in range(3 - min(extra_free, 3))}
        elif tier == "none":
            loaded = None
        else:
            loaded = {f"o{k}": GPU for k in range(slots)}
        busy = {f"o{k}" for k in range(slots)} if tier == "full" else {f"o{k}" for k in range(1, slots)}
        endpoints.append(endpoint(i, running=busy, waiting=busy, slots=slots, loaded=loaded))
        tier_of.append(order[tier])
    pool = PoolSnapshot(endpoints)
    got = scores(lora_load_state_scorer(LoraLoadStateParameters()), "a", pool)
    for (s1, t1), (s2, t2) in itertools.combinations(zip(got, tier_of, strict=True), 2):
        if t1 > t2:
            assert s1 > s2
        elif t2 > t1:
            assert s2 > s1


def test_load_state_base_model_scores_free_slot_share_and_invalid_parameters_fall_back() -> None:
    pool = PoolSnapshot([endpoint(0, loaded={"a": GPU, "b": GPU}), endpoint(1, loaded={}), endpoint(2, slots=0)])
    assert scores(lora_load_state_scorer(LoraLoadStateParameters()), None, pool) == [
        round(0.5 * 0.94, 6), 0.94, 0.94]
    crossing = LoraLoadStateParameters(cpu_resident_score=0.62, placement_bonus=0.03, headroom_bonus=0.03)
    assert not crossing.valid()  # 0.62 - 0.6 = 0.02 of gap is less than the 0.06 of bonuses
    default = scores(lora_load_state_scorer(LoraLoadStateParameters()), "a", pool)
    assert scores(lora_load_state_scorer(crossing), "a", pool) == default


# --- the legacy GIE filter chain -----------------------------------------------------------------------------------


def test_low_queue_filter_keeps_queues_below_the_threshold() -> None:
    pool = PoolSnapshot([endpoint(0, queue=127), endpoint(1, queue=128), endpoint(2, queue=3)])
    mask = low_queue_filter(LowQueueParameters())(SchedulingRequest(), pool, cycle(pool))
    assert mask.tolist() == [True, False, True]


def test_lora_affinity_filter_affinity_group_else_room_group() -> None:
    pool = PoolSnapshot([
        endpoint(0, running={"a"}, waiting={"a"}, slots=2),            # affinity (listed), no room (2 < 2 false)
        endpoint(1, running={"b"}, waiting=set(), slots=4),            # room
        endpoint(2, running={"b", "c"}, waiting={"b", "c"}, slots=4),  # no room (listed sum 4)
    ])
    always = lora_affinity_filter(LoraAffinityFilterParameters(threshold=1.0))
    never = lora_affinity_filter(LoraAffinityFilterParameters(threshold=0.0))
    rng = np.random.default_rng(0)
    assert always(SchedulingRequest(served_name="a"), pool, cycle(pool, rng)).tolist() == [True, False, False]
    assert never(SchedulingRequest(served_name="a"), pool, cycle(pool, rng)).tolist() == [False, True, False]
    # not listed anywhere: the room group
    assert always(SchedulingRequest(served_name="z"), pool, cycle(pool, rng)).tolist() == [False, True, False]
    # the 0.999 draw: about one request in a thousand goes to the room group
    legacy = lora_affinity_filter(LoraAffinityFilterParameters())
    picks = [legacy(SchedulingRequest(served_name="a"), pool, cycle(pool, rng)).tolist()[1] for _ in range(20_000)]
    assert 5 <= sum(picks) <= 45


def test_least_queue_and_kv_filters_exact_minimum_or_gie_range() -> None:
    pool = PoolSnapshot([endpoint(0, queue=2, kv=0.30), endpoint(1, queue=3, kv=0.10), endpoint(2, queue=2, kv=0.2),
                         endpoint(3, queue=9, kv=0.9)])
    request = SchedulingRequest()
    exact_q = _least("queue_depth", True)(LeastFilterParameters())
    range_q = _least("queue_depth", True)(LeastFilterParameters(gie_range=True))
    assert exact_q(request, pool, cycle(pool)).tolist() == [True, False, True, False]
    assert range_q(request, pool, cycle(pool)).tolist() == [True, True, True, False]  # 2 + (9 - 2) // 4 = 3
    exact_kv = _least("kv_utilization", False)(LeastFilterParameters())
    keep = np.asarray([True, False, True, False])
    assert exact_kv(request, pool, cycle(pool, candidates=keep)).tolist() == [False, True, True, False]  # min of candidates
    range_kv = _least("kv_utilization", False)(LeastFilterParameters(gie_range=True))
    assert range_kv(request, pool, cycle(pool)).tolist() == [True, True, True, False]  # 0.1 + 0.8 / 4 = 0.3


def test_least_request_scores_fewest_waiting_plus_running() -> None:
    pool = PoolSnapshot([endpoint(0, queue=1, busy=4), endpoint(1, queue=0, busy=2), endpoint(2, queue=3, busy=3)])
    assert scores(least_request_scorer(_NoParameters()), "a", pool) == [0.25, 1.0, 0.0]
    equal = PoolSnapshot([endpoint(0, busy=1), endpoint(1, busy=1)])
    assert least_request_scorer(_NoParameters())(SchedulingRequest(), equal, cycle(equal)) is None


def test_queue_scorer_all_equal_picks_as_llmd_gives_everyone_one() -> None:
    """loraplane's queue scorer gives no preference where queues are equal, llm-d's 1.0 to all: either way the KV
    scorer decides, and equal pods are a random tie."""
    scheduler = Scheduler(EndpointPickerConfig.load("peer:gie-default"))
    pool = PoolSnapshot([endpoint(0, queue=2, kv=0.5), endpoint(1, queue=2, kv=0.1), endpoint(2, queue=2, kv=0.1)])
    rng = np.random.default_rng(1)
    chosen = {scheduler.schedule(SchedulingRequest(served_name="a"), pool, rng).indices[0] for _ in range(50)}
    assert chosen == {1, 2}


def test_prefix_scorer_scores_saturated_endpoints_when_told_to_as_llmd() -> None:
    pool = PoolSnapshot([endpoint(0), endpoint(1)])
    hit = np.asarray([1.0, 0.5])
    saturated = np.asarray([False, True])
    for below_only, expected in ((True, [1.0, 0.0]), (False, [1.0, 0.5])):
        scorer = PrefixCacheScorer(PrefixCacheParameters(below_saturation_only=below_only))
        request = SchedulingRequest(served_name="a", prefix=scorer.hash_text("a", None, "x" * 256))
        c = Cycle(np.ones(2, dtype=np.bool_), np.zeros(2), ~saturated, prefix_hit=hit)
        assert scorer(request, pool, c).tolist() == expected


# --- the packaged configs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["least-request", "gie-default", "gie-lora-affinity", "gie-lora-filter",
                                  "llmd-load-state", "llmd-prefix"])
def test_packaged_peer_configs_load_by_name_and_say_their_source(name: str) -> None:
    assert name in peers.peer_configs()
    config = EndpointPickerConfig.load(f"peer:{name}")
    scheduler = Scheduler(config)
    assert not scheduler.request_plugins  # no flow control: the peers ship it off
    text = peers.peer_config_text(name)
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    assert re.search(r"Source:|Envoy", header) and "--lora-modules" in header and "on demand" in header
    assert parser().parse_args(["--pool", "p", "--config", f"peer:{name}"]).config == f"peer:{name}"


def test_peer_config_weights_are_the_peers() -> None:
    weights = {name: {ref: w for ref, _, w in Scheduler(EndpointPickerConfig.load(f"peer:{name}")).snapshot_scorers
                      + Scheduler(EndpointPickerConfig.load(f"peer:{name}")).scorers}
               for name in peers.peer_configs()}
    assert weights["gie-default"] == {"queue-scorer": 2, "kv-usage-scorer": 2}
    assert weights["gie-lora-affinity"] == {"queue-scorer": 2, "kv-usage-scorer": 2, "lora-affinity-scorer": 2}
    assert weights["llmd-load-state"] == {"queue-scorer": 2, "kv-usage-scorer": 2, "lora-load-state-scorer": 2}
    assert weights["llmd-prefix"] == {"queue-scorer": 2, "kv-usage-scorer": 2, "prefix-cache-scorer": 3}
    assert weights["least-request"] == {"least-request-scorer": 1}
    filters = [f.name for f in Scheduler(EndpointPickerConfig.load("peer:gie-lora-filter")).filters]
    assert filters == ["subset-hint-filter", "low-queue-filter", "lora-affinity-filter", "least-queue-filter",
                       "least-kv-cache-filter"]


def test_an_unknown_peer_config_is_refused() -> None:
    with pytest.raises(ValueError, match="no packaged peer config 'nope'"):
        EndpointPickerConfig.load("peer:nope")
    with pytest.raises(SystemExit):
        parser().parse_args(["--pool", "p", "--config", "peer:nope"])
