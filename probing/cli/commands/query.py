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

# what the store keeps of its tables (the others keep nothing)
STORED_SQL = """
SELECT "schema" || '.' || "table" AS "table", rows, stored_bytes,
       compression_ratio AS ratio, retired_rows AS retired, dropped_events AS dropped
FROM probing.tables
"""
KINDS = {
    "stored": "rows kept by the probe (the store)",
    "view": "SQL over other tables",
    "live": "made from the process when queried",
}


def list_tables(pid: int) -> None:
    """Print the tables ``pid``'s probe answers: how each answers (its
    kind), and for a stored one its rows and compression."""
    import textwrap

    from probing.cli.render import format_table

    probe = client(pid)
    names, rows = probe.query_rows(STORED_SQL)
    stored = {row[0]: row[1:] for row in rows}
    blank = [None] * (len(names) - 1)
    out = []
    for t in probe.tables():
        name = f"{t['schema']}.{t['table']}"
        out.append([name, t["kind"], *stored.get(name, blank)])
    typer.echo(format_table([names[0], "kind", *names[1:]], out, null=""))
    legend = "; ".join(f"{kind}: {what}" for kind, what in KINDS.items())
    typer.echo(textwrap.fill(legend, 80))


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
