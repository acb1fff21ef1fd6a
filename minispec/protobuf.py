"""The protobuf wire format, as much of it as minispec needs (no dependency on the protobuf package).

SentencePiece's tokenizer.model is a serialized ModelProto. The tokenizer reads its piece
types and normalizer flags and rewrites one flag; tools/convert_gguf.py builds one from a
GGUF vocabulary. Both go through the three functions here.
"""

from __future__ import annotations

import struct


class ProtobufError(ValueError):
    """Bytes that are not a well-formed protobuf message."""


def fields(data: bytes) -> list[tuple[int, int, int | bytes]]:
    """Top-level (field number, wire type, value) triples of a serialized message.

    Varints (wire 0) come back as ints, everything else as the raw bytes of the value.
    """
    i, out, n = 0, [], len(data)

    def varint(i: int) -> tuple[int, int]:
        v = shift = 0
        while True:
            if i >= n or shift > 63:
                raise ProtobufError("truncated or overlong varint")
            b = data[i]
            i += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return v, i

    while i < n:
        key, i = varint(i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            v, i = varint(i)
        elif wire in (1, 2, 5):
            size, i = (8, i) if wire == 1 else (4, i) if wire == 5 else varint(i)
            if i + size > n:
                raise ProtobufError(f"field {number} runs past the end of the message")
            v, i = data[i:i + size], i + size
        else:
            raise ProtobufError(f"unexpected wire type {wire} (field {number})")
        out.append((number, wire, v))
    return out


def varint(n: int) -> bytes:
    """A varint; negative int32 values become 10-byte two's complement, as protobuf sends them."""
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, value: int | bytes | str | float, wire: int | None = None) -> bytes:
    """One encoded field: ints as varints, bytes and str as length-delimited, floats as fixed32
    (wire 1 and 5 with raw bytes pass through as they were read)."""
    if wire is None:
        wire = 0 if isinstance(value, int) else 5 if isinstance(value, float) else 2
    if wire == 0:
        return varint(number << 3) + varint(int(value))
    if wire == 5 and isinstance(value, float):
        return varint(number << 3 | 5) + struct.pack("<f", value)
    if isinstance(value, str):
        value = value.encode("utf-8")
    if wire == 2:
        return varint(number << 3 | 2) + varint(len(value)) + value
    return varint(number << 3 | wire) + value  # fixed 32/64-bit: raw bytes
