"""``probing trace``: one process (followed live until --duration or Ctrl-C),
or every rank of its job (``--cluster`` through its peers, ``--job`` on this
machine)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from probing.cli.commands.common import client, note, probe_client

if TYPE_CHECKING:
    from probing.cli.client import ProbeClient

T = TypeVar("T")
# the request's own socket timeout while ``answered`` waits on it: a compile has
# no fixed length (BCC, under load), ``answered``'s watch gives up first
LONGEST_ANSWER_S = 3600.0


@dataclass(frozen=True)
class TraceOptions:
    """What to trace: the options a probe's ``trace_start`` takes."""

    families: list[str]
    stacks: bool = True
    launch_stacks: bool = False


def trace_one(
    pid: int, options: TraceOptions, *, inject: bool, stop: bool, background: bool,
    duration: float | None, output: str | None,
) -> None:  # fmt: skip
    """Stop ``pid``'s trace (``stop``), or start one and, unless ``background``,
    follow it live until ``duration`` or Ctrl-C, then stop it and summarize."""
    from probing.cli.render import TraceMonitor
    from probing.errors import NoProbe, NoSuchProcess, NotTracing

    if stop:
        try:
            status = client(pid).trace_stop()
        except NotTracing:  # as --job and --cluster say of such a rank: done, exit 0
            typer.echo(f"pid {pid} is not tracing: already stopped")
            return
        typer.echo(TraceMonitor.summary(status))
        still = still_tracing(pid)
        if still:
            typer.echo(
                f"{len(still)} more rank(s) of its job still trace (pids "
                f"{', '.join(map(str, still))}); stop every rank with: "
                f"probing trace --pid {pid} --cluster --stop"
            )
        return
    probe = probe_client(pid, inject)
    out = os.path.abspath(output) if output else None
    status = answered(probe, pid, lambda: probe.trace_start(**asdict(options), output=out))
    monitor = TraceMonitor(pid, status)
    typer.echo(monitor.started())
    if background:
        typer.echo(f"tracing in the background; stop with: probing trace --pid {pid} --stop")
        return
    try:
        monitor.follow(probe.trace_status, duration)
    except (NoProbe, NoSuchProcess):
        typer.echo(monitor.target_exited(out), err=True)
        return
    except KeyboardInterrupt:
        pass
    if monitor.status.get("state") != "tracing":  # the target is exiting: its probe stopped
        monitor.wait_exit()
        monitor.wait_stopped(probe.trace_status)
        typer.echo(monitor.target_exited(out), err=True)
        return
    try:
        typer.echo(TraceMonitor.summary(probe.trace_stop()))
    except (NoProbe, NoSuchProcess):
        typer.echo(monitor.target_exited(out), err=True)


def trace_many(
    pid: int, options: TraceOptions, *, job: bool, inject: bool, stop: bool,
    background: bool, duration: float | None, timeout: float,
) -> int:  # fmt: skip
    """``trace --cluster`` (every rank, through ``pid``'s peers) or ``--job``
    (every rank of its job on this machine, each through its own probe):
    start (and, unless ``background``, stop after ``duration`` or Ctrl-C);
    the exit status: 2 where a rank did not."""
    import time

    from probing.cli.render import control_rows

    who = ("pid",) if job else ("rank", "node", "addr")
    flag = "--job" if job else "--cluster"

    def act(action: str) -> list[dict[str, Any]]:
        if job:
            return job_trace(pid, action, inject, options)
        if action != "start":
            return client(pid).cluster_trace(action, timeout=timeout)
        probe = probe_client(pid, inject)
        return answered(  # the peers' answers come first (cluster_trace's own wait)
            probe, pid, lambda: probe.cluster_trace(action, timeout=timeout, **asdict(options)),
            timeout + 10,
        )  # fmt: skip

    if not job and not stop and inject:  # the whole job, however it was started
        pid = probe_job(pid, timeout)
    rows = act("stop" if stop else "start")
    typer.echo(control_rows(rows, "stopped" if stop else "tracing", who))
    if stop or background:
        if not stop:
            typer.echo(f"stop every rank with: probing trace --pid {pid} {flag} --stop")
        return 0 if all(r["ok"] for r in rows) else 2
    try:
        if duration:
            time.sleep(duration)
        else:
            wait_forever()
    except KeyboardInterrupt:
        pass
    typer.echo(control_rows(act("stop"), "stopped", who))
    return 0


