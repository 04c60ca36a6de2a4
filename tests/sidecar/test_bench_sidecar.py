"""``loraplane bench sidecar`` end to end on the tiny preset: one JSON object with every path's stages."""

from __future__ import annotations

import json

import pytest

from loraplane.bench import sidecar as bench


@pytest.mark.slow
def test_the_bench_measures_every_path_against_both_raw_reads(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert bench.main(["--model", "tiny", "--rank", "8", "--repeats", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    stages = result["stages_ms"]
    assert {"resolve", "download", "verify", "unpack", "disk_load", "h2d", "engine_disk_read"} <= stages["L3"].keys()
    assert {"disk_load", "h2d", "engine_disk_read", "engine_parse"} <= stages["L2"].keys()
    assert stages["L2"]["disk_load"] > stages["L2"]["engine_disk_read"] > 0
    for field in ("raw_read_ms", "raw_read_parallel_ms", "l2_load_over_raw_read", "l2_load_over_parallel_raw_read"):
        assert result[field] > 0
    assert result["load_read_threads"] >= 1
    assert result["adapter_bytes"] > 0
