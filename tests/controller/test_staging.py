"""The staging rules (``controller/loraplane/controller/staging.py``), each predicate on small hand-made inputs: idle revisions, floors,
whether floors fit, which pods stage, the shield and what follows from it."""

from __future__ import annotations

from dataclasses import dataclass

from loraplane.api.runtime import Tier
from loraplane.controller.placement import PlacementConfig
from loraplane.controller.staging import (
    Staging,
    floors_fit,
    is_floor,
    is_idle,
    shields_staging,
    staging_pods,
)

#: a quarter of the pods stage (two of eight); floors below 0.2 requests/s; two replicas per gold revision
CONFIG = PlacementConfig(staging_share=0.25, gpu_min_rate=0.2, gold_min_replicas=2)


@dataclass(frozen=True)
class Rev:
    """What the staging rules read of a revision."""

    rate: float = 0.0
    need: int = 0
    gold: bool = False
    pinned: bool = False


IDLE = Rev()
TRICKLE = Rev(rate=0.1)
GOLD = Rev(rate=1.0, need=2, gold=True)


def _pods(n: int, slots: int = 4) -> dict[str, int]:
    return {f"pod-{i}": slots for i in range(n)}


def test_a_revision_is_idle_only_without_traffic() -> None:
    assert is_idle(IDLE)
    assert not is_idle(TRICKLE)


def test_a_floor_is_below_gpu_min_rate_and_not_pinned() -> None:
    assert is_floor(IDLE, CONFIG) and is_floor(TRICKLE, CONFIG)
    assert not is_floor(Rev(rate=0.2), CONFIG)  # at gpu_min_rate: real demand
    assert not is_floor(Rev(rate=0.1, pinned=True), CONFIG)


def test_floors_fit_where_the_slots_left_hold_every_trickle() -> None:
    busy = [Rev(rate=5.0, need=3), TRICKLE, TRICKLE]
    assert floors_fit(busy, free_slots=5, config=CONFIG)  # 3 replicas + 2 trickles in 5 slots
    assert not floors_fit(busy, free_slots=4, config=CONFIG)
    # an idle revision needs no slot of its own (its loads come with a sweep), a floor's own need counts for nothing
    assert floors_fit([Rev(rate=5.0, need=3), IDLE, Rev(rate=0.1, need=1)], free_slots=4, config=CONFIG)


def _sweep_pool() -> tuple[dict[str, int], dict[str, Rev]]:
    """8 pods of 4 slots; 9 gold revisions (18 replicas: the other 6 pods' 24 slots less one free each, scarce)
    and an idle sweep."""
    revisions: dict[str, Rev] = {f"gold-{i}": GOLD for i in range(9)}
    revisions.update({f"sweep-{i}": IDLE for i in range(4)})
    return _pods(8), revisions


def test_staging_pods_are_the_share_that_held_the_most_idle_revisions() -> None:
    pods, revisions = _sweep_pool()
    previous = {"sweep-0": {"pod-5": Tier.DISK, "pod-6": Tier.CPU}, "sweep-1": {"pod-6": Tier.DISK},
                "gold-0": {"pod-0": Tier.GPU, "pod-1": Tier.CPU}}
    assert staging_pods(pods, revisions, previous, CONFIG) == {"pod-5", "pod-6"}


def test_staging_pods_then_those_with_the_fewest_gold_gpu_replicas() -> None:
    pods, revisions = _sweep_pool()
    previous = {f"gold-{i}": {f"pod-{i % 3}": Tier.GPU} for i in range(8)}  # pods 0-2 hold the gold replicas
    assert staging_pods(pods, revisions, previous, CONFIG) == {"pod-3", "pod-4"}


def test_every_pod_stages_when_the_share_rounds_to_none_or_all() -> None:
    pods, revisions = _sweep_pool()
    revisions.update({f"gold-{i}": GOLD for i in range(9, 12)})  # 24 replicas: scarce even on all 8 pods
    assert staging_pods(pods, revisions, {}, PlacementConfig(staging_share=0.1)) == set(pods)  # 0.8 pods
    # (all of them staging would leave no room for the gold replicas either: the rule is a shortcut)
    assert staging_pods(pods, revisions, {}, PlacementConfig(staging_share=1.0)) == set(pods)


def test_every_pod_stages_when_no_revision_is_idle() -> None:
    pods, revisions = _sweep_pool()
    busy = {name: rev if rev.gold else TRICKLE for name, rev in revisions.items()}
    assert staging_pods(pods, busy, {}, CONFIG) == set(pods)


def test_every_pod_stages_without_gold_revisions() -> None:
    pods, revisions = _sweep_pool()
    plain = {name: Rev(rate=rev.rate, need=4) if rev.gold else rev for name, rev in revisions.items()}  # 32 needed
    assert staging_pods(pods, plain, {}, CONFIG) == set(pods)


def test_every_pod_stages_when_the_other_pods_cannot_hold_the_gold_minimum() -> None:
    pods, revisions = _sweep_pool()
    revisions.update({f"gold-{i}": GOLD for i in range(9, 13)})  # 26 gold replicas, 24 slots off two staging pods
    assert staging_pods(pods, revisions, {}, CONFIG) == set(pods)
    del revisions["gold-12"]  # 24: they fit
    assert len(staging_pods(pods, revisions, {}, CONFIG)) == 2


