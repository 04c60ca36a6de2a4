"""The placement function: capacity in slots and bytes, spreading, churn, bursts, budgets, pins, priority."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.api import WarmPolicy
from loraplane.api.runtime import Tier
from loraplane.controller.placement import (
    AdapterDemand,
    Placement,
    PlacementConfig,
    PodCapacity,
    Rates,
    TenantBudget,
    gpu_loads,
    host_slots,
    is_burst,
    keep_until_replaced,
    minimum_gpu_loads,
    place,
    place_again,
)

MB = 1 << 20


#: one holder per revision with traffic (no extra disk copies: ``traffic_holders``, ``holder_spread``), where a test
#: checks every tier
ONE_HOLDER = PlacementConfig(traffic_holders=1, holder_spread=0)


def _pods(n: int, gpu: int = 4, cpu: int = 8, gpu_bytes: int | None = None) -> list[PodCapacity]:
    return [PodCapacity(f"pod-{i}", gpu_slots=gpu, cpu_slots=cpu, gpu_bytes=gpu_bytes) for i in range(n)]


def _demand(name: str, rate: float = 0.0, **kw: object) -> AdapterDemand:
    kw.setdefault("bytes", 10 * MB)
    return AdapterDemand(served_name=name, rates=Rates(rate, rate, rate), **kw)  # type: ignore[arg-type]


def _assert_capacity(pods: list[PodCapacity], demands: list[AdapterDemand], plan: Placement) -> None:
    sizes = {d.served_name: d.bytes for d in demands}
    for cap in pods:
        held = plan.pods[cap.name]
        for tier, slots, limit in ((Tier.GPU, cap.gpu_slots, cap.gpu_bytes), (Tier.CPU, cap.cpu_slots, cap.cpu_bytes)):
            names = [n for n, t in held.items() if t is tier]
            assert len(names) <= slots, (cap.name, tier, names)
            if limit is not None:
                assert sum(sizes[n] for n in names) <= limit


def _zipf_demands(n: int, seed: int, top_rate: float = 40.0) -> list[AdapterDemand]:
    rng = random.Random(seed)
    sizes = [4 * MB, 8 * MB, 16 * MB, 32 * MB]
    return [
        _demand(f"a{i:04d}@v1", top_rate / (i + 1) ** 1.1, bytes=rng.choice(sizes), tenant=f"t{i % 7}")
        for i in range(n)
    ]


def _perturb(demands: list[AdapterDemand], seed: int, change: float = 0.10) -> list[AdapterDemand]:
    rng = random.Random(seed)
    out = []
    for d in demands:
        f = 1 + rng.uniform(-change, change)
        out.append(AdapterDemand(served_name=d.served_name, bytes=d.bytes, rates=d.rates.scaled(f), tenant=d.tenant))
    return out


def test_every_demand_is_placed_within_capacity() -> None:
    pods = _pods(5, gpu=3, cpu=4)
    demands = _zipf_demands(60, seed=1)
    plan = place(pods, demands)
    _assert_capacity(pods, demands, plan)
    for d in demands:
        assert plan.tiers_of(d.served_name), d.served_name


def test_hot_adapter_is_spread_over_enough_pods_for_its_rate() -> None:
    plan = place(_pods(6), [_demand("hot@v1", 10.0), _demand("cold@v1", 0.5)], config=PlacementConfig(replica_rate=4))
    assert len(plan.replicas(Tier.GPU)["hot@v1"]) == 3  # ceil(10 / 4)
    assert len(plan.replicas(Tier.GPU)["cold@v1"]) == 1


def test_hot_adapters_land_on_different_pods() -> None:
    plan = place(_pods(3), [_demand("a@v1", 3.0), _demand("b@v1", 3.0), _demand("c@v1", 3.0)])
    gpu = plan.replicas(Tier.GPU)
    assert {next(iter(gpu[n])) for n in ("a@v1", "b@v1", "c@v1")} == {"pod-0", "pod-1", "pod-2"}


def test_bytes_limit_the_gpu_tier() -> None:
    pods = _pods(1, gpu=4, gpu_bytes=50 * MB)
    demands = [_demand(f"big{i}@v1", 5.0 - i, bytes=30 * MB) for i in range(3)]
    plan = place(pods, demands, config=PlacementConfig(burst_slots_per_pod=0))
    assert plan.replicas(Tier.GPU) == {"big0@v1": {"pod-0"}}  # a second 30 MB adapter would exceed 50 MB
    assert plan.pods["pod-0"]["big1@v1"] is Tier.CPU


def test_more_demand_than_slots_keeps_the_best_on_gpu_and_the_rest_on_cpu() -> None:
    pods = _pods(2, gpu=2, cpu=10)
    demands = [_demand(f"a{i}@v1", 1.0 + i) for i in range(6)]
    plan = place(pods, demands, config=PlacementConfig(burst_slots_per_pod=0, host_copies=0))
    assert set(plan.replicas(Tier.GPU)) == {"a5@v1", "a4@v1", "a3@v1", "a2@v1"}
    assert set(plan.replicas(Tier.CPU)) == {"a1@v1", "a0@v1"}


def test_pinned_adapter_keeps_a_gpu_slot_without_traffic() -> None:
    pods = _pods(1, gpu=2)
    demands = [_demand("pinned@v1", 0.0, pinned=True), _demand("hot@v1", 9.0), _demand("warm@v1", 8.0)]
    plan = place(pods, demands, config=PlacementConfig(burst_slots_per_pod=0))
    assert plan.pods["pod-0"]["pinned@v1"] is Tier.GPU
    assert plan.pods["pod-0"]["hot@v1"] is Tier.GPU
    assert plan.pods["pod-0"]["warm@v1"] is Tier.CPU


def test_gold_priority_wins_a_contested_slot() -> None:
    pods = _pods(1, gpu=1)
    demands = [_demand("std@v1", 2.0), _demand("gold@v1", 1.0, priority=10)]
    plan = place(pods, demands, config=PlacementConfig(burst_slots_per_pod=0))
    assert plan.pods["pod-0"] == {"gold@v1": Tier.GPU, "std@v1": Tier.CPU}


def test_tenant_budget_caps_gpu_bytes_and_says_why() -> None:
    pods = _pods(4, gpu=4)
    demands = [_demand(f"t{i}@v1", 5.0, tenant="greedy") for i in range(4)] + [_demand("other@v1", 1.0)]
    plan = place(pods, demands, budgets={"greedy": TenantBudget(gpu_bytes=25 * MB)})
    greedy_gpu = [n for n, pods_ in plan.replicas(Tier.GPU).items() for _ in pods_ if n.startswith("t")]
    assert len(greedy_gpu) == 2  # 2 x 10 MB fit in 25 MB, a third would not
    assert any("budget" in why for why in plan.notes.values())
    assert "other@v1" in plan.replicas(Tier.GPU)


def test_warm_policies_set_the_idle_floor() -> None:
    demands = [
        _demand("gpu@v1", warm_policy=WarmPolicy.GPU_PREFERRED),
        _demand("cpu@v1", warm_policy=WarmPolicy.CPU),
        _demand("lazy@v1", warm_policy=WarmPolicy.ON_DEMAND),
    ]
    plan = place(_pods(1), demands)
    assert plan.pods["pod-0"] == {"gpu@v1": Tier.GPU, "cpu@v1": Tier.CPU, "lazy@v1": Tier.DISK}


def test_required_placements_override_rates_and_eligibility_is_respected() -> None:
    pods = _pods(3, gpu=1)
    demands = [
        _demand("hot@v1", 3.0, eligible=frozenset({"pod-0"})),
        _demand("canary@v2", 0.0, required={"pod-0": Tier.GPU}, warm_policy=WarmPolicy.ON_DEMAND),
        _demand("old@v1", 0.0, required={"pod-1": Tier.CPU, "pod-2": Tier.CPU}, warm_policy=WarmPolicy.ON_DEMAND),
    ]
    plan = place(pods, demands, config=PlacementConfig(burst_slots_per_pod=0))
    assert plan.pods["pod-0"]["canary@v2"] is Tier.GPU
    assert plan.tiers_of("old@v1") == {"pod-1": Tier.CPU, "pod-2": Tier.CPU}
    assert set(plan.tiers_of("hot@v1")) == {"pod-0"}  # only eligible there; its GPU slot went to the canary
    assert plan.tiers_of("hot@v1")["pod-0"] is Tier.CPU


def test_a_canary_keeps_the_gpu_slot_it_holds_against_a_newer_requirement() -> None:
    """Two canaries require the one GPU slot of a pod: the one the previous plan put there keeps it (between its
    activation and its probe), whatever the demand order; the newcomer stays on the pod one tier lower."""
    pods = _pods(1, gpu=1, cpu=2)
    config = PlacementConfig(burst_slots_per_pod=0)
    holder = _demand("b@v1", 0.0, required={"pod-0": Tier.GPU}, warm_policy=WarmPolicy.ON_DEMAND, min_replicas=0)
    before = place(pods, [holder], config=config)
    assert before.pods["pod-0"] == {"b@v1": Tier.GPU}
    newcomer = _demand("a@v1", 0.0, required={"pod-0": Tier.GPU}, warm_policy=WarmPolicy.ON_DEMAND, min_replicas=0)
    after = place(pods, [newcomer, holder], previous=before, config=config)  # the newcomer comes first
    assert after.pods["pod-0"] == {"b@v1": Tier.GPU, "a@v1": Tier.CPU}
    assert after.notes == {"a@v1": "pod pod-0 has no GPU room for a required replica"}


def test_burst_is_detected_from_the_windows() -> None:
    config = PlacementConfig()
    assert is_burst(Rates(m5=5.0, h1=0.1, h24=0.01), config)
    assert not is_burst(Rates(m5=5.0, h1=4.0, h24=3.0), config)
    assert not is_burst(Rates(m5=0.01), config)  # too little to matter


def test_one_off_burst_takes_a_burst_slot_and_evicts_no_hot_adapter() -> None:
    pods = _pods(4, gpu=3)
    hot = [_demand(f"hot{i}@v1", 6.0 - i * 0.5) for i in range(8)]
    before = place(pods, hot)
    burst = AdapterDemand("batch@v1", bytes=10 * MB, rates=Rates(m5=20.0, h1=0.2, h24=0.05), tenant="batch")
    after = place(pods, [*hot, burst], previous=before)
    hot_gpu_before = {n: p for n, p in before.replicas(Tier.GPU).items()}
    hot_gpu_after = {n: p for n, p in after.replicas(Tier.GPU).items() if n != "batch@v1"}
    assert hot_gpu_after == hot_gpu_before
    assert len(after.replicas(Tier.GPU)["batch@v1"]) == 1
    assert gpu_loads(before, after) == 1


def test_burst_never_evicts_when_no_slot_is_free() -> None:
    pods = _pods(2, gpu=2)
    hot = [_demand(f"hot{i}@v1", 3.0) for i in range(4)]
    before = place(pods, hot, config=PlacementConfig(burst_slots_per_pod=0))
    burst = AdapterDemand("batch@v1", bytes=10 * MB, rates=Rates(m5=50.0))
    after = place(pods, [*hot, burst], previous=before, config=PlacementConfig(burst_slots_per_pod=0))
    assert "batch@v1" not in after.replicas(Tier.GPU)
    assert after.replicas(Tier.GPU) == before.replicas(Tier.GPU)
    assert after.tiers_of("batch@v1")


def test_unchanged_inputs_give_the_same_plan_and_no_churn() -> None:
    pods, demands = _pods(10, gpu=4), _zipf_demands(200, seed=3)
    first = place(pods, demands)
    second = place(pods, demands, previous=first)
    assert second.pods == first.pods
    assert gpu_loads(first, second) == 0


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_ten_percent_rate_change_moves_few_adapters(seed: int) -> None:
    pods, demands = _pods(20, gpu=6, cpu=16), _zipf_demands(400, seed=seed, top_rate=60.0)
    before = place(pods, demands)
    changed = _perturb(demands, seed)
    after = place(pods, changed, previous=before)
    moved = gpu_loads(before, after)
    minimum = minimum_gpu_loads(before, place(pods, changed))
    assert moved <= max(2 * minimum, 2), (moved, minimum)
    # from scratch, the same new rates would reshuffle far more
    assert gpu_loads(before, place(pods, changed)) >= moved


def test_lost_pod_replicas_are_replaced_elsewhere() -> None:
    pods = _pods(4, gpu=4)
    demands = [_demand("hot@v1", 7.0), *(_demand(f"x{i}@v1", 1.0) for i in range(5))]
    before = place(pods, demands)
    survivors = [p for p in pods if p.name != next(iter(sorted(before.replicas(Tier.GPU)["hot@v1"])))]
    after = place(survivors, demands, previous=before)
    assert len(after.replicas(Tier.GPU)["hot@v1"]) == 2
    assert set(after.pods) == {p.name for p in survivors}


@settings(max_examples=80, deadline=None)
@given(
    n_pods=st.integers(1, 6),
    gpu=st.integers(0, 4),
    cpu=st.integers(0, 4),
    rates=st.lists(st.floats(0, 30, allow_nan=False), min_size=1, max_size=25),
    pinned=st.sets(st.integers(0, 24), max_size=3),
    gpu_mb=st.one_of(st.none(), st.integers(0, 80)),
)
def test_invariants_hold_for_any_input(
    n_pods: int, gpu: int, cpu: int, rates: list[float], pinned: set[int], gpu_mb: int | None
) -> None:
    pods = _pods(n_pods, gpu=gpu, cpu=cpu, gpu_bytes=None if gpu_mb is None else gpu_mb * MB)
    demands = [
        _demand(f"a{i}@v1", r, pinned=i in pinned, bytes=(4 + i % 3 * 8) * MB, min_replicas=1 + i % 2)
        for i, r in enumerate(rates)
    ]
    plan = place(pods, demands)
    _assert_capacity(pods, demands, plan)
    for d in demands:
        assert len(plan.tiers_of(d.served_name)) >= min(d.min_replicas, n_pods)
    # re-planning only ever makes strict improvements, so it settles: a fixed point within a few rounds
    rounds = [plan]
    while len(rounds) < 4 and (len(rounds) == 1 or rounds[-1].pods != rounds[-2].pods):
        rounds.append(place(pods, demands, previous=rounds[-1]))
        _assert_capacity(pods, demands, rounds[-1])
    assert rounds[-1].pods == rounds[-2].pods, [r.pods for r in rounds]


def test_a_replica_pushed_off_the_gpu_is_demoted_to_cpu_not_dropped() -> None:
    pods = _pods(2, gpu=1, cpu=2)
    hot = _demand("hot@v1", 6.0)
    before = place(pods, [hot], config=PlacementConfig(burst_slots_per_pod=0))
    assert before.replicas(Tier.GPU)["hot@v1"] == {"pod-0", "pod-1"}
    canary = _demand("hot@v2", 0.0, required={"pod-0": Tier.GPU}, warm_policy=WarmPolicy.ON_DEMAND, min_replicas=0)
    after = place(pods, [hot, canary], previous=before, config=PlacementConfig(burst_slots_per_pod=0))
    assert after.pods["pod-0"] == {"hot@v2": Tier.GPU, "hot@v1": Tier.CPU}  # still served there, from host memory
    assert after.pods["pod-1"] == {"hot@v1": Tier.GPU}


def test_a_trickle_plans_like_an_idle_adapter_its_warm_policy_sets_the_floor() -> None:
    trickle = _demand("trickle@v1", 0.1, warm_policy=WarmPolicy.CPU)
    demands = [_demand("hot@v1", 5.0), trickle]
    plan = place(_pods(2), demands, config=ONE_HOLDER)
    assert "trickle@v1" not in plan.replicas(Tier.GPU)  # below gpu_min_rate: a planned load would be wasted
    assert list(plan.tiers_of("trickle@v1").values()) == [Tier.CPU]
    lower = place(_pods(2), demands, config=PlacementConfig(gpu_min_rate=0.05))
    assert len(lower.replicas(Tier.GPU)["trickle@v1"]) == 1
    # gpu-preferred: a GPU replica only while a slot is left over; any adapter with demand takes it
    preferred = _demand("trickle@v1", 0.1)
    assert len(place(_pods(1, gpu=2), [preferred]).replicas(Tier.GPU)["trickle@v1"]) == 1
    full = place(_pods(1, gpu=2), [preferred, _demand("a@v1", 0.3), _demand("b@v1", 0.3)],
                 config=PlacementConfig(burst_slots_per_pod=0))
    assert "trickle@v1" not in full.replicas(Tier.GPU)


def test_a_replica_goes_to_the_pod_that_already_holds_the_revision() -> None:
    pods = _pods(4, gpu=2, cpu=1)
    held_on_disk = Placement(pods={"pod-0": {}, "pod-1": {}, "pod-2": {}, "pod-3": {"rare@v1": Tier.DISK}})
    rare = _demand("rare@v1", 0.1, warm_policy=WarmPolicy.CPU)
    plan = place(pods, [rare], previous=held_on_disk, config=ONE_HOLDER)
    assert plan.tiers_of("rare@v1") == {"pod-3": Tier.CPU}  # not pod-0, which would have to fetch it first
    # when its holder has no host-memory room it stays there on disk rather than being copied to another pod
    other = _demand("other@v1", 0.15, warm_policy=WarmPolicy.CPU, eligible=frozenset({"pod-3"}))
    plan = place(pods, [rare, other], previous=held_on_disk, config=ONE_HOLDER)
    assert plan.tiers_of("other@v1") == {"pod-3": Tier.CPU}
    assert plan.tiers_of("rare@v1") == {"pod-3": Tier.DISK}
    # a first GPU replica is promoted in place too
    wanted = _demand("rare@v1", 1.0)
    assert place(pods, [wanted], previous=held_on_disk).replicas(Tier.GPU)["rare@v1"] == {"pod-3"}


def test_a_burst_is_promoted_where_it_is_held_and_a_small_one_gets_no_gpu_slot() -> None:
    pods = _pods(3, gpu=3)
    previous = Placement(pods={"pod-0": {}, "pod-1": {}, "pod-2": {"batch@v1": Tier.DISK}})
    big = AdapterDemand("batch@v1", bytes=10 * MB, rates=Rates(m5=2.0, h1=0.1, h24=0.05))
    assert place(pods, [big], previous=previous).replicas(Tier.GPU)["batch@v1"] == {"pod-2"}
    small = AdapterDemand("batch@v1", bytes=10 * MB, rates=Rates(m5=0.1, h1=0.001, h24=0.001),
                          warm_policy=WarmPolicy.CPU)
    assert is_burst(small.rates, PlacementConfig())
    assert place(pods, [small], previous=previous, config=ONE_HOLDER).tiers_of("batch@v1") == {"pod-2": Tier.CPU}


def test_a_burst_without_a_holder_goes_where_gold_traffic_is_lightest() -> None:
    pods = _pods(3, gpu=2)  # one slot per pod for steady demand, one for bursts
    gold = _demand("gold@v1", 0.5, priority=10)  # two warm pods (gold_min_replicas), score 2 -> 1 per replica
    std = _demand("std@v1", 3.0)  # one replica carrying 3: the most loaded pod, but no gold on it
    burst = AdapterDemand("batch@v1", bytes=10 * MB, rates=Rates(m5=2.0, h1=0.1, h24=0.05))
    plan = place(pods, [gold, std, burst])
    assert len(plan.replicas(Tier.GPU)["gold@v1"]) == 2
    (std_pod,) = plan.replicas(Tier.GPU)["std@v1"]
    assert plan.replicas(Tier.GPU)["batch@v1"] == {std_pod}


def test_a_gold_adapter_gets_a_second_warm_pod_a_standard_one_does_not() -> None:
    demands = [_demand("gold@v1", 1.0, priority=10), _demand("std@v1", 1.0)]
    plan = place(_pods(4), demands)
    assert len(plan.replicas(Tier.GPU)["gold@v1"]) == 2
    assert len(plan.replicas(Tier.GPU)["std@v1"]) == 1
    one = place(_pods(4), demands, config=PlacementConfig(gold_min_replicas=1))
    assert len(one.replicas(Tier.GPU)["gold@v1"]) == 1


def test_two_hot_adapters_left_on_one_pod_by_an_earlier_plan_get_a_replica_on_the_idlest_pod() -> None:
    # an idle start placed a and b together; now each asks for one replica (3.6 req/s < replica_rate), so keeping
    # the old plan leaves pod-0 with 7.2 req/s while pod-3 carries 0.6
    pods = _pods(4)
    previous = Placement(pods={
        "pod-0": {"a@v1": Tier.GPU, "b@v1": Tier.GPU}, "pod-1": {"c@v1": Tier.GPU},
        "pod-2": {"d@v1": Tier.GPU}, "pod-3": {"e@v1": Tier.GPU},
    })  # fmt: skip
    rates = {"a@v1": 3.6, "b@v1": 3.6, "c@v1": 3.6, "d@v1": 1.8, "e@v1": 0.6}
    demands = [_demand(name, rate) for name, rate in rates.items()]
    plan = place(pods, demands, previous=previous)
    gpu = plan.replicas(Tier.GPU)
    # a further replica where the load is lightest (pod-0 5.4, pod-3 2.4), then b's (pod-0 3.6, pod-2 3.6, at
    # most 1.25 x the mean); nothing moved
    assert gpu["a@v1"] == {"pod-0", "pod-3"} and gpu["b@v1"] == {"pod-0", "pod-2"}
    assert gpu["c@v1"] == {"pod-1"} and gpu["d@v1"] == {"pod-2"} and gpu["e@v1"] == {"pod-3"}
    # re-planning keeps it (no flapping), and a balanced pool gets no extra replica
    assert place(pods, demands, previous=plan).pods == plan.pods
    balanced = place(pods, [_demand(n, 3.6) for n in ("a@v1", "b@v1", "c@v1", "d@v1")])
    assert all(len(holders) == 1 for holders in balanced.replicas(Tier.GPU).values())


def test_an_idle_floor_on_the_busiest_pod_is_not_spread_over_the_free_slots() -> None:
    """The busiest pod's hot adapter can go nowhere else (eligible there only); the idle gpu-preferred revision
    beside it carries no load, so a further replica of it lowers nothing and it keeps its one floor replica (each of
    its replicas lowered the peak by a rounding error, and it took every free GPU slot of the pool)."""
    pods = _pods(6)
    hot = _demand("hot@v1", 30.0, eligible=frozenset({"pod-0"}))
    idle = _demand("idle@v1", warm_policy=WarmPolicy.GPU_PREFERRED, min_replicas=1)
    previous = Placement(pods={"pod-0": {"hot@v1": Tier.GPU, "idle@v1": Tier.GPU}})
    plan = place(pods, [hot, idle], previous=previous)
    assert plan.replicas(Tier.GPU)["hot@v1"] == {"pod-0"}
    assert plan.replicas(Tier.GPU)["idle@v1"] == {"pod-0"}


def test_a_gpu_placed_adapter_gets_a_host_copy_in_a_spare_slot_of_another_pod() -> None:
    pods = _pods(3, gpu=2, cpu=4)
    demands = [_demand("hot@v1", 2.0), _demand("idle@v1")]
    one_copy = PlacementConfig(host_copies=1)
    plan = place(pods, demands, config=one_copy)
    (gpu_pod,) = plan.replicas(Tier.GPU)["hot@v1"]
    copies = plan.replicas(Tier.CPU)["hot@v1"]
    assert len(copies) == 1 and gpu_pod not in copies
    assert "idle@v1" not in plan.replicas(Tier.CPU)  # no traffic, no copy
    # the next plan keeps the copy where it is (no churn), and more copies are a setting
    assert place(pods, demands, previous=plan, config=one_copy) == plan
    wider = place(pods, demands, config=PlacementConfig(host_copies=5))
    assert wider.replicas(Tier.CPU)["hot@v1"] == {p.name for p in pods} - {gpu_pod}
    # none by default
    assert PlacementConfig().host_copies == 0 and "hot@v1" not in place(pods, demands).replicas(Tier.CPU)


def test_host_copies_take_only_the_host_slots_nothing_else_wants() -> None:
    pods = _pods(2, gpu=1, cpu=1)
    demands = [_demand("hot@v1", 2.0), _demand("second@v1", 1.5), _demand("cold@v1", 0.1, warm_policy=WarmPolicy.CPU)]
    plan = place(pods, demands, config=PlacementConfig(host_copies=3))
    _assert_capacity(pods, demands, plan)
    assert plan.replicas(Tier.GPU) == {"hot@v1": {"pod-0"}, "second@v1": {"pod-1"}} or plan.replicas(Tier.GPU) == {
        "hot@v1": {"pod-1"}, "second@v1": {"pod-0"}}
    # one pod serves each of them: no traffic to spill, so an adapter with no GPU replica comes first
    assert "cold@v1" in plan.replicas(Tier.CPU)
    assert sum(len(pods_of) for pods_of in plan.replicas(Tier.CPU).values()) == 2


def test_a_copy_of_an_adapter_busier_than_one_pod_is_worth_the_traffic_beyond_it() -> None:
    # one host slot in the pool, on the pod without the busy adapter's GPU replicas
    pods = [PodCapacity("pod-0", 1, 0), PodCapacity("pod-1", 1, 0), PodCapacity("pod-2", 1, 1)]
    config = PlacementConfig(burst_slots_per_pod=0, host_copies=1)
    busy, other = _demand("busy@v1", 6.0), _demand("other@v1", 1.0)
    cold = _demand("cold@v1", 0.1, warm_policy=WarmPolicy.CPU)
    plan = place(pods, [busy, other, cold], config=config)
    assert plan.replicas(Tier.GPU) == {"busy@v1": {"pod-0", "pod-1"}, "other@v1": {"pod-2"}}
    assert plan.replicas(Tier.CPU) == {"busy@v1": {"pod-2"}}  # worth 6 - 4 = 2 requests/s, the cold one 0.1
    assert set(plan.tiers_of("cold@v1").values()) == {Tier.DISK}
    # an adapter kept off the GPU by its tenant's budget, busier than the copy is worth, gets the slot first
    capped = _demand("capped@v1", 3.0, tenant="capped")
    plan = place(pods, [busy, other, capped], budgets={"capped": TenantBudget(gpu_bytes=0)}, config=config)
    assert plan.replicas(Tier.CPU) == {"capped@v1": {"pod-2"}}


def test_an_idle_gpu_placed_adapter_claims_no_host_copy_whatever_its_weight() -> None:
    # a pinned gold adapter with no traffic keeps its GPU slot (its score is a tiny positive number times a large
    # gold weight); its copy is worth nothing, so the one host slot goes to the adapter that has traffic
    pods = [PodCapacity("pod-0", 1, 0), PodCapacity("pod-1", 0, 1)]
    config = PlacementConfig(burst_slots_per_pod=0, gold_weight=1e6, host_copies=1)
    idle = _demand("idle@v1", 0.0, priority=1, pinned=True)
    busy = _demand("busy@v1", 0.5, tenant="capped")
    plan = place(pods, [idle, busy], budgets={"capped": TenantBudget(gpu_bytes=0)}, config=config)
    assert plan.replicas(Tier.GPU) == {"idle@v1": {"pod-0"}}
    assert plan.replicas(Tier.CPU) == {"busy@v1": {"pod-1"}}


def test_hot_host_copies_are_not_crowded_out_by_colder_cpu_replicas_and_demotions() -> None:
    # four adapters busier than one pod, two GPU replicas each; a sweep of cold adapters and a demoted one could
    # fill every host slot
    pods = _pods(4, gpu=2, cpu=2)
    hot = [_demand(f"hot{i}@v1", 7.5 - i / 2) for i in range(4)]
    sweep = [_demand(f"sweep{i}@v1", 0.1) for i in range(8)]
    config = PlacementConfig(burst_slots_per_pod=0, host_copies=1)
    previous = place(pods, [*hot[:3], _demand("old@v1", 8.0)], config=config)
    assert len(previous.replicas(Tier.GPU)["old@v1"]) == 2
    demands = [*hot, *sweep, _demand("old@v1", 0.15)]  # old@v1 cooled down: it loses its GPU slots, is demoted
    plan = place(pods, demands, previous=previous, config=config)
    _assert_capacity(pods, demands, plan)
    gpu, cpu = plan.replicas(Tier.GPU), plan.replicas(Tier.CPU)
    for d in hot:
        name = d.served_name
        assert len(gpu[name]) == 2 and len(cpu.get(name, set())) == 1 and not gpu[name] & cpu[name], (name, plan.pods)
    # the slots left over still go to the colder adapters, demoted and swept: none is left empty
    assert sum(len(pods_of) for pods_of in cpu.values()) == 8 and "old@v1" in cpu
    # more copies are a setting that takes effect here: each adapter gets one on every pod without its GPU replicas
    wider = place(pods, demands, previous=previous, config=PlacementConfig(burst_slots_per_pod=0, host_copies=3))
    assert wider.replicas(Tier.CPU) == {d.served_name: {p.name for p in pods} - gpu[d.served_name] for d in hot}


def test_host_slots_leave_the_gpu_resident_adapters_their_place_in_the_host_cache() -> None:
    assert host_slots(16, 4) == 12
    assert host_slots(4, 4) == 1  # vLLM's default host cache: one slot still, to prewarm a revision
    assert host_slots(0, 4) == 0


def _gold_and_idle(gold_rate: float = 2.0, idle: int = 60, busy: int = 10) -> list[AdapterDemand]:
    """4 gold revisions, ``idle`` ones (a sweep to come) and ``busy`` standard ones with traffic: 8 + 10 GPU replicas
    needed, as many as 6 of 8 pods' 24 slots hold with one free slot each (slots are scarce: staging pays)."""
    gold = [_demand(f"gold-{i}@v1", gold_rate, priority=1, tenant="online") for i in range(4)]
    standard = [_demand(f"std-{i}@v1", 0.5, tenant="online") for i in range(busy)]
    return gold + standard + [_demand(f"sweep-{i:02d}@v1", tenant="batch") for i in range(idle)]


