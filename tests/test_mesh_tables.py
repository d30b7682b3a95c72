"""Each rank's place in the mesh as data, through SQL: ``comm.groups``' ``role``
and ``process.info``'s ``tp``/``pp``/``dp``/``cp``/``ep`` and ``coords``, from a
process whose traced Gloo contexts belong to canned groups (Megatron-Core's
descriptions, a DeviceMesh's); and docs/sql.md names every column of both."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from probing.analyze import mesh
from probing.node.sql import Database
from probing.node.store import Store
from probing.node.tables import groups, install, nvml, process
from probing.target import Local

DOCS = Path(__file__).resolve().parents[1] / "docs" / "sql.md"


class Canned(Local):
    """This process, whose Gloo groups are ``rows`` (what the guest reads)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        super().__init__()
        self.rows = rows

    def groups(self, comms: list[int]) -> list[dict[str, Any]]:
        return [dict(r) for r in self.rows if r["comm"] in comms]


class Probe:
    """A probe's ``Context`` (``probing.node.tables.Context``) over ``target``."""

    def __init__(self, database: Database, target: Local) -> None:
        self.tracer = None
        self.cluster = None
        self.target = target
        self.nvml = nvml.GpuSampler(database.store)

    def trace_intervals(self) -> list[dict[str, Any]]:
        return []


def group(comm: int, pg: str, ranks: list[int], me: int) -> dict[str, Any]:
    return {"backend": "gloo", "comm": comm, "pg": pg, "ranks": ranks,
            "group_rank": ranks.index(me), "nranks": len(ranks)}  # fmt: skip


# rank 3 of a Megatron-Core TP 2 x PP 2 job (tp-dp-pp: TP 1 of stage 1, DP 0 of 1)
MEGATRON_RANK_3 = [
    group(0x100, "0", [0, 1, 2, 3], 3),  # the default group: no role
    group(0x200, "22 (TENSOR_MODEL_PARALLEL_GROUP)", [2, 3], 3),
    group(0x300, "25 (PIPELINE_MODEL_PARALLEL_GROUP)", [1, 3], 3),
    group(0x400, "20 (DATA_PARALLEL_GROUP)", [3], 3),
    group(0x500, "19 (MODEL_PARALLEL_GROUP)", [0, 1, 2, 3], 3),
]


def probe_of(rows: list[dict[str, Any]], traced: list[int]) -> Database:
    """A database over a process with ``rows`` for groups, ``traced`` its
    contexts seen in ``gloo.calls``."""
    database = Database(Store())
    install(database, Probe(database, Canned(rows)))
    if traced:
        calls = database.store.get("gloo", "calls")
        assert calls is not None and calls.schema is not None
        rows = [{"comm": c} for c in traced]  # the other columns NULL: only comm is read
        calls.append_batch(pa.Table.from_pylist(rows, schema=calls.schema))
    return database


def test_comm_groups_says_each_groups_role() -> None:
    database = probe_of(MEGATRON_RANK_3, [r["comm"] for r in MEGATRON_RANK_3])
    got = database.sql("SELECT pg, role FROM comm.groups ORDER BY comm").to_pylist()
    assert [(r["pg"].split()[0], r["role"]) for r in got] == [
        ("0", None), ("22", "tp"), ("25", "pp"), ("20", "dp"), ("19", None),
    ]  # fmt: skip


