"""The node's engine as a service: killed under a traced 4-rank job, a new
one starts by itself (the guests notice), answers the next query, traces
what was traced and watches the job again; a client or guest of another
install is refused; a new engine removes what a killed one left."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from probing.cli.client import ProbeClient
from probing.errors import ProbingError
from tests.conftest import SLOWDOWN, cli, require_bpf
from tests.privileged.test_cluster_trace import JOB, TOKEN, WORLD, _job, _traced_ranks

pytestmark = pytest.mark.privileged


def _engine_pid(runtime_dir: Path) -> int:
    [lock] = (runtime_dir / f"probing-{os.getuid()}").glob("engine-*.lock")
    return int(lock.read_text().split()[0])


def _detections(pid: int) -> int:
    status, _, body = ProbeClient.for_pid(pid).transport.request("GET", "/metrics")
    assert status == 200, body
    found = re.search(rb"^probing_detections_total (\d+)", body, re.M)
    assert found is not None, body
    return int(found.group(1))


def _sealed(pid: int) -> int:
    """Rows of ``pid``'s gloo.calls sealed in chunk files."""
    r = cli("query", "--pid", str(pid), "--format", "json",
            "SELECT rows - pending_rows AS n FROM probing.tables "
            "WHERE schema = 'gloo' AND \"table\" = 'calls'")  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    return int(got[0]["n"] or 0) if got else 0


def _calls(pid: int) -> int:
    r = cli("query", "--pid", str(pid), "--format", "json", "SELECT count(*) AS n FROM gloo.calls")
    assert r.returncode == 0, r.stderr
    return int(json.loads(r.stdout)[0]["n"])


