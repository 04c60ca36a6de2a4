"""Request body parsing and the ``model`` field rewrite, byte-exact everywhere else.

Every failure is a ``ClientError`` carrying the HTTP status the client gets (400 bad JSON or missing model, 413 too
large); nothing else escapes. The rewrite splices the new name into the original bytes when the field is found
unambiguously, so numbers, key order and whitespace reach the model server untouched.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
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


#: bytes of a request body per prompt token (about 4 of English text, as the prefix scorer's 64-byte blocks assume)
BYTES_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class ParsedBody:
    """The fields of an OpenAI-style request body the picker uses."""

    model: str
    stream: bool
    document: dict[str, Any]
    #: the prompt's length in tokens as estimated from the body's size (``BYTES_PER_TOKEN``): what the request adds
    #: to its pod's prefill queue until its first token
    prompt_tokens: int = 0


def parse_body(body: bytes, limit: int, model_optional: bool = False) -> ParsedBody:
    """Parse a JSON request body; ``ClientError`` (400/413) for anything unusable.

    ``model_optional``: a body without a string ``model`` is accepted (``ParsedBody.model`` is then ``""``): the
    gateway names the model in a model-name rewrite header, as llm-d-router accepts it.
    """
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
        if not model_optional:
            raise ClientError(400, "request body has no string field 'model'")
        model = ""
    if len(model) > _MAX_MODEL_NAME:
        raise ClientError(400, f"model name longer than {_MAX_MODEL_NAME} characters")
    return ParsedBody(model, document.get("stream") is True, document, len(body) // BYTES_PER_TOKEN)


#: the request headers the API type is read from, in order (llm-d-router v0.10's ``GetRequestPath``)
PATH_HEADERS = (":path", "x-original-path", "x-forwarded-path")


def request_path(headers: Mapping[str, str]) -> str | None:
    """The request's path: ``:path``, else ``x-original-path``, else ``x-forwarded-path`` (the first non-empty)."""
    for name in PATH_HEADERS:
        if value := headers.get(name):
            return value
    return None


# --- the API types' fields, checked as llm-d-router v0.10's OpenAI parser decodes them into Go structs ----------------
# A check returns None when the value is acceptable, else what is wrong with it (appended to the field's name).
Check = Callable[[object], str | None]


def _optional(check: Check) -> Check:
    """``check``, or absent / null (Go leaves the field at its zero value)."""
    return lambda value: None if value is None else check(value)


def _string(value: object) -> str | None:
    return None if isinstance(value, str) else "must be a string"


def _boolean(value: object) -> str | None:
    return None if isinstance(value, bool) else "must be a boolean"


def _integer(value: object) -> str | None:
    return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"


def _array(value: object) -> str | None:
    return None if isinstance(value, list) else "must be an array"


def _mapping(value: object) -> str | None:
    return None if isinstance(value, dict) else "must be an object"


def _fields(**checks: Check) -> Check:
    """An object whose listed fields, where present and not null, pass their checks (others are not looked at)."""

    def check(value: object) -> str | None:
        if not isinstance(value, dict):
            return "must be an object"
        for name, field_check in checks.items():
            field = value.get(name)
            if field is not None and (problem := field_check(field)) is not None:
                return f"{name} {problem}"
        return None

    return check


def _items(item: Check) -> Check:
    """An array whose every element passes ``item``."""

    def check(value: object) -> str | None:
        if not isinstance(value, list):
            return "must be an array"
        for index, element in enumerate(value):
            if (problem := item(element)) is not None:
                return f"[{index}] {problem}"
        return None

    return check


def _token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32


def _text_or_tokens(batched: bool) -> Check:
    """A non-empty string, or a non-empty array of strings only or of token ids only (and, with ``batched``, of
    token-id arrays only: vLLM's batched prompts)."""

    def check(value: object) -> str | None:
        if isinstance(value, str):
            return None if value else "must not be empty"
        if not isinstance(value, list) or not value:
            return "must be a non-empty string or array"
        if all(isinstance(v, str) for v in value) or all(_token_id(v) for v in value):
            return None
        if batched and all(isinstance(v, list) and v and all(_token_id(t) for t in v) for v in value):
            return None
        return "must hold strings only or token ids only"

    return check


def _not_null(value: object) -> str | None:
    return None


_CONTENT_BLOCK = _fields(type=_string, text=_string, image_url=_fields(url=_string),
                         input_audio=_fields(data=_string, format=_string), video_url=_fields(url=_string))


