"""``loraplane bench emulator`` prints its figures as one JSON object (tests never assert timings)."""

from __future__ import annotations

import json

import pytest

from loraplane.bench.emulator import main
from loraplane.cli import BENCHMARKS


def test_the_bench_prints_idle_and_load_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert BENCHMARKS["emulator"][0] == "loraplane.bench.emulator:main"
    assert main(["--json", "--idle-s", "0.5", "--duration-s", "1", "--rate", "5", "--max-tokens", "8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["idle"]) == {"seconds", "rss_mib", "cpu_share_of_core"}
    assert result["load"]["requests"] == 5 and result["load"]["failed"] == 0
    assert {"cpu_ms_per_request", "cpu_share_of_core", "rss_mib"} <= set(result["load"])
