"""PyTorch's Flight Recorder: the guest's rows (``probing.guest.flight``), the
``comm.flight`` tables, and the hang they tell (``probing.analyze.flight``),
on real dumps of a 4-rank Gloo job where rank 2 never entered the world's
5th collective (``tests/fixtures/flight``, made by its ``capture.py``)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from typing import Any

import pyarrow as pa
import pytest

from probing.analyze import analyze
from probing.analyze import flight as fl
from probing.analyze import hangs as hg
from probing.analyze.tables import sql_tables
from probing.cli.asking import diagnose
from probing.cli.render import diagnosis as render
from probing.errors import ProbingError
from probing.guest import flight as guest
from probing.node.sql import Database
from probing.node.store import Store
from probing.node.tables import flight as tables
from tests.conftest import REPO
from tests.test_analyze import job

FIXTURES = REPO / "tests" / "fixtures" / "flight"
WORLD = 4


def dump(rank: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"rank{rank}.json").read_text())
    return data


def gathered(dumps: list[dict[str, Any]] | None = None) -> fl.Gathered:
    """Every rank's rows and status as ``fl.gather`` returns them (tagged ``rank``)."""
    dumps = dumps if dumps is not None else [dump(r) for r in range(WORLD)]
    rows, status = [], []
    for rank, d in enumerate(dumps):
        mine = guest.records(d)
        rows += [{**row, "rank": rank, "node": "vm"} for row in mine]
        status.append({"state": "on" if mine else "empty", "reason": "", "rank": rank})
    return fl.Gathered(rows, status)


def last_ts(rec: fl.Gathered) -> int:
    return max(r["ts"] for r in rec.rows)


# -- the guest: torch's dump as rows ---------------------------------------------------


def test_each_record_of_a_dump_is_one_flat_row() -> None:
    rows = guest.records(dump(0))
    assert [(r["pg"], r["seq"], r["op"]) for r in rows] == [
        ("0", 1, "broadcast"), ("0", 2, "all_reduce"), ("1", 1, "all_reduce"),
        ("0", 3, "all_reduce"), ("1", 2, "all_reduce"), ("0", 4, "all_gather"),
        ("0", 5, "all_reduce"),
    ]  # fmt: skip
    last = rows[-1]
    assert last["backend"] == "gloo" and last["pg_desc"] == "default_pg"
    assert last["input_sizes"] == [[128, 4]] and last["input_dtypes"] == ["Float"]
    assert last["bytes"] == 128 * 4 * 4 and not last["retired"] and not last["is_p2p"]
    assert last["started_ns"] is None and last["completed_ns"] is None  # Gloo never sees them
    assert [r["bytes"] for r in rows if r["pg"] == "1"] == [8 * 2, 8 * 2]  # bfloat16
    gather = rows[5]  # int64, one tensor in, one out per rank
    assert gather["bytes"] == 2 * 8 and gather["output_sizes"] == [[4, 2]]
    assert set(rows[0]) == set(tables.SCHEMA.names)


def test_a_dump_without_entries_has_no_rows() -> None:
    assert guest.records({"version": "2.10", "pg_status": {}}) == []


