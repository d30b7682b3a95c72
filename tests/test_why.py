"""Diagnosis under noise, and why a straggler is slow, on canned rows: a
uniformly noisy machine raises nothing (and says it is noisy), a straggler
costing >= 10 % of the step is named through noise, the per-function
comparison names the slow function with file:line, CPU starvation is told
apart, a hang in a subgroup names only that group's missing rank, and
repeated diagnoses of one hang name the same collective."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from probing.analyze import analyze
from probing.analyze import collectives as coll
from probing.analyze import evidence as ev
from probing.cli.render import diagnosis as render
from tests.test_analyze import T0, job


@pytest.mark.parametrize("seed", range(6))
def test_a_uniformly_noisy_machine_raises_nothing_and_says_noisy(seed: int) -> None:
    d = analyze(job(jitter_ms=40.0, step_ms=150.0, steps=80, seed=seed), now_ns=T0)
    assert d.healthy and not d.stragglers, d.verdict
    assert d.verdict.startswith("noisy, no single straggler: 4 ranks"), d.verdict
    assert "chance 25 %" in d.verdict


@pytest.mark.parametrize("seed", range(6))
def test_a_straggler_costing_a_tenth_of_the_step_is_named_through_noise(seed: int) -> None:
    rank = seed % 4
    d = analyze(
        job(jitter_ms=10.0, step_ms=150.0, steps=80, straggler=rank, lag_ms=30.0, seed=seed),
        now_ns=T0,
    )
    assert [s.rank for s in d.stragglers] == [rank], d.verdict
    [s] = d.stragglers
    assert s.share_of_step >= 0.05 and s.p_value < 1e-3 and s.groups == ["gloo/n4#0"]


def _gathers(late_rank: int, late_ms: float, steps: int = 30, seed: int = 0) -> pa.Table:
    """An FSDP-like job: 15 all-gathers a step, 3 ms apart, each rank's arrival
    jittered; ``late_rank`` reaches the first gather of each step ``late_ms``
    late (its code runs before that block only)."""
    rng = np.random.default_rng(seed)
    rows, t = [], float(T0)
    for k in range(steps * 15):
        arrive = t + rng.exponential(1.5, size=4) * 1e6
        if k % 15 == 0:
            arrive[late_rank] += late_ms * 1e6
        end = arrive.max() + 0.3e6
        for r in range(4):
            rows.append({"backend": "gloo", "op": "allgather", "comm": 0x10 + r, "seq": k,
                         "comm_rank": r, "nranks": 4, "bytes": 4096, "ts": int(arrive[r]),
                         "dur_ns": int(end - arrive[r]), "pid": 100 + r, "node": "n",
                         "rank": r})  # fmt: skip
        t = end + 3e6
    return pa.Table.from_pylist(rows)


@pytest.mark.parametrize("seed", range(3))
def test_late_by_far_at_one_gather_a_step_is_named(seed: int) -> None:
    """Last at only ~30 % of the gathers (chance: 25 %), but by 100 ms where
    it is, and nobody else is: the gathers wait for it a third of the time."""
    d = analyze(_gathers(2, 100.0, seed=seed), now_ns=T0)
    assert [s.rank for s in d.stragglers] == [2], d.verdict
    healthy = analyze(_gathers(2, 0.0, seed=seed), now_ns=T0)
    assert not healthy.stragglers, healthy.verdict


def test_the_order_test_is_uniform_for_alike_ranks() -> None:
    rng = np.random.default_rng(1)
    ps = [ev.order_p(rng.integers(0, 4, 200).astype(float), np.full(200, 4.0)) for _ in range(400)]
    assert 0.02 < np.mean(np.array(ps) < 0.05) < 0.09  # ~5 % below 0.05 by chance
    assert ev.order_p(np.full(100, 3.0), np.full(100, 4.0)) < 1e-12  # always last


def _samples(
    rank_rows: dict[int, list[tuple[str, str, str, int, float]]], span_s: float
) -> pa.Table:
    rows = []
    for rank, entries in rank_rows.items():
        rows.append({"kind": "tick", "file": None, "func": None, "line": None,
                     "dur_ns": int(span_s * 1e9), "n": 1, "rank": rank})  # fmt: skip
        for kind, file, func, line, ms in entries:
            rows.append({"kind": kind, "file": file, "func": func, "line": line,
                         "dur_ns": int(ms * 1e6), "n": 1, "rank": rank})  # fmt: skip
    return pa.Table.from_pylist(rows)


STEPS_PER_S = 1000 / (80 + 5 + 30)  # job(): step_ms + compute + the straggler's lag


def test_why_names_the_slow_function_with_file_and_line() -> None:
    # 60 steps: the slow loader sleeps 80 ms a step on rank 2 only
    span, steps = 60 / STEPS_PER_S, 60
    per = {
        r: [("off", "/job/train.py", "load_batch", 41, (80.0 if r == 2 else 0.3) * steps),
            ("cpu", "/job/train.py", "step", 12, 5.0 * steps)]
        for r in range(4)
    }  # fmt: skip
    d = analyze(job(straggler=2, lag_ms=30, seed=2), now_ns=T0, samples=_samples(per, span))
    [s] = d.stragglers
    fn = [w for w in d.why if w.kind == "function"]
    assert fn and fn[0].what == "load_batch" and fn[0].line == 41, d.why
    assert 60 < fn[0].ms_per_step < 100 and fn[0].others_ms_per_step < 1
    assert fn[0].text.startswith("rank 2: load_batch (/job/train.py:41) ")
    assert "ms/step vs 0.3 ms on the others (mostly off CPU)" in fn[0].text
    assert not [w for w in d.why if w.kind == "cpu_starvation"]
    coll_why = [w for w in d.why if w.kind == "collectives"]
    assert coll_why and coll_why[0].ms_per_step < coll_why[0].others_ms_per_step
    assert "why (time per step" in render(d) and "load_batch" in render(d)


def test_a_straggler_whose_samples_were_not_read_is_said_so_not_left_blank() -> None:
    """The verdict says why it names no cause: the rank's samples unanswered
    (unheard in the gather), absent from the window, or not asked at all."""
    from probing.analyze.gather import with_missing

    span, steps = 60 / STEPS_PER_S, 60
    per = {r: [("off", "/job/train.py", "load_batch", 41, (80.0 if r == 2 else 0.3) * steps)]
           for r in range(4)}  # fmt: skip
    table = job(straggler=2, lag_ms=30, seed=2)
    others = _samples({r: v for r, v in per.items() if r != 2}, span)
    unheard = with_missing(others, ["rank 2 (host1): timeout"], [2])
    cases = {
        "rank 2 did not answer in time for its stack samples": unheard,
        "no stack samples of rank 2 in the window": others,
        "its stack samples could not be read": None,
    }
    for said, samples in cases.items():
        d = analyze(table, now_ns=T0, samples=samples)
        [s] = d.stragglers
        assert s.rank == 2, d.verdict
        assert f"its step time; its cause is not known: {said}" in d.verdict, d.verdict
    d = analyze(table, now_ns=T0, samples=_samples(per, span))  # read: the cause, no excuse
    assert "load_batch" in d.verdict and "not known" not in d.verdict, d.verdict


def test_why_tells_cpu_starvation_from_a_slow_function() -> None:
    span, steps = 60 / STEPS_PER_S, 60
    per = {}
    for r in range(4):
        k = 2.0 if r == 1 else 1.0  # every function twice as slow on rank 1 ...
        per[r] = [
            ("cpu", "/job/train.py", "forward", 30, 10.0 * steps),
            ("runq", "/job/train.py", "forward", 30, (10.0 * k - 10.0 + 0.5) * steps),
            ("cpu", "/job/train.py", "augment", 50, 6.0 * steps),
            ("runq", "/job/train.py", "augment", 50, (6.0 * k - 6.0 + 0.3) * steps),
        ]  # ... because it waits for a CPU as long as it runs
    d = analyze(job(straggler=1, lag_ms=30, seed=5), now_ns=T0, samples=_samples(per, span))
    first = d.why[0]
    assert first.kind == "cpu_starvation", d.why
    assert first.text.startswith("rank 1: CPU starvation: waits ")
    assert "every function ~2.0x slower" in first.text
    assert 1.7 < (first.slower or 0) < 2.3


def _native(rows: pa.Table, runq_ms: dict[int, float]) -> pa.Table:
    """``rows`` plus each rank's threads without Python waiting ``runq_ms`` for a CPU."""
    extra = [{"kind": "runq", "file": None, "func": None, "line": None, "thread": "gloo_tcp_loop",
              "dur_ns": int(ms * 1e6), "n": 1, "rank": r} for r, ms in runq_ms.items()]  # fmt: skip
    return pa.Table.from_pylist(rows.to_pylist() + extra)


