"""The guest: standard library only, in every CPython it supports, leaving
the job's view of its environment as it was; and its answers, asked through
its socket as the engine asks them (``probing.target.GuestProcess``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from probing import pyframes
from probing.errors import EvalError, QueryError
from probing.guest import outbox, place
from probing.target import GuestProcess
from tests.conftest import PY314_BUILD_S, REPO, py314_python, require

GUEST_DIR = REPO / "probing" / "guest"

LOAD_AND_LOOK = """
import json, sys
before_path, before_mods = list(sys.path), set(sys.modules)
ns = {"__name__": "_probing_hook"}
exec(compile(open(GUEST_DIR + "/hook.py").read(), "hook.py", "exec"), ns)
guest = ns["load"](GUEST_DIR)
from _probing_guest import inside, outbox, wire, life
info = inside.info()
rows = inside.stacks(0.01)
new = sorted(set(sys.modules) - before_mods)
print(json.dumps({
    "path_same": sys.path == before_path,
    "foreign": [m for m in new if m.split(".")[0] not in sys.stdlib_module_names
                and m.split(".")[0] != "_probing_guest"
                and not m.startswith("_sysconfigdata_")],  # sysconfig's own data module
    "python": info["python"], "frames": len(rows),
    "expr": inside.expr("{'a': [1, 2], 'b': ['x', None]}"),
}))
"""


def _python(version: str) -> str:
    if version == "3.14":  # Debian unstable's, in a chroot (.ci/py314.sh: root only)
        return py314_python()
    pythons = sorted(Path(os.path.expanduser("~/.pyenv/versions")).glob(f"{version}.*/bin/python"))
    require(bool(pythons), f"no CPython {version} here (pyenv)")
    return str(pythons[-1])


@pytest.mark.timeout(PY314_BUILD_S + 300)  # 3.14 may wait for its env's background build
@pytest.mark.parametrize("version", pyframes.SUPPORTED)
def test_the_guest_loads_in_every_cpython_with_the_standard_library_only(version) -> None:
    code = f"GUEST_DIR = {str(GUEST_DIR)!r}\n" + LOAD_AND_LOOK
    out = subprocess.run(
        [_python(version), "-I", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["path_same"] and got["foreign"] == [], got
    assert got["python"].startswith(version) and got["frames"] >= 1
    assert got["expr"] == {"a": [1, 2], "b": ["x", None]}


@pytest.fixture
def guest(runtime_dir) -> GuestProcess:  # type: ignore[no-untyped-def]
    """This process's guest serving on its socket, asked as the engine asks."""
    from probing.guest.life import Guest

    served = Guest(sys.executable)
    served.serve()
    yield GuestProcess(os.getpid(), place.guest_path(os.getpid(), served.directory))
    served.stop()


def test_the_guest_answers_what_only_the_process_knows(guest: GuestProcess) -> None:
    about = guest.info()
    assert about["pid"] == os.getpid() and about["python"] == sys.version.split()[0]
    assert any(t["main"] for t in about["threads"])
    assert guest.eval("6 * 7") == {"result": "42", "output": ""}
    assert guest.eval("print('hi')")["output"] == "hi\n"
    assert guest.expr("[{'a': 1}, {'a': 2}]") == {"a": [1, 2]}
    assert any(r["func"] == "test_the_guest_answers_what_only_the_process_knows"
               for r in guest.stacks(0.01))  # fmt: skip


def test_errors_cross_the_socket_as_their_own_kind(guest: GuestProcess) -> None:
    with pytest.raises(EvalError) as err:
        guest.eval("1 / 0")
    assert "ZeroDivisionError" in str(err.value) and "Traceback" in err.value.detail
    with pytest.raises(QueryError, match="NameError"):
        guest.expr("no_such_name_here")


def test_external_table_rows_wait_in_the_guest_until_taken(guest: GuestProcess) -> None:
    t = outbox.Table("guest_steps", [("step", "int64"), ("loss", "double")])
    t.append([1, 0.5])
    t.append({"step": 2, "loss": 0.25})
    assert len(t) == 2
    taken = guest.external()["guest_steps"]
    assert taken["columns"] == ["step", "loss"] and taken["types"] == ["int64", "double"]
    assert taken["rows"] == [[1, 0.5], [2, 0.25]]
    assert guest.external()["guest_steps"]["rows"] == []  # taken once
    with pytest.raises(ValueError, match="already exists"):
        outbox.Table("guest_steps", ["other"])


