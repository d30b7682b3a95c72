"""Verdicts against the job's own truth (docs/accuracy.md has the whole matrix):
the demo job, a real 4-rank DDP job on Gloo with two all-reduces a step
(DDP's buckets), times its own steps and its arrival at each backward pass
(``--truth``); every number ``diagnose`` says per step is compared with what
the job measured over the same window. Also: a loop in a thread, a hang
with a rank that does not answer, one rank asked without ``--cluster``.
Root-only."""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from probing.cli.demo import JOB_SCRIPT, DemoJob, trace_all
from tests.conftest import SLOWDOWN, cli, require_bpf

pytestmark = pytest.mark.privileged

WORLD = 4
WINDOW_S = 8.0  # the window diagnosed, and the steps of the truth compared
TRACED_STEPS = 40  # steps traced before diagnosing (a window's worth, however slow)


class Truth:
    """What the job measured itself (``job.py --truth``): per rank and step,
    when the step began, when its backward pass (and all-reduces) began, and
    when it ended, in wall-clock s."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def rows(self) -> list[tuple[int, int, float, float, float]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:  # a line being written is left for the next read
                r, s, t0, tb, t1 = parts
                out.append((int(r), int(s), float(t0), float(tb), float(t1)))
        return out

    def wait_steps(self, n: int, after: float, timeout: float = 120.0) -> None:
        """Until rank 0 has begun ``n`` steps since ``after`` (wall s)."""
        deadline = time.monotonic() + timeout * SLOWDOWN
        while time.monotonic() < deadline:
            if sum(1 for r, _, t0, _, _ in self.rows() if r == 0 and t0 > after) >= n:
                return
            time.sleep(0.2)
        raise AssertionError(f"the job did not step {n} times in {timeout:g} s")

    def over(self, since: float, until: float, slow: int) -> tuple[float, float]:
        """The job's median step (ms, rank 0's) begun in ``[since, until]``, and
        how late ``slow`` reached its backward pass, each step, against the
        others' median (ms, the median over those steps)."""
        rows = self.rows()
        steps = [1e3 * (t1 - t0) for r, _, t0, _, t1 in rows if r == 0 and since <= t0 <= until]
        by_step: dict[int, dict[int, float]] = {}
        for r, s, t0, tb, _ in rows:
            if since <= t0 <= until:
                by_step.setdefault(s, {})[r] = tb
        late = [
            1e3 * (ts[slow] - statistics.median(t for o, t in ts.items() if o != slow))
            for ts in by_step.values()
            if len(ts) == WORLD
        ]
        assert len(steps) >= 10 and len(late) >= 10, f"too few steps: {len(steps)}"
        return statistics.median(steps), statistics.median(late)


@pytest.fixture
def job() -> Iterator:
    started: list[DemoJob] = []

    def start(*job_args: str) -> DemoJob:
        j = DemoJob(WORLD, job_args=job_args)
        started.append(j)
        j.wait_ready(timeout=120)
        return j

    yield start
    for j in started:
        for p in j.pids:  # a rank this test stopped must be able to die
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
        j.stop()


