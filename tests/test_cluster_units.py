"""Cluster logic on canned input: identity, peer lists, planning, wire, clocks."""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import pyarrow as pa
import pytest

from probing.errors import ProbingError, QueryError
from probing.node.cluster import identity, plan
from probing.node.cluster.discovery import PeerInfo, Registry, parse_published
from probing.node.cluster.wire import clock_offset, pack, unpack
from tests.conftest import a_read_that_writes_another

THREADS = plan.tagged_schema(pa.schema([("tid", pa.int64()), ("name", pa.string())]))
COLL = plan.tagged_schema(
    pa.schema(
        [("op", pa.string()), ("rank", pa.int32()), ("ts", pa.int64()), ("dur_ns", pa.int64())]
    )
)
SCHEMAS: dict[str, pa.Schema | None] = {"process.threads": THREADS, "comm.collectives": COLL}
KNOWN = {"process", "comm", "probing"}


def test_identity_from_torchrun_env() -> None:
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "2",
        "MASTER_ADDR": "10.1.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "job42",
        "PROBING_NODE": "gpu-07",
    }
    ident = identity.from_env(env)
    assert identity.known(ident)
    assert (ident.rank, ident.world_size, ident.local_rank, ident.group_rank) == (5, 8, 1, 2)
    assert ident.master == ("10.1.0.1", 29500) and ident.run_id == "job42"
    assert ident.node == "gpu-07" and ident.source == "torchrun" and ident.port == 0