def _holders(plan: Placement, prefix: str, tiers: tuple[Tier, ...] = (Tier.CPU, Tier.DISK)) -> set[str]:
    """The pods holding a revision named ``prefix...`` at one of ``tiers`` (staged: host memory or disk)."""
    return {pod for pod, held in plan.pods.items() if any(n.startswith(prefix) and held[n] in tiers for n in held)}


#: staging at a quarter of the pods (the default), with a host copy per busy adapter (off by default): docs/controller.md
STAGING = PlacementConfig(staging_share=0.25, host_copies=1)


def test_idle_revisions_are_staged_on_a_quarter_of_the_pods_and_stay_there() -> None:
    pods = _pods(8, gpu=4, cpu=8)
    plan = place(pods, _gold_and_idle(), config=STAGING)
    staging = _holders(plan, "sweep-")
    assert len(staging) == 2  # staging_share 0.25 of 8 pods; without it the 60 revisions spread over all 8
    assert plan.staging == staging  # the route table names them: revisions no pod holds go there
    assert keep_until_replaced(plan, _gold_and_idle(), {}).staging == staging
    again = place(pods, _gold_and_idle(), previous=plan, config=STAGING)
    assert again.pods == plan.pods  # the same pods, plan after plan
    # a pool that keeps its idle revisions elsewhere keeps them there (the pods holding the most of them)
    elsewhere = Placement(pods={p.name: {} for p in pods})
    for i in range(60):
        elsewhere.pods[f"pod-{6 + i % 2}"][f"sweep-{i:02d}@v1"] = Tier.DISK
    kept = place(pods, _gold_and_idle(), previous=elsewhere, config=STAGING)
    assert _holders(kept, "sweep-") == {"pod-6", "pod-7"}
    # share 0: every pod stages
    spread = place(pods, _gold_and_idle(), config=dataclasses.replace(STAGING, staging_share=0))
    assert len(_holders(spread, "sweep-")) == 8
    assert spread.staging == frozenset()


