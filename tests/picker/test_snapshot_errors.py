"""A sidecar error on a row does not hide an adapter the runtime still holds (and so still serves)."""

from __future__ import annotations

from loraplane.api import AdapterResidency, ResidencyReport, Tier
from loraplane.picker.snapshot import endpoint_from_report

DIGEST = "sha256:" + "a" * 64


def _row(name: str, tier: Tier, reason: str | None) -> AdapterResidency:
    return AdapterResidency(served_name=name, tier=tier, digest=DIGEST, error=reason and "failed", error_reason=reason)


def test_loaded_adapters_with_an_action_error_stay_routable_but_failed_loads_do_not() -> None:
    report = ResidencyReport(pool="pool", pod="pod-0", address="10.0.0.1:8000", heartbeat_at=0.0, adapters=[
        _row("busy@v1", Tier.GPU, "RequestsInFlight"),
        _row("offload@v1", Tier.CPU, "OffloadRejected"),
        _row("broken@v1", Tier.DISK, "Incompatible"),
        _row("fine@v1", Tier.DISK, None),
    ])
    residency = endpoint_from_report(report).residency
    assert residency == {"busy@v1": (Tier.GPU, DIGEST), "offload@v1": (Tier.CPU, DIGEST), "fine@v1": (Tier.DISK, DIGEST)}
