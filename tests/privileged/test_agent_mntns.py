"""``probing agent`` in a mount namespace of its own, as the DaemonSet's
container runs it: probing's package and injection library at a path the
job cannot see (a tmpfs over an empty directory, mounted in the agent's
namespace only), the runtime directory shared (the pod's ``/tmp``). Every
rank of a 4-rank Gloo job is attached and traced all the same: it loads the
library and the guest from the one stage in its runtime directory
(``probing.inject.stage``), never from the agent's paths; the engine that
serves it runs in the agent's namespace (started there by the agent, never
by the job); the job imports nothing it did not; the slowed rank becomes a
finding in the agent's ``/metrics``. The image itself (``make image``, run
under podman) is docs/deploy.md's check: it takes minutes to build."""

from __future__ import annotations

import os
import shutil
import stat
import time
import urllib.request
from pathlib import Path

import pytest

from probing.cli.client import ProbeClient
from tests.conftest import REPO, SLOWDOWN, live_engines, require, require_bpf
from tests.privileged.test_agent import SLOW, active_findings, wait_traced, watched_job

pytestmark = pytest.mark.privileged
FINDING_S = 60.0  # from every rank traced to the slowed rank a finding

# run by unshare -m: the install hidden from every other namespace, then the agent
HIDE_INSTALL = """set -e
mount -t tmpfs probing-test "$HIDDEN"
mkdir "$HIDDEN/src"
mount --bind "$SRC" "$HIDDEN/src"
cd "$HIDDEN/src"
export PYTHONPATH="$HIDDEN/src"
exec "$@"
"""


def _mnt(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/mnt")


def _loaded(pid: int) -> set[str]:
    """The injection libraries ``pid`` maps, by the path it maps them at."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1] for line in lines if "libprobing_boot" in line}


def _finding(url: str) -> str:
    """The agent's /metrics once the slowed rank is an active straggler finding."""
    deadline = time.monotonic() + FINDING_S * SLOWDOWN
    while True:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
        if ("straggler", str(SLOW)) in active_findings(text):
            return text
        assert time.monotonic() < deadline, text
        time.sleep(0.5)


def test_an_agent_in_another_mount_namespace_attaches_through_a_stage(  # type: ignore[no-untyped-def]
    runtime_dir, tmp_path
) -> None:
    require_bpf()
    require(shutil.which("unshare") is not None, "unshare (util-linux)")
    hidden = tmp_path / "install"
    hidden.mkdir()
    script = tmp_path / "hide.sh"
    script.write_text(HIDE_INSTALL)
    wrap = ("env", f"HIDDEN={hidden}", f"SRC={REPO}",
            "unshare", "-m", "--propagation", "private", "bash", str(script))  # fmt: skip
    with watched_job(runtime_dir, wrap=wrap) as w:
        agent, ranks = w.procs[0], w.ranks
        print(f"every rank traced {wait_traced(ranks):.1f} s after the job started")
        assert _mnt(agent.pid) != _mnt(ranks[0].pid)
        assert os.listdir(hidden) == []  # the agent's install: not there for the job (nor us)
        # one stage for the whole job, root's and read-only to others, in its runtime dir
        [staged] = runtime_dir.glob("probing-stage-*")
        st = staged.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755), st
        [lib] = staged.glob("libprobing_boot-*.so")
        assert sorted(p.name for p in (staged / "guest").iterdir()) == sorted(
            p.name for p in (REPO / "probing" / "guest").glob("*.py")
        )
        for rank in ranks:
            assert _loaded(rank.pid) == {str(lib)}, (rank.pid, _loaded(rank.pid))
        # the engine was started in the agent's namespace, by the agent
        engines = live_engines(runtime_dir)
        assert engines and {_mnt(e) for e in engines} == {_mnt(agent.pid)}, engines
        # the job imports what it imported before: the guest under its private name only
        said = ProbeClient.for_pid(ranks[0].pid).eval(
            "[m for m in __import__('sys').modules if m.split('.')[0] == 'probing']"
            f" + [p for p in __import__('sys').path if p.startswith(({str(staged)!r}, "
            f"{str(hidden)!r}))]"
        )
        assert said["result"] == "[]", said
        text = _finding(w.url)
        assert "probing_agent_attached 4" in text, text
