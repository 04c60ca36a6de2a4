"""``loraplane-controller`` refuses bad configuration with the reason, before touching any server."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplane.controller.cli import main
from loraplane.controller.config import load_config
from loraplane.controller.placement import PlacementConfig, TenantBudget


def test_config_file_sets_placement_and_budgets(tmp_path: Path) -> None:
    path = tmp_path / "controller.yaml"
    path.write_text("placement: {replicaRate: 2.5, burstSlotsPerPod: 0, gpuMinRate: 0.5, goldMinReplicas: 1, "
                    "balanceRatio: 1.5, stagingShare: 0.25}\n"
                    "tenantBudgets: {batch: {gpuBytes: 1073741824}}\n")
    config = load_config(path)
    assert config.placement_config() == PlacementConfig(
        replica_rate=2.5, burst_slots_per_pod=0, gpu_min_rate=0.5, gold_min_replicas=1, balance_ratio=1.5,
        staging_share=0.25,
    )
    assert config.budgets() == {"batch": TenantBudget(gpu_bytes=1 << 30)}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("placement: {replicaRat: 2}\n", "replicaRat"),
        ("placement: {replicaRate: -1}\n", "replicaRate"),
        ("placement: {goldMinReplicas: 0}\n", "goldMinReplicas"),
        ("placement: {balanceRatio: 0.5}\n", "balanceRatio"),
        ("placement: {stagingShare: 2}\n", "stagingShare"),
        ("tenantBudgets: {batch: {gpuBytes: lots}}\n", "gpuBytes"),
        ("placement: [\n", "config file"),
    ],
)
def test_bad_config_exits_2_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                            needle: str) -> None:
    path = tmp_path / "controller.yaml"
    path.write_text(text)
    assert main(["--config", str(path), "--kubeconfig", str(tmp_path / "none")]) == 2
    assert needle in capsys.readouterr().err


def test_inconsistent_lease_timings_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["--lease-duration", "5", "--renew-deadline", "6", "--kubeconfig", str(tmp_path / "none")]) == 2
    assert "retry_period < renew_deadline < lease_duration" in capsys.readouterr().err


def test_missing_kubeconfig_is_a_clear_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["--kubeconfig", str(tmp_path / "missing")]) == 2
    assert "no Kubernetes credentials" in capsys.readouterr().err
