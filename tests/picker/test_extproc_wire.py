"""Routed responses are encoded from cached pieces on the wire: they must decode to the message the protocol wants."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given
from hypothesis import strategies as st

from loraplane.picker.extproc import _destination_metadata, _routed, _routing_common
from tests.picker.conftest import routed_response


@given(st.sampled_from(["request_headers", "request_body"]), st.text(min_size=1, max_size=300),
       st.one_of(st.none(), st.integers(0, 1 << 40)), st.one_of(st.none(), st.binary(max_size=70_000)))
def test_wire_encoded_routed_responses_decode_to_the_protocol_message(
    phase: str, destination: str, content_length: int | None, body: bytes | None
) -> None:
    wire = _routed(phase, _routing_common(destination, content_length), _destination_metadata(destination), body)
    assert pb.ProcessingResponse.FromString(wire) == routed_response(phase, destination, content_length, body)
