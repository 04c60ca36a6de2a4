"""inference-perf, the field's benchmark client, against a 2-pod twin for a few seconds, and its report read back.

Needs inference-perf in ``.venv-iperf`` (``scripts/setup-inference-perf.sh``: Python >= 3.12): a benchmark tool
outside ``make setup``, so the test skips without it, in CI too. The checks: inference-perf's start-up check of its
``lora_traffic_split`` against ``GET /v1/models`` through Envoy passes (loraplane's picker answers it from the route
table, a peer's pods list what they registered), every request is served, and the report parses into stages with
TTFT, TPOT and the server's output token counts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplane.stack.iperf import Lengths, SweepOptions, find_inference_perf, run_policy
from loraplane.stack.twin import TwinOptions

pytestmark = pytest.mark.slow

EXECUTABLE = find_inference_perf()


@pytest.mark.skipif(EXECUTABLE is None, reason="inference-perf is not installed (scripts/setup-inference-perf.sh)")
@pytest.mark.parametrize("policy", ["loraplane", "gie-lora-affinity"])
def test_inference_perf_drives_a_two_pod_twin_and_its_report_parses(tmp_path: Path, policy: str) -> None:
    assert EXECUTABLE is not None
    sweep = SweepOptions(rates=(2.0, 4.0), stage_seconds=4, interval_s=1.0, adapters=4,
                         input=Lengths(mean=1000, std_dev=200, min=400, max=2000),
                         output=Lengths(mean=16, std_dev=4, min=8, max=32))
    report = run_policy(policy, TwinOptions(pods=2), sweep, tmp_path / policy, EXECUTABLE)
    assert report["summary"]["errors"] == 0, report["summary"]["error_kinds"]
    assert report["dead_processes"] == []
    stages = report["stages"]
    assert [s["requested_rate"] for s in stages] == [2.0, 4.0]
    assert sum(s["successes"] for s in stages) == report["summary"]["successes"] >= 12
    for stage in stages:
        latency = stage["latency_ms"]
        assert 0 < latency["time_to_first_token"]["p50"] <= latency["time_to_first_token"]["p99"]
        assert 0 < latency["time_per_output_token"]["p50"] < latency["request_latency"]["p50"]
        assert 8 <= stage["output_tokens_mean"] <= 32  # the server's count: max_tokens, produced exactly
        assert stage["achieved_rate"] > 0
    assert set(report["adapters"]) <= {f"lora-{i:02d}" for i in range(4)} and "lora-00" in report["adapters"]
    assert report["inference_perf"]["cpu_s"] > 0