def test_a_wait_for_a_cpu_that_accounts_for_the_lateness_is_starvation() -> None:
    """A busy machine that favours the others: every rank waits for CPUs, rank 1's
    functions only ~1.15x slower, but its threads (Gloo's too) wait ~30 ms/step
    longer for a CPU: as long as it is late. The verdict says so."""
    span, steps = 60 / STEPS_PER_S, 60
    per = {}
    for r in range(4):
        k = 1.15 if r == 1 else 1.0
        per[r] = [
            ("cpu", "/job/train.py", "forward", 30, 10.0 * steps),
            ("runq", "/job/train.py", "forward", 30, 20.0 * k * steps),
            ("cpu", "/job/train.py", "other_work", 50, 6.0 * steps),
            ("runq", "/job/train.py", "other_work", 50, 12.0 * k * steps),
        ]
    native = {r: (40.0 if r == 1 else 15.0) * steps for r in range(4)}
    samples = _native(_samples(per, span), native)
    d = analyze(job(straggler=1, lag_ms=30, seed=5), now_ns=T0, samples=samples)
    first = d.why[0]
    assert first.kind == "cpu_starvation", d.why
    assert 25 < first.ms_per_step - first.others_ms_per_step < 40, first
    assert 1.05 < (first.slower or 0) < 1.3
    assert d.verdict.endswith(
        "longer for a CPU than the others, 99 % of its lateness (what else runs on its node?)"
    ), d.verdict
    # without the threads' wait, the functions alone (~1.15x) do not make it starvation
    bare = analyze(job(straggler=1, lag_ms=30, seed=5), now_ns=T0, samples=_samples(per, span))
    assert not [w for w in bare.why if w.kind == "cpu_starvation"], bare.why
    assert "CPU starvation" not in bare.verdict


