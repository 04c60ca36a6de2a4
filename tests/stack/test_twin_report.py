"""The twin's and the fidelity benchmark's arithmetic: outcomes in the simulator's shape, histogram quantiles between
two scrapes, errors and winners."""

from __future__ import annotations

import math

from loraplane.sim.cluster import SERVED
from loraplane.sim.trace import scenario
from loraplane.stack.fidelity import errors, winner
from loraplane.stack.replay import NO_ANSWER, Outcome
from loraplane.stack.twin import NO_ANSWER_STATUS, histogram_quantiles, metric_samples, outcomes_as_result

HISTOGRAM = """# TYPE h histogram
h_bucket{{le="0.001"}} {a}
h_bucket{{le="0.01"}} {b}
h_bucket{{le="+Inf"}} {c}
h_count {c}
h_sum 1.0
"""


def test_outcomes_become_the_simulators_result() -> None:
    trace = scenario("gie-multilora", 4, 0, 1000)
    outcomes = [Outcome(status=200, ttft_s=0.1, e2e_s=0.5, upstream="10.0.0.2:80"),
                Outcome(status=429, reason="rejected-saturated"),
                Outcome(status=200, ttft_s=0.2),  # a stream that broke off: not served
                Outcome(status=NO_ANSWER)]
    result = outcomes_as_result("p", trace, outcomes, lambda upstream: 1 if upstream else -1)
    assert list(result.refused) == [SERVED, 429, NO_ANSWER_STATUS, NO_ANSWER_STATUS]
    assert result.ttft[0] == 0.1 and all(math.isnan(t) for t in result.ttft[1:])
    assert list(result.pod) == [1, -1, -1, -1]


def test_histogram_quantiles_count_only_what_happened_between_the_scrapes() -> None:
    before = metric_samples(HISTOGRAM.format(a=5, b=5, c=5))
    after = metric_samples(HISTOGRAM.format(a=6, b=104, c=105))  # 100 observations: 1, 98, 1
    got = histogram_quantiles(before, after, "h")
    assert got == {"count": 100.0, "p50_ms_le": 10.0, "p99_ms_le": 10.0}
    after = metric_samples(HISTOGRAM.format(a=5, b=5, c=15))
    assert histogram_quantiles(before, after, "h")["p50_ms_le"] == math.inf


def test_errors_and_the_winner() -> None:
    sim = {"slo_attainment": 0.98, "ttft_ms": {"p50": 110.0, "p99": 900.0}, "cold_starts": 90,
           "p99_served_ttft_ms": 900.0}
    twin = {"slo_attainment": 0.99, "ttft_ms": {"p50": 100.0, "p99": 1000.0}, "cold_starts": 100,
            "p99_served_ttft_ms": 1000.0}
    assert errors(sim, twin) == {"slo_attainment_abs": 0.01, "ttft_p50_rel": 0.1, "ttft_p99_rel": 0.1,
                                 "gpu_loads_rel": 0.1}
    assert winner({"a": sim, "b": twin}) == "b"
    assert winner({"a": {**twin, "p99_served_ttft_ms": 800.0}, "b": twin}) == "a"  # a tie goes to the lower p99
