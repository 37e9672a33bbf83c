"""Reading a SentencePiece ``.model`` file (a protobuf ModelProto) without the
sentencepiece or protobuf packages: only the pieces and their types are needed."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message, enough for ModelProto."""
    pos = 0
    value: Any
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        elif wire == 5:
            value, pos = struct.unpack("<f", buf[pos : pos + 4])[0], pos + 4
        else:
            raise ValueError(f"wire type {wire}")
        yield field, wire, value


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def sentencepiece_pieces(path: Path) -> list[tuple[str, int]]:
    """(piece, type) in id order; type 1 normal, 2 unknown, 3 control, 6 byte."""
    pieces: list[tuple[str, int]] = []
    for field, _, value in _fields(path.read_bytes()):
        if field == 1:
            piece, kind = "", 1
            for f, _, v in _fields(value):
                if f == 1:
                    piece = v.decode()
                elif f == 3:
                    kind = v
            pieces.append((piece, kind))
    return pieces