def test_starvation_is_told_with_a_single_function_sampled() -> None:
    """No other function to compare (no "every function ~Nx slower"): the wait
    for a CPU that accounts for the lateness says it alone."""
    span, steps = 60 / STEPS_PER_S, 60
    per = {
        r: [("cpu", "/job/train.py", "forward", 30, 10.0 * steps),
            ("runq", "/job/train.py", "forward", 30, (23.0 if r == 1 else 20.0) * steps)]
        for r in range(4)
    }  # fmt: skip
    samples = _native(
        _samples(per, span), {r: (40.0 if r == 1 else 15.0) * steps for r in range(4)}
    )
    d = analyze(job(straggler=1, lag_ms=30, seed=5), now_ns=T0, samples=samples)
    [w] = [w for w in d.why if w.kind == "cpu_starvation"]
    assert w.rank == 1 and w.slower is None and "every function" not in w.text, w
    assert "CPU starvation, it waits 28 ms/step longer" in d.verdict, d.verdict


def test_extra_work_waiting_for_a_cpu_is_the_function_not_starvation() -> None:
    """Rank 2 does 40 ms/step of extra work in ``augment`` on a busy machine, most of
    it waiting for a CPU: the function is the cause, not the machine."""
    span, steps = 60 / STEPS_PER_S, 60
    per = {}
    for r in range(4):
        per[r] = [
            ("cpu", "/job/train.py", "forward", 30, 10.0 * steps),
            ("runq", "/job/train.py", "forward", 30, 20.0 * steps),
        ]
        if r == 2:
            per[r] += [("cpu", "/job/train.py", "augment", 52, 12.0 * steps),
                       ("runq", "/job/train.py", "augment", 52, 28.0 * steps)]  # fmt: skip
    samples = _native(_samples(per, span), {r: 15.0 * steps for r in range(4)})
    d = analyze(job(straggler=2, lag_ms=30, seed=2), now_ns=T0, samples=samples)
    assert d.why[0].kind == "function" and d.why[0].what == "augment", d.why
    assert "mostly waiting for a CPU" in d.why[0].text
    assert not [w for w in d.why if w.kind == "cpu_starvation"], d.why


def test_a_hog_that_makes_a_function_3x_slower_is_starvation_not_the_function() -> None:
    """Rank 3 shares its core with a hog: ``forward`` takes 3x as long there,
    all of it waiting for a CPU (its own work is the others'). That is the
    machine's doing, and the verdict says starvation."""
    span, steps = 60 / STEPS_PER_S, 60
    per = {
        r: [("cpu", "/job/train.py", "forward", 30, 10.0 * steps),
            ("runq", "/job/train.py", "forward", 30, (22.0 if r == 3 else 2.0) * steps)]
        for r in range(4)
    }  # fmt: skip
    d = analyze(job(straggler=3, lag_ms=30, seed=4), now_ns=T0, samples=_samples(per, span))
    assert d.why[0].kind == "cpu_starvation" and d.why[0].rank == 3, d.why
    assert "CPU starvation, it waits 20 ms/step longer" in d.verdict, d.verdict


def _threads(rows: pa.Table, thread: dict[str, str]) -> pa.Table:
    """``rows`` with each function's thread (``MainThread`` where not named)."""
    out = [{**row, "thread": thread.get(row["func"], "MainThread")} for row in rows.to_pylist()]
    return pa.Table.from_pylist(out)


def test_an_idle_thread_of_one_rank_only_is_not_its_cause() -> None:
    """Rank 0 alone runs a thread that sleeps (Lightning's child observer):
    its time off CPU delays nothing. The function that is slow in the thread
    that trains is named."""
    span, steps = 60 / STEPS_PER_S, 60
    per = {
        r: [("off", "/job/train.py", "load_batch", 41, (40.0 if r == 0 else 0.3) * steps),
            ("cpu", "/job/train.py", "step", 12, 5.0 * steps)]
        for r in range(4)
    }  # fmt: skip
    per[0].append(("off", "/lib/lightning/launch.py", "Observer.run", 205, 110.0 * steps))
    samples = _threads(_samples(per, span), {"Observer.run": "Thread-1"})
    d = analyze(job(straggler=0, lag_ms=30, seed=3), now_ns=T0, samples=samples)
    fn = [w for w in d.why if w.kind == "function"]
    assert [w.what for w in fn] == ["load_batch"], d.why
    assert "load_batch" in d.verdict and "Observer" not in d.verdict, d.verdict


