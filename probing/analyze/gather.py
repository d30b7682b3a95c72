"""Rows gathered from every rank of a job, tagged ``node`` and ``rank`` (and
``pg``, torch's name of each row's group: ``with_groups``).

The asking is the client's (``probing.cli.client.JobClient``: local pids over their
sockets, or the cluster through one probe); here are the pieces both sides
share: the tags, the rank expression, and the ranks a gather missed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol

import pyarrow as pa

from probing.analyze import columns
from probing.errors import ProbingError

MISSING_KEY = b"probing.missing"
UNHEARD_KEY = b"probing.unheard"  # the ranks (numbers) among them, where known
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


def launched_rank(pid: int) -> int | None:
    """``pid``'s rank as its launcher set it (``RANK`` in its environment),
    for a process that cannot answer (stopped, its guest gone); None if unset
    or unreadable."""
    import psutil

    try:
        return int(psutil.Process(pid).environ()["RANK"])
    except (psutil.Error, KeyError, ValueError, OSError):
        return None


def _start_time(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def with_missing(table: pa.Table, gone: list[str], ranks: Sequence[int] = ()) -> pa.Table:
    """``table`` noting, in its metadata, the ranks a gather did not reach:
    in words (``gone``), and by number where the gather knew them (``ranks``)."""
    if not gone:
        return table
    meta = dict(table.schema.metadata or {})
    meta[MISSING_KEY] = json.dumps(gone).encode()
    if ranks:
        meta[UNHEARD_KEY] = json.dumps(sorted(ranks)).encode()
    return table.replace_schema_metadata(meta)


def unheard_ranks(table: pa.Table) -> set[int]:
    """The ranks (by number) a cluster gather of ``table`` could not reach:
    what they did is unknown, not absent."""
    raw = (table.schema.metadata or {}).get(UNHEARD_KEY)
    return set(json.loads(raw)) if raw else set()


def missing_ranks(table: pa.Table) -> list[str]:
    """The ranks a cluster gather could not reach (from the table's metadata)."""
    raw = (table.schema.metadata or {}).get(MISSING_KEY)
    return json.loads(raw) if raw else []


def with_groups(table: pa.Table, groups: pa.Table) -> pa.Table:
    """``table`` plus ``pg``: each row's torch process group, where its rank's
    ``comm.groups`` names one (the cross-rank name of a Gloo context). Where
    a rank with rows has no groups (its process stopped, its guest gone), no
    row gets one: its contexts would be named by size and order and the
    others' by torch, one group under two names (its ranks apart)."""
    if not table.num_rows or not groups.num_rows or "pg" in table.column_names:
        return table
    key_cols = [c for c in ("node", "rank") if c in groups.column_names]
    if key_cols and set(key_cols) <= set(table.column_names):
        said = set(zip(*(groups.column(c).to_pylist() for c in key_cols), strict=True))
        ranks = table.select(key_cols).group_by(key_cols, use_threads=False).aggregate([])
        rows = set(zip(*(ranks.column(c).to_pylist() for c in key_cols), strict=True))
        if rows - said:
            return table
    names = {
        (*(g[c] for c in key_cols), g["backend"], g["comm"]): g["pg"] for g in groups.to_pylist()
    }
    code, firsts = columns.distinct(table, [*key_cols, "backend", "comm"])
    cols = [
        table.column(c).take(pa.array(firsts)).to_pylist() for c in (*key_cols, "backend", "comm")
    ]
    pg = pa.array([names.get(k) for k in zip(*cols, strict=True)], pa.string())
    return table.append_column("pg", pg.take(pa.array(code)))
