"""The one reader of stored payloads: each refusal has its own reason, a compatible newer writer is read."""

from __future__ import annotations

import logging

import orjson
import pytest

from loraplane.api import (
    SCHEMA_VERSION,
    TARGET_SCHEMA_VERSION,
    KvBlockSet,
    PayloadError,
    PayloadRefusal,
    PickerCounters,
    RequestRates,
    ResidencyReport,
    RouteTable,
    TargetState,
    read_payload,
    read_payload_or_none,
)
from loraplane.api.base import PayloadModel

PAYLOADS: list[PayloadModel] = [
    TargetState(pool="pool-a", pod="pod-0", generation=3, updated_at=1.0),
    ResidencyReport(pool="pool-a", pod="pod-0", address="10.0.0.1:8000", heartbeat_at=1.0, ttl_seconds=2.5),
    RouteTable(pool="pool-a", generation=2, updated_at=1.0),
    RequestRates(pool="pool-a", published_at=1.0, windows={"5m": {"rev-a": 2.0}}),
    PickerCounters(pool="pool-a", replica="picker-0", published_at=1.0),
    KvBlockSet(pool="pool-a", pod="pod-0", block_size=16, heartbeat_at=1.0),
]


def _dict(payload: PayloadModel) -> dict[str, object]:
    return orjson.loads(payload.to_json())  # type: ignore[no-any-return]


def _refusal(model: type[PayloadModel], raw: bytes) -> PayloadError:
    with pytest.raises(PayloadError) as caught:
        read_payload(model, raw)
    assert caught.value.model is model
    return caught.value


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda p: type(p).__name__)
def test_round_trip_of_every_stored_payload(payload: PayloadModel) -> None:
    assert read_payload(type(payload), payload.to_json()) == payload


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe"])
def test_bad_json_is_refused_as_invalid_json(raw: bytes) -> None:
    error = _refusal(TargetState, raw)
    assert error.reason is PayloadRefusal.INVALID_JSON
    assert "TargetState refused (invalid-json)" in str(error)


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda p: type(p).__name__)
def test_a_payload_without_a_schema_version_is_refused(payload: PayloadModel) -> None:
    data = _dict(payload)
    del data["schemaVersion"]
    assert _refusal(type(payload), orjson.dumps(data)).reason is PayloadRefusal.SCHEMA_MISSING


@pytest.mark.parametrize("version", [TARGET_SCHEMA_VERSION + 1, 0, "1", True, None])
def test_another_schema_version_is_refused(version: object) -> None:
    data = {**_dict(PAYLOADS[0]), "schemaVersion": version}
    error = _refusal(TargetState, orjson.dumps(data))
    expected = PayloadRefusal.SCHEMA_MISSING if version is None else PayloadRefusal.SCHEMA_UNSUPPORTED
    assert error.reason is expected
    if version is not None:
        assert f"schemaVersion {version!r}" in error.detail


def test_target_state_reads_its_version_one_and_two_other_payloads_only_one() -> None:
    # version 2 (entries by reference) is TargetState's alone: a whole-entry state of version 1 is still read
    old = {**_dict(PAYLOADS[0]), "schemaVersion": SCHEMA_VERSION}
    del old["refs"]
    assert read_payload(TargetState, orjson.dumps(old)).generation == 3
    assert _dict(PAYLOADS[0])["schemaVersion"] == TARGET_SCHEMA_VERSION
    report = {**_dict(PAYLOADS[1]), "schemaVersion": TARGET_SCHEMA_VERSION}
    assert _refusal(ResidencyReport, orjson.dumps(report)).reason is PayloadRefusal.SCHEMA_UNSUPPORTED


def test_a_model_validation_error_names_the_field() -> None:
    data = {**_dict(PAYLOADS[0]), "generation": "many"}
    error = _refusal(TargetState, orjson.dumps(data))
    assert error.reason is PayloadRefusal.INVALID
    assert error.detail.startswith("generation:")
    missing = _dict(PAYLOADS[1])
    del missing["pod"]
    assert _refusal(ResidencyReport, orjson.dumps(missing)).detail.startswith("pod:")
    assert _refusal(TargetState, b"[1, 2]").reason is PayloadRefusal.INVALID


def test_a_newer_compatible_writer_is_read_and_its_new_fields_ignored() -> None:
    # a minor (additive) change keeps schemaVersion and adds optional fields, also inside nested objects
    data = {**_dict(PAYLOADS[1]), "someFieldOfANewerWriter": {"x": 1}}
    report = read_payload(ResidencyReport, orjson.dumps(data))
    assert report == PAYLOADS[1]


def test_the_skipping_reader_logs_the_reason_and_returns_none(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.payload")
    assert read_payload_or_none(TargetState, None, log) is None
    assert read_payload_or_none(TargetState, PAYLOADS[0].to_json(), log) == PAYLOADS[0]
    with caplog.at_level(logging.WARNING, logger="test.payload"):
        assert read_payload_or_none(TargetState, b'{"schemaVersion": 3}', log) is None
    assert "schema-unsupported" in caplog.text
