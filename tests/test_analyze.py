"""probing.analyze on canned collectives: several ranks, each traced from a
different moment (so their sequence numbers disagree), per-process comm
pointers, arrival noise, and one straggler, a slow link, jitter or a hang."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from probing.analyze import analyze
from probing.analyze import collectives as coll
from probing.analyze import evidence as ev
from probing.analyze import hangs as hg
from probing.analyze import stragglers as sg
from probing.analyze.diagnose import _rank_rows
from probing.analyze.tables import sql_tables
from probing.cli.render import diagnosis as render
from probing.node.sql import Database
from probing.node.store import Store

T0 = 1_763_880_000 * 10**9  # a wall-clock ns


def job(
    *,
    ranks: int = 4,
    steps: int = 60,
    step_ms: float = 80.0,
    jitter_ms: float = 1.0,
    straggler: int | None = None,
    lag_ms: float = 30.0,
    slow_from: int = 0,
    link_ms: float = 0.4,
    link_from: int = 0,
    hang_rank: int | None = None,
    hang_step: int | None = None,
    backend: str = "gloo",
    behind_link: int | None = None,
    seed: int = 0,
    buckets: int = 1,
    every: int = 1,
) -> pa.Table:
    """Rows as ``gather(queries()["collectives"])`` returns them for a synchronous
    DDP job: ``buckets`` all-reduces a step (of different sizes, back to back in
    its backward pass), the straggler late by ``lag_ms`` before the first (at
    one step in ``every``)."""
    rng = np.random.default_rng(seed)
    skipped = rng.integers(0, 5, size=ranks)  # collectives before each rank's trace began
    comm_ptr = rng.integers(1 << 40, 1 << 44, size=ranks)  # a local pointer per process
    rows = []
    t = np.full(ranks, float(T0))
    for k in range(steps * buckets):
        arrive = t + rng.normal(0, jitter_ms, size=ranks).clip(-3 * jitter_ms, 3 * jitter_ms) * 1e6
        first = k % buckets == 0
        arrive += 5e6 if first else 1e6  # compute: the forward pass, or the next bucket's
        if (
            straggler is not None
            and k >= slow_from * buckets
            and first
            and k // buckets % every == 0
        ):
            arrive[straggler] += lag_ms * 1e6 * rng.uniform(0.8, 1.2)
        link = link_ms if k >= link_from * buckets else 0.4
        end = arrive.max() + link * 1e6 * rng.uniform(0.9, 1.1)
        ends = np.full(ranks, end)
        if behind_link is not None:  # the last hop's data reaches it one link delay later
            ends[behind_link] += link * 1e6 / 2
        hung = hang_step is not None and k >= hang_step
        for r in range(ranks):
            if k < skipped[r] or (hung and (r == hang_rank or k > hang_step)):
                continue
            in_flight = hung and k == hang_step
            rows.append(
                {
                    "backend": backend, "op": "allreduce", "comm": int(comm_ptr[r]),
                    "seq": k - int(skipped[r]), "comm_rank": r, "nranks": ranks,
                    "bytes": 4 * 20_000 * (1 + k % buckets), "ts": int(arrive[r]),
                    "dur_ns": None if in_flight else int(ends[r] + rng.uniform(0, 2e4) - arrive[r]),
                    "pid": 1000 + r, "node": f"host{r // 2}", "rank": r,
                }
            )  # fmt: skip
        t = ends + (step_ms * 1e6 if k % buckets == buckets - 1 else 0)
    return pa.Table.from_pylist(rows)


def test_collectives_match_across_ranks_despite_different_trace_starts() -> None:
    matched = coll.match(job(steps=20))
    complete = [c for c in matched if c.complete]
    # every rank's rows line up: the collectives every rank traced are complete
    assert len(complete) >= 15
    assert len({c.comm for c in matched}) == 1 and matched[0].comm == "gloo/n4#0"
    for c in complete:
        ends = list(c.end.values())
        assert max(ends) - min(ends) < 1e6  # synchronous: every rank returns together


def test_nccl_unique_id_is_the_cross_process_identity() -> None:
    t = job(steps=10, backend="nccl")
    t = t.set_column(t.schema.get_field_index("comm"), "comm", pa.array([0xABC] * t.num_rows))
    assert {c.comm for c in coll.match(t)} == {"nccl:abc"}


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_a_straggler_is_named_with_its_lag_share_and_since(rank: int) -> None:
    d = analyze(job(straggler=rank, lag_ms=30, slow_from=25, seed=rank), now_ns=T0)
    assert not d.healthy and not d.hangs and not d.slow_links
    [s] = d.stragglers
    assert s.rank == rank and s.node == f"host{rank // 2}"
    assert 25 < s.lag_ms_mean < 35 and s.lag_ms_p99 > s.lag_ms_mean
    assert s.last_share > 0.55  # slow for the last 35 of 60 collectives
    # about 30 ms lost per 115 ms step, since step 25
    assert 0.1 < s.share_of_step < 0.3
    matched = [c for c in coll.match(job(straggler=rank, slow_from=25, seed=rank)) if c.complete]
    change = min(c.ts[rank] for c in matched if c.seq >= 25 - 5)
    assert not s.since_start and abs(s.since_ns - change) < 0.5e9
    # every figure per step is the job's: ~30 ms late a ~115 ms step, ~26 % lost
    assert abs(s.step_ms - 115) < 11.5 and abs(s.late_ms - 30) < 3 and s.period == 1
    assert abs(s.share_of_step - 30 / 115) < 0.1
    assert d.verdict.startswith(f"rank {rank} on node host{rank // 2} is {s.late_ms:.0f} ms late")
    assert f"each {s.step_ms:.0f} ms step" in d.verdict and "of its step time" in d.verdict


@pytest.mark.parametrize("buckets", [2, 3, 5])
def test_several_collectives_a_step_give_the_jobs_own_step(buckets: int) -> None:
    # DDP's buckets: several all-reduces a step, the straggler late before the first
    table = job(straggler=1, lag_ms=40, buckets=buckets, seed=buckets)
    d = analyze(table, now_ns=T0)
    [s] = d.stragglers
    # the job's own step: its last all-reduce's end to the next one's, 80 ms, plus the
    # forward pass (5 ms), the other buckets (1 ms each), the links and 40 ms of lag
    truth = 80 + 5 + (buckets - 1) + 0.4 * buckets + 40
    assert s.period == buckets and abs(s.step_ms - truth) < 0.1 * truth
    assert d.summary.step_ms is not None and abs(d.summary.step_ms - truth) < 0.1 * truth
    assert abs(s.late_ms - 40) < 4 and abs(s.share_of_step - 40 / truth) < 0.1
    assert f"is {s.late_ms:.0f} ms late each {s.step_ms:.0f} ms step" in d.verdict


def test_a_straggler_slow_from_the_start_says_since_at_least() -> None:
    d = analyze(job(straggler=2, lag_ms=15, seed=7), now_ns=T0)
    [s] = d.stragglers
    assert s.rank == 2 and s.since_start and s.last_share > 0.95
    assert "since at least" in d.verdict


@pytest.mark.parametrize("seed", range(10))
def test_a_healthy_job_with_jitter_raises_nothing(seed: int) -> None:
    d = analyze(job(jitter_ms=4.0, seed=seed), now_ns=T0)
    assert d.healthy, d.verdict
    assert d.verdict.startswith("healthy: 4 ranks")
    assert d.summary.collectives >= 50 and d.summary.last_share_max < 0.5


def test_one_noisy_step_raises_nothing() -> None:
    t = job(seed=3).to_pylist()
    for r in t:  # rank 1 is 200 ms late once
        if r["rank"] == 1 and r["seq"] == 30:
            r["ts"] += 200_000_000
    assert analyze(pa.Table.from_pylist(t), now_ns=T0).healthy


def test_a_slow_link_is_slow_for_every_rank_without_skew() -> None:
    d = analyze(job(link_ms=60.0, link_from=20, seed=4), now_ns=T0)
    assert not d.stragglers and not d.hangs
    [link] = d.slow_links
    assert 50 < link.transfer_ms_median < 70 and link.skew_ms_median < 5
    assert link.nodes == ["host0", "host1"] and link.share_of_step > 0.2
    assert d.verdict.startswith("slow link: allreduce on gloo/n4#0 takes")


def test_a_rank_behind_a_slow_link_is_released_late_not_a_straggler() -> None:
    # rank 1 gets the last hop 30 ms late, so it arrives last at the next one:
    # its own time between collectives is like the others', the link is slow
    d = analyze(job(link_ms=60.0, behind_link=1, seed=8), now_ns=T0)
    assert not d.stragglers, d.verdict
    assert [s.comm for s in d.slow_links] == ["gloo/n4#0"]
    assert sg.released_late(
        [c for c in coll.match(job(link_ms=60.0, behind_link=1, seed=8)) if c.complete], 1, 30.0
    )


def test_a_traced_hang_names_the_missing_rank() -> None:
    t = job(steps=30, hang_rank=3, hang_step=25, seed=5)
    last = max(r["ts"] for r in t.to_pylist())
    frames = {
        3: [{"tid": 9, "thread": "MainThread", "state": "idle", "depth": 0,
             "func": "load_batch", "file": "train.py", "line": 12}],
        0: [{"tid": 8, "thread": "MainThread", "state": "waiting", "depth": 0,
             "func": "all_reduce", "file": "torch/distributed/distributed_c10d.py",
             "line": 2500}],
    }  # fmt: skip
    early = analyze(t, frames=frames, now_ns=last + 2 * 10**9)
    assert early.healthy or not early.hangs  # 2 s is not a hang yet
    d = analyze(t, frames=frames, now_ns=last + 12 * 10**9)
    [h] = d.hangs
    assert h.missing_ranks == [3] and h.waiting_ranks == [0, 1, 2] and h.evidence == "traced"
    assert h.age_s >= 12 and h.op == "allreduce"
    assert h.stacks[3][1].startswith("load_batch (train.py:12)")
    assert "all_reduce" in h.stacks[0][1]
    assert d.verdict.startswith("hang: ranks 0, 1, 2 wait in allreduce #")
    out = d.to_json()
    assert out["hangs"][0]["missing_ranks"] == [3] and "3" in out["hangs"][0]["stacks"]


def _state(rank: int, count: int, func: str, file: str) -> hg.RankState:
    frame = {"tid": rank, "thread": "MainThread", "state": "waiting", "depth": 0,
             "func": func, "file": file, "line": 1}  # fmt: skip
    return hg.RankState(rank, "h", {"default_pg": count}, [frame])


def test_a_hang_found_after_the_fact_from_counts_and_stacks() -> None:
    states = [_state(r, 41, "backward", "torch/autograd/__init__.py") for r in (0, 1, 3)]
    states.append(_state(2, 40, "sleep", "train.py"))
    assert hg.snapshot_hangs(states, stalled_s=3.0, hang_after_s=10) == []
    [h] = hg.snapshot_hangs(states, stalled_s=11.0, hang_after_s=10)
    assert (h.comm, h.seq, h.missing_ranks, h.waiting_ranks) == (
        "process group default_pg",
        40,
        [2],
        [0, 1, 3],
    )
    assert set(h.stacks) == {2, 0}
    d = analyze(pa.table({}), frames={s.rank: s.frames for s in states}, states=states,
                stalled_s=11.0)  # fmt: skip
    assert d.hangs and not d.healthy and "rank 2 never entered it" in d.verdict
    text = render(d)
    assert "rank 2 (missing)" in text and "rank 0 (waiting)" in text
    assert all(len(line) <= 80 for line in text.splitlines())


def test_without_counts_the_stacks_tell_who_waits() -> None:
    states = [_state(r, 0, "backward", "torch/autograd/__init__.py") for r in (0, 1, 3)]
    states.append(_state(2, 0, "load_batch", "train.py"))
    for s in states:
        s.counts = {}  # python.`expr` is refused over TCP: no counts from a cluster
    d = analyze(pa.table({}), frames={s.rank: s.frames for s in states}, states=states,
                stalled_s=11.0)  # fmt: skip
    [h] = d.hangs
    assert (h.missing_ranks, h.waiting_ranks, h.evidence) == ([2], [0, 1, 3], "stacks")
    assert d.verdict.startswith("hang: ranks 0, 1, 3 wait in a collective (by their stacks)")


def test_equal_counts_are_no_hang() -> None:
    states = [_state(r, 41, "step", "train.py") for r in range(4)]
    assert hg.snapshot_hangs(states, stalled_s=60.0) == []


def test_change_point_and_binomial_tail() -> None:
    x = np.r_[np.zeros(30), np.full(20, 5.0)] + np.random.default_rng(1).normal(0, 0.3, 50)
    k, score = ev.change_point(x)
    assert k == 30 and score > 3
    assert ev.binom_tail(10, 10, 0.25) == pytest.approx(0.25**10)
    assert ev.binom_tail(0, 10, 0.25) == 1.0
    # a long window's tail, summed term by term from lgamma
    n, p = 3000, 0.25
    for k in (700, 760, 900, 3000):
        terms = [
            math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
                     + i * math.log(p) + (n - i) * math.log1p(-p))
            for i in range(k, n + 1)
        ]  # fmt: skip
        assert ev.binom_tail(k, n, p) == pytest.approx(min(1.0, sum(terms)), rel=1e-9)


def _collective(seq: int, ts: dict[int, int]) -> coll.Collective:
    return coll.Collective("c", seq, "allreduce", 4, 8, ts, {r: t + 5 for r, t in ts.items()})


def test_a_window_is_read_as_each_collective_says() -> None:
    """``Seen`` and ``evidence`` read the window as arrays: what they say of
    each collective is what its own arrivals say, with ties, ranks missing
    and a rank alone."""
    cs = [
        _collective(0, {0: 10, 1: 30, 2: 20, 3: 25}),
        _collective(1, {3: 100, 1: 140, 0: 140, 2: 90}),  # a tie last: 0, after 1 in its order
        _collective(2, {0: 200, 2: 260}),  # ranks 1 and 3 not there
        _collective(3, {1: 300}),  # alone
        _collective(4, {2: 410, 1: 400, 0: 460, 3: 400}),
    ]
    seen = ev.Seen.of(cs)
    assert seen.ranks == [0, 1, 2, 3]
    assert seen.last.tolist() == [1, 0, 2, -1, 0]
    assert np.allclose(seen.lead_ms[[0, 1, 2, 4]], np.array([5, 0, 60, 50]) / 1e6)
    assert np.isnan(seen.lead_ms[3])
    assert seen.arrive[2].tolist()[0] == 190 and np.isnan(seen.arrive[2, 1])
    both = [c for c in cs if 0 in c.ts]
    e = ev.evidence(both, 0)
    # last at the 2nd (tie: not after every other) no; at the 5th yes, by 50 ns
    assert (e.collectives, e.last) == (4, 1)
    assert e.p_excess == ev.order_p(np.array([0, 2, 0, 3]), np.array([4, 4, 2, 4]))
    assert e.step_ms == pytest.approx(np.median(np.diff([10, 90, 200, 400])) / 1e6)
    # every rank's row: of the 3 collectives every rank returned from
    rows = {r["rank"]: r for r in _rank_rows(cs, [0, 1, 2, 3], {}, {}, [])}
    assert [rows[r]["collectives"] for r in range(4)] == [3, 3, 3, 3]
    assert rows[0]["lag_ms_mean"] == round((0 + 50 + 60) / 3 / 1e6, 2)
    # the last of a tie is the first of them in its order (the 2nd: rank 1)
    assert (rows[0]["last_pct"], rows[1]["last_pct"], rows[2]["last_pct"]) == (33.3, 66.7, 0.0)


def test_json_shape_and_sql_tables() -> None:
    t = job(straggler=1, seed=2)
    d = analyze(t, now_ns=T0)
    out = json.loads(json.dumps(d.to_json()))
    assert {"healthy", "verdict", "stragglers", "slow_links", "hangs"} <= set(out)
    s = out["stragglers"][0]
    assert {"rank", "node", "lag_ms_mean", "lag_ms_p99", "share_of_step", "since"} <= set(s)
    assert s["since"].endswith("Z")
    database = Database(Store())
    for name, table in sql_tables(d, t).items():
        database.register_table("analyze", name, lambda table=table: table)
    rows = database.sql(
        "SELECT rank, last_share, since_ns, since_utc FROM analyze.stragglers"
    ).to_pylist()
    assert [r["rank"] for r in rows] == [1]
    # times in SQL are integer ns; the ISO text is an explicitly named extra column
    assert rows[0]["since_ns"] == s["since_ns"] and rows[0]["since_utc"] == s["since"]
    ranks = database.sql("SELECT rank FROM analyze.ranks ORDER BY last_pct DESC LIMIT 1")
    assert ranks.to_pylist() == [{"rank": 1}]
    assert database.sql("SELECT count(*) AS n FROM analyze.hangs").to_pylist() == [{"n": 0}]


def test_the_json_and_the_tables_have_every_field_of_a_finding() -> None:
    """One source: a straggler's dataclass fields are its JSON keys and its
    table's columns (``since`` as ``since_utc``), and a hang's stacks by rank
    are JSON text in SQL."""
    import dataclasses

    from probing.schema import table_of

    t = job(straggler=2, seed=4)
    d = analyze(t, now_ns=T0)
    fields = [f.name for f in dataclasses.fields(sg.Straggler)]
    [s] = d.to_json()["stragglers"]
    assert list(s) == fields and s["excess_ms_median"] > 0
    [row] = sql_tables(d, t)["stragglers"].to_pylist()
    assert list(row) == [("since_utc" if f == "since" else f) for f in fields]
    assert row["since_utc"] == s["since"] and row["excess_ms_median"] == s["excess_ms_median"]
    h = hg.Hang("c", 3, "allreduce", [1], [0], 12.0, "traced", {1: ["f (a.py:2)"]})
    [hang] = table_of(hg.Hang, [h]).to_pylist()
    assert json.loads(hang["stacks"]) == {"1": ["f (a.py:2)"]} and hang["missing_ranks"] == [1]


def test_no_data_is_no_verdict() -> None:
    d = analyze(pa.table({}), now_ns=T0)
    assert not d.healthy and d.verdict.startswith("no verdict")  # unknown, not healthy


def test_calls_in_flight_do_not_throw_the_alignment_off() -> None:
    # a 40 ms straggler in a ~55 ms step: nearest *arrivals* would pair the wrong
    # steps; the synchronous returns pair them right, in-flight calls left out
    rows = job(straggler=2, lag_ms=40, step_ms=10, seed=11).to_pylist()
    last = max(r["ts"] for r in rows)
    for rank in range(4):
        mine = max((r for r in rows if r["rank"] == rank), key=lambda r: r["seq"])
        rows.append({**mine, "seq": mine["seq"] + 1, "ts": last + 10**8, "dur_ns": None})
    d = analyze(pa.Table.from_pylist(rows), now_ns=last + 2 * 10**8)
    assert [s.rank for s in d.stragglers] == [2], d.verdict


def test_stack_paths_are_short_and_collective_frames_are_seen() -> None:
    assert hg.short_path("/x/.venv/lib/python3.11/site-packages/torch/autograd/graph.py") == (
        "torch/autograd/graph.py"
    )
    assert hg.short_path("/usr/lib/python3.11/threading.py") == "threading.py"
    assert hg.short_path("train.py") == "train.py"
    inside = {"func": "all_reduce", "file": "torch/distributed/distributed_c10d.py"}
    assert hg.in_collective([inside])
    assert not hg.in_collective([{"func": "Event.wait", "file": "/usr/lib/threading.py"}])


def test_analyze_tables_in_a_probe_read_its_own_rows() -> None:
    import time

    from probing.node.assemble import install_tables
    from probing.node.bpf.families import GLOO_SCHEMA

    database = Database(Store())
    install_tables(database)
    now = time.time_ns()
    rows = [
        {"event_id": k, "ts": now - (50 - k) * 10**8, "dur_ns": 10**6, "pid": 7, "tid": 7,
         "api": "gloo::allreduce", "op": "allreduce", "comm": 0x55, "seq": k, "rank": 1,
         "nranks": 4, "elements": 10, "bytes": 40}
        for k in range(50)
    ]  # fmt: skip
    database.store.table("gloo", "calls").append_batch(
        pa.RecordBatch.from_pylist(rows, schema=GLOO_SCHEMA)
    )
    got = database.sql("SELECT count(*) AS n FROM analyze.collectives").to_pylist()
    assert got == [{"n": 50}]
    assert database.sql("SELECT count(*) AS n FROM analyze.stragglers").to_pylist() == [{"n": 0}]
    [rank] = database.sql("SELECT collectives FROM analyze.ranks").to_pylist()
    assert rank == {"collectives": 0}  # one rank alone completes no collective


def test_diagnose_bad_input_is_one_clear_line() -> None:
    from tests.conftest import cli

    cases = [
        ((), "nothing to ask: give --pid"),
        (("--pid", "999999999"), "no process with pid 999999999"),
        (("--pid", "1", "--window", "soon"), "not a duration: 'soon'"),
    ]
    for args, msg in cases:
        r = cli("diagnose", *args)
        assert r.returncode == 1 and r.stdout == ""
        assert r.stderr.startswith("probing: error: ") and msg in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_ranks_that_did_not_answer_are_reported() -> None:
    from probing.analyze.gather import MISSING_KEY, missing_ranks

    t = job(seed=1)
    gone = ["rank 5 (host9): timed out after 5 s"]
    t = t.replace_schema_metadata({MISSING_KEY: json.dumps(gone).encode()})
    assert missing_ranks(t) == gone and missing_ranks(job(seed=1)) == []
    d = analyze(t, now_ns=T0)
    d.missing = missing_ranks(t)
    assert d.to_json()["missing"] == gone
    assert "not heard from: rank 5 (host9)" in render(d)


def test_a_collective_every_rank_entered_and_none_left_is_a_hang() -> None:
    rows = job(steps=20, seed=9).to_pylist()
    last = max(r["ts"] for r in rows)
    for rank in range(4):  # everyone enters the next all-reduce; nobody returns
        mine = max((r for r in rows if r["rank"] == rank), key=lambda r: r["seq"])
        rows.append({**mine, "seq": mine["seq"] + 1, "ts": last + 10**8, "dur_ns": None})
    t = pa.Table.from_pylist(rows)
    assert not analyze(t, now_ns=last + 5 * 10**9).hangs
    d = analyze(t, now_ns=last + 15 * 10**9)
    [h] = d.hangs
    assert h.missing_ranks == [] and h.waiting_ranks == [0, 1, 2, 3] and h.age_s >= 14
    assert d.verdict.startswith("hang: every rank (0, 1, 2, 3) waits in allreduce #")


def test_callsites_pick_each_ranks_most_frequent() -> None:
    from probing.analyze.diagnose import callsites
    from probing.analyze.queries import queries

    rows = [
        {"callsite": "train.py:69 main", "n": 40, "rank": 2},
        {"callsite": "train.py:12 warmup", "n": 3, "rank": 2},
        {"callsite": None, "n": 9, "rank": 1},
        {"callsite": "train.py:69 main", "n": 41, "rank": 0},
    ]
    assert callsites(pa.Table.from_pylist(rows)) == {0: "train.py:69 main", 2: "train.py:69 main"}
    d = analyze(job(straggler=2, seed=2), now_ns=T0)
    d.callsites = {2: "train.py:69 main"}
    assert "rank 2 issues its collectives at train.py:69 main" in render(d)
    # the query plans against a probe's real tables (comm.collectives with
    # stack_id, the python.callsites view); nothing traced: no rows
    database = Database(Store())
    from probing.node.tables import install

    install(database)
    assert database.sql(queries(False)["callsites"].format(since_ns=0)).num_rows == 0
    # and so do the questions of why: which thread issued what, samples and CUDA calls
    for name in ("samples", "cuda"):
        asked = database.sql(queries(False)[name].format(since_ns=0))
        assert asked.num_rows == 0 and "tid" in asked.column_names


def test_two_groups_of_one_size_are_matched_per_group_with_comm_groups() -> None:
    """Data-parallel {0,2},{1,3}: by size and order of use both are ``n2#0``
    and their calls mix; named by ``comm.groups`` (torch's group names, the
    same in every rank) each group's calls match across its own two ranks."""
    from probing.analyze.gather import with_groups

    rows, groups = [], []
    for r in range(4):
        ptr = 0x5000 + 16 * r  # a local pointer, different in every process
        pg = "1" if r % 2 == 0 else "2"
        groups.append({"backend": "gloo", "comm": ptr, "pg": pg, "node": "h", "rank": r})
        for k in range(5):
            t = 10**9 * k + 1000 * r
            rows.append(
                {
                    "backend": "gloo", "op": "allreduce", "comm": ptr, "seq": k,
                    "comm_rank": r // 2, "nranks": 2, "bytes": 16, "ts": t, "dur_ns": 100,
                    "pid": 100 + r, "node": "h", "rank": r,
                }
            )  # fmt: skip
    table = pa.Table.from_pylist(rows)
    mixed = {c.comm: set(c.ts) for c in coll.match(table)}
    assert list(mixed.values()) == [{0, 1, 2, 3}]  # what matching by size did
    named = with_groups(table, pa.Table.from_pylist(groups))
    members = {c.comm: set(c.ts) for c in coll.match(named)}
    assert members == {"gloo/pg1": {0, 2}, "gloo/pg2": {1, 3}}


