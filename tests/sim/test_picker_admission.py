"""The picker's own flow-control queue behind the simulator's admission seam, on the simulator's clock."""

from __future__ import annotations

import numpy as np

from loraplane.sim.admission import FlowControlConfig
from loraplane.sim.cluster import SimConfig, Simulator
from loraplane.sim.metrics import summarize
from loraplane.sim.picker_admission import PickerFlowControl
from loraplane.sim.policies import build_policy
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.runner import simulate
from loraplane.sim.trace import scenario
from tests.sim.conftest import ADAPTER_BYTES
from tests.sim.test_admission_slo import REQUESTS, Recorder


def _gate(room: list[bool], config: FlowControlConfig | None = None) -> PickerFlowControl:
    return PickerFlowControl(lambda now, rid, sim: 0 if room[0] else None, lambda rid: REQUESTS[rid][0],
                             lambda rid: REQUESTS[rid][1], config)


def test_held_requests_go_out_by_band_then_tenants_in_turn() -> None:
    room = [False]
    gate, sim = _gate(room), Recorder()
    for rid in REQUESTS:
        gate.arrive(0.1 * rid, rid, sim)  # type: ignore[arg-type]
    assert gate.held == len(REQUESTS) and not sim.dispatched
    room[0] = True
    gate.capacity_freed(0.9, sim)  # type: ignore[arg-type]
    assert sim.dispatched == [3, 5, 0, 2, 4, 6, 7, 1, 8]  # the same order as the simulator's own model
    assert gate.held == 0


def test_deadlines_and_bounds_run_on_the_simulators_clock() -> None:
    config = FlowControlConfig(queue_limit=(1, 2, 1), deadline_s=(1.0, 2.0, 0.5))
    gate, sim = _gate([False], config), Recorder()
    for rid in REQUESTS:
        gate.arrive(0.0, rid, sim)  # type: ignore[arg-type]
    assert sim.refused == {4: 503, 6: 503, 7: 503, 5: 503, 8: 429}  # over the band limits at once
    while gate.held:
        gate.expire(gate.next_deadline(), sim)  # type: ignore[arg-type]  # what the simulator's event loop does
    assert sim.refused == {4: 503, 6: 503, 7: 503, 5: 503, 8: 429, 1: 429, 3: 503, 0: 503, 2: 503}
    assert not sim.dispatched


def test_in_a_saturated_simulation_it_serves_or_refuses_every_request_like_the_simulators_model() -> None:
    trace = scenario("hot-plus-burst", 4000, seed=3, adapter_bytes=ADAPTER_BYTES)
    pool = SimConfig(pods=2, max_loras=4, max_cpu_loras=16)
    config = FlowControlConfig()
    policy = build_policy("loraplane", 3, trace, LARGE_GPU, pool, flow_control=config)
    tenants = trace.tenants
    gate = PickerFlowControl(policy.router.choose, lambda rid: tenants[trace.tenant[rid]].priority,  # type: ignore[attr-defined]
                             trace.tenant.__getitem__, config)
    sim = Simulator(trace, pool, LARGE_GPU, policy.router, policy.eviction, policy.placement, admission=gate)
    result = sim.run()
    refused = np.frombuffer(result.refused, dtype=np.uint16)
    held = np.frombuffer(result.held_s, dtype=np.float64)
    served = refused == 0
    assert 0 < np.count_nonzero(~served) < len(trace) and np.count_nonzero(held[served] > 0) > 0
    assert (held <= max(config.deadline_s) + 1e-9).all()  # nobody waits past its deadline
    mine = summarize(result, pool, 1)["slo_attainment"]
    theirs = summarize(simulate(trace, pool, LARGE_GPU, "loraplane", 3, flow_control=config), pool, 1)["slo_attainment"]
    without = summarize(simulate(trace, pool, LARGE_GPU, "loraplane", 3), pool, 1)["slo_attainment"]
    assert mine > without + 0.1, (mine, without)  # the queue pays off as the simulator's own model does
    assert abs(mine - theirs) < 0.05, (mine, theirs)
