"""How right ``probing diagnose`` is, against jobs that record their own truth.

    python benchmarks/accuracy.py                          # every case
    python benchmarks/accuracy.py --quick                  # 3 cases, ~2 min
    python benchmarks/accuracy.py --cases 'ddp_buckets/*' --cases fsdp2/hang
    python benchmarks/accuracy.py --cases 'megatron/*,hf_trainer/loader'
    python benchmarks/accuracy.py --out docs/accuracy.md   # `make accuracy`

Each case is a real 4-rank Gloo job on CPU (``benchmarks/accuracy_jobs/train.py``
under ``torchrun --nproc-per-node 4``, ``OMP_NUM_THREADS=1``) of one shape
(DDP with 2 buckets, gradient accumulation, a training loop in a thread,
FSDP2) with one fault injected on one rank from step ``--onset`` (a slow
loader, extra Python work, a slow 10th step, a hang, a rank killed, a slow
link (DDP shapes), CPU contention, garbage
collection) or none (healthy, also under background load). And real
frameworks' jobs (``tests/jobs/frameworks/``, started as
``tests/jobs/framework.py`` starts them for the tests, in the job environment
``.venv-jobs/frameworks``): ``torch.distributed.pipelining`` (``pipeline``),
Megatron-Core TP 2 x PP 2 (``megatron``), DeepSpeed ZeRO-2 under the
``deepspeed`` launcher (``deepspeed_z2``) and the HF ``Trainer``
(``hf_trainer``), each with one rank's own function slowed from step
``--onset`` (``loader``: 40 ms asleep a step; ``python_work``: 30 ms of busy
loop) or none (``healthy``); no first collective stamped there, a rank's
lateness is scored against the time it spent slowed. Every rank writes its
steps (wall-clock start and end), the time it spent in the fault and its
wait for a CPU to its own truth file. The runner waits until every
rank is a few steps past the onset, runs the command a user would,
``probing diagnose --pid <rank 0> --cluster --record 12s --format json``
(a hang: ``probing diagnose --pid <rank 0> --cluster --format json``, 5 s
after it hung), kills the job and scores the verdict against the truth over
the recorded window: the rank, the cause, the step, the share of the step
lost, the lateness per step, how long from the onset to the verdict. One
JSON object a case on stdout as it ends, then a markdown table; ``--out``
writes the table into that page between its markers, with the date and
the commit. Needs root (the tracing is BPF). Imports nothing from probing's
analysis: it measures the command line (the framework cases import
``tests/jobs/framework.py``'s launch commands, which take probing's
``free_port``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import json
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "benchmarks" / "accuracy_jobs" / "train.py"
WORLD = 4
SHAPES = ["ddp_buckets", "grad_accum", "thread_loop", "fsdp2"]
FAULTS = [
    "loader",
    "python_work",
    "every_10th",
    "hang",
    "killed",
    "cpu_contention",
    "gc",
    "healthy",
]
STOPS = ("hang", "killed")  # the faults that stop the job: diagnosed once it stands still
# one rank in a network namespace of its own behind a slow link (``slow_link``):
# the job's other ranks and its store on the host's side of a veth pair
LINK_SHAPES = ["ddp_buckets", "thread_loop"]  # DDP's 2.4 MB a step: FSDP2's small model barely
# feels a link that slows DDP by half
NETNS, HOST_IF, NS_IF, HOST_IP, NS_IP = "p9acc", "p9h", "p9v", "10.79.0.1", "10.79.0.2"
# the function each fault runs in (what the headline cause must name)
CAUSE = {
    "loader": "load_batch",
    "python_work": "extra_work",
    "every_10th": "load_batch",
    "hang": "load_batch",
    "killed": "died",
    "slow_link": "slow link",  # the verdict says it died (``dead``), not a function
    "gc": "make_garbage",
    "cpu_contention": "cpu_starvation",  # a kind, not a function
}
# real frameworks' jobs (tests/jobs/frameworks/, started as tests/jobs/framework.py
# starts them, in the job environment .venv-jobs/frameworks): shape -> how many
# times a step the slowed function runs (pipeline's stage_work: once per microbatch)
FRAMEWORKS = {"pipeline": 4, "megatron": 1, "deepspeed_z2": 1, "hf_trainer": 1}
FRAMEWORK_FAULTS = ["loader", "python_work", "healthy"]
SLOW = {"loader": ("sleep", 40.0), "python_work": ("cpu", 30.0)}  # SLOW_KIND, ms a step
QUICK = ["ddp_buckets/loader", "ddp_buckets/healthy", "thread_loop/loader"]
TARGETS = {"rank": 0.99, "cause": 0.95, "numbers_pct": 10.0, "share_pts": 10.0}
BEGIN, END = "<!-- accuracy:begin -->", "<!-- accuracy:end -->"


@dataclasses.dataclass
class Tree:
    """The probing a case's ``diagnose`` runs: this checkout, or a baseline
    revision's worktree (``--baseline``: its CLI, guest and engine, an install
    of its own so that its engine is its own)."""

    name: str
    path: Path
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    python: str = sys.executable

    def environ(self) -> dict[str, str]:
        return {**os.environ, **self.env}


THIS = Tree("this", REPO)


@dataclasses.dataclass
class Case:
    shape: str
    fault: str
    load: int = 0  # background `yes > /dev/null` processes

    @property
    def name(self) -> str:
        return f"{self.shape}/{self.fault}" + ("_load" if self.load else "")

    @property
    def framework(self) -> bool:
        return self.shape in FRAMEWORKS

    @property
    def rank(self) -> int | None:
        """The rank the fault is injected on: drawn per case, reproducibly."""
        if self.fault == "healthy":
            return None
        if self.fault == "slow_link":  # rank 0 serves the job's store on the host's side
            return 1 + random.Random(self.name).randrange(WORLD - 1)
        return random.Random(self.name).randrange(WORLD)


def all_cases() -> list[Case]:
    cases = [Case(s, f) for s in SHAPES for f in FAULTS]
    cases += [Case("ddp_buckets", "healthy", load=2), Case("grad_accum", "healthy", load=2)]
    cases += [Case(s, f) for s in FRAMEWORKS for f in FRAMEWORK_FAULTS]
    cases += [Case(s, "slow_link") for s in LINK_SHAPES]
    return cases


def framework() -> Any:
    """``tests/jobs/framework.py``, whose launch commands start the framework
    jobs (it imports probing's ``free_port``: imported for those cases only)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    # its Job hands the jobs this; diagnose finds their engines under the same
    os.environ.setdefault("PROBING_RUNTIME_DIR", "/tmp")
    import tests.jobs.framework as fw

    return fw


def cause_of(case: Case) -> str:
    """The function the headline cause must name."""
    return framework().FUNCTION[case.shape] if case.framework else CAUSE[case.fault]


# --------------------------------------------------------------------------- the job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun() -> list[str]:
    exe = Path(sys.executable).parent / "torchrun"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def read_truth(path: Path) -> dict[int, list[dict[str, Any]]]:
    """Every rank's truth lines (a line being written is skipped)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for r in range(WORLD):
        lines: list[dict[str, Any]] = []
        try:
            text = Path(f"{path}.rank{r}").read_text()
        except OSError:
            text = ""
        for line in text.splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                pass
        out[r] = lines
    return out


def steps_of(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [x for x in lines if "t0" in x]


def header_of(lines: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((x for x in lines if "pid" in x), None)


def onset_of(lines: list[dict[str, Any]]) -> float | None:
    return next((x["onset"] for x in lines if "onset" in x), None)


class Failure(Exception):
    """A case outcome that is not a verdict: the job or the command failed."""


def tail(path_or_text: Path | str, n: int = 1500) -> str:
    text = (
        path_or_text.read_text(errors="replace") if isinstance(path_or_text, Path) else path_or_text
    )
    return text[-n:]


def wait_for(
    cond: Any, timeout: float, what: str, alive: Any = None, log: Path | None = None
) -> Any:
    """Poll ``cond()`` until it is truthy; ``alive()`` false or the timeout: Failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        if alive is not None and not alive():
            raise Failure(f"the job exited while waiting for {what}: " + (tail(log) if log else ""))
        time.sleep(0.2)
    raise Failure(
        f"timed out after {timeout:.0f} s waiting for {what}: " + (tail(log) if log else "")
    )


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (through /proc's children lists)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                out.append(k)
                todo.append(k)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def kill_group(pid: int) -> None:
    """SIGKILL ``pid``'s process group if ``pid`` leads it, else ``pid``."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_job(proc: subprocess.Popen[bytes], pids: list[int]) -> list[int]:
    """Kill torchrun, its ranks (each leads its own session under torchrun) and
    what they started; the pids still alive after 10 s (should be none)."""
    every = set(pids) | set(descendants(proc.pid)) | {proc.pid}
    for p in pids:
        every |= set(descendants(p))
    for p in sorted(every):
        kill_group(p)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in every):
        time.sleep(0.1)
    return sorted(p for p in every if alive(p))


# --------------------------------------------------------------------------- diagnose


@dataclasses.dataclass
class Run:
    rc: int | None
    stdout: str
    stderr: str
    started: float  # time.time() the command began
    recording: float | None  # when it said it began recording
    ended: float


def run_diagnose(pid: int, record_s: float | None, timeout: float, tree: Tree = THIS) -> Run:
    """``probing diagnose`` as a user runs it (``tree``'s); its stderr lines timestamped."""
    cmd = [tree.python, "-m", "probing", "diagnose", "--pid", str(pid), "--cluster"]
    if record_s is not None:
        cmd += ["--record", f"{record_s:g}s"]
    cmd += ["--format", "json"]
    started = time.time()
    p = subprocess.Popen(
        cmd, cwd=tree.path, env=tree.environ(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    err: list[str] = []
    out: list[str] = []
    recording: list[float] = []

    def read_err() -> None:
        assert p.stderr is not None
        for line in p.stderr:
            if "recording" in line and not recording:
                recording.append(time.time())
            err.append(line)

    def read_out() -> None:
        assert p.stdout is not None
        out.append(p.stdout.read())

    readers = [threading.Thread(target=f, daemon=True) for f in (read_err, read_out)]
    for t in readers:
        t.start()
    try:
        rc: int | None = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:  # timed out, or the runner interrupted
        if p.poll() is None:
            kill_group(p.pid)
            p.wait()
    for t in readers:
        t.join(timeout=5)
    ended = time.time()
    return Run(rc, "".join(out), "".join(err), started, recording[0] if recording else None, ended)


def diagnosis(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    """The JSON a run printed; a timeout, an exit status or no JSON: Failure."""
    if run.rc is None:
        raise Failure(
            f"diagnose timed out after {args.diagnose_timeout:.0f} s: " + tail(run.stderr)
        )
    d = parse(run.stdout)
    if run.rc != 0 or d is None:
        raise Failure(f"diagnose exited {run.rc}: " + tail(run.stderr + run.stdout))
    return d


def parse(out: str) -> dict[str, Any] | None:
    for line in reversed(out.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return dict(json.loads(line))
            except ValueError:
                return None
    return None


# --------------------------------------------------------------------------- scoring


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def truth_window(
    truth: dict[int, list[dict[str, Any]]], case: Case, lo: float, hi: float
) -> dict[str, Any]:
    """The job's own figures over the steps that began after ``lo`` (and the
    onset) and ended before ``hi``: its median step; how late the faulty rank
    reached the collective the others wait at each step (DDP's last bucket,
    else its first collective) after the others (mean; its lateness), the
    share of the step that is; and the
    time it spent in the fault (``injected_ms``, shown beside: on 2 CPUs for 4
    ranks the others go on computing meanwhile, and it reaches the collective
    less late than it spent)."""
    onset_step = next((h["onset_step"] for r in truth if (h := header_of(truth[r]))), 0)
    win = {
        r: [
            s
            for s in steps_of(lines)
            if s["t0"] >= lo
            and s["t1"] <= hi
            and (case.rank is None or case.fault in STOPS or s["step"] >= onset_step)
        ]
        for r, lines in truth.items()
    }
    durations = [1e3 * (s["t1"] - s["t0"]) for ss in win.values() for s in ss]
    step = median(durations)
    out: dict[str, Any] = {"steps": min((len(v) for v in win.values()), default=0)}
    out["step_ms"] = round(step, 2) if step else None
    # each rank's arrival at its first collective after the others' (median of
    # them), mean over the window: how late it makes the step; and its wait
    # for a CPU beyond theirs
    arrive = stamped(win, "t_arrive")
    # the first collective itself (DDP's first bucket, stamped by a comm hook;
    # FSDP2's first all-gather starts with the forward: t_arrive)
    first = stamped(win, "t_collective", "t_arrive")
    # what the others wait for: DDP's last bucket (the others wait at the end of
    # backward until it is launched: a rank slowed all through its backward, by
    # CPU contention, is later there than at its first); else the first
    reach = stamped(win, "t_last_collective", "t_collective", "t_arrive")
    runq = {r: [s["runq_ms"] for s in ss] for r, ss in win.items() if ss}

    def excess(per: dict[int, list[float]]) -> dict[int, float]:
        means = {r: statistics.fmean(v) for r, v in per.items()}
        return {
            r: round(m - statistics.median([o for q, o in means.items() if q != r]), 2)
            for r, m in means.items()
            if len(means) > 1
        }

    out["arrival_excess_ms"] = excess(arrive)
    out["first_collective_excess_ms"] = excess(first)
    out["collective_excess_ms"] = excess(reach)
    out["runq_excess_ms"] = excess(runq)
    if case.rank is None or step is None or case.fault in (*STOPS, "slow_link"):
        return out
    mine = win.get(case.rank, [])
    if case.fault != "cpu_contention" and mine:  # no injected figure for contention
        out["injected_ms"] = round(statistics.fmean(s["injected_ms"] for s in mine), 2)
    late = out["collective_excess_ms"].get(case.rank)
    if late is None and out.get("injected_ms") is not None:
        # no first collective stamped (the framework jobs): the time spent in the fault
        late = out["injected_ms"]
        out["late_from"] = "spent"
    if late is not None:
        out["late_ms"] = late
        out["share"] = round(late / step, 4)
    return out


def stamped(win: dict[int, list[dict[str, Any]]], *keys: str) -> dict[int, list[float]]:
    """Per rank, ms from each step's start to its first of ``keys`` stamped;
    only the ranks that stamped every step of the window (none: {})."""
    out = {}
    for r, ss in win.items():
        ts = [next((s[k] for k in keys if s.get(k)), None) for s in ss]
        if ss and all(x is not None for x in ts):
            out[r] = [1e3 * (x - s["t0"]) for x, s in zip(ts, ss, strict=True)]
    return out


def words(x: Any) -> str:
    return json.dumps(x, default=str).lower()


def named_of(case: Case, d: dict[str, Any]) -> tuple[list[int], str | None]:
    """The ranks the diagnosis ``d`` blames, and as what: a hang's missing
    ranks, else (a pipeline) the slow stage, else the first straggler."""
    hangs = d.get("hangs") or []
    if hangs:
        return sorted({int(r) for h in hangs for r in (h.get("missing_ranks") or [])}), "hang"
    slow = (d.get("pipeline") or {}).get("slow")
    if case.shape == "pipeline" and slow is not None:  # its neighbours wait: victims
        return [int(slow)], "slow stage"
    stragglers = d.get("stragglers") or []
    if stragglers:
        return [int(stragglers[0]["rank"])], "straggler"
    return [], None


def score(case: Case, d: dict[str, Any], truth: dict[str, Any]) -> dict[str, Any]:
    """The diagnosis ``d`` against the truth of ``case``."""
    rank = case.rank
    verdict = str(d.get("verdict", ""))
    stragglers = d.get("stragglers") or []
    hangs = d.get("hangs") or []
    links = d.get("slow_links") or []
    s0 = stragglers[0] if stragglers else {}
    named, kind = named_of(case, d)
    out: dict[str, Any] = {
        "verdict": verdict,
        "healthy": d.get("healthy"),
        "named": named,
        "kind": kind or ("slow link" if links else None),
        "abstained": "no verdict" in verdict.lower(),
    }
    if case.fault == "slow_link":  # a link is no rank's: named as the slow link, nothing else
        out["rank_right"] = bool(links) and not named
        out["cause"] = "slow link" if links else None
        out["cause_right"] = out["rank_right"]
        return out
    if rank is None:
        out["rank_right"] = not named
        out["false_alarm"] = bool(named)
        out["slow_link_named"] = bool(links)
        out["cause_right"] = None
    elif case.fault in STOPS:
        out["rank_right"] = named == [rank]
    elif kind == "slow stage":
        out["rank_right"] = named == [rank]
    else:
        out["rank_right"] = bool(stragglers) and int(s0["rank"]) == rank
    summary = d.get("summary") or {}
    diag_step = s0.get("step_ms") or summary.get("step_ms")
    out["step_ms"] = diag_step
    if diag_step and truth.get("step_ms"):
        out["step_err_pct"] = round(100 * abs(diag_step - truth["step_ms"]) / truth["step_ms"], 1)
    if rank is None:
        if stragglers:  # what it said, and how late the job's truth has that rank
            out["late_ms"], out["share_of_step"] = (
                s0.get("late_ms") or s0.get("lag_ms_mean"),
                s0.get("share_of_step"),
            )
            out["named_excess_ms"] = (truth.get("collective_excess_ms") or {}).get(int(s0["rank"]))
        return out
    expect = cause_of(case)
    if case.fault == "killed":  # said dead, by its rank
        out["cause"] = expect if str(rank) in (d.get("dead") or {}) else None
        out["cause_right"] = out["cause"] == expect and out["rank_right"]
        return out
    if case.fault == "hang":
        h = next((h for h in hangs if rank in (h.get("missing_ranks") or [])), None)
        stacks = (h or {}).get("stacks") or {}
        stack = stacks.get(str(rank), stacks.get(rank)) if isinstance(stacks, dict) else None
        out["cause"] = expect if stack and expect in words(stack) else None
        out["cause_right"] = out["cause"] == expect
        return out
    why = [w for w in d.get("why") or [] if w.get("rank") == (named[0] if named else rank)]
    head = max(why, key=lambda w: w.get("share") or 0.0, default=None)
    if head is not None:
        name = " ".join(str(head.get(k) or "") for k in ("what", "name", "func", "file"))
        out["cause"] = head.get("what") or head.get("name") or head.get("func")
        out["cause_kind"] = head.get("kind")
        out["cause_share"] = head.get("share")
        if case.fault == "cpu_contention":
            out["cause_right"] = head.get("kind") == "cpu_starvation" and out["rank_right"]
        else:
            out["cause_right"] = expect in name and out["rank_right"]
    else:
        out["cause"], out["cause_right"] = None, False
    if not stragglers:
        return out
    late = s0.get("late_ms") or s0.get("lag_ms_mean")
    share = s0.get("share_of_step")
    out["late_ms"], out["share_of_step"] = late, share
    if late is not None and truth.get("late_ms"):
        out["late_err_pct"] = round(100 * abs(late - truth["late_ms"]) / truth["late_ms"], 1)
    if share is not None and truth.get("share") is not None:
        out["share_err_pts"] = round(100 * abs(share - truth["share"]), 1)
    return out


# --------------------------------------------------------------------------- a case


def launch(
    case: Case, args: argparse.Namespace, path: Path, tmp: Path
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start the case's job in a session of its own: its launcher, its log."""
    if case.framework:
        return launch_framework(case, args, path, tmp)
    log = tmp / "job.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    job = [
        str(JOB), "--shape", case.shape, "--fault", case.fault,
        "--fault-rank", str(-1 if case.rank is None else case.rank),
        "--onset-step", str(args.onset), "--truth", str(path),
    ]  # fmt: skip
    cmd = [*torchrun(), "--nproc-per-node", str(WORLD), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *job]  # fmt: skip
    if case.fault == "slow_link":
        return launch_apart(case, env, job, log), log
    if case.fault == "killed":  # torchrun would stop the job: the srun way, a process a rank
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))  # fmt: skip
        each = " ".join(map(shlex.quote, [sys.executable, *job]))
        cmd = ["sh", "-c", f"for r in $(seq 0 {WORLD - 1}); do RANK=$r LOCAL_RANK=$r "
               f"{each} & done; wait"]  # fmt: skip
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
    return proc, log


def launch_apart(
    case: Case, env: dict[str, str], job: list[str], log: Path
) -> subprocess.Popen[bytes]:
    """The job the srun way, the case's rank in the namespace ``NETNS`` behind
    a slow link (``slow_net``), the others on the host's side of it; Gloo
    over the veth pair's addresses."""
    slow_net()
    env = dict(env, MASTER_ADDR=HOST_IP, MASTER_PORT=str(free_port()), WORLD_SIZE=str(WORLD),
               LOCAL_WORLD_SIZE=str(WORLD))  # fmt: skip
    each = " ".join(map(shlex.quote, [sys.executable, *job]))
    lines = []
    for r in range(WORLD):
        where = f"ip netns exec {NETNS} env GLOO_SOCKET_IFNAME={NS_IF}" if r == case.rank else (
            f"env GLOO_SOCKET_IFNAME={HOST_IF}")  # fmt: skip
        lines.append(f"RANK={r} LOCAL_RANK={r} {where} {each} &")
    with open(log, "wb") as f:
        return subprocess.Popen(
            ["sh", "-c", "\n".join([*lines, "wait"])], stdout=f, stderr=subprocess.STDOUT,
            env=env, cwd=REPO, start_new_session=True,
        )  # fmt: skip


def slow_net() -> None:
    """The namespace ``NETNS`` joined to the host by a veth pair whose
    namespace side is slowed: ``tc netem delay 15ms``, or where the kernel has
    no netem, a thin pipe (``tbf rate 400mbit``: DDP's 2.4 MB of gradients a
    step take ~60 ms more through it, a degraded link, not a broken one)."""
    unslow_net()

    def run(*args: str) -> None:
        subprocess.run(args, check=True, capture_output=True)

    run("ip", "netns", "add", NETNS)
    run("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
    run("ip", "link", "set", NS_IF, "netns", NETNS)
    run("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_IF)
    run("ip", "link", "set", HOST_IF, "up")
    run("ip", "-n", NETNS, "addr", "add", f"{NS_IP}/24", "dev", NS_IF)
    run("ip", "-n", NETNS, "link", "set", NS_IF, "up")
    run("ip", "-n", NETNS, "link", "set", "lo", "up")
    tc = ["ip", "netns", "exec", NETNS, "tc", "qdisc", "add", "dev", NS_IF, "root"]
    if subprocess.run([*tc, "netem", "delay", "15ms"], capture_output=True).returncode:
        run(*tc, "tbf", "rate", "400mbit", "burst", "64kb", "latency", "200ms")


def unslow_net() -> None:
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)
    subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True)


def launch_framework(
    case: Case, args: argparse.Namespace, path: Path, tmp: Path
) -> tuple[subprocess.Popen[bytes], Path]:
    """A framework's job as ``tests/jobs/framework.py`` starts it (``start``),
    slowed by ``SLOW`` a step on the case's rank, recording its truth
    (``ACCURACY_TRUTH``) and slowed from step ``--onset`` (``ONSET_STEP``)."""
    fw = framework()
    py = fw.ENV / "bin" / "python"
    if not py.exists():
        raise Failure(f"no job environment {fw.ENV}: make jobenvs (or PROBING_JOB_ENVS=DIR)")
    kind, ms = SLOW.get(case.fault, ("sleep", 0.0))
    more = {
        "ACCURACY_TRUTH": str(path), "ACCURACY_FAULT": case.fault,
        "ACCURACY_SHAPE": case.shape, "ONSET_STEP": str(args.onset),
        "SLOW_KIND": kind, "SLOW_MS": f"{ms / FRAMEWORKS[case.shape]:g}",
        # as train.py's cases (torchrun's default; the deepspeed launcher sets none)
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    }  # fmt: skip
    job = fw.start(case.shape, str(py), tmp, False, -1 if case.rank is None else case.rank, **more)
    return job.proc, job.out


def retry_hang(
    case: Case, args: argparse.Namespace, pid: int, t_onset: float, truth: dict[str, Any],
    tree: Tree = THIS,
) -> dict[str, Any]:  # fmt: skip
    """A hang not named 5 s in: diagnosed again once it is older than
    ``--hang-after`` (``--hang-retry`` after it began), scored the same way."""
    time.sleep(max(0.0, t_onset + args.hang_retry - time.time()))
    again: dict[str, Any] = {"after_s": args.hang_retry}
    try:
        run = run_diagnose(pid, None, args.diagnose_timeout, tree)
        r2 = score(case, diagnosis(run, args), truth)
        again.update({k: r2.get(k) for k in ("verdict", "named", "kind", "rank_right")})
        again.update(cause_right=r2.get("cause_right"), abstained=r2.get("abstained"))
        again["latency_s"] = round(run.ended - t_onset, 1)
    except Failure as e:
        again["error"] = str(e)
    return again


def run_case(case: Case, args: argparse.Namespace, tree: Tree = THIS) -> dict[str, Any]:
    """Start the job, inject, diagnose (``tree``'s probing), stop it; the outcome, scored."""
    t_case = time.monotonic()
    rec: dict[str, Any] = {"case": case.name, "shape": case.shape, "fault": case.fault}
    rec["tree"] = tree.name
    rec["fault_rank"] = case.rank
    tmp = Path(tempfile.mkdtemp(prefix="probing-accuracy-"))
    path, log = tmp / "truth.jsonl", tmp / "job.log"
    hogs = [
        subprocess.Popen(["yes"], stdout=subprocess.DEVNULL, start_new_session=True)
        for _ in range(case.load)
    ]
    proc: subprocess.Popen[bytes] | None = None
    pids: list[int] = []
    try:
        proc, log = launch(case, args, path, tmp)
        job = proc

        def running() -> bool:
            return job.poll() is None

        def headers() -> list[int] | None:
            t = read_truth(path)
            hs = [header_of(t[r]) for r in range(WORLD)]
            return [int(h["pid"]) for h in hs] if all(hs) else None  # type: ignore[index]

        # a framework's job imports it first (HF, DeepSpeed: ~30 s on 2 loaded CPUs)
        start_s = args.start_timeout * (2 if case.framework else 1)
        pids = wait_for(headers, start_s, "every rank to start", running, log)
        onset = args.onset + args.settle
        # the pid a user gives: rank 0's, or a live rank's where rank 0 is the one killed
        asked = pids[1] if case.fault == "killed" and case.rank == 0 else pids[0]

        def past_onset() -> bool:
            t = read_truth(path)
            return all(len(steps_of(t[r])) > onset for r in range(WORLD))

        def hung() -> float | None:
            return onset_of(read_truth(path)[case.rank]) if case.rank is not None else None

        if case.fault in STOPS:
            wait_for(hung, args.start_timeout, f"the {case.fault} rank", running, log)
            time.sleep(args.hang_wait)  # no condition: the job is hung
            run = run_diagnose(asked, None, args.diagnose_timeout, tree)
        else:
            wait_for(past_onset, args.start_timeout, f"{onset} steps on every rank", running, log)
            run = run_diagnose(asked, args.record, args.diagnose_timeout, tree)
        truth = read_truth(path)
        t_onset = onset_of(truth[case.rank]) if case.rank is not None else None
        d = diagnosis(run, args)
        rec["diagnose_s"] = round(run.ended - run.started, 1)
        if t_onset is not None:
            rec["latency_s"] = round(run.ended - t_onset, 1)
        if run.recording is not None:
            lo, hi = run.recording, run.recording + args.record
        else:  # a hang: the steps before it, for the step
            lo, hi = run.started - 60, run.ended
        rec["truth"] = truth_window(truth, case, lo, hi)
        rec.update(score(case, d, rec["truth"]))
        if rec.get("abstained") or not rec.get("rank_right"):
            rec["stderr_tail"] = tail(run.stderr, 600)
        if case.fault in STOPS and not rec["rank_right"] and t_onset and args.hang_retry:
            rec["retry"] = retry_hang(case, args, asked, t_onset, rec["truth"], tree)
        rec["outcome"] = "verdict"
    except Failure as e:
        rec["outcome"] = "failed"
        rec["error"] = str(e)
    except Exception as e:  # the runner's own bug: one case, not the run
        rec["outcome"] = "failed"
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if proc is not None:
            left = stop_job(proc, pids)
            if left:
                rec["left_running"] = left
        for h in hogs:
            h.kill()
            h.wait()
        if case.fault == "slow_link":
            unslow_net()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            rec["dir"] = str(tmp)
    rec["case_s"] = round(time.monotonic() - t_case, 1)
    rec["loadavg"] = round(os.getloadavg()[0], 1)  # what else ran (1 min load average)
    return rec


# --------------------------------------------------------------------------- the table


def fmt(x: Any, unit: str = "", nd: int = 0) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "✓" if x else "✗"
    if isinstance(x, float):
        return f"{x:.{nd}f}{unit}"
    return f"{x}{unit}"


def trio(truth: Any, diag: Any, err: Any, unit: str, err_unit: str) -> str:
    """``truth / diagnosed (error)``."""
    return f"{fmt(truth, unit)} / {fmt(diag, unit)} ({fmt(err, err_unit)})"


def pct(num: int, den: int) -> str:
    return f"{num}/{den} ({100 * num / den:.0f} %)" if den else "–"


def table(recs: list[dict[str, Any]]) -> str:
    head = (
        "| case | rank | named | rank ok | cause (share) | cause ok | step ms truth / diag (err) "
        "| lost share truth / diag (err) | late ms truth / diag (err) | latency s | load |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in recs:
        t = r.get("truth") or {}
        if r.get("outcome") != "verdict":
            err = (r.get("error") or "").splitlines()[0][:90].replace("|", "\\|")
            rows.append(
                f"| {r['case']} | {fmt(r['fault_rank'])} | failed: {err} |"
                + " |" * 7
                + f" {fmt(r.get('loadavg'), nd=0)} |"
            )
            continue
        named = ",".join(map(str, r.get("named") or [])) or "none"
        if r.get("kind"):
            named += f" ({r['kind']})"
        if r.get("abstained"):
            named += " abstained"
        if r.get("retry"):
            again = r["retry"]
            named += f"; at {again['after_s']:.0f} s: " + (
                ",".join(map(str, again.get("named") or [])) or "none"
            )
            named += f" ({again['kind']})" if again.get("kind") else ""
        cause = r.get("cause")
        if cause and r.get("cause_share") is not None:
            cause = f"{cause} ({100 * r['cause_share']:.0f} %)"
        step = trio(t.get("step_ms"), r.get("step_ms"), r.get("step_err_pct"), "", " %")
        share_t = 100 * t["share"] if t.get("share") is not None else None
        share_d = 100 * r["share_of_step"] if r.get("share_of_step") is not None else None
        share = trio(share_t, share_d, r.get("share_err_pts"), " %", " pts")
        late_t = t.get("late_ms") if r["fault_rank"] is not None else r.get("named_excess_ms")
        late = trio(late_t, r.get("late_ms"), r.get("late_err_pct"), "", " %")
        if t.get("late_from") == "spent":  # no collective stamped: the truth is the time spent
            late = late.replace(" / ", " (spent) / ", 1)
        elif t.get("injected_ms") is not None and r["fault"] not in STOPS:
            late = late.replace(" / ", f" (spent {t['injected_ms']:.0f}) / ", 1)
        rows.append(
            f"| {r['case']} | {fmt(r['fault_rank'])} | {named} | {fmt(r.get('rank_right'))} "
            f"| {fmt(cause)} | {fmt(r.get('cause_right'))} | {step} | {share} | {late} "
            f"| {fmt(r.get('latency_s'), nd=0)} | {fmt(r.get('loadavg'), nd=0)} |"
        )
    return head + "\n".join(rows) + "\n"


def measures(recs: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """``(measure, result, target)`` over ``recs``."""
    ok = [r for r in recs if r.get("outcome") == "verdict"]
    faulty = [r for r in recs if r["fault_rank"] is not None]
    healthy = [r for r in recs if r["fault_rank"] is None]
    rank_ok = sum(1 for r in recs if r.get("rank_right"))
    cause_ok = sum(1 for r in faulty if r.get("cause_right"))

    def within(key: str, lim: float) -> str:
        have = [r[key] for r in ok if r.get(key) is not None]
        return pct(sum(1 for v in have if v <= lim), len(have))

    def of(cases: list[str], out_of: int | None = None) -> str:
        n = f"{len(cases)} of {out_of}" if out_of is not None else str(len(cases))
        return n + (f": {', '.join(cases)}" if cases else "")

    retried = [r for r in recs if r.get("retry")]
    lat = [r["latency_s"] for r in ok if r.get("latency_s") is not None and r.get("rank_right")]
    return [
        ("rank right (cases run, failures count as wrong)", pct(rank_ok, len(recs)), "≥ 99 %"),
        ("cause right (faulty cases)", pct(cause_ok, len(faulty)), "≥ 95 %"),
        ("step within 10 %", within("step_err_pct", 10), "all"),
        ("lost share within 10 points", within("share_err_pts", 10), "all"),
        ("lateness within 10 %", within("late_err_pct", 10), "all"),
        ("false alarms (healthy runs)",
         of([r["case"] for r in healthy if r.get("false_alarm")], len(healthy)), "0"),
        ("slow link named on a healthy run",
         of([r["case"] for r in healthy if r.get("slow_link_named")], len(healthy)), "0"),
        ('abstained ("no verdict")', of([r["case"] for r in ok if r.get("abstained")]), "–"),
        ("failed (no diagnosis)",
         of([r["case"] for r in recs if r.get("outcome") != "verdict"]), "0"),
        ("hangs not named at first, named right on the retry",
         pct(sum(1 for r in retried if r["retry"].get("rank_right")), len(retried)), "–"),
        ("latency, onset to verdict (right ones), median", fmt(median(lat), " s", 0), "–"),
    ]  # fmt: skip


def totals(recs: list[dict[str, Any]]) -> str:
    lines = ["| measure | result | target |", "|---|---|---|"]
    lines += [f"| {m} | {v} | {t} |" for m, v, t in measures(recs)]
    return "\n".join(lines) + "\n"


def compared(base: list[dict[str, Any]], this: list[dict[str, Any]], rev: str) -> str:
    """The baseline's figures beside this tree's, case by case (the same
    cases, run one after the other) and in total."""
    lines = [f"| measure | baseline `{rev}` | this tree | target |", "|---|---|---|---|"]
    lines += [
        f"| {m} | {b} | {t} | {target} |"
        for (m, b, target), (_, t, _) in zip(measures(base), measures(this), strict=True)
    ]
    lines += ["", f"| case | baseline `{rev}`: named, errors | this tree: named, errors |",
              "|---|---|---|"]  # fmt: skip

    def said(r: dict[str, Any]) -> str:
        if r.get("outcome") != "verdict":
            return "failed"
        named = ",".join(map(str, r.get("named") or [])) or "none"
        named += f" ({r['kind']})" if r.get("kind") else ""
        errs = [
            f"{label} {fmt(r.get(key), unit)}"
            for label, key, unit in (("step", "step_err_pct", " %"),
                                     ("share", "share_err_pts", " pts"),
                                     ("late", "late_err_pct", " %"))
            if r.get(key) is not None
        ]  # fmt: skip
        marks = f"rank {fmt(r.get('rank_right'))}"
        if r["fault_rank"] is not None:
            marks += f", cause {fmt(r.get('cause_right'))}"
        return f"{named}: {marks}" + (f"; {', '.join(errs)}" if errs else "")

    lines += [f"| {t['case']} | {said(b)} | {said(t)} |" for b, t in zip(base, this, strict=True)]
    return "\n".join(lines) + "\n"


def verdicts(recs: list[dict[str, Any]]) -> str:
    out = []
    for r in recs:
        text = (
            r.get("verdict")
            if r.get("outcome") == "verdict"
            else "failed: " + (r.get("error") or "")
        )
        text = " ".join((text or "").split())[:600]
        if r.get("retry"):
            again = r["retry"].get("verdict") or "failed: " + (r["retry"].get("error") or "")
            text += f" — again at {r['retry']['after_s']:.0f} s: " + " ".join(again.split())[:600]
        out.append(f"- `{r['case']}` (rank {fmt(r['fault_rank'])}): {text}")
    return "\n".join(out) + "\n"


def report(recs: list[dict[str, Any]], took_s: float) -> str:
    return (
        table(recs)
        + "\n"
        + totals(recs)
        + f"\n{len(recs)} cases in {took_s / 60:.1f} min.\n\nThe verdicts, as printed:\n\n"
        + verdicts(recs)
    )


def head() -> str:
    """The commit checked out (short), or "unknown"."""
    r = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    return r.stdout.strip() or "unknown"


def write_doc(path: Path, body: str, load: str, first: str) -> None:
    rev = head()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", "probing"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.strip()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if first != rev:  # the analysis changed under the run: each case ran what was there
        stamp = (
            f"Run until {when} from commit `{first}` to `{rev}` (probing changed during the run)"
        )
    else:
        stamp = f"Run on {when} at commit `{rev}`"
    if dirty:
        stamp += " with uncommitted changes to probing/"
    stamp += f", on {os.cpu_count()} CPUs, torch {torch_version()}"
    stamp += f"; the machine's load average after each case: {load}:\n\n"
    block = f"{BEGIN}\n{stamp}{body}{END}"
    text = path.read_text() if path.exists() else "# Accuracy of `probing diagnose`\n\n"
    if BEGIN in text and END in text:
        pre, rest = text.split(BEGIN, 1)
        text = pre + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def torch_version() -> str:
    r = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
    )
    return r.stdout.strip() or "?"


def interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def baseline_tree(rev: str) -> Tree:
    """A worktree of ``rev`` whose ``python -m probing`` (its CLI, the guest it
    injects, the engine it starts) is an install of its own: run by this venv's
    Python through a link to the venv (an install is its version and where its
    Python is: ``guest.place.install``), so that its engine is its own."""
    top = Path(tempfile.mkdtemp(prefix="probing-accuracy-base-"))
    where = top / "tree"
    got = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), rev],
                         capture_output=True, text=True)  # fmt: skip
    if got.returncode != 0:
        sys.exit(f"accuracy: --baseline {rev}: {got.stderr.strip()} (give a commit of this repo)")
    venv = Path(sys.executable).parent.parent
    (top / "venv").symlink_to(venv, target_is_directory=True)
    python = str(top / "venv" / "bin" / Path(sys.executable).name)
    return Tree(f"baseline {rev}", where, {"PYTHONPATH": str(where)}, python)


def drop_tree(tree: Tree) -> None:
    """Stop the baseline's engine, remove its worktree."""
    cmd = [tree.python, "-m", "probing", "engine", "stop"]
    subprocess.run(cmd, cwd=tree.path, env=tree.environ(), capture_output=True, timeout=60)
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree.path)],
                   capture_output=True)  # fmt: skip
    shutil.rmtree(tree.path.parent, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--cases",
        action="append",
        default=[],
        help="names or globs (ddp_buckets/*), repeatable or comma-separated",
    )
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--out", type=Path, help="write the table into this page (docs/accuracy.md)")
    p.add_argument("--record", type=float, default=12.0, help="seconds diagnose --record traces")
    p.add_argument("--onset", type=int, default=20, help="the step the fault starts at")
    p.add_argument("--settle", type=int, default=5, help="steps past the onset before diagnosing")
    p.add_argument(
        "--hang-wait", type=float, default=5.0, help="seconds after a hang before diagnosing"
    )
    p.add_argument(
        "--hang-retry",
        type=float,
        default=12.0,
        help="a hang not named: diagnose again this long after it began (0: not)",
    )
    p.add_argument("--start-timeout", type=float, default=90.0)
    p.add_argument("--diagnose-timeout", type=float, default=120.0)
    p.add_argument("--keep", action="store_true", help="keep each case's truth files and job log")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="each case also run first with that revision's probing (a worktree), side by side",
    )
    args = p.parse_args()
    cases = all_cases()
    pats = [c for arg in args.cases for c in arg.split(",") if c]
    if args.quick:
        pats += QUICK
    if pats:
        cases = [c for c in cases if any(fnmatch.fnmatchcase(c.name, pat) for pat in pats)]
        if not cases:
            p.error(f"no case matches {pats}; --list shows them")
    if args.list:
        for c in cases:
            print(c.name)
        return
    if os.geteuid() != 0:
        print("accuracy: not root: tracing needs BPF; the cases will fail", file=sys.stderr)
    first = head()
    signal.signal(signal.SIGTERM, interrupted)  # a case's job is stopped on the way out
    base = baseline_tree(args.baseline) if args.baseline else None
    t0 = time.monotonic()
    recs: list[dict[str, Any]] = []
    was: list[dict[str, Any]] = []  # the baseline's
    try:
        for i, case in enumerate(cases, 1):
            for tree in [base, THIS] if base else [THIS]:
                now = os.getloadavg()[0]
                print(
                    f"accuracy: [{i}/{len(cases)}] {case.name} ({tree.name}, "
                    f"load average {now:.1f})",
                    file=sys.stderr,
                    flush=True,
                )
                rec = run_case(case, args, tree)
                (recs if tree is THIS else was).append(rec)
                print(json.dumps(rec, default=str), flush=True)
    except KeyboardInterrupt:
        print(f"\naccuracy: interrupted after {len(recs)} cases", file=sys.stderr)
        if recs:
            print("\n" + report(recs, time.monotonic() - t0))
        sys.exit(130)
    finally:
        if base:
            drop_tree(base)
    body = report(recs, time.monotonic() - t0)
    if base:
        print("\n" + compared(was[: len(recs)], recs, args.baseline))
    print("\n" + body)
    if args.out:
        loads = [r["loadavg"] for r in recs if "loadavg" in r]
        load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "?"
        write_doc(args.out, body, load, first)
        print(f"accuracy: wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