def _only(table: pa.Table, ranks: set[int]) -> pa.Table:
    keep = [r in ranks for r in table.column("rank").to_pylist()]
    return table.filter(pa.array(keep))


def test_one_rank_alone_says_to_add_cluster_not_that_nothing_was_traced() -> None:
    # one pid without --cluster: its collectives are there, but only its side of each
    table = _only(job(straggler=2, seed=3), {0})
    d = analyze(table, now_ns=T0)
    assert not d.stragglers and table.num_rows > 50
    assert d.verdict.startswith("no verdict: only rank 0 of the job's 4 answered"), d.verdict
    assert "add --cluster" in d.verdict and "every rank's pid" in d.verdict


def test_peers_not_heard_from_are_the_reason_and_no_cause_is_built_on_them() -> None:
    from probing.analyze.gather import with_missing

    gone = ["rank 1 (vm): timeout after 5 s", "rank 3 (vm): connection refused"]
    table = with_missing(_only(job(seed=4), {0, 2}), gone)
    d = analyze(table, now_ns=T0)
    assert d.missing == gone
    assert d.verdict.startswith("no verdict: not heard from rank 1 (vm): timeout"), d.verdict
    assert "rank 3 (vm): connection refused" in d.verdict and "unknown" in d.verdict


def test_a_hang_with_a_peer_unheard_blames_no_network() -> None:
    from probing.analyze.gather import with_missing

    # rank 3 hangs before #25; rank 3's probe does not answer: the others wait in
    # #25, and whether rank 3 entered it is unknown
    t = job(steps=30, hang_rank=3, hang_step=25, seed=5)
    t = with_missing(_only(t, {0, 1, 2}), ["rank 3 (host1): timeout after 5 s"])
    last = max(t.column("ts").to_pylist())
    d = analyze(t, now_ns=last + 12 * 10**9)
    assert "network" not in d.verdict and "stuck" not in d.verdict, d.verdict
    assert "not heard from rank 3 (host1)" in d.verdict and "unknown" in d.verdict


