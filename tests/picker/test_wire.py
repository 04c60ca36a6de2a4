"""Every reply ``loraplane.picker.wire`` encodes decodes, with the real ext_proc protobuf classes, to the message the
protocol wants (built the ordinary way here)."""

from __future__ import annotations

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import wrappers_pb2
from hypothesis import given
from hypothesis import strategies as st

from loraplane.picker import wire
from tests.picker.conftest import routed_response, set_headers

BODIES = st.binary(max_size=200_000)


@given(st.sampled_from(["request_headers", "request_body"]), st.text(min_size=1, max_size=300),
       st.one_of(st.none(), st.integers(0, 1 << 40)), st.one_of(st.none(), st.binary(max_size=70_000)))
def test_routed_responses_decode_to_the_protocol_message(
    phase: str, destination: str, content_length: int | None, body: bytes | None
) -> None:
    encoded = wire.routed(phase, destination, content_length, body)
    assert pb.ProcessingResponse.FromString(encoded) == routed_response(phase, destination, content_length, body)


@given(st.integers(1, (1 << 64) - 1))
def test_varints_match_protobufs_own_encoding(value: int) -> None:
    assert wire._varint(value) == wrappers_pb2.UInt64Value(value=value).SerializeToString()[1:]  # after the key


@given(BODIES, st.booleans(), st.booleans())
def test_streamed_bodies_split_into_chunks_that_join_back(body: bytes, end: bool, response: bool) -> None:
    messages = [pb.ProcessingResponse.FromString(m) for m in wire.streamed_body(body, end, response)]
    phase = "response_body" if response else "request_body"
    assert all(m.WhichOneof("response") == phase for m in messages)
    pieces = [getattr(m, phase).response.body_mutation.streamed_response for m in messages]
    assert b"".join(p.body for p in pieces) == body
    assert all(len(p.body) <= wire.MAX_BODY_CHUNK for p in pieces)
    assert [p.end_of_stream for p in pieces] == [False] * (len(pieces) - 1) + [end]


@given(BODIES, st.booleans(), st.booleans())
def test_streamed_bodies_are_what_protobuf_serialises(body: bytes, end: bool, response: bool) -> None:
    pieces = [body[i : i + wire.MAX_BODY_CHUNK] for i in range(0, len(body), wire.MAX_BODY_CHUNK)] or [b""]
    expected = []
    for n, piece in enumerate(pieces):
        streamed = pb.StreamedBodyResponse(body=piece, end_of_stream=end and n == len(pieces) - 1)
        reply = pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed)))
        message = pb.ProcessingResponse(response_body=reply) if response else pb.ProcessingResponse(request_body=reply)
        expected.append(message.SerializeToString())
    assert list(wire.streamed_body(body, end, response)) == expected


@given(st.binary(max_size=5000), st.booleans())
def test_replaced_response_bodies(body: bytes, with_length: bool) -> None:
    common = pb.CommonResponse(body_mutation=pb.BodyMutation(body=body))
    if with_length:
        common.header_mutation.CopyFrom(set_headers([("content-length", str(len(body)))]))
    expected = pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))
    assert pb.ProcessingResponse.FromString(wire.response_body(body, with_length)) == expected


@given(st.integers(100, 599), st.lists(st.tuples(st.text(min_size=1, max_size=20), st.text(max_size=50)), max_size=4),
       st.binary(max_size=300), st.text(max_size=40))
def test_immediate_responses(status: int, headers: list[tuple[str, str]], body: bytes, details: str) -> None:
    decoded = pb.ProcessingResponse.FromString(wire.immediate(status, headers, body, details)).immediate_response
    assert decoded.status.code == status and decoded.body == body and decoded.details == details
    assert decoded.headers == set_headers(headers)


def test_constant_replies() -> None:
    mode = pm.ProcessingMode
    cases = {
        wire.CONTINUE_REQUEST_HEADERS: pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
        wire.CONTINUE_RESPONSE_HEADERS: pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
        wire.CONTINUE_RESPONSE_BODY: pb.ProcessingResponse(response_body=pb.BodyResponse()),
        wire.CONTINUE_REQUEST_TRAILERS: pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
        wire.CONTINUE_RESPONSE_TRAILERS: pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
        wire.buffer_request_body(mode.FULL_DUPLEX_STREAMED): pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(),
            mode_override=mode(request_body_mode=mode.BUFFERED, response_body_mode=mode.FULL_DUPLEX_STREAMED)),
    }
    for encoded, expected in cases.items():
        assert pb.ProcessingResponse.FromString(encoded) == expected
    for encoded, phase in ((wire.CLEAR_REQUEST_CHUNK, "request_body"), (wire.CLEAR_RESPONSE_CHUNK, "response_body")):
        assert getattr(pb.ProcessingResponse.FromString(encoded), phase).response.body_mutation.clear_body
    removed = pb.ProcessingResponse.FromString(wire.REMOVE_CONTENT_LENGTH).response_headers.response.header_mutation
    assert list(removed.remove_headers) == ["content-length"]
