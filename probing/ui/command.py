"""``probing ui``: the typer command (registered by ``probing.cli``)."""

from __future__ import annotations

from typing import Annotated

import typer

EPILOG = (
    "Examples:\n\n"
    "  probing ui --pid 1234            # the job rank 1234 belongs to\n\n"
    "  probing ui -p 101 -p 102 -p 103  # these local ranks only\n\n"
    "  PROBING_TOKEN=... probing ui --addr 10.0.0.2:7070 --port 8765\n\n"
    "  (then open the printed http://127.0.0.1:PORT/?token=... URL; over ssh:\n"
    "  ssh -L PORT:127.0.0.1:PORT host)"
)


def ui_command(
    pid: Annotated[
        list[int] | None,
        typer.Option("--pid", "-p", help="a rank's process id (repeat for local ranks only)"),
    ] = None,
    addr: Annotated[
        str | None, typer.Option("--addr", help="a peer probe, host:port (token: $PROBING_TOKEN)")
    ] = None,
    port: Annotated[int, typer.Option(help="port on 127.0.0.1 (0: a free one)")] = 0,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the peers")] = 10.0,
) -> None:
    """Serve the web UI: job heatmap, diagnose, SQL console, GPU, Perfetto timeline."""
    from probing.errors import ProbingError
    from probing.export import Source
    from probing.ui.data import JobView
    from probing.ui.server import UIServer

    try:
        # one pid: the whole job through its probe's peers; several: those ranks
        src = Source(pids=pid or [], addr=addr, cluster=len(pid or []) == 1, timeout=timeout)
        if not 0 <= port <= 65535:
            raise ProbingError(f"--port {port} is not a port", hint="use 1-65535, or 0")
        ranks = src.ranks()  # the probes answer (and the token works) before we serve
        server = UIServer(JobView(src), port=port)
    except ProbingError as err:
        typer.echo(f"probing: error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"probing ui for {src.describe()} ({len(ranks)} ranks): open {server.url}")
    typer.echo("(Ctrl-C stops it)", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


def register(app: typer.Typer) -> None:
    app.command(name="ui", epilog=EPILOG)(ui_command)
