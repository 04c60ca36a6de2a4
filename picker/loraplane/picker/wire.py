"""The ext_proc ``ProcessingResponse``s the picker sends, as wire bytes.

Every reply the exchange (``loraplane.picker.extproc``) produces is built here: the constant ones are encoded once,
the routed ones are joined from cached encoded pieces (see ``routed``), so the hot path builds no protobuf objects.
Each function's result decodes, with the real ``envoy.service.ext_proc.v3`` classes, to the message its docstring
names (tests/picker/test_wire.py round-trips them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache

from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.protobuf.message import Message

#: a wire-encoded ``ProcessingResponse``
Wire = bytes

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
#: largest body piece of one ``StreamedBodyResponse``
MAX_BODY_CHUNK = 62_000

CONTINUE_REQUEST_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse()).SerializeToString()
CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse()).SerializeToString()
CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse()).SerializeToString()
CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse()).SerializeToString()
CONTINUE_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse()).SerializeToString()
CLEAR_REQUEST_CHUNK = pb.ProcessingResponse(request_body=pb.BodyResponse(
    response=pb.CommonResponse(body_mutation=pb.BodyMutation(clear_body=True)))).SerializeToString()
CLEAR_RESPONSE_CHUNK = pb.ProcessingResponse(response_body=pb.BodyResponse(
    response=pb.CommonResponse(body_mutation=pb.BodyMutation(clear_body=True)))).SerializeToString()
#: CONTINUE on the response headers, removing ``content-length`` (the body will be rewritten)
REMOVE_CONTENT_LENGTH = pb.ProcessingResponse(response_headers=pb.HeadersResponse(
    response=pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=["content-length"]))
)).SerializeToString()


@lru_cache(maxsize=8192)
def _header_option(key: str, value: str) -> core.HeaderValueOption:
    """A SET (overwrite or add) of one header; cached, as destinations and lengths repeat."""
    return core.HeaderValueOption(
        header=core.HeaderValue(key=key, raw_value=value.encode()),
        append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _set_headers(pairs: Iterable[tuple[str, str]]) -> pb.HeaderMutation:
    return pb.HeaderMutation(set_headers=[_header_option(k, v) for k, v in pairs])


def immediate(status: int, headers: Sequence[tuple[str, str]], body: bytes, details: str) -> Wire:
    """``ProcessingResponse{immediate_response: {status, headers (SET), body, details}}``."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(status=http_status_pb2.HttpStatus(code=status),
                                                headers=_set_headers(headers), body=body, details=details)
    ).SerializeToString()


@lru_cache(maxsize=1 << 14)  # building even a two-byte varint in Python costs more than the cache's lookup
def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(message: type[Message], field: str) -> bytes:
    """The wire key of a length-delimited (message or bytes) field."""
    return _varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


_PHASE_KEYS = {phase: _key(pb.ProcessingResponse, phase) for phase in ("request_headers", "request_body", "response_body")}
_COMMON_KEY = _key(pb.BodyResponse, "response")  # HeadersResponse.response has the same number
assert _COMMON_KEY == _key(pb.HeadersResponse, "response")
_BODY_MUTATION_KEY = _key(pb.CommonResponse, "body_mutation")
_BODY_KEY = _key(pb.BodyMutation, "body")
_STREAMED_KEY = _key(pb.BodyMutation, "streamed_response")
_STREAMED_BODY_KEY = _key(pb.StreamedBodyResponse, "body")
#: ``end_of_stream: true`` of a ``StreamedBodyResponse`` (a varint field)
_END_OF_STREAM = _varint(pb.StreamedBodyResponse.DESCRIPTOR.fields_by_name["end_of_stream"].number << 3) + b"\x01"


@lru_cache(maxsize=8192)
def _destination_metadata(value: str) -> bytes:
    """The ``dynamic_metadata`` field of a routed response (``envoy.lb`` -> destination), encoded."""
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(LB_NAMESPACE)[DESTINATION_HEADER] = value
    return pb.ProcessingResponse(dynamic_metadata=metadata).SerializeToString()