def test_a_rank_the_environment_does_not_name_is_learned_from_torch() -> None:
    assert not identity.known(identity.from_env({}))
    assert not identity.known(identity.from_env({"WORLD_SIZE": "1", "RANK": "0"}))
    assert identity.known(identity.from_env({"PROBING_PEERS": "a:1,b:2"}))
    # Lightning's ranks 1-3: a size and a store, but no RANK
    lightning = {"WORLD_SIZE": "4", "LOCAL_RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "7"}
    ident = identity.from_env(lightning)
    assert not identity.known(ident) and ident.master == ("h", 7)
    # what torch's default group says wins, its store included
    got = identity.learned(ident, {"rank": 2, "world": 4, "store": ["10.0.0.1", 29500]})
    assert identity.known(got)
    assert (got.rank, got.world_size, got.master, got.local_rank) == (2, 4, ("10.0.0.1", 29500), 2)
    # a file store: the environment's store stays, if it named one
    assert identity.learned(ident, {"rank": 1, "world": 4}).master == ("h", 7)


STORE = {"MASTER_ADDR": "10.1.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    ("launcher", "env", "want"),
    [
        ("srun (Megatron)", {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"},
         (5, 8, 1)),
        ("Open MPI", {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                      "OMPI_COMM_WORLD_LOCAL_RANK": "3"}, (3, 4, 3)),
        ("Hydra (PMI)", {"PMI_RANK": "2", "PMI_SIZE": "16", "MPI_LOCALRANKID": "2"}, (2, 16, 2)),
        ("srun --mpi=pmix", {"PMIX_RANK": "6", "SLURM_PROCID": "6", "SLURM_NTASKS": "12",
                             "SLURM_LOCALID": "2"}, (6, 12, 2)),
        # mpirun inside an allocation: its ranks inherit the batch step's SLURM_PROCID=0
        ("mpirun under sbatch", {"SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                                 "OMPI_COMM_WORLD_RANK": "7", "OMPI_COMM_WORLD_SIZE": "8"},
         (7, 8, 0)),
        # torchrun's own variables win over the launcher's that started torchrun
        ("torchrun under srun", {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "13",
                                 "WORLD_SIZE": "16", "LOCAL_RANK": "5"}, (13, 16, 5)),
    ],
)  # fmt: skip
def test_a_rank_from_other_launchers_where_rank_is_absent(
    launcher: str, env: dict[str, str], want: tuple[int, int, int]
) -> None:
    ident = identity.from_env({**env, **STORE})
    assert (ident.rank, ident.world_size, ident.local_rank) == want, launcher
    assert identity.known(ident)


def test_a_kubeflow_pods_index_is_not_a_rank_but_torchruns_in_it_is() -> None:
    """A PyTorchJob's pod 1 of 2, with torchrun starting 4 processes in it:
    Kubeflow sets RANK to the pod's index; torchrun gives each process its own
    (with TORCHELASTIC_RUN_ID). The launcher is no rank of the job."""
    pod = {"RANK": "1", "WORLD_SIZE": "8", "PET_NPROC_PER_NODE": "4", "PET_NNODES": "2",
           "PET_NODE_RANK": "1", **STORE}  # fmt: skip
    launcher = identity.from_env(pod)
    assert launcher.rank == -1 and not identity.known(launcher)
    worker = {**pod, "RANK": "6", "LOCAL_RANK": "2", "GROUP_RANK": "1",
              "TORCHELASTIC_RUN_ID": "pytorchjob-1"}  # fmt: skip
    ident = identity.from_env(worker)
    assert (ident.rank, ident.world_size, ident.local_rank, ident.group_rank) == (6, 8, 2, 1)
    assert identity.known(ident)
    # one process a pod, started without torchrun: the pod's index is its rank
    alone = identity.from_env({**pod, "PET_NPROC_PER_NODE": "1"})
    assert alone.rank == 1 and identity.known(alone)
    # and PROBING_RANK says it whatever the launcher
    assert identity.from_env({**pod, "PROBING_RANK": "3"}).rank == 3


def test_peer_list_from_string_and_file(tmp_path) -> None:
    assert identity.parse_peers(" 10.0.0.1:7070, 10.0.0.2:7070 ,") == (
        "10.0.0.1:7070",
        "10.0.0.2:7070",
    )
    f = tmp_path / "peers"
    f.write_text("# the job\nh0:1\n\nh1:2  # second\n[::1]:3\n")
    assert identity.parse_peers(f"@{f}") == ("h0:1", "h1:2", "[::1]:3")
    assert identity.parse_peers(str(f)) == ("h0:1", "h1:2", "[::1]:3")
    assert identity.split_addr("[::1]:3") == ("::1", 3)
    for bad in ("h0", "h0:x", "h0:70000", ":1"):
        with pytest.raises(ProbingError, match="bad peer address"):
            identity.parse_peers(bad)
    ident = identity.from_env({"PROBING_PEERS": f"@{f}", "WORLD_SIZE": "9"})
    assert ident.world_size == 3 and ident.rank == -1 and ident.source == "peers"


def test_token_from_env_or_file(tmp_path) -> None:
    assert identity.token_from_env({"PROBING_TOKEN": " abc \n"}) == b"abc"
    f = tmp_path / "tok"
    f.write_text("s3cret\nignored\n")
    assert identity.token_from_env({"PROBING_TOKEN_FILE": str(f)}) == b"s3cret"
    assert identity.token_from_env({}) is None


def test_job_address_is_the_route_to_the_master() -> None:
    assert identity.job_address(("127.0.0.1", 29500)) == "127.0.0.1"
    assert identity.job_address(None) == "127.0.0.1"


def test_group_by_rank_is_computed_on_the_peers() -> None:
    p = plan.plan(
        "SELECT rank, count(*) AS n FROM process.threads GROUP BY rank ORDER BY n DESC LIMIT 3",
        SCHEMAS,
        KNOWN,
    )
    assert p.mode == "agg"
    assert p.final_sql == 'SELECT * FROM cluster_partial ORDER BY "n" DESC LIMIT 3'
    p = plan.plan(
        "SELECT rank, count(*) FROM process.threads GROUP BY rank ORDER BY count(*)", SCHEMAS, KNOWN
    )
    assert p.final_sql == 'SELECT * FROM cluster_partial ORDER BY "count(*)"'
    p = plan.plan("SELECT node, max(ts) FROM comm.collectives GROUP BY node", SCHEMAS, KNOWN)
    assert p.mode == "agg_node" and p.scans["comm.collectives"].columns == ["ts", "node"]


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT rank, count(*) FROM process.threads GROUP BY 1",  # key not named
        "SELECT rank, sum(n) FROM (SELECT rank, 1 AS n FROM process.threads) GROUP BY rank",
        "SELECT a.rank, count(*) FROM process.threads a JOIN comm.collectives b "
        "ON a.rank = b.rank GROUP BY a.rank",
        "SELECT rank, count(*) FROM process.threads GROUP BY rank ORDER BY max(tid)",
        "SELECT op, rank, count(*) OVER () FROM comm.collectives GROUP BY op, rank",
        "SELECT rank, count(*) FROM process.threads GROUP BY rank ORDER BY 2 LIMIT 2 OFFSET 1",
    ],
)
def test_other_shapes_fall_back_to_scans(sql: str) -> None:
    assert plan.plan(sql, SCHEMAS, KNOWN).mode == "scan"


def test_scans_push_columns_filters_and_time_windows() -> None:
    p = plan.plan(
        "SELECT op, max(ts) - min(ts) FROM comm.collectives "
        "WHERE ts BETWEEN 1000 AND 2000 AND op LIKE 'all%' AND rank < 4 GROUP BY op",
        SCHEMAS,
        KNOWN,
    )
    scan = p.scans["comm.collectives"]
    assert p.mode == "scan" and sorted(scan.columns or []) == ["op", "ts"]
    assert scan.where is not None and "LIKE 'all%'" in scan.where
    assert "ts >= 1000" in scan.where and "ts <= 2000" in scan.where
    assert '"rank" < 4' in scan.where
    # a self-join: the union of columns, either side's rows
    p = plan.plan(
        "SELECT a.rank FROM comm.collectives a JOIN comm.collectives b ON a.seq_x = b.seq_x",
        {"comm.collectives": plan.tagged_schema(pa.schema([("seq_x", pa.int64())]))},
        KNOWN,
    )
    assert p.scans["comm.collectives"] == plan.ScanSpec(["seq_x", "rank"], None)


def test_a_filter_the_scan_takes_keeps_its_columns() -> None:
    # the scan takes `ts >= 5` whole and projects only what the join and the
    # output need; the asker re-runs the WHERE over the merged rows, so ts must come
    stacks = plan.tagged_schema(pa.schema([("stack_id", pa.int64()), ("callsite", pa.string())]))
    coll = plan.tagged_schema(pa.schema([("stack_id", pa.int64()), ("ts", pa.int64())]))
    sql = (
        "SELECT s.callsite, count(*) AS n, c.rank FROM comm.collectives c "
        "JOIN python.callsites s ON c.stack_id = s.stack_id AND c.rank = s.rank "
        "WHERE c.ts >= 5 GROUP BY s.callsite, c.rank"
    )
    schemas: dict[str, pa.Schema | None] = {"comm.collectives": coll, "python.callsites": stacks}
    p = plan.plan(sql, schemas, KNOWN | {"python"})
    assert "ts" in (p.scans["comm.collectives"].columns or [])
    peer_rows = {
        "comm.collectives": pa.table(
            {"stack_id": [7, 7, 7], "ts": [1, 6, 9], "node": ["a"] * 3, "rank": [0, 0, 0]}
        ),
        "python.callsites": pa.table(
            {"stack_id": [7], "callsite": ["t.py:3 f"], "node": ["a"], "rank": [0]}
        ),
    }
    picked = {
        name: t.select(
            list(dict.fromkeys([*(p.scans[name].columns or t.column_names), "node", "rank"]))
        )
        for name, t in peer_rows.items()
    }
    out = plan.run_final(p.final_sql, picked)
    assert out.to_pylist() == [{"callsite": "t.py:3 f", "n": 2, "rank": 0}]


def test_unknown_schema_fetches_every_column_and_no_table_is_an_error() -> None:
    p = plan.plan("SELECT count(*) FROM comm.collectives", {"comm.collectives": None}, KNOWN)
    assert p.mode == "scan" and p.scans["comm.collectives"] == plan.ScanSpec(None, None)
    with pytest.raises(QueryError, match="schema.table"):
        plan.plan("SELECT 1", SCHEMAS, KNOWN)


def test_table_refs_skip_strings_comments_and_column_qualifiers() -> None:
    sql = (
        "SELECT comm.collectives.ts, 'process.threads' -- process.info\n"
        'FROM comm.collectives WHERE x = "process"."stacks"'
    )
    refs = plan.table_refs(sql, KNOWN)
    assert [(r.name, r.qualified_column) for r in refs] == [
        ("comm.collectives", True),
        ("comm.collectives", False),
        ("process.stacks", False),
    ]


def test_tagged_schema_keeps_a_tables_own_rank() -> None:
    assert COLL.names == ["op", "table_rank", "ts", "dur_ns", "node", "rank"]
    assert COLL.field("rank").type == pa.int64() and COLL.field("table_rank").type == pa.int32()


def test_a_job_wide_table_keeps_its_own_rank_and_tags_the_probe_apart() -> None:
    """``analyze.*`` rows are about the ranks they name, whichever probe keeps
    them: their own ``rank`` and ``node`` stay, the probe that answered is
    ``probe_rank``/``probe_node``; a GROUP BY rank over one is not computed
    per peer (two probes may keep rows about one rank)."""
    own = pa.schema([("kind", pa.string()), ("rank", pa.int64()), ("node", pa.string())])
    findings = plan.tagged_schema(own, "analyze.findings")
    assert findings.names == ["kind", "rank", "node", "probe_node", "probe_rank"]
    assert plan.tagged_sql("analyze.findings", own.names, "n1", 0) == (
        'SELECT *, \'n1\' AS probe_node, CAST(0 AS BIGINT) AS probe_rank FROM "analyze"."findings"'
    )
    assert (
        plan.tags_of("analyze.findings") == plan.PROBE_TAGS and plan.tags_of("comm.x") == plan.TAGS
    )
    schemas: dict[str, pa.Schema | None] = {"analyze.findings": findings}
    known = KNOWN | {"analyze"}
    p = plan.plan("SELECT rank, count(*) AS n FROM analyze.findings GROUP BY rank", schemas, known)
    assert p.mode == "scan"
    p = plan.plan("SELECT kind FROM analyze.findings WHERE rank = 2", schemas, known)
    assert "rank" in (p.scans["analyze.findings"].columns or [])
    # two probes' rows (rank 0's detector, and rank 1's after it took over): by the rank blamed
    rows = pa.table({"kind": ["straggler", "straggler"], "rank": [2, 2], "node": ["b", "b"],
                     "probe_node": ["a", "a"], "probe_rank": [0, 1]})  # fmt: skip
    out = plan.run_final(p.sql.replace("kind FROM", "kind, probe_rank FROM"),
                         {"analyze.findings": rows})  # fmt: skip
    assert out.to_pylist() == [{"kind": "straggler", "probe_rank": 0},
                               {"kind": "straggler", "probe_rank": 1}]  # fmt: skip


def test_final_sql_runs_over_empty_and_merged_tables() -> None:
    empty = plan.run_final(
        "SELECT count(*) AS n FROM process.threads", {"process.threads": THREADS}
    )
    assert empty.to_pylist() == [{"n": 0}]
    rows = pa.table({"rank": pa.array([0, 0, 1], pa.int64()), "tid": [1, 2, 3]})
    out = plan.run_final(
        "SELECT rank, count(*) AS n FROM process.threads GROUP BY rank ORDER BY rank",
        {"process.threads": rows},
    )
    assert out.to_pylist() == [{"rank": 0, "n": 2}, {"rank": 1, "n": 1}]
    with pytest.raises(QueryError):
        plan.run_final("DROP TABLE process.threads", {"process.threads": rows})


def test_pack_unpack_roundtrip() -> None:
    a = pa.table({"x": [1, 2]})
    b = pa.table({"y": ["u"]})
    data = pack({"rank": 3, "missing": []}, {"t.a": a, "t.b": b}, t_recv_ns=123)
    head, tables = unpack(data)
    assert head["rank"] == 3 and head["t_recv_ns"] == 123 and head["t_send_ns"] >= 123
    assert tables["t.a"].equals(a) and tables["t.b"].equals(b)
    with pytest.raises(ValueError):
        unpack(data + b"x")
    with pytest.raises(ValueError):
        unpack(b"no head line")


def test_ntp_offset() -> None:
    # the peer's clock is 500 ahead; 10 each way, 30 of work on the peer
    assert clock_offset(t0=1000, t1=1510, t2=1540, t3=1050) == 500
    # 500 ahead, 20 out and 0 back: the error is half the difference
    assert clock_offset(t0=0, t1=520, t2=520, t3=20) == 510


def test_registry_and_published_entries() -> None:
    raw = (
        b'{"rank": 1, "node": "a", "addr": "h:1", "pid": 7}\n'
        b"torn{\n"
        b'{"rank": 0, "node": "b", "addr": "h:2", "pid": 8}\n'
        b'{"rank": 1, "node": "a", "addr": "h:3", "pid": 9}\n'
    )
    peers = parse_published(raw)
    assert [(p.rank, p.addr, p.pid) for p in peers] == [(0, "h:2", 8), (1, "h:3", 9)]
    reg = Registry()
    for p in peers:
        reg.upsert(p)
    reg.upsert(PeerInfo(2, "c", "h:4", status="self"))
    reg.mark_up(0, 12.5, -300)
    reg.mark_missing(1, "timeout")
    reg.mark_missing(2, "timeout")  # never for itself
    rows = {r["rank"]: r for r in reg.table().to_pylist()}
    assert rows[0]["status"] == "up" and rows[0]["response_ms"] == 12.5
    assert rows[0]["clock_offset_ns"] == -300 and rows[0]["last_seen_ns"] > 0
    assert rows[1]["status"] == "missing" and rows[1]["reason"] == "timeout"
    assert rows[2]["status"] == "self"


def test_exchange_answers_refusals_closes_and_timeouts_at_once() -> None:
    """Five loopback listeners, each answering differently, asked in one call."""
    import socket
    import threading
    import time

    from probing.node.cluster.exchange import Exchange, PeerFailure, Reply
    from probing.node.probe.http import request_bytes

    def listener() -> socket.socket:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        return s

    ok, closes, garbage, silent = listener(), listener(), listener(), listener()
    refused = listener()
    refused_port = refused.getsockname()[1]
    refused.close()  # nothing listens there any more
    seen: list[bytes] = []

    def serve() -> None:
        conn, _ = ok.accept()
        data = b""
        while not data.endswith(b"hello"):
            data += conn.recv(1 << 16)
        seen.append(data)
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nabc")
        conn.close()
        closes.accept()[0].close()
        conn, _ = garbage.accept()
        conn.sendall(b"not http")
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    deadline = time.monotonic() + 1.0
    ex = Exchange(deadline)
    req = request_bytes("/cluster/gather", b"hello", b"tok")
    for s in (ok, closes, garbage, silent):  # silent: accepted by the kernel, never answered
        ex.add("127.0.0.1", s.getsockname()[1], req)
    ex.add("127.0.0.1", refused_port, req)
    got = ex.run()
    assert time.monotonic() >= deadline - 0.01  # the silent one waited for the deadline
    assert isinstance(got[0], Reply) and (got[0].status, got[0].body) == (200, b"abc")
    assert got[0].t_done_ns >= got[0].t_send_ns
    assert seen[0].startswith(b"POST /cluster/gather HTTP/1.0\r\n")
    assert b"Authorization: Bearer tok\r\n" in seen[0] and b"Content-Length: 5\r\n" in seen[0]
    reasons = [g.reason if isinstance(g, PeerFailure) else g for g in got[1:]]
    assert reasons == ["connection closed", "connection closed", None, "refused"]
    for s in (ok, closes, garbage, silent):
        s.close()


def test_a_peer_without_a_usable_answer_raises_peer_failure_with_its_reason() -> None:
    from probing.errors import PeerUnreachable
    from probing.node.cluster.exchange import Reply
    from probing.node.cluster.fanout import PeerFailure, PeerLate, answer_of, reply_of

    peer = PeerInfo(1, "n1", "h:1")
    cases = [
        (Reply(401, b'{"error": "bad token"}', 0, 1), "401"),
        (Reply(500, b'{"error": "boom", "type": "ProbingError"}', 0, 1), "500: boom"),
        (Reply(200, b"not a head line", 0, 1), "bad answer: no head line"),
    ]
    for reply, reason in cases:
        with pytest.raises(PeerFailure) as err:
            answer_of(peer, reply)
        assert err.value.reason == reason and isinstance(err.value, PeerUnreachable)
    with pytest.raises(PeerLate) as late:
        reply_of([None], 0)
    assert late.value.reason == "timeout"
    with pytest.raises(PeerFailure, match="refused"):
        reply_of([PeerFailure("refused")], 0)


def test_a_gatherers_answer_brings_its_members_on_my_clock() -> None:
    from probing.node.cluster.exchange import Reply
    from probing.node.cluster.fanout import answer_of

    meta = {
        "node": "n1",
        "missing": [{"rank": 3, "node": "n1", "addr": "h:3", "reason": "refused"}],
        "peers": [
            {"rank": 2, "node": "n1", "addr": "h:2", "response_ms": 1.0, "clock_offset_ns": 5}
        ],  # fmt: skip
    }
    body = pack(meta, {"t": pa.table({"x": [1]})}, 100)
    got = answer_of(PeerInfo(1, "?", "h:1"), Reply(200, body, 0, 10**6))
    assert [t.rank for t in got.peers] == [1, 2] and got.peers[0].node == "n1"
    assert got.peers[1].clock_offset_ns == 5 + got.peers[0].clock_offset_ns
    assert [m.rank for m in got.missing] == [3] and got.merged()["t"].num_rows == 1


def test_a_peers_tables_are_read_tagged_with_its_node_and_rank() -> None:
    tagged = plan.tagged_sql("comm.collectives", ["op", "rank"], "n'1", 3)
    assert tagged == (
        'SELECT "op", "rank" AS "table_rank", \'n\'\'1\' AS node, CAST(3 AS BIGINT) AS rank '
        'FROM "comm"."collectives"'
    )
    spec = plan.ScanSpec(["op", "rank"], "rank > 1")
    assert plan.scan_sql("comm.collectives", "T", spec) == (
        'SELECT "op", "rank" FROM (T) AS "collectives" WHERE rank > 1'
    )
    sql = "SELECT rank, count(*) FROM comm.collectives c GROUP BY rank"
    refs = plan.table_refs(sql, KNOWN)
    assert plan.over_tagged(sql, refs, {"comm.collectives": "T"}) == (
        "SELECT rank, count(*) FROM (T) c GROUP BY rank"
    )
    sql = "SELECT rank FROM process.threads WHERE tid > 0"
    refs = plan.table_refs(sql, KNOWN)
    assert plan.over_tagged(sql, refs, {"process.threads": "T"}) == (
        'SELECT rank FROM (T) AS "threads" WHERE tid > 0'
    )


def test_a_control_fan_out_names_each_rank_it_could_not_ask() -> None:
    from probing.node.cluster import fanout

    class Node:
        ident = identity.Identity(0, 3, 0, "n0", 0, None, "run", (), 0)
        rank, addr, token, registry = 0, None, b"tok", Registry()

        def refresh(self, budget: float = 2.0) -> None:
            pass

        def others(self) -> list[PeerInfo]:
            return [PeerInfo(1, "n1", "no port here")]

        @property
        def share(self) -> Any:
            raise AssertionError("a control action runs nothing here")

    rows = fanout.control(Node(), "/trace/stop", b"{}", 1.0)
    assert rows == [
        {"rank": 1, "node": "n1", "addr": "no port here", "status": 0, "reason": "bad address"},
        {"rank": 2, "node": "?", "addr": "", "status": 0,
         "reason": "not discovered (no probe, or not joined yet)"},
    ]  # fmt: skip


def _one_engines_ranks(n: int) -> list[Any]:
    """``n`` ranks served by one engine (one peer port), as the node's engine
    serves them: each with its own store, with ``bench.events`` (rank r has
    r + 1 rows, rank 1 some sealed and twice as many; the last rank has none
    of it) and a live table ``live.t``."""
    import types

    import numpy as np

    from probing.node.cluster.node import ClusterNode
    from probing.node.cluster.port import NodePort
    from probing.node.probe.api import make_app
    from probing.node.probe.server import UnixHTTPServer
    from probing.node.sql import Database
    from probing.node.store import Store

    port = NodePort(first=0)
    port.server = UnixHTTPServer(None, port.route)
    port.server.start()
    nodes = []
    for rank in range(n):
        store = Store()
        if rank < n - 1:
            rows = np.arange(rank + 1, dtype=np.int64)
            events = store.table("bench", "events")
            events.append_batch({"ts": rows, "dur_ns": rows * 10 + rank})
            if rank == 1:  # sealed in a chunk file, then rows not sealed yet
                events.flush()
                events.append_batch({"ts": rows + 10, "dur_ns": rows * 10 + 7})
                assert events.snapshot().chunk_dir is not None
        eng = Database(store)
        eng.register_table("live", "t", lambda rank=rank: pa.table({"x": [rank * 100]}))
        ident = identity.Identity(
            rank=rank, world_size=n, local_rank=rank, node="n0", group_rank=0, master=None,
            run_id="t", peers=(), port=0,
        )  # fmt: skip
        node = ClusterNode(ident, lambda eng=eng: eng, token=b"t", pid=(1 << 22) + rank)
        node.port = port
        host = types.SimpleNamespace(database=eng, cluster=node, note_query=lambda: None)
        app = make_app(host)
        node.register(app.routes)
        node.setup(types.SimpleNamespace(app=app))
        nodes.append(node)
    for node in nodes:
        for other in nodes:
            if other is not node:
                node.registry.upsert(PeerInfo(other.rank, "n0", other.addr or "", other.pid))
    nodes[0].stop_port = port.server.stop
    return nodes


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT rank, count(*) AS n, sum(dur_ns) AS d FROM bench.events GROUP BY rank",
        "SELECT node, count(*) AS n FROM bench.events GROUP BY node",
        "SELECT rank, ts, dur_ns FROM bench.events WHERE dur_ns > 5 ORDER BY rank, ts",
        "SELECT rank, x FROM live.t ORDER BY rank",
    ],
)
def test_an_engines_ranks_answer_in_one_query_what_each_would_alone(monkeypatch, sql) -> None:  # type: ignore[no-untyped-def]
    """The ranks one engine serves answer a cluster query with one query
    over all their stored rows: the same rows as each rank's own share;
    a rank without the table adds none; a live table is made per rank."""
    from probing.node.cluster import coordinator
    from probing.node.cluster.share import Together

    nodes = _one_engines_ranks(4)
    try:
        runs: list[int] = []
        real = Together.run
        monkeypatch.setattr(Together, "run", lambda self: runs.append(1) or real(self))
        together, got, _ = coordinator.coordinate(nodes[0], sql, fanout="auto")
        assert not got.missing and sorted(t.rank for t in got.peers) == [0, 1, 2, 3]
        assert len(runs) == (0 if "live" in sql else 1)  # one query for the 4 ranks
        monkeypatch.setattr(Together, "prepare", classmethod(lambda cls, owners, work: None))
        apart, _, _ = coordinator.coordinate(nodes[0], sql, fanout="auto")
        assert together.sort_by([(c, "ascending") for c in together.column_names]).equals(
            apart.sort_by([(c, "ascending") for c in apart.column_names])
        )
        assert together.num_rows > 0
    finally:
        nodes[0].stop_port()


