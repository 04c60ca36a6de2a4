"""Request body parsing and the ``model`` field rewrite, byte-exact everywhere else.

Every failure is a ``ClientError`` carrying the HTTP status the client gets (400 bad JSON or missing model, 413 too
large); nothing else escapes. The rewrite splices the new name into the original bytes when the field is found
unambiguously, so numbers, key order and whitespace reach the model server untouched.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import orjson

_MODEL_FIELD = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.)*)"')
_MAX_MODEL_NAME = 512


class ClientError(Exception):
    """The client's request is refused with ``status`` (4xx) and ``message``."""

    def __init__(self, status: int, message: str, reason: str = "bad-request") -> None:
        """Remember the HTTP status, a human message and a machine reason."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ParsedBody:
    """The fields of an OpenAI-style request body the picker uses."""

    model: str
    stream: bool
    document: dict[str, Any]


def parse_body(body: bytes, limit: int) -> ParsedBody:
    """Parse a JSON request body; ``ClientError`` (400/413) for anything unusable."""
    if len(body) > limit:
        raise ClientError(413, f"request body of {len(body)} bytes exceeds the limit of {limit}", "body-too-large")
    if not body:
        raise ClientError(400, "request body is empty; a JSON object with a 'model' field is required")
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ClientError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ClientError(400, "request body must be a JSON object")
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise ClientError(400, "request body has no string field 'model'")
    if len(model) > _MAX_MODEL_NAME:
        raise ClientError(400, f"model name longer than {_MAX_MODEL_NAME} characters")
    return ParsedBody(model, document.get("stream") is True, document)


def _listed(value: object) -> bool:
    return isinstance(value, list) and bool(value)


def _given(value: object) -> bool:
    return isinstance(value, (str, list)) and bool(value)


def _present(value: object) -> bool:
    return value is not None


#: ``:path`` suffix -> (API name, the field a request of that type must carry, the check of that field)
_API_FIELDS = (
    ("/chat/completions", "chat completions", "messages", _listed),
    ("/completions", "completions", "prompt", _given),
    ("/embeddings", "embeddings", "input", _given),
    ("/responses", "responses", "input", _present),
    ("/conversations", "conversations", "items", _listed),
)


def validate_api_fields(document: dict[str, Any], path: str | None) -> None:
    """Refuse (400) a request missing the field its API type needs; the type comes from the ``:path`` suffix.

    Completions need a non-empty ``prompt``, chat completions a non-empty ``messages`` list, embeddings a non-empty
    ``input``, responses an ``input``, conversations a non-empty ``items`` list. Other paths are not checked.
    """
    rule = _api_rule(path) if path else None
    if rule is not None:
        api, name, check = rule
        if not check(document.get(name)):
            raise ClientError(400, f"invalid {api} request: must have a non-empty {name!r} field")


@lru_cache(maxsize=256)
def _api_rule(path: str) -> tuple[str, str, Callable[[object], bool]] | None:
    path = path.partition("?")[0].rstrip("/")
    return next(((api, name, check) for suffix, api, name, check in _API_FIELDS if path.endswith(suffix)), None)


def _decode_json_string(raw: bytes) -> str | None:
    try:
        value = orjson.loads(b'"' + raw + b'"')
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def rewrite_request_model(body: bytes, parsed: ParsedBody, new_model: str) -> bytes:
    """``body`` with its top-level ``model`` set to ``new_model``."""
    hits = [m for m in _MODEL_FIELD.finditer(body) if _decode_json_string(m.group(1)) == parsed.model]
    if len(hits) == 1:
        start, end = hits[0].span(1)
        return body[:start] + orjson.dumps(new_model)[1:-1] + body[end:]
    return orjson.dumps({**parsed.document, "model": new_model})  # ambiguous: re-serialise


def set_request_field(body: bytes, name: str, value: object) -> bytes:
    """``body`` (a JSON object the picker parsed) with its top-level ``name`` set to ``value``."""
    document = orjson.loads(body)
    document[name] = value
    return orjson.dumps(document)


@lru_cache(maxsize=4096)
def _response_pattern(served_name: str) -> re.Pattern[bytes]:
    return re.compile(rb'("model"\s*:\s*")' + re.escape(orjson.dumps(served_name)[1:-1]) + rb'"')


def rewrite_response_model(chunk: bytes, served_name: str, logical_name: str) -> bytes:
    """Replace ``"model": "<served name>"`` with the logical name the client asked for (per chunk)."""
    replacement = orjson.dumps(logical_name)[1:-1].replace(b"\\", b"\\\\")
    return _response_pattern(served_name).sub(rb"\g<1>" + replacement + b'"', chunk)
