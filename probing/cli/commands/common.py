"""What the commands share: notes on stderr and the client of a pid's probe."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from probing.cli.client import ProbeClient


def note(msg: str) -> None:
    """A line for the user beside the output: on stderr."""
    typer.echo(msg, err=True)


def client(pid: int) -> ProbeClient:
    """The client of ``pid``'s probe (no injection)."""
    from probing.cli.client import ProbeClient

    return ProbeClient.for_pid(pid)


def probe_client(pid: int, inject: bool, timeout: float | None = None) -> ProbeClient:
    """The client of ``pid``'s probe, injecting one first when asked to."""
    from probing.cli.client import attach

    return attach(pid, inject=inject, timeout=timeout, note=note)