def test_no_staging_without_gold_revisions_or_room_for_them_elsewhere() -> None:
    pods = _pods(8, gpu=4, cpu=8)
    standard = [AdapterDemand(d.served_name, d.bytes, d.rates, d.tenant) for d in _gold_and_idle()]
    # nobody to shield from the cold traffic
    assert len(_holders(place(pods, standard, config=STAGING), "sweep-")) == 8
    assert place(pods, standard, config=STAGING).staging == frozenset()
    # 13 gold revisions x gold_min_replicas 2 = 26 replicas: more than the 24 GPU slots of 6 pods
    busy = [_demand(f"gold-{i}@v1", 2.0, priority=1) for i in range(13)] + _gold_and_idle()[4:]
    assert len(_holders(place(pods, busy, config=STAGING), "sweep-")) == 8


def test_cold_traffic_on_the_staging_pods_moves_the_gold_replicas_off_them() -> None:
    pods = _pods(8, gpu=4, cpu=8)
    calm = place(pods, _gold_and_idle(), config=STAGING)
    staging = _holders(calm, "sweep-")
    gold_pods = set().union(*(calm.replicas(Tier.GPU)[f"gold-{i}@v1"] for i in range(4)))
    assert gold_pods & staging  # with no cold traffic the gold adapters may sit on staging pods
    # three staged revisions get their first requests: 0.3 req/s of cold traffic, all on the staging pods
    staged = sorted(n for n in calm.replicas(Tier.DISK) if n.startswith("sweep-") and n not in calm.replicas(Tier.GPU))
    swept = [_demand(d.served_name, 0.1, tenant="batch") if d.served_name in staged[:3] else d for d in _gold_and_idle()]
    plan = place(pods, swept, previous=calm, config=STAGING)
    assert _holders(plan, "sweep-") == staging
    for i in range(4):
        replicas = plan.replicas(Tier.GPU)[f"gold-{i}@v1"]
        assert len(replicas) >= 2 and not replicas & staging
        assert not any(pod in staging for pod in plan.tiers_of(f"gold-{i}@v1"))
    # no floor replica takes a staging pod's GPU slots meanwhile (they are for the cold traffic's own loads), and a
    # staging pod plans one replica at most
    assert not any(tier is Tier.GPU and n.startswith("sweep-") for pod in staging for n, tier in plan.pods[pod].items())
    assert all(sum(t is Tier.GPU for t in plan.pods[pod].values()) <= 1 for pod in staging)
    # the other pods give up their burst slot, so 11 gold adapters keep their 2 warm pods each: 22 replicas, more
    # than the 6 x 3 slots the other pods have beside their burst slots
    crowded = [_demand(f"gold-{i}@v1", 2.0, priority=1) for i in range(11)]
    before = place(pods, crowded + _gold_and_idle()[4:], previous=calm, config=STAGING)
    assert _holders(before, "gold-", (Tier.GPU,)) & staging
    plan = place(pods, crowded + swept[4:], previous=before, config=STAGING)
    for i in range(11):
        replicas = plan.replicas(Tier.GPU)[f"gold-{i}@v1"]
        assert len(replicas) >= 2 and not replicas & staging
    # gold asking for more replicas than the other pods have room for overflows onto the staging pods, one planned
    # replica on each (its other slots are for the cold traffic's loads), the least valuable ones
    busiest = _demand("gold-11@v1", 16.0, priority=1)  # asks for 4 replicas: 26 in all, 24 slots off the staging pods
    demands = [*crowded, busiest, *(d for d in swept[4:] if d.served_name.startswith("sweep-"))]
    plan = place(pods, demands, previous=place(pods, demands, previous=before, config=STAGING), config=STAGING)
    assert plan.replicas(Tier.GPU)["gold-11@v1"].isdisjoint(staging) and len(plan.replicas(Tier.GPU)["gold-11@v1"]) == 4
    assert [sum(t is Tier.GPU for t in plan.pods[pod].values()) for pod in sorted(staging)] == [1, 1]
    assert sum(len(plan.replicas(Tier.GPU)[f"gold-{i}@v1"]) for i in range(12)) == 26


