"""Real frameworks from PyPI, launched their own way (``tests/jobs/frameworks``,
environment ``frameworks`` from ``.ci/jobenvs.sh``: no probing in it).

For each: one rank, drawn at random, is slowed in a function of the user's
own file; probes start with ``PROBING=1`` (the hook installed in the job's
environment) or are injected later; ``query --cluster`` lists every rank
and ``diagnose --cluster`` names the slowed rank (for a pipeline: the stage).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from probing.cli.demo import trace_all
from tests.conftest import SLOWDOWN, cli, require, require_bpf
from tests.jobs.framework import ENV, FUNCTION, JOBS, WORLD, Job, Slowed, start, torchrun
from tests.test_cluster import wait_ready

# a failed test runs once more (never twice): four ranks of a real framework
# on 2 cores pace themselves by the load, and one run in many is slowed past
# what a verdict can tell; a test that fails twice in a row fails CI, and
# each rerun is listed in the summary (R)
pytestmark = [pytest.mark.privileged, pytest.mark.flaky(reruns=1)]

ALL_RANKS = "SELECT rank FROM process.info ORDER BY rank"


def python() -> str:
    py = ENV / "bin" / "python"
    require(py.exists(), f"job env {ENV.name} missing: run .ci/jobenvs.sh (make setup)")
    return str(py)


@pytest.fixture(scope="module")
def hooked() -> Iterator[str]:
    """The frameworks environment with probing's start-up hook (for ``PROBING=1``)."""
    py = python()
    r = cli("hook", "--python", py)
    assert r.returncode == 0, r.stderr
    yield py
    cli("hook", "--python", py, "--remove")


def diagnosed(job: Job, rank: int, pipeline: bool, timeout: float = 60) -> dict:
    """``diagnose --cluster`` (JSON) until it names ``rank``; its last answer."""
    deadline = time.monotonic() + timeout * SLOWDOWN
    pid = job.ranks[0 if rank else 1]  # asked through another rank's probe
    while True:
        r = cli("diagnose", "--pid", str(pid), "--cluster", "--window", "15", "--format", "json",
                timeout=120)  # fmt: skip
        assert r.returncode in (0, 2), r.stderr
        got = json.loads(r.stdout)
        if named(got, pipeline) == rank or time.monotonic() > deadline:
            return got
        time.sleep(1)


def named(d: dict, pipeline: bool) -> int | None:
    if pipeline:
        return (d.get("pipeline") or {}).get("slow")
    return d["stragglers"][0]["rank"] if d["stragglers"] else None


@pytest.mark.parametrize(
    ("name", "probing"),
    [
        ("lightning_ddp", True),
        ("lightning_ddp", False),
        ("lightning_ddp_spawn", True),
        ("lightning_ddp_spawn", False),
        ("mp_spawn", True),
        ("hf_trainer", False),
        ("accelerate", True),
        ("fsdp2", False),
        ("fsdp2_tp", False),
        ("pipeline", False),
    ],
)
def test_a_framework_job_forms_a_cluster_and_its_slow_rank_is_named(
    name: str, probing: bool, hooked: str, runtime_dir: Path, tmp_path: Path
) -> None:
    require_bpf()
    slow = random.Random(f"{name}{probing}{time.time_ns()}").randrange(WORLD)
    job = start(name, hooked, tmp_path, probing, slow)
    try:
        ranks = job.wait_ready()
        assert not trace_all(list(ranks.values()), ["gloo"])
        for pid in ranks.values():  # each probe learns its rank from the job's group, then joins
            wait_ready(pid, 60 * SLOWDOWN)
        r = cli("query", "--pid", str(ranks[3]), "--cluster", "--format", "json", ALL_RANKS)
        assert r.returncode == 0, r.stderr
        assert [row["rank"] for row in json.loads(r.stdout)] == list(range(WORLD))
        d = diagnosed(job, slow, pipeline=name == "pipeline")
        assert named(d, name == "pipeline") == slow, d["verdict"]
        assert f"rank {slow}" in d["verdict"] and not d["healthy"]
        if name == "fsdp2_tp":  # named with the groups it slows: its mesh dimensions
            groups = d["stragglers"][0]["groups"]
            dims = {g.split("(")[-1].rstrip(")") for g in groups}
            assert groups and dims <= {"mesh_dp", "mesh_tp"}, groups
            # and where it sits: the 2 x 2 mesh ("dp", "tp") puts rank r at tp r % 2, dp r // 2
            place = f"TP {slow % 2} of 2, DP {slow // 2}"
            assert d["stragglers"][0]["place"] == place, d["stragglers"][0]
            assert d["verdict"].startswith(f"rank {slow} ({place}) on node "), d["verdict"]
        if name == "pipeline":  # the others wait on it: victims, not stragglers
            assert sorted(d["pipeline"]["victims"]) == sorted(set(range(WORLD)) - {slow})
            assert not d["stragglers"] and "slow stage" in d["verdict"]
    finally:
        job.stop()