@pytest.mark.parametrize("issues", ["collectives", "launches"])
def test_the_thread_that_trains_is_counted_whatever_its_name(issues: str) -> None:
    """A launcher runs the training loop in a ``threading.Thread`` while its
    main thread waits in the launcher's own loop. The worker thread issues the
    rank's collectives (SAMPLES_SQL's ``trains``), or launches its kernels
    (CUDA_SQL's rows, by thread): its time off CPU counts, and the function
    that sleeps 60 ms a step in it on rank 1 is named. A pin-memory thread
    that only copies is still an idle helper: its longer wait on rank 1 is not."""
    span, steps = 60 / STEPS_PER_S, 60
    per = {
        r: [("off", "/job/train.py", "attention", 41, (60.0 if r == 1 else 0.3) * steps),
            ("cpu", "/job/train.py", "step", 12, 5.0 * steps),
            ("off", "/lib/launcher/loop.py", "Launcher.poll", 88, 110.0 * steps),
            ("off", "/lib/torch/pin_memory.py", "_pin_memory_loop", 30,
             (90.0 if r == 1 else 20.0) * steps)]
        for r in range(4)
    }  # fmt: skip
    thread = {"Launcher.poll": ("MainThread", 100), "_pin_memory_loop": ("Thread-2", 300)}
    rows, cuda = [], []
    for row in _samples(per, span).to_pylist():
        name, tid = thread.get(row["func"], ("Thread-1 (train)", 200))
        tick = row["kind"] == "tick"  # the sampler's read: no thread's
        rows.append({**row, "thread": None if tick else name, "tid": 0 if tick else tid,
                     "trains": issues == "collectives" and tid == 200 and not tick})  # fmt: skip
    for r in range(4):
        cuda += [{"api": "cudaLaunchKernel", "tid": 200, "dur_ns": 10**6, "rank": r},
                 {"api": "cudaMemcpyAsync", "tid": 300, "dur_ns": 10**5, "rank": r}]  # fmt: skip
    d = analyze(job(straggler=1, lag_ms=60, seed=3), now_ns=T0, samples=pa.Table.from_pylist(rows),
                cuda=pa.Table.from_pylist(cuda) if issues == "launches" else None)  # fmt: skip
    assert [s.rank for s in d.stragglers] == [1], d.verdict
    fn = [w for w in d.why if w.kind == "function"]
    assert [w.what for w in fn] == ["attention"], d.why
    assert fn[0].off_cpu_ms is not None and fn[0].off_cpu_ms > 50, fn[0]
    assert "attention (/job/train.py:41)" in d.verdict and "nothing of its own" not in d.verdict
    assert "_pin_memory_loop" not in d.verdict and "Launcher" not in d.verdict, d.verdict


def test_a_hang_in_a_subgroup_names_only_that_groups_missing_rank() -> None:
    rows = []
    for r in (2, 3):  # a 2-rank tensor-parallel group; rank 3 never enters #10
        for k in range(11 if r == 2 else 10):
            ts = T0 + k * 10**8
            rows.append({"backend": "gloo", "op": "allreduce", "comm": 0x10 + r, "seq": k,
                         "comm_rank": r - 2, "nranks": 2, "bytes": 16, "ts": ts,
                         "dur_ns": None if k == 10 else 10**6, "pid": 100 + r,
                         "node": "n", "rank": r, "pg": "3"})  # fmt: skip
    for r in (0, 1):  # the world group carries on meanwhile for ranks 0 and 1's view
        rows.append({"backend": "gloo", "op": "barrier", "comm": 0x20 + r, "seq": 0,
                     "comm_rank": r, "nranks": 4, "bytes": 0, "ts": T0, "dur_ns": 10**6,
                     "pid": 100 + r, "node": "n", "rank": r, "pg": "0"})  # fmt: skip
    d = analyze(pa.Table.from_pylist(rows), now_ns=T0 + 30 * 10**9, hang_after_s=5)
    [h] = d.hangs
    assert h.comm == "gloo/pg3" and h.missing_ranks == [3] and h.waiting_ranks == [2]


def test_repeated_diagnoses_of_one_hang_name_the_same_collective() -> None:
    t = job(hang_rank=1, hang_step=40, steps=60, seed=9)
    first = analyze(t, now_ns=T0 + 600 * 10**9)
    # later, the window has lost the oldest rows, unevenly across ranks
    rows = [r for r in t.to_pylist() if not (r["rank"] in (0, 3) and r["seq"] < 12)]
    again = analyze(pa.Table.from_pylist(rows), now_ns=T0 + 610 * 10**9)
    assert first.hangs and again.hangs
    assert (first.hangs[0].comm, first.hangs[0].seq) == (again.hangs[0].comm, again.hangs[0].seq)
    assert first.verdict.split(" for ")[0] == again.verdict.split(" for ")[0]