def test_a_rank_with_no_process_left_is_said_dead_and_the_hang_names_it() -> None:
    """Rank 3 was killed before any probe saw it (its node's launcher started
    it there, and no process of the job has its rank): the others wait in
    #25. It is the hang's missing rank and said dead first, not "unknown"."""
    from probing.analyze.gather import with_missing
    from probing.procs import NO_PROCESS

    t = job(steps=30, hang_rank=3, hang_step=25, seed=5)
    t = with_missing(_only(t, {0, 1, 2}), [f"rank 3 (vm): {NO_PROCESS}"], [3])
    last = max(t.column("ts").to_pylist())
    d = analyze(t, now_ns=last + 12 * 10**9)
    [h] = d.hangs
    assert h.missing_ranks == [3] and d.missing == [] and list(d.dead) == [3], d.verdict
    assert d.verdict.startswith(f"rank 3: {NO_PROCESS}; hang: ranks 0, 1, 2 wait in "), d.verdict
    assert "rank 3 never entered it" in d.verdict and "unknown" not in d.verdict
    assert "network" not in d.verdict and not d.healthy
    # one not heard from for another reason stays unknown
    t2 = with_missing(_only(job(steps=30, hang_rank=3, hang_step=25, seed=5), {0, 1, 2}),
                      ["rank 3 (vm): timeout after 5 s"], [3])  # fmt: skip
    assert "unknown" in analyze(t2, now_ns=last + 12 * 10**9).verdict


