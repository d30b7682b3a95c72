from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from probing.guest import place

REPO = Path(__file__).resolve().parent.parent
# how much slower than this host the tests run (make vm-test sets 10 in a
# TCG-emulated guest): every wait on a process's start or answer stretches by it
SLOWDOWN = float(os.environ.get("PROBING_TEST_SLOWDOWN", "1"))


FIXTURES = REPO / "tests" / "fixtures"


def build_lib(src: str, out: Path, *flags: str) -> str:
    """A stand-in library built from ``tests/fixtures/<src>`` (make setup installs cc)."""
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-O1", "-Wall", "-o", str(out), str(FIXTURES / src), *flags],
        check=True,
    )
    return str(out)


def a_read_that_writes_another(store: Any) -> None:
    """``demo.rows``, whose every read first adds a row to ``demo.names``
    (marked referenced; id 0 there from the start) and then one to itself
    that refers to it: as the sampler's read before python.samples adds its
    samples' stacks to python.stacks. Joined on ``id``, every row's
    ``name`` is ``f<id>``."""
    names = store.table("demo", "names")  # made first: the store's first
    names.referenced = True
    names.append_batch({"id": [0], "name": ["f0"]})
    rows = store.table("demo", "rows")
    taken = iter(range(1, 1000))

    def read() -> None:  # a stack first, then the rows that use it
        i = next(taken)
        names.append_batch({"id": [i], "name": [f"f{i}"]})
        rows.append_batch({"id": [i]})

    rows.add_before_read(read)


def require(condition: bool, reason: str) -> None:
    """Skip with ``reason`` unless PROBING_REQUIRE_PRIVILEGED=1 makes it a failure."""
    if condition:
        return
    if os.environ.get("PROBING_REQUIRE_PRIVILEGED") == "1":
        pytest.fail(f"required capability missing: {reason}")
    pytest.skip(reason)


def require_bpf() -> None:
    """Root, BCC, kernel headers and tracefs, or skip (fail in CI) naming the fix."""
    from probing.cli import doctor

    require(os.geteuid() == 0, "needs root (CAP_BPF, CAP_PERFMON)")
    for check in (doctor.check_bcc(), doctor.check_headers(), doctor.check_tracefs()):
        require(check.ok, f"{check.name}: {check.detail}; fix: {check.fix}")


# CPython 3.14: Debian unstable's, in a chroot (.ci/py314.sh, made by .ci/jobenvs.sh,
# or built in the background by .ci/run while the suite runs)
PY314_ENV = Path(os.environ.get("PROBING_JOB_ENVS", REPO / ".venv-jobs")) / "py314"
PY314_BUILD_S = 1800  # the longest a background build is waited for (~4-6 min cold here)


def _building(marker: Path) -> bool:
    """Whether the background build ``marker`` names (its pid) still runs."""
    try:
        os.kill(int(marker.read_text().split()[0]), 0)
    except (OSError, ValueError, IndexError):
        return False
    return True


def py314_python() -> str:
    """The CPython 3.14 job env's python, once ready: root only (its chroot);
    a background build (.ci/run) is waited for, its failure shown."""
    require(os.geteuid() == 0, "CPython 3.14 runs in a chroot (.ci/py314.sh): needs root")
    ready, marker = PY314_ENV / ".ready", PY314_ENV.with_name("py314.building")
    deadline = time.monotonic() + PY314_BUILD_S
    while not ready.exists() and _building(marker) and time.monotonic() < deadline:
        time.sleep(1)
    log = PY314_ENV.with_name("py314.log")
    if not ready.exists() and marker.exists() and log.exists():
        pytest.fail(f"the CPython 3.14 env's background build did not finish: "
                    f"{log.read_text()[-1500:]}")  # fmt: skip
    require(ready.exists(), f"no CPython 3.14 job env at {PY314_ENV}: run .ci/jobenvs.sh as root")
    return str(PY314_ENV / "bin" / "python")


# the engines the tests start keep a dead process's probe 30 s, not 10 min,
# and go 5 s after their last process (each test's runtime dir has its own)
os.environ.setdefault("PROBING_KEEP_DEAD_S", "30")
os.environ.setdefault("PROBING_ENGINE_IDLE_S", "5")


def live_engines(runtime_dir: Path) -> list[int]:
    """The pids of the engines serving ``runtime_dir`` now (from their locks)."""
    pids = []
    for lock in (runtime_dir / f"probing-{os.getuid()}").glob("engine-*.lock"):
        try:
            pid = int(lock.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if place.is_engine(pid):
            pids.append(pid)
    return pids


def stop_engine(runtime_dir: Path) -> None:
    """Stop the engines serving ``runtime_dir``."""
    for pid in live_engines(runtime_dir):
        os.kill(pid, signal.SIGTERM)


@pytest.fixture
def runtime_dir(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """An isolated PROBING_RUNTIME_DIR for the probe sockets of one test (and
    the engine that serves them, stopped after the test)."""
    d = tmp_path_factory.mktemp("rt")
    monkeypatch.setenv("PROBING_RUNTIME_DIR", str(d))
    yield d
    stop_engine(d)


class Target:
    """A Python process started by a test, with its probe's socket path."""

    def __init__(self, proc: subprocess.Popen[str], runtime_dir: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.runtime_dir = runtime_dir

    def socket(self) -> Path:
        return self.runtime_dir / f"probing-{os.getuid()}" / f"{self.pid}.sock"

    def wait_for_probe(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout * SLOWDOWN
        while time.monotonic() < deadline:
            if self.socket().exists():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"target exited early: {self.proc.communicate()}")
            time.sleep(0.02)
        raise AssertionError("probe socket never appeared")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=10)


@pytest.fixture
def spawn(runtime_dir: Path) -> Iterator:
    """spawn(code, env=..., args=...) starts ``python -c code`` and returns a Target."""
    started: list[Target] = []

    def _spawn(
        code: str,
        *,
        probing: bool = True,
        env: dict[str, str] | None = None,
        argv: list[str] | None = None,
        wait: bool = True,
        cwd: str | Path | None = None,
    ) -> Target:
        full_env = {**os.environ, "PROBING_RUNTIME_DIR": str(runtime_dir), **(env or {})}
        full_env.pop("PROBING", None)
        if probing:
            full_env["PROBING"] = "1"
        cmd = argv or [sys.executable, "-c", textwrap.dedent(code)]
        proc = subprocess.Popen(
            cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
        )
        target = Target(proc, runtime_dir)
        started.append(target)
        if probing and wait:
            target.wait_for_probe()
        return target

    yield _spawn
    for t in started:
        t.stop()


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the ``probing`` command as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "probing", *args],
        env=dict(os.environ, **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout * SLOWDOWN,
    )


IDLE_LOOP = """
import threading, time
def work():
    while True:
        time.sleep(0.05)
for name in ("loader-0", "loader-1"):
    threading.Thread(target=work, name=name, daemon=True).start()
while True:
    time.sleep(0.05)
"""
