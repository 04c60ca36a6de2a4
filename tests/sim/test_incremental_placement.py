"""The simulated controller plans as the real one's ``IncrementalPlanner`` does: a pool at rest keeps its plan, a
few adapters whose rates moved beyond the hysteresis are placed again alone, the full-plan period plans it whole.

(It placed the whole pool at every resync: at fleet size, 256 pods and 10,000 adapters, 1.4 s of CPU every 2 s of
trace, and plans the real controller never makes.)
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from loraplane.controller.placement import (
    DEFAULT_FULL_PLAN_SECONDS,
    DELTA_SHARE,
    RATE_FLOOR,
    plans_as_floor,
    rate_moved,
    rate_moved_elementwise,
)
from loraplane.sim.cluster import VLLM, SimConfig, Simulator
from loraplane.sim.policies import LORAPLANE, ControllerPlacement, build_policy
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.trace import scenario
from tests.sim.conftest import ADAPTER_BYTES

CONFIG = SimConfig(pods=4, max_loras=4, max_cpu_loras=16, loraplane_runtime=VLLM)


def test_a_pool_at_rest_keeps_its_plan_and_a_few_moved_adapters_are_placed_again_alone() -> None:
    trace = scenario("zipf-many", 400, seed=2, adapter_bytes=ADAPTER_BYTES)
    built = build_policy(LORAPLANE, 2, trace, LARGE_GPU, CONFIG)
    sim = Simulator(trace, CONFIG, built.pod_profile or LARGE_GPU, built.router, built.eviction, built.placement,
                    admission=built.admission, priority=built.priority)
    placement = sim.placement
    assert isinstance(placement, ControllerPlacement)
    start = float(trace.arrival[0])

    placement.apply(start, sim)  # the first plan: whole
    first = placement._previous
    assert first is not None and (placement.planned, placement.reused, placement.deltas) == (1, 0, 0)

    placement.apply(start + 2, sim)  # no request yet: every rate as planned
    assert placement._previous is first and placement.reused == 1

    sim.arrived = 3  # the first three requests: at most three adapters' rates move
    moved = {trace.adapters[a].name for a in trace.adapter[:3]}
    placement.apply(start + 4, sim)
    delta = placement._previous
    assert delta is not None and delta is not first and (placement.planned, placement.deltas) == (1, 1)
    for pod, held in first.pods.items():  # every other adapter is where it was
        assert {n: t for n, t in delta.pods.get(pod, {}).items() if n not in moved} == \
            {n: t for n, t in held.items() if n not in moved}
    assert any(n in moved for held in delta.pods.values() for n in held)

    placement.apply(start + 4.5, sim)  # the moved rates are the new baseline: within 25 % of it, at rest again
    assert placement._previous is delta and placement.reused == 2

    placement.apply(start + 4 + DEFAULT_FULL_PLAN_SECONDS, sim)  # the full-plan period
    assert placement.planned == 2


def test_adapters_placed_again_alone_since_the_whole_plan_stay_few(monkeypatch) -> None:
    """A sweep of new adapters moves a few adapters' rates at almost every resync: each few is placed again alone
    while the floor adapters (every sweep adapter, and the disks cannot hold three holders of each) placed again
    alone since the last whole plan stay ``few_enough``, then the pool is planned whole (as ``IncrementalPlanner``
    does), long before the full-plan period comes round."""
    from loraplane.sim import policies

    trace = scenario("hot-plus-burst", 12000, seed=1, adapter_bytes=ADAPTER_BYTES)
    config = replace(CONFIG, disk_bytes=30 * ADAPTER_BYTES)  # 120 copies of 81 adapters
    built = build_policy(LORAPLANE, 1, trace, LARGE_GPU, config)
    placement = built.placement
    assert isinstance(placement, ControllerPlacement)
    alone: list[int] = [0]  # floor adapters placed alone since the last whole plan
    most = [0]
    place, place_again = policies.place, policies.place_again

    def whole(*args, **kwargs):  # type: ignore[no-untyped-def]
        alone[0] = 0
        return place(*args, **kwargs)

    def part(before, capacity, demands, changed, *args):  # type: ignore[no-untyped-def]
        most[0] = max(most[0], alone[0])  # placed alone since the whole plan, before this part
        alone[0] += sum(plans_as_floor(d, config.placement) for d in changed.values())
        return place_again(before, capacity, demands, changed, *args)

    monkeypatch.setattr(policies, "place", whole)
    monkeypatch.setattr(policies, "place_again", part)
    sim = Simulator(trace, config, built.pod_profile or LARGE_GPU, built.router, built.eviction, placement,
                    admission=built.admission, priority=built.priority)
    sim.run()
    assert placement._previous is not None and placement._previous.deferred
    assert placement.deltas > 0 and 0 < most[0] <= max(8, len(trace.adapters) * DELTA_SHARE)
    assert placement.planned > 1 + trace.duration / DEFAULT_FULL_PLAN_SECONDS


def test_the_simulated_controllers_elementwise_hysteresis_is_the_controllers() -> None:
    """``rate_moved_elementwise`` (the simulated controller's 10,000 revisions at once) answers as ``rate_moved``
    does for each pair, at and around the floor and the hysteresis's edges."""
    rng = np.random.default_rng(0)
    base = rng.choice([0.0, RATE_FLOOR / 2, RATE_FLOOR, 0.04, 0.1, 1.0, 10.0], size=2000)
    factor = rng.choice([0.0, 0.5, 0.75, 0.8, 1.0, 1.25, 4 / 3, 2.0], size=2000)
    old, new = base, base * factor + rng.choice([0.0, RATE_FLOOR, 0.011], size=2000)
    expected = [rate_moved(a, b, 0.25) for a, b in zip(old.tolist(), new.tolist(), strict=True)]
    assert rate_moved_elementwise(old, new, 0.25).tolist() == expected
    assert 0 < sum(expected) < len(expected)
