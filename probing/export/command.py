"""``probing export``: the typer command (registered by ``probing.cli``)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

EPILOG = (
    "Examples:\n\n"
    "  probing export --pid 1234 --cluster --format perfetto -o job.pftrace\n\n"
    "  probing export -p 1234 --cluster --window 30s --max-events 2000000 -o last30s.pftrace\n\n"
    "  probing export -p 1234 --cluster --format parquet -o job-parquet/\n\n"
    "  PROBING_TOKEN=... probing export --addr 10.0.0.2:7070 -o job.pftrace\n\n"
    "  (open a .pftrace in https://ui.perfetto.dev, or offline: probing ui --pid 1234)"
)


class ExportFormat(str, Enum):
    perfetto = "perfetto"
    parquet = "parquet"


def export_command(
    output: Annotated[
        str, typer.Option("--output", "-o", help="the trace file (perfetto) or directory (parquet)")
    ],
    pid: Annotated[
        list[int] | None,
        typer.Option("--pid", "-p", help="a rank's process id (repeat for local ranks)"),
    ] = None,
    addr: Annotated[
        str | None, typer.Option("--addr", help="a peer probe, host:port (token: $PROBING_TOKEN)")
    ] = None,
    cluster: Annotated[
        bool, typer.Option("--cluster", help="every rank of the job, through --pid's probe")
    ] = False,
    fmt: Annotated[ExportFormat, typer.Option("--format", "-f")] = ExportFormat.perfetto,
    window: Annotated[str, typer.Option(help="how far back to export (60s, 500ms)")] = "60s",
    max_events: Annotated[
        int | None, typer.Option(help="keep at most this many events (the newest)")
    ] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the peers")] = 10.0,
) -> None:
    """Write every rank's recent events as a Perfetto trace or Parquet files."""
    from probing.errors import ProbingError
    from probing.export import Source, export
    from probing.tables.nvml import parse_interval

    try:
        window_s = parse_interval(window)
    except ValueError as err:
        typer.echo(f"probing: error: {err}", err=True)
        raise typer.Exit(2) from None
    try:
        src = Source(pids=pid or [], addr=addr, cluster=cluster or bool(addr), timeout=timeout)
        report = export(src, output, fmt=fmt.value, window_s=window_s, max_events=max_events)
    except (ProbingError, OSError) as err:
        typer.echo(f"probing: error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(report.summary())


def register(app: typer.Typer) -> None:
    app.command(name="export", epilog=EPILOG)(export_command)
