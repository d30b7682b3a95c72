"""``probing.cli.export.protowire``: the wire format for many rows at once, checked
against a byte-by-byte reading of each row."""

from __future__ import annotations

import numpy as np
import pytest

from probing.cli.export import protowire as wire


def read_varint(row: bytes) -> tuple[int, int]:
    """A varint from the start of ``row``: its value (64 bits) and its length."""
    value = 0
    for i, b in enumerate(row):
        value |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            return value & ((1 << 64) - 1), i + 1
    raise AssertionError(f"unterminated varint {row.hex()}")


def rows(part: wire.Bytes) -> list[bytes]:
    return [bytes(part.data[i, : int(part.size[i])]) for i in range(len(part.size))]


@pytest.mark.parametrize(
    "values",
    [
        np.array([0, 1, 127, 128, 300, 16383, 16384, (1 << 63) - 1], dtype=np.int64),
        np.array([-1, -(1 << 40), 5, 0], dtype=np.int64),  # negatives: 10 bytes
        # timestamps of one window: the high 7-bit groups are the same in every row
        1_795_000_000_000_000_000 + np.random.default_rng(1).integers(0, 10**10, 1000),
        # ... and a window that crosses a 2**35 boundary
        (1 << 35) * 52_000_000 - 5 + np.arange(10, dtype=np.int64),
        np.random.default_rng(2).integers(-(1 << 62), 1 << 62, 1000),
        np.array([7] * 5, dtype=np.int64),
    ],
)
def test_varints_read_back_as_the_values(values: np.ndarray) -> None:
    part = wire.varints(values)
    got = [read_varint(r) for r in rows(part)]
    assert [v for v, _ in got] == [int(x) & ((1 << 64) - 1) for x in values.tolist()]
    assert all(n == len(r) for (_, n), r in zip(got, rows(part), strict=True))


def test_join_lays_messages_end_to_end_with_and_without_absent_fields() -> None:
    n = 50
    rng = np.random.default_rng(3)
    ts = rng.integers(0, 1 << 50, n)
    present = rng.random(n) < 0.6
    message = [
        wire.const(wire.tag(8, wire.VARINT), n),
        wire.varints(ts),
        *wire.only([wire.const(b"\x99\x01", n), wire.fixed64(ts.astype(np.uint64))], present),
        wire.blobs([b"x" * (i % 4) for i in range(n)]),
    ]
    want = b"".join(
        b"\x40" + rows(message[1])[i]
        + (b"\x99\x01" + int(ts[i]).to_bytes(8, "little") if present[i] else b"")
        + b"x" * (i % 4)
        for i in range(n)
    )  # fmt: skip
    assert bytes(wire.join(message)) == want
    # every row full: no mask, the same bytes
    full = [message[0], message[1]]
    assert bytes(wire.join(full)) == b"".join(b"\x40" + r for r in rows(message[1]))