def test_a_rank_unheard_in_the_collectives_never_is_said_to_have_not_entered() -> None:
    from probing.analyze.gather import with_missing

    # rank 3 hangs before #25; rank 2's collectives timed out (its stack came
    # from another question): only rank 3 is known not to have entered #25
    t = job(steps=30, hang_rank=3, hang_step=25, seed=5)
    t = with_missing(_only(t, {0, 1, 3}), ["rank 2 (vm): timeout"], [2])
    frames = {r: [{"tid": r, "thread": "MainThread", "state": "waiting", "depth": 0,
                   "func": "f", "file": "train.py", "line": 1}] for r in range(4)}  # fmt: skip
    last = max(t.column("ts").to_pylist())
    d = analyze(t, frames=frames, now_ns=last + 12 * 10**9)
    [h] = d.hangs
    assert h.missing_ranks == [3], d.verdict
    assert "rank 3 never entered it" in d.verdict and "not heard from rank 2 (vm)" in d.verdict
    # the same gather without the ranks' numbers: rank 2 counted with those who never entered
    blind = analyze(with_missing(_only(job(steps=30, hang_rank=3, hang_step=25, seed=5),
                                       {0, 1, 3}), ["rank 2 (vm): timeout"]),
                    frames=frames, now_ns=last + 12 * 10**9)  # fmt: skip
    assert blind.hangs[0].missing_ranks == [2, 3]


