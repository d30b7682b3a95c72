"""The ``probing`` command: every sub-command is a thin call into a module."""

from __future__ import annotations

import contextlib
import json
import sys
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from probing.errors import ProbingError

if TYPE_CHECKING:
    from probing.client import ProbeClient

app = typer.Typer(
    name="probing",
    help="Query what a running Python / PyTorch process is doing, with SQL.",
    epilog=(
        "Examples:\n\n"
        "  PROBING=1 python train.py &\n\n"
        "  probing inject --pid 1234\n\n"
        "  probing stack --pid 1234\n\n"
        "  probing ps\n\n"
        '  probing query --pid 1234 "SELECT name, state FROM process.threads"\n\n'
        "  probing tables --pid 1234\n\n"
        "  probing doctor"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class Format(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"


class Fanout(str, Enum):
    auto = "auto"
    flat = "flat"
    tree = "tree"


def _fail(err: ProbingError | str, code: int = 1) -> typer.Exit:
    typer.echo(f"probing: error: {err}", err=True)
    return typer.Exit(code)


def _client(pid: int) -> ProbeClient:
    from probing.client import ProbeClient

    return ProbeClient.for_pid(pid)


PidOpt = Annotated[int, typer.Option("--pid", "-p", help="process id of the target")]


@app.command(epilog="Examples:\n\n  probing ps")
def ps() -> None:
    """Python processes on this machine, and which of them carry a probe."""
    from probing.procs import python_processes
    from probing.render import format_rows

    procs = python_processes()
    rows = [[p.pid, p.user, p.probe, p.cmdline] for p in procs]
    typer.echo(format_rows(["PID", "USER", "PROBE", "COMMAND"], rows))


@app.command(
    epilog=(
        "Examples:\n\n"
        '  probing query --pid 1234 "SELECT count(*) FROM process.threads"\n\n'
        '  probing query -p 1234 -f json "SELECT * FROM probing.tables"\n\n'
        '  probing query -p 1234 "SELECT * FROM python.`torch.__version__`"\n\n'
        '  probing query -p 1234 --cluster "SELECT rank, count(*) FROM process.threads '
        'GROUP BY rank"\n\n'
        "  PROBING_TOKEN=... probing query --addr 10.0.0.2:7070 --cluster --strict "
        '"SELECT node, rank, max(ts) FROM comm.collectives GROUP BY node, rank"'
    )
)
def query(
    sql: Annotated[str, typer.Argument(help="read-only SQL (SELECT, WITH, SHOW, EXPLAIN)")],
    pid: Annotated[int | None, typer.Option("--pid", "-p", help="process id of the target")] = None,
    addr: Annotated[
        str | None,
        typer.Option("--addr", help="a peer probe's host:port instead (token: $PROBING_TOKEN)"),
    ] = None,
    fmt: Annotated[Format, typer.Option("--format", "-f", help="output format")] = Format.table,
    cluster: Annotated[
        bool, typer.Option("--cluster", help="run over every peer of the job; rows get node, rank")
    ] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the peers (--cluster)")] = 5.0,
    strict: Annotated[
        bool, typer.Option("--strict", help="fail when a peer does not answer (--cluster)")
    ] = False,
    timings: Annotated[
        bool, typer.Option("--timings", help="print each peer's response time on stderr")
    ] = False,
    fanout: Annotated[
        Fanout, typer.Option(help="ask every peer, or each node's first rank (--cluster)")
    ] = Fanout.auto,
) -> None:
    """Run SQL in a process's probe (or across the job with --cluster) and print it."""
    from probing.render import format_arrow, format_table

    if (pid is None) == (addr is None):
        raise _fail("give exactly one of --pid or --addr", 2)
    try:
        if cluster:
            result = _cluster_query(
                sql, pid, addr, timeout=timeout, strict=strict, fanout=fanout.value
            )
            _report_peers(result, timings)
            table = result.table
        else:
            client = _client(pid) if pid is not None else _addr_client(addr or "")
            if fmt is not Format.table:
                sys.stdout.buffer.write(client.query_raw(sql, fmt.value))
                if fmt is Format.json:
                    sys.stdout.buffer.write(b"\n")
                sys.stdout.flush()
                return
            names, rows = client.query_rows(sql)  # no pyarrow in this process
            typer.echo(format_table(names, rows))
            return
    except ProbingError as err:
        raise _fail(err) from None
    if fmt is Format.table:
        typer.echo(format_arrow(table))
    elif fmt is Format.json:
        typer.echo(json.dumps(table.to_pylist(), default=str))
    else:
        import pyarrow.csv as pacsv

        pacsv.write_csv(table, sys.stdout.buffer)
        sys.stdout.flush()


def _addr_client(addr: str) -> ProbeClient:
    from probing.client import ProbeClient

    return ProbeClient.for_addr(addr)


def _cluster_query(sql: str, pid: int | None, addr: str | None, **kw: object) -> Any:
    from probing.client import cluster_query

    return cluster_query(sql, pid=pid, addr=addr, **kw)  # type: ignore[arg-type]


def _report_peers(result: Any, timings: bool) -> None:
    """Missing peers (always) and response times (the slowest, or all) on stderr."""
    for m in result.missing:
        typer.echo(f"probing: rank {m.rank} ({m.node}, {m.addr}) missing: {m.reason}", err=True)
    if not result.peers:
        return
    if timings:
        from probing.render import format_rows

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


TABLES_SQL = """
SELECT t.table_schema || '.' || t.table_name AS "table", s.rows, s.stored_bytes,
       s.compression_ratio AS ratio, s.retired_rows AS retired, s.dropped_events AS dropped
FROM information_schema.tables t
LEFT JOIN probing.tables s ON t.table_schema = s."schema" AND t.table_name = s."table"
WHERE t.table_schema <> 'information_schema'
ORDER BY 1
"""


@app.command(epilog="Examples:\n\n  probing tables --pid 1234")
def tables(pid: PidOpt) -> None:
    """Tables a process's probe can answer, with rows and compression."""
    from probing.render import format_table

    try:
        typer.echo(format_table(*_client(pid).query_rows(TABLES_SQL)))
    except ProbingError as err:
        raise _fail(err) from None


InjectOpt = Annotated[
    bool,
    typer.Option("--inject/--no-inject", help="inject a probe first when the process has none"),
]
JobOpt = Annotated[
    bool,
    typer.Option(
        "--job", help="every rank on this machine of the job the process belongs to (probing ps)"
    ),
]


def _note(msg: str) -> None:
    typer.echo(msg, err=True)


def _probe_client(pid: int, inject: bool, timeout: float | None = None) -> ProbeClient:
    """The client of pid's probe, injecting one first when asked to."""
    from probing.client import attach

    return attach(pid, inject=inject, timeout=timeout, note=_note)


@app.command(
    name="inject",
    epilog="Examples:\n\n  probing inject --pid 1234\n\n  probing inject -p 1234 --timeout 30",
)
def inject_cmd(
    pid: PidOpt,
    timeout: Annotated[
        float,
        typer.Option(help="seconds to wait for the probe to start (the engine's start too)"),
    ] = 30.0,
    job: JobOpt = False,
) -> None:
    """Start a probe in a running Python process (ptrace; no restart, no code change)."""
    from probing.inject import inject
    from probing.procs import job_pids

    failed = False
    for p in job_pids(pid) if job else [pid]:
        try:
            res = inject(p, timeout=timeout)
        except ProbingError as err:
            if not job:
                raise _fail(err) from None
            typer.echo(f"pid {p}: no probe: {err}")
            failed = True
            continue
        if res.already:
            typer.echo(f"pid {p} already has a probe ({res.socket}); nothing to do")
            continue
        typer.echo(
            f"probe started in pid {p} (Python {res.python}) in {res.total_s:.2f} s; "
            f"thread {res.tid} was stopped {res.stopped_s * 1000:.1f} ms; socket {res.socket}"
        )
    if failed:
        raise typer.Exit(2)


@app.command(
    epilog=(
        "Examples:\n\n  probing stack --pid 1234\n\n  probing stack -p 1234 --format json"
        "\n\n  probing stack -p 1234 --no-inject"
    )
)
def stack(
    pid: PidOpt,
    inject: InjectOpt = True,
    fmt: Annotated[Format, typer.Option("--format", "-f", help="table or json")] = Format.table,
) -> None:
    """Every thread's Python stack, like py-spy dump: name, tid, state, file:line.

    Asks the process's probe (injecting one unless --no-inject); where there
    is none, injection fails or the probe does not answer (a thread holding
    the GIL in a C call), reads the stacks from outside (process_vm_readv)."""
    from probing.client import stacks
    from probing.render import format_stacks

    try:
        info, frames = stacks(pid, inject=inject, note=_note)
    except ProbingError as err:
        raise _fail(err) from None
    if fmt is Format.json:
        typer.echo(json.dumps({"process": info, "frames": frames}, default=str))
    else:
        typer.echo(format_stacks(info, frames))


@app.command(
    name="eval",
    epilog=(
        "Examples:\n\n"
        '  probing eval --pid 1234 "len(gc.get_objects())"\n\n'
        '  probing eval -p 1234 "import torch; print(torch.cuda.memory_allocated())"'
    ),
)
def eval_cmd(
    code: Annotated[str, typer.Argument(help="a Python expression or statements")],
    pid: PidOpt,
    inject: InjectOpt = False,
) -> None:
    """Run Python inside the target (local socket only); print its value and output."""
    from probing.errors import EvalError

    try:
        out = _probe_client(pid, inject).eval(code)
    except EvalError as err:
        if err.detail:
            typer.echo(err.detail.rstrip(), err=True)
        raise _fail(err) from None
    except ProbingError as err:
        raise _fail(err) from None
    if out.get("output"):
        typer.echo(out["output"], nl=False)
    if out.get("result") is not None:
        typer.echo(out["result"])


@app.command(
    epilog=(
        "Examples:\n\n  probing nvml --pid 1234 --interval 100ms\n\n"
        "  probing nvml --pid 1234 --stop\n\n"
        '  probing query -p 1234 "SELECT gpu, avg(util_gpu) FROM nvml.gpu GROUP BY gpu"'
    )
)
def nvml(
    pid: PidOpt,
    interval: Annotated[str, typer.Option(help="sampling interval (100ms, 1s)")] = "100ms",
    stop: Annotated[bool, typer.Option("--stop", help="stop sampling")] = False,
) -> None:
    """Sample GPU counters (NVML) into nvml.gpu next to the events; print nvml.status."""
    try:
        status = _client(pid).nvml(interval, stop=stop)
    except ProbingError as err:
        raise _fail(err) from None
    typer.echo(" ".join(f"{k}={v}" for k, v in status.items() if v is not None))
    if status.get("state") == "unavailable":
        raise typer.Exit(1)


def _family_flag(name: str, what: str) -> Any:
    return typer.Option(f"--{name}/--no-{name}", help=f"trace {what}")


@app.command(
    epilog=(
        "Examples:\n\n  probing trace --pid 1234\n\n"
        "  probing trace -p 1234 --duration 30 --output run.parquet\n\n"
        "  probing trace -p 1234 --no-cuda --background\n\n"
        "  probing trace -p 1234 --no-stacks\n\n"
        "  probing trace -p 1234 --launch-stacks\n\n"
        "  probing trace -p 1234 --stop\n\n"
        "  probing trace -p 1234 --cluster --background   # every rank of the job\n\n"
        "  probing trace -p 1234 --cluster --stop\n\n"
        "  probing trace -p 1234 --job --background   # every rank on this machine\n\n"
        '  probing query -p 1234 "SELECT op, count(*), avg(dur_ns) FROM comm.collectives '
        'GROUP BY op"'
    )
)
def trace(
    pid: PidOpt,
    nccl: Annotated[bool, _family_flag("nccl", "NCCL collectives (libnccl)")] = True,
    cuda: Annotated[bool, _family_flag("cuda", "CUDA runtime/driver calls")] = True,
    gloo: Annotated[bool, _family_flag("gloo", "Gloo collectives (torch CPU)")] = True,
    duration: Annotated[
        float | None, typer.Option(help="seconds to trace (default: until Ctrl-C)")
    ] = None,
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", help="also write every event to this Parquet file"),
    ] = None,
    background: Annotated[
        bool, typer.Option("--background", help="start tracing in the probe and return")
    ] = False,
    stop: Annotated[
        bool, typer.Option("--stop", help="stop a trace started with --background")
    ] = False,
    stacks: Annotated[
        bool, typer.Option("--stacks/--no-stacks", help="record the Python stack of each call")
    ] = True,
    launch_stacks: Annotated[
        bool,
        typer.Option(
            "--launch-stacks", help="stacks on kernel launches and async copies too (costly)"
        ),
    ] = False,
    inject: InjectOpt = True,
    cluster: Annotated[
        bool,
        typer.Option(
            "--cluster", help="the same on every rank of the job, through this rank's peers"
        ),
    ] = False,
    job: JobOpt = False,
    timeout: Annotated[
        float, typer.Option(help="seconds to wait for the peers to start or stop (--cluster)")
    ] = 30.0,
) -> None:
    """Record NCCL, CUDA and Gloo calls of a running process with eBPF uprobes."""
    import os

    from probing.errors import NoProbe, NoSuchProcess
    from probing.render import TraceMonitor

    families = [n for n, on in (("nccl", nccl), ("cuda", cuda), ("gloo", gloo)) if on]
    if cluster or job:
        if output:
            raise _fail("--output writes one process's events: leave it out with --cluster, --job")
        if cluster and job:
            raise _fail("--cluster reaches every rank already: leave --job out")
        opts = {"families": families, "stacks": stacks, "launch_stacks": launch_stacks}
        _trace_many(pid, inject, stop, background, duration, opts, job, timeout)
        return
    try:
        if stop:
            status = _client(pid).trace_stop()
            typer.echo(TraceMonitor.summary(status))
            return
        if not families:
            raise _fail("nothing to trace: every family is turned off")
        client = _probe_client(pid, inject)
        out = os.path.abspath(output) if output else None
        status = client.trace_start(
            families, output=out, stacks=stacks, launch_stacks=launch_stacks
        )
    except ProbingError as err:
        raise _fail(err) from None
    monitor = TraceMonitor(pid, status)
    typer.echo(monitor.started())
    if background:
        typer.echo(f"tracing in the background; stop with: probing trace --pid {pid} --stop")
        return
    try:
        monitor.follow(client.trace_status, duration)
    except (NoProbe, NoSuchProcess):
        typer.echo(monitor.target_exited(out), err=True)
        return
    except ProbingError as err:
        raise _fail(err) from None
    except KeyboardInterrupt:
        pass
    if monitor.status.get("state") != "tracing":  # the target is exiting: its probe stopped
        monitor.wait_exit()
        monitor.wait_stopped(client.trace_status)
        typer.echo(monitor.target_exited(out), err=True)
        return
    try:
        typer.echo(TraceMonitor.summary(client.trace_stop()))
    except (NoProbe, NoSuchProcess):
        typer.echo(monitor.target_exited(out), err=True)
    except ProbingError as err:
        raise _fail(err) from None


def _trace_many(
    pid: int, inject: bool, stop: bool, background: bool, duration: float | None,
    options: dict[str, Any], job: bool, timeout: float,
) -> None:  # fmt: skip
    """``trace --cluster`` (every rank, through ``pid``'s peers) or ``--job``
    (every rank of its job on this machine, each through its own probe):
    start (and, unless --background, stop after --duration or Ctrl-C);
    exit 2 where a rank did not."""
    import time

    from probing.render import control_rows

    if not stop and not options["families"]:
        raise _fail("nothing to trace: every family is turned off")
    who = ("pid",) if job else ("rank", "node", "addr")
    flag = "--job" if job else "--cluster"

    def act(action: str) -> list[dict[str, Any]]:
        if job:
            return _job_trace(pid, action, inject, options)
        client = _probe_client(pid, inject) if action == "start" else _client(pid)
        more = options if action == "start" else {}
        return client.cluster_trace(action, timeout=timeout, **more)

    try:
        rows = act("stop" if stop else "start")
    except ProbingError as err:
        raise _fail(err) from None
    typer.echo(control_rows(rows, "stopped" if stop else "tracing", who))
    if stop or background:
        if not stop:
            typer.echo(f"stop every rank with: probing trace --pid {pid} {flag} --stop")
        if not all(r["ok"] for r in rows):
            raise typer.Exit(2)
        return
    try:
        if duration:
            time.sleep(duration)
        else:
            _wait_forever()
    except KeyboardInterrupt:
        pass
    try:
        rows = act("stop")
    except ProbingError as err:
        raise _fail(err) from None
    typer.echo(control_rows(rows, "stopped", who))


def _job_trace(
    pid: int, action: str, inject: bool, options: dict[str, Any]
) -> list[dict[str, Any]]:
    """Start or stop tracing in every rank of ``pid``'s job on this machine."""
    from probing.errors import control_outcome, outcome_of
    from probing.procs import job_pids

    rows = []
    for p in job_pids(pid):
        try:
            if action == "start":
                reply = _probe_client(p, inject).trace_start(**options)
            else:
                reply = _client(p).trace_stop()
            rows.append({"pid": p, **control_outcome(200, reply)})
        except ProbingError as err:
            rows.append({"pid": p, **outcome_of(err)})
    return rows


def _wait_forever() -> None:  # until Ctrl-C
    import threading

    threading.Event().wait()


@app.command(epilog="Examples:\n\n  probing doctor\n\n  probing doctor --format json")
def doctor(
    fmt: Annotated[Format, typer.Option("--format", "-f", help="table or json")] = Format.table,
) -> None:
    """Check kernel, BTF, tracefs, BCC, headers, CAP_BPF, ptrace and NVML."""
    from probing.doctor import run_all

    checks = run_all()
    if fmt is Format.json:
        typer.echo(json.dumps([c._asdict() for c in checks], indent=1))
    else:
        for c in checks:
            status = "OK" if c.ok else ("FAIL" if c.required else "WARN")
            typer.echo(f"{status:<5} {c.name:<8} {c.detail}")
            if not c.ok and c.fix:
                typer.echo(f"{'':<14}fix: {c.fix}")
    if any(c.required and not c.ok for c in checks):
        raise typer.Exit(1)


def run_script(argv: list[str]) -> int:
    """``python -m probing run`` / ``probing run``: the script with the probe on."""
    import os

    if not argv:
        print("usage: python -m probing run SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    script = argv[0]
    if not os.path.exists(script):
        print(f"probing: error: no such script: {script}", file=sys.stderr)
        return 2
    import runpy

    from probing import _boot

    _boot.start(wait=False)
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    epilog="Examples:\n\n  probing run train.py --epochs 3",
)
def run(ctx: typer.Context, script: Annotated[str, typer.Argument(help="script to run")]) -> None:
    """Run a Python script with the probe enabled (like PROBING=1)."""
    raise typer.Exit(run_script([script, *ctx.args]))


@app.command(
    epilog=(
        "Examples:\n\n  probing hook --python /opt/job-venv/bin/python\n\n"
        "  PROBING=1 /opt/job-venv/bin/python train.py\n\n"
        "  probing hook --python /opt/job-venv/bin/python --remove"
    )
)
def hook(
    python: Annotated[str, typer.Option(help="the job environment's Python")],
    remove: Annotated[bool, typer.Option(help="take the hook out again")] = False,
) -> None:
    """Let PROBING=1 start the probe in a job environment that lacks probing:
    a .pth line and the stdlib-only guest go in; nothing the job imports."""
    from probing.inject import hookinstall

    try:
        done = hookinstall.remove(python) if remove else hookinstall.install(python)
    except (ProbingError, OSError) as err:
        raise _fail(err if isinstance(err, ProbingError) else str(err)) from None
    if remove:
        typer.echo(f"removed the probing hook from {done.site}")
    else:
        typer.echo(f"PROBING=1 now starts the probe in {python} ({done.pth}, {done.guest})")


@app.command(
    epilog=(
        "Examples:\n\n  probing diagnose --pid 101 --pid 102 --pid 103 --pid 104\n\n"
        "  probing diagnose -p 101 -p 102 --window 30s --format json\n\n"
        "  probing diagnose --pid 101 --cluster\n\n"
        "  probing diagnose --pid 101 --cluster --record 15s   # an untraced job\n\n"
        '  probing diagnose -p 101 -p 102 --sql "SELECT rank, lag_ms_p99 FROM '
        'analyze.stragglers"'
    )
)
def diagnose(
    pid: Annotated[
        list[int] | None,
        typer.Option("--pid", "-p", help="a local rank's process id (repeat for every rank)"),
    ] = None,
    addr: Annotated[
        str | None, typer.Option("--addr", help="a peer probe, host:port (cluster query)")
    ] = None,
    cluster: Annotated[
        bool, typer.Option("--cluster", help="ask every rank of the job through its peers")
    ] = False,
    window: Annotated[str, typer.Option(help="how far back to look (60s, 500ms)")] = "60s",
    hang_after: Annotated[
        str, typer.Option(help="a collective not entered by every rank this long is a hang")
    ] = "10s",
    sql: Annotated[
        str | None,
        typer.Option(help="SQL over analyze.stragglers/slow_links/hangs/ranks/collectives"),
    ] = None,
    fmt: Annotated[Format, typer.Option("--format", "-f", help="table or json")] = Format.table,
    inject: InjectOpt = True,
    timeout: Annotated[
        float, typer.Option(help="seconds to wait for the peers (--cluster, --addr)")
    ] = 5.0,
    record: Annotated[
        str | None,
        typer.Option(help="trace every rank this long first, then stop them (--cluster): 15s"),
    ] = None,
) -> None:
    """Name the straggler, slow link or hang of a distributed job, and show why."""
    import time

    from probing.analyze import diagnose as run_diagnosis
    from probing.analyze.diagnose import sql_tables
    from probing.client import Job
    from probing.config import parse_interval
    from probing.render import diagnosis

    try:
        window_s, hang_s = parse_interval(window), parse_interval(hang_after)
        record_s = parse_interval(record) if record else None
    except ValueError as err:
        raise _fail(str(err)) from None
    started: list[int] = []
    if record_s is not None:
        if not cluster or len(pid or []) != 1:
            raise _fail("--record traces the job through one rank: give --cluster and one --pid")
        try:
            started = _record(pid[0], inject, record_s)  # type: ignore[index]
        except ProbingError as err:
            raise _fail(err) from None
        window_s = min(window_s, record_s)

    def waiting(seconds: float) -> None:
        typer.echo(f"probing: counts differ; watching {seconds:.0f} s for a hang", err=True)

    try:
        if record_s is not None:  # Ctrl-C here stops the ranks it started too
            typer.echo(f"probing: recording {record_s:g} s", err=True)
            time.sleep(record_s)
        for p in pid or []:  # a hung job never traced: stacks and counts still tell
            _probe_client(p, inject)
        job = Job(pids=pid, addr=addr, cluster=cluster, timeout=timeout)
        d, table = run_diagnosis(job, window_s=window_s, hang_after_s=hang_s, on_wait=waiting)
        if sql is not None:
            from probing.engine import Engine
            from probing.render import format_arrow
            from probing.store import Store

            engine = Engine(Store())
            for name, t in sql_tables(d, table).items():
                engine.register_table("analyze", name, lambda t=t: t)  # type: ignore[misc]  # a lambda's default
            result = engine.sql(sql)
            if fmt is Format.json:
                typer.echo(json.dumps(result.to_pylist(), default=str))
            else:
                typer.echo(format_arrow(result))
            return
    except ProbingError as err:
        raise _fail(err) from None
    finally:
        if record_s is not None and started:  # the ranks it started, not a trace of someone's
            with contextlib.suppress(ProbingError):
                _client(pid[0]).cluster_trace("stop", ranks=started)  # type: ignore[index]
    if fmt is Format.json:
        typer.echo(json.dumps(d.to_json(), default=str))
    else:
        typer.echo(diagnosis(d))


def _record(pid: int, inject: bool, seconds: float) -> list[int]:
    """``diagnose --record``: start tracing every rank of ``pid``'s job (the
    caller waits ``seconds``); the ranks it started (a rank tracing already
    goes on as it was, and is not stopped after)."""
    from probing.render import control_rows

    rows = _probe_client(pid, inject).cluster_trace("start")
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


@app.command(
    epilog="Examples:\n\n  probing demo\n\n  probing demo --slow-rank 2\n\n  probing demo --hang"
)
def demo(
    seconds: Annotated[
        float, typer.Option(help="how long to trace the job before diagnosing")
    ] = 4.0,
    slow_rank: Annotated[
        int | None, typer.Option(help="the rank to slow down (default: one at random)")
    ] = None,
    hang: Annotated[
        bool, typer.Option("--hang", help="one rank gets stuck before a collective instead")
    ] = False,
) -> None:
    """Run a 4-rank DDP job with one slow rank, attach, and name it with diagnose."""
    from probing.demo import main as demo_main

    raise typer.Exit(demo_main(seconds, slow_rank=slow_rank, hang=hang))


def _register_views() -> None:
    """``probing export`` and ``probing ui`` (their commands live with them)."""
    from probing.export.command import register as register_export
    from probing.ui.command import register as register_ui

    register_export(app)
    register_ui(app)


_register_views()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
