"""The node's engine as a service: killed under a traced 4-rank job, a new
one starts by itself (the guests notice), answers the next query, traces
what was traced and watches the job again; a client or guest of another
install is refused; a new engine removes what a killed one left."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from probing.cli.client import ProbeClient
from probing.errors import ProbingError
from tests.conftest import SLOWDOWN, cli, require_bpf
from tests.privileged.test_cluster_trace import JOB, WORLD, _job, _traced_ranks

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
    os.kill(_engine_pid(runtime_dir), signal.SIGKILL)
    gone.proc.kill()
    gone.proc.wait()
    assert (directory / f"{gone.pid}.guest").exists()  # killed with its engine: left behind
    # the live process's guest starts a new engine, which cleans up
    assert _until(lambda: not (directory / f"{gone.pid}.guest").exists(), 20)
    assert not (directory / f"{gone.pid}.sock").exists()
    assert (directory / f"{live.pid}.guest").exists()
    try:
        assert ProbeClient.for_pid(live.pid).health()["pid"] == live.pid
    except ProbingError as err:  # the assertion says what went wrong
        raise AssertionError(err) from err


def test_an_engine_that_served_20_jobs_holds_what_it_held_after_the_first() -> None:
    """20 short 4-rank jobs (probed, traced, asked a cluster query, stopped)
    through one engine (``benchmarks/engine_soak.py``): once they are
    retired, its threads, descriptors, ports and files are what they were
    once the first job was, and its memory came back."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    require_bpf()
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "engine_soak.py"), "--jobs", "20",
         "--kind", "plain", "--keep-dead-s", "1", "--every", "5"],
        capture_output=True, text=True, timeout=600 * SLOWDOWN,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    first, last = got["after_first_job_retired"], got["after_all_retired"]
    assert last["threads"] == first["threads"], got["rows"]
    assert abs(last["fds"] - first["fds"]) <= 2, got["rows"]
    assert last["tcp_listening"] == first["tcp_listening"] == 0, got["rows"]
    assert last["files"] == first["files"], got["rows"]
    assert last["rss_mb"] - first["rss_mb"] < 50, got["rows"]