@pytest.mark.parametrize("together", [True, False], ids=["together", "rank-by-rank"])
def test_a_read_that_writes_another_table_is_seen_by_a_cluster_query(monkeypatch, together) -> None:  # type: ignore[no-untyped-def]
    """As a rank's sampler's read before python.samples adds its samples'
    stacks to python.stacks: a cluster query joining the two sees every
    sample's stack, whether the ranks run it together or rank by rank, one
    scan a table (which the planner names alphabetically: names, then
    rows). A diagnose --cluster soon after a trace began found its
    straggler's samples without their functions."""
    from probing.node.cluster import coordinator
    from probing.node.cluster.share import Together

    nodes = _one_engines_ranks(3)
    try:
        for node in nodes:
            a_read_that_writes_another(node.share.owner.database().store)
        if not together:
            monkeypatch.setattr(Together, "prepare", classmethod(lambda cls, owners, work: None))
        sql = (
            "SELECT r.rank, r.id, n.name FROM demo.rows r LEFT JOIN demo.names n "
            "ON r.id = n.id AND r.rank = n.rank"
        )
        for _ in range(2):
            got, collected, _ = coordinator.coordinate(nodes[0], sql, fanout="auto")
            assert not collected.missing
            rows_seen = got.to_pylist()
            assert {r["rank"] for r in rows_seen} == {0, 1, 2}, rows_seen
            assert all(r["name"] == f"f{r['id']}" for r in rows_seen), rows_seen
    finally:
        nodes[0].stop_port()


