"""deploy/slurm under a real one-node Slurm (Debian's slurm-wlm and munge,
started here: munged with a key of its own, slurmctld and slurmd from a
generated slurm.conf, every file in the test's directory) with the recipe's
Prolog and Epilog: the Prolog starts the node's agent; a 4-task ``srun`` job
of a Gloo script, with no PROBING in its environment (its rank from
``SLURM_PROCID``), is attached, traced and watched; a rank slowed in it is
named in analyze.findings and the agent's /metrics; the Epilog leaves no
engine of the job behind, and the test leaves no daemon."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from probing.cli.client import ProbeClient
from probing.cli.demo import free_port
from probing.errors import ProbingError
from probing.guest import place
from tests.conftest import REPO, SLOWDOWN, require, require_bpf
from tests.privileged.helpers import env_python

pytestmark = pytest.mark.privileged
WORLD, SLOW = 4, 2
RECIPE = REPO / "deploy" / "slurm"
JOB = REPO / "tests" / "jobs" / "srun_job.py"
TOOLS = ("munged", "slurmctld", "slurmd", "srun", "sinfo", "scancel", "squeue")
NODE = socket.gethostname().split(".")[0]

CONF = """\
ClusterName=probingtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# 4 tasks on a 2-core machine: the node says it has the CPUs declared here
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=2
MailProg=/bin/true
Prolog={recipe}/prolog.sh
Epilog={recipe}/epilog.sh
PrologFlags=Alloc
NodeName={node} NodeAddr=127.0.0.1 CPUs={world} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _until(what: Callable[[], Any], timeout: float, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout * SLOWDOWN
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every)


class Slurm:
    """munged, slurmctld and slurmd of a one-node cluster under ``root``,
    each a child of the test, with deploy/slurm's Prolog and Epilog; beside
    its slurm.conf (``root/etc``), the recipe's settings (probing-slurm.env:
    this install of probing, files under ``root``) and the agent's (agent.env)."""

    def __init__(self, root: Path, mark: str) -> None:
        self.root = root
        self.mark = mark  # the job's name; the agent attaches to this job only
        agent_args = f"--every 0.5 --env SLURM_JOB_NAME={mark}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.agent_port = free_port()
        self.log = root / "probing-agent.log"
        for d in ("munge", "state", "spool", "etc"):
            (root / d).mkdir(mode=0o700, parents=True)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        etc = root / "etc"
        (etc / "agent.env").write_text(f"PROBING_AGENT_PORT={self.agent_port}\n")
        probing = Path(sys.executable).parent / "probing"
        (etc / "probing-slurm.env").write_text(
            (RECIPE / "probing-slurm.env").read_text()
            + f"AGENT_BIN={probing}\nAGENT_CONFIG={etc}/agent.env\nAGENT_ARGS='{agent_args}'\n"
            f"AGENT_LOG={self.log}\nAGENT_LOCK={root}/agent.lock\n"
        )
        self.conf = etc / "slurm.conf"  # the recipe's settings are beside it
        ports = {"ctld_port": free_port(), "slurmd_port": free_port()}
        self.conf.write_text(CONF.format(root=root, recipe=RECIPE, node=NODE, world=WORLD, **ports))
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def _start(self, *cmd: str) -> subprocess.Popen[bytes]:
        with open(self.root / f"{os.path.basename(cmd[0])}.out", "wb") as out:
            proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    cwd=self.root, start_new_session=True)  # fmt: skip
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        m = self.root / "munge"
        # --force: the socket's directory is the test's, not world-searchable
        self._start("munged", "-F", "--force", f"--key-file={m}/munge.key",
                    f"--socket={m}/munge.sock", f"--pid-file={m}/munged.pid",
                    f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed")  # fmt: skip
        _until(lambda: (m / "munge.sock").exists(), 10)
        self._start("slurmctld", "-D", "-f", str(self.conf))
        slurmd = self._start("slurmd", "-D", "-f", str(self.conf), "-N", NODE)
        idle = _until(lambda: self.state() == "idle" or slurmd.poll() is not None, 30)
        up = idle and slurmd.poll() is None
        require(up, f"slurmd cannot run here: {self.tail('slurmd.out')}")

    def state(self) -> str:
        r = self.run("sinfo", "-h", "-n", NODE, "-o", "%T")
        return r.stdout.strip()

    def run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)

    def tail(self, name: str) -> str:
        try:
            return (self.root / name).read_text()[-2000:]
        except OSError as err:
            return str(err)

    def ours(self) -> list[psutil.Process]:
        """The processes of this cluster: its daemons, the job steps' slurmstepd
        and tasks (SLURM_CONF is ours), the agent its Prolog started."""
        found = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if p.pid != os.getpid() and (
                    str(self.root) in " ".join(p.info["cmdline"] or [])
                    or p.environ().get("SLURM_CONF") == str(self.conf)
                ):
                    found.append(p)
            except psutil.Error:
                continue
        return found

    def stop(self) -> None:
        """Whatever of the cluster's is left but its daemons, then slurmd,
        slurmctld and munged, each waited for; then nothing of it runs."""
        daemons = {p.pid for p in self.procs}
        rest = [p for p in self.ours() if p.pid not in daemons]
        for p in rest:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(rest, timeout=15)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        left = [(p.pid, p.info["cmdline"]) for p in self.ours()]
        assert not left, f"still running after the cluster stopped: {left}"


