"""Tracing on: compile once per node, then load from the cache; attach only
to what the process has mapped. Root-only; PROBING_REQUIRE_PRIVILEGED=1
(CI) turns skips into failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from probing.cli.client import ProbeClient
from probing.node.bpf import loader
from probing.node.bpf.kernel import uprobe_links
from probing.node.bpf.tracer import Tracer
from probing.node.store import Store
from tests.conftest import REPO
from tests.privileged.helpers import installed_lib, require_privileged, wait_line

pytestmark = pytest.mark.privileged

FLAGS = ["-DRINGBUF_PAGES=1024", "-Wno-unused-function"]
OBTAIN = """
import json, sys
from probing.node.bpf import loader
compiled, cached = loader.obtain("gloo.bpf.c", "gloo.h", json.loads(sys.argv[1]))
print(json.dumps({"cached": cached, "key": compiled.key}))
"""


def test_ranks_starting_together_compile_once(tmp_path: Path) -> None:
    """Four processes ask for the same program at once with an empty cache:
    one compiles, the others wait on the lock and read its result."""
    require_privileged()
    env = dict(os.environ, **{loader.ENV_CACHE: str(tmp_path / "cache")})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OBTAIN, json.dumps(FLAGS)],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(4)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["cached"] for r in results) == [False, True, True, True]
    assert len({r["key"] for r in results}) == 1
    files = list((tmp_path / "cache").glob("gloo-*.json"))
    assert len(files) == 1 and files[0].stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700


def test_a_cache_others_could_write_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytecode loaded as root comes only from a file only we can write."""
    require_privileged()
    monkeypatch.setenv(loader.ENV_CACHE, str(tmp_path / "cache"))
    first, cached = loader.obtain("gloo.bpf.c", "gloo.h", FLAGS)
    again, cached_again = loader.obtain("gloo.bpf.c", "gloo.h", FLAGS)
    assert (cached, cached_again) == (False, True) and again == first
    (path,) = (tmp_path / "cache").glob("gloo-*.json")
    path.chmod(0o666)
    _, cached = loader.obtain("gloo.bpf.c", "gloo.h", FLAGS)
    assert not cached  # compiled anew, and the file replaced by a private one
    assert path.stat().st_mode & 0o022 == 0
    other = ["-DRINGBUF_PAGES=2048", "-Wno-unused-function"]
    _, cached = loader.obtain("gloo.bpf.c", "gloo.h", other)
    assert not cached  # other flags, other bytecode


def test_a_second_trace_loads_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_privileged()
    monkeypatch.setenv(loader.ENV_CACHE, str(tmp_path / "cache"))
    store = Store()
    try:
        infos = []
        for _ in range(2):
            tracer = Tracer(["cuda", "nccl"], store=store)
            tracer.start()
            infos.append(tracer.load_info)
            tracer.stop()
        assert infos[0]["cached"] == {"cuda": False, "nccl": False}
        assert infos[1]["cached"] == {"cuda": True, "nccl": True}
        assert infos[1]["load_s"] < infos[0]["load_s"]
    finally:
        store.close()


WARM = """
import json, sys
from probing.node.bpf.tracer import Tracer
from probing.node.store import Store
tracer = Tracer(["cuda", "nccl", "gloo"], store=Store())
tracer.start()
sampling = tracer.sampler is not None
tracer.stop()
cached = tracer.status()["load"]["cached"]
print(json.dumps({"cached": cached, "bcc": "bcc" in sys.modules, "sampling": sampling}))
"""


def test_a_warm_cache_runs_no_bcc(tmp_path: Path) -> None:
    """Every program a trace loads (the families and the sampler) comes from
    the node's cache once one process compiled it: the next never imports BCC."""
    require_privileged()
    env = dict(os.environ, **{loader.ENV_CACHE: str(tmp_path / "cache")})
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", WARM], env=env, cwd=REPO, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["bcc"] and not any(runs[0]["cached"].values())
    assert runs[1] == {"cached": {"cuda": True, "nccl": True, "gloo": True}, "bcc": False,
                       "sampling": True}  # fmt: skip
    assert {p.name.split("-")[0] for p in (tmp_path / "cache").glob("*.json")} == {
        "cuda", "nccl", "gloo", "sampler"}  # fmt: skip


def test_only_mapped_libraries_are_attached(spawn) -> None:
    """libnccl is installed beside libcudart, but this process never loads it."""
    require_privileged()
    code = (
        "import ctypes, sys, time\n"
        f"ctypes.CDLL({installed_lib('libcudart')!r})\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    t = spawn("", argv=[sys.executable, "-c", code])
    wait_line(t, "ready")
    status = ProbeClient.for_pid(t.pid).trace_start(["cuda", "nccl"])
    assert status["families"]["cuda"]["libraries"] == [installed_lib("libcudart")]
    assert status["families"]["nccl"]["libraries"] == []
    assert status["families"]["nccl"]["uprobes"] == 0
    paths = {link.path for link in uprobe_links() if link.pid == t.pid}
    if loader.has_uprobe_multi():
        assert paths == {os.path.realpath(installed_lib("libcudart"))}
    ProbeClient.for_pid(t.pid).trace_stop()
    deadline = time.monotonic() + 60  # the helper holding the links lets go after the stop
    while [link for link in uprobe_links() if link.pid == t.pid]:
        assert time.monotonic() < deadline, "links left after the stop"
        time.sleep(0.1)