def test_traced_contexts_are_read_from_each_sealed_chunk_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``comm.groups`` is asked at each full detection: the contexts traced
    are read from the chunks sealed since the last ask and the rows not
    sealed, not from the whole trace again."""
    import pyarrow.dataset as ds

    from probing.node.bpf.families import GLOO_SCHEMA

    store = Store(chunk_rows=4)
    calls = store.table("gloo", "calls", GLOO_SCHEMA)

    def put(*comms: int) -> None:
        calls.append_batch(pa.Table.from_pylist([{"comm": c} for c in comms], schema=GLOO_SCHEMA))

    put(1, 2, 1, 2)
    put(3, 0, 3, 3)  # 0: no context
    put(5)
    opened: list[Any] = []
    real = ds.dataset
    monkeypatch.setattr(ds, "dataset", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    sealed: dict[str, set[int]] = {}
    assert groups.traced_gloo_contexts(store, sealed) == [1, 2, 3, 5]
    assert len(opened) == calls.stats().chunks == 2
    put(7, 7, 7, 7)
    assert groups.traced_gloo_contexts(store, sealed) == [1, 2, 3, 5, 7]
    assert len(opened) == calls.stats().chunks == 3  # the new chunk alone
    assert groups.traced_gloo_contexts(store) == [1, 2, 3, 5, 7]  # no cache: the same


def test_process_info_says_where_the_process_sits() -> None:
    database = probe_of(MEGATRON_RANK_3, [r["comm"] for r in MEGATRON_RANK_3])
    [row] = database.sql("SELECT coords, tp, pp, dp, cp, ep FROM process.info").to_pylist()
    assert row == {"coords": "tp 1/2, pp 1/2, dp 0/1", "tp": 1, "pp": 1, "dp": 0, "cp": None,
                   "ep": None}  # fmt: skip
    # SQL picks ranks by place: this one is TP rank 1 of stage 1
    assert database.sql("SELECT pid FROM process.info WHERE tp = 1 AND pp = 1").num_rows == 1


def test_a_device_meshs_own_dimension_names_are_its_roles() -> None:
    rows = [group(0x10, "1 (mesh_dp_shard)", [0, 2], 2), group(0x20, "2 (mesh_tp)", [2, 3], 2),
            group(0x30, "3 (mesh_dim_0)", [0, 2], 2)]  # fmt: skip
    database = probe_of(rows, [0x10, 0x20, 0x30])
    roles = database.sql("SELECT role FROM comm.groups ORDER BY comm").column("role").to_pylist()
    assert roles == ["dp_shard", "tp", None]
    [row] = database.sql("SELECT coords, tp, dp FROM process.info").to_pylist()
    assert row == {"coords": "tp 0/2, dp_shard 1/2", "tp": 0, "dp": None}


def test_no_traced_group_no_place() -> None:
    """Nothing traced: no group to read, every place column NULL."""
    database = probe_of(MEGATRON_RANK_3, [])
    assert database.sql("SELECT * FROM comm.groups").num_rows == 0
    [row] = database.sql("SELECT coords, tp, pp, dp FROM process.info").to_pylist()
    assert set(row.values()) == {None}


def test_a_place_is_read_once_a_while_and_kept_once_its_groups_are_gone() -> None:
    """The watch asks ``process.info`` every 5 s: the groups are read at most
    once a ``ttl_s``; a process whose groups are gone (it ended) keeps its place."""
    reads = iter([MEGATRON_RANK_3[1:2], MEGATRON_RANK_3, []])  # what each read finds

    def comm_groups() -> pa.Table:
        rows = [{**r, "role": mesh.role_of(r["pg"])} for r in next(reads)]
        return pa.Table.from_pylist(rows, schema=groups.SCHEMA)

    at = process.PlaceCache(comm_groups, ttl_s=3600)
    assert at()["coords"] == "tp 1/2" and at()["coords"] == "tp 1/2"  # one read
    at.ttl_s = 0
    assert at()["coords"] == "tp 1/2, pp 1/2, dp 0/1"  # read again: every group traced
    assert at() == {"coords": "tp 1/2, pp 1/2, dp 0/1", "tp": 1, "pp": 1, "dp": 0}  # kept


def test_process_info_has_a_column_for_each_role_the_mesh_names() -> None:
    assert process.ROLES == mesh.ORDER == tuple(mesh.ROLES)


def test_two_groups_of_one_role_that_disagree_say_nothing_of_it() -> None:
    at = mesh.own_coordinates([("tp", 0, 2), ("tp", 1, 2), ("pp", 1, 4)])
    assert at == {"pp": (1, 4)} and mesh.coords_text(at) == "pp 1/4"


@pytest.mark.parametrize("table", ["process.info", "comm.groups"])
def test_docs_name_every_column(table: str) -> None:
    database = probe_of([], [])
    columns = database.sql(f"SELECT * FROM {table} LIMIT 0").column_names
    text = DOCS.read_text()
    section = re.search(rf"## `{re.escape(table)}`.*?(?=\n## |\Z)", text, re.DOTALL)
    assert section, f"docs/sql.md has no section for {table}"
    missing = [c for c in columns if not re.search(rf"\b{c}\b", section.group(0))]
    assert not missing, f"docs/sql.md's {table} misses {missing}"


def test_a_verdict_names_a_group_by_its_role() -> None:
    from probing.analyze.verdict import group_text

    tp, shard = "gloo/pg23 (TENSOR_MODEL_PARALLEL_GROUP)", "gloo/pg5 (mesh_dp_shard)"
    said = {
        tp: f"its TP group {tp}",
        shard: f"its dp_shard group {shard}",  # a DeviceMesh's own dimension
        "gloo/pg0": "gloo/pg0",  # the world's: no role
        "gloo/pg3 (mesh_dim_0)": "gloo/pg3 (mesh_dim_0)",  # a dimension with no name
    }
    assert {g: group_text(g) for g in said} == said
