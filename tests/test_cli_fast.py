"""The fast path of ``probing query``, ``stack`` and ``ps`` (``probing.__main__``):
what it takes from typer, and that it prints what typer's commands print."""

from __future__ import annotations

import subprocess
import sys

import pytest

from probing.__main__ import parse
from probing.cli.client import ProbeClient
from probing.cli.render import format_arrow, format_table
from tests.conftest import IDLE_LOOP, SLOWDOWN, cli


def test_the_fast_path_reads_the_flags_it_knows() -> None:
    assert parse(["query", "-p", "12", "SELECT 1"]) == (
        "query",
        {"pid": 12, "fmt": "table"},
        ["SELECT 1"],
    )
    assert parse(["query", "SELECT 1", "--pid=12", "-fjson"])[1] == {"pid": 12, "fmt": "json"}
    assert parse(["query", "-p", "1", "-p", "2", "--", "-1"]) == (
        "query",
        {"pid": 2, "fmt": "table"},
        ["-1"],
    )
    assert parse(["stack", "--pid", "7", "--no-inject", "-f", "json"])[1] == {
        "pid": 7,
        "inject": False,
        "fmt": "json",
    }
    assert parse(["ps"]) == ("ps", {}, [])


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--help"],
        ["query", "--help"],
        ["query", "-p", "1", "SELECT 1", "--cluster"],
        ["query", "--addr", "h:1", "SELECT 1"],
        ["query", "SELECT 1"],  # no pid: typer says what to give
        ["query", "-p", "x", "SELECT 1"],
        ["query", "-p", "١", "SELECT 1"],  # a digit click may read otherwise
        ["query", "-p", "1"],
        ["query", "-p", "1", "a", "b"],
        ["query", "-p", "1", "-f", "xml", "SELECT 1"],
        ["query", "-p", "1", "-f", "TABLE", "SELECT 1"],
        ["query", "-p", "--format", "SELECT 1"],
        ["query", "-p", "1", "-x", "SELECT 1"],
        ["stack"],
        ["stack", "-p", "1", "--inject=yes"],
        ["ps", "-p", "1"],
        ["ps", "extra"],
        ["tables", "-p", "1"],
        ["trace", "-p", "1"],
    ],
)
def test_anything_else_goes_to_typer(argv: list[str]) -> None:
    assert parse(argv) is None


MODULES = ("typer", "click", "pydantic", "rich", "pyarrow", "numpy", "datafusion", "psutil")
SHOW_MODULES = f"""
import atexit, sys
atexit.register(lambda: print("MODULES", [m for m in {MODULES!r} if m in sys.modules],
                              file=sys.stderr))
sys.argv = ["probing", *sys.argv[1:]]
from probing.__main__ import main
main()
"""


def _run(*args: str, typer: bool = False) -> subprocess.CompletedProcess[str]:
    """The ``probing`` command through the fast path, or (``typer``) straight
    through the typer app, with the heavy modules it imported on stderr."""
    code = SHOW_MODULES.replace(
        "from probing.__main__ import main", "from probing.cli.app import main"
    )
    return subprocess.run(
        [sys.executable, "-c", code if typer else SHOW_MODULES, *args],
        capture_output=True,
        text=True,
        timeout=60 * SLOWDOWN,
    )


def _split(r: subprocess.CompletedProcess[str]) -> tuple[int, str, str, list[str]]:
    err, _, modules = r.stderr.rpartition("MODULES ")
    return r.returncode, r.stdout, err, eval(modules)  # our own list


ODD_VALUES = (
    "SELECT 1.5 AS a, NULL AS b, 'x\ny' AS c, true AS d, "
    "arrow_cast(1.5, 'Decimal128(5,2)') AS e, [1, 2] AS l, {'a': 1} AS s, "
    "arrow_cast(TIMESTAMP '2026-01-02 03:04:05.123456', 'Timestamp(Microsecond, None)') AS t, "
    "[arrow_cast(TIMESTAMP '2026-01-02 03:04:05', 'Timestamp(Microsecond, None)')] AS lt, "
    "map(['k'], [1]) AS m, arrow_cast('ab', 'Binary') AS bin, arrow_cast(1, 'Date32') AS day, "
    "'é…' AS u, 1e300 AS big, -0.0 AS z, 'a\x1b[1mb' AS esc"
)
QUERIES = (
    "SELECT 1",
    "SELECT * FROM (SELECT 1 AS a) x, (SELECT 2 AS a) y",  # two columns of one name
    "SELECT 1 AS a WHERE false",  # names, no rows
    ODD_VALUES,
    "SELECT x FROM unnest([1.0, 2.25, NULL, -3.5]) AS t(x)",
    "SELECT name FROM process.threads WHERE name LIKE 'loader%' ORDER BY name",
)


@pytest.mark.parametrize("sql", QUERIES)
def test_rows_print_as_the_arrow_table_does(spawn, sql: str) -> None:
    t = spawn(IDLE_LOOP)
    with ProbeClient.for_pid(t.pid) as probe:
        assert format_table(*probe.query_rows(sql)) == format_arrow(probe.query(sql))