@pytest.mark.parametrize(
    "small", [True, False, "over budget"], ids=["in-memory", "scanned", "budget"]
)
def test_the_ranks_together_follow_their_chunks_as_they_are_sealed_and_retired(
    monkeypatch, small
) -> None:  # type: ignore[no-untyped-def]
    """The session the queries together share keeps each rank's sealed
    chunks registered (or, small, their rows in memory): a chunk sealed
    since, a rank's first, and one retired change the answer as they change
    each rank's own; a range replaced by a newer one of its directory, and
    the rows of one query, are dropped."""
    import numpy as np

    from probing.node.cluster import coordinator, share
    from probing.node.cluster.share import Together

    monkeypatch.setattr(share, "_sessions", {})
    if not small:
        monkeypatch.setattr(share, "SMALL_BYTES", 0)
    if small == "over budget":  # the least recently read go, down to one
        monkeypatch.setattr(share, "SMALL_KEPT", 1)

    sql = (
        "SELECT rank, count(*) AS n, sum(dur_ns) AS d FROM bench.events GROUP BY rank ORDER BY rank"
    )
    nodes = _one_engines_ranks(4)
    events = [n.database().store.table("bench", "events") for n in nodes[:3]]
    runs: list[int] = []
    real = Together.run
    monkeypatch.setattr(Together, "run", lambda self: runs.append(1) or real(self))

    def both() -> dict[str, list[Any]]:
        together, got, _ = coordinator.coordinate(nodes[0], sql, fanout="auto")
        with monkeypatch.context() as m:
            m.setattr(Together, "prepare", classmethod(lambda cls, owners, work: None))
            apart, _, _ = coordinator.coordinate(nodes[0], sql, fanout="auto")
        assert not got.missing and together.equals(apart)
        return together.to_pydict()

    try:
        first = both()
        assert first["n"] == [1, 4, 3]
        for rank in (0, 1):  # rank 0's first chunk, rank 1's second
            rows = np.arange(5, dtype=np.int64)
            events[rank].append_batch({"ts": rows + 100, "dur_ns": rows})
            events[rank].flush()
        assert both()["n"] == [6, 9, 3]
        assert events[1].retire_oldest() is not None  # its first chunk, 2 rows
        assert both()["n"] == [6, 7, 3]
        assert len(runs) == 3
        [session] = share._sessions.values()
        kept = session._rows.items if small else session.schema.table_names()
        assert len(kept) == (1 if small == "over budget" else 2)  # rank 0's, rank 1's newest
        assert session._rows.total == sum(t.nbytes for t in session._rows.items.values())
        assert len(session.schema.table_names()) == (0 if small else 2)
        assert not session._reading and not session._doomed
    finally:
        nodes[0].stop_port()