def test_a_pool_whose_slots_are_not_scarce_stages_nothing() -> None:
    # 32 slots a pod: the 18 replicas the traffic needs leave free slots everywhere, so cold loads evict nobody, and
    # two staging pods would only concentrate the sweep's loads and prefill on themselves
    roomy = _pods(8, gpu=32, cpu=64)
    plan = place(roomy, _gold_and_idle(), config=STAGING)
    assert plan.staging == frozenset() and len(_holders(plan, "sweep-", (Tier.GPU, Tier.CPU, Tier.DISK))) == 8
    # the same traffic in 4-slot pods is scarce: staged apart
    assert len(place(_pods(8, gpu=4, cpu=8), _gold_and_idle(), config=STAGING).staging) == 2
    # before any traffic the gold minimum counts: 4 gold revisions x 2 leave roomy pods free, 12 fill 4-slot ones
    idle = [_demand(d.served_name, 0.0, priority=d.priority, tenant=d.tenant) for d in _gold_and_idle()]
    assert place(roomy, idle, config=STAGING).staging == frozenset()
    gold_only = [_demand(f"gold-{i}@v1", priority=1) for i in range(12)] + _gold_and_idle(busy=0)[4:]
    assert len(place(_pods(8, gpu=4, cpu=8), gold_only, config=STAGING).staging) == 2