def test_every_pod_stages_where_slots_are_not_scarce() -> None:
    pods, revisions = _sweep_pool()
    assert len(staging_pods(pods, revisions, {}, CONFIG)) == 2  # 18 gold replicas: 24 slots less 6 free
    few = {name: rev for name, rev in revisions.items() if name not in ("gold-0", "gold-1", "gold-2")}
    assert staging_pods(pods, few, {}, CONFIG) == set(pods)  # 12 leave every other pod free slots
    # what the traffic asks for counts as well as the gold minimum (floors' needs do not)
    few["busy"] = Rev(rate=8.0, need=6)
    assert len(staging_pods(pods, few, {}, CONFIG)) == 2
    few["busy"] = Rev(rate=0.1, need=6)
    assert staging_pods(pods, few, {}, CONFIG) == set(pods)


STAGING = frozenset({"pod-6", "pod-7"})


def test_the_staging_pods_are_shielded_once_cold_traffic_shows_on_them() -> None:
    previous = {"sweep-0": {"pod-6": Tier.DISK}, "sweep-1": {"pod-7": Tier.CPU}, "gold-0": {"pod-0": Tier.GPU}}
    calm = {"sweep-0": IDLE, "sweep-1": IDLE, "gold-0": GOLD}
    assert not shields_staging(STAGING, 8, calm, previous, CONFIG)
    cold = {**calm, "sweep-0": TRICKLE, "sweep-1": TRICKLE}  # 0.2 requests/s on the staging pods
    assert shields_staging(STAGING, 8, cold, previous, CONFIG)
    assert not shields_staging(STAGING, 8, {**cold, "sweep-1": IDLE}, previous, CONFIG)  # 0.1 only


def test_only_revisions_held_on_staging_pods_alone_count_as_cold_traffic() -> None:
    previous = {"sweep-0": {"pod-6": Tier.DISK, "pod-0": Tier.DISK}, "sweep-1": {"pod-7": Tier.CPU}}
    revisions = {"sweep-0": TRICKLE, "sweep-1": TRICKLE}
    assert not shields_staging(STAGING, 8, revisions, previous, CONFIG)  # sweep-0 is held on pod-0 too
    # a revision with real demand is no cold traffic, however much it carries
    assert not shields_staging(STAGING, 8, {"sweep-1": Rev(rate=5.0, need=2)}, previous, CONFIG)


def test_no_shield_while_every_pod_stages() -> None:
    previous = {"sweep-0": {"pod-0": Tier.DISK}, "sweep-1": {"pod-0": Tier.CPU}}
    cold = {"sweep-0": TRICKLE, "sweep-1": TRICKLE}  # 0.2 requests/s of cold traffic
    assert not shields_staging(frozenset({"pod-0"}), 1, cold, previous, CONFIG)


def _staging(shielded: bool, apart: bool = True) -> Staging:
    pool = frozenset(_pods(8))
    return Staging(STAGING if apart else pool, pool, shielded, CONFIG)


def test_of_plans_the_staging_pods_and_their_shield() -> None:
    pods, revisions = _sweep_pool()
    previous = {"sweep-0": {"pod-5": Tier.DISK}, "sweep-1": {"pod-6": Tier.DISK},
                "sweep-2": {"pod-5": Tier.DISK, "pod-6": Tier.DISK}}
    calm = Staging.of(pods, revisions, previous, CONFIG)
    assert (calm.pods, calm.pool, calm.shielded) == ({"pod-5", "pod-6"}, set(pods), False)
    revisions.update({"sweep-0": TRICKLE, "sweep-1": TRICKLE})  # the sweep's first requests
    cold = Staging.of(pods, revisions, previous, CONFIG)
    assert (cold.pods, cold.shielded) == ({"pod-5", "pod-6"}, True)


def test_routed_names_the_staging_pods_only_while_they_stage_apart() -> None:
    assert _staging(False).apart and _staging(False).routed == STAGING
    assert not _staging(False, apart=False).apart and _staging(False, apart=False).routed == frozenset()


def test_idle_revisions_are_hosted_on_the_staging_pods_only() -> None:
    staging = _staging(False)
    assert set(staging.hosts(IDLE)) == STAGING
    assert set(staging.hosts(TRICKLE)) == staging.pool


def test_a_shielded_staging_pod_holds_no_gold_revision() -> None:
    assert _staging(True).shields(GOLD, "pod-6")
    assert not _staging(True).shields(GOLD, "pod-0")  # not a staging pod
    assert not _staging(True).shields(TRICKLE, "pod-6")  # not gold
    assert not _staging(False).shields(GOLD, "pod-6")  # not shielded


def test_no_floor_replica_of_a_non_gold_revision_while_shielded() -> None:
    assert _staging(True).floor_barred(TRICKLE)
    assert not _staging(True).floor_barred(Rev(rate=0.1, gold=True))
    assert not _staging(True).floor_barred(Rev(rate=1.0, need=1))  # real demand
    assert not _staging(False).floor_barred(TRICKLE)


def test_while_shielded_a_staging_pod_plans_one_gpu_replica_and_the_others_keep_no_burst_slot() -> None:
    assert _staging(True).gpu_reserve("pod-6", 4, reserve=1) == 3
    assert _staging(True).gpu_reserve("pod-6", 0, reserve=0) == 0
    assert _staging(True).gpu_reserve("pod-0", 4, reserve=1) == 0
    assert _staging(False).gpu_reserve("pod-6", 4, reserve=1) == 1
