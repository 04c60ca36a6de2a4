"""``loraplane up``'s pieces that need no running stack: flags, manifests, the metrics parser, the summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from loraplane.api import AdapterRevision, Tier, adapter_digest
from loraplane.engine.metrics import EngineMetrics
from loraplane.processes import ManagedProcess
from loraplane.stack import main
from loraplane.stack.demo import (
    Artifact,
    DemoResult,
    LatencySummary,
    RolloutStep,
    latency_summary,
    manifest,
    parse_decisions,
    parse_engine_tiers,
    render,
    write_artifacts,
)
from loraplane.stack.services import Engine, pool_manifests


@pytest.mark.parametrize("argv", [["--engines", "0"], ["--json"]])
def test_bad_flags_are_refused_before_anything_starts(argv: list[str], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--workdir", str(tmp_path / "run")]) == 2
    assert "loraplane up:" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # imports torch
def test_artifacts_are_tars_whose_digests_and_content_digests_are_real(tmp_path: Path) -> None:
    artifacts = write_artifacts(tmp_path, [("claims", "v1"), ("claims", "v2")], "tiny")
    v1, v2 = artifacts["claims@v1"], artifacts["claims@v2"]
    assert v1.uri.startswith("file://") and v1.uri.endswith("/claims-v1.tar")
    assert v1.digest != v2.digest and v1.content_digest != v2.content_digest
    assert v1.content_digest == adapter_digest(tmp_path / "adapters" / "claims-v1")


def test_manifest_is_a_valid_adapter_revision_for_the_local_pool() -> None:
    artifact = Artifact("tail-0", "v1", "file:///run/artifacts/tail-0-v1.tar", "sha256:" + "a" * 64, "sha256:x")
    body = manifest(artifact, "tiny", "sha256:" + "b" * 64, "cpu")
    revision = AdapterRevision.model_validate(body)
    assert revision.served_name == "tail-0@v1" and revision.spec.pool_ref.name == "local"
    with pytest.raises(ValueError):
        manifest(artifact, "tiny", "not-a-digest", "cpu")


def test_pool_objects_select_every_engine_pod(tmp_path: Path) -> None:
    engines = [Engine(f"engine-{i}", 8000 + i, ManagedProcess(["true"], tmp_path / "log")) for i in range(2)]
    pool, *pods = pool_manifests(engines)
    selector = pool["spec"]["selector"]["matchLabels"]
    assert [p["metadata"]["name"] for p in pods] == ["engine-0", "engine-1"]
    assert all(p["metadata"]["labels"] == selector for p in pods)


def test_decisions_are_read_from_prometheus_text() -> None:
    text = ('# TYPE loraplane_picker_decisions_total counter\n'
            'loraplane_picker_decisions_total{outcome="warm-gpu"} 412.0\n'
            'loraplane_picker_decisions_total{outcome="cold"} 3.0\n'
            'loraplane_picker_decisions_created{outcome="cold"} 1.7e9\n')
    assert parse_decisions(text) == {"warm-gpu": 412, "cold": 3}


def test_engine_tiers_are_read_from_the_engines_own_ttft_histogram() -> None:
    metrics = EngineMetrics("tiny")
    for tier in (Tier.GPU, Tier.GPU, Tier.DISK, None):
        metrics.first_token(tier, 0.01)
    assert parse_engine_tiers(metrics.render().decode()) == {"L0": 2, "L2": 1}


def test_latency_summary() -> None:
    assert latency_summary([]) == LatencySummary(0, None, None, None)
    summary = latency_summary([float(v) for v in range(1, 101)])
    assert (summary.count, summary.p50_ms, summary.p95_ms, summary.mean_ms) == (100, 51.0, 95.0, 50.5)


def _result(final: str, wrong: list[dict[str, object]], errors: tuple[str, ...] = (), requests: int = 3) -> DemoResult:
    return DemoResult(
        requests=requests, errors=list(errors), requests_by_phase={"hot adapters": 3},
        ttft_by_tier={"gpu": latency_summary([10.0, 12.0]), "cpu": latency_summary([30.0]), "cold": latency_summary([])},
        decisions={"warm-gpu": 2, "warm-cpu": 1}, warm_available=2, warm_landed=2, wrong_revision=wrong,
        rollout=[RolloutStep("Verifying", 0.2, 0), RolloutStep(final, 9.0, 100 if final == "Stable" else 0)],
        rollout_final_phase=final, previous_revision_phase="Retiring", served_after_rollout={"claims@v2": 2},
        pids={"redis": 1}, gateway_url="http://127.0.0.1:1", wall_seconds=1.0)


def test_summary_json_and_table() -> None:
    good = _result("Stable", [])
    assert json.loads(good.to_json())["ok"] is True
    assert json.loads(good.to_json())["rollout"][1] == {"phase": "Stable", "at_s": 9.0, "weight": 100}
    assert not _result("RolledBack", []).ok
    assert not _result("Stable", [{"served": "claims@v1"}]).ok
    race = "tail-1: 404 The model `tail-1@v1` does not exist."
    assert _result("Stable", [], (race,), requests=100).ok  # the documented unload race, rare enough
    assert not _result("Stable", [], (race,) * 3, requests=100).ok
    assert not _result("Stable", [], ("tail-1: 503 no endpoint",), requests=100).ok
    console = Console(record=True, width=100)
    render(good, console)
    text = console.export_text()
    assert "GPU slot (warm)" in text and "decisions by tier" in text and "warm-gpu" in text and "Verifying" in text and "demo ok" in text
