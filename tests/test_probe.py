"""The probe inside real processes, driven through the CLI and raw HTTP."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from probing.cli.client import ProbeClient
from probing.errors import NoProbe, NoSuchProcess, QueryError
from tests.conftest import IDLE_LOOP, cli


def raw_http(path: str, request: bytes) -> bytes:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    s.sendall(request)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    return out


def post_sql(path: str, sql: str) -> tuple[int, dict]:
    body = json.dumps({"sql": sql, "format": "json"}).encode()
    resp = raw_http(
        path, b"POST /query HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    head, _, payload = resp.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def test_probing_env_starts_a_probe_that_answers_sql(spawn) -> None:
    t = spawn(IDLE_LOOP)
    r = cli("query", "--pid", str(t.pid), "SELECT count(*) AS n FROM process.threads", "-f", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)  # one JSON array on stdout, nothing else
    assert rows[0]["n"] >= 3  # main, two loaders (and the probe's own)
    r = cli("query", "--pid", str(t.pid), "SELECT name FROM process.threads ORDER BY name")
    assert "loader-0" in r.stdout and "loader-1" in r.stdout and "MainThread" in r.stdout
    assert all(len(line) <= 80 for line in r.stdout.splitlines())


def test_bad_query_is_reported_and_the_next_one_works(spawn) -> None:
    t = spawn(IDLE_LOOP)
    bad = cli("query", "--pid", str(t.pid), "SELECT * FROM process.nonexistent")
    assert bad.returncode == 1 and bad.stdout == ""
    assert "no table process.nonexistent" in bad.stderr
    good = cli("query", "--pid", str(t.pid), "SELECT pid FROM process.info", "-f", "csv")
    assert good.returncode == 0 and good.stdout.split() == ['"pid"', str(t.pid)]


def test_ddl_and_dml_over_http_are_refused(spawn) -> None:
    t = spawn(IDLE_LOOP)
    path = str(t.socket())
    for sql in (
        "CREATE TABLE x AS SELECT 1",
        "INSERT INTO probing.tables VALUES (1)",
        "CREATE VIEW v AS SELECT 1",
    ):
        status, err = post_sql(path, sql)
        assert status == 400 and err["type"] == "QueryError", (sql, err)
    status, rows = post_sql(
        path, "SELECT count(*) AS n FROM information_schema.tables WHERE table_name IN ('x', 'v')"
    )
    assert status == 200 and rows == [{"n": 0}]


def test_socket_is_private_to_the_user(spawn) -> None:
    t = spawn(IDLE_LOOP)
    mode = stat.S_IMODE(os.stat(t.socket()).st_mode)
    assert mode & 0o077 == 0
    assert stat.S_IMODE(os.stat(t.socket().parent).st_mode) == 0o700


def test_garbage_on_the_socket_does_not_hurt_the_probe(spawn) -> None:
    t = spawn(IDLE_LOOP)
    path = str(t.socket())
    raw_http(path, b"\x00\xffnot http at all\r\n\r\n")
    raw_http(path, b"GET /nope HTTP/1.0\r\n\r\n")
    resp = raw_http(path, b"POST /query HTTP/1.0\r\nContent-Length: 5\r\n\r\n{bad}")
    assert b" 400 " in resp.split(b"\r\n")[0]
    client = ProbeClient.for_pid(t.pid)
    assert client.health()["pid"] == t.pid
    assert t.proc.poll() is None


def test_client_errors_are_precise(spawn) -> None:
    t = spawn(IDLE_LOOP)
    with pytest.raises(QueryError, match="Division by zero|divide by zero|ZeroDivision"):
        ProbeClient.for_pid(t.pid).query("SELECT * FROM python.`1/0`")
    plain = spawn(IDLE_LOOP, probing=False)
    with pytest.raises(NoProbe, match="probing inject"):
        ProbeClient.for_pid(plain.pid)
    with pytest.raises(NoSuchProcess):
        ProbeClient.for_pid(2**22 + 12345)


def test_a_dead_process_answers_with_what_it_left_then_is_retired(spawn) -> None:
    """Killed, a process's probe still answers (its engine keeps it for
    PROBING_KEEP_DEAD_S), marked as dead; once retired, the message is clear."""
    t = spawn(IDLE_LOOP, env={"PROBING_KEEP_DEAD_S": "2"})
    t.proc.kill()
    t.proc.wait()
    r = cli("query", "--pid", str(t.pid), "--format", "csv", "SELECT pid, alive FROM process.info")
    assert r.returncode == 0 and f"{t.pid},false" in r.stdout, r.stderr
    deadline = time.monotonic() + 30
    while t.socket().exists():
        assert time.monotonic() < deadline, "the dead process's probe was never retired"
        time.sleep(0.1)
    r = cli("query", "--pid", str(t.pid), "SELECT 1")
    assert r.returncode == 1
    assert "exited" in r.stderr or "no process" in r.stderr


def test_python_m_probing_run(spawn, tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text("import sys, time\nARGS = sys.argv[1:]\nwhile True: time.sleep(0.05)\n")
    t = spawn(
        "",
        probing=False,
        argv=[sys.executable, "-m", "probing", "run", str(script), "--lr", "0.1"],
        wait=False,
    )
    t.wait_for_probe()
    rows = ProbeClient.for_pid(t.pid).query("SELECT * FROM python.`ARGS`").to_pylist()
    assert [r["value"] for r in rows] == ["--lr", "0.1"]


FORKING_JOB = """
import os, time
pid = os.fork()
if pid == 0:
    while True: time.sleep(0.05)