def test_a_range_a_query_reads_stays_registered_until_it_is_done(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A newer range of a rank's chunks replaces the older one, but a query
    still reading the older keeps it until that query leaves."""
    import types

    import numpy as np

    from probing.node.cluster import share

    monkeypatch.setattr(share, "SMALL_BYTES", 0)  # scanned, not read into memory
    from probing.node.sql import Database
    from probing.node.store import Store

    store = Store()
    events = store.table("bench", "events")
    snaps = []
    for i in range(2):
        events.append_batch({"ts": np.arange(3, dtype=np.int64) + 10 * i})
        events.flush()
        snaps.append(events.snapshot())
    session = share._Session(Database(store).limits)
    owner = types.SimpleNamespace(ident=types.SimpleNamespace(node="n0"), rank=0)
    mem1, old = session.enter("bench.events", [(owner, snaps[0])])
    mem2, new = session.enter("bench.events", [(owner, snaps[1])])
    assert old[0] != new[0]
    assert {mem1, old[0], mem2, new[0]} <= set(session.schema.table_names())
    session.leave([mem1, old[0]])
    assert set(session.schema.table_names()) == {mem2, new[0]}
    session.leave([mem2, new[0]])
    assert set(session.schema.table_names()) == {new[0]}  # kept for the next query
    store.close()


@pytest.mark.parametrize("small", [True, False], ids=["in-memory", "scanned"])
def test_a_retired_ranks_ranges_are_forgotten(monkeypatch, small) -> None:  # type: ignore[no-untyped-def]
    """An engine serves hundreds of jobs: the ranges of a process retired
    (its chunk directory removed) go from the session that kept them."""
    import types

    import numpy as np

    from probing.node.cluster import share
    from probing.node.sql import Database
    from probing.node.store import Store

    if not small:
        monkeypatch.setattr(share, "SMALL_BYTES", 0)
    stores = [Store(), Store()]
    snaps = []
    for store in stores:
        events = store.table("bench", "events")
        events.append_batch({"ts": np.arange(3, dtype=np.int64)})
        events.flush()
        snaps.append(events.snapshot())
    session = share._Session(Database(stores[0]).limits)
    owners = [types.SimpleNamespace(ident=types.SimpleNamespace(node="n0"), rank=r) for r in (0, 1)]
    got = list(zip(owners, snaps, strict=True))
    mem, sealed = session.enter("bench.events", got)
    session.leave([mem, *sealed.values()])
    kept = lambda: session._rows.items if small else session.schema.table_names()  # noqa: E731
    assert len(kept()) == 2
    stores[1].close()  # its process retired
    monkeypatch.setattr(share, "PRUNE_S", 0.0)
    mem, sealed = session.enter("bench.events", got[:1])
    session.leave([mem, *sealed.values()])
    assert len(kept()) == 1
    assert session._rows.total == sum(t.nbytes for t in session._rows.items.values())
    stores[0].close()


def test_a_query_the_ranks_cannot_run_together_runs_rank_by_rank(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The query together fails (here: made to): each rank runs its own
    share, so the answer is whole and each failure is its rank's."""
    from probing.node.cluster import coordinator
    from probing.node.cluster.share import Together

    nodes = _one_engines_ranks(3)
    try:

        def broken(self: Any) -> Any:
            raise QueryError("made to fail")

        monkeypatch.setattr(Together, "run", broken)
        sql = "SELECT rank, count(*) AS n FROM bench.events GROUP BY rank ORDER BY rank"
        table, got, _ = coordinator.coordinate(nodes[0], sql, fanout="auto")
        assert table.to_pydict() == {"rank": [0, 1], "n": [1, 4]} and not got.missing
    finally:
        nodes[0].stop_port()


def test_the_ranks_an_engine_serves_answer_without_the_jobs_store() -> None:
    """The job's store is gone (rank 0 held it and was killed) before the
    other ranks joined: the ranks one engine serves still find each other
    through it (``NodePort.kin``) and answer together; a dead process's node
    (an earlier job's on the same address) and another job's do not."""
    import subprocess
    import sys

    from probing.node.cluster import coordinator
    from probing.node.cluster.node import ClusterNode
    from probing.node.cluster.port import NodePort
    from probing.node.sql import Database
    from probing.node.store import Store

    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                for _ in range(4)]  # fmt: skip
    port, nodes = NodePort(first=0), []
    try:
        for rank, sleeper in enumerate(sleepers):
            eng = Database(Store())
            eng.register_table("live", "t", lambda rank=rank: pa.table({"x": [rank]}))
            master = ("127.0.0.1", 1 if rank < 3 else 2)  # nothing listens on port 1 or 2
            ident = identity.Identity(
                rank=rank + 1 if rank < 3 else 1, world_size=4, local_rank=rank, node="n0",
                group_rank=0, master=master, run_id="none", peers=(), port=0,
            )  # fmt: skip
            # no token: the store had it
            node = ClusterNode(ident, lambda eng=eng: eng, pid=sleeper.pid)
            port.keep(node)
            nodes.append(node)
        sleepers[2].kill()
        sleepers[2].wait()  # rank 3's process is gone: what it left is not asked this way
        table, got, _ = coordinator.coordinate(nodes[0], "SELECT rank, x FROM live.t", timeout=3)
        assert sorted(table.column("x").to_pylist()) == [0, 1], table  # ranks 1 and 2
        assert sorted(t.rank for t in got.peers) == [1, 2]
        assert sorted((m.rank, m.reason) for m in got.missing) == [
            (0, "not discovered"),
            (3, "not discovered"),
        ]  # the other job's rank 1 (another store) is not this job's
    finally:
        for s in sleepers:
            s.kill()
            s.wait()


