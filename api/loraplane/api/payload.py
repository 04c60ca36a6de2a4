"""The one reader of payloads stored in Redis: JSON, then the schema version, then the model.

Every payload (``TargetState``, ``ResidencyReport``, ``RouteTable``, ``RequestRates``, ``PickerCounters``,
``KvBlockSet``) carries ``schemaVersion``. The version is bumped only on an incompatible change, and a reader refuses
any version but its own (a model's ``READ_VERSIONS`` where it reads more than one: ``TargetState``). A compatible (minor) change adds optional fields without bumping it: older readers ignore
fields they do not know (``PayloadModel``), so a payload from a newer writer of the same version is read.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Any, TypeVar

import orjson
from pydantic import ValidationError

from loraplane.api.base import PayloadModel
from loraplane.api.runtime import SCHEMA_VERSION

P = TypeVar("P", bound=PayloadModel)


class PayloadRefusal(StrEnum):
    """Why a payload was refused: a fixed, short label (fit for a metric's ``reason`` label)."""

    INVALID_JSON = "invalid-json"
    SCHEMA_MISSING = "schema-missing"
    SCHEMA_UNSUPPORTED = "schema-unsupported"
    INVALID = "invalid"


class PayloadError(ValueError):
    """A stored payload this reader refuses; ``reason`` says which check failed, ``detail`` what was wrong."""

    def __init__(self, model: type[PayloadModel], reason: PayloadRefusal, detail: str) -> None:
        super().__init__(f"{model.__name__} refused ({reason}): {detail}")
        self.model = model
        self.reason = reason
        self.detail = detail


def read_payload(model: type[P], raw: bytes | str) -> P:
    """Parse ``raw`` as a ``model`` of this reader's ``SCHEMA_VERSION``; ``PayloadError`` when it is not one."""
    try:
        data: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise PayloadError(model, PayloadRefusal.INVALID_JSON, str(exc)) from exc
    if not isinstance(data, dict):
        raise PayloadError(model, PayloadRefusal.INVALID, f"a JSON object is expected, not {type(data).__name__}")
    version = data.get("schemaVersion", data.get("schema_version"))
    if version is None:
        raise PayloadError(model, PayloadRefusal.SCHEMA_MISSING, "no schemaVersion")
    accepted = model.READ_VERSIONS or (SCHEMA_VERSION,)
    if version not in accepted or isinstance(version, bool):
        raise PayloadError(model, PayloadRefusal.SCHEMA_UNSUPPORTED,
                           f"schemaVersion {version!r}, this reader reads {' or '.join(map(str, accepted))}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "payload"
        raise PayloadError(model, PayloadRefusal.INVALID, f"{where}: {first['msg']}") from exc


def read_payload_or_none(model: type[P], raw: bytes | str | None, log: logging.Logger) -> P | None:
    """``read_payload`` for readers that skip what they refuse: None for no key or a refused payload (logged)."""
    if raw is None:
        return None
    try:
        return read_payload(model, raw)
    except PayloadError as exc:
        log.warning("ignoring a stored payload: %s", exc)
        return None
