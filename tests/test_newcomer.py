"""A newcomer's first hour (issue 43): the tables are easy to find, the
numbers easy to read, the errors lead somewhere, and the examples of every
command's help paste into bash as they print."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import probing
from probing.__main__ import parse
from probing.cli.doctor import Check, check_ptrace, format_checks
from probing.cli.render import format_rows, untraced
from probing.errors import QueryError
from probing.node import assemble
from probing.node.sql import Database
from probing.node.store import Store
from tests.conftest import IDLE_LOOP, SLOWDOWN, cli

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def database() -> Database:
    e = Database(Store())
    assemble.install_tables(e)
    return e


def _names(database: Database, sql: str) -> set[str]:
    rows = database.sql(sql).to_pylist()
    return {f"{r['table_schema']}.{r['table_name']}" for r in rows}


# -- 1. every table a probe answers is listed, its columns too ------------------------


def test_show_tables_lists_the_views_and_the_lazy_schemas(database: Database) -> None:
    assert database.schema("analyze")._pending  # registered at the first listing
    for sql in (
        "SHOW TABLES",
        "SELECT table_schema, table_name FROM information_schema.tables",
    ):
        names = _names(database, sql)
        assert {"comm.collectives", "python.callsites", "analyze.stragglers"} <= names, sql
        assert {"nccl.calls", "process.threads", "trace.intervals"} <= names, sql


def test_show_columns_of_a_view(database: Database) -> None:
    cols = database.sql("SHOW COLUMNS FROM comm.collectives").column("column_name").to_pylist()
    assert {"backend", "op", "ts", "dur_ns", "rank"} <= set(cols)
    # filtered information_schema runs on DataFusion's own threads
    got = database.sql(
        "SELECT DISTINCT table_name FROM information_schema.columns "
        "WHERE table_schema = 'python' AND column_name = 'stack_id'"
    )
    assert "callsites" in got.column(0).to_pylist()
    # and the view still answers its rows afterwards
    assert database.sql("SELECT count(*) AS n FROM comm.collectives").to_pylist() == [{"n": 0}]


# -- 2. probing tables: how each table answers --------------------------------------------


def test_every_table_has_its_kind(database: Database) -> None:
    kinds = {f"{k['schema']}.{k['table']}": k["kind"] for k in database.kinds()}
    assert kinds["comm.collectives"] == "view" and kinds["python.callsites"] == "view"
    assert kinds["nccl.calls"] == "stored" and kinds["python.stacks"] == "stored"
    assert kinds["process.info"] == "live" and kinds["analyze.stragglers"] == "live"
    assert set(kinds) == _names(database, "SHOW TABLES") - {
        n for n in _names(database, "SHOW TABLES") if n.startswith("information_schema.")
    }


def test_the_tables_command_shows_kinds_not_nulls(spawn) -> None:
    t = spawn(IDLE_LOOP)
    r = cli("tables", "--pid", str(t.pid))
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()[2:]}
    assert rows["comm.collectives"] == ["view"]
    assert rows["process.info"] == ["live"]
    assert rows["nccl.calls"][:2] == ["stored", "0"]
    assert "NULL" not in r.stdout
    assert all(len(line) <= 80 for line in r.stdout.splitlines())


# -- 3. numbers for people; timestamps documented ---------------------------------


def test_floats_print_in_fixed_point_and_integers_whole() -> None:
    out = format_rows(
        ["avg", "small", "count", "huge"],
        [[29404700.5, 0.000333, 123456789, 1e300], [1.0, -0.5, 7, None]],
    )
    lines = out.splitlines()
    assert lines[2].split() == ["29404700.50", "0.000333", "123456789", "1e+300"]
    assert lines[3].split() == ["1.00", "-0.500", "7", "NULL"]
    assert "e+07" not in out


def test_timestamps_are_documented() -> None:
    help_text = cli("query", "--help").stdout
    assert "to_timestamp_nanos(ts)" in help_text and "wall-clock ns" in help_text
    doc = (REPO / "docs" / "sql.md").read_text()
    assert "to_timestamp_nanos(ts)" in doc and "wall-clock nanoseconds" in doc


def test_to_timestamp_nanos_reads_ts(database: Database) -> None:
    got = database.sql("SELECT CAST(to_timestamp_nanos(1767323045123456789) AS VARCHAR) AS t")
    assert got.to_pylist() == [{"t": "2026-01-02T03:04:05.123456789"}]


# -- 4. an empty answer before any trace says how to trace ---------------------------------


def test_an_untraced_table_says_how_to_trace(spawn) -> None:
    t = spawn(IDLE_LOOP)
    hint = f"nothing traced yet: probing trace --pid {t.pid}"
    for fmt in ("table", "json", "csv"):
        r = cli("query", "-p", str(t.pid), "-f", fmt, "SELECT op, dur_ns FROM nccl.calls")
        assert r.returncode == 0 and hint in r.stderr, (fmt, r.stderr)
    r = cli("query", "-p", str(t.pid), "SELECT op, avg(dur_ns) FROM comm.collectives GROUP BY op")
    assert r.returncode == 0 and "(0 rows)" in r.stdout and hint in r.stderr
    # not for rows, nor for tables that need no trace
    r = cli("query", "-p", str(t.pid), "SELECT count(*) AS n FROM nccl.calls")
    assert r.returncode == 0 and r.stderr == ""
    r = cli("query", "-p", str(t.pid), "SELECT name FROM process.threads WHERE false")
    assert r.returncode == 0 and r.stderr == ""


class _Probe:
    """A probe client that answers ``trace.intervals`` with ``traces`` rows."""

    def __init__(self, traces: int) -> None:
        self.traces = traces
        self.asked: list[str] = []
        self.transport = SimpleNamespace(pid=42)

    def query_rows(self, sql: str) -> tuple[list[str], list[list[int]]]:
        self.asked.append(sql)
        return ["count(*)"], [[self.traces]]


def test_a_probe_that_traced_once_gets_no_hint() -> None:
    assert untraced(_Probe(0), "SELECT * FROM python.samples") == (
        "probing: nothing traced yet: probing trace --pid 42"
    )
    probe = _Probe(1)
    assert untraced(probe, "SELECT * FROM cuda.calls") is None and probe.asked
    quiet = _Probe(0)
    assert untraced(quiet, "SELECT * FROM process.info") is None and not quiet.asked


# -- 5. a misspelt table: the nearest names, never the catalog's own --------------------


@pytest.mark.parametrize(
    ("sql", "said", "meant"),
    [
        ("SELECT * FROM comm.colectives", "comm.colectives", "comm.collectives"),
        ("SELECT * FROM colectives", "colectives", "comm.collectives"),
        ("SELECT * FROM nccl.cals", "nccl.cals", "nccl.calls"),
        ("SELECT * FROM probing.tabels", "probing.tabels", "probing.tables"),
    ],
)
def test_a_misspelt_table_gets_the_nearest_names(
    database: Database, sql: str, said: str, meant: str
) -> None:
    with pytest.raises(QueryError) as err:
        database.sql(sql)
    msg = str(err.value)
    assert msg.startswith(f"no table {said}; did you mean {meant}"), msg
    assert "probing.probing" not in msg and "probing.comm" not in msg
    assert "SHOW TABLES lists them" in msg


def test_a_table_like_no_other_gets_no_guess(database: Database) -> None:
    with pytest.raises(QueryError, match=r"^no table zzz\.qqq \(SHOW TABLES lists them\)$"):
        database.sql("SELECT * FROM zzz.qqq")


def test_the_command_line_names_its_own_listing(spawn) -> None:
    t = spawn(IDLE_LOOP)
    r = cli("query", "-p", str(t.pid), "SELECT * FROM comm.colectives")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (
        "probing: error: no table comm.colectives; did you mean comm.collectives or "
        f"analyze.collectives? (probing tables --pid {t.pid} lists them)\n"
    )


# -- 6-8. errors that lead somewhere --------------------------------------------------------


def test_a_process_that_is_not_python(spawn) -> None:
    t = spawn("", probing=False, argv=["sleep", "100"])
    for args in (("query", "-p", str(t.pid), "SELECT 1"), ("tables", "-p", str(t.pid))):
        r = cli(*args)
        assert r.returncode == 1, args
        assert f"process {t.pid} (sleep) is not a Python process" in r.stderr, r.stderr
        assert "probing ps" in r.stderr and "inject" in r.stderr
        assert "probing inject" not in r.stderr


def test_a_python_process_without_a_probe_is_told_to_inject(spawn) -> None:
    t = spawn(IDLE_LOOP, probing=False)
    r = cli("query", "-p", str(t.pid), "SELECT 1")
    assert r.returncode == 1 and f"probing inject --pid {t.pid}" in r.stderr


def test_cluster_on_a_process_that_is_no_rank(spawn) -> None:
    t = spawn(IDLE_LOOP)
    r = cli("query", "-p", str(t.pid), "--cluster", "SELECT 1")
    assert r.returncode == 1 and "probe answered 500" not in r.stderr
    drop = r.stderr.find("leave --cluster out")
    assert 0 <= drop < r.stderr.find("RANK"), r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("query", "-p", "999999999", "SELECT 1"),
        ("tables", "-p", "999999999"),
        ("stack", "-p", "999999999"),
        ("trace", "-p", "999999999", "--stop"),
        ("inject", "-p", "999999999"),
    ],
)
def test_a_wrong_pid_points_to_ps(args: tuple[str, ...]) -> None:
    r = cli(*args)
    assert r.returncode == 1
    assert r.stderr == (
        "probing: error: no process with pid 999999999 (probing ps lists the Python processes)\n"
    )


# -- 9. every example of every help pastes into bash ------------------------------------------


def _helps() -> dict[str, str]:
    """Every command's --help (and the app's) as an 80-column terminal shows it."""
    import typer.main
    from typer.testing import CliRunner

    from probing.cli.app import app

    runner = CliRunner()
    names = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    out = {"": runner.invoke(app, ["--help"], terminal_width=80).stdout}
    for name in names:
        out[name] = runner.invoke(app, [name, "--help"], terminal_width=80).stdout
    return out


# bash with ``probing`` a function that prints its arguments, every other
# command silent (the $(...) of an example's variable), HOME a known place
ARGV = (
    'probing() { for a in "$@"; do printf "%s\\0" "$a"; done; printf "\\1"; }\n'
    "command_not_found_handle() { return 127; }\n"
)
PROBING_CALL = re.compile(r"^(?:[A-Z_]+=(?:\$\([^)]*\)|\S*)\s+)*probing(?=\s|$)")


def _bash_argv(snippet: str) -> tuple[list[list[str]], str]:
    """What bash hands ``probing`` when ``snippet`` is pasted: one list a call."""
    r = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", ARGV + snippet],
        capture_output=True,
        timeout=10,
        env={"PATH": "/usr/bin:/bin", "HOME": "/HOME"},
    )
    calls = [c.split(b"\0")[:-1] for c in r.stdout.split(b"\1")[:-1]]
    return [[a.decode() for a in c] for c in calls], r.stderr.decode()


def test_every_help_example_pastes_into_bash() -> None:
    """Each example, pasted as --help prints it (80 columns), is one call of
    probing with the arguments it shows: no line wrapped outside its quotes,
    nothing substituted inside them (backticks in double quotes)."""
    checked = 0
    for name, text in _helps().items():
        assert "Examples:" in text, name
        examples = text.split("Examples:", 1)[1]
        for para in re.split(r"\n\s*\n", examples.strip("\n")):
            snippet = "\n".join(line.strip() for line in para.splitlines()).strip()
            call = PROBING_CALL.match(snippet)
            if call is None:  # a note in parentheses, or how to start the job
                assert snippet.startswith("(") or "python" in snippet, (name, snippet)
                continue
            args = snippet[call.end() :].replace("\\\n", " ")
            words = [re.sub(r"^~(?=/|$)", "/HOME", w) for w in shlex.split(args, comments=True)]
            calls, err = _bash_argv(snippet)
            assert err == "" and calls == [words], (name, snippet, calls, err)
            checked += 1
    assert checked >= 30


def test_single_quotes_keep_backticks() -> None:
    calls, err = _bash_argv("probing query -p 1 'SELECT * FROM python.`torch.__version__`'")
    assert err == "" and calls == [["query", "-p", "1", "SELECT * FROM python.`torch.__version__`"]]
    calls, _ = _bash_argv('probing query -p 1 "SELECT * FROM python.`echo x`"')
    assert calls == [["query", "-p", "1", "SELECT * FROM python.x"]]  # what double quotes do


# -- 10. only the formats a command produces ---------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("stack", "-p", "1", "-f", "csv"),
        ("stack", "-p", "1", "--format=csv", "--no-inject"),
        ("doctor", "--format", "csv"),
        ("diagnose", "-p", "1", "-f", "csv"),
    ],
)
def test_csv_is_refused_where_nothing_prints_csv(args: tuple[str, ...]) -> None:
    r = cli(*args)
    assert r.returncode == 2 and r.stdout == ""
    assert "'csv' is not one of 'table', 'json'" in r.stderr, r.stderr


def test_the_fast_path_leaves_a_refused_format_to_typer() -> None:
    assert parse(["stack", "-p", "1", "-f", "csv"]) is None
    assert parse(["stack", "-p", "1", "-f", "json"]) is not None
    assert parse(["query", "-p", "1", "-f", "csv", "SELECT 1"]) is not None


# -- 11. --version -------------------------------------------------------------------------------


def test_version() -> None:
    r = cli("--version")
    assert r.returncode == 0 and r.stdout == f"probing {probing.__version__}\n"
    assert r.stderr == ""
    typer_app = subprocess.run(
        [sys.executable, "-c", "from probing.cli.app import main; main()", "--version"],
        capture_output=True,
        text=True,
        timeout=60 * SLOWDOWN,
    )
    assert typer_app.returncode == 0 and typer_app.stdout == r.stdout


# -- 12. doctor ----------------------------------------------------------------------------------


def test_doctor_rows_line_up_and_say_no_none(tmp_path) -> None:
    checks = [
        Check("kernel", True, "6.8 (BPF ring buffers need >= 5.8)"),
        Check("uprobe_multi", False, "multi-uprobe links unavailable", "a kernel >= 6.6 " * 8),
        check_ptrace(0, str(tmp_path / "no-yama")),
    ]
    lines = format_checks(checks).splitlines()
    assert all(len(line) <= 80 for line in lines)
    # the detail of every check starts in one column: after the longest name
    heads = [line for line in lines if not line.startswith(" ")]
    assert [line.split()[1] for line in heads] == ["kernel", "uprobe_multi", "ptrace"]
    assert all(line[18] == " " and line[19] != " " for line in heads), heads
    # what goes on below (the rest of a long line, the fix) starts there too
    rest = [line for line in lines if line.startswith(" ")]
    assert len(rest) >= 2 and all(line[:19].isspace() and line[19] != " " for line in rest)
    assert any(line[19:].startswith("fix: a kernel") for line in rest)
    assert "None" not in "\n".join(lines) and "no Yama" in checks[2].detail


def test_doctor_command_lines_up(tmp_path) -> None:
    r = cli("doctor")
    assert "None" not in r.stdout
    heads = [line for line in r.stdout.splitlines() if not line.startswith(" ")]
    names = json.loads(cli("doctor", "--format", "json").stdout)
    width = max(len(c["name"]) for c in names)
    assert len(heads) == len(names)
    assert all(line[6 + width] == " " and line[7 + width] != " " for line in heads), heads
    assert all(len(line) <= 80 for line in r.stdout.splitlines())


# -- 13. a second stop ----------------------------------------------------------------------------


def test_stopping_a_process_that_is_not_tracing_is_done(spawn) -> None:
    t = spawn(IDLE_LOOP)
    for _ in range(2):
        r = cli("trace", "--pid", str(t.pid), "--stop")
        assert r.returncode == 0 and "already stopped" in r.stdout, (r.stdout, r.stderr)