print(pid, flush=True)
while True: time.sleep(0.05)
"""


def test_probe_survives_fork_and_the_child_gets_its_own(spawn) -> None:
    t = spawn(FORKING_JOB, env={"PROBING_FORK": "child"})
    child = int(t.proc.stdout.readline())
    try:
        sock = t.socket().parent / f"{child}.sock"
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        child_info = ProbeClient.for_pid(child).query("SELECT pid, ppid FROM process.info")
        assert child_info.to_pylist() == [{"pid": child, "ppid": t.pid}]
        parent_info = ProbeClient.for_pid(t.pid).query("SELECT pid FROM process.info")
        assert parent_info.to_pylist() == [{"pid": t.pid}]
    finally:
        os.kill(child, 9)


def test_fork_without_child_probe(spawn) -> None:
    """The default: a forked child (a DataLoader worker) gets no second probe."""
    t = spawn(FORKING_JOB)
    child = int(t.proc.stdout.readline())
    try:
        time.sleep(0.5)
        assert not (t.socket().parent / f"{child}.sock").exists()
        assert ProbeClient.for_pid(t.pid).health()["pid"] == t.pid
    finally:
        os.kill(child, 9)


def test_probe_start_failure_never_breaks_the_host(spawn, tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    t = spawn("print('ran', flush=True)", env={"PROBING_RUNTIME_DIR": str(blocker)}, wait=False)
    out, err = t.proc.communicate(timeout=30)
    assert t.proc.returncode == 0 and out == "ran\n"
    assert "probing: probe not started" in err
    assert "Traceback" not in err  # an expected failure says one line; a bug, its traceback


def test_ps_lists_probes(spawn) -> None:
    t = spawn(IDLE_LOOP)
    plain = spawn(IDLE_LOOP, probing=False)
    r = cli("ps")
    assert r.returncode == 0
    processes, _, engines = r.stdout.partition("\n\nengines:\n")
    lines = {int(line.split()[0]): line.split() for line in processes.splitlines()[2:]}
    assert lines[t.pid][2] == "yes"
    assert lines[plain.pid][2] == "-"
    # the engine that serves t's probe: its pid, this install, one live process at least
    serving = ProbeClient.for_pid(t.pid).health()
    [row] = [line.split() for line in engines.splitlines()[2:] if line.split()[0] == str(
        serving["engine_pid"])]  # fmt: skip
    assert row[1] == serving["install"] and int(row[2]) >= 1, engines


def test_tables_command(spawn) -> None:
    code = """
    import probing, time
    t = probing.ExternalTable("steps", ["step", "ms"])
    for i in range(1000):
        t.append([i, i * 0.5])
    while True: time.sleep(0.05)
    """
    t = spawn(code)
    r = cli("tables", "--pid", str(t.pid))
    assert r.returncode == 0, r.stderr
    row = next(line.split() for line in r.stdout.splitlines() if line.startswith("python.steps"))
    assert row[1:3] == ["stored", "1000"]
    assert "process.threads" in r.stdout and "probing.tables" in r.stdout


def test_idle_probe_is_quiet(spawn) -> None:
    """An idle probe blocks in select(): its threads sleep, no CPU ticks."""
    t = spawn("import time\ntime.sleep(60)\n")
    time.sleep(0.3)

    def cpu_ticks() -> int:
        with open(f"/proc/{t.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    before = cpu_ticks()
    time.sleep(2)
    assert cpu_ticks() - before <= 1


def test_subprocess_without_env_has_no_probe(runtime_dir) -> None:
    """``PROBING=0``: importing probing starts no guest and loads none."""
    code = "import sys, probing; print('_probing_guest' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PROBING="0"),
    )
    assert out.stdout.strip() == "False", out.stderr
    assert not list(runtime_dir.glob("probing-*/*.guest"))


def test_request_threads_are_reused_then_leave(tmp_path, monkeypatch) -> None:
    """Back-to-back requests share one thread; it exits once idle for LINGER_S."""
    import threading

    from probing.node.probe import server as srv
    from probing.node.probe.connections import Workers
    from probing.node.probe.http import Request, Response

    monkeypatch.setattr(Workers, "LINGER_S", 0.3)
    seen: list[int] = []

    def app(req: Request) -> Response:
        seen.append(threading.get_ident())
        return Response.json({"ok": True})

    path = str(tmp_path / "s" / "probe.sock")
    server = srv.UnixHTTPServer(path, app)
    server.start()
    try:
        for _ in range(3):
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                assert s.makefile("rb").read().startswith(b"HTTP/1.0 200")
            time.sleep(0.05)  # the thread is back waiting before the next one
        assert len(seen) == 3 and len(set(seen)) == 1
        deadline = time.monotonic() + 5
        while any(t.ident == seen[0] for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the request thread never left"
            time.sleep(0.05)
    finally:
        server.stop()