def test_a_rank_alone_in_a_call_of_unknown_size_is_not_every_rank() -> None:
    # a Gloo context traced after its creation says no size: rank 0 waits in its
    # call, rank 1 answered and sits in no collective
    rows = [
        {"backend": "gloo", "op": "allreduce", "comm": 7, "seq": 157, "comm_rank": 0,
         "nranks": None, "bytes": 64, "ts": T0, "dur_ns": None, "pid": 10, "node": "vm",
         "rank": 0},
    ]  # fmt: skip
    frames = {
        0: [{"tid": 1, "thread": "MainThread", "state": "waiting", "depth": 0,
             "func": "all_reduce", "file": "torch/distributed/distributed_c10d.py", "line": 1}],
        1: [{"tid": 2, "thread": "MainThread", "state": "running", "depth": 0,
             "func": "load_batch", "file": "train.py", "line": 40}],
    }  # fmt: skip
    d = analyze(pa.Table.from_pylist(rows), frames=frames, now_ns=T0 + 20 * 10**9)
    [h] = d.hangs
    assert h.missing_ranks == [1] and h.waiting_ranks == [0]
    assert "every rank" not in d.verdict and "rank 1 never entered it" in d.verdict, d.verdict


def test_the_stack_shown_is_the_thread_that_trains_whatever_its_name() -> None:
    # the loop runs in a thread named "trainer"; the main thread only joins it
    t = job(straggler=2, lag_ms=30, seed=6)
    t = t.append_column("tid", pa.array([500 + r for r in t.column("rank").to_pylist()]))
    frames = {
        2: [
            {"tid": 2, "thread": "MainThread", "state": "waiting", "depth": 0,
             "func": "Thread._wait_for_tstate_lock", "file": "threading.py", "line": 1},
            {"tid": 2, "thread": "MainThread", "state": "waiting", "depth": 1,
             "func": "Thread.join", "file": "threading.py", "line": 2},
            {"tid": 502, "thread": "trainer", "state": "running", "depth": 0,
             "func": "upload_checkpoint", "file": "train.py", "line": 77},
            {"tid": 502, "thread": "trainer", "state": "running", "depth": 1,
             "func": "loop", "file": "train.py", "line": 90},
        ]
    }  # fmt: skip
    d = analyze(t, frames=frames, now_ns=T0)
    assert [s.rank for s in d.stragglers] == [2]
    assert d.stacks[2][0].startswith("thread trainer (502)")
    assert "upload_checkpoint (train.py:77)" in d.stacks[2]
    # untraced (no tids): the main thread only joins, so the other thread is the one
    assert hg.main_stack(frames[2])[0].startswith("thread trainer (502)")
    busy = [dict(f, func="step", file="train.py") if f["tid"] == 2 else f for f in frames[2]]
    assert hg.main_stack(busy)[0].startswith("thread MainThread (2)")