def test_only_the_users_own_uid_is_answered(guest: GuestProcess) -> None:
    mode = os.stat(guest.socket).st_mode & 0o777
    assert mode == 0o600 and (os.stat(os.path.dirname(guest.socket)).st_mode & 0o777) == 0o700


def test_the_engine_is_named_by_the_settings_a_job_shares() -> None:
    ranks = [{"PROBING_TOKEN": "t", "PROBING_RANK": str(r), "RANK": str(r)} for r in range(4)]
    assert len({place.engine_key(e) for e in ranks}) == 1
    assert place.engine_key({"PROBING_STORE_BYTES": "1"}) != place.engine_key({})
    passed = {"PROBING_ENGINE_ENV": "LD_LIBRARY_PATH", "LD_LIBRARY_PATH": "/x", "HOME": "/h"}
    assert place.engine_settings(passed) == {k: passed[k] for k in passed if k != "HOME"}


def test_a_free_threaded_cpython_gets_one_line_and_no_probe(monkeypatch, capsys) -> None:
    """3.14t: refused before the guest serves (its frames are not the table's);
    ``PROBING=1`` says so in one line and the job goes on."""
    ns: dict = {"__name__": "_probing_hook"}  # type: ignore[type-arg]
    hook = GUEST_DIR / "hook.py"
    exec(compile(hook.read_text(), str(hook), "exec"), ns)
    monkeypatch.setattr(sys, "abiflags", "t", raising=False)
    monkeypatch.setenv("PROBING", "1")
    try:
        ns["boot"](str(GUEST_DIR), sys.executable)
    finally:  # the guest loaded under its private name, in this process: gone again
        for name in [n for n in sys.modules if n.split(".")[0] == "_probing_guest"]:
            del sys.modules[name]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "free-threaded CPython (3." in err, err
    assert "not supported yet" in err
    from probing.guest import life

    assert life.current() is None


ONE_WAY_JOB = """
import json, os, sys
import probing
probing.enable()
steps = probing.ExternalTable("one_way_steps", ["step", "loss"])
steps.append_many([[1, 0.5], [2, 0.25]])
print(json.dumps(probing.query("SELECT pid FROM process.info")))
print(json.dumps(probing.query("SELECT step, loss FROM python.one_way_steps ORDER BY step")))
print(json.dumps(probing.query("SELECT 1 AS one")))
try:
    probing.query("SELECT * FROM nowhere.nothing")
except probing.QueryError as err:
    print(json.dumps({"error": type(err).__name__}))
print(json.dumps({m: m in sys.modules for m in ("pyarrow", "datafusion", "numpy")}))
guest = sys.modules["_probing_guest"].current().server.path
probing.disable()
print(json.dumps({"guest_socket_left": os.path.exists(guest)}))
probing.enable()  # handed to the engine again: what it recorded is still there
print(json.dumps(probing.query("SELECT sum(step) AS s FROM python.one_way_steps")))
probing.disable()
"""


def test_a_job_that_enables_and_queries_loads_neither_pyarrow_nor_datafusion(
    runtime_dir,
) -> None:
    """``probing.enable()`` starts the guest and hands the process to the
    node's engine; ``probing.query`` asks the engine through it and gets
    plain rows; ``ExternalTable`` rows reach the engine from the guest;
    ``disable`` stops the guest and the engine keeps what it recorded."""
    env = {**os.environ, "PROBING_RUNTIME_DIR": str(runtime_dir)}
    env.pop("PROBING", None)
    out = subprocess.run(
        [sys.executable, "-c", ONE_WAY_JOB], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(lines) == 7, out.stdout
    (info,) = lines[0]
    assert set(info) == {"pid"} and info["pid"] > 0
    assert lines[1] == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]
    assert lines[2] == [{"one": 1}]
    assert lines[3] == {"error": "QueryError"}
    assert lines[4] == {"pyarrow": False, "datafusion": False, "numpy": False}
    assert lines[5] == {"guest_socket_left": False}
    assert lines[6] == [{"s": 3}]
