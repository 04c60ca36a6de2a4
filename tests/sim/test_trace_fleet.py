"""The ``fleet`` scenario: 10,000 revisions of 500 tenants and a few batch sweeps, sized for 256 pods."""

from __future__ import annotations

from collections import Counter

from loraplane.sim.trace import BURST, scenario
from tests.sim.conftest import ADAPTER_BYTES


def test_fleet_has_ten_thousand_adapters_of_zipf_tenants_and_sweeps_inside_its_window() -> None:
    trace = scenario("fleet", 40_000, seed=4, adapter_bytes=ADAPTER_BYTES)
    assert len(trace) == 40_000 and len(trace.adapters) == 10_000
    assert trace.arrival == sorted(trace.arrival)
    online = [t for t in trace.tenants if t.cls != BURST]
    assert len(online) == 500 and sum(t.cls == BURST for t in trace.tenants) == 4
    assert {t.priority for t in online} == {-1, 0, 1}
    owners = Counter(a.tenant for a in trace.adapters[:9_600])
    assert owners.most_common(1)[0][1] > 500 > len(owners)  # a few tenants own many adapters, many own a handful
    counts = Counter(trace.adapter)
    assert counts.most_common(1)[0][1] > 40 * sorted(counts.values())[len(counts) // 2]  # Zipf: a long tail
    assert trace.burst_window is not None
    start, end = trace.burst_window
    sweep = [i for i, t in enumerate(trace.tenant) if trace.tenants[t].cls == BURST]
    assert len(sweep) == 4 * 1_000 and all(start <= trace.arrival[i] <= end for i in sweep)
    assert all(not trace.adapters[trace.adapter[i]].on_disk for i in sweep)
    for b in range(4):  # each batch tenant sweeps its own adapters one after the other
        mine = [trace.adapter[i] for i in sweep if trace.tenants[trace.tenant[i]].name == f"batch-{b}"]
        assert mine == sorted(mine) and len(set(mine)) == 100
