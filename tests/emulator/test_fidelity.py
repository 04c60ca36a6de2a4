"""``loraplane bench emulator-fidelity``'s figures and a replay on the emulator alone (vLLM's side needs
``.venv-vllm``: the issue's closing figures are in docs/emulator.md)."""

from __future__ import annotations

import json

import pytest

from loraplane.emulator import fidelity
from loraplane.emulator.client import Timing


def stream(ttft_ms: float, tpot_ms: float, tokens: int, held_up: bool = False) -> Timing:
    """A stream as the client records it; ``held_up``: every token reached the client with the last one."""
    end = (ttft_ms + tpot_ms * (tokens - 1)) / 1000
    if held_up:
        return Timing(status=200, ttft_s=end, last_token_s=end, tokens=tokens, together=tokens - 1)
    return Timing(status=200, ttft_s=ttft_ms / 1000, last_token_s=end, tokens=tokens)


def test_the_time_to_the_last_token_is_the_same_whether_or_not_a_stream_was_held_up() -> None:
    free = fidelity.figures([stream(10, 3, 41)] * 10)
    held = fidelity.figures([stream(10, 3, 41, held_up=True)] * 10)
    assert free["e2e_ms"]["p50"] == held["e2e_ms"]["p50"] == pytest.approx(130.0)
    assert (free["held_up_share"], held["held_up_share"]) == (0.0, 1.0)
    # what the held-up streams do to TTFT and TPOT at the client
    assert held["ttft_ms"]["p50"] == pytest.approx(130.0) and held["tpot_ms"]["p50"] == 0.0
    assert free["ttft_ms"]["p50"] == pytest.approx(10.0) and free["tpot_ms"]["p50"] == pytest.approx(3.0)


@pytest.mark.slow
def test_a_replay_on_the_emulator_alone_reports_its_figures_and_no_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert fidelity.main(["--json", "--runtimes", "emulated", "--requests", "12", "--rate", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    emulated = report["emulated"]
    assert report["profile"] == fidelity.DEFAULT_PROFILE and "error" not in report and "vllm" not in report
    assert emulated["answered"] == 12 and emulated["errors"] == []
    assert emulated["e2e_ms"]["p50"] >= emulated["ttft_ms"]["p50"]
    assert set(report["scheduling"]) == {"nice", "autogroup_nice"}


def test_the_spread_between_rounds_is_the_largest_round_over_the_smallest() -> None:
    fast = fidelity.figures([stream(10, 3, 41)] * 10)
    slow = fidelity.figures([stream(15, 3, 41)] * 10)
    spread = fidelity.spread([fast, slow, fast])
    assert spread["ttft_p50"] == pytest.approx(0.5) and spread["tpot_p50"] == pytest.approx(0.0)
    assert spread["e2e_p99"] == pytest.approx(5 / 130, abs=1e-4)


@pytest.mark.slow
def test_rounds_replay_the_trace_again_and_report_each_round(capsys: pytest.CaptureFixture[str]) -> None:
    assert fidelity.main(["--json", "--runtimes", "emulated", "--requests", "12", "--rate", "8", "--rounds", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    emulated = report["emulated"]
    assert report["rounds"] == 2 and [r["answered"] for r in emulated["rounds"]] == [12, 12]
    assert emulated["answered"] == 24 and set(report["spread"]) == {"emulated"}
    assert all(value >= 0 for value in report["spread"]["emulated"].values())