@pytest.fixture
def slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Slurm]:
    require_bpf()
    for tool in TOOLS:
        installed = shutil.which(tool) is not None
        require(installed, f"needs {tool} (slurm-wlm, munge: .ci/testtools.sh installs them)")
    # the job's probes live where a job's do by default, and so does the agent's view of them
    monkeypatch.delenv("PROBING_RUNTIME_DIR", raising=False)
    cluster = Slurm(tmp_path / "slurm", f"probing-test-{uuid.uuid4().hex[:12]}")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _health(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        return json.load(r)


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _traced(health: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in health["processes"] if p["state"] == "tracing"]


def _probed(pid: int) -> bool:
    return _state(pid) == "tracing"


def _state(pid: int) -> str:
    """``pid``'s trace state, as its probe says; else why it said nothing."""
    try:
        return str(ProbeClient.for_pid(pid).trace_status()["state"])
    except ProbingError as err:
        return f"{type(err).__name__}: {err}"


_SAMPLE = re.compile(r"^([a-z_:]+)\{(.*)\} (\S+)", re.M)


def _samples(text: str, name: str, job: str) -> list[tuple[dict[str, str], float]]:
    """The samples of ``name`` in OpenMetrics ``text`` labelled ``job``."""
    out = []
    for m in _SAMPLE.finditer(text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if m.group(1) == name and labels.get("job") == job:
            out.append((labels, float(m.group(3))))
    return out


def _named(port: int, job: str) -> str:
    """The agent's /metrics once they name a straggler of ``job`` ("" before)."""
    text = _metrics(port)
    found = _samples(text, "probing_finding_active", job)
    return text if any(lb.get("kind") == "straggler" and v >= 1 for lb, v in found) else ""


def _gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(p) for p in pids)


def test_an_srun_job_is_watched_by_the_agent_the_prolog_started(
    slurm: Slurm, tmp_path: Path
) -> None:
    python = env_python("torch-np126")  # torch, and no probing
    t_start = time.monotonic()
    slow_file = tmp_path / "slow"
    job_env = {k: v for k, v in os.environ.items() if not k.startswith("PROBING")}
    job_env.update(SLURM_CONF=str(slurm.conf), SLOW_RANK=str(SLOW), SLOW_FILE=str(slow_file))
    port = slurm.agent_port
    agent_pid = engine_pid = 0
    ranks: dict[int, int] = {}
    with open(tmp_path / "job.out", "wb") as out:
        srun = subprocess.Popen(
            ["srun", "-n", str(WORLD), "-N", "1", "-J", slurm.mark, f"--chdir={tmp_path}",
             python, str(JOB), str(free_port())],
            env=job_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        # the Prolog started the agent, in a session of its own, before the tasks
        health = _until(lambda: _try(_health, port), 30)
        assert health, f"no agent on :{port}; its log: {slurm.tail('probing-agent.log')}"
        agent_pid = health["pid"]
        assert os.getsid(agent_pid) == agent_pid, "the agent is not in a session of its own"
        assert "starting" in slurm.tail("probing-agent.log")
        # every task is attached, for its SLURM_PROCID, and traced
        traced = _until(lambda: len(_traced(_health(port))) == WORLD and _traced(_health(port)), 60)
        assert traced, (_health(port), slurm.tail("probing-agent.log"), _tail(tmp_path / "job.out"))
        job_id = _squeue(slurm)
        for p in traced:
            assert p["why"] == "SLURM_PROCID" and p["job"] == f"slurm_job_id={job_id}", p
            environ = psutil.Process(p["pid"]).environ()
            assert not [k for k in environ if k.startswith("PROBING")], environ
            ranks[int(environ["SLURM_PROCID"])] = p["pid"]
        assert sorted(ranks) == list(range(WORLD)), ranks
        # what the agent says, each rank's own probe says (asked on a busy node)
        probed = _until(lambda: all(_probed(pid) for pid in ranks.values()), 20)
        assert probed, {pid: _state(pid) for pid in ranks.values()}
        print(f"every task traced {time.monotonic() - t_start:.1f} s after srun; attach s:",
              sorted(p["attached_s"] for p in traced))  # fmt: skip

        # the Prolog of the next job starts no second agent: it finds this one
        # answering; and where it does not answer yet (asked on another port
        # here), the lock this agent holds keeps a second one from starting
        prolog_env = {"SLURM_JOB_ID": "next", "SLURM_CONF": str(slurm.conf)}
        r = subprocess.run([str(RECIPE / "prolog.sh")], env=prolog_env, timeout=30)
        assert r.returncode == 0 and _health(port)["pid"] == agent_pid
        other = slurm.root / "other"  # what it might start is the cluster's, stopped with it
        other.mkdir()
        (other / "agent.env").write_text(f"PROBING_AGENT_PORT={free_port()}\n")
        settings = (slurm.conf.parent / "probing-slurm.env").read_text()
        (other / "probing-slurm.env").write_text(
            f"{settings}AGENT_CONFIG={other}/agent.env\nAGENT_WAIT_S=1\n"
        )
        prolog_env.update(SLURM_JOB_ID="racing", SLURM_CONF=str(other / "slurm.conf"))
        r = subprocess.run([str(RECIPE / "prolog.sh")], env=prolog_env, timeout=30)
        assert r.returncode == 0 and _agents(slurm.mark) == [agent_pid]
        assert "job racing: the agent did not answer" in slurm.tail("probing-agent.log")

        # rank SLOW slows down by 60 ms a step: named in findings and /metrics
        slow_file.touch()
        onset = time.monotonic()
        job = f"slurm_job_id={job_id}"
        text = _until(lambda: _named(port, job), 60, every=0.5)
        assert text, _metrics(port)
        print(f"rank {SLOW} named {time.monotonic() - onset:.1f} s after its slowdown began")
        assert f"probing_agent_attached {WORLD}" in text, text
        blamed = {lb.get("rank") for lb, v in _samples(text, "probing_finding_active", job)
                  if lb.get("kind") == "straggler" and v >= 1}  # fmt: skip
        assert blamed == {str(SLOW)}, text
        late = {lb["rank"]: v for lb, v in _samples(text, "probing_rank_lateness_seconds", job)}
        assert max(late, key=lambda r: late[r]) == str(SLOW), late
        _, rows = ProbeClient.for_pid(ranks[0]).query_rows(
            "SELECT kind, rank FROM analyze.findings WHERE cleared_ns IS NULL"
        )
        assert ["straggler", SLOW] in rows, rows
        engine_pid = ProbeClient.for_pid(ranks[0]).health()["engine_pid"]
        # rows are sealed into chunks once SEAL_AFTER_S old: the trace may be younger
        assert _until(lambda: _chunks(engine_pid), 30), "the engine keeps no chunk to remove"

        # the job ends: its tasks go, and the Epilog stops the engine that served them
        assert slurm.run("scancel", job_id).returncode == 0
        srun.wait(timeout=30 * SLOWDOWN)
        assert _until(lambda: _gone(list(ranks.values())), 30)
        # the node is idle once the Epilog is done (it drains the node if it fails)
        assert _until(lambda: slurm.state() == "idle", 60), slurm.state()
        log = slurm.tail("probing-agent.log")
        assert _until(lambda: not psutil.pid_exists(engine_pid), 10), log
        assert f"engine {engine_pid} of uid 0 stopped" in log, log
        pids = {str(pid) for pid in ranks.values()}
        left = [f for f in os.listdir(place.user_dir(0)) if f.split(".")[0] in pids]
        assert not left and not _chunks(engine_pid), (left, _chunks(engine_pid))
        assert _health(port)["pid"] == agent_pid  # the node's agent stays for the next job
        print(f"done {time.monotonic() - t_start:.1f} s after srun")
    finally:
        if srun.poll() is None:
            slurm.run("scancel", "-n", slurm.mark)
            try:
                srun.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(srun.pid, signal.SIGKILL)
                srun.wait()
        for pid in [*ranks.values(), engine_pid, agent_pid]:
            _stop(pid)


def _try(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except OSError:
        return None


def _squeue(slurm: Slurm) -> str:
    r = slurm.run("squeue", "-h", "-n", slurm.mark, "-o", "%i")
    assert r.returncode == 0 and r.stdout.strip(), r
    return r.stdout.strip()


def _agents(mark: str) -> list[int]:
    """The agents of this test (their ``--env`` names its job)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        argv = p.info["cmdline"] or []
        if "agent" in argv and f"SLURM_JOB_NAME={mark}" in argv:
            found.append(p.info["pid"])
    return found


def _chunks(engine_pid: int) -> list[str]:
    """The chunk directories of the engine ``engine_pid`` (/dev/shm or the temp directory)."""
    return glob.glob(f"/dev/shm/probing-0/chunks-{engine_pid}-*") + glob.glob(
        os.path.join(tempfile.gettempdir(), "probing-0", f"chunks-{engine_pid}-*")
    )


def _tail(path: Path) -> str:
    try:
        return path.read_text()[-2000:]
    except OSError as err:
        return str(err)


def _stop(pid: int) -> None:
    """SIGTERM, then SIGKILL after 15 s: what the test started is gone after it."""
    if pid <= 0 or not psutil.pid_exists(pid):
        return
    try:
        proc = psutil.Process(pid)
        proc.terminate()
        proc.wait(timeout=15)
    except psutil.TimeoutExpired:
        proc.kill()
    except psutil.Error:
        pass


def test_the_prolog_and_epilog_never_fail_a_job(tmp_path: Path) -> None:
    """A Prolog or Epilog that exits non-zero drains the node: each says what
    is wrong in the agent's log and exits 0. The Epilog removes the sockets of
    exited processes only, and its engine look-up runs (probing's own API)."""
    log = tmp_path / "agent.log"
    settings = tmp_path / "probing-slurm.env"
    conf = str(tmp_path / "slurm.conf")  # the settings are found beside it
    settings.write_text(f"AGENT_BIN={tmp_path}/none/probing\nAGENT_LOG={log}\n")
    r = subprocess.run([str(RECIPE / "prolog.sh")], env={"SLURM_JOB_ID": "7", "SLURM_CONF": conf})
    assert r.returncode == 0 and f"job 7: no {tmp_path}/none/probing" in log.read_text()
    r = subprocess.run([str(RECIPE / "epilog.sh")], env={"SLURM_JOB_ID": "7", "SLURM_CONF": conf})
    assert r.returncode == 0 and "job 7: no SLURM_JOB_UID" in log.read_text()

    probing = Path(sys.executable).parent / "probing"
    settings.write_text(f"AGENT_BIN={probing}\nAGENT_LOG={log}\n")
    user = tmp_path / "rt" / "probing-4242"
    user.mkdir(parents=True)
    dead, live = str(2**31 - 1), str(os.getpid())  # no pid is 2^31 - 1 (pid_max <= 2^22)
    names = [f"{dead}.sock", f"{dead}.guest", f"{live}.guest", "engine-0123.lock", f"{dead}.log"]
    for name in names:
        (user / name).write_text("")
    env = {"SLURM_JOB_ID": "8", "SLURM_JOB_UID": "4242", "SLURM_CONF": conf,
           "PROBING_RUNTIME_DIR": str(tmp_path / "rt")}  # fmt: skip
    r = subprocess.run([str(RECIPE / "epilog.sh")], env=env, timeout=60)
    assert r.returncode == 0
    assert sorted(os.listdir(user)) == sorted(names[2:]), os.listdir(user)
    said = log.read_text()
    assert "job 8: removed 2 probe sockets of exited processes of uid 4242" in said, said
    assert "Traceback" not in said and "Error" not in said, said
