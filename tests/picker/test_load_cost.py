"""The prefill-queue scorer's load-cost mode: a pod that would load the revision counts its load time as requests
awaiting their first token, so a cold holder with a short queue takes a request from a warm pod with a long one."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from loraplane.api import Tier
from loraplane.picker.plugins import Cycle, PrefillQueueParameters, SchedulingRequest, prefill_queue_scorer
from loraplane.picker.scheduler import EndpointPickerConfig, Outcome, Scheduler
from loraplane.picker.snapshot import EndpointState, PoolSnapshot

DIGEST = "sha256:" + "a" * 64
OTHER = "sha256:" + "b" * 64
ADAPTER = "claims@v1"
REQUEST = SchedulingRequest(served_name=ADAPTER, digest=DIGEST)


def pod(i: int, tier: Tier | None = None, digest: str = DIGEST, **load: object) -> EndpointState:
    residency = {ADAPTER: (tier, digest)} if tier is not None else {}
    return EndpointState(name=f"pod-{i}", address=f"10.0.0.{i}:8000", residency=residency, **load)  # type: ignore[arg-type]


def queue(pool: PoolSnapshot, requests: list[int], tokens_each: int) -> None:
    """Each endpoint's requests awaiting their first token, every prompt ``tokens_each`` tokens long."""
    pool.in_flight[:] = pool.prefilling[:] = requests
    pool.prefill_tokens[:] = [n * tokens_each for n in requests]


def scores(pool: PoolSnapshot, unsaturated: list[bool] | None = None, **params: object) -> list[float]:
    scorer = prefill_queue_scorer(PrefillQueueParameters.model_validate({"capacity": 16, "loadCost": True, **params}))
    n = pool.size
    below = np.ones(n, dtype=np.bool_) if unsaturated is None else np.asarray(unsaturated)
    got = scorer(REQUEST, pool, Cycle(np.ones(n, dtype=np.bool_), np.zeros(n), below))
    assert got is not None
    return [round(float(s), 4) for s in got]


def test_a_pod_that_would_load_the_revision_counts_its_load_time_as_requests() -> None:
    pool = PoolSnapshot([pod(1, Tier.GPU), pod(2, Tier.CPU), pod(3, Tier.DISK), pod(4), pod(5, Tier.GPU, OTHER)])
    pool.prefilling[:] = [4, 0, 0, 0, 0]
    # GPU: 1 - 4/16; host: 0.02 s = 0.2 requests of 0.1 s; disk: 0.25 s = 2.5; absent (or another digest): a 3 s
    # fetch = 30 requests, more than the capacity
    assert scores(pool) == [0.75, 0.9875, 0.8438, 0.0, 0.0]
    # requests worth more seconds each make the same load cost fewer of them
    assert scores(pool, requestSeconds=0.25) == [0.75, 0.995, 0.9375, 0.25, 0.25]
    # saturated pods score nothing, warm or not
    assert scores(pool, [True, True, False, True, True]) == [0.75, 0.9875, 0.0, 0.0, 0.0]


def test_a_pods_measured_load_times_replace_the_defaults() -> None:
    slow_disk = pod(2, Tier.DISK, load_seconds=(0.05, 1.0, 4.0))
    pool = PoolSnapshot([pod(1, Tier.DISK), slow_disk])
    assert scores(pool) == [0.8438, 0.375]  # 1 s from this pod's disk = 10 requests


def test_the_default_config_sends_a_request_to_a_cold_holder_once_the_warm_queue_outgrows_the_load() -> None:
    scheduler = Scheduler.default()
    rng = np.random.default_rng(0)
    pool = PoolSnapshot([pod(1, Tier.GPU), pod(2, Tier.DISK)])
    queue(pool, [2, 0], 1_000)
    decision = scheduler.schedule(REQUEST, pool, rng)
    assert decision.endpoints[0] == "10.0.0.1:8000" and decision.outcome is Outcome.WARM_GPU
    # twelve 1,000-token prompts awaiting their first token on the GPU pod (still below saturation): ~1.2 s of
    # prefill ahead, against a 0.25 s read from the other pod's disk
    queue(pool, [12, 0], 1_000)
    assert scheduler.schedule(REQUEST, pool, rng).endpoints[0] == "10.0.0.2:8000"
    # a pod that lacks the revision altogether (a 3 s fetch) is no such alternative
    absent = PoolSnapshot([pod(1, Tier.GPU), pod(2)])
    queue(absent, [12, 0], 1_000)
    assert scheduler.schedule(REQUEST, absent, rng).endpoints[0] == "10.0.0.1:8000"