def test_a_pool_with_no_idle_revision_stages_nothing() -> None:
    pods = _pods(8, gpu=4, cpu=8)
    demands = [d if d.priority else _demand(d.served_name, 0.05, tenant="batch") for d in _gold_and_idle()]
    plan = place(pods, demands, config=STAGING)
    assert plan.pods == place(pods, demands, config=dataclasses.replace(STAGING, staging_share=0)).pods
    again = place(pods, demands, previous=plan, config=STAGING)
    assert again.pods == place(pods, demands, previous=plan, config=dataclasses.replace(STAGING, staging_share=0)).pods


@pytest.mark.parametrize("seed", range(6))
def test_staging_plans_reach_a_fixed_point(seed: int) -> None:
    """Nothing changed, nothing moves: the staging set and the shield are read off the previous plan, so the plan
    after the one that reacted to a change is the same plan again."""
    rng = random.Random(seed)
    pods = _pods(8, gpu=4, cpu=8)
    demands = [_demand(f"gold-{i}@v1", rng.uniform(0.5, 12), priority=1) for i in range(rng.randint(2, 12))]
    demands += [_demand(f"std-{i}@v1", rng.choice([0.0, 0.0, 0.05, 0.1, 1.0])) for i in range(rng.randint(10, 80))]
    plan = place(pods, demands, config=STAGING)
    for _ in range(2):
        plan = place(pods, demands, previous=plan, config=STAGING)
    assert place(pods, demands, previous=plan, config=STAGING).pods == plan.pods


