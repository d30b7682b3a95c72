"""``analyze.*`` in a database: the diagnosis tables over the rows one probe
holds (its own rank), registered with its database (``install``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from probing.analyze.diagnose import analyze
from probing.analyze.queries import queries
from probing.analyze.tables import sql_tables
from probing.errors import ProbingError

SQL_TABLES = (
    "stragglers", "slow_links", "hangs", "ranks", "collectives", "why", "stages", "transfers",
)  # fmt: skip


def install(database: Any) -> None:
    """``analyze.*`` in a probe: over this probe's own rows (one rank)."""

    def producer(name: str) -> Callable[[], Any]:
        return lambda: local_tables(database)[name]

    for name in SQL_TABLES:
        database.register_table("analyze", name, producer(name))


def local_tables(database: Any, window_s: float = 60.0) -> dict[str, pa.Table]:
    """The analyze.* tables over the data this one probe holds (its own rank)."""
    import os
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from probing.analyze.gather import RANK_EXPR, tag

    now = time.time_ns()
    sql = queries(remote=False)["collectives"].format(since_ns=now - int(window_s * 1e9))
    # a table is produced inside the database's own query: the query it needs runs
    # on a thread of its own (DataFusion cannot block inside its runtime)
    with ThreadPoolExecutor(max_workers=1) as pool:
        rows = pool.submit(database.sql, sql).result()
        try:  # the process's rank, as the process itself tells it
            asked = pool.submit(database.sql, f"SELECT value FROM python.`{RANK_EXPR}`").result()
            rank = int(asked.column("value")[0].as_py())
        except (ProbingError, ValueError, TypeError, IndexError):  # no number; torch's refusal
            rank = -1
    rows = tag(rows, socket.gethostname(), rank if rank >= 0 else os.getpid())
    d = analyze(rows, now_ns=now, window_s=window_s)
    return sql_tables(d, rows)