def test_the_default_config_counts_the_queue_by_its_prompts() -> None:
    """Two requests of 4,000-token prompts wait longer than the disk read; twelve of 50 tokens do not."""
    scheduler = Scheduler.default()
    rng = np.random.default_rng(0)
    pool = PoolSnapshot([pod(1, Tier.GPU), pod(2, Tier.DISK)])
    queue(pool, [2, 0], 4_000)
    assert scheduler.schedule(REQUEST, pool, rng).endpoints[0] == "10.0.0.2:8000"
    queue(pool, [12, 0], 50)
    assert scheduler.schedule(REQUEST, pool, rng).endpoints[0] == "10.0.0.1:8000"


def test_counted_by_tokens_the_queue_is_its_prompts_at_the_seconds_a_token() -> None:
    pool = PoolSnapshot([pod(1, Tier.GPU), pod(2, Tier.GPU), pod(3, Tier.DISK)])
    queue(pool, [4, 1, 0], 0)
    pool.prefill_tokens[:] = [400, 6_000, 0]
    # 400 tokens at 0.1 ms = 0.04 s = 0.4 requests of 0.1 s; 6,000 = 6 requests; the disk read 2.5 as before
    assert scores(pool, prefillSecondsPerToken=0.0001) == [0.975, 0.625, 0.8438]
    assert scores(pool) == [0.75, 0.9375, 0.8438]  # by count: the pod of one long prompt looked the least loaded


def test_the_default_config_runs_the_load_cost_mode() -> None:
    config = EndpointPickerConfig.load()
    spec = next(p for p in config.plugins if p.type == "prefill-queue-scorer")
    params = PrefillQueueParameters.model_validate(spec.parameters)
    assert params.load_cost and not params.warm_only and params.capacity == 10
    assert params.prefill_seconds_per_token == 0.0001


@pytest.mark.parametrize("params", [{"loadCost": True}, {"capacity": 16, "loadCost": True, "warmOnly": True},
                                    {"prefillSecondsPerToken": 0.0001}])
def test_load_cost_needs_a_capacity_and_excludes_warm_only(params: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        PrefillQueueParameters.model_validate(params)


def busy_holder_pool(staging: set[str] | None = None, loads_on_demand: bool = True) -> PoolSnapshot:
    """Pod 1 holds the revision but runs its one GPU slot's worth of another revision; pods 2 and 3 lack it, pod 2
    with a free slot, pod 3 running another revision too. Simulated pods (they load on demand) unless
    ``loads_on_demand`` is false: pods of a real runtime, which answer 404 for a revision they have not registered."""
    one_slot = {"gpu_slots": 1, "loads_on_demand": loads_on_demand}
    pool = PoolSnapshot([pod(1, Tier.DISK, **one_slot), pod(2, **one_slot), pod(3, **one_slot)],
                        staging=staging or ())  # fmt: skip
    pool.set_in_flight([{"other@v1": 2}, {}, {"third@v1": 1}])
    return pool


def test_a_request_whose_holders_have_no_room_may_go_to_a_pod_that_has() -> None:
    from loraplane.picker.plugins import ResidencyFilterParameters, residency_filter

    def kept(pool: PoolSnapshot, spill: bool) -> list[bool]:
        keep = residency_filter(ResidencyFilterParameters(spill_without_room=spill))
        n = pool.size
        got = keep(REQUEST, pool, Cycle(np.ones(n, dtype=np.bool_), np.zeros(n), np.ones(n, dtype=np.bool_)))
        assert got is not None
        return got.tolist()

    assert kept(busy_holder_pool(), spill=False) == [True, False, False]
    assert kept(busy_holder_pool(), spill=True) == [True, True, False]
    # a staging pool keeps its cold traffic waiting for the holders
    assert kept(busy_holder_pool({"pod-1"}), spill=True) == [True, False, False]
    # a holder with room: nothing widens
    roomy = busy_holder_pool()
    roomy.set_in_flight([{}, {}, {"third@v1": 1}])
    assert kept(roomy, spill=True) == [True, False, False]
    # the default config routes it to the pod with room instead of holding it for flow control
    decision = Scheduler.default().schedule(REQUEST, busy_holder_pool(), np.random.default_rng(0))
    assert decision.endpoints[0] == "10.0.0.2:8000" and decision.room
    # pods of a real runtime: the holder only, and the default config holds the request for flow control
    assert kept(busy_holder_pool(loads_on_demand=False), spill=True) == [True, False, False]
    decision = Scheduler.default().schedule(REQUEST, busy_holder_pool(loads_on_demand=False), np.random.default_rng(0))
    assert decision.endpoints == ("10.0.0.1:8000",) and decision.should_wait
