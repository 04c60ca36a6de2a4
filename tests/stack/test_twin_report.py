"""The twin's and the fidelity benchmark's arithmetic: outcomes in the simulator's shape, histogram quantiles between
two scrapes, errors and winners."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from loraplane.sim.cluster import SERVED, SimConfig
from loraplane.sim.metrics import every_request_p50_ms
from loraplane.sim.profile import LARGE_GPU
from loraplane.sim.runner import simulate
from loraplane.sim.trace import scenario
from loraplane.stack.fidelity import errors, seed_spread, sim_report, static_set, winner, winner_margin
from loraplane.stack.replay import NO_ANSWER, Outcome
from loraplane.stack.twin import (
    NO_ANSWER_STATUS,
    TwinOptions,
    by_label,
    gateway_path,
    histogram_quantiles,
    increase,
    metric_samples,
    outcomes_as_result,
    pooled_histogram,
    read_access_log,
)

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


def test_the_median_over_every_request_counts_a_refusal_as_never_answered() -> None:
    trace = scenario("gie-multilora", 5, 0, 1000)

    def median(*statuses: int) -> float | None:
        outcomes = [Outcome(status=s, ttft_s=0.1 * (i + 1), e2e_s=1.0) if s == 200 else Outcome(status=s, reason="x")
                    for i, s in enumerate(statuses)]
        return every_request_p50_ms(outcomes_as_result("p", trace, outcomes, lambda _u: 0))

    assert median(200, 200, 200, 200, 200) == 300.0
    # refusing the two slowest leaves the served median at 200 ms; over every request it stays 300 ms
    assert median(200, 200, 200, 429, 429) == 300.0
    assert median(429, 200, 200, 200, 200) == 400.0
    assert median(200, 200, 429, 429, 429) is None


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
                                 "gpu_loads_rel": 0.1, "ttft_p50_every_request_rel": None,
                                 "ttft_p50_rel_at_pod": None, "ttft_p99_rel_at_pod": None,
                                 "ttft_mean_rel_emulator": None}
    # the TTFT at the pod (Envoy's send to the first chunk), the path around it measured apart
    at_pod = {**twin, "gateway_path": {"ttft_at_pod_ms": {"p50": 88.0, "p99": 1125.0}}}
    got = errors(sim, at_pod)
    assert (got["ttft_p50_rel_at_pod"], got["ttft_p99_rel_at_pod"]) == (0.25, 0.2)
    assert winner({"a": sim, "b": twin}) == "b"
    assert winner({"a": {**twin, "p99_served_ttft_ms": 800.0}, "b": twin}) == "a"  # a tie goes to the lower p99
    assert winner_margin({"a": sim, "b": twin}) == {"runner_up": "a", "slo_attainment_abs": 0.01}
    assert winner_margin({"a": {**twin, "p99_served_ttft_ms": 800.0}, "b": twin}) == {
        "runner_up": "b", "p99_served_ttft_rel": 0.25}


def test_the_access_log_splits_ttft_into_the_pod_and_the_path(tmp_path: Path) -> None:
    # Envoy's lines as picker.envoy.ACCESS_LOG_FORMAT writes them: a refused request has no upstream timestamps
    log = tmp_path / "envoy-access.log"
    log.write_text("\n".join([
        '{"id":"twin-1","status":200,"to_upstream_us":4000,"upstream_sent_us":4100,"first_body_us":94000}',
        '{"id":"twin-0","status":200,"to_upstream_us":2000,"upstream_sent_us":2100,"first_body_us":52000}',
        '{"id":"twin-2","status":429,"to_upstream_us":null,"upstream_sent_us":null,"first_body_us":null}',
        '{"id":"-","status":200,"to_upstream_us":1,"upstream_sent_us":1,"first_body_us":2}',
    ]) + "\n")
    times = read_access_log(log, 3, wait_s=0)
    assert times[2] is None and times[0] is not None and times[0].first_body_s == 0.052
    outcomes = [Outcome(status=200, ttft_s=0.060, e2e_s=1.0), Outcome(status=200, ttft_s=0.100, e2e_s=1.0),
                Outcome(status=429)]
    split = gateway_path(outcomes, times)
    assert split["requests"] == 2
    assert split["ttft_at_pod_ms"]["p50"] == pytest.approx(70.0)  # 50 and 90 ms from Envoy's send to the chunk
    assert split["path_ms"]["p50"] == pytest.approx(10.0)  # 10 ms each: client TTFT less the pod's part
    assert split["ingress_ms"]["p50"] == pytest.approx(3.0) and split["egress_ms"]["p50"] == pytest.approx(7.0)


def test_loads_by_tier_count_only_the_increase_on_every_pod() -> None:
    def pod(cpu: int, disk: int) -> dict[str, list[tuple[dict[str, str], float]]]:
        return metric_samples(f'loraplane_emulator_lora_loads_total{{tier="cpu"}} {cpu}\n'
                              f'loraplane_emulator_lora_loads_total{{tier="disk"}} {disk}\n')

    before = {"a": pod(3, 1), "b": pod(0, 0)}
    after = {"a": pod(5, 1), "b": pod(1, 4)}
    assert by_label(before, after, "loraplane_emulator_lora_loads_total", "tier") == {"cpu": 3, "disk": 4}
    assert increase(before, after, "loraplane_emulator_lora_loads_total") == 7


def test_the_pods_ttft_histograms_pool_with_an_exact_mean_and_interpolated_quantiles() -> None:
    def pod(low: int, high: int, seconds: float) -> dict[str, list[tuple[dict[str, str], float]]]:
        name = "vllm:time_to_first_token_seconds"
        return metric_samples(f"# TYPE {name} histogram\n"
                              f'{name}_bucket{{le="0.1"}} {low}\n{name}_bucket{{le="0.25"}} {low + high}\n'
                              f'{name}_bucket{{le="+Inf"}} {low + high}\n{name}_count {low + high}\n'
                              f"{name}_sum {seconds}\n")

    before = {"a": pod(10, 0, 0.5), "b": pod(0, 0, 0.0)}
    after = {"a": pod(14, 2, 0.9), "b": pod(0, 4, 0.8)}  # 4 fast, 6 slow requests since; 1.2 s of TTFT
    got = pooled_histogram(before, after, "vllm:time_to_first_token_seconds")
    assert got["count"] == 10 and got["mean_ms"] == 120.0
    assert got["p50_ms"] == 125.0  # the 5th of 10 is 1 of the 6 in (0.1, 0.25]: a sixth of the way in
    assert got["p99_ms"] == pytest.approx(247.5)


def test_the_emulators_mean_ttft_is_compared_only_when_it_counts_the_trace_alone() -> None:
    sim = {"ttft_mean_ms": 110.0}
    twin = {"requests": 100, "emulator_ttft_ms": {"count": 100, "mean_ms": 100.0}}
    assert errors(sim, twin)["ttft_mean_rel_emulator"] == 0.1
    # sidecars' activation completions counted too: no comparison
    assert errors(sim, {**twin, "emulator_ttft_ms": {"count": 430, "mean_ms": 30.0}})["ttft_mean_rel_emulator"] is None


def test_the_simulators_peers_hold_every_adapter_on_disk_as_the_twin_registers_them() -> None:
    """The twin's peer pools register every adapter on every pod at start-up, so none is fetched, whatever the
    sidecar's 20 GB cache budget (zipf-many's 420 adapters of 84 MB are 35 GB)."""
    trace = scenario("zipf-many", 600, 0, 84 * 2**20)
    assert sum(a.nbytes for a in trace.adapters) > SimConfig().disk_bytes
    options = TwinOptions(pods=4)
    summary = sim_report(trace, options, LARGE_GPU, "least-request", 0)
    assert summary["hit_ratio"]["L3"] == 0.0
    unbounded = simulate(static_set(trace), SimConfig(pods=4, scrape_interval_s=options.scrape_interval), LARGE_GPU,
                         "least-request", 0)
    assert np.count_nonzero(np.frombuffer(bytes(unbounded.tier), np.uint8) == 3) > 0  # the budget alone fetches


def test_the_seed_spread_says_whether_the_twin_lies_inside_the_simulators_range() -> None:
    runs = [{"slo_attainment": 0.457, "ttft_ms": {"p50": 3001.7, "p99": 33_749.6}, "cold_starts": 894},
            {"slo_attainment": 0.496, "ttft_ms": {"p50": 2053.9, "p99": 30_532.4}, "cold_starts": 896}]
    twin = {"slo_attainment": 0.503, "ttft_ms": {"p50": 2100.0, "p99": 31_405.5}, "cold_starts": 902}
    spread = seed_spread(runs, twin)
    assert spread["seeds"] == 2 and spread["slo_attainment"] == [0.457, 0.496]
    assert spread["ttft_ms_p50"] == [2053.9, 3001.7] and spread["cold_starts"] == [894, 896]
    assert not spread["slo_attainment_twin_inside"] and not spread["cold_starts_twin_inside"]
    assert spread["ttft_ms_p50_twin_inside"] and spread["ttft_ms_p99_twin_inside"]
    assert seed_spread(runs, {})["slo_attainment_twin_inside"] is False  # no twin figure: not inside