def test_the_first_size_variable_set_wins() -> None:
    assert guest.buffer_size({}) == (None, "")
    assert guest.buffer_size({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}) == (
        0,
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
    )
    both = {"TORCH_FR_BUFFER_SIZE": "50", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    assert guest.buffer_size(both) == (50, "TORCH_FR_BUFFER_SIZE")
    assert guest.buffer_size({"TORCH_FR_BUFFER_SIZE": "lots"}) == (None, "TORCH_FR_BUFFER_SIZE")


def test_unknown_dtypes_leave_bytes_null() -> None:
    assert guest.tensor_bytes([[3, 2]], ["Float"]) == 24
    assert guest.tensor_bytes([[3]], ["Float4_e2m1fn_x2"]) is None
    assert guest.tensor_bytes([], []) == 0


def test_a_job_that_set_the_size_to_zero_is_told_off(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    got = guest.flight()
    assert (got["state"], got["rows"], got["buffer_size"]) == ("off", [], 0)
    assert got["reason"].startswith("the job set TORCH_FR_BUFFER_SIZE=0; ")


def test_a_process_without_torch_distributed_is_told_off(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    got = guest.flight()
    assert got["state"] == "off" and "torch.distributed is not imported" in got["reason"]


RECORDING_JOB = """
import json, os, sys, torch, torch.distributed as dist
from probing.node import assemble
from probing.node.sql import Database
from probing.node.store import Store
database = Database(Store())
assemble.install_tables(database)
ask = lambda sql: database.sql(sql).to_pylist()
before = ask("SELECT state, records FROM comm.flight_status")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
dist.all_reduce(torch.ones(3, 2))
dist.barrier()
print(json.dumps({
    "before": before,
    "after": ask("SELECT state, records, buffer_size, version FROM comm.flight_status"),
    "rows": ask("SELECT pg, op, seq, input_sizes, bytes, retired FROM comm.flight ORDER BY seq"),
}))
"""


@pytest.mark.parametrize("size", ["", "0"], ids=["default", "off"])
def test_a_real_process_group_through_sql(size: str) -> None:
    from probing.cli.demo import free_port

    env = {k: v for k, v in os.environ.items() if "BUFFER_SIZE" not in k}
    if size:
        env["TORCH_FR_BUFFER_SIZE"] = size
    out = subprocess.run(
        [sys.executable, "-c", RECORDING_JOB, str(free_port())],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    if size == "0":
        assert got["after"] == [{"state": "off", "records": 0, "buffer_size": 0, "version": None}]
        assert got["rows"] == []
        return
    assert got["before"] == [{"state": "empty", "records": 0}]
    assert got["after"] == [{"state": "on", "records": 2, "buffer_size": None, "version": "2.10"}]
    assert got["rows"] == [
        {"pg": "0", "op": "all_reduce", "seq": 1, "input_sizes": [[3, 2]], "bytes": 24,
         "retired": True},
        {"pg": "0", "op": "barrier", "seq": 2, "input_sizes": [], "bytes": 0, "retired": True},
    ]  # fmt: skip


# -- the tables ------------------------------------------------------------------------


def test_the_tables_are_typed_and_empty_when_off() -> None:
    database = Database(Store())
    answer = {"state": "on", "reason": "", "version": "2.10", "buffer_size": 64,
              "rows": guest.records(dump(2))}  # fmt: skip
    off = {"state": "off", "reason": "the job set TORCH_FR_BUFFER_SIZE=0", "rows": []}
    database.register_table("comm", "flight", tables.provider(lambda: answer))
    database.register_table("comm", "flight_status", tables.status_provider(lambda: answer))
    database.register_table("fr_off", "flight", tables.provider(lambda: off))
    database.register_table("fr_off", "flight_status", tables.status_provider(lambda: off))
    got = database.sql(
        "SELECT pg, max(seq) AS last, sum(bytes) AS bytes FROM comm.flight "
        "WHERE NOT is_p2p GROUP BY pg ORDER BY pg"
    ).to_pylist()
    assert got == [{"pg": "0", "last": 4, "bytes": 64 + 2 * 2048 + 16},
                   {"pg": "2", "last": 2, "bytes": 32}]  # fmt: skip
    empty = database.sql("SELECT * FROM fr_off.flight")
    assert empty.num_rows == 0 and empty.schema.equals(tables.SCHEMA)
    [status] = database.sql("SELECT * FROM fr_off.flight_status").to_pylist()
    assert status == {"state": "off", "reason": "the job set TORCH_FR_BUFFER_SIZE=0",
                      "records": 0, "buffer_size": None, "version": None}  # fmt: skip
    [status] = database.sql(
        "SELECT state, records, buffer_size FROM comm.flight_status"
    ).to_pylist()
    assert status == {"state": "on", "records": 6, "buffer_size": 64}


# -- the hang --------------------------------------------------------------------------


def test_where_each_rank_stands_in_each_group() -> None:
    at = fl.places(gathered().rows)
    assert {r: (p.entered, p.completed, p.op) for r, p in at["0"].items()} == {
        0: (5, 4, "all_reduce"), 1: (5, 4, "all_reduce"),
        2: (4, 4, "all_gather"), 3: (5, 4, "all_reduce"),
    }  # fmt: skip
    # torch names the 2-rank groups alike in every rank: "1" is {0, 1}, "2" is {2, 3}
    assert {pg: sorted(ranks) for pg, ranks in at.items() if pg != "0"} == {
        "1": [0, 1], "2": [2, 3],
    }  # fmt: skip


def test_the_rank_that_never_entered_the_collective_is_named() -> None:
    rec = gathered()
    [s] = fl.stalls(rec.rows, rec.status, last_ts(rec) + 12 * 10**9, hang_after_s=10)
    assert (s.pg, s.seq, s.op, s.missing_ranks, s.waiting_ranks) == (
        "0", 5, "all_reduce", [2], [0, 1, 3],
    )  # fmt: skip
    assert (s.sizes, s.dtypes, s.bytes, s.disagree) == ([[128, 4]], ["Float"], 2048, {})
    assert 12.0 <= s.age_s < 12.1
    assert fl.detail(s) == (
        "Flight Recorder: all_reduce #5 of 128x4 Float, 2.0 KiB; rank 2's last: all_gather #4"
    )


def test_a_stall_younger_than_hang_after_is_no_hang() -> None:
    rec = gathered()
    assert fl.stalls(rec.rows, rec.status, last_ts(rec) + 2 * 10**9, hang_after_s=10) == []


def test_ranks_that_stand_together_are_no_hang() -> None:
    dumps = [dump(r) for r in range(WORLD)]
    for d in dumps:  # every rank past the 5th all-reduce: a healthy moment, however old
        d["entries"] = [e for e in d["entries"] if e["collective_seq_id"] < 5 or e["pg_id"]]
    rec = gathered(dumps)
    assert fl.stalls(rec.rows, rec.status, last_ts(rec) + 600 * 10**9, hang_after_s=10) == []


def test_a_collective_every_rank_entered_and_none_left_is_stuck() -> None:
    dumps = [dump(r) for r in range(WORLD)]
    late = copy.deepcopy(dumps[0]["entries"][-1])
    dumps[2]["entries"].append(late)  # rank 2 entered it too; nobody completed it
    rec = gathered(dumps)
    [h] = hg.recorded_hangs(rec, last_ts(rec) + 20 * 10**9, hang_after_s=10)
    assert (h.seq, h.missing_ranks, h.waiting_ranks) == (5, [], [0, 1, 2, 3])
    assert h.evidence == "flight recorder" and h.comm == "process group 0"


def test_a_rank_that_entered_it_differently_is_said() -> None:
    dumps = [dump(r) for r in range(WORLD)]
    dumps[3]["entries"][-1]["input_sizes"] = [[64, 4]]  # a shape bug on rank 3
    rec = gathered(dumps)
    [s] = fl.stalls(rec.rows, rec.status, last_ts(rec) + 20 * 10**9, hang_after_s=10)
    assert s.disagree == {3: "all_reduce [[64, 4]] Float"} and s.sizes == [[128, 4]]
    assert fl.detail(s).endswith("; rank 3 entered it as all_reduce [[64, 4]] Float")
    dumps[0]["entries"][-1]["input_sizes"] = [[64, 4]]  # the lowest rank is odd too
    dumps[1]["entries"][-1]["profiling_name"] = "gloo:broadcast"
    rec = gathered(dumps)
    [s] = fl.stalls(rec.rows, rec.status, last_ts(rec) + 20 * 10**9, hang_after_s=10)
    assert s.sizes == [[64, 4]] and sorted(s.disagree) == [1]  # 0 and 3 agree: 2 to 1


def test_scatter_gather_and_all_to_all_may_differ_in_shape_by_rank() -> None:
    dumps = [dump(r) for r in range(WORLD)]
    for r, d in enumerate(dumps):
        if r != 2:
            d["entries"][-1].update(profiling_name="gloo:scatter", input_sizes=[[r + 1]])
    rec = gathered(dumps)
    [s] = fl.stalls(rec.rows, rec.status, last_ts(rec) + 20 * 10**9, hang_after_s=10)
    assert s.op == "scatter" and s.disagree == {}


def test_a_rank_with_no_record_yet_stands_at_zero_in_the_world() -> None:
    dumps = [dump(r) for r in range(WORLD)]
    dumps[2] = {"version": "2.10"}  # it never issued a collective: its ring is empty
    rec = gathered(dumps)
    [s] = fl.stalls(rec.rows, rec.status, last_ts(rec) + 20 * 10**9, hang_after_s=10)
    assert (s.seq, s.op, s.missing_ranks) == (1, "broadcast", [2])
    assert fl.detail(s).endswith("rank 2's last: none recorded")


def test_a_subgroup_hang_names_only_its_members() -> None:
    dumps = [dump(r) for r in range(WORLD)]
    for d in dumps:  # the world's 5th all-reduce never happened in this story
        d["entries"] = [e for e in d["entries"] if e["collective_seq_id"] < 5 or e["pg_id"]]
    extra = copy.deepcopy(next(e for e in dumps[2]["entries"] if e["process_group"][0] == "2"))
    extra.update(collective_seq_id=3, retired=False, time_created_ns=extra["time_created_ns"] + 1)
    dumps[2]["entries"].append(extra)  # rank 2 waits in group "2"'s 3rd; rank 3 never came
    rec = gathered(dumps)
    [s] = fl.stalls(rec.rows, rec.status, last_ts(rec) + 20 * 10**9, hang_after_s=10)
    assert (s.pg, s.seq, s.missing_ranks, s.waiting_ranks) == ("2", 3, [3], [2])
    assert s.dtypes == ["BFloat16"] and s.bytes == 16


def test_point_to_point_records_are_left_out() -> None:
    rec = gathered()
    p2p = {**rec.rows[0], "is_p2p": True, "seq": 99, "op": "send 0->1"}
    assert "WHERE NOT is_p2p" in fl.FLIGHT_SQL  # not asked; and not counted where given
    assert fl.places([*rec.rows, p2p])["0"][0].entered == 5


def test_off_ranks_are_said_with_the_reason() -> None:
    on = {"state": "on", "reason": ""}
    off = {"state": "off", "reason": "the job set TORCH_FR_BUFFER_SIZE=0; set it"}
    status = [{**on, "rank": 0}, {**off, "rank": 1}, {**off, "rank": 3},
              {"state": "empty", "reason": "no collective yet", "rank": 2}]  # fmt: skip
    assert fl.off_note(status) == (
        "Flight Recorder is off in ranks 1, 3: the job set TORCH_FR_BUFFER_SIZE=0; set it; "
        "Flight Recorder has no record in rank 2: no collective yet"
    )
    assert fl.off_note([{**on, "rank": r} for r in range(WORLD)]) == ""


# -- in the diagnosis ------------------------------------------------------------------


def test_an_untraced_hang_gets_a_verdict_with_seq_op_sizes_and_missing_rank() -> None:
    rec = gathered()
    d = analyze(pa.table({}), now_ns=last_ts(rec) + 15 * 10**9, recorded=rec)
    assert not d.healthy and d.flight == ""
    [h] = d.hangs
    assert (h.comm, h.seq, h.op, h.missing_ranks, h.evidence) == (
        "process group 0", 5, "all_reduce", [2], "flight recorder",
    )  # fmt: skip
    assert d.verdict.startswith(
        "hang: ranks 0, 1, 3 wait in all_reduce #5 of process group 0 for 15"
    )
    assert d.verdict.endswith(
        "+ s; rank 2 never entered it (Flight Recorder: all_reduce #5 of 128x4 Float, "
        "2.0 KiB; rank 2's last: all_gather #4)"
    )
    assert d.to_json()["hangs"][0]["detail"].startswith("Flight Recorder: all_reduce #5")
    [row] = sql_tables(d, pa.table({}))["hangs"].to_pylist()
    assert row["evidence"] == "flight recorder" and row["missing_ranks"] == [2]
    assert all(len(line) <= 80 for line in render(d).splitlines())


def test_a_traced_hang_comes_before_the_recorder() -> None:
    from tests.test_analyze import job

    table = job(steps=20, hang_rank=2, hang_step=12)
    now = max(table.column("ts").to_pylist()) + 30 * 10**9
    rec = gathered()
    d = analyze(table, now_ns=now, recorded=fl.Gathered(rec.rows, rec.status))
    assert d.hangs[0].evidence == "traced" and d.flight == ""


def test_when_the_recorder_is_off_the_verdict_says_so() -> None:
    off = "the job set TORCH_FR_BUFFER_SIZE=0; TORCH_FR_BUFFER_SIZE=2000 ... turns it on"
    rec = fl.Gathered([], [{"state": "off", "reason": off, "rank": r} for r in range(WORLD)])
    d = analyze(pa.table({}), recorded=rec)
    assert not d.hangs
    assert d.flight == f"Flight Recorder is off in ranks 0, 1, 2, 3: {off}"
    assert d.verdict.startswith("no verdict: ") and d.verdict.endswith(f"; {d.flight}")
    assert d.to_json()["flight"] == d.flight


def test_gather_asks_the_rows_only_where_a_recorder_has_some() -> None:
    asked: list[str] = []
    status = pa.table({"state": ["off"], "reason": ["x"], "records": [0], "rank": [0]})

    def ask(sql: str) -> pa.Table:
        asked.append(sql)
        return status

    got = fl.gather(ask, remote=True)
    assert got == fl.Gathered([], [{"state": "off", "reason": "x", "records": 0, "rank": 0}])
    assert asked == ["SELECT state, reason, records, node, rank FROM comm.flight_status"]


# -- a young hang, asked before --hang-after: watched until it lasts ---------------------


class YoungHang:
    """An untraced job asked over the cluster 4 s into a hang: rank 2 never
    entered the world's 5th all-reduce (the fixtures' dumps, stamped as if
    it was issued 4 s ago), its stack in its loader, the others' in the
    all-reduce; no counts (a cluster query has no python.`expr`). With
    ``moving``, the recorder's newest records move on at each ask: a step
    caught mid-way."""

    remote = True

    def __init__(self, moving: bool = False) -> None:
        self.rec = gathered()
        shift = time.time_ns() - 4 * 10**9 - last_ts(self.rec)
        self.rows = [{**r, "ts": r["ts"] + shift} for r in self.rec.rows]
        self.moving = moving
        self.flight_asked = 0

    def ask(self, sql: str) -> pa.Table:
        if sql.startswith("SELECT state, reason, records"):
            return pa.Table.from_pylist(self.rec.status)
        if "FROM comm.flight" in sql:
            self.flight_asked += 1
            rows = copy.deepcopy(self.rows)
            if self.moving:  # rank 2 entered it, and each rank moved on since
                rows += [{**r, "rank": 2} for r in rows if r["rank"] == 0 and r["seq"] == 5]
                rows += [{**r, "seq": 5 + self.flight_asked} for r in rows if r["seq"] == 5]
            return pa.Table.from_pylist(rows)
        if "FROM process.stacks" in sql:
            return pa.Table.from_pylist([self._frame(r) for r in range(WORLD)])
        if "FROM comm.collectives" in sql and "GROUP BY" not in sql:  # never traced
            return job(steps=1).slice(0, 0)
        raise ProbingError("no such table here\n")

    def _frame(self, rank: int) -> dict[str, Any]:
        func, file = ("all_reduce", "torch/distributed/distributed_c10d.py")
        if rank == 2:
            func, file = ("load_batch", "train.py")
        return {"tid": 1, "thread": "MainThread", "state": "S", "depth": 0, "func": func,
                "file": file, "line": 1, "rank": rank, "node": "vm"}  # fmt: skip

    def trace_starts_ns(self) -> list[int]:
        return []


def test_a_hang_younger_than_hang_after_is_watched_until_it_lasts() -> None:
    j = YoungHang()
    waits: list[float] = []
    t0 = time.monotonic()
    d, _ = diagnose(j, hang_after_s=5.0, on_wait=waits.append)
    took = time.monotonic() - t0
    [h] = d.hangs
    assert (h.missing_ranks, h.evidence, h.seq) == ([2], "flight recorder", 5), d.verdict
    assert h.age_s >= 5.0 and d.verdict.startswith("hang: ranks 0, 1, 3 wait in all_reduce #5")
    # watched for what was left of --hang-after (the recorder dated the stall), not all of it
    [left] = waits
    assert 0.5 <= left <= 1.5 and took < 5.0 + 3, (left, took)
    assert j.flight_asked >= 3  # asked again while it was watched


def test_ranks_apart_that_move_on_are_no_hang_and_not_waited_for() -> None:
    j = YoungHang(moving=True)
    t0 = time.monotonic()
    d, _ = diagnose(j, hang_after_s=30.0)
    assert not d.hangs, d.verdict
    assert time.monotonic() - t0 < 10  # the watch ended when the recorder moved


def test_ranks_that_stop_answering_while_watched_are_no_hang() -> None:
    # the stacks of ranks 1-3 time out once the watch begins: nothing says they stood still
    j = YoungHang()
    real = j.ask
    asked = {"stacks": 0}

    def ask(sql: str) -> pa.Table:
        if "FROM process.stacks" in sql:
            asked["stacks"] += 1
            if asked["stacks"] > 1:
                return pa.Table.from_pylist([j._frame(0)])
        return real(sql)

    j.ask = ask  # type: ignore[method-assign]
    d, _ = diagnose(j, hang_after_s=5.0)
    assert not d.hangs, d.verdict
