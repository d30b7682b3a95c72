"""The ``probing`` command and ``python -m probing``.

``python -m probing run script.py args…`` runs a script with the probe on.
``query --pid``, ``stack`` and ``ps``, what a user types most against a live
probe, take a fast path: their few flags are read here and the probe is
asked over its socket without importing typer (pydantic, rich) or pyarrow,
and print exactly what the typer commands print. Any other command, any
flag this reader does not know (``--help``, ``--cluster``, ``--addr``), a
missing or malformed value: the typer app (``probing.cli.app``) takes the whole
command line and says what is wrong.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

# value options and flags of each fast command: option -> (field, value or None)
_PID = {"--pid": ("pid", None), "-p": ("pid", None)}
_FMT = {"--format": ("fmt", None), "-f": ("fmt", None)}
_INJECT = {"--inject": ("inject", True), "--no-inject": ("inject", False)}
FAST: dict[str, tuple[dict[str, tuple[str, object]], int]] = {
    "query": ({**_PID, **_FMT}, 1),  # one positional: the SQL
    "stack": ({**_PID, **_FMT, **_INJECT}, 0),
    "ps": ({}, 0),
}
FORMATS = {"query": ("table", "csv", "json"), "stack": ("table", "json")}


def parse(argv: list[str]) -> tuple[str, dict[str, object], list[str]] | None:
    """(command, options, positionals) of a command line the fast path
    serves exactly as typer would, or None (typer's turn)."""
    if not argv or argv[0] not in FAST:
        return None
    spec, n_pos = FAST[argv[0]]
    opts: dict[str, object] = {}
    pos: list[str] = []
    args = iter(argv[1:])
    for arg in args:
        if arg == "--":
            pos.extend(args)
            break
        if not arg.startswith("-") or arg == "-":
            pos.append(arg)
            continue
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg[:2], "", arg[2:])
        if name not in spec:
            return None
        field, const = spec[name]
        if const is not None:  # a flag
            if eq or value:
                return None
            opts[field] = const
            continue
        if not eq and not value:
            value = next(args, "")
        if not value or value.startswith("-"):
            return None
        opts[field] = value  # the last one wins, as in click
    if len(pos) != n_pos:
        return None
    pid = opts.get("pid")
    if pid is not None:
        if not (isinstance(pid, str) and pid.isascii() and pid.isdigit()):
            return None
        opts["pid"] = int(pid)
    elif argv[0] != "ps":
        return None
    if "--format" in spec and opts.setdefault("fmt", "table") not in FORMATS[argv[0]]:
        return None
    return argv[0], opts, pos


def _echo(text: str, err: bool = False) -> None:
    """``typer.echo``: a line, ANSI escapes dropped unless on a terminal, flushed."""
    stream = sys.stderr if err else sys.stdout
    line = text + "\n"
    if "\x1b" in line and not stream.isatty():
        import re

        line = re.sub(r"\033\[[0-?]*[ -/]*[@-~]", "", line)
    stream.write(line)
    stream.flush()


def _query(pid: int, fmt: str, sql: str) -> None:
    from probing.cli.client import ProbeClient
    from probing.cli.render import write_answer

    write_answer(ProbeClient.for_pid(pid), sql, fmt, _echo)


def _stack(pid: int, fmt: str, inject: bool = True) -> None:
    import json

    from probing.cli.client import stacks
    from probing.cli.render import format_stacks

    info, frames = stacks(pid, inject=inject, note=lambda m: _echo(m, err=True))
    if fmt == "json":
        _echo(json.dumps({"process": info, "frames": frames}, default=str))
    else:
        _echo(format_stacks(info, frames))


def _ps() -> None:
    from probing.cli.commands.engine import ps_text

    _echo(ps_text())


def fast(argv: list[str]) -> Callable[[], int] | None:
    """The fast path's run of ``argv`` (returning the exit status), or None."""
    parsed = parse(argv)
    if parsed is None or (sys.stdout.encoding or "").lower() in ("ascii", "us-ascii"):
        return None  # click re-wraps a misconfigured stdout: leave that to it
    name, opts, pos = parsed
    pid, fmt = opts.get("pid"), str(opts.get("fmt"))
    command: Callable[[], None] = {
        "query": lambda: _query(pid, fmt, pos[0]),  # type: ignore[arg-type]
        "stack": lambda: _stack(pid, fmt, bool(opts.get("inject", True))),  # type: ignore[arg-type]
        "ps": _ps,
    }[name]

    def go() -> int:
        from probing.errors import ProbingError

        try:
            command()
        except ProbingError as err:
            _echo(f"probing: error: {err}", err=True)
            return 1
        except BrokenPipeError:  # `probing ps | head`: quietly, as click does
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        except KeyboardInterrupt:  # as typer: no traceback
            return 130
        return 0

    return go


def main() -> None:
    argv = sys.argv[1:]
    if argv == ["--version"]:  # as the typer app prints it, without importing it
        from probing import __version__

        _echo(f"probing {__version__}")
        sys.exit(0)
    if argv[:1] == ["run"]:
        from probing.cli.app import run_script

        sys.exit(run_script(argv[1:]))
    go = fast(argv)
    if go is not None:
        sys.exit(go())
    from probing.cli.app import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