def test_the_span_said_is_within_the_window() -> None:
    from probing.analyze import coverage as cv

    since, now = T0, T0 + 60 * 10**9
    rows = [
        {"rank": 0, "start_ns": T0 - 300 * 10**9, "stop_ns": None, "state": "tracing"},
        {"rank": 1, "start_ns": T0 - 300 * 10**9, "stop_ns": T0 + 30 * 10**9,
         "state": "stopped"},
    ]  # fmt: skip
    cov = cv.coverage(rows, [0, 1], since, now)
    assert cov.span is not None and cov.span[0] < since  # the calls before number a hang
    assert cov.shown() == (since, T0 + 30 * 10**9)


def test_a_rank_late_before_one_of_many_collectives_a_step_is_named() -> None:
    # FSDP: 12 gathers and reduce-scatters a step; rank 1's loader makes it 30 ms
    # late at the first gather only, 15 % of a ~200 ms step: chance hides it over
    # all 12, not at that one
    rng = np.random.default_rng(8)
    rows, t = [], float(T0)
    for k in range(40):
        begin = t
        for j in range(12):
            arrive = begin + (5 + 12 * j + rng.normal(0, 1.0, size=4).clip(-3, 3)) * 1e6
            if j == 0 and k >= 5:
                arrive[1] += 30e6 * rng.uniform(0.9, 1.1)
            end = arrive.max() + 0.5e6
            for r in range(4):
                rows.append({
                    "backend": "gloo", "op": "allgather" if j < 8 else "reducescatter",
                    "comm": 77, "seq": 12 * k + j, "comm_rank": r, "nranks": 4,
                    "bytes": 4096 if j < 8 else 16384, "ts": int(arrive[r]),
                    "dur_ns": int(end - arrive[r]), "pid": 10 + r, "node": "vm", "rank": r,
                })  # fmt: skip
            t = end
        t += 50e6
    d = analyze(pa.Table.from_pylist(rows), now_ns=int(t))
    [s] = d.stragglers
    assert s.rank == 1 and s.period == 12, d.verdict
    assert abs(s.late_ms - 30) < 4 and abs(s.share_of_step - 30 / s.step_ms) < 0.05


