"""``loraplane bench controller`` at a small scale: one JSON object, incremental writes, bounded churn."""

from __future__ import annotations

import json

import pytest

from loraplane.cli import main


def test_bench_prints_one_json_object_and_writes_only_changes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "controller", "--json", "--revisions", "60", "--pods", "6", "--gpu-slots", "4",
                 "--live-revisions", "40", "--live-pools", "2", "--apply-samples", "3", "--gate-adapters", "2",
                 "--gate-steps", "3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"revisions", "pods", "reconcile_s", "redis_writes", "churn_adapters_moved", "churn_minimum"} <= set(result)
    assert (result["revisions"], result["pods"]) == (60, 6)
    # every pod's target state, the route table and each revision's catalogue entry, once
    assert result["cold_redis_writes"] == 6 + 1 + 60
    assert result["idle_redis_writes"] == 0  # nothing changed, nothing written
    assert result["rate_change_replanned"] is False and result["redis_writes"] == 0  # within the hysteresis
    assert result["spike_planned"] == "placement delta" and result["spike_redis_writes"] >= 1
    assert 0 < result["redis_bytes_per_change"] and result["max_rss_mb"] > 0 and result["idle_reconcile_cpu_s"] >= 0
    assert result["redis_writes"] <= 6  # only pods whose targets changed
    assert result["churn_adapters_moved"] <= 2 * max(result["churn_minimum"], 1)
    # the live loop: every created revision reached a target state, and every timed step after the first was seen
    assert (result["live_revisions"], result["live_pools"]) == (40 + 2 * 2, 2 + 1)
    assert result["apply_to_target_ms"]["n"] == 3 and result["apply_to_target_ms"]["p50"] > 0
    assert result["live_process_rss_mb"] > 0 and result["devcluster_peak_rss_mb"] > 0
    # each canary's steps after its first are timed; the first one too when its due time fell after the warm-up
    assert 2 * 2 <= result["gate_delay_ms"]["n"] <= 2 * 3 and result["gate_delay_ms"]["p99"] >= 0