def test_the_disk_floor_fits_each_pods_disk_cache() -> None:
    # 2 pods whose disk caches hold 3 revisions of 10 MB each; 4 busy revisions take GPU replicas (on disk too)
    pods = [dataclasses.replace(p, disk_bytes=30 * MB) for p in _pods(2, gpu=2, cpu=2)]
    busy = [_demand(f"busy-{i}@v1", 5.0) for i in range(2)]
    trickle = [_demand(f"trickle-{i}@v1", 0.01) for i in range(6)]
    plan = place(pods, busy + trickle)
    for cap in pods:
        assert len(plan.pods[cap.name]) <= 3, plan.pods  # nothing beyond what the cache holds
    placed = {n for held in plan.pods.values() for n in held}
    assert {d.served_name for d in busy} <= placed  # real demand first
    left = [d.served_name for d in trickle if d.served_name not in placed]
    assert left and all(plan.notes[n] == "no disk room" for n in left)  # fetched on their first request
    # without a byte budget every revision gets its floor
    unbounded = place(_pods(2, gpu=2, cpu=2), busy + trickle)
    assert {d.served_name for d in busy + trickle} <= {n for held in unbounded.pods.values() for n in held}


def test_idle_revisions_wait_on_the_staging_pods_only_when_their_disks_fill() -> None:
    pods = [dataclasses.replace(p, disk_bytes=200 * MB) for p in _pods(8, gpu=4, cpu=8)]
    plan = place(pods, _gold_and_idle(), config=STAGING)
    staging = _holders(plan, "sweep-")
    assert len(staging) == 2  # the other pods take none of the 60, though the staging pods hold only 40
    assert sum(n.startswith("sweep-") for pod in staging for n in plan.pods[pod]) <= 40
    assert any(note == "no disk room" for note in plan.notes.values())


