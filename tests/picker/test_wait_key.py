"""``Scheduler.still_waits`` never keeps a request waiting that a decision would send: over random pools (holders,
slots, fetches, saturation) and random changes of the in-flight counts, whenever it says "still waits" a whole
decision says so too, and it says "decide again" when a pod the request could use changed."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from loraplane.api import Tier
from loraplane.picker.plugins import SchedulingRequest
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from loraplane.picker.snapshot import EndpointState, InFlightTracker, PoolSnapshot

DIGEST = "sha256:" + "a" * 64
CLAIMS = SchedulingRequest("claims@v1", DIGEST)
OTHER = "sha256:" + "b" * 64
OTHERS = [f"other-{i}@v1" for i in range(4)]
DEFAULT = EndpointPickerConfig.load().model_dump(by_alias=True)
TWO_IN_FLIGHT = EndpointPickerConfig.load().model_dump(by_alias=True)
TWO_IN_FLIGHT["saturationDetector"]["inFlightThreshold"] = 2  # saturation is reached in a few requests
#: without the residency filter every pod is a candidate, holder or not (a fetch there blocks room)
ANY_POD = {**TWO_IN_FLIGHT, "schedulingProfiles": [
    {**profile, "plugins": [p for p in profile["plugins"] if p["pluginRef"] != "residency-filter"]}
    for profile in TWO_IN_FLIGHT["schedulingProfiles"]]}


def random_pool(rng: random.Random) -> PoolSnapshot:
    rows = []
    for _ in range(rng.randint(2, 8)):
        residency = {name: (Tier.GPU, OTHER) for name in OTHERS if rng.random() < 0.5}
        if rng.random() < 0.5:
            residency["claims@v1"] = (rng.choice([Tier.GPU, Tier.CPU, Tier.DISK]), DIGEST)
        rows.append(residency)
    rows[0].setdefault("claims@v1", (Tier.DISK, DIGEST))  # some pod holds it
    return PoolSnapshot([EndpointState(name=f"pod-{i}", address=f"10.0.0.{i}:8000", gpu_slots=rng.randint(1, 2),
                                       residency=residency)  # type: ignore[arg-type]
                         for i, residency in enumerate(rows)])


def change(rng: random.Random, pool: PoolSnapshot, tracker: InFlightTracker, sent: list[tuple[str, str]]) -> None:
    """A request starts somewhere, or one in flight finishes."""
    if sent and rng.random() < 0.5:
        tracker.finish(*sent.pop(rng.randrange(len(sent))))
        return
    request = (rng.choice(pool.addresses), rng.choice([*OTHERS, "claims@v1"]))
    tracker.start(*request)
    sent.append(request)


@pytest.mark.parametrize("config", [TWO_IN_FLIGHT, ANY_POD], ids=["holders", "any-pod"])
def test_still_waits_only_when_a_decision_would_wait(config: dict[str, object]) -> None:
    scheduler = Scheduler(EndpointPickerConfig.model_validate(config))
    decide = np.random.default_rng(0)
    rng = random.Random(0)
    counted = {"still waits": 0, "decide again": 0}
    for _ in range(5000):
        pool, tracker, sent = random_pool(rng), InFlightTracker(), []
        tracker.attach(pool)
        for _ in range(rng.randint(2, 14)):
            change(rng, pool, tracker, sent)
        decision = scheduler.schedule(CLAIMS, pool, decide)
        key = decision.wait_key
        assert (key is not None) == decision.should_wait
        if key is None:
            continue
        for _ in range(rng.randint(1, 2)):
            change(rng, pool, tracker, sent)
        if scheduler.still_waits(CLAIMS, pool, key):
            counted["still waits"] += 1
            assert scheduler.schedule(CLAIMS, pool, decide).should_wait
        else:
            counted["decide again"] += 1
    assert min(counted.values()) >= 10, counted  # both answers were exercised


def test_a_new_report_always_means_decide_again() -> None:
    scheduler = Scheduler.default()
    pool = PoolSnapshot([EndpointState(name="pod-0", address="10.0.0.0:8000", gpu_slots=1,
                                       residency={"claims@v1": (Tier.DISK, DIGEST)})])
    tracker = InFlightTracker()
    tracker.attach(pool)
    tracker.start("10.0.0.0:8000", "other-0@v1")  # its one slot is taken: no room for claims
    key = scheduler.schedule(CLAIMS, pool, np.random.default_rng(0)).wait_key
    assert key is not None and scheduler.still_waits(CLAIMS, pool, key)
    pool.update_endpoint(0, replace(pool.endpoints[0], gpu_slots=2))
    assert not scheduler.still_waits(CLAIMS, pool, key)
    assert not scheduler.schedule(CLAIMS, pool, np.random.default_rng(0)).should_wait


HOLDS_CLAIMS = {"claims@v1": (Tier.DISK, DIGEST)}
HELD = {name: (Tier.GPU, OTHER) for name in OTHERS[:2]}


@pytest.mark.parametrize(("config", "residency", "slots", "before", "after"), [
    # claims joins the batch of its own requests on pod-0 (room there whatever the slots)
    (DEFAULT, HOLDS_CLAIMS | HELD, 1, ["other-0@v1"], ["claims@v1"]),
    # two requests of one adapter instead of two adapters: a GPU slot frees
    (DEFAULT, HOLDS_CLAIMS | HELD, 2, ["other-0@v1", "other-1@v1"], ["other-0@v1", "other-0@v1"]),
    # a pod without claims (a candidate when the profile has no residency filter) ends its fetch
    (ANY_POD, HELD, 2, ["other-2@v1"], ["other-0@v1"]),
], ids=["revision-in-flight", "slot-freed", "fetch-ended"])
def test_the_same_count_in_flight_but_room_for_the_revision_means_decide_again(
        config: dict[str, object], residency: dict[str, tuple[Tier, str]], slots: int, before: list[str],
        after: list[str]) -> None:
    scheduler = Scheduler(EndpointPickerConfig.model_validate(config))
    pool = PoolSnapshot([EndpointState(name="pod-0", address="10.0.0.0:8000", gpu_slots=slots,
                                       residency=residency)])  # type: ignore[arg-type]
    tracker = InFlightTracker()
    tracker.attach(pool)
    for name in before:
        tracker.start("10.0.0.0:8000", name)
    key = scheduler.schedule(CLAIMS, pool, np.random.default_rng(0)).wait_key
    assert key is not None
    for name in before:
        tracker.finish("10.0.0.0:8000", name)
    for name in after:
        tracker.start("10.0.0.0:8000", name)
    assert not scheduler.still_waits(CLAIMS, pool, key)
    assert not scheduler.schedule(CLAIMS, pool, np.random.default_rng(0)).should_wait
