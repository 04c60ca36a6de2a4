"""``loraplane bench inference-perf`` without inference-perf: the traffic split, the config, the report reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplane.cli import BENCHMARKS
from loraplane.stack import iperf
from loraplane.stack.iperf import (
    SPLIT_UNIT,
    SweepOptions,
    adapters_trace,
    iperf_config,
    read_reports,
    traffic_split,
)


@pytest.mark.parametrize("count", [1, 2, 3, 8, 12, 16, 100, 1024])
@pytest.mark.parametrize("s", [0.0, 0.8, 1.0, 1.5])
def test_the_split_sums_to_exactly_one_in_binary_fractions(count: int, s: float) -> None:
    split = traffic_split([f"a{i}" for i in range(count)], s)
    shares = [item["split"] for item in split]
    assert sum(shares) == 1.0 and sum(reversed(shares)) == 1.0  # inference-perf's exact test, in any order
    assert all(share > 0 and (share * SPLIT_UNIT).is_integer() for share in shares)
    assert shares == sorted(shares, reverse=True)  # Zipf: rank order
    assert [item["name"] for item in split] == [f"a{i}" for i in range(count)]


def test_the_split_follows_zipf() -> None:
    shares = [item["split"] for item in traffic_split([f"a{i}" for i in range(16)], 1.0)]
    harmonic = sum(1 / r for r in range(1, 17))
    for rank, share in enumerate(shares, start=1):
        assert share == pytest.approx(1 / rank / harmonic, abs=1 / SPLIT_UNIT)


def test_more_adapters_than_units_is_refused() -> None:
    with pytest.raises(ValueError):
        traffic_split([f"a{i}" for i in range(SPLIT_UNIT + 1)], 1.0)


def test_the_config_is_a_streamed_poisson_sweep_over_the_adapters(tmp_path: Path) -> None:
    trace = adapters_trace(16, 1)
    assert [a.name for a in trace.adapters][:2] == ["lora-00@v1", "lora-01@v1"] and len(trace) == 0
    sweep = SweepOptions(rates=(2.0, 4.0), stage_seconds=10)
    names = [a.name.partition("@")[0] for a in trace.adapters]
    config = iperf_config("http://127.0.0.1:1", tmp_path / "model", names, sweep, tmp_path / "report")
    assert config["api"] == {"type": "completion", "streaming": True}
    assert config["server"]["type"] == "vllm" and config["server"]["base_url"] == "http://127.0.0.1:1"
    assert config["tokenizer"] == {"pretrained_model_name_or_path": str(tmp_path / "model")}
    assert config["data"]["type"] == "synthetic"
    assert config["data"]["input_distribution"]["total_count"] >= 60  # every request of the sweep gets a prompt
    assert config["load"]["type"] == "poisson"
    assert config["load"]["stages"] == [{"rate": 2.0, "duration": 10}, {"rate": 4.0, "duration": 10}]
    assert [item["name"] for item in config["load"]["lora_traffic_split"]] == names
    assert config["report"]["request_lifecycle"]["use_server_output_tokens"] is True
    assert config["storage"]["local_storage"]["path"] == str(tmp_path / "report")


def _lifecycle(count: int, failures: int, ttft_s: float, rate: float | None = None) -> dict[str, object]:
    latency = {name: {"mean": ttft_s, "median": ttft_s, "p90": 2 * ttft_s, "p99": 3 * ttft_s}
               for name in iperf.LATENCIES}
    load: dict[str, object] = {"count": count + failures, "schedule_delay": {"p99": 0.002}}
    if rate is not None:
        load |= {"requested_rate": rate, "achieved_rate": rate * 0.98}
    return {"load_summary": load,
            "successes": {"count": count, "latency": latency,
                          "throughput": {"requests_per_sec": rate or 1.0, "output_tokens_per_sec": 100.0},
                          "prompt_tokens": {"mean": 500.0}, "output_tokens": {"mean": 64.0},
                          "output_len": {"mean": 350.0}, "token_count_mismatches": count},
            "failures": {"count": failures, "by_label": {"http_503": {"count": failures}} if failures else {}}}


def test_the_reports_are_read_per_stage_and_adapter(tmp_path: Path) -> None:
    report = tmp_path / "report"
    report.mkdir()
    (report / "summary_lifecycle_metrics.json").write_text(json.dumps(_lifecycle(30, 2, 0.05)))
    (report / "stage_0_lifecycle_metrics.json").write_text(json.dumps(_lifecycle(10, 0, 0.04, rate=2.0)))
    (report / "stage_1_lifecycle_metrics.json").write_text(json.dumps(_lifecycle(20, 2, 0.06, rate=4.0)))
    (report / "adapter_lora-00_lifecycle_metrics.json").write_text(json.dumps(_lifecycle(25, 1, 0.05)))
    (report / "adapter_lora-00_stage_0_lifecycle_metrics.json").write_text(json.dumps(_lifecycle(1, 0, 0.05)))
    read = read_reports(report, 3)
    assert read["summary"]["successes"] == 30 and read["summary"]["errors"] == 2
    first, second, third = read["stages"]
    assert (first["requested_rate"], first["achieved_rate"], first["errors"]) == (2.0, 1.96, 0)
    assert first["latency_ms"]["time_to_first_token"] == {"p50": 40.0, "p90": 80.0, "p99": 120.0, "mean": 40.0}
    assert first["output_tokens_mean"] == 64.0  # the server's count (usage), not the client tokenizer's
    assert first["schedule_delay_p99_ms"] == 2.0
    assert second["error_kinds"] == {"http_503": 2}
    assert third == {"stage": 2, "missing": True}
    assert read["adapters"] == {"lora-00": {"successes": 25, "errors": 1, "ttft_p50_ms": 50.0, "ttft_p99_ms": 150.0}}


def test_no_summary_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="summary_lifecycle_metrics"):
        read_reports(tmp_path, 1)


def test_the_executable_is_found_by_flag_environment_or_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert iperf.find_inference_perf("/opt/x/inference-perf") == "/opt/x/inference-perf"
    monkeypatch.setenv(iperf.IPERF_ENV, "/opt/y/inference-perf")
    assert iperf.find_inference_perf() == "/opt/y/inference-perf"
    monkeypatch.delenv(iperf.IPERF_ENV)
    venv = tmp_path / iperf.IPERF_VENV / "bin"
    venv.mkdir(parents=True)
    (venv / "inference-perf").write_text("#!/bin/sh\n")
    (venv / "inference-perf").chmod(0o755)
    monkeypatch.chdir(tmp_path)
    assert iperf.find_inference_perf() == str(venv / "inference-perf")


def test_without_inference_perf_the_command_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(iperf, "find_inference_perf", lambda _explicit=None: None)
    assert iperf.main(["--pods", "2"]) == 2
    assert "scripts/setup-inference-perf.sh" in capsys.readouterr().err
    assert BENCHMARKS["inference-perf"][0] == "loraplane.stack.iperf:main"
