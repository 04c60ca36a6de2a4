"""Routed responses are encoded from cached pieces on the wire: they must decode to the message the protocol wants."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2 as core
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st

from loraplane.picker.extproc import DESTINATION_HEADER, _destination_metadata, _routed, _routing_common


def expected(phase: str, destination: str, content_length: int | None, body: bytes | None) -> pb.ProcessingResponse:
    headers = [(DESTINATION_HEADER, destination)] + ([("content-length", str(content_length))] if content_length is not None else [])
    common = pb.CommonResponse(clear_route_cache=True, header_mutation=pb.HeaderMutation(set_headers=[
        core.HeaderValueOption(header=core.HeaderValue(key=k, raw_value=v.encode()),
                               append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD) for k, v in headers]))
    if body is not None:
        common.body_mutation.body = body
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct("envoy.lb")[DESTINATION_HEADER] = destination
    response = pb.ProcessingResponse(dynamic_metadata=metadata)
    getattr(response, phase).response.CopyFrom(common)
    return response


@given(st.sampled_from(["request_headers", "request_body"]), st.text(min_size=1, max_size=300),
       st.one_of(st.none(), st.integers(0, 1 << 40)), st.one_of(st.none(), st.binary(max_size=70_000)))
def test_wire_encoded_routed_responses_decode_to_the_protocol_message(
    phase: str, destination: str, content_length: int | None, body: bytes | None
) -> None:
    wire = _routed(phase, _routing_common(destination, content_length), _destination_metadata(destination), body)
    assert pb.ProcessingResponse.FromString(wire) == expected(phase, destination, content_length, body)
