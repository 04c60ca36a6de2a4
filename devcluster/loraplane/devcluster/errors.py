"""Kubernetes API errors: the ``Status`` object and field errors worded the way the real API server words them.

kubectl prints ``details.causes`` of an ``Invalid`` status as ``The <Kind> "<name>" is invalid: <field>: <message>``,
so the wording here is what users read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


def format_value(value: Any) -> str:
    """A value as Go's field errors print it: strings quoted, numbers and booleans bare, objects as "object"."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    return '"null"'


@dataclass(frozen=True)
class FieldError:
    """One invalid field: its path (``spec.lora.rank``), the reason code and the message after the path."""

    field: str
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


def required(field: str, detail: str = "") -> FieldError:
    """A missing required field."""
    return FieldError(field, "FieldValueRequired", "Required value" + (f": {detail}" if detail else ""))


def invalid(field: str, value: Any, detail: str) -> FieldError:
    """A value that breaks a rule."""
    return FieldError(field, "FieldValueInvalid", f"Invalid value: {format_value(value)}: {detail}")


def not_supported(field: str, value: Any, supported: list[Any]) -> FieldError:
    """A value outside an enum."""
    quoted = ", ".join(json.dumps(str(s)) for s in supported)
    return FieldError(field, "FieldValueNotSupported", f"Unsupported value: {format_value(value)}: supported values: {quoted}")


def too_long(field: str, limit: int) -> FieldError:
    """A string over its maximum length."""
    return FieldError(field, "FieldValueTooLong", f"Too long: may not be more than {limit} bytes")


def too_many(field: str, count: int, limit: int) -> FieldError:
    """An array over its maximum size."""
    return FieldError(field, "FieldValueTooMany", f"Too many: {count}: must have at most {limit} items")


def forbidden(field: str, detail: str) -> FieldError:
    """A change that is not allowed."""
    return FieldError(field, "FieldValueForbidden", f"Forbidden: {detail}")


class ApiError(Exception):
    """An error answered as a Kubernetes ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        """The ``Status`` object the server answers with."""
        out: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            out["details"] = self.details
        return out


def qualified(resource: str, group: str) -> str:
    """``adapterrevisions.loraplane.io``, or ``pods`` for the core group."""
    return f"{resource}.{group}" if group else resource


def not_found(resource: str, group: str, name: str) -> ApiError:
    """``adapterrevisions.loraplane.io "x" not found``."""
    return ApiError(404, "NotFound", f'{qualified(resource, group)} "{name}" not found',
                    {"name": name, "group": group, "kind": resource})


def already_exists(resource: str, group: str, name: str) -> ApiError:
    """A create whose name is taken."""
    return ApiError(409, "AlreadyExists", f'{qualified(resource, group)} "{name}" already exists',
                    {"name": name, "group": group, "kind": resource})


def conflict(resource: str, group: str, name: str, why: str) -> ApiError:
    """An update or delete whose precondition (resourceVersion, uid) no longer holds."""
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {qualified(resource, group)} "{name}": {why}',
                    {"name": name, "group": group, "kind": resource})


def bad_request(message: str) -> ApiError:
    """A malformed request."""
    return ApiError(400, "BadRequest", message)


def method_not_allowed(message: str) -> ApiError:
    """A verb the resource does not serve."""
    return ApiError(405, "MethodNotAllowed", message)


def unsupported_media_type(message: str) -> ApiError:
    """A body in a format the endpoint does not take."""
    return ApiError(415, "UnsupportedMediaType", message)


def gone(message: str) -> ApiError:
    """A resourceVersion older than the server still remembers."""
    return ApiError(410, "Expired", message)


def invalid_object(kind: str, group: str, name: str, errors: list[FieldError]) -> ApiError:
    """``AdapterRevision.loraplane.io "x" is invalid: <field>: <message>`` (422 with one cause per field)."""
    joined = str(errors[0]) if len(errors) == 1 else "[" + ", ".join(str(e) for e in errors) + "]"
    return ApiError(
        422,
        "Invalid",
        f'{qualified(kind, group)} "{name}" is invalid: {joined}',
        {
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [{"reason": e.reason, "message": e.message, "field": e.field} for e in errors],
        },
    )