def test_floor_replicas_take_gpu_slots_only_while_every_trickle_has_one() -> None:
    """A trickle's on-demand load evicts whatever floor replica sits in the slot it takes, and the next plan loads
    that floor again: floors are planned only where the slots left hold every adapter with a trickle of traffic."""
    pod = _pods(1, gpu=4)
    config = PlacementConfig(burst_slots_per_pod=0)
    hot = _demand("hot@v1", 1.0)
    few = [hot] + [_demand(f"t{i}@v1", 0.05) for i in range(3)]
    assert set(place(pod, few, config=config).replicas(Tier.GPU)) == {"hot@v1", "t0@v1", "t1@v1", "t2@v1"}
    many = [hot, _demand("idle@v1")] + [_demand(f"t{i}@v1", 0.05) for i in range(4)]  # four trickles, three slots
    plan = place(pod, many, config=config)
    assert set(plan.replicas(Tier.GPU)) == {"hot@v1"}  # the hot adapter keeps its replica, no floor gets one
    assert set(plan.replicas(Tier.CPU)) == {"idle@v1"} | {f"t{i}@v1" for i in range(4)}  # in host memory instead
    pinned = _demand("pinned@v1", pinned=True)
    assert "pinned@v1" in place(pod, [*many, pinned], config=config).replicas(Tier.GPU)


def test_a_revision_is_held_on_traffic_holders_pods() -> None:
    pods = _pods(4, gpu=1, cpu=1)
    demands = [_demand("hot@v1", 1.0), _demand("trickle@v1", 0.05), _demand("idle@v1")]
    plan = place(pods, demands, config=PlacementConfig(holder_spread=0))
    assert len(plan.tiers_of("hot@v1")) == 3 and len(plan.tiers_of("trickle@v1")) == 3
    # idle too (a sweep yet to come): its traffic, when it comes, spreads over three holders
    assert len(plan.tiers_of("idle@v1")) == 3
    one = place(pods, demands, config=ONE_HOLDER)
    assert len(one.tiers_of("trickle@v1")) == 1 and len(one.tiers_of("idle@v1")) == 1
    # as far as the disks hold them: 10 MB revisions on 25 MB disks
    small = [PodCapacity(p.name, 1, 1, disk_bytes=25 * MB) for p in pods]
    many = [_demand(f"t{i}@v1", 0.05) for i in range(4)]
    held = place(small, many)
    assert all(sum(1 for h in held.pods.values() if n in h) >= 1 for n in (d.served_name for d in many))
    assert all(len(h) <= 2 for h in held.pods.values())


def test_every_revision_gets_its_floor_before_any_gets_further_holders() -> None:
    """A sweep of more revisions than the disks hold ``traffic_holders`` copies of: each is held somewhere (else its
    first requests wait for a fetch, longer than their deadline), the room left spreads the first ones further."""
    pods = [dataclasses.replace(p, disk_bytes=50 * MB) for p in _pods(4, gpu=1, cpu=1)]  # 20 copies of 10 MB
    busy = _demand("busy@v1", 1.0)
    sweep = [_demand(f"sweep-{i:02d}@v1") for i in range(14)]
    plan = place(pods, [busy, *sweep])
    assert len(plan.tiers_of("busy@v1")) == 3  # real demand first, on traffic_holders pods
    holders = [len(plan.tiers_of(d.served_name)) for d in sweep]
    assert min(holders) == 1 and sum(holders) == 20 - 3  # every one held, the rest of the room spread
    assert holders == sorted(holders, reverse=True)  # further holders in the disk order
    assert "no disk room" not in plan.notes.values()
    # with room for all, every one on traffic_holders pods
    assert {len(place(_pods(4, gpu=1, cpu=1), [busy, *sweep]).tiers_of(d.served_name)) for d in sweep} == {3}


