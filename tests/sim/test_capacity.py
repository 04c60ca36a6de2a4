"""``loraplane plan --scenario S | --trace CSV``: the fewest pods each policy needs to reach a target attainment."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from loraplane.sim.capacity import fewest_pods
from loraplane.sim.plan import main as plan_main
from loraplane.sim.trace import scenario


def step(threshold: int) -> tuple[list[int], Callable[[int], float]]:
    """An attainment that reaches 1.0 at ``threshold`` pods, and the counts it was asked for."""
    asked: list[int] = []

    def attainment(pods: int) -> float:
        asked.append(pods)
        return 1.0 if pods >= threshold else pods / threshold

    return asked, attainment


@pytest.mark.parametrize("start", [1, 3, 8, 20, 64])
@pytest.mark.parametrize("threshold", [1, 2, 5, 8, 9, 17, 40])
def test_the_search_finds_the_fewest_pods_from_any_start(start: int, threshold: int) -> None:
    asked, attainment = step(threshold)
    pods, tried = fewest_pods(attainment, 0.99, start, 128)
    assert pods == threshold
    assert len(asked) == len(set(asked))  # no count simulated twice
    assert tried[pods] >= 0.99
    if pods > 1:  # the count below was simulated and missed
        assert tried[pods - 1] < 0.99
    assert len(asked) <= 2 * 8 + 2  # galloping and bisection: logarithmic


def test_the_search_says_none_when_even_the_most_pods_miss() -> None:
    _, attainment = step(300)
    pods, tried = fewest_pods(attainment, 0.99, 8, 100)
    assert pods is None
    assert max(tried) == 100 and all(v < 0.99 for v in tried.values())


def test_plan_with_a_scenario_reports_each_policys_fewest_pods(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--scenario", "gie-multilora", "--requests", "1500", "--policies", "loraplane,round-robin",
            "--slo-ttft-ms", "2000", "--target-attainment", "0.99", "--pods", "4", "--jobs", "1", "--json"]  # fmt: skip
    assert plan_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["target_attainment"] == 0.99 and out["slo_ttft_ms"] == 2000.0 and out["requests"] == 1500
    assert out["loraplane_runtime"] == "vllm"  # as loraplane sim: vLLM behind loraplane's sidecar by default
    assert set(out["policies"]) == {"loraplane", "round-robin"}
    for found in out["policies"].values():
        pods = found["pods"]
        assert pods is not None and found["slo_attainment"] >= 0.99
        assert found["tried"][str(pods)] == found["slo_attainment"]
        if pods > 1:
            assert found["tried"][str(pods - 1)] < 0.99
        assert {"p99_served_ttft_ms", "rejected", "cold_starts", "bound_cold_starts"} <= found.keys()
    assert out["best_baseline"] == {"policy": "round-robin", "pods": out["policies"]["round-robin"]["pods"]}
    ratio = out["policies"]["loraplane"]["pods"] / out["policies"]["round-robin"]["pods"]
    assert out["loraplane_pods_over_best_baseline"] == round(ratio, 4)


def test_plan_with_a_recorded_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv = tmp_path / "trace.csv"
    csv.write_text(scenario("gie-multilora", 800, 1, 84_000_000).to_csv())
    argv = ["--trace", str(csv), "--policies", "least-request", "--pods", "2", "--jobs", "1", "--json",
            "--loraplane-runtime", "on-demand"]  # fmt: skip
    assert plan_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 800 and out["policies"]["least-request"]["pods"] >= 1
    assert out["loraplane_runtime"] == "on-demand"
    assert "loraplane_pods_over_best_baseline" not in out  # no loraplane in the list


def test_the_sizing_mode_still_needs_its_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        plan_main(["--traffic", "10"])
    assert exc.value.code == 2
    assert "--base-model" in capsys.readouterr().err


def test_azure_options_need_an_azure_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        plan_main(["--scenario", "gie-multilora", "--compress", "2"])
    assert exc.value.code == 2
    assert "--compress" in capsys.readouterr().err
