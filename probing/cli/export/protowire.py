"""Protobuf's wire format for many messages at once (numpy), one per row.

``TraceWriter`` writes a chunk's slices and counters with it: building
TrackEvent packets one by one through the protobuf runtime cost ~20 µs an
event, six times what reading the rows costs. Here a field of n messages is
``Bytes``: n byte strings, one per row, held as their sizes and an
``(n, width)`` matrix whose row i starts with string i (the rest is padding).
A message is a list of fields; ``join`` lays the n messages end to end:
with the fields' matrices side by side, the bytes inside each size, read in
row-major order, are exactly message 0, message 1, ...

What makes it fast: most fields have the same width in every row (a
constant, a fixed64, a varint column written at its widest value's width,
padded with continuation bytes as protozero pads the sizes it backfills), so
that their sizes are one number (``bytes_each``), the nested sizes are
constants, and the matrix is the output with no mask; only a field absent
in some rows (``only``: a null arg, a call still running) needs one.

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

    size: np.ndarray  # int64, (n,); read-only, stride 0 where every row is full
    data: np.ndarray  # uint8, (n, width)


Message = list[Bytes]
BLOCK_BYTES = 1 << 18  # rows laid out together by ``join`` (in a core's L2 cache)


def bytes_each(data: np.ndarray) -> Bytes:
    """Row i is ``data[i]``, every row as wide as ``data`` (its size one number, broadcast)."""
    return Bytes(np.broadcast_to(np.int64(data.shape[1]), (data.shape[0],)), data)


def _is_full(part: Bytes) -> bool:
    return part.size.strides[0] == 0 and int(part.size[0]) == part.data.shape[1]


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
    return bytes_each(np.broadcast_to(row, (n, len(data))))


def varints(values: np.ndarray) -> Bytes:
    """Each value as a varint (signed values: two's complement, as int64 is written),
    all as wide as the widest: a smaller value padded with continuation bytes
    (0x80 ... 0x00), as protozero pads the sizes it backfills. Every reader
    takes a varint of up to 10 bytes, and a column of one width lays out
    without a mask (``join``)."""
    v = np.ascontiguousarray(values).astype(np.int64, copy=False).view(np.uint64)
    n = len(v)
    if not n or int(v.max()) < 0x80:  # one byte each (ids, flags, small counts)
        return bytes_each(v.astype(np.uint8).reshape(-1, 1))
    low, high = int(v.min()), int(v.max())
    width = int(np.searchsorted(_WIDTHS, high, side="right")) + 1
    data = np.empty((n, width), dtype=np.uint8)
    for k in range(width):
        more = 0x80 if k < width - 1 else 0  # the top bit: another byte follows
        if low >> 7 * k == high >> 7 * k:  # the same from here up in every row (timestamps)
            data[:, k] = (low >> 7 * k) & 0x7F | more
        else:
            group = (v >> np.uint64(7 * k)).astype(np.uint8)  # the low 8 bits
            group &= 0x7F
            group |= more
            data[:, k] = group
    return bytes_each(data)


def fixed64(values: np.ndarray) -> Bytes:
    """Each value as 8 little-endian bytes (uint64 or float64: double)."""
    kind = "<f8" if values.dtype.kind == "f" else "<u8"
    data = np.ascontiguousarray(values, dtype=kind).view(np.uint8).reshape(-1, 8)
    return bytes_each(data)


def blobs(values: list[bytes]) -> Bytes:
    """Byte strings of any length (the rare string written whole)."""
    size = np.array([len(b) for b in values], dtype=np.int64)
    width = int(size.max()) if len(values) else 0
    data = np.zeros((len(values), width), dtype=np.uint8)
    for i, b in enumerate(values):
        data[i, : len(b)] = np.frombuffer(b, dtype=np.uint8)
    return Bytes(size, data)


def size(message: Message, n: int) -> np.ndarray:
    """Each row's message size in bytes (broadcast where every row has one)."""
    if all(part.size.strides[0] == 0 for part in message):
        width = sum(int(part.size[0]) for part in message) if n else 0
        return np.broadcast_to(np.int64(width), (n,))
    total = np.zeros(n, dtype=np.int64)
    for part in message:
        total += part.size
    return total


def nested(field: int, message: Message, n: int) -> Message:
    """``message`` as a length-delimited field of the one around it."""
    sizes = size(message, n)
    if n and sizes.strides[0] == 0:  # one size: a constant
        return [const(tag(field, LEN) + varint_bytes(int(sizes[0])), n), *message]
    return [const(tag(field, LEN), n), varints(sizes), *message]


def only(message: Message, present: np.ndarray) -> Message:
    """``message`` in the rows where ``present``, nothing in the others."""
    if present.all():
        return message
    if not present.any():
        return []
    keep = present.astype(np.int64)
    return [Bytes(part.size * keep, part.data) for part in message]


def join(message: Message) -> np.ndarray:
    """The n messages end to end (a uint8 array: a buffer ``file.write`` takes):
    the fields side by side in one (n, width) matrix, read row by row, less
    the padding of the fields narrower in some rows than in others."""
    if not message or not len(message[0].size):
        return np.zeros(0, dtype=np.uint8)
    n = len(message[0].size)
    width = sum(part.data.shape[1] for part in message)
    # the constant fields as one row copied to every row; each other field as
    # one strided copy of n items of its width (numpy's void type: a (n, w)
    # slice of a wider matrix would copy row by row)
    row = np.zeros(width, dtype=np.uint8)
    out = np.empty((n, width), dtype=np.uint8)
    ragged, fields = [], []
    at = 0
    for part in message:
        w = part.data.shape[1]
        if part.data.strides[0] == 0:
            row[at : at + w] = part.data[0]
        elif w:
            items = np.ascontiguousarray(part.data).view(f"V{w}").reshape(-1)
            place = np.ndarray((n,), f"V{w}", buffer=out, offset=at, strides=(width,))
            fields.append((place, items))
        if not _is_full(part):
            ragged.append((at, part))
        at += w
    out[:] = row
    # a block of rows at a time, so that the block stays in the cache while
    # each of its fields is written
    block = max(1, BLOCK_BYTES // width)
    for lo in range(0, n, block):
        for place, items in fields:
            place[lo : lo + block] = items[lo : lo + block]
    if not ragged:
        return out.reshape(-1)
    mask = np.ones((n, width), dtype=bool)
    for at, part in ragged:
        for j in range(part.data.shape[1]):
            np.greater(part.size, j, out=mask[:, at + j])
    return out[mask]