def _content(value: object) -> str | None:
    """A chat message's ``content``: a string or an array of content blocks."""
    if isinstance(value, str):
        return None
    if isinstance(value, list):
        return _items(_CONTENT_BLOCK)(value)
    return "must be a string or an array of content parts"


_MESSAGE = _fields(role=_string, content=_content, tool_calls=_array)
_CACHE_SALT = {"cache_salt": _string}


@dataclass(frozen=True, slots=True)
class ApiType:
    """One API the picker checks: its name in messages, the field it must carry and how, the other typed fields."""

    name: str
    #: the field the request must carry (present and not null) and what it must be
    required: str
    check: Check
    others: dict[str, Check]


_CHAT = ApiType("chat completions", "messages", lambda v: "must be a non-empty array" if not isinstance(v, list) or not v
                else _items(_MESSAGE)(v),
                {"tools": _array, "documents": _array, "chat_template": _string,
                 "return_assistant_tokens_mask": _boolean, "continue_final_message": _boolean,
                 "add_generation_prompt": _boolean, "chat_template_kwargs": _mapping, **_CACHE_SALT})
_COMPLETIONS = ApiType("completions", "prompt", _text_or_tokens(batched=True), dict(_CACHE_SALT))

#: ``:path`` suffix -> its API type, first match wins (llm-d-router v0.10's ``determineAPITypeFromPath`` order)
_API_TYPES: tuple[tuple[str, ApiType], ...] = (
    ("/conversations", ApiType("conversations", "items", lambda v: "must be a non-empty array"
                               if not isinstance(v, list) or not v else _items(_fields(type=_string, role=_string))(v),
                               {"metadata": _mapping, **_CACHE_SALT})),
    ("/responses", ApiType("responses", "input", _not_null, dict(_CACHE_SALT))),
    ("/chat/completions", _CHAT),
    ("/chat/completions/render", _CHAT),
    ("/completions", _COMPLETIONS),
    ("/completions/render", _COMPLETIONS),
    ("/embeddings", ApiType("embeddings", "input", _text_or_tokens(batched=False), dict(_CACHE_SALT))),
    ("/images/generations", ApiType("images generations", "prompt",
                                    lambda v: None if isinstance(v, str) and v else "must be a non-empty string",
                                    {"n": _integer, "size": _string, "num_inference_steps": _integer})),
)


def validate_api_fields(document: dict[str, Any], path: str | None) -> None:
    """Refuse (400) a request whose fields do not fit its API type; the type comes from the path's suffix.

    The required field: completions a ``prompt`` (a non-empty string or array), chat completions a non-empty
    ``messages`` array of message objects (``role`` a string, ``content`` a string or content parts), embeddings an
    ``input``, responses an ``input``, conversations a non-empty ``items`` array, image generations a non-empty
    ``prompt`` string; the other fields llm-d-router decodes must have its types when present (``cache_salt`` a
    string, chat ``tools`` an array, ...). Other paths, and requests without a path, are not checked.
    """
    api = _api_type(path) if path else None
    if api is None:
        return
    value = document.get(api.required)
    if value is None:
        raise ClientError(400, f"invalid {api.name} request: must have a non-empty {api.required!r} field")
    if (problem := api.check(value)) is not None:
        raise ClientError(400, f"invalid {api.name} request: {api.required}{_join(problem)}")
    for name, check in api.others.items():
        field = document.get(name)
        if field is not None and (problem := check(field)) is not None:
            raise ClientError(400, f"invalid {api.name} request: {name}{_join(problem)}")


def _join(problem: str) -> str:
    return problem if problem.startswith("[") else f" {problem}"


@lru_cache(maxsize=256)
def _api_type(path: str) -> ApiType | None:
    path = path.partition("?")[0].rstrip("/")
    return next((api for suffix, api in _API_TYPES if path.endswith(suffix)), None)


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


def parse_request(body: bytes, limit: int, path: str | None, model_optional: bool = False) -> ParsedBody:
    """``parse_body``, then the fields its API type (from ``path``) requires (``validate_api_fields``)."""
    parsed = parse_body(body, limit, model_optional)
    validate_api_fields(parsed.document, path)
    return parsed


def outgoing_body(body: bytes, parsed: ParsedBody, model: str, priority: int | None = None) -> bytes:
    """The body the model server gets: ``model`` in its ``model`` field, and vLLM's ``priority`` set when given
    (``body`` itself when nothing changes)."""
    out = body if model == parsed.model else rewrite_request_model(body, parsed, model)
    return out if priority is None else set_request_field(out, "priority", priority)


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