@pytest.mark.parametrize("probing", [True, False])
def test_a_megatron_tp_pp_straggler_is_named_with_its_place(
    probing: bool, hooked: str, runtime_dir: Path, tmp_path: Path
) -> None:
    """Megatron-Core's ``parallel_state``, TP 2 x PP 2 on 4 ranks (torchrun,
    Gloo): the slowed rank is named with where it sits (rank r: TP r % 2 of
    its stage r // 2, DP 0), and its function once, per step."""
    require_bpf()
    slow = random.Random(f"megatron{probing}{time.time_ns()}").randrange(WORLD)
    print(f"straggler: rank {slow}")
    job = start("megatron", hooked, tmp_path, probing, slow)
    try:
        ranks = job.wait_ready()
        assert not trace_all(list(ranks.values()), ["gloo"])
        r = cli("query", "--pid", str(ranks[3]), "--cluster", "--format", "json", ALL_RANKS)
        assert r.returncode == 0, r.stderr
        assert [row["rank"] for row in json.loads(r.stdout)] == list(range(WORLD))
        d = diagnosed(job, slow, pipeline=False)
        print(d["verdict"])
        assert named(d, False) == slow, d["verdict"]
        place = f"TP {slow % 2} of 2, PP stage {slow // 2}, DP 0"
        assert d["stragglers"][0]["place"] == place, d["stragglers"][0]
        assert d["verdict"].startswith(f"rank {slow} ({place}) on node "), d["verdict"]
        assert "attention_block (" in d["verdict"], d["verdict"]
        said = [w["text"] for w in d["why"] if "attention_block" in w["text"]]
        assert len(said) == 1 and "ms/step" in said[0], said
        assert d["verdict"].count("attention_block (") == 1, d["verdict"]
        assert " its TP group gloo/" in d["verdict"], d["verdict"]  # its group, by role
        # the same place as data: each rank's coordinates, each group's role
        want = [{"rank": k, "coords": f"tp {k % 2}/2, pp {k // 2}/2, dp 0/1", "tp": k % 2,
                 "pp": k // 2, "dp": 0, "cp": None} for k in range(WORLD)]  # fmt: skip
        q = "SELECT rank, coords, tp, pp, dp, cp FROM process.info ORDER BY rank"
        deadline = time.monotonic() + 30 * SLOWDOWN  # read again every 10 s (PLACE_TTL_S)
        while True:
            r = cli("query", "--pid", str(ranks[1]), "--cluster", "--format", "json", q)
            assert r.returncode == 0, r.stderr
            if json.loads(r.stdout) == want or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert json.loads(r.stdout) == want
        q = "SELECT DISTINCT rank, pg, role FROM comm.groups"
        r = cli("query", "--pid", str(ranks[2]), "--cluster", "--format", "json", q)
        assert r.returncode == 0, r.stderr
        roles = {(g["pg"].split("(")[-1].rstrip(")"), g["role"]) for g in json.loads(r.stdout)}
        assert {("TENSOR_MODEL_PARALLEL_GROUP", "tp"), ("PIPELINE_MODEL_PARALLEL_GROUP", "pp"),
                ("DATA_PARALLEL_GROUP", "dp")} <= roles, roles  # fmt: skip
        assert {role for _, role in roles} <= {"tp", "pp", "dp", None}, roles
    finally:
        job.stop()


# DeepSpeed under its own launcher (deepspeed_z<stage>) and under torchrun, each
# with PROBING=1 and attached later, ZeRO-1, 2 and 3 under each (ZeRO-2 under
# torchrun in the losses' test below)
@pytest.mark.parametrize(
    ("name", "probing"),
    [
        ("deepspeed_z2", True),
        ("deepspeed_z1", False),
        ("deepspeed_torchrun_z3", True),
        ("deepspeed_z3", False),
    ],
)
def test_a_deepspeed_straggler_is_named_with_its_function(
    name: str, probing: bool, hooked: str, runtime_dir: Path, tmp_path: Path
) -> None:
    """Every rank found (attached later: by ``trace --job`` from one rank's pid,
    which finds the others by their launcher's variables), the slowed rank
    named, and ``mix_features``, the user's function it slows, as its cause."""
    require_bpf()
    slow = random.Random(f"{name}{probing}{time.time_ns()}").randrange(WORLD)
    print(f"straggler: rank {slow}")
    job = start(name, hooked, tmp_path, probing, slow)
    try:
        ranks = job.wait_ready()
        if probing:
            assert not trace_all(list(ranks.values()), ["gloo"])
        else:
            r = cli("trace", "--pid", str(ranks[slow]), "--job", "--background", "--no-nccl",
                    "--no-cuda", timeout=240)  # fmt: skip
            assert r.returncode == 0, r.stdout + r.stderr
            assert r.stdout.startswith(f"{WORLD} of {WORLD} ranks tracing\n"), r.stdout
        for pid in ranks.values():
            wait_ready(pid, 60 * SLOWDOWN)
        r = cli("query", "--pid", str(ranks[3]), "--cluster", "--format", "json", ALL_RANKS)
        assert r.returncode == 0, r.stderr
        assert [row["rank"] for row in json.loads(r.stdout)] == list(range(WORLD))
        fn = FUNCTION["deepspeed_z2"]
        deadline = time.monotonic() + 60 * SLOWDOWN
        while True:
            d = diagnosed(job, slow, pipeline=False, timeout=30)
            if f"{fn} (" in d["verdict"] or time.monotonic() > deadline:
                break
        print(d["verdict"])
        assert named(d, False) == slow, d["verdict"]
        assert d["verdict"].startswith(f"rank {slow} on node "), d["verdict"]
        assert f"{fn} (" in d["verdict"].split(" of its step time", 1)[-1], d["verdict"]
    finally:
        job.stop()


def test_python_is_what_the_job_runs() -> None:
    """The job environment is its own: another numpy than probing's, no probing."""
    py = python()
    got = subprocess.run(
        [py, "-c", "import numpy, importlib.util as u; print(numpy.__version__, "
         "u.find_spec('probing') is None)"],
        capture_output=True, text=True, cwd="/", check=True,
    )  # fmt: skip
    assert got.stdout.split() == ["1.26.4", "True"]
    assert sys.executable != py


def hang_diagnosed(asker: int, done: Callable[[dict], bool]) -> dict:  # type: ignore[type-arg]
    """``diagnose --cluster --hang-after 2s`` (JSON) through ``asker``'s probe
    until ``done`` says so of its answer (60 s at most); its last answer."""
    deadline = time.monotonic() + 60 * SLOWDOWN
    while True:
        r = cli("diagnose", "--pid", str(asker), "--cluster", "--hang-after", "2s",
                "--format", "json", timeout=120)  # fmt: skip
        d = json.loads(r.stdout)
        if done(d) or time.monotonic() > deadline:
            return d
        time.sleep(1)


def test_a_hung_pipeline_names_the_stage_that_never_sent(
    hooked: str, runtime_dir: Path, tmp_path: Path
) -> None:
    require_bpf()
    stuck = random.randrange(WORLD)
    flag = tmp_path / "hang"
    job = Job(torchrun(hooked, str(JOBS / "pipeline.py")), tmp_path,
              {"HANG_RANK": str(stuck), "HANG_FILE": str(flag)})  # fmt: skip
    try:
        ranks = job.wait_ready()
        assert not trace_all(list(ranks.values()), ["gloo"])
        flag.touch()  # traced first: the neighbours' waits begin under the probes
        d = hang_diagnosed(ranks[(stuck + 1) % WORLD], lambda d: bool(d["hangs"]))
        [h] = d["hangs"]
        assert h["missing_ranks"] == [stuck] and h["op"] == "recv", d["verdict"]
        assert h["waiting_ranks"] and stuck not in h["waiting_ranks"]
        assert f"rank {stuck} never sent or received what they wait for" in d["verdict"]
        assert "Flight Recorder" not in d["verdict"]  # traced: the recorder adds nothing
        assert any("stage_work" in line for line in h["stacks"][str(stuck)])
    finally:
        job.stop()


# a rank of DeepSpeed ZeRO-3 (its own launcher) or Megatron-Core TP 2 x PP 2 stops
# for good in the user's function: the collective the others wait in names it
@pytest.mark.parametrize("name", ["deepspeed_z3", "megatron"])
def test_a_rank_that_stops_in_a_framework_job_is_named_as_the_hang(
    name: str, hooked: str, runtime_dir: Path, tmp_path: Path
) -> None:
    require_bpf()
    stuck = random.randrange(WORLD)
    flag = tmp_path / "hang"
    job = start(name, hooked, tmp_path, True, -1, HANG_RANK=str(stuck), HANG_FILE=str(flag))
    try:
        ranks = job.wait_ready()
        assert not trace_all(list(ranks.values()), ["gloo"])
        for pid in ranks.values():
            wait_ready(pid, 60 * SLOWDOWN)
        flag.touch()  # traced first: the others' waits begin under the probes

        def missing(d: dict) -> list[dict]:  # type: ignore[type-arg]
            return [h for h in d["hangs"] if h["missing_ranks"] == [stuck]]

        d = hang_diagnosed(ranks[(stuck + 1) % WORLD], lambda d: bool(missing(d)))
        hung = missing(d)
        assert hung, d["verdict"]
        assert f"rank {stuck}" in d["verdict"], d["verdict"]
        fn = FUNCTION.get(name, FUNCTION["deepspeed_z2"])
        stacks = [line for h in hung for line in (h.get("stacks") or {}).get(str(stuck), [])]
        assert any(fn in line for line in stacks), (d["verdict"], stacks)
    finally:
        job.stop()


def _losses(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("name", ["pipeline", "lightning_ddp", "deepspeed_torchrun_z2", "megatron"])
def test_a_traced_framework_job_trains_with_the_losses_of_an_untraced_one(
    name: str, hooked: str, runtime_dir: Path, tmp_path: Path
) -> None:
    require_bpf()
    traced, untraced = tmp_path / "traced", tmp_path / "untraced"
    traced.mkdir()
    untraced.mkdir()
    job = start(name, hooked, traced, True, -1, LOSS_FILE=str(traced / "loss"))
    try:
        ranks = job.wait_ready()
        assert not trace_all(list(ranks.values()), ["gloo"])
        start_step = len(_losses(traced / "loss"))
        deadline = time.monotonic() + 120 * SLOWDOWN
        while len(_losses(traced / "loss")) < start_step + 30:
            assert time.monotonic() < deadline, job.text()[-3000:]
            time.sleep(0.2)
        r = cli("query", "--pid", str(ranks[1]), "--format", "json",
                "SELECT count(*) AS n FROM comm.collectives")  # fmt: skip
        assert json.loads(r.stdout)[0]["n"] > 0, r.stderr  # the steps compared were traced
    finally:
        job.stop()
    got = _losses(traced / "loss")
    ref = start(name, hooked, untraced, False, -1, LOSS_FILE=str(untraced / "loss"),
                STEPS=str(len(got)))  # fmt: skip
    try:
        assert ref.proc.wait(timeout=300 * SLOWDOWN) == 0, ref.text()[-3000:]
    finally:
        ref.stop()
    want = _losses(untraced / "loss")
    assert len(got) > start_step + 20 and got == want[: len(got)]


# each cause (tests.jobs.framework.Slowed) on a real framework, and the verdict's headline
SLOWED = {"off_cpu": "hf_trainer", "cpu": "fsdp2", "loader_worker": "hf_trainer",
          "cpu_hog": "lightning_ddp", "gpu": "lightning_ddp"}  # fmt: skip


@pytest.mark.parametrize("cause", sorted(SLOWED))
def test_the_verdict_blames_the_real_cause(cause: str, runtime_dir: Path, tmp_path: Path) -> None:
    require_bpf()
    python()
    slow = random.randrange(WORLD)
    job = Slowed(SLOWED[cause], cause, slow, 60, tmp_path)
    try:
        ranks = job.ready()
        assert not trace_all(list(ranks.values()), job.families())
        job.traced()
        deadline = time.monotonic() + 90 * SLOWDOWN
        while True:
            d = diagnosed(job.job, slow, pipeline=False, timeout=30)
            if job.blamed in d["verdict"] or time.monotonic() > deadline:
                break
        assert named(d, False) == slow, d["verdict"]
        head = d["verdict"].split(" of its step time", 1)[-1]
        assert job.blamed in head, (d["verdict"], d["why"])
        assert cause == "cpu_hog" or "CPU starvation" not in d["verdict"], d["verdict"]
    finally:
        job.stop()
