"""``probing diagnose``: record the job first where asked (``--record``), name
its straggler, slow link or hang, and print the diagnosis or SQL over it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import typer

from probing.cli.commands.common import client, probe_client
from probing.errors import ProbingError

if TYPE_CHECKING:
    import pyarrow as pa

    from probing.analyze.diagnose import Diagnosis
    from probing.cli.client import JobClient


def diagnose_job(
    pids: list[int], *, addr: str | None, cluster: bool, timeout: float, inject: bool,
    window_s: float, hang_s: float, sql: str | None, fmt: str, record_s: float | None,
) -> None:  # fmt: skip
    """Diagnose the job of ``pids`` (local ranks; one with ``cluster``: every
    rank through its peers) or of the peer at ``addr`` over the last
    ``window_s``, and print it as ``fmt`` (table, json), or the answer of
    ``sql`` over its ``analyze.*`` tables. A probe is injected first into
    each pid that lacks one (``inject``). ``record_s``: trace every rank of
    ``pids[0]``'s job that long first, and stop the ranks it started after,
    whatever happens. A launcher's pid (torchrun's agent) stands for its
    ranks (``job_ranks``)."""
    from probing.cli.client import JobClient

    pids = job_ranks(pids, cluster=cluster, inject=inject, timeout=timeout)
    started = start_recording(pids[0], inject) if record_s is not None else []
    if record_s is not None:
        window_s = min(window_s, record_s)
    try:
        if record_s is not None:  # Ctrl-C here stops the ranks it started too
            import time

            typer.echo(f"probing: recording {record_s:g} s", err=True)
            time.sleep(record_s)
        for p in pids:  # a hung job never traced: stacks and counts still tell
            probe_client(p, inject)
        job = JobClient(pids=pids, addr=addr, cluster=cluster, timeout=timeout)
        answer(job, window_s=window_s, hang_s=hang_s, sql=sql, fmt=fmt)
    finally:
        if record_s is not None and started:  # the ranks it started, not a trace of someone's
            with contextlib.suppress(ProbingError):
                client(pids[0]).cluster_trace("stop", ranks=started)


JOIN_WAIT_S = 30.0  # at most, for probes injected with --cluster to join their job


def job_ranks(pids: list[int], *, cluster: bool, inject: bool, timeout: float) -> list[int]:
    """The pids to diagnose: one pid alone with ``cluster`` is asked through a
    rank of its job (``trace --cluster``'s way: with ``inject``, every rank of
    the job on this machine gets a probe and joins first); a launcher's pid
    alone without it, its ranks on this machine. Other lists as given."""
    from probing.procs import job_pids

    if len(pids) != 1:
        return pids
    if cluster and inject:
        from probing.cli.commands.trace import probe_job

        return [probe_job(pids[0], max(timeout, JOIN_WAIT_S))]
    ranks = job_pids(pids[0])
    if pids[0] in ranks:
        return pids
    return ranks[:1] if cluster else ranks


def answer(job: JobClient, *, window_s: float, hang_s: float, sql: str | None, fmt: str) -> None:
    """Diagnose ``job`` and print the diagnosis, or ``sql`` over it, as ``fmt``."""
    from probing.cli.asking import diagnose as run_diagnosis
    from probing.cli.render import diagnosis

    def waiting(seconds: float) -> None:
        typer.echo(f"probing: counts differ; watching {seconds:.0f} s for a hang", err=True)

    d, table = run_diagnosis(job, window_s=window_s, hang_after_s=hang_s, on_wait=waiting)
    if sql is not None:
        print_sql(d, table, sql, fmt)
    elif fmt == "json":
        typer.echo(json.dumps(d.to_json(), default=str))
    else:
        typer.echo(diagnosis(d))


def print_sql(d: Diagnosis, table: pa.Table, sql: str, fmt: str) -> None:
    """``sql`` over the diagnosis's ``analyze.*`` tables, printed as ``fmt``."""
    from probing.analyze.tables import sql_tables
    from probing.cli.render import format_arrow
    from probing.node.sql import Database
    from probing.node.store import Store

    database = Database(Store())
    for name, t in sql_tables(d, table).items():
        database.register_table("analyze", name, _constant(t))
    result = database.sql(sql)
    if fmt == "json":
        typer.echo(json.dumps(result.to_pylist(), default=str))
    else:
        typer.echo(format_arrow(result))


def _constant(table: pa.Table) -> Callable[[], pa.Table]:
    """A table provider that always answers ``table``."""
    return lambda: table


def start_recording(pid: int, inject: bool) -> list[int]:
    """``diagnose --record``: start tracing every rank of ``pid``'s job (the
    caller waits); the ranks it started (a rank tracing already
    goes on as it was, and is not stopped after)."""
    from probing.cli.render import control_rows

    rows = probe_client(pid, inject).cluster_trace("start")
    started = [r["rank"] for r in rows if r["done"]]
    if not any(r["ok"] for r in rows):
        raise ProbingError(f"no rank could be traced:\n{control_rows(rows, 'tracing')}")
    missing = ", ".join(f"rank {r['rank']} ({r['reason']})" for r in rows if not r["ok"])
    traced = sum(1 for r in rows if r["ok"])
    typer.echo(
        f"probing: tracing {traced} of {len(rows)} ranks"
        + (f"; not traced: {missing}" if missing else ""),
        err=True,
    )
    return started