def test_a_nanosecond_timestamp_prints_as_text(spawn) -> None:
    t = spawn(IDLE_LOOP)
    names, rows = ProbeClient.for_pid(t.pid).query_rows(
        "SELECT arrow_cast(1767323045123456789, 'Timestamp(Nanosecond, None)') AS t"
    )
    assert names == ["t"] and rows == [["2026-01-02 03:04:05.123456789"]]


def test_query_stack_and_ps_print_what_typer_prints_without_its_imports(spawn) -> None:
    t = spawn(IDLE_LOOP)
    pid = str(t.pid)
    commands = [
        ["query", "-p", pid, "SELECT name FROM process.threads WHERE name LIKE 'lo%' ORDER BY 1"],
        ["query", f"--pid={pid}", "-f", "json", ODD_VALUES.replace(", 'a\x1b[1mb' AS esc", "")],
        ["query", "-p", pid, "--format", "csv", "SELECT pid, cmdline FROM process.info"],
        ["query", "-p", pid, ODD_VALUES],
        ["query", "-p", pid, "SELECT * FROM process.nonexistent"],
        ["query", "-p", "999999999", "SELECT 1"],
        ["stack", "-p", pid, "--no-inject", "-f", "json"],
        ["stack", "-p", "999999999"],
    ]
    for args in commands:
        fast, slow = _split(_run(*args)), _split(_run(*args, typer=True))
        if args[0] == "stack" and fast[0] == 0:  # a thread's state and CPU share move
            fast, slow = _frames(fast), _frames(slow)
        assert fast[:3] == slow[:3], args
        assert not set(fast[3]) & {"typer", "click", "pydantic", "rich", "pyarrow"}, args
        assert "typer" in slow[3]
    code, out, err, modules = _split(_run("ps"))
    assert code == 0 and err == ""
    processes, _, engines = out.partition("\n\nengines:\n")
    listed = {line.split()[0]: line.split() for line in processes.splitlines()[2:]}
    assert listed[pid][2] == "yes"
    serving = str(ProbeClient.for_pid(t.pid).health()["engine_pid"])
    assert serving in {line.split()[0] for line in engines.splitlines()[2:]}, out
    assert not set(modules) & {"typer", "pyarrow", "numpy"}


def _frames(r: tuple[int, str, str, list[str]]) -> tuple[int, str, str, list[str]]:
    import json

    doc = json.loads(r[1])
    keep = ("tid", "thread", "depth", "func", "file", "line")
    frames = [{k: f[k] for k in keep} for f in doc["frames"] if f["thread"] == "MainThread"]
    return r[0], json.dumps([doc["process"], frames]), r[2], r[3]


def test_errors_are_one_line_on_stderr(spawn) -> None:
    t = spawn(IDLE_LOOP)
    r = cli("query", "-p", str(t.pid), "SELEC 1")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("probing: error: ") and r.stderr.endswith("\n")
    gone = cli("stack", "-p", "999999999")
    assert gone.returncode == 1 and gone.stderr == (
        "probing: error: no process with pid 999999999 (probing ps lists the Python processes)\n"
    )


def test_rows_are_encoded_in_steps_and_capped() -> None:
    import json

    import pyarrow as pa

    from probing.node.probe.api import json_columns
    from probing.node.sql.limits import LimitExceeded

    table = pa.table({"a": list(range(50_000)), "b": [str(i) for i in range(50_000)]})
    got = json.loads(json_columns(table, 1 << 30))
    assert got["columns"] == ["a", "b"] and got["rows"] == [[i, str(i)] for i in range(50_000)]
    assert json.loads(json_columns(table.slice(0, 0), 1 << 30)) == {
        "columns": ["a", "b"],
        "rows": [],
    }
    with pytest.raises(LimitExceeded) as err:
        json_columns(table, 100_000)
    assert err.value.setting == "PROBING_QUERY_MAX_RESULT_MB"


def test_uprobes_not_attached_are_said_one_line_an_error() -> None:
    from probing.cli.render import refused_lines

    verifier = "the kernel refused BPF program cuda_x: bpf(5): Argument list too long: too large"
    refused = [
        *({"symbol": f"cudaF{i}", "kind": "entry", "library": "/l/libcudart.so", "error": verifier}
          for i in range(8)),
        {"symbol": "cudaF0", "kind": "return", "library": "/l/libcudart.so", "error": verifier},
        {"symbol": "*", "kind": "entry", "library": "/l/libcuda.so.1", "error": "cannot read: EOF"},
    ]  # fmt: skip
    lines = refused_lines("cuda", refused, 42)
    assert lines[0] == "  ! cuda: 10 uprobes not attached, their calls not traced:"
    assert (
        lines[1] == f"      cudaF0, cudaF1, cudaF2, cudaF3, cudaF4, cudaF5 and 2 more: {verifier}"
    )
    assert lines[2] == "      every uprobe on /l/libcuda.so.1: cannot read: EOF"
    assert lines[3].startswith("      each one and its whole error: probing query --pid 42 ")
    assert refused_lines("cuda", [], 42) == []
