"""The ``probing`` command: every sub-command is a thin call into a module.

A command here is the options typer reads and a call, into
``probing.cli.commands`` (query, tables, trace, diagnose, ui) or the module it
names. Every one is registered the same way, by ``@command``, which also
turns a ProbingError it raises into one line on stderr and exit status 1.
Heavy modules (pyarrow, datafusion, bcc, torch) load inside the commands.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from enum import Enum
from typing import Annotated, Any, ParamSpec, TypeVar

import typer

from probing.cli.commands import common
from probing.errors import EvalError, ProbingError

app = typer.Typer(
    name="probing",
    help="Query what a running Python / PyTorch process is doing, with SQL.",
    epilog=(
        "Examples:\n\n"
        "  PROBING=1 python train.py &\n\n"
        "  probing inject --pid 1234\n\n"
        "  probing stack --pid 1234\n\n"
        "  probing ps\n\n"
        "  probing query --pid 1234 'SELECT name, state FROM process.threads'\n\n"
        "  probing tables --pid 1234\n\n"
        "  probing doctor"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class RowsFormat(str, Enum):
    """How ``probing query`` writes its rows: a table, CSV or JSON."""

    table = "table"
    csv = "csv"
    json = "json"


class TextFormat(str, Enum):
    """What a command that prints no rows of a table writes: text or JSON."""

    table = "table"
    json = "json"


class Fanout(str, Enum):
    auto = "auto"
    flat = "flat"
    tree = "tree"


def _fail(err: Exception | str, code: int = 1) -> typer.Exit:
    typer.echo(f"probing: error: {err}", err=True)
    return typer.Exit(code)


P = ParamSpec("P")
R = TypeVar("R")


def wrap_errors(fn: Callable[P, R], also: tuple[type[Exception], ...] = ()) -> Callable[P, R]:
    """``fn``, where a ProbingError (or one of ``also``) ends the command
    with one line on stderr and exit status 1, as psutil's
    ``wrap_exceptions`` translates for every method; an EvalError's
    traceback (from the target) goes first."""

    caught: tuple[type[Exception], ...] = (ProbingError, *also)

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except caught as err:
            if isinstance(err, EvalError) and err.detail:
                typer.echo(err.detail.rstrip(), err=True)
            raise _fail(err) from None

    return wrapper


def command(
    name: str | None = None, *, also: tuple[type[Exception], ...] = (), **settings: Any
) -> Callable[[Callable[P, None]], Callable[P, None]]:
    """Register the function below as the sub-command ``name`` (its own name
    by default), its errors printed by ``wrap_errors``: the one way every
    command is added to ``app``."""

    def register(fn: Callable[P, None]) -> Callable[P, None]:
        app.command(name=name, **settings)(wrap_errors(fn, also))
        return fn

    return register


def _version(value: bool) -> None:
    if value:
        from probing import __version__

        typer.echo(f"probing {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="print probing's version and exit"
        ),
    ] = False,
) -> None:
    """Query what a running Python / PyTorch process is doing, with SQL."""


PidOpt = Annotated[int, typer.Option("--pid", "-p", help="process id of the target")]


@command(epilog="Examples:\n\n  probing ps")
def ps() -> None:
    """Python processes on this machine, which of them carry a probe, and
    the node's engines that serve the probes (this user's)."""
    from probing.cli.commands.engine import ps_text

    typer.echo(ps_text())


@command(
    epilog="Examples:\n\n  probing agent\n\n  probing agent --no-attach --port 9978\n\n"
    "  probing agent --match 'train\\.py' --families gloo,nccl,cuda\n\n"
    "  probing agent --config /etc/probing/agent.env"
)
def agent(
    attach: Annotated[
        bool | None,
        typer.Option("--attach/--no-attach", help="attach to matching processes (default on)"),
    ] = None,
    match: Annotated[
        str | None, typer.Option("--match", help="also a command line matching this regex")
    ] = None,
    cgroup: Annotated[
        str | None, typer.Option("--cgroup", help="also a process whose cgroup holds this")
    ] = None,
    families: Annotated[
        str | None, typer.Option("--families", help="what to trace (default gloo,nccl)")
    ] = None,
    every: Annotated[
        float | None, typer.Option("--every", help="seconds between looks at the node")
    ] = None,
    host: Annotated[str | None, typer.Option("--host", help="serve on (127.0.0.1)")] = None,
    port: Annotated[
        int | None, typer.Option("--port", help="GET /health and /metrics (9978; 0: any)")
    ] = None,
    config_file: Annotated[
        str | None,
        typer.Option("--config", help="a file of NAME=value lines, as systemd reads them"),
    ] = None,
    require: Annotated[
        list[str] | None,
        typer.Option("--env", help="only processes whose environment has NAME=VALUE (repeatable)"),
    ] = None,
) -> None:
    """The node's agent, in the foreground (a service's main process): it
    attaches to every training process of the node, whatever started it (a
    launcher's variables: torchrun, srun, mpirun; or a torch process group
    formed: mp.spawn, Lightning's own launcher; not one with PROBING=0, nor
    a launcher), traces its collectives and watches its job, and serves
    GET /health and /metrics. Logs go to stderr; SIGTERM stops it (the
    probes go on)."""
    import os

    from probing import config, log
    from probing.node import agent as node_agent
    from probing.node.cluster.port import port_range

    env = dict(os.environ)
    if config_file is not None:
        env.update(_env_file(config_file))
    try:  # what a restart cannot fix: one line, and the status the unit does not restart on
        s = config.from_env(env, strict=True)
        log.setup("agent", s.log)  # a service's lines: who wrote each, and when
        policy = node_agent.Policy(
            pattern=s.agent_match if match is None else match,
            cgroup=s.agent_cgroup if cgroup is None else cgroup,
            families=tuple(
                f.strip() for f in (families or s.agent_families).split(",") if f.strip()
            ),
            attach=s.agent_attach if attach is None else attach,
            require=tuple(tuple(r.split("=", 1)) for r in require or [] if "=" in r),  # type: ignore[misc]
        )
        port = s.agent_port if port is None else port
        first, last = port_range(s.port_range)
        if first <= port <= last:
            raise config.ConfigError(
                f"the agent's port {port} is one of the engines' peer ports "
                f"(PROBING_PORT_RANGE {first}-{last}): an engine could take it",
                hint="give the agent a port outside that range (9978), or move the range",
            )
        node_agent.main(
            policy,
            every_s=s.agent_every_s if every is None else every,
            host=host or s.agent_host,
            port=port,
            webhook=s.agent_webhook,
        )
    except ProbingError as err:
        raise _fail(err, node_agent.EX_CONFIG) from None


def _env_file(path: str) -> dict[str, str]:
    """``NAME=value`` lines (``#`` comments, optional quotes), as systemd reads them."""
    out = {}
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as err:
        raise typer.BadParameter(f"cannot read {path}: {err.strerror}") from err
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        out[name.strip()] = value.strip().strip("'\"")
    return out


class EngineAction(str, Enum):
    list = "list"
    stop = "stop"


@command(
    epilog="Examples:\n\n  probing engine list\n\n  probing engine stop\n\n"
    "  probing engine stop --pid 4242"
)
def engine(
    action: Annotated[EngineAction, typer.Argument(help="list, or stop (gracefully)")],
    pid: Annotated[
        int | None, typer.Option("--pid", "-p", help="the engine's pid (stop: default all)")
    ] = None,
) -> None:
    """The node's engines of this user: list them, or stop one (or all).
    A stopped engine stops tracing; its processes go on, and are served by
    a new engine when a probe is asked for again (probing inject)."""
    from probing.cli.commands import engine as engines
    from probing.cli.render import format_rows

    if action is EngineAction.list:
        typer.echo(format_rows(engines.ENGINE_COLUMNS, engines.engine_rows(engines.engines())))
        return
    for e in engines.stop(pid):
        typer.echo(f"engine {e.pid} ({e.install}) stopped")


@command(
    epilog=(
        "Examples:\n\n"
        "  probing query --pid 1234 'SELECT count(*) FROM process.threads'\n\n"
        "  probing query -p 1234 -f json 'SELECT * FROM probing.tables'\n\n"
        "  probing query -p 1234 'SELECT * FROM python.`torch.__version__`'\n\n"
        "  probing query -p 1234 'SHOW COLUMNS FROM comm.collectives'\n\n"
        "  \b\n  probing query -p 1234 'SELECT to_timestamp_nanos(ts) AS time, op, dur_ns\n"
        "    FROM comm.collectives ORDER BY ts DESC LIMIT 5'   # ts: wall-clock ns\n\n"
        "  \b\n  probing query -p 1234 --cluster \\\n"
        "    'SELECT rank, count(*) FROM process.threads GROUP BY rank'\n\n"
        "  \b\n  PROBING_TOKEN=... probing query --addr 10.0.0.2:7070 --cluster --strict \\\n"
        "    'SELECT node, rank, max(ts) FROM comm.collectives GROUP BY node, rank'"
    )
)
def query(
    sql: Annotated[str, typer.Argument(help="read-only SQL (SELECT, WITH, SHOW, EXPLAIN)")],
    pid: Annotated[int | None, typer.Option("--pid", "-p", help="process id of the target")] = None,
    addr: Annotated[
        str | None,
        typer.Option("--addr", help="a peer probe's host:port instead (token: $PROBING_TOKEN)"),
    ] = None,
    fmt: Annotated[
        RowsFormat, typer.Option("--format", "-f", help="output format")
    ] = RowsFormat.table,
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
    from probing.cli.commands.query import ask_cluster, ask_one

    if (pid is None) == (addr is None):
        raise _fail("give exactly one of --pid or --addr", 2)
    if not cluster:
        ask_one(sql, pid, addr, fmt.value)
        return
    ask_cluster(
        sql,
        pid,
        addr,
        fmt.value,
        timeout=timeout,
        strict=strict,
        timings=timings,
        fanout=fanout.value,
    )


@command(epilog="Examples:\n\n  probing tables --pid 1234")
def tables(pid: PidOpt) -> None:
    """Tables a process's probe can answer, with rows and compression."""
    from probing.cli.commands.query import list_tables

    list_tables(pid)


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


@command(
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
                raise
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


@command(
    epilog=(
        "Examples:\n\n  probing stack --pid 1234\n\n  probing stack -p 1234 --format json"
        "\n\n  probing stack -p 1234 --no-inject"
    )
)
def stack(
    pid: PidOpt,
    inject: InjectOpt = True,
    fmt: Annotated[
        TextFormat, typer.Option("--format", "-f", help="table or json")
    ] = TextFormat.table,
) -> None:
    """Every thread's Python stack, like py-spy dump: name, tid, state, file:line.

    Asks the process's probe (injecting one unless --no-inject); where there
    is none, injection fails or the probe does not answer (a thread holding
    the GIL in a C call), reads the stacks from outside (process_vm_readv)."""
    from probing.cli.client import stacks
    from probing.cli.render import format_stacks

    info, frames = stacks(pid, inject=inject, note=common.note)
    if fmt is TextFormat.json:
        typer.echo(json.dumps({"process": info, "frames": frames}, default=str))
    else:
        typer.echo(format_stacks(info, frames))


@command(
    name="eval",
    epilog=(
        "Examples:\n\n"
        "  probing eval --pid 1234 'len(gc.get_objects())'\n\n"
        "  probing eval -p 1234 'import torch; print(torch.cuda.memory_allocated())'"
    ),
)
def eval_cmd(
    code: Annotated[str, typer.Argument(help="a Python expression or statements")],
    pid: PidOpt,
    inject: InjectOpt = False,
) -> None:
    """Run Python inside the target (local socket only); print its value and output."""
    out = common.probe_client(pid, inject).eval(code)
    if out.get("output"):
        typer.echo(out["output"], nl=False)
    if out.get("result") is not None:
        typer.echo(out["result"])


@command(
    epilog=(
        "Examples:\n\n  probing nvml --pid 1234 --interval 100ms\n\n"
        "  probing nvml --pid 1234 --stop\n\n"
        "  probing query -p 1234 'SELECT gpu, avg(util_gpu) FROM nvml.gpu GROUP BY gpu'"
    )
)
def nvml(
    pid: PidOpt,
    interval: Annotated[str, typer.Option(help="sampling interval (100ms, 1s)")] = "100ms",
    stop: Annotated[bool, typer.Option("--stop", help="stop sampling")] = False,
) -> None:
    """Sample GPU counters (NVML) into nvml.gpu next to the events; print nvml.status."""
    status = common.client(pid).nvml(interval, stop=stop)
    typer.echo(" ".join(f"{k}={v}" for k, v in status.items() if v is not None))
    if status.get("state") == "unavailable":
        raise typer.Exit(1)


def _family_flag(name: str, what: str) -> Any:  # a typer.OptionInfo
    return typer.Option(f"--{name}/--no-{name}", help=f"trace {what}")


@command(
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
        "  probing query -p 1234 'SELECT op, count(*), avg(dur_ns) FROM comm.collectives "
        "GROUP BY op'"
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
    from probing.cli.commands.trace import TraceOptions, trace_many, trace_one

    families = [n for n, on in (("nccl", nccl), ("cuda", cuda), ("gloo", gloo)) if on]
    if output and (cluster or job):
        raise _fail("--output writes one process's events: leave it out with --cluster, --job")
    if cluster and job:
        raise _fail("--cluster reaches every rank already: leave --job out")
    if not stop and not families:
        raise _fail("nothing to trace: every family is turned off")
    options = TraceOptions(families, stacks=stacks, launch_stacks=launch_stacks)
    if cluster or job:
        raise typer.Exit(
            trace_many(
                pid,
                options,
                job=job,
                inject=inject,
                stop=stop,
                background=background,
                duration=duration,
                timeout=timeout,
            )
        )
    trace_one(
        pid,
        options,
        inject=inject,
        stop=stop,
        background=background,
        duration=duration,
        output=output,
    )


@command(epilog="Examples:\n\n  probing doctor\n\n  probing doctor --format json")
def doctor(
    fmt: Annotated[
        TextFormat, typer.Option("--format", "-f", help="table or json")
    ] = TextFormat.table,
) -> None:
    """Check kernel, BTF, tracefs, BCC, headers, CAP_BPF, ptrace and NVML."""
    from probing.cli.doctor import format_checks, run_all

    checks = run_all()
    if fmt is TextFormat.json:
        typer.echo(json.dumps([c._asdict() for c in checks], indent=1))
    else:
        typer.echo(format_checks(checks))
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


@command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    epilog="Examples:\n\n  probing run train.py --epochs 3",
)
def run(ctx: typer.Context, script: Annotated[str, typer.Argument(help="script to run")]) -> None:
    """Run a Python script with the probe enabled (like PROBING=1)."""
    raise typer.Exit(run_script([script, *ctx.args]))


@command(
    also=(OSError,),  # the job environment's files
    epilog=(
        "Examples:\n\n  probing hook --python /opt/job-venv/bin/python\n\n"
        "  PROBING=1 /opt/job-venv/bin/python train.py\n\n"
        "  probing hook --python /opt/job-venv/bin/python --remove"
    ),
)
def hook(
    python: Annotated[str, typer.Option(help="the job environment's Python")],
    remove: Annotated[bool, typer.Option(help="take the hook out again")] = False,
) -> None:
    """Let PROBING=1 start the probe in a job environment that lacks probing:
    a .pth line and the stdlib-only guest go in; nothing the job imports."""
    from probing.inject import hookinstall

    done = hookinstall.remove(python) if remove else hookinstall.install(python)
    if remove:
        typer.echo(f"removed the probing hook from {done.site}")
    else:
        typer.echo(f"PROBING=1 now starts the probe in {python} ({done.pth}, {done.guest})")


@command(
    epilog=(
        "Examples:\n\n  probing diagnose --pid 101 --pid 102 --pid 103 --pid 104\n\n"
        "  probing diagnose -p 101 -p 102 --window 30s --format json\n\n"
        "  probing diagnose --pid 101 --cluster\n\n"
        "  probing diagnose --pid 101 --cluster --record 15s   # an untraced job\n\n"
        "  probing diagnose -p 101 -p 102 --sql 'SELECT rank, lag_ms_p99 FROM "
        "analyze.stragglers'"
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
    fmt: Annotated[
        TextFormat, typer.Option("--format", "-f", help="table or json")
    ] = TextFormat.table,
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
    from probing.cli.commands.diagnose import diagnose_job
    from probing.config import parse_interval

    try:
        window_s, hang_s = parse_interval(window), parse_interval(hang_after)
        record_s = parse_interval(record) if record else None
    except ValueError as err:
        raise _fail(err) from None
    if record_s is not None and (not cluster or len(pid or []) != 1):
        raise _fail("--record traces the job through one rank: give --cluster and one --pid")
    diagnose_job(
        pid or [],
        addr=addr,
        cluster=cluster,
        timeout=timeout,
        inject=inject,
        window_s=window_s,
        hang_s=hang_s,
        sql=sql,
        fmt=fmt.value,
        record_s=record_s,
    )


@command(
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
    from probing.cli.demo import main as demo_main

    raise typer.Exit(demo_main(seconds, slow_rank=slow_rank, hang=hang))


class ExportFormat(str, Enum):
    perfetto = "perfetto"
    parquet = "parquet"


@command(
    name="export",
    also=(OSError,),  # the trace file or directory
    epilog=(
        "Examples:\n\n"
        "  probing export --pid 1234 --cluster --format perfetto -o job.pftrace\n\n"
        "  \b\n  probing export -p 1234 --cluster --window 30s --max-events 2000000 \\\n"
        "    -o last30s.pftrace\n\n"
        "  probing export -p 1234 --cluster --format parquet -o job-parquet/\n\n"
        "  PROBING_TOKEN=... probing export --addr 10.0.0.2:7070 -o job.pftrace\n\n"
        "  (open a .pftrace in https://ui.perfetto.dev, or offline: probing ui --pid 1234)"
    ),
)
def export_cmd(
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
    from probing.cli.export import Source, export
    from probing.config import parse_interval

    try:
        window_s = parse_interval(window)
    except ValueError as err:
        raise _fail(err, 2) from None
    src = Source(pids=pid or [], addr=addr, cluster=cluster or bool(addr), timeout=timeout)
    report = export(src, output, fmt=fmt.value, window_s=window_s, max_events=max_events)
    typer.echo(report.summary())


@command(
    name="ui",
    epilog=(
        "Examples:\n\n"
        "  probing ui --pid 1234            # the job rank 1234 belongs to\n\n"
        "  probing ui -p 101 -p 102 -p 103  # these local ranks only\n\n"
        "  PROBING_TOKEN=... probing ui --addr 10.0.0.2:7070 --port 8765\n\n"
        "  (then open the printed http://127.0.0.1:PORT/?token=... URL; over ssh:\n"
        "  ssh -L PORT:127.0.0.1:PORT host)"
    ),
)
def ui_cmd(
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
    from probing.cli.commands.ui import serve

    serve(pid or [], addr, port, timeout)


@command(
    name="mcp",
    epilog=(
        "Examples:\n\n"
        "  probing mcp                      # stdio: what an agent's MCP config spawns\n\n"
        "  probing mcp --allow-control --out-dir ~/probing-mcp\n\n"
        "  probing mcp --http --port 8765   # http://127.0.0.1:8765/mcp\n\n"
        "  PROBING_MCP_TOKEN=$(openssl rand -hex 16) probing mcp --http --host 0.0.0.0"
    ),
)
def mcp_cmd(
    http: Annotated[
        bool, typer.Option("--http", help="serve streamable HTTP instead of stdio")
    ] = False,
    host: Annotated[
        str, typer.Option(help="address to listen on (--http); off the loopback: a token")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on (--http; 0: a free one)")] = 8765,
    token: Annotated[
        str | None,
        typer.Option(help="bearer token each HTTP request must carry (default $PROBING_MCP_TOKEN)"),
    ] = None,
    out_dir: Annotated[
        str | None,
        typer.Option(help="where traces and the audit log go (default: a private temp dir)"),
    ] = None,
    allow_control: Annotated[
        bool, typer.Option("--allow-control", help="serve trace_start, trace_stop and eval")
    ] = False,
) -> None:
    """Serve probing to AI agents over MCP: processes, stacks, SQL, diagnose, findings."""
    from probing.cli.mcp import Options, serve
    from probing.config import load
    from probing.node.cluster.port import check_free

    token = token or load().mcp_token or None
    if http:  # a port held: who holds it, in one line
        check_free("probing mcp", host, port, "choose another --port (0: any free one)")
    serve(Options(http, host, port, token, out_dir, allow_control))


def main() -> None:
    from probing import config, log

    log.setup(None, config.load().log)  # a command's warnings: `probing: ...` on stderr
    app()


if __name__ == "__main__":
    main()
