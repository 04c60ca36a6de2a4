"""Traces (scenarios, CSV), calibration profiles from bench output, and the ``loraplane sim`` command."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest

from loraplane.api import Tier
from loraplane.cli import main as loraplane_main
from loraplane.controller.placement import PlacementConfig
from loraplane.sim.cli import main as sim_main
from loraplane.sim.profile import LARGE_GPU, ProfileError, from_bench, load_profile
from loraplane.sim.trace import BURST, TraceError, load_csv, scenario
from tests.sim.conftest import ADAPTER_BYTES


def test_gie_multilora_has_the_anchors_traffic_shares() -> None:
    trace = scenario("gie-multilora", 30_000, seed=1, adapter_bytes=ADAPTER_BYTES)
    counts = Counter(trace.adapter)
    shares = sorted((counts[i] / len(trace) for i in range(15)), reverse=True)
    assert shares[:5] == pytest.approx([0.12] * 5, abs=0.01)
    assert shares[5:10] == pytest.approx([0.06] * 5, abs=0.01)
    assert shares[10:] == pytest.approx([0.02] * 5, abs=0.006)
    assert max(trace.input_tokens) <= 2048 and max(trace.output_tokens) <= 128
    assert trace.arrival == sorted(trace.arrival)


def test_hot_plus_burst_sweeps_cold_adapters_inside_its_window() -> None:
    trace = scenario("hot-plus-burst", 20_000, seed=2, adapter_bytes=ADAPTER_BYTES)
    assert trace.burst_window is not None
    start, end = trace.burst_window
    burst = [i for i, t in enumerate(trace.tenant) if trace.tenants[t].cls == BURST]
    assert burst and all(start <= trace.arrival[i] <= end + 1 for i in burst)
    swept = [trace.adapter[i] for i in burst]
    assert all(not trace.adapters[a].on_disk for a in swept)
    assert swept == sorted(swept)  # a sweep: one adapter after the other
    without = trace.without_class(BURST)
    assert len(without) == len(trace) - len(burst) and not without.has_class(BURST)


def test_csv_round_trip_and_errors(tmp_path: Path) -> None:
    trace = scenario("rollout", 500, seed=3, adapter_bytes=ADAPTER_BYTES)
    path = tmp_path / "t.csv"
    path.write_text(trace.to_csv())
    back = load_csv(path, ADAPTER_BYTES)
    assert [back.adapters[a].name for a in back.adapter] == [trace.adapters[a].name for a in trace.adapter]
    assert back.input_tokens == trace.input_tokens and back.output_tokens == trace.output_tokens
    assert back.arrival == pytest.approx([t - trace.arrival[0] for t in trace.arrival], abs=1e-5)
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,adapter,tenant,input_tokens,output_tokens\n1.0,a@v1,t,10,5\n2.0,a@v1,t,ten,5\n")
    with pytest.raises(TraceError, match=r"bad.csv:3"):
        load_csv(bad, ADAPTER_BYTES)
    bad.write_text("time,adapter\n1,a\n")
    with pytest.raises(TraceError, match="missing column"):
        load_csv(bad, ADAPTER_BYTES)


ENGINE_BENCH = {
    "ttft_ms": {"L0": 30.0, "L1": 34.0, "L2": 90.0},
    "decode_batch": 8,
    "prompt_tokens": 100,
    "decode_tokens_per_s": {"base": 800.0, "1_adapter": 640.0, "8_adapters": 400.0},
}
SIDECAR_BENCH = {"stages_ms": {"L3": {"resolve": 1.0, "download": 20.0, "verify": 3.0, "disk_load": 50.0}},
                 "adapter_bytes": 1_000_000}  # fmt: skip


def test_profile_from_bench_output(tmp_path: Path) -> None:
    profile = from_bench(ENGINE_BENCH, SIDECAR_BENCH)
    assert profile.load_ms(Tier.CPU, 1_000_000) == pytest.approx(4.0)
    assert profile.load_ms(Tier.DISK, 1_000_000) == pytest.approx(60.0)
    assert profile.download_ms(1_000_000) == pytest.approx(24.0)
    # a step of 8 sequences: 10 ms base, 12.5 ms with one adapter, 20 ms with eight
    assert profile.decode_step_ms(8, 0) == pytest.approx(10.0)
    assert profile.decode_step_ms(8, 1) == pytest.approx(12.5)
    assert profile.decode_step_ms(8, 8) == pytest.approx(20.0)
    assert profile.prefill_per_token_ms == pytest.approx(0.2)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"engine": ENGINE_BENCH, "sidecar": SIDECAR_BENCH}))
    assert load_profile(str(path)).download_ms(1) == pytest.approx(24.0)
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(LARGE_GPU.to_dict()))
    assert load_profile(str(saved)) == LARGE_GPU
    with pytest.raises(ProfileError, match="L0 <= L1 <= L2"):
        from_bench({**ENGINE_BENCH, "ttft_ms": {"L0": 5, "L1": 4, "L2": 9}})
    with pytest.raises(ProfileError, match="unknown profile"):
        load_profile("no-such-profile")


def test_sim_json_has_the_issue_keys_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--scenario", "hot-plus-burst", "--requests", "3000", "--policies", "loraplane,gie-lora-affinity",
            "--pods", "4", "--jobs", "1", "--json", "--plot", str(tmp_path)]  # fmt: skip
    assert loraplane_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scenario"] == "hot-plus-burst" and out["requests"] == 3000
    assert out["bound"]["cold_starts"] > 0
    for name in ("loraplane", "gie-lora-affinity"):
        policy = out["policies"][name]
        assert set(policy["ttft_ms"]) == {"p50", "p95", "p99"}
        for key in ("hot_ttft_p99_ms", "hot_ttft_p99_no_burst_ms", "cold_starts", "cold_start_rate", "thrash_ratio"):
            assert isinstance(policy[key], int | float), key
        assert policy["cold_starts"] >= policy["bound_in_service_order"]
    for png in ("ttft_cdf.png", "cold_starts.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_main(["--trace", str(tmp_path / "missing.csv")]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim_main(["--policies", "best-policy"])
    assert sim_main(["--max-loras", "8", "--max-cpu-loras", "4"]) == 2


def test_sim_plans_with_the_controllers_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "controller.yaml"
    config.write_text("placement: {hostCopies: 2, stagingShare: 0.25}\n")
    argv = ["--scenario", "gie-multilora", "--requests", "500", "--policies", "loraplane", "--jobs", "1", "--json"]
    assert sim_main([*argv, "--controller-config", str(config)]) == 0
    placement = json.loads(capsys.readouterr().out)["placement"]
    assert (placement["host_copies"], placement["staging_share"]) == (2, 0.25)
    assert sim_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["placement"] == dataclasses.asdict(PlacementConfig())
    config.write_text("placement: {stagingShare: 3}\n")
    assert sim_main([*argv, "--controller-config", str(config)]) == 2
    assert "stagingShare" in capsys.readouterr().err