def test_a_busy_revision_gets_holders_for_its_share_of_the_traffic_on_pods_with_free_gpu_slots() -> None:
    """Twelve pods with four GPU slots (one kept for bursts); one revision at 3 req/s, 21 at 1 and 40 trickles at
    0.1 (more revisions with traffic than GPU slots): the busy one has 3/28 of the traffic, ``ceil(8 x 3/28 x 12)`` =
    11 holders, the ones beyond three on pods the plan leaves a GPU slot free."""
    busy = _demand("busy@v1", 3.0)
    trickles = [_demand(f"r{i:02d}@v1", 0.1) for i in range(40)]
    demands = [busy] + [_demand(f"t{i:02d}@v1", 1.0) for i in range(21)] + trickles
    plan = place(_pods(12, gpu=4, cpu=8), demands)
    assert all(sum(t is Tier.GPU for t in held.values()) < 3 for held in plan.pods.values())
    assert len(plan.tiers_of("busy@v1")) == 11
    assert len(plan.tiers_of("t00@v1")) == 4  # 1/28 of the traffic: ceil(8 x 1/28 x 12)
    assert len(plan.tiers_of("r00@v1")) == 3  # traffic_holders
    unspread = place(_pods(12, gpu=4, cpu=8), demands, config=PlacementConfig(holder_spread=0))
    assert len(unspread.tiers_of("busy@v1")) == len(unspread.tiers_of("t00@v1")) == 3
    capped = place(_pods(12, gpu=4, cpu=8), demands, config=PlacementConfig(max_spread_holders=5))
    assert len(capped.tiers_of("busy@v1")) == 5
    # the share moving a little does not take holders away (stickiness), nor does a small rise add them
    calmer = [_demand("busy@v1", 2.7), *demands[1:]]
    assert len(place(_pods(12, gpu=4, cpu=8), calmer, previous=plan).tiers_of("busy@v1")) == 11
    assert len(place(_pods(12, gpu=4, cpu=8), calmer).tiers_of("busy@v1")) == 10
    # a pool whose GPU slots the plan fills: no holders beyond traffic_holders
    full = place(_pods(12, gpu=4, cpu=8), [busy] + [_demand(f"t{i:02d}@v1", 1.0) for i in range(40)] + trickles)
    assert all(sum(t is Tier.GPU for t in held.values()) == 3 for held in full.pods.values())
    assert len(full.tiers_of("busy@v1")) == 3
    # a pool whose revisions with traffic fit its GPU slots: each has its GPU replicas, no more holders
    assert len(place(_pods(12, gpu=4, cpu=8), demands[:22]).tiers_of("busy@v1")) == 3


def test_the_config_file_sets_traffic_holders() -> None:
    from loraplane.controller.config import PlacementSettings

    assert PlacementSettings.model_validate({"trafficHolders": 1}).traffic_holders == 1
    assert PlacementSettings().traffic_holders == PlacementConfig().traffic_holders == 3
    assert PlacementSettings.model_validate({"holderSpread": 0}).holder_spread == 0
    assert PlacementSettings().holder_spread == PlacementConfig().holder_spread


def test_a_sweep_of_idle_revisions_spreads_beyond_the_pods_with_free_gpu_slots() -> None:
    """Hot revisions fill the GPU slots of 12 of 16 pods; 12 idle ones get their floor in the 4 pods' free slots.
    With one holder each the sweep's burst would queue on those 4 pods; each idle revision is held on
    ``traffic_holders`` pods, so the burst spreads."""
    pods = _pods(16, gpu=1)
    hot = [_demand(f"hot{i}@v1", 1.0) for i in range(12)]
    sweep = [_demand(f"sweep{i}@v1") for i in range(12)]
    plan = place(pods, hot + sweep, config=PlacementConfig(burst_slots_per_pod=0))
    holders = {pod for d in sweep for pod in plan.tiers_of(d.served_name)}
    assert all(len(plan.tiers_of(d.served_name)) == 3 for d in sweep)
    assert len(holders) > 4
    alone = place(pods, hot + sweep, config=PlacementConfig(burst_slots_per_pod=0, traffic_holders=1))
    assert len({pod for d in sweep for pod in alone.tiers_of(d.served_name)}) < len(holders)


def test_a_part_placed_again_alone_keeps_each_revisions_disk_holders() -> None:
    """Two trickles placed again alone where the disks cannot hold three holders of every revision: one whose
    traffic just started (held on three pods, as a sweep's next revision is) and one whose traffic ended minutes
    ago (more requests in the hour: it comes first among trickles). Competing only for the room their own holders
    leave, the first handed two holders to the second -- two registrations, each a load stalling its pod's batch,
    for a revision nobody asks for any more. Each keeps its holders; they move between revisions in whole plans."""
    pods = [PodCapacity(f"pod-{i}", gpu_slots=4, cpu_slots=0, disk_bytes=3 * MB) for i in range(4)]
    ended = AdapterDemand("ended", MB, Rates(0.0, 0.1, 0.1), warm_policy=WarmPolicy.ON_DEMAND)
    started = AdapterDemand("started", MB, Rates(0.02, 0.01, 0.01), warm_policy=WarmPolicy.ON_DEMAND)
    fillers = [AdapterDemand(f"idle-{i}", MB, warm_policy=WarmPolicy.ON_DEMAND) for i in range(8)]
    before = Placement(pods={
        "pod-0": {"ended": Tier.DISK, "idle-0": Tier.DISK, "idle-1": Tier.DISK},
        "pod-1": {"started": Tier.DISK, "idle-2": Tier.DISK, "idle-3": Tier.DISK},
        "pod-2": {"started": Tier.DISK, "idle-4": Tier.DISK, "idle-5": Tier.DISK},
        "pod-3": {"started": Tier.DISK, "idle-6": Tier.DISK, "idle-7": Tier.DISK},
    })
    changed = {"ended": ended, "started": started}
    again, _ = place_again(before, pods, [ended, started, *fillers], changed, set(changed), PlacementConfig(), MB)
    assert again.replicas(Tier.DISK)["started"] == {"pod-1", "pod-2", "pod-3"}
    assert again.replicas(Tier.DISK)["ended"] == {"pod-0"}
