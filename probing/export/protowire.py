"""Protobuf's wire format for many messages at once (numpy), one per row.

``TraceWriter`` writes a chunk's slices and counters with it: building
TrackEvent packets one by one through the protobuf runtime cost ~20 µs an
event, six times what reading the rows costs. Here a field of n messages is
``Bytes``: n byte strings, one per row, held as their sizes and an
``(n, width)`` matrix whose row i starts with string i (the rest is padding).
A message is a list of fields; ``join`` lays the n messages end to end:
with the fields' matrices side by side, the bytes inside each size, read in
row-major order, are exactly message 0, message 1, ...

The encodings (https://protobuf.dev/programming-guides/encoding/): a tag is
``field << 3 | wire type`` as a varint; varints hold 7 bits a byte, low
first, the top bit set on every byte but the last (a negative int64 as its
64-bit two's complement: 10 bytes); fixed64 and double are 8 bytes, little
endian; a length-delimited field is its tag, its size as a varint, its bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

VARINT, FIXED64, LEN = 0, 1, 2
_WIDTHS = np.array([1 << (7 * k) for k in range(1, 10)], dtype=np.uint64)


class Bytes(NamedTuple):
    """One field of n messages: ``size[i]`` bytes of ``data[i]`` (the rest is padding)."""

    size: np.ndarray  # int64, (n,)
    data: np.ndarray  # uint8, (n, width)


Message = list[Bytes]


def varint_bytes(value: int) -> bytes:
    """One varint (tags, sizes, the odd packet)."""
    out = bytearray()
    value &= (1 << 64) - 1
    while True:
        low = value & 0x7F
        value >>= 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def tag(field: int, wire: int) -> bytes:
    return varint_bytes(field << 3 | wire)


def const(data: bytes, n: int) -> Bytes:
    """The same bytes in every row."""
    row = np.frombuffer(data, dtype=np.uint8)
    return Bytes(np.full(n, len(data), dtype=np.int64), np.broadcast_to(row, (n, len(data))))


def varints(values: np.ndarray) -> Bytes:
    """Each value as a varint (signed values: two's complement, as int64 is written)."""
    v = np.ascontiguousarray(values).astype(np.int64, copy=False).view(np.uint64)
    if not len(v) or int(v.max()) < 0x80:  # one byte each (ids, flags, small counts)
        return Bytes(np.ones(len(v), np.int64), v.astype(np.uint8).reshape(-1, 1))
    size = np.searchsorted(_WIDTHS, v, side="right").astype(np.int64) + 1
    width = int(size.max())
    shifts = np.arange(0, 7 * width, 7, dtype=np.uint64)
    data = ((v[:, None] >> shifts[None, :]) & np.uint64(0x7F)).astype(np.uint8)
    data[np.arange(width)[None, :] < size[:, None] - 1] |= 0x80
    return Bytes(size, data)


def fixed64(values: np.ndarray) -> Bytes:
    """Each value as 8 little-endian bytes (uint64 or float64: double)."""
    kind = "<f8" if values.dtype.kind == "f" else "<u8"
    data = np.ascontiguousarray(values, dtype=kind).view(np.uint8).reshape(-1, 8)
    return Bytes(np.full(len(values), 8, dtype=np.int64), data)


def blobs(values: list[bytes]) -> Bytes:
    """Byte strings of any length (the rare string written whole)."""
    size = np.array([len(b) for b in values], dtype=np.int64)
    width = int(size.max()) if len(values) else 0
    data = np.zeros((len(values), width), dtype=np.uint8)
    for i, b in enumerate(values):
        data[i, : len(b)] = np.frombuffer(b, dtype=np.uint8)
    return Bytes(size, data)


def size(message: Message, n: int) -> np.ndarray:
    """Each row's message size in bytes."""
    total = np.zeros(n, dtype=np.int64)
    for part in message:
        total += part.size
    return total


def nested(field: int, message: Message, n: int) -> Message:
    """``message`` as a length-delimited field of the one around it."""
    return [const(tag(field, LEN), n), varints(size(message, n)), *message]


def only(message: Message, present: np.ndarray) -> Message:
    """``message`` in the rows where ``present``, nothing in the others."""
    keep = present.astype(np.int64)
    return [Bytes(part.size * keep, part.data) for part in message]


def _full(part: Bytes) -> bool:
    """Every row as wide as the matrix (no padding)."""
    return bool((part.size == part.data.shape[1]).all())


def _runs(message: Message) -> Message:
    """Fields with no padding merged into the next: fewer, wider fields."""
    out: Message = []
    run: Message = []
    for part in message:
        run.append(part)
        if not _full(part):
            out.append(_merge(run))
            run = []
    if run:
        out.append(_merge(run))
    return out


def _merge(run: Message) -> Bytes:
    if len(run) == 1:
        return run[0]
    fixed = sum(part.data.shape[1] for part in run[:-1])
    data = np.concatenate([part.data for part in run], axis=1)
    return Bytes(run[-1].size + fixed, data)


def join(message: Message) -> np.ndarray:
    """The n messages end to end (a uint8 array: a buffer ``file.write`` takes)."""
    if not message or not len(message[0].size):
        return np.zeros(0, dtype=np.uint8)
    runs = _runs(message)
    data = np.concatenate([part.data for part in runs], axis=1)
    if len(runs) == 1 and _full(runs[0]):
        return data.reshape(-1)
    mask = np.empty(data.shape, dtype=bool)
    at = 0
    for part in runs:
        width = part.data.shape[1]
        np.less(np.arange(width)[None, :], part.size[:, None], out=mask[:, at : at + width])
        at += width
    return data[mask]
