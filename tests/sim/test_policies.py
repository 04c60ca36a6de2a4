"""The simulator's loraplane glue: the picker config it runs with."""

from __future__ import annotations

import dataclasses

import numpy as np

from loraplane.api import Tier
from loraplane.picker.plugins import SchedulingRequest
from loraplane.picker.scheduler import Scheduler
from loraplane.picker.snapshot import EndpointState, PoolSnapshot
from loraplane.sim.policies import adapter_digest, picker_config_for
from loraplane.sim.profile import LARGE_GPU

NAME = "hot@v1"


def _pick(scheduler: Scheduler, in_flight_on_warm_pod: int) -> str:
    digest = adapter_digest(NAME)
    pool = PoolSnapshot(
        [
            EndpointState("warm", "10.0.0.1:8000", residency={NAME: (Tier.GPU, digest)}),
            EndpointState("host", "10.0.0.2:8000", residency={NAME: (Tier.CPU, digest)}),
        ]
    )
    pool.in_flight[0] = in_flight_on_warm_pod
    decision = scheduler.schedule(SchedulingRequest(NAME, digest), pool, np.random.default_rng(0))
    return pool.endpoints[decision.indices[0]].name


def test_saturation_thresholds_scale_with_the_pods_batch() -> None:
    large = picker_config_for(LARGE_GPU).saturation_detector
    assert (large.in_flight_threshold, large.queue_threshold) == (LARGE_GPU.max_num_seqs / 2, LARGE_GPU.max_num_seqs / 8)
    # never below the packaged defaults, which are sized for the small reference engine
    small = picker_config_for(dataclasses.replace(LARGE_GPU, max_num_seqs=16)).saturation_detector
    assert (small.in_flight_threshold, small.queue_threshold) == (16, 5)


def test_a_large_pod_keeps_its_warm_traffic_where_the_packaged_thresholds_would_spill_it() -> None:
    # 100 requests in flight is a third of a 256-sequence batch: the GPU-warm pod still takes the request
    assert _pick(Scheduler(picker_config_for(LARGE_GPU)), 100) == "warm"
    # with thresholds sized for a 16-sequence engine the same pod counts as saturated and the request spills
    small = dataclasses.replace(LARGE_GPU, max_num_seqs=16)
    assert _pick(Scheduler(picker_config_for(small)), 100) == "host"
    assert _pick(Scheduler(picker_config_for(small)), 3) == "warm"
