"""The residency filter's spillWhileStaging: a sweep's request whose holders have no GPU slot for it goes to a pod
that has one (a staging pod first, else the one with the fewest gold replicas on its GPU) instead of waiting in
flow control to its deadline."""

from __future__ import annotations

import numpy as np

from loraplane.api import Tier
from loraplane.picker.plugins import Cycle, ResidencyFilterParameters, residency_filter
from loraplane.picker.scheduler import EndpointPickerConfig, Scheduler
from loraplane.picker.snapshot import EndpointState, PoolSnapshot
from tests.picker.test_load_cost import ADAPTER, DIGEST, REQUEST

GOLD = "gold@v1"
GOLD_DIGEST = "sha256:" + "c" * 64


def kept(pool: PoolSnapshot, **params: bool) -> list[bool]:
    keep = residency_filter(ResidencyFilterParameters(spill_without_room=True, **params))
    n = pool.size
    got = keep(REQUEST, pool, Cycle(np.ones(n, dtype=np.bool_), np.zeros(n), np.ones(n, dtype=np.bool_)))
    assert got is not None
    return got.tolist()


def sweep_pool(staging: set[str], gold_on: set[int], loads_on_demand: bool = True) -> PoolSnapshot:
    """Pod 1 (staging) holds the sweep's revision on disk but runs its one GPU slot's worth of another; pods 2 and 3
    have a free slot, gold revisions GPU-resident on ``gold_on``; pod 4 runs another revision. Simulated pods (they
    load on demand) unless ``loads_on_demand`` is false."""
    def one(i: int) -> EndpointState:
        residency: dict[str, tuple[Tier, str | None]] = {ADAPTER: (Tier.DISK, DIGEST)} if i == 1 else {}
        if i in gold_on:
            residency[GOLD] = (Tier.GPU, GOLD_DIGEST)
        return EndpointState(name=f"pod-{i}", address=f"10.0.0.{i}:8000", residency=residency, gpu_slots=1,
                             loads_on_demand=loads_on_demand)

    pool = PoolSnapshot([one(i) for i in range(1, 5)], {GOLD: 1}, staging=staging)
    pool.set_in_flight([{"other@v1": 2}, {}, {}, {"third@v1": 1}])
    return pool


def test_a_sweeps_request_waits_for_its_holders_unless_spilling_while_staging() -> None:
    pool = sweep_pool({"pod-1"}, gold_on={2})
    assert kept(pool) == [True, False, False, False]  # spillWithoutRoom alone: held for the staging holder
    # spilling: no staging pod has room, so the pod with room and no gold replica (pod 3, not pod 2)
    assert kept(pool, spill_while_staging=True) == [True, False, True, False]
    # a second staging pod with room takes it before any other pod
    two = sweep_pool({"pod-1", "pod-2"}, gold_on={3})
    assert kept(two, spill_while_staging=True) == [True, True, False, False]
    # pods of a real runtime would answer 404: the request waits for its holder
    assert kept(sweep_pool({"pod-1"}, gold_on={2}, loads_on_demand=False), spill_while_staging=True) == [
        True, False, False, False]


def test_the_default_config_spills_while_staging() -> None:
    config = EndpointPickerConfig.load()
    spec = next(p for p in config.plugins if p.type == "residency-filter")
    params = ResidencyFilterParameters.model_validate(spec.parameters)
    assert params.spill_without_room and params.spill_while_staging
    decision = Scheduler(config).schedule(REQUEST, sweep_pool({"pod-1"}, gold_on={2}), np.random.default_rng(0))
    assert decision.endpoints[0] == "10.0.0.3:8000" and decision.room