def diagnosed(*args: str) -> dict:  # type: ignore[type-arg]
    r = cli("diagnose", *args, "--format", "json", timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    print(out["verdict"])
    return out


def traced(j: DemoJob, truth: Truth) -> None:
    """Every rank traced, and ``TRACED_STEPS`` steps since the last began to:
    counted from when ``trace_all`` returned, not from when it was called
    (it injects and loads, seconds on a busy machine: a diagnosis of ~20
    traced steps named a step two or four steps long, 1 in ~10 runs)."""
    errors = trace_all(j.pids, ["gloo"])
    assert not errors, "\n".join([*errors, j.exits()])
    truth.wait_steps(TRACED_STEPS, after=time.time())


# once in a run beside other privileged tests on 2 CPUs the cause's share came
# out 0.79 against the 0.8 asked (30.1 of 37.8 ms late): a rerun, as the
# other verdict tests beside a busy suite have
@pytest.mark.flaky(reruns=1)
def test_a_ddp_jobs_step_lateness_and_loss_are_its_own(job, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    require_bpf()
    slow = random.randrange(WORLD)
    print(f"load_batch slowed 40 ms on rank {slow}")
    truth = Truth(tmp_path / "truth")
    j = job("--slow-rank", str(slow), "--slow-ms", f"{40 * SLOWDOWN:g}", "--truth", str(truth.path))
    traced(j, truth)
    # one rank alone, without --cluster: not "nothing traced", but what to do
    alone = diagnosed("--pid", str(j.pids[0]), "--window", f"{WINDOW_S:g}s")
    assert alone["verdict"].startswith("no verdict: only rank 0 of the job's 4 answered")
    assert "add --cluster" in alone["verdict"]
    asked = time.time()
    out = diagnosed(*(a for p in j.pids for a in ("--pid", str(p))), "--window", f"{WINDOW_S:g}s")
    step, late = truth.over(asked - WINDOW_S, asked, slow)
    print(f"the job's own: step {step:.1f} ms, rank {slow} {late:.1f} ms late a step")
    [s] = out["stragglers"]
    assert s["rank"] == slow and s["period"] == 2, out["verdict"]  # DDP's two buckets
    assert abs(s["step_ms"] - step) <= 0.1 * step, (s["step_ms"], step)
    assert abs(out["summary"]["step_ms"] - step) <= 0.1 * step
    assert abs(s["late_ms"] - late) <= max(0.1 * late, 2.0), (s["late_ms"], late)
    assert abs(s["share_of_step"] - late / step) <= 0.1, (s["share_of_step"], late / step)
    # the one thing changed explains most of it, and heads the verdict
    top = max((w for w in out["why"] if w["share"] is not None), key=lambda w: w["share"])
    assert top["kind"] == "function" and "load_batch" in top["text"], out["why"]
    assert top["share"] >= 0.8, top
    assert f"is {s['late_ms']:.0f} ms late each {s['step_ms']:.0f} ms step" in out["verdict"]
    assert ": load_batch (" in out["verdict"]
    # the same through one rank's probe in cluster mode (peers from the job's store)
    peers_s = f"{5 * SLOWDOWN:g}"  # the peers' default 5 s, stretched like the tests' waits
    over = diagnosed("--pid", str(j.pids[-1]), "--cluster", "--timeout", peers_s)
    assert [s["rank"] for s in over["stragglers"]] == [slow], (over["verdict"], over["missing"])
    # the trace records Python stacks: the straggler's collectives come from the
    # line of the job that runs DDP's backward pass, through either path
    backward = next(
        n for n, line in enumerate(JOB_SCRIPT.read_text().splitlines(), 1) if "backward()" in line
    )
    for d in (out, over):
        assert d["callsites"][str(slow)].startswith(f"{JOB_SCRIPT}:{backward} "), d["callsites"]


def test_a_loop_in_a_thread_shows_the_thread_that_trains(job, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    require_bpf()
    slow = random.randrange(WORLD)
    print(f"trains in a thread; load_batch slowed 40 ms on rank {slow}")
    truth = Truth(tmp_path / "truth")
    args = ("--slow-rank", str(slow), "--slow-ms", f"{40 * SLOWDOWN:g}", "--truth", str(truth.path))
    j = job(*args, "--thread")
    traced(j, truth)
    pids = [a for p in j.pids for a in ("--pid", str(p))]
    out = diagnosed(*pids, "--window", f"{WINDOW_S:g}s")
    assert [s["rank"] for s in out["stragglers"]] == [slow], out["verdict"]
    # the straggler's stack is its "trainer" thread's, not MainThread's join
    stack = out["stacks"][str(slow)]
    assert stack[0].startswith("thread trainer ") and any(
        line.startswith("train (") for line in stack
    ), stack


def test_a_hang_with_a_rank_unheard_blames_nothing_unknown(job, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    require_bpf()
    hung, stopped = random.sample(range(WORLD), 2)
    print(f"rank {hung} hangs in load_batch; rank {stopped} is stopped (SIGSTOP)")
    stuck, truth = tmp_path / "stuck", Truth(tmp_path / "truth")
    j = job("--hang-rank", str(hung), "--hang-file", str(stuck), "--truth", str(truth.path))
    traced(j, truth)
    stuck.touch()
    hang_s = 2.0 * SLOWDOWN
    deadline = time.monotonic() + 60
    while time.time() - max(t1 for *_, t1 in truth.rows()) < 2 * hang_s:  # the job stands still
        assert time.monotonic() < deadline, "the job did not hang"
        time.sleep(0.2)
    os.kill(j.pids[stopped], signal.SIGSTOP)
    [asked, *_] = sorted(set(range(WORLD)) - {hung, stopped})  # a rank that can answer
    for how in (("--pid", str(j.pids[asked]), "--cluster"),
                tuple(a for p in j.pids for a in ("--pid", str(p)))):  # fmt: skip
        out = diagnosed(*how, "--hang-after", f"{hang_s:g}s")
        [h, *_] = out["hangs"]
        assert h["missing_ranks"] == [hung], out["verdict"]
        assert f"rank {hung} never entered it" in out["verdict"]
        # the stopped rank is said, and no cause is built on what it did not say
        assert out["missing"] and "stopped" in " ".join(out["missing"]), out["missing"]
        assert "not heard from" in out["verdict"] and "network" not in out["verdict"]