def test_a_small_or_now_and_then_lateness_with_nothing_of_its_own_is_noise() -> None:
    from probing.analyze import cause as ca
    from probing.analyze import why as wy
    from probing.analyze.explain import explained

    def late(rank: int, share: float) -> sg.Straggler:
        return sg.Straggler(
            rank=rank, node="vm", lag_ms_mean=2.0, lag_ms_p99=3.0, excess_ms_median=2.0,
            last_share=0.5, share_of_step=share, since="", since_ns=0, since_start=True,
            comm="gloo/pg0", op="allreduce", collectives=100, p_value=1e-9,
        )  # fmt: skip

    def why(rank: int, kind: str) -> ca.Why:
        return ca.Why(rank, kind, "f", None, None, 5.0, 1.0, text=f"rank {rank}: f")

    # rank 1: 4 % of the step and nothing of its own (a loaded machine favouring
    # the others); rank 2: as small, with a function of its own; rank 3: 30 %
    stragglers = [late(1, 0.04), late(2, 0.04), late(3, 0.30)]
    whys = [why(1, wy.NOTHING), why(2, "function"), why(3, wy.NOTHING)]
    kept, said = explained(stragglers, whys)
    assert [s.rank for s in kept] == [2, 3] and [w.rank for w in said] == [2, 3]
    # late at 2 steps in 10, 11 % of the step: with nothing of its own, noise of
    # a loaded node; with a function of its own (a slow 10th step), named; late
    # at every step, named whatever its samples say
    sparse = [late(1, 0.11), late(2, 0.11), late(3, 0.11)]
    sparse[0].late_steps = sparse[1].late_steps = 0.2
    kept, said = explained(sparse, [why(1, wy.NOTHING), why(2, "function"), why(3, wy.NOTHING)])
    assert [s.rank for s in kept] == [2, 3] and [w.rank for w in said] == [2, 3]