class _Rows:
    """A job whose probes hold ``table``: each query's ``ts >= N`` window is applied
    (and calls in flight are always returned); no stacks, no other table."""

    remote = False

    def __init__(self, table: pa.Table) -> None:
        self.table = table

    def ask(self, sql: str) -> pa.Table:
        import re

        from probing.errors import ProbingError

        if "FROM comm.collectives" in sql and "GROUP BY" not in sql:
            since = int(re.search(r"ts >= (\d+)", sql).group(1))  # type: ignore[union-attr]
            keep = [r for r in self.table.to_pylist() if r["ts"] >= since or r["dur_ns"] is None]
            return pa.Table.from_pylist(keep, schema=self.table.schema)
        if "FROM process.stacks" in sql:
            return pa.table({"rank": pa.array([], pa.int64())})
        raise ProbingError("no such table here\n")

    def trace_starts_ns(self) -> list[int]:
        return []


def test_a_hang_that_began_just_inside_the_window_is_numbered_as_later() -> None:
    """The window starts between the last completed collective and the hang: the
    calls before it are fetched too, so each rank's numbers line up (without them,
    no rank could be aligned) and the hang is named as it is a minute later."""
    from probing.cli.asking import diagnose

    t = job(hang_rank=1, hang_step=40, steps=60, seed=9)
    rows = t.to_pylist()
    began = min(r["ts"] for r in rows if r["dur_ns"] is None)
    last_done = max(r["ts"] + r["dur_ns"] for r in rows if r["dur_ns"] is not None)
    assert last_done < began
    later = analyze(t, now_ns=began + 90 * 10**9, hang_after_s=5)
    window_s = 30.0
    since = (last_done + began) // 2  # just before the hang: no completed call in the window
    d, _ = diagnose(_Rows(t), window_s=window_s, hang_after_s=5, now_ns=since + int(window_s * 1e9))
    [h] = d.hangs
    assert h.missing_ranks == [1] and h.waiting_ranks == [0, 2, 3], d.verdict
    assert (h.comm, h.seq) == (later.hangs[0].comm, later.hangs[0].seq)