def answered(probe: ProbeClient, pid: int, call: Callable[[], T], budget_s: float = 0.0) -> T:
    """``call()``'s answer from ``pid``'s probe, which starts a trace: where its
    engine compiles the BPF programs meanwhile (the first trace on a node, a
    job of another Python), that is said and waited for however long it
    takes; a wait with no compile in it is the probe's usual answer timeout
    (``PROBING_ANSWER_TIMEOUT_S``, or ``budget_s`` where longer)."""
    from probing.errors import NoProbe, ProbingError
    from probing.node.service import warm

    try:
        engine = probe.health().get("engine_pid")
    except ProbingError:  # it says so again at the call
        engine = None
    transport = probe.transport
    wait = float(transport.timeout)
    transport.timeout = LONGEST_ANSWER_S
    try:
        quiet = max(wait, budget_s)
        engine_pid = engine if isinstance(engine, int) else None
        return warm.wait_out(call, engine_pid, quiet, note)
    except TimeoutError:
        raise NoProbe(f"the probe of pid {pid} did not answer in {quiet:g} s", pid=pid) from None
    finally:
        transport.timeout = wait


def still_tracing(pid: int) -> list[int]:
    """The other ranks of ``pid``'s job on this machine that trace now."""
    from probing.errors import ProbingError
    from probing.procs import job_pids

    out = []
    for p in job_pids(pid):
        if p == pid:
            continue
        try:
            if client(p).trace_status().get("state") == "tracing":
                out.append(p)
        except ProbingError:  # no probe: not tracing
            continue
    return out


STORE = "rendezvous store:"  # a probe's cluster error when its job's store does not answer
STORE_S = 3.0  # how long a job's ranks are waited for while their store does not answer


def probe_job(pid: int, timeout: float) -> int:
    """Every rank of ``pid``'s job on this machine with a probe (injected where
    it has none: a job started without probing), each in its job (joined
    through the job's store, within ``timeout``); the pid to ask: ``pid``,
    or a launcher's first rank (torchrun's agent is no rank)."""
    import time

    from probing.errors import ProbingError
    from probing.procs import job_pids

    ranks = job_pids(pid)
    for p in ranks:
        try:
            probe_client(p, True)
        except ProbingError:  # said for that rank by the trace below
            continue
    began = time.monotonic()
    deadline = began + timeout
    for p in ranks:
        while time.monotonic() < deadline:
            try:
                cluster = client(p).health().get("cluster")
            except ProbingError:
                break
            if not cluster or cluster.get("published"):
                break  # in its job, or not a rank (one that cannot join is said below)
            gone = (cluster.get("error") or "").startswith(STORE)
            if gone and time.monotonic() > began + STORE_S:
                break  # its store does not answer (gone with the rank that held it)
            time.sleep(0.1)
    return pid if pid in ranks else ranks[0]


def job_trace(pid: int, action: str, inject: bool, options: TraceOptions) -> list[dict[str, Any]]:
    """Start or stop tracing in every rank of ``pid``'s job on this machine."""
    from probing.errors import ProbingError, control_outcome, outcome_of
    from probing.procs import job_pids

    rows = []
    for p in job_pids(pid):
        try:
            if action == "start":
                probe = probe_client(p, inject)
                reply = answered(probe, p, functools.partial(probe.trace_start, **asdict(options)))
            else:
                reply = client(p).trace_stop()
            rows.append({"pid": p, **control_outcome(200, reply)})
        except ProbingError as err:
            rows.append({"pid": p, **outcome_of(err)})
    return rows


def wait_forever() -> None:
    """Until Ctrl-C."""
    import threading

    threading.Event().wait()
