"""A fast HPACK (RFC 7541) header-block decoder for the picker's HTTP/2 transport.

The ``hpack`` package decodes Huffman strings nibble by nibble in Python and logs every field; on the picker's
hot path that cost ~200 us per gRPC call (Envoy sends a fresh Huffman-coded ``x-request-id`` on each). This decoder
walks Huffman data a byte at a time through a memoised (state, byte) table built from ``hpack``'s own state machine,
and keeps the dynamic table as a deque. It only decodes; the picker's responses use literal fields that never touch
the peer's dynamic table.
"""

from __future__ import annotations

from collections import deque

from hpack.huffman_table import HUFFMAN_COMPLETE, HUFFMAN_EMIT_SYMBOL, HUFFMAN_FAIL, HUFFMAN_TABLE
from hpack.table import HeaderTable

STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = HeaderTable.STATIC_TABLE
DEFAULT_TABLE_SIZE = 4096
_MAX_INTEGER = 1 << 28


class HpackError(Exception):
    """The header block is malformed (an HTTP/2 COMPRESSION_ERROR)."""


_FAILED = (b"", 0, HUFFMAN_FAIL)
_byte_steps: dict[int, tuple[bytes, int, int]] = {}


def _step(state: int, byte: int) -> tuple[bytes, int, int]:
    emitted = bytearray()
    flags = 0
    for nibble in (byte >> 4, byte & 0x0F):
        state, flags, symbol = HUFFMAN_TABLE[state * 16 + nibble]
        if flags & HUFFMAN_FAIL:
            return _FAILED
        if flags & HUFFMAN_EMIT_SYMBOL:
            emitted.append(symbol)
    return bytes(emitted), state, flags


def huffman_decode(data: bytes) -> bytes:
    """Decode an HPACK Huffman string."""
    state, flags = 0, HUFFMAN_COMPLETE
    out = []
    steps = _byte_steps
    for byte in data:
        key = state << 8 | byte
        step = steps.get(key)
        if step is None:
            step = steps[key] = _step(state, byte)
        emitted, state, flags = step
        if flags & HUFFMAN_FAIL:
            raise HpackError("invalid Huffman string")
        if emitted:
            out.append(emitted)
    if not flags & HUFFMAN_COMPLETE:
        raise HpackError("Huffman string ends mid-symbol")
    return b"".join(out)


def _integer(block: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    mask = (1 << prefix_bits) - 1
    value = block[i] & mask
    i += 1
    if value < mask:
        return value, i
    shift = 0
    while True:
        if i >= len(block):
            raise HpackError("truncated integer")
        byte = block[i]
        i += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if value > _MAX_INTEGER:
            raise HpackError("integer too large")
        if not byte & 0x80:
            return value, i


_memo: dict[bytes, bytes] = {}


def _string(block: bytes, i: int, decode: bool = True) -> tuple[bytes, int]:
    """A string literal (Huffman-decoded, memoised: names and paths repeat); ``decode=False`` only skips it (and
    returns b"")."""
    if i >= len(block):
        raise HpackError("truncated string")
    huffman = block[i] & 0x80
    length = block[i] & 0x7F
    if length == 0x7F:  # a length of 127 or more: the integer continues
        length, i = _integer(block, i, 7)
    else:
        i += 1
    end = i + length
    if end > len(block):
        raise HpackError("truncated string")
    if not decode:
        return b"", end
    data = block[i:end]
    if not huffman:
        return data, end
    text = _memo.get(data)
    if text is None:
        if len(_memo) > 4096:
            _memo.clear()
        text = _memo[data] = huffman_decode(data)
    return text, end


class HpackDecoder:
    """Decodes the header blocks of one connection (the dynamic table is per connection)."""

    def __init__(self, max_table_size: int = DEFAULT_TABLE_SIZE, wanted: frozenset[bytes] | None = None) -> None:
        """``max_table_size``: the largest table size update accepted (the peer starts at 4096 in any case).

        ``wanted``: when set, and once the peer has shrunk the dynamic table to 0 (after our
        SETTINGS_HEADER_TABLE_SIZE=0), values of other headers are skipped undecoded and left out.
        """
        self.wanted = wanted
        self.allowed_size = max_table_size
        self.max_size = max_table_size
        self.size = 0
        self.table: deque[tuple[bytes, bytes]] = deque()
        #: RFC 7541 size (name + value + 32 per field) of the last decoded block's whole list, skipped fields included
        #: (a skipped Huffman value counted at its encoded length)
        self.last_list_size = 0

    def _get(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= len(STATIC_TABLE):
            return STATIC_TABLE[index - 1]
        dynamic = index - len(STATIC_TABLE) - 1
        if index == 0 or dynamic >= len(self.table):
            raise HpackError(f"header index {index} out of range")
        return self.table[dynamic]

    def _add(self, name: bytes, value: bytes) -> None:
        self.table.appendleft((name, value))
        self.size += len(name) + len(value) + 32
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_size and self.table:
            name, value = self.table.pop()
            self.size -= len(name) + len(value) + 32

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The (name, value) pairs of one complete header block (only ``wanted`` ones in skip mode)."""
        headers = []
        wanted = self.wanted
        i, n = 0, len(block)
        list_size = 0
        while i < n:
            byte = block[i]
            if byte & 0x80:  # indexed field
                index, i = _integer(block, i, 7)
                field = self._get(index)
                list_size += len(field[0]) + len(field[1]) + 32
                if wanted is None or field[0] in wanted:
                    headers.append(field)
            elif byte & 0x40:  # literal with incremental indexing
                index, i = _integer(block, i, 6)
                name, i = (self._get(index)[0], i) if index else _string(block, i)
                if self.max_size == 0 and wanted is not None:
                    start = i
                    value, i = _string(block, i, name in wanted)  # nothing is kept in a 0-byte table
                    list_size += len(name) + i - start + 32
                    if name in wanted:
                        headers.append((name, value))
                    continue
                value, i = _string(block, i)
                list_size += len(name) + len(value) + 32
                self._add(name, value)
                headers.append((name, value))
            elif byte & 0x20:  # dynamic table size update
                size, i = _integer(block, i, 5)
                if size > self.allowed_size:
                    raise HpackError("table size update above the advertised maximum")
                self.max_size = size
                self._evict()
            else:  # literal without indexing / never indexed
                index, i = _integer(block, i, 4)
                name, i = (self._get(index)[0], i) if index else _string(block, i)
                keep = wanted is None or name in wanted
                start = i
                value, i = _string(block, i, keep)
                list_size += len(name) + max(len(value), i - start) + 32
                if keep:
                    headers.append((name, value))
        self.last_list_size = list_size
        return headers
