"""Rows gathered from every rank of a job, tagged ``node`` and ``rank``.

The asking is the client's (``probing.cli.client.Job``: local pids over their
sockets, or the cluster through one probe); here are the pieces both sides
share: the tags, the rank expression, and the ranks a gather missed.
"""

from __future__ import annotations

import json
from typing import Protocol

import pyarrow as pa

from probing.errors import ProbingError

MISSING_KEY = b"probing.missing"
RANK_EXPR = (
    "(lambda d: d.get_rank() if d is not None and d.is_initialized() "
    "else int(os.environ.get('RANK', '-1')))(sys.modules.get('torch.distributed'))"
)


def tag(table: pa.Table, node: str, rank: int) -> pa.Table:
    """``table`` with its ``node`` and ``rank`` columns set to this rank's."""
    for name in ("node", "rank"):
        if name in table.column_names:
            table = table.drop_columns([name])
    n = table.num_rows
    table = table.append_column("node", pa.array([node] * n, type=pa.string()))
    return table.append_column("rank", pa.array([rank] * n, type=pa.int64()))


_RANKS: dict[tuple[int, float], int] = {}  # (pid, its start time) -> rank


class Queries(Protocol):
    """What ``process_rank`` needs of a probe's client (``probing.cli.client.ProbeClient``)."""

    def query(self, sql: str) -> pa.Table: ...


def process_rank(client: Queries, pid: int) -> int:
    """A local process's rank in its job (-1 when it has none); asked once per process."""
    key = (pid, _start_time(pid))
    if key in _RANKS:
        return _RANKS[key]
    try:
        value = client.query(f"SELECT value FROM python.`{RANK_EXPR}`")
        rank = int(value.column(0)[0].as_py())
    except (ProbingError, ValueError, TypeError, IndexError):
        return -1
    if rank >= 0:
        _RANKS[key] = rank
    return rank


def _start_time(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def with_missing(table: pa.Table, gone: list[str]) -> pa.Table:
    """``table`` noting, in its metadata, the ranks a gather did not reach."""
    if not gone:
        return table
    meta = dict(table.schema.metadata or {})
    meta[MISSING_KEY] = json.dumps(gone).encode()
    return table.replace_schema_metadata(meta)


def missing_ranks(table: pa.Table) -> list[str]:
    """The ranks a cluster gather could not reach (from the table's metadata)."""
    raw = (table.schema.metadata or {}).get(MISSING_KEY)
    return json.loads(raw) if raw else []
