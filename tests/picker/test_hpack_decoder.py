"""The fast HPACK decoder agrees with the reference ``hpack`` package, including Huffman and table eviction."""

from __future__ import annotations

import pytest
from hpack import Encoder
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.picker.transport.hpack_decoder import HpackDecoder, HpackError

header_lists = st.lists(
    st.tuples(st.sampled_from([":path", ":method", "content-type", "x-request-id", "grpc-timeout", "x-a", "x-b"]),
              st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=300)),
    min_size=1, max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(blocks=st.lists(header_lists, min_size=1, max_size=20), huffman=st.booleans())
def test_decodes_what_hpack_encodes(blocks: list[list[tuple[str, str]]], huffman: bool) -> None:
    encoder, decoder = Encoder(), HpackDecoder()
    encoder.header_table_size = 256  # small table: entries get evicted and size updates are sent
    for headers in blocks:
        wire = encoder.encode(headers, huffman=huffman)
        assert decoder.decode(wire) == [(k.encode(), v.encode()) for k, v in headers]
        assert decoder.last_list_size == sum(len(k.encode()) + len(v.encode()) + 32 for k, v in headers)


@pytest.mark.parametrize("wire", [b"\x80", b"\xff\xff\xff\xff\xff\xff\x0f", b"\x40\x85abc", b"\x00\x81\xff\x00", b"\x3f\xff\xff\x7f"])
def test_malformed_blocks_are_refused(wire: bytes) -> None:
    with pytest.raises(HpackError):
        HpackDecoder().decode(wire)


@settings(max_examples=100, deadline=None)
@given(blocks=st.lists(header_lists, min_size=1, max_size=10))
def test_with_a_zero_table_only_wanted_headers_are_decoded(blocks: list[list[tuple[str, str]]]) -> None:
    encoder, decoder = Encoder(), HpackDecoder(wanted=frozenset({b":path"}))
    encoder.header_table_size = 0  # what the peer does after our SETTINGS_HEADER_TABLE_SIZE=0
    for headers in blocks:
        decoded = decoder.decode(encoder.encode(headers))
        assert decoded == [(k.encode(), v.encode()) for k, v in headers if k == ":path"]
        # skipped values count at their encoded length: never below what a Huffman code can shrink them to
        exact = sum(len(k.encode()) + len(v.encode()) + 32 for k, v in headers)
        assert exact * 5 // 8 <= decoder.last_list_size
