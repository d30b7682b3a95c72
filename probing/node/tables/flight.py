"""``comm.flight`` and ``comm.flight_status``: PyTorch's Flight Recorder.

torch records each collective of every process group in a ring of its own
(``TORCH_FR_BUFFER_SIZE`` records, on by default in torch 2.13, 0 turns it
off), traced or not. The process dumps it (``probing.guest.flight``); here
it is one row per record, and one row saying whether it is on and why not.
Both are read afresh at each query: the ring is torch's, not the store's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa

SIZES = pa.list_(pa.list_(pa.int64()))
SCHEMA = pa.schema(
    [
        ("record_id", pa.int64()), ("pg_id", pa.int64()), ("pg", pa.string()),
        ("pg_desc", pa.string()), ("backend", pa.string()), ("op", pa.string()),
        ("seq", pa.int64()), ("p2p_seq", pa.int64()), ("op_id", pa.int64()),
        ("is_p2p", pa.bool_()), ("state", pa.string()), ("retired", pa.bool_()),
        ("input_sizes", SIZES), ("input_dtypes", pa.list_(pa.string())),
        ("output_sizes", SIZES), ("output_dtypes", pa.list_(pa.string())),
        ("bytes", pa.int64()), ("ts", pa.int64()), ("started_ns", pa.int64()),
        ("completed_ns", pa.int64()), ("dur_ns", pa.int64()), ("timeout_ms", pa.int64()),
        ("thread", pa.string()),
    ]
)  # fmt: skip
STATUS_SCHEMA = pa.schema(
    [
        ("state", pa.string()), ("reason", pa.string()), ("records", pa.int64()),
        ("buffer_size", pa.int64()), ("version", pa.string()),
    ]
)  # fmt: skip


def provider(flight_of: Callable[[], dict[str, Any]]) -> Callable[[], pa.Table]:
    """``comm.flight`` over a target's ``flight`` (``probing.target``): empty,
    with its columns, when the recorder is off."""

    def table() -> pa.Table:
        return pa.Table.from_pylist(flight_of().get("rows") or [], schema=SCHEMA)

    return table


def status_provider(flight_of: Callable[[], dict[str, Any]]) -> Callable[[], pa.Table]:
    """``comm.flight_status``: one row, the recorder's state and why."""

    def table() -> pa.Table:
        return status_table(flight_of())

    return table


def status_table(answer: dict[str, Any]) -> pa.Table:
    row = {
        "state": answer.get("state"),
        "reason": answer.get("reason") or "",
        "records": len(answer.get("rows") or []),
        "buffer_size": answer.get("buffer_size"),
        "version": answer.get("version"),
    }
    return pa.Table.from_pylist([row], schema=STATUS_SCHEMA)
