"""The simulated pod's waiting queue under vLLM's two scheduling policies: ``fcfs`` (the order requests reached
the pod) and ``priority`` (by ``(priority, that order)``, lower first, as vLLM's ``PriorityRequestQueue``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loraplane.sim.baselines import BASELINES
from loraplane.sim.cluster import SimConfig, Simulator
from loraplane.sim.policies import build_policy, runtime_priorities
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.trace import Adapter, Tenant, Trace, scenario
from tests.sim.conftest import ADAPTER_BYTES, free_loads

ONE_POD = SimConfig(pods=1, max_loras=2, max_cpu_loras=4)
#: one request at a time: who goes next is the queue's order alone
ONE_SEQ = replace(free_loads(), max_num_seqs=1)


def queued_behind_a_long_request() -> Trace:
    """A batch request that holds the pod's only sequence slot for 200 steps, then two more batch requests and,
    last, a gold one: all four arrive while the first runs."""
    tenants = [Tenant("gold", priority=1), Tenant("batch", cls="burst", priority=-1)]
    adapters = [Adapter("gold@v1", 0, ADAPTER_BYTES), Adapter("batch@v1", 1, ADAPTER_BYTES)]
    who = [1, 1, 1, 0]
    return Trace(
        name="queued",
        tenants=tenants,
        adapters=adapters,
        arrival=[0.0, 0.001, 0.002, 0.003],
        adapter=who,
        tenant=who,
        input_tokens=[64] * 4,
        output_tokens=[200, 4, 4, 4],
    )


def admitted_order(trace: Trace, priority: bool) -> list[int]:
    policy = build_policy("round-robin", 0, trace, ONE_SEQ, ONE_POD)
    sim = Simulator(
        trace, ONE_POD, ONE_SEQ, policy.router, policy.eviction, priority=runtime_priorities(trace) if priority else None
    )  # fmt: skip
    result = sim.run()
    return list(result.admitted)


def test_fcfs_admits_in_arrival_order() -> None:
    assert admitted_order(queued_behind_a_long_request(), priority=False) == [0, 1, 2, 3]


def test_priority_admits_the_gold_request_before_earlier_batch_ones_and_ties_in_arrival_order() -> None:
    # request 0 runs already (vLLM never preempts a running request for a waiting one); then gold, then the batch
    # requests in the order they came
    assert admitted_order(queued_behind_a_long_request(), priority=True) == [0, 3, 1, 2]


def test_runtime_priorities_are_the_negated_tenant_priorities() -> None:
    trace = queued_behind_a_long_request()
    assert list(runtime_priorities(trace)) == [1, 1, 1, -1]


def test_loraplane_pods_schedule_by_priority_and_the_baselines_pods_by_arrival() -> None:
    trace = scenario("hot-plus-burst", 400, seed=0, adapter_bytes=ADAPTER_BYTES)
    config = SimConfig(pods=2)
    chosen = build_policy("loraplane", 0, trace, LARGE_GPU, config).priority
    assert chosen is not None and list(chosen) == list(runtime_priorities(trace))
    for name in BASELINES:
        assert build_policy(name, 0, trace, LARGE_GPU, config).priority is None, name


@pytest.mark.parametrize("priority", [False, True])
def test_every_request_is_admitted_once_under_either_policy(priority: bool) -> None:
    trace = scenario("hot-plus-burst", 3000, seed=2, adapter_bytes=ADAPTER_BYTES)
    config = SimConfig(pods=2)
    policy = build_policy("least-request", 0, trace, LARGE_GPU, config)
    sim = Simulator(
        trace, config, LARGE_GPU, policy.router, policy.eviction, priority=runtime_priorities(trace) if priority else None
    )  # fmt: skip
    result = sim.run()
    assert sorted(result.admitted) == list(range(len(trace)))