def test_a_plain_scan_of_a_made_table_asks_this_engines_ranks_no_sql(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``ClusterNode.scan``: ``SELECT cols, node, rank FROM s.t`` of a table
    a function makes (the detector's deaths, spans, groups) reads it on the
    ranks one engine serves, the rows SQL answers; anything else (a store's
    table, a filter) is None: asked by SQL."""
    from probing.node.cluster import coordinator

    nodes = _one_engines_ranks(4)
    sql = "SELECT x, node, rank FROM live.t"
    try:
        by_sql = nodes[0].coordinate(sql, timeout=3)[0].to_pylist()
        monkeypatch.setattr(coordinator, "coordinate", lambda *a, **k: pytest.fail("SQL asked"))
        table, got = nodes[0].scan(sql, timeout=3)
        assert sorted(t.rank for t in got.peers) == [0, 1, 2, 3] and not got.missing
        key = itemgetter("rank")
        assert sorted(table.to_pylist(), key=key) == sorted(by_sql, key=key)
        assert table.column_names == ["x", "node", "rank"]
        assert nodes[0].scan("SELECT ts, node, rank FROM bench.events", timeout=3) is None
        assert nodes[0].scan(f"{sql} WHERE x > 100", timeout=3) is None
        assert nodes[0].scan("SELECT x FROM live.t", timeout=3) is None  # untagged: not its ask
    finally:
        nodes[0].stop_port()


def test_the_detectors_ask_takes_this_engines_ranks_from_their_tracers(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``ClusterNode.collectives_since``: the ranks one engine serves whose
    tracer keeps their calls (``recent``) answer from it with no query; the
    others by SQL (``coordinate``'s ``skip``), each rank once; every rank
    here answering from its tracer, no query is planned at all."""
    from probing.node.cluster import coordinator

    nodes = _one_engines_ranks(4)
    sql = "SELECT ts, dur_ns, node, rank FROM bench.events WHERE dur_ns > 5"
    asked: list[tuple[int, int]] = []

    def kept(rank: int) -> Any:
        def recent(since_ns: int, cursor_ns: int) -> pa.Table:
            asked.append((since_ns, cursor_ns))
            one = pa.array([rank], pa.int64())
            return pa.table({"ts": one, "dur_ns": pa.array([-1]), "node": ["n0"], "rank": one})

        return recent

    try:
        nodes[0].recent, nodes[2].recent = kept(0), kept(2)
        table, got = nodes[0].collectives_since(sql, 1, 2, timeout=3)
        assert asked == [(1, 2), (1, 2)]
        assert not got.missing and sorted(t.rank for t in got.peers) == [0, 1, 2, 3]
        by_rank = {r: [] for r in range(4)}
        for row in table.to_pylist():
            by_rank[row["rank"]].append(row["dur_ns"])
        assert by_rank[0] == [-1] and by_rank[2] == [-1]  # the tracers' rows, not the tables'
        assert sorted(by_rank[1]) == [7, 11, 17] and by_rank[3] == []  # rank 3 has no such table
        nodes[1].recent, nodes[3].recent = kept(1), kept(3)
        monkeypatch.setattr(coordinator, "coordinate", lambda *a, **k: pytest.fail("SQL asked"))
        table, got = nodes[0].collectives_since(sql, 1, 2, timeout=3)
        assert sorted(table.column("rank").to_pylist()) == [0, 1, 2, 3]
        assert sorted(t.rank for t in got.peers) == [0, 1, 2, 3]
        for node in nodes:
            node.recent = lambda since_ns, cursor_ns: None  # none can say: SQL, as before
        assert nodes[0].collectives_since(sql, 1, 2, timeout=3) is None
    finally:
        nodes[0].stop_port()
