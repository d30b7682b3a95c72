"""``probing ui``: serve the web UI of a job's ranks until Ctrl-C."""

from __future__ import annotations

import typer

from probing.errors import ProbingError


def serve(pids: list[int], addr: str | None, port: int, timeout: float) -> None:
    """Serve the UI on 127.0.0.1:``port`` for the ranks of ``pids`` (one pid:
    the whole job through its probe's peers; several: those ranks) or of the
    peer at ``addr``, once their probes answer; print its URL."""
    from probing.cli.export import Source
    from probing.cli.ui.data import JobView
    from probing.cli.ui.server import UIServer
    from probing.node.cluster.port import check_free

    src = Source(pids=pids, addr=addr, cluster=len(pids) == 1, timeout=timeout)
    if not 0 <= port <= 65535:
        raise ProbingError(f"--port {port} is not a port", hint="use 1-65535, or 0")
    # a port held: who holds it, before the wait for the ranks' probes
    check_free("probing ui", "127.0.0.1", port, "pick another --port, or leave it out")
    ranks = src.ranks()  # the probes answer (and the token works) before we serve
    server = UIServer(JobView(src), port=port)
    server.view.warm()  # the first diagnosis, ready by the time its page is opened
    typer.echo(f"probing ui for {src.describe()} ({len(ranks)} ranks): open {server.url}")
    typer.echo("(Ctrl-C stops it)", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
