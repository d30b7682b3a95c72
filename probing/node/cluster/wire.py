"""What travels between peers: a JSON head line, then Arrow IPC streams.

``pack(meta, tables)`` writes ``<json>\\n`` followed by one Arrow IPC stream
per table; the head says each table's name and byte length. Every answer
also carries the peer's clock (``t_recv_ns``, ``t_send_ns``), from which
the asker estimates the offset NTP-style (``clock_offset``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

CLUSTER_CONTENT_TYPE = "application/vnd.probing.node.cluster"


@dataclass
class MissingPeer:
    """A peer that sent nothing in time: ``reason`` is timeout, refused, 401, ..."""

    rank: int
    node: str
    addr: str
    reason: str


@dataclass
class PeerTiming:
    """A peer that answered: round trip in ms, and its clock minus the asker's."""

    rank: int
    node: str
    addr: str
    response_ms: float
    clock_offset_ns: int


def clock_offset(t0: int, t1: int, t2: int, t3: int) -> int:
    """NTP offset (peer clock minus ours): sent at t0, peer got it at t1,
    answered at t2, we got it at t3. Exact when both legs take equally long."""
    return ((t1 - t0) + (t2 - t3)) // 2


def table_bytes(table: pa.Table) -> bytes:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data: bytes = sink.getvalue().to_pybytes()
    return data


def pack(meta: dict[str, Any], tables: dict[str, pa.Table], t_recv_ns: int) -> bytes:
    """Head line + streams; ``t_send_ns`` is stamped last, after encoding."""
    blobs = [(name, table_bytes(t)) for name, t in tables.items()]
    head = dict(meta)
    head["tables"] = [[name, len(blob)] for name, blob in blobs]
    head["t_recv_ns"] = t_recv_ns
    head["t_send_ns"] = time.time_ns()
    return json.dumps(head, default=str).encode() + b"\n" + b"".join(b for _, b in blobs)


def unpack(data: bytes) -> tuple[dict[str, Any], dict[str, pa.Table]]:
    """The inverse of ``pack``; ValueError when the bytes are not such a message."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    nl = data.find(b"\n")
    if nl < 0:
        raise ValueError("no head line")
    head = json.loads(data[:nl])
    tables: dict[str, pa.Table] = {}
    pos = nl + 1
    for name, length in head.get("tables", []):
        tables[name] = ipc.open_stream(pa.py_buffer(data[pos : pos + length])).read_all()
        pos += length
    if pos != len(data):
        raise ValueError(f"{len(data) - pos} trailing bytes")
    return head, tables


def missing_from(items: list[dict[str, Any]]) -> list[MissingPeer]:
    return [MissingPeer(**m) for m in items]


def timings_from(items: list[dict[str, Any]]) -> list[PeerTiming]:
    return [PeerTiming(**t) for t in items]