@lru_cache(maxsize=8192)
def _routing_common(destination: str, content_length: int | None) -> bytes:
    """The encoded ``CommonResponse`` fields of a routed response: the destination (and length) headers, clear_route_cache."""
    pairs = [(DESTINATION_HEADER, destination)]
    if content_length is not None:
        pairs.append(("content-length", str(content_length)))
    return pb.CommonResponse(header_mutation=_set_headers(pairs), clear_route_cache=True).SerializeToString()


def routed(phase: str, destination: str, content_length: int | None = None, body: bytes | None = None) -> Wire:
    """``ProcessingResponse{<phase>: {response: {header_mutation: destination (and content-length),
    clear_route_cache, body_mutation{body}}}, dynamic_metadata: {envoy.lb: {destination}}}``.

    ``phase`` is ``request_headers`` or ``request_body``. Protobuf parsers merge repeated occurrences of a message
    field, so cached encoded pieces can be concatenated; the body is copied once (into the joined result) instead
    of into a message and out again.
    """
    pieces: list[bytes | memoryview] = [_routing_common(destination, content_length)]
    if body is not None:
        body_field: list[bytes | memoryview] = [_BODY_KEY, _varint(len(body)), body]
        _prepend_length(body_field, _BODY_MUTATION_KEY)
        pieces += body_field
    _prepend_length(pieces, _COMMON_KEY)
    _prepend_length(pieces, _PHASE_KEYS[phase])
    pieces.append(_destination_metadata(destination))
    return b"".join(pieces)


def _prepend_length(pieces: list[bytes | memoryview], key: bytes) -> None:
    """Make ``pieces`` (to be joined) one length-delimited field ``key`` holding them."""
    pieces[:0] = (key, _varint(sum(map(len, pieces))))


def response_body(body: bytes, with_length: bool) -> Wire:
    """``ProcessingResponse{response_body: {response: {body_mutation{body}}}}`` replacing the chunk with ``body``;
    ``with_length``: also SET ``content-length``."""
    common = pb.CommonResponse(body_mutation=pb.BodyMutation(body=body))
    if with_length:
        common.header_mutation.CopyFrom(_set_headers([("content-length", str(len(body)))]))
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common)).SerializeToString()


@lru_cache(maxsize=8)
def buffer_request_body(response_body_mode: int) -> Wire:
    """CONTINUE on the request headers, switching this request's body to BUFFERED (Envoy's ``mode_override``)."""
    mode = pm.ProcessingMode(request_body_mode=pm.ProcessingMode.BUFFERED, response_body_mode=response_body_mode)
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=mode).SerializeToString()


def streamed_body(body: bytes, end_of_stream: bool = True, response: bool = False) -> Iterable[Wire]:
    """``FULL_DUPLEX_STREAMED`` body mutations (``streamed_response``) of at most ``MAX_BODY_CHUNK`` bytes each, on
    the request body (or the response body with ``response``); the last carries ``end_of_stream``.

    Joined from encoded pieces as ``routed`` is, byte for byte what ``SerializeToString`` gives: each piece of the
    body is copied once, into its message.
    """
    phase = _PHASE_KEYS["response_body" if response else "request_body"]
    view = memoryview(body)
    starts = range(0, len(body), MAX_BODY_CHUNK) or range(1)
    for start in starts:
        piece = view[start : start + MAX_BODY_CHUNK]
        pieces: list[bytes | memoryview] = [_STREAMED_BODY_KEY, _varint(len(piece)), piece] if piece else []  # proto3 leaves out an empty body
        if end_of_stream and start == starts[-1]:
            pieces.append(_END_OF_STREAM)
        for key in (_STREAMED_KEY, _BODY_MUTATION_KEY, _COMMON_KEY, phase):
            _prepend_length(pieces, key)
        yield b"".join(pieces)
