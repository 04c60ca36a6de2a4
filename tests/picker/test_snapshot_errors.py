"""Which reported rows count as servable: a sidecar error does not hide an adapter the runtime still holds (and so
still serves); a disk row the runtime has not registered does not count."""

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


def test_disk_rows_count_only_when_the_runtime_has_them_registered() -> None:
    rows = [
        AdapterResidency(served_name="loaded@v1", tier=Tier.DISK, digest=DIGEST, registered=True),
        AdapterResidency(served_name="cached@v1", tier=Tier.DISK, digest=DIGEST, registered=False),
        AdapterResidency(served_name="older-sidecar@v1", tier=Tier.DISK, digest=DIGEST),
        # demoted by the sidecar because the target wanted more in host memory than fits: registered, still served
        AdapterResidency(served_name="clipped@v1", tier=Tier.DISK, digest=DIGEST, registered=True,
                         error="kept below its target tier", error_reason="CapacityExceeded"),
    ]
    report = ResidencyReport(pool="pool", pod="pod-0", address="10.0.0.1:8000", heartbeat_at=0.0, adapters=rows)
    residency = endpoint_from_report(report).residency
    assert residency == {"loaded@v1": (Tier.DISK, DIGEST), "older-sidecar@v1": (Tier.DISK, DIGEST),
                         "clipped@v1": (Tier.DISK, DIGEST)}
