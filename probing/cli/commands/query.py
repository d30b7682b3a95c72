"""``probing query`` (one probe, or the job with ``--cluster``) and ``probing tables``."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import typer

from probing.cli.commands.common import client

if TYPE_CHECKING:
    import pyarrow as pa

    from probing.node.cluster.query import ClusterResult

TABLES_SQL = """
SELECT t.table_schema || '.' || t.table_name AS "table", s.rows, s.stored_bytes,
       s.compression_ratio AS ratio, s.retired_rows AS retired, s.dropped_events AS dropped
FROM information_schema.tables t
LEFT JOIN probing.tables s ON t.table_schema = s."schema" AND t.table_name = s."table"
WHERE t.table_schema <> 'information_schema'
ORDER BY 1
"""


def list_tables(pid: int) -> None:
    """Print the tables ``pid``'s probe answers, with rows and compression."""
    from probing.cli.render import format_table

    typer.echo(format_table(*client(pid).query_rows(TABLES_SQL)))


def ask_one(sql: str, pid: int | None, addr: str | None, fmt: str) -> None:
    """Print ``sql``'s answer from one probe (``pid``'s, or the peer at
    ``addr``) as ``fmt`` (table, csv, json): the probe's own bytes, or its
    rows as text (no pyarrow in this process)."""
    from probing.cli.client import ProbeClient
    from probing.cli.render import write_answer

    probe = client(pid) if pid is not None else ProbeClient.for_addr(addr or "")
    write_answer(probe, sql, fmt, typer.echo)


def ask_cluster(
    sql: str, pid: int | None, addr: str | None, fmt: str, *,
    timeout: float, strict: bool, timings: bool, fanout: str,
) -> None:  # fmt: skip
    """Print ``sql``'s answer over every peer of the job as ``fmt``, the
    missing peers and response times on stderr."""
    from probing.cli.client import cluster_query

    result = cluster_query(sql, pid=pid, addr=addr, timeout=timeout, strict=strict, fanout=fanout)
    report_peers(result, timings)
    print_arrow(result.table, fmt)


def print_arrow(table: pa.Table, fmt: str) -> None:
    """An Arrow table on stdout as text (table), JSON rows or CSV."""
    from probing.cli.render import format_arrow

    if fmt == "table":
        typer.echo(format_arrow(table))
    elif fmt == "json":
        typer.echo(json.dumps(table.to_pylist(), default=str))
    else:
        import pyarrow.csv as pacsv

        pacsv.write_csv(table, sys.stdout.buffer)
        sys.stdout.flush()


def report_peers(result: ClusterResult, timings: bool) -> None:
    """Missing peers (always) and response times (the slowest, or all) on stderr."""
    for m in result.missing:
        typer.echo(f"probing: rank {m.rank} ({m.node}, {m.addr}) missing: {m.reason}", err=True)
    if not result.peers:
        return
    if timings:
        from probing.cli.render import format_rows

        rows = [
            [t.rank, t.node, t.addr, round(t.response_ms, 1), t.clock_offset_ns]
            for t in result.peers
        ]
        typer.echo(format_rows(["RANK", "NODE", "ADDR", "MS", "CLOCK_OFFSET_NS"], rows), err=True)
        return
    slow = max(result.peers, key=lambda t: t.response_ms)
    typer.echo(
        f"probing: {len(result.peers)} peer(s) answered; slowest rank {slow.rank} "
        f"({slow.node}) in {slow.response_ms:.0f} ms",
        err=True,
    )
