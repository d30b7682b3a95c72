"""Catch-alls narrowed: what is expected is caught; a bug is logged with its
traceback (or answered 500), never swallowed and never answered as bad SQL."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import types
from typing import Any

import pyarrow as pa
import pytest

from probing import errors
from probing.node.probe import connections
from probing.node.probe import server as srv
from probing.node.probe.context import ProbeContext, base_tables
from probing.node.probe.http import Response
from probing.node.probe.request import Head, answer
from probing.node.sql import Database, run
from probing.node.store import Store


def _raised(err: BaseException) -> BaseException:
    try:
        raise err
    except BaseException as caught:  # the test wants it with a traceback
        return caught


# -- the log -----------------------------------------------------------------------


def test_log_unexpected_writes_each_error_once_with_its_traceback(capfd, monkeypatch) -> None:
    seen: set[str] = set()
    first = _raised(KeyError("k"))
    for _ in range(3):
        errors.log_unexpected("the loop", first, seen)
    errors.log_unexpected("the loop", _raised(TypeError("t")), seen)
    log = capfd.readouterr().err
    assert log.count("probing: the loop: KeyError: 'k'") == 1
    assert log.count("probing: the loop: TypeError: t") == 1
    assert log.count("Traceback (most recent call last)") == 2
    errors.log_unexpected("unremembered", first)  # no set: written every time
    errors.log_unexpected("unremembered", first)
    assert capfd.readouterr().err.count("Traceback") == 2
    monkeypatch.setattr(sys, "stderr", None)
    errors.log_unexpected("no stderr", first)  # nothing to tell, nothing raised


# -- the engine: DataFusion's errors are the SQL's; anything else is a bug --------------


def test_datafusion_error_tells_the_engines_answers_from_a_bug() -> None:
    assert run.datafusion_error(Exception("DataFusion error: Arrow error: Divide by zero"))
    assert run.datafusion_error(ValueError("SQL error: ParserError"))
    assert run.datafusion_error(pa.ArrowInvalid("bad batch"))
    assert not run.datafusion_error(KeyError("x"))
    assert not run.datafusion_error(TypeError("x"))
    assert not run.datafusion_error(UnicodeDecodeError("utf-8", b"", 0, 1, "x"))


def test_sql_errors_stay_400_and_a_bug_in_the_engine_is_not_bad_sql(monkeypatch) -> None:
    database = Database(Store())
    with pytest.raises(errors.QueryError, match="Divide by zero"):
        database.sql("SELECT 1/0")
    with pytest.raises(errors.QueryError):
        database.sql("SELEC 1")

    def denied() -> pa.Table:
        raise PermissionError("a table raises this on purpose")

    database.register_table("test", "denied", denied)
    with pytest.raises(errors.QueryError, match="on purpose"):  # as before: 400
        database.sql("SELECT * FROM test.denied")

    def broken(df: Any, limits: Any, schema: Any = None) -> pa.Table:
        raise TypeError("a bug in probing")

    monkeypatch.setattr(run, "collect", broken)
    with pytest.raises(TypeError, match="a bug in probing"):
        database.sql("SELECT 1")


def test_the_final_step_of_a_cluster_query_sorts_its_errors_alike(monkeypatch) -> None:
    from probing.node.cluster import plan

    table = pa.table({"a": [1, 2]})
    tables = {"t.x": table}
    assert plan.run_final("SELECT sum(a) AS s FROM t.x", tables).to_pylist() == [{"s": 3}]
    with pytest.raises(errors.QueryError):
        plan.run_final("SELECT nope FROM t.x", tables)

    def broken(df: Any, limits: Any, schema: Any = None) -> pa.Table:
        raise TypeError("a bug in probing")

    monkeypatch.setattr(run, "collect", broken)
    with pytest.raises(TypeError, match="a bug in probing"):
        plan.run_final("SELECT a FROM t.x", tables)


def test_a_bug_in_the_engine_answers_500_with_its_traceback_in_the_log(
    runtime_dir, capfd, monkeypatch
) -> None:
    from probing.cli.client import ProbeClient, UnixTransport

    path = runtime_dir / f"probing-{os.getuid()}" / "engine-bug.sock"
    ctx = ProbeContext(installers=(base_tables,), socket_path=str(path))
    ctx.serve()
    try:
        client = ProbeClient(UnixTransport(ctx.socket_path, pid=os.getpid()))
        real = run.collect

        def broken(df: Any, limits: Any, schema: Any = None) -> pa.Table:
            if "engine-bug" in str(df.logical_plan()):
                raise TypeError("a bug in probing")
            return real(df, limits, schema)

        monkeypatch.setattr(run, "collect", broken)
        status, _, body = client.transport.request(
            "POST", "/query", json.dumps({"sql": "SELECT 'engine-bug' AS x"}).encode()
        )
        assert status == 500, body
        assert "TypeError: a bug in probing" in json.loads(body)["error"]
        with pytest.raises(errors.QueryError):  # bad SQL is still a 400
            client.query("SELEC 1")
    finally:
        ctx.stop()
    log = capfd.readouterr().err
    assert "Traceback (most recent call last)" in log
    assert "POST /query failed: TypeError: a bug in probing" in log


def test_a_query_thread_that_cannot_be_started_is_a_query_error(monkeypatch) -> None:
    def refuse(target: Any, stack_bytes: int) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(run, "_start_thread", refuse)
    with pytest.raises(errors.QueryError, match="no thread could be started"):
        run.QueryThreads().run(lambda: 1, timeout_s=5)


# -- the server: its loop and its workers never die, and never stay silent --------------


def _get(path: str) -> bytes:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    s.sendall(b"GET /x HTTP/1.0\r\n\r\n")
    s.shutdown(socket.SHUT_WR)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    return out


def test_the_answer_to_a_crashing_app_is_500_with_its_traceback_logged(capfd) -> None:
    def app(req: Any) -> Response:
        raise ZeroDivisionError("in the app")

    resp = answer(app, Head("GET", "/x", {}, 0), b"", None, None)
    assert resp.status == 500
    log = capfd.readouterr().err
    assert "GET /x failed: ZeroDivisionError: in the app" in log and "Traceback" in log


def test_the_server_loop_counts_and_logs_a_bug_then_goes_on(tmp_path, capfd) -> None:
    server = srv.UnixHTTPServer(str(tmp_path / "rt" / "loop.sock"), lambda r: Response.json({}))
    left = [3]

    def flaky() -> None:
        if left[0]:
            left[0] -= 1
            raise RuntimeError("injected into the loop")
        srv.UnixHTTPServer._once(server)

    server._once = flaky  # type: ignore[method-assign]
    server.start()
    try:
        assert _get(server.path).startswith(b"HTTP/1.0 200")  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while left[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _get(server.path).startswith(b"HTTP/1.0 200")  # type: ignore[arg-type]
        assert server.stats["loop_errors"] == 3
    finally:
        server.stop()
    log = capfd.readouterr().err
    assert log.count("the server loop failed: RuntimeError: injected into the loop") == 1


def test_a_request_worker_logs_a_bug_and_serves_the_next_request(tmp_path, capfd, monkeypatch):  # type: ignore[no-untyped-def]
    server = srv.UnixHTTPServer(str(tmp_path / "rt" / "w.sock"), lambda r: Response.json({}))
    real = connections.response_bytes
    left = [1]

    def flaky(resp: Response) -> bytes:
        if left[0]:
            left[0] -= 1
            raise AttributeError("injected into the worker")
        return real(resp)

    monkeypatch.setattr(connections, "response_bytes", flaky)
    server.start()
    try:
        assert _get(server.path) == b""  # type: ignore[arg-type]  # closed with no answer
        assert _get(server.path).startswith(b"HTTP/1.0 200")  # type: ignore[arg-type]
    finally:
        server.stop()
    log = capfd.readouterr().err
    assert "a request worker failed: AttributeError: injected into the worker" in log
    assert "Traceback" in log


# -- the store: a writer never sees a sealing failure; reads go on past a drain's -----


def test_a_failed_drain_is_counted_every_time_and_logged_once(capfd) -> None:
    table = Store().table("test", "drained")
    table.append_batch(pa.RecordBatch.from_pydict({"a": [1]}))

    def drain() -> None:
        raise ValueError("undecodable event")

    table.add_before_read(drain)
    for _ in range(3):
        assert table.to_arrow().num_rows == 1
    assert table.read_errors >= 3
    log = capfd.readouterr().err
    assert log.count("a flush before a read: ValueError: undecodable event") == 1
    assert log.count("Traceback") == 1


@pytest.mark.parametrize(
    ("err", "traceback"), [(OSError(28, "No space left on device"), False), (TypeError("x"), True)]
)
def test_a_failed_seal_drops_and_counts_its_rows_a_bug_with_its_traceback(
    capfd, err: Exception, traceback: bool
) -> None:
    store = Store()
    table = store.table("test", "sealed")
    real = store.codec

    class Failing:
        extension = real.extension
        container = real.container

        def encode(self, t: pa.Table) -> pa.Buffer:
            raise err

    store.codec = Failing()  # type: ignore[assignment]
    table.append_batch(pa.RecordBatch.from_pydict({"a": [1, 2, 3]}))
    table.flush()  # never raises into the writer
    assert table.dropped_events == 3 and "sealing failed" in (table.last_error or "")
    log = capfd.readouterr().err
    assert "3 rows dropped" in log
    assert ("Traceback" in log) is traceback


# -- the collectors and the probe's own threads --------------------------------------


def test_the_nvml_thread_counts_a_bug_every_turn_and_logs_it_once(capfd) -> None:
    from probing.node.tables.nvml import GpuSampler

    sampler = GpuSampler(Store())
    calls = []

    def sample() -> int:
        calls.append(1)
        if len(calls) >= 3:
            sampler._stop.set()
        raise KeyError("a bug in sampling")

    sampler.sample = sample  # type: ignore[method-assign]
    sampler.interval_s = 0.001
    thread = threading.Thread(target=sampler._loop)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and sampler.errors == 3
    assert sampler.last_error == "sample: 'a bug in sampling'"
    log = capfd.readouterr().err
    assert log.count("NVML sampling: KeyError: 'a bug in sampling'") == 1


def test_a_bad_cluster_setting_is_one_line_a_bug_has_its_traceback(capfd) -> None:
    def bad_value(ctx: ProbeContext) -> Any:
        raise ValueError("PROBING_PEERS: not an address")

    def bug(ctx: ProbeContext) -> Any:
        raise NameError("a bug in the node")

    assert ProbeContext(cluster=bad_value)._cluster_node() is None
    log = capfd.readouterr().err
    assert "cluster mode off: PROBING_PEERS: not an address" in log and "Traceback" not in log
    assert ProbeContext(cluster=bug)._cluster_node() is None
    log = capfd.readouterr().err
    assert "NameError: a bug in the node" in log and "Traceback" in log


def test_the_join_loop_stays_local_on_a_bug_and_logs_it(capfd) -> None:
    from probing.node.cluster import join

    def try_join(budget: float) -> bool:
        raise IndexError("a bug in joining")

    node = types.SimpleNamespace(
        learn=None, try_join=try_join, ready=threading.Event(), error=None, pid=os.getpid()
    )
    join.run(node)  # the node's thread; the rank is known: the store
    assert node.ready.is_set() and node.error == "IndexError: a bug in joining"
    assert "Traceback" in capfd.readouterr().err


def test_torch_groups_skip_what_torch_refuses(monkeypatch) -> None:
    from probing.guest import inside as groups

    class Group:
        def __init__(self, backend: Any) -> None:
            self.backend = backend

        def _get_backend(self, device: Any) -> Any:
            if self.backend is None:
                raise RuntimeError("No backend type associated with device type cpu")
            return self.backend

        def rank(self) -> int:
            return 0

    class MeshGroup(Group):
        group_desc = "mesh_dp"

    ProcessGroupGloo = type("ProcessGroupGloo", (), {})  # the name torch gives it
    gloo, nccl, mesh = Group(ProcessGroupGloo()), Group(None), MeshGroup(ProcessGroupGloo())
    world = types.SimpleNamespace(
        pg_names={gloo: "gloo", nccl: "nccl", mesh: "3"},
        pg_group_ranks={gloo: {0: 0, 1: 1}, nccl: {}, mesh: {2: 0, 3: 1}},
    )
    dist = types.ModuleType("torch.distributed")
    dist.is_initialized = lambda: True  # type: ignore[attr-defined]
    dist.distributed_c10d = types.SimpleNamespace(_world=world)  # type: ignore[attr-defined]
    torch = types.ModuleType("torch")
    torch.device = lambda name: name  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    found = groups.torch_groups()
    assert [(name, ranks, rank) for name, ranks, rank, _ in found] == [
        ("gloo", [0, 1], 0),
        ("3 (mesh_dp)", [2, 3], 0),  # a device mesh's dimension says which it is
    ]
    del dist.distributed_c10d  # type: ignore[attr-defined]  # torch internals moved
    assert groups.torch_groups() == []


def test_a_context_is_its_own_groups_when_the_search_reads_into_a_neighbour() -> None:
    """Two Gloo groups' C++ objects side by side in memory, each holding its
    context vector at the same offset: the search past the first object's
    end reads the second's vector too, and each context is still named once,
    by the group that holds it (comm.groups; a context named by two groups
    swapped a tensor-parallel hang's ranks in CI)."""
    import ctypes

    from probing.guest import inside

    words = inside.OBJECT_BYTES // 8
    ctx_a, ctx_b = 0x5A5A_0000, 0x5B5B_0000
    vec_a, vec_b = (ctypes.c_uint64 * 2)(ctx_a, 0), (ctypes.c_uint64 * 2)(ctx_b, 0)  # shared_ptrs
    heap = (ctypes.c_uint64 * (2 * words))()
    half = words // 2  # the second object starts inside the first one's search
    for at, vec in ((8, vec_a), (half + 8, vec_b)):  # a std::vector's begin and end
        heap[at], heap[at + 1] = ctypes.addressof(vec), ctypes.addressof(vec) + 16
    # pybind11 keeps the C++ object's address after the object header, as ctypes does
    a = (ctypes.c_uint64 * half).from_buffer(heap)
    b = (ctypes.c_uint64 * half).from_buffer(heap, 8 * half)
    found = [("1", [0, 2], 0, a), ("3", [0, 1], 0, b)]
    rows = inside.groups([ctx_a, ctx_b], find=lambda: found)
    assert [(r["comm"], r["pg"]) for r in rows] == [(ctx_a, "1"), (ctx_b, "3")]
    rows = inside.groups([ctx_a, ctx_b], find=lambda: found[::-1])  # either order
    assert [(r["comm"], r["pg"]) for r in rows] == [(ctx_a, "1"), (ctx_b, "3")]


def test_check_bcc_says_why_bcc_cannot_be_imported(monkeypatch) -> None:
    from probing import checks

    monkeypatch.setitem(sys.modules, "bcc", None)
    check = checks.check_bcc()
    assert not check.ok and "not importable" in check.detail