def test_a_partner_released_late_by_a_subgroup_straggler_is_not_named() -> None:
    """2 x 2 groups: rank 2 works 60 ms before the tensor-parallel all-reduce with
    rank 3, so both reach the next world all-reduce late; only rank 2 is named."""
    rng = np.random.default_rng(4)
    rows = []
    t = float(T0)
    world, tp = {r: 0x100 + r for r in range(4)}, {r: 0x200 + r for r in range(4)}
    for k in range(60):
        arrive = t + rng.normal(0, 2e6, 4)
        arrive[2] += 60e6  # rank 2's shard of work, before its tensor-parallel all-reduce
        for pair in ((0, 1), (2, 3)):
            end = max(arrive[list(pair)]) + 1e6
            for r in pair:
                rows.append({"backend": "gloo", "op": "allreduce", "comm": tp[r], "seq": k,
                             "comm_rank": r % 2, "nranks": 2, "bytes": 16, "ts": int(arrive[r]),
                             "dur_ns": int(end - arrive[r]), "pid": 100 + r, "node": "n",
                             "rank": r, "pg": str(3 + r // 2)})  # fmt: skip
                arrive[r] = end
        nxt = arrive + 20e6 + rng.normal(0, 2e6, 4)  # the next step's world all-reduce
        end = nxt.max() + 1e6
        for r in range(4):
            rows.append({"backend": "gloo", "op": "allreduce", "comm": world[r], "seq": k,
                         "comm_rank": r, "nranks": 4, "bytes": 16, "ts": int(nxt[r]),
                         "dur_ns": int(end - nxt[r]), "pid": 100 + r, "node": "n", "rank": r,
                         "pg": "0"})  # fmt: skip
        t = end + 10e6
    d = analyze(pa.Table.from_pylist(rows), now_ns=T0)
    assert [s.rank for s in d.stragglers] == [2], d.verdict
    assert "gloo/pg4" in d.stragglers[0].groups


def test_why_compares_cuda_call_time_per_step() -> None:
    # 60 steps; rank 2 synchronises 40 ms a step longer than the others
    cuda = pa.Table.from_pylist(
        [{"api": "cudaStreamSynchronize", "dur_ns": int((42.0 if r == 2 else 2.0) * 60 * 1e6),
          "n": 60, "rank": r} for r in range(4)]
        + [{"api": "cudaLaunchKernel", "dur_ns": int(0.5 * 60 * 1e6), "n": 600, "rank": r}
           for r in range(4)]
    )  # fmt: skip
    d = analyze(job(straggler=2, lag_ms=30, seed=2), now_ns=T0, cuda=cuda)
    [w] = [w for w in d.why if w.kind == "cuda"]
    assert w.what == "cudaStreamSynchronize" and w.rank == 2
    assert 35 < w.ms_per_step - w.others_ms_per_step < 45, w
    assert w.text.startswith("rank 2: CUDA cudaStreamSynchronize ")


def test_too_few_collectives_give_no_verdict_not_a_healthy_one() -> None:
    d = analyze(job(jitter_ms=30.0, steps=7, seed=1), now_ns=T0, window_s=10)
    assert not d.stragglers and 0 < (d.summary.busiest or 0) < coll.MIN_COLLECTIVES
    assert d.verdict.startswith(f"no verdict: only {d.summary.busiest} complete collectives")
    assert "longer --window" in d.verdict


@pytest.mark.parametrize("seed", range(4))
def test_a_persistent_lateness_of_a_few_percent_beyond_doubt_is_named(seed: int) -> None:
    # 1.6 ms late in a ~33 ms step, every step, under 2 ms of jitter: below the 2 ms
    # floor of a moderately sure test, but p < 1e-7 over 300 collectives
    rank = seed % 4
    t = job(steps=300, step_ms=25.0, jitter_ms=2.0, straggler=rank, lag_ms=1.6, seed=seed)
    d = analyze(t, now_ns=T0)
    assert [s.rank for s in d.stragglers] == [rank], d.verdict
    assert d.stragglers[0].p_value < 1e-7


@pytest.mark.parametrize("seed", range(4))
def test_a_rank_the_machine_favours_a_little_is_not_named(seed: int) -> None:
    # 0.5 ms later in a ~33 ms step, every step: certain, but 1.5 % of a step
    t = job(steps=300, step_ms=25.0, jitter_ms=1.0, straggler=seed % 4, lag_ms=0.5, seed=seed)
    d = analyze(t, now_ns=T0)
    assert d.healthy and d.verdict.startswith("healthy: 4 ranks"), d.verdict
    late = max(d.ranks, key=lambda r: r["excess_ms_median"])
    assert late["rank"] == seed % 4 and late["excess_ms_median"] < 1.0


def test_a_slowed_function_heads_the_verdict_with_its_share_not_a_busy_machine() -> None:
    """HF Trainer's case: a data collator sleeps ~30 ms a step on rank 2 on a
    machine where every rank waits ~85 ms a step for a CPU, rank 2 2 ms more:
    the function explains the lateness, the 2 ms are noise between ranks."""
    span, steps = 60 / STEPS_PER_S, 60
    runq = {0: 84.0, 1: 85.5, 2: 86.2, 3: 83.0}
    per = {
        r: [("cpu", "/job/train.py", "forward", 30, 10.0 * steps),
            ("runq", "/job/train.py", "forward", 30, runq[r] * steps)]
        + ([("off", "/job/train.py", "collate_tokens", 29, 30.0 * steps)] if r == 2 else [])
        for r in range(4)
    }  # fmt: skip
    samples = _samples(per, span).to_pylist()
    for row in samples:  # transformers' Trainer called it
        row.update(via_file=None, via_func=None)
        if row["func"] == "collate_tokens":
            row.update(via_file="/venv/lib/python3.11/site-packages/transformers/trainer.py",
                       via_func="Trainer.get_batch_samples")  # fmt: skip
    d = analyze(
        job(straggler=2, lag_ms=30, seed=2), now_ns=T0, samples=pa.Table.from_pylist(samples)
    )
    head = d.why[0]
    assert head.kind == "function" and head.what == "collate_tokens", d.why
    assert "collate_tokens (/job/train.py:29) via transformers Trainer.get_batch_samples " in (
        head.text
    )
    assert head.share is not None and head.share >= 0.9
    assert not [w for w in d.why if w.kind == "cpu_starvation"], d.why
    assert "collate_tokens (/job/train.py:29)" in d.verdict and "% of its lateness" in d.verdict
    assert "CPU starvation" not in d.verdict


def test_a_wait_for_a_cpu_within_the_noise_between_ranks_is_not_starvation() -> None:
    """Rank 1 waits 16 ms a step longer for a CPU, about its lateness, but the
    others' waits differ by 20 ms among themselves: not starvation."""
    span, steps = 60 / STEPS_PER_S, 60
    runq = {0: 60.0, 1: 86.0, 2: 70.0, 3: 80.0}
    per = {
        r: [("cpu", "/job/train.py", "forward", 30, 10.0 * steps),
            ("runq", "/job/train.py", "forward", 30, runq[r] * steps)]
        for r in range(4)
    }  # fmt: skip
    d = analyze(job(straggler=1, lag_ms=30, seed=5), now_ns=T0, samples=_samples(per, span))
    assert not [w for w in d.why if w.kind == "cpu_starvation"], d.why
    assert "CPU starvation" not in d.verdict


def test_when_no_cause_explains_most_of_the_lateness_the_verdict_says_so() -> None:
    span, steps = 60 / STEPS_PER_S, 60
    per = {r: [("cpu", "/job/train.py", "forward", 30, 10.0 * steps)] for r in range(4)}
    per[3].append(("cpu", "/job/train.py", "tokenize", 12, 8.0 * steps))  # 8 of 30 ms
    d = analyze(job(straggler=3, lag_ms=30, seed=3), now_ns=T0, samples=_samples(per, span))
    [w] = [w for w in d.why if w.kind == "function"]
    assert w.what == "tokenize" and w.share is not None and 0.15 < w.share < 0.4, w
    assert "no single cause explains most of its lateness (the largest: tokenize" in d.verdict


def test_the_evidence_table_leaves_out_a_column_no_rank_has() -> None:
    d = analyze(job(straggler=1, lag_ms=30, seed=5), now_ns=T0)
    assert all(r["count"] is None for r in d.ranks)  # no torch counts: none asked
    table = render(d).split("\n\n")[1]
    assert "RANK" in table and "LAST %" in table and "COUNT" not in table


def _gpus(throttled: int, **mine: float) -> pa.Table:
    """NVML_SQL rows: one GPU per rank, ``throttled``'s held by its power cap."""
    rows = [{"gpu": r, "sm_mhz": 1210.0 if r == throttled else 1980.0,
             "reasons": 0x4 if r == throttled else 0, "power_w": 300.0, "temp_c": 60,
             "xids": 0, "xid": None, "ecc": 0, "pcie_kbs": 2e6, "nvlink_kib": None,
             "span_ns": int(60e9), "rank": r} for r in range(4)]  # fmt: skip
    rows[throttled].update(mine)
    return pa.Table.from_pylist(rows)


def test_a_throttled_gpu_heads_the_cuda_wait_it_causes() -> None:
    cuda = pa.Table.from_pylist(
        [{"api": "cudaStreamSynchronize", "dur_ns": int((32.0 if r == 2 else 2.0) * 60 * 1e6),
          "n": 60, "rank": r} for r in range(4)]
    )  # fmt: skip
    d = analyze(job(straggler=2, lag_ms=30, seed=2), now_ns=T0, cuda=cuda, nvml=_gpus(2))
    [gpu] = [w for w in d.why if w.kind == "gpu"]
    assert gpu.text == "rank 2: its GPU runs at 1.21 GHz vs 1.98 GHz on the others (power cap)"
    assert gpu.share is not None and gpu.share > 0.8  # the wait it makes rank 2 do
    assert "its GPU runs at 1.21 GHz vs 1.98 GHz on the others (power cap), " in d.verdict
    assert "% of its lateness" in d.verdict


def test_errors_and_a_slow_link_only_the_straggler_has_are_told() -> None:
    nvml = _gpus(1, sm_mhz=1980.0, reasons=0, xids=2, xid=79, ecc=3, pcie_kbs=2e5)
    d = analyze(job(straggler=1, lag_ms=30, seed=5), now_ns=T0, nvml=nvml)
    [gpu] = [w for w in d.why if w.kind == "gpu"]
    assert "reported 2 XID error(s) (last: XID 79)" in gpu.text
    assert "3 uncorrected ECC error(s)" in gpu.text and "its PCIe moves 195 MB/s vs" in gpu.text
    assert "its GPU reported 2 XID" in d.verdict


def test_extra_cpu_work_heads_the_verdict_over_a_throttled_gpu() -> None:
    span, steps = 60 / STEPS_PER_S, 60
    per = {r: [("cpu", "/job/train.py", "forward", 30, 10.0 * steps)] for r in range(4)}
    per[2].append(("cpu", "/job/train.py", "heavy_features", 61, 30.0 * steps))
    d = analyze(job(straggler=2, lag_ms=30, seed=2), now_ns=T0,
                samples=_samples(per, span), nvml=_gpus(2))  # fmt: skip
    assert "heavy_features (/job/train.py:61)" in d.verdict, d.verdict
    assert [w for w in d.why if w.kind == "gpu"]  # still told, below


def test_a_rank_waiting_for_a_slow_dataloader_worker_says_so() -> None:
    span, steps = 60 / STEPS_PER_S, 60
    rows = _samples(
        {r: [("cpu", "/job/train.py", "forward", 30, 10.0 * steps)] for r in range(4)}, span
    ).to_pylist()
    for row in rows:
        row["loader"] = False
    for r in range(4):  # every rank waits on its loader; rank 1 ~30 ms a step longer
        rows.append({"kind": "off", "file": "/venv/lib/python3.11/site-packages/torch/utils/"
                     "data/dataloader.py", "func": "_MultiProcessingDataLoaderIter._get_data",
                     "line": 1440, "loader": True, "n": 1, "rank": r,
                     "dur_ns": int((31.0 if r == 1 else 1.0) * steps * 1e6)})  # fmt: skip
    d = analyze(job(straggler=1, lag_ms=30, seed=5), now_ns=T0, samples=pa.Table.from_pylist(rows))
    head = d.why[0]
    assert head.text.startswith("rank 1: waits for its DataLoader's worker processes "), head
    assert head.text.endswith(
        "(mostly off CPU): its workers take longer for a batch than the others'"
    )
    assert "its DataLoader's worker processes" in d.verdict


def _cpus(rank: int, one_node: bool = False, **mine: float) -> pa.Table:
    """CPU_SQL rows: every rank's CPU at 2.1 GHz, its node 2 % stolen; each
    rank on a node of its own, or all on one (``one_node``)."""
    rows = [{"cpu": r % 2, "mhz": 2100.0, "max_mhz": None, "steal_pct": 2.0, "busy_pct": 90.0,
             "rank": r, "node": "n0" if one_node else f"n{r}"} for r in range(4)]  # fmt: skip
    rows[rank].update(mine)
    return pa.Table.from_pylist(rows)


def test_a_hypervisors_steal_heads_the_starvation_it_causes() -> None:
    span, steps = 60 / STEPS_PER_S, 60
    per = {
        r: [("cpu", "/job/train.py", "forward", 30, 10.0 * steps),
            ("runq", "/job/train.py", "forward", 30, 20.0 * steps)]
        for r in range(4)
    }  # fmt: skip
    samples = _native(
        _samples(per, span), {r: (45.0 if r == 1 else 15.0) * steps for r in range(4)}
    )
    d = analyze(job(straggler=1, lag_ms=30, seed=5), now_ns=T0, samples=samples,
                cpu=_cpus(1, steal_pct=31.0))  # fmt: skip
    assert [w.kind for w in d.why][:2] == ["cpu_starvation", "cpu"], d.why
    assert "a hypervisor takes 31 % of its node's CPU time (2 % on the other nodes'), " in d.verdict
    # ranks of one node read its steal at other instants: a difference is no cause
    same = analyze(job(straggler=1, lag_ms=30, seed=5), now_ns=T0, samples=samples,
                   cpu=_cpus(1, one_node=True, steal_pct=31.0))  # fmt: skip
    assert "hypervisor" not in same.verdict and "CPU starvation, it waits" in same.verdict
    # the same wait for a CPU with nothing stolen is starvation, said as such
    plain = analyze(job(straggler=1, lag_ms=30, seed=5), now_ns=T0, samples=samples,
                    cpu=_cpus(1))  # fmt: skip
    assert "CPU starvation, it waits" in plain.verdict


def test_a_slower_cpu_clock_heads_the_same_code_running_slower() -> None:
    span, steps = 60 / STEPS_PER_S, 60
    per = {r: [("cpu", "/job/train.py", "forward", 30, (26.0 if r == 3 else 10.0) * steps)]
           for r in range(4)}  # fmt: skip
    d = analyze(job(straggler=3, lag_ms=16, seed=3), now_ns=T0, samples=_samples(per, span),
                cpu=_cpus(3, mhz=800.0))  # fmt: skip
    assert "its CPU runs at 0.80 GHz vs 2.10 GHz on the others, " in d.verdict, d.verdict
    # extra work on a slower CPU is still the work's
    per[3].append(("cpu", "/job/train.py", "augment", 40, 30.0 * steps))
    d = analyze(job(straggler=3, lag_ms=40, seed=3), now_ns=T0, samples=_samples(per, span),
                cpu=_cpus(3, mhz=800.0))  # fmt: skip
    assert ": augment (/job/train.py:40)" in d.verdict, d.verdict


def test_a_rank_that_died_is_said_first_with_the_collective_it_died_in() -> None:
    """Rank 1 was killed inside collective 30 (entered, never left), the
    others wait there: the verdict says it died, when, and in which."""
    t = job(hang_rank=None, steps=31, seed=6).to_pylist()
    last = max(r["seq"] + 0 for r in t if r["rank"] == 1)
    for r in t:
        if r["rank"] == 1 and r["seq"] == last:
            r["dur_ns"] = None  # in it when it died
    died = max(r["ts"] for r in t)
    dead = [{"pid": 100 + r, "alive": r != 1, "died_ns": died if r == 1 else None, "rank": r}
            for r in range(4)]  # fmt: skip
    d = analyze(pa.Table.from_pylist(t), now_ns=died + 60 * 10**9, hang_after_s=5, dead=dead)
    assert not d.healthy and list(d.dead) == [1]
    assert d.verdict.startswith("rank 1 (pid 101) died at "), d.verdict
    assert " in allreduce #" in d.verdict.split(";")[0], d.verdict
    assert d.to_json()["dead"]["1"]["pid"] == 101


def test_a_named_rank_whose_samples_show_nothing_of_its_own_says_so() -> None:
    """Named, sampled, and every function, wait and call as the others': the
    verdict says nothing of the rank's own explains it, and where to look,
    rather than ending at the lateness; unsampled, it says nothing more."""
    span, steps = 60 / STEPS_PER_S, 60
    alike = [("cpu", "/job/train.py", "step", 12, 5.0 * steps),
             ("off", "/job/train.py", "load_batch", 41, 2.0 * steps)]  # fmt: skip
    per = {r: alike for r in range(4)}
    t = job(straggler=2, lag_ms=30, seed=2)
    d = analyze(t, now_ns=T0, samples=_samples(per, span))
    assert [s.rank for s in d.stragglers] == [2]
    assert not [w for w in d.why if w.kind == "function"], d.why
    assert d.verdict.endswith(
        "; nothing of its own explains it: its functions, their waits for a CPU, its CUDA "
        "calls and its hardware are as the others' (another process on its CPU, or its "
        "network?)"
    ), d.verdict
    assert "nothing of its own" not in analyze(t, now_ns=T0).verdict