def _until(what, timeout: float):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout * SLOWDOWN
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_a_killed_engine_comes_back_tracing_and_watching(spawn, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    require_bpf()
    pids = _job(spawn, JOB)
    r = cli("trace", "--pid", str(pids[0]), "--cluster", "--background", "--no-nccl",
            "--no-cuda", timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert _until(lambda: min(_traced_ranks(pids[0]).values() or [0]) > 0, 30)
    assert _until(lambda: _detections(pids[0]) > 0, 30), "the watch never detected"
    sealed = _until(lambda: _sealed(pids[0]), 30)  # rows in chunk files (/dev/shm)
    assert sealed, "nothing sealed"
    old = _engine_pid(runtime_dir)
    os.kill(old, signal.SIGKILL)
    t0 = time.monotonic()
    r = cli("query", "--pid", str(pids[0]), "SELECT pid FROM process.info", timeout=60)
    answered_s = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert str(pids[0]) in r.stdout
    assert answered_s < 10 * SLOWDOWN, answered_s  # ~1 s here: a new engine, no command typed
    new = _engine_pid(runtime_dir)
    assert new != old
    kept = _calls(pids[0])  # what the killed engine had sealed, taken over
    assert kept >= sealed, (kept, sealed)
    # what was traced goes on being traced, by every rank, and the job is watched again
    tracing = _until(
        lambda: all(ProbeClient.for_pid(p).trace_status()["state"] == "tracing" for p in pids),
        60,
    )
    assert tracing, [ProbeClient.for_pid(p).trace_status() for p in pids]
    first = _traced_ranks(pids[0])
    assert sorted(first) == list(range(WORLD)), first
    grown = _until(lambda: all(n > first[r] for r, n in _traced_ranks(pids[0]).items()), 30)
    assert grown, (first, _traced_ranks(pids[0]))
    assert _until(lambda: _detections(pids[0]) > 0, 30), "the watch did not resume"


def test_a_client_of_another_install_is_refused(spawn) -> None:  # type: ignore[no-untyped-def]
    target = spawn("import time\nwhile True: time.sleep(0.1)\n")
    r = cli("query", "--pid", str(target.pid), "SELECT 1",
            env={"PROBING_VERSION_OVERRIDE": "99.0"})  # fmt: skip
    assert r.returncode != 0
    assert "is served by probing 0.1.0@" in r.stderr and "this command is probing 99.0@" in r.stderr
    assert cli("query", "--pid", str(target.pid), "SELECT 1").returncode == 0


def test_a_guest_of_another_install_is_never_served(spawn, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """A guest stating another version gets an engine of its own (its key
    differs); sent to this engine's socket anyway, it is refused."""
    from probing.guest import place, wire

    ours = spawn("import time\nwhile True: time.sleep(0.1)\n")
    theirs = spawn(
        "import time\nwhile True: time.sleep(0.1)\n", env={"PROBING_VERSION_OVERRIDE": "99.0"}
    )
    directory = str(runtime_dir / f"probing-{os.getuid()}")
    engine = ProbeClient.for_pid(ours.pid).health()["engine_pid"]
    with pytest.raises(ProbingError, match="is served by probing 99.0@"):
        ProbeClient.for_pid(theirs.pid).health()  # its own engine, refusing this install
    locks = _until(lambda: sorted(Path(directory).glob("engine-*.lock"))[1:], 20)
    assert locks, "one engine for both installs"
    [lock] = [p for p in Path(directory).glob("engine-*.lock") if int(p.read_text()) == engine]
    sock = str(lock.with_suffix(".sock"))
    payload = {"pid": theirs.pid, "guest": place.guest_path(theirs.pid, directory),
               "install": f"99.0@{os.path.dirname(place.__file__)}"}  # fmt: skip
    with pytest.raises(wire.WireError, match="this engine serves probing 0.1.0@"):
        wire.request(sock, "POST", "/attach", payload, timeout=10)


def test_a_new_engine_removes_what_a_killed_one_left(spawn, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    directory = runtime_dir / f"probing-{os.getuid()}"
    live = spawn("import time\nwhile True: time.sleep(0.1)\n")
    gone = spawn("import time\nwhile True: time.sleep(0.1)\n")
    engine = _engine_pid(runtime_dir)
    binding = directory / f"{engine}.bind-7"  # killed while it bound a process's socket
    binding.write_bytes(b"")
    os.kill(engine, signal.SIGKILL)
    gone.proc.kill()
    gone.proc.wait()
    assert (directory / f"{gone.pid}.guest").exists()  # killed with its engine: left behind
    # the live process's guest starts a new engine, which cleans up
    assert _until(lambda: not (directory / f"{gone.pid}.guest").exists(), 20)
    assert not (directory / f"{gone.pid}.sock").exists() and not binding.exists()
    assert (directory / f"{live.pid}.guest").exists()
    try:
        assert ProbeClient.for_pid(live.pid).health()["pid"] == live.pid
    except ProbingError as err:  # the assertion says what went wrong
        raise AssertionError(err) from err


def _soak(*args: str) -> dict[str, Any]:
    """``benchmarks/engine_soak.py`` with ``args``: its JSON."""
    import subprocess
    import sys

    from tests.conftest import REPO

    require_bpf()
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "engine_soak.py"), "--keep-dead-s", "1", *args],
        capture_output=True, text=True, timeout=600 * SLOWDOWN,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got: dict[str, Any] = json.loads(r.stdout)
    return got


def test_an_engine_that_served_20_jobs_holds_what_it_held_after_the_first() -> None:
    """20 short 4-rank jobs (probed, traced, asked a cluster query, stopped)
    through one engine (``benchmarks/engine_soak.py``): once they are
    retired, its threads, descriptors, ports and files are what they were
    once the first job was, and its memory came back."""
    got = _soak("--jobs", "20", "--kind", "plain", "--every", "5")
    first, last = got["after_first_job_retired"], got["after_all_retired"]
    assert last["threads"] == first["threads"], got["rows"]
    assert abs(last["fds"] - first["fds"]) <= 2, got["rows"]
    assert last["tcp_listening"] == first["tcp_listening"] <= 1, got["rows"]  # the engine's
    assert last["files"] == first["files"], got["rows"]
    assert last["rss_mb"] - first["rss_mb"] < 50, got["rows"]


def test_an_engine_that_served_torch_jobs_that_seal_holds_what_it_held_after_the_first() -> None:
    """Three 4-rank torch DDP jobs, each traced until the engine sealed a
    chunk of its calls (the sealer thread ran), then stopped: once they are
    retired, the engine's threads and descriptors are the first job's."""
    got = _soak("--jobs", "3", "--kind", "torch", "--every", "1")
    assert got["jobs_sealed"] == 3, got["rows"]
    first, last = got["after_first_job_retired"], got["after_all_retired"]
    assert last["threads"] == first["threads"], got["rows"]
    assert abs(last["fds"] - first["fds"]) <= 2, got["rows"]


def test_one_peer_port_per_engine_and_none_per_exited_process(spawn, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """Every rank an engine serves is reached through the engine's one TCP
    port; once the job exited, that port alone still answers for it."""
    import psutil

    pids = _job(spawn, JOB)
    r = cli("query", "--pid", str(pids[0]), "--cluster", "--format", "json",
            "SELECT rank, addr FROM probing.peers ORDER BY rank", timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    engine = psutil.Process(_engine_pid(runtime_dir))

    def listening() -> list[str]:
        return sorted({f"{c.laddr.ip}:{c.laddr.port}" for c in engine.net_connections("tcp")
                       if c.status == psutil.CONN_LISTEN})  # fmt: skip

    [port] = listening()
    got = _until(lambda: _cluster_ranks(pids[1]) == list(range(WORLD)), 30)
    assert got, _cluster_ranks(pids[1])
    peers = json.loads(cli("query", "--pid", str(pids[2]), "--format", "json",
                           "SELECT rank, addr FROM probing.peers").stdout)  # fmt: skip
    assert {p["addr"] for p in peers} == {port}, peers  # every rank: one address
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert _until(lambda: all(_exited(p) for p in pids), 20)
    assert listening() == [port]  # none opened, none left, per process
    r = cli("query", "--addr", port, "--format", "json", "SELECT pid FROM process.info",
            env={"PROBING_TOKEN": TOKEN})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["pid"] in pids  # an exited rank's data, through the port


def _exited(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # the test reaps it later
    except psutil.NoSuchProcess:
        return True


def _cluster_ranks(pid: int) -> list[int]:
    r = cli("query", "--pid", str(pid), "--cluster", "--format", "json",
            "SELECT rank FROM process.info ORDER BY rank")  # fmt: skip
    return [row["rank"] for row in json.loads(r.stdout)] if r.returncode == 0 else []


def test_a_stopped_engine_leaves_its_data_and_tracing_to_the_next(spawn, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """``probing engine stop``: the engine seals what it holds and leaves it,
    and what it traced, to the next engine of those processes (an upgrade's
    path), which answers with it and traces on."""
    require_bpf()
    pids = _job(spawn, JOB)
    r = cli("trace", "--pid", str(pids[0]), "--cluster", "--background", "--no-nccl",
            "--no-cuda", timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    sealed = _until(lambda: _sealed(pids[0]), 30)
    assert sealed, "nothing sealed"
    old = _engine_pid(runtime_dir)
    r = cli("engine", "stop", timeout=60)
    assert r.returncode == 0, r.stderr
    assert _until(lambda: not _alive(old), 30)
    r = cli("inject", "--pid", str(pids[0]), timeout=60)  # the next probe starts an engine
    assert r.returncode == 0, r.stdout + r.stderr
    assert _engine_pid(runtime_dir) != old
    assert _calls(pids[0]) >= sealed  # the stopped engine's rows, taken over
    tracing = _until(lambda: ProbeClient.for_pid(pids[0]).trace_status()["state"] == "tracing", 30)
    assert tracing, ProbeClient.for_pid(pids[0]).trace_status()


def _alive(pid: int) -> bool:
    from probing.node.store.store import pid_alive

    return pid_alive(pid)


def test_an_engine_is_never_probed_itself(spawn, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """An engine given to ``inject`` (or handed to itself) is refused: it
    would serve itself and never go idle."""
    from probing.guest import place, wire

    target = spawn("import time\nwhile True: time.sleep(0.1)\n")
    engine = ProbeClient.for_pid(target.pid).health()["engine_pid"]
    r = cli("inject", "--pid", str(engine))
    assert r.returncode != 0
    assert f"process {engine} is probing's own engine" in r.stderr, r.stderr
    [lock] = (runtime_dir / f"probing-{os.getuid()}").glob("engine-*.lock")
    payload = {"pid": engine, "guest": "/nonexistent", "install": place.install()}
    with pytest.raises(wire.WireError, match="is an engine of probing"):
        wire.request(str(lock.with_suffix(".sock")), "POST", "/attach", payload, timeout=10)