def test_a_rank_late_at_one_step_in_ten_is_named_with_how_often_and_its_mean() -> None:
    # rank 2 is 60 ms late at every 10th 80 ms step (DDP's two buckets): its
    # typical step is on time; what the job loses is 6 ms a step
    t = job(steps=200, straggler=2, lag_ms=60.0, every=10, buckets=2, seed=3)
    d = analyze(t, now_ns=T0)
    [s] = d.stragglers
    assert s.rank == 2 and 0.08 <= s.late_steps <= 0.12, s
    assert 50 <= s.late_each_ms <= 70 and 5.0 <= s.late_ms <= 7.0, s
    assert abs(s.share_of_step - s.late_ms / s.step_ms) < 0.01
    assert "is 6" in d.verdict or "is 5" in d.verdict or "is 7" in d.verdict
    assert "late at 1 in 10 of its " in d.verdict and "a step on average" in d.verdict, d.verdict
    # the same rank late at every step is said as every step
    every = analyze(job(steps=60, straggler=2, lag_ms=30.0, buckets=2, seed=3), now_ns=T0)
    assert every.stragglers[0].late_steps == 1.0 and " late each " in every.verdict


def test_noise_now_and_then_on_every_rank_names_none() -> None:
    # every rank late now and then by chance (jitter with rare spikes on each): no straggler
    rng = np.random.default_rng(4)
    t = job(steps=200, buckets=2, jitter_ms=3.0, seed=4)
    rows = t.to_pylist()
    for r in rows:  # a 20 ms stall at a random rank, now and then
        if rng.random() < 0.02:
            r["ts"] += 20_000_000
    d = analyze(pa.Table.from_pylist(rows, schema=t.schema), now_ns=T0)
    assert not d.stragglers, d.verdict


def test_a_ranks_own_delay_counts_from_where_the_collective_before_left_it() -> None:
    """``own_delays``: from its return from the one before (held there), or
    from its arrival there where it came to the next first (launched
    asynchronously); only consecutive collectives every rank at the next
    returned from, and never a rank alone."""

    def c(seq: int, ts: dict[int, int], end: dict[int, int | None]) -> coll.Collective:
        return coll.Collective("c", seq, "allreduce", 3, 8, ts, end)

    cs = [
        c(0, {0: 0, 1: 0, 2: 0}, {0: 100, 1: 100, 2: 100}),
        c(1, {0: 90, 1: 160, 2: 300}, {0: 400, 1: 400, 2: 400}),  # rank 0 came before its return
        c(2, {0: 450, 1: 450, 2: 700}, {0: 800, 1: None, 2: 800}),
        c(3, {0: 900, 1: 900, 2: 900}, {0: 950, 1: 950, 2: 950}),  # rank 1 still inside at 2
        c(5, {0: 1000, 1: 1000, 2: 1100}, {0: 1200, 1: 1200, 2: 1200}),  # 4 not seen
    ]
    # at 1: gaps 90 (from its arrival at 0), 60, 200: rank 2's own delay 200 - 75 ns
    # at 2: 50, 50, 300 from their returns: 250 ns
    assert sg.own_delays(cs, 2) == [(1, 125 / 1e6), (2, 250 / 1e6)]
    assert sg.own_delays(cs, 0) == [(1, (90 - 130) / 1e6), (2, (50 - 175) / 1e6)]
    assert sg.own_delays(cs[:1], 2) == [] and sg.own_delays(cs, 7) == []
