from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest

from probing.errors import QueryError
from probing.guest.inside import columns, expr
from probing.node.sql import Database
from probing.node.store import Store
from probing.node.tables import ExternalTable, install
from probing.node.tables.python import to_arrow
from tests.conftest import a_read_that_writes_another


@pytest.fixture
def database() -> Database:
    eng = Database(Store())
    install(eng)
    return eng


def test_process_info_is_this_process(database: Database) -> None:
    row = database.sql("SELECT pid, ppid, num_threads FROM process.info").to_pylist()[0]
    assert row["pid"] == os.getpid() and row["ppid"] == os.getppid()
    assert row["num_threads"] >= 1


def test_process_threads_names_python_threads(database: Database) -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="data-loader-7")
    t.start()
    try:
        rows = database.sql("SELECT tid, name, is_python, is_main FROM process.threads").to_pylist()
    finally:
        stop.set()
        t.join()
    by_tid = {r["tid"]: r for r in rows}
    assert by_tid[t.native_id]["name"] == "data-loader-7"
    assert by_tid[t.native_id]["is_python"] is True
    assert by_tid[threading.main_thread().native_id]["is_main"] is True


@pytest.mark.parametrize(
    "sql",
    [
        "CREATE TABLE x AS SELECT 1",
        "CREATE VIEW v AS SELECT 1",
        "INSERT INTO probing.tables VALUES ('a')",
        "SET datafusion.execution.batch_size = 1",
        "DROP TABLE probing.tables",
    ],
)
def test_writes_and_statements_are_refused(database: Database, sql: str) -> None:
    with pytest.raises(QueryError):
        database.sql(sql)
    # and the database keeps answering
    assert database.sql("SELECT 1 AS one").to_pylist() == [{"one": 1}]


def test_bad_sql_names_the_problem(database: Database) -> None:
    with pytest.raises(QueryError, match="no table process.nope"):
        database.sql("SELECT * FROM process.nope")
    with pytest.raises(QueryError):
        database.sql("SELEC 1")
    with pytest.raises(QueryError, match="empty"):
        database.sql("  ")


def test_python_expressions_become_tables(database: Database) -> None:
    assert database.sql("SELECT * FROM python.`1 + 2`").to_pylist() == [{"value": 3}]
    t = database.sql("SELECT value FROM python.`time.time()`").column(0)[0].as_py()
    assert isinstance(t, float) and t > 1.6e9  # `time` imported on demand
    assert database.sql("SELECT a, b FROM python.`{'a': 1, 'b': 'x'}`").to_pylist() == [
        {"a": 1, "b": "x"}
    ]
    assert database.sql("SELECT * FROM python.`{'a': [1, 2], 'b': [3, 4]}`").num_rows == 2
    assert database.sql(
        "SELECT sum(k) AS s FROM python.`[{'k': i} for i in range(5)]`"
    ).to_pylist() == [{"s": 10}]
    assert database.sql("SELECT count(*) AS n FROM python.`list(range(7))`").to_pylist() == [
        {"n": 7}
    ]


def test_python_expression_errors_are_query_errors(database: Database) -> None:
    with pytest.raises(QueryError, match="ZeroDivisionError"):
        database.sql("SELECT * FROM python.`1/0`")
    with pytest.raises(QueryError, match="no_such_name_xyz"):
        database.sql("SELECT * FROM python.`no_such_name_xyz + 1`")


def test_to_arrow_handles_odd_values() -> None:
    assert to_arrow(columns(object)).column_names == ["value"]  # unconvertible -> repr
    assert to_arrow(columns(pa.table({"q": [1]}))).column_names == ["q"]
    assert to_arrow(columns({"a": [1, 2], "b": 3})).num_rows == 1
    mixed = to_arrow({"v": [1, "a", object]})  # no one Arrow type: each value's repr
    assert mixed.column("v").type == pa.string() and mixed.num_rows == 3


def test_values_cross_as_plain_data() -> None:
    """What the process evaluates crosses to the engine as JSON would carry it."""
    assert expr("[{'a': 1}, {'b': 2}]") == {"a": [1, None], "b": [None, 2]}
    assert expr("{'x': [1, 2], 'y': [3, 4]}") == {"x": [1, 2], "y": [3, 4]}
    assert expr("(1, 2.5)") == {"value": [1, 2.5]}
    assert expr("object")["value"][0].startswith("<class")


def test_external_table_is_queryable(database: Database) -> None:
    t = ExternalTable("loss", ["step", "loss"], store=database.store)
    for i in range(10):
        t.append([i, 1.0 / (i + 1)])
    t.append({"step": 10, "loss": 0.0})
    t.append_many([[11, 0.5], [12, 0.25]])
    rows = database.sql("SELECT count(*) AS n, max(step) AS m FROM python.loss").to_pylist()
    assert rows == [{"n": 13, "m": 12}]
    assert "loss" in database.sql("SHOW TABLES").column("table_name").to_pylist()


def test_empty_external_table_has_its_columns(database: Database) -> None:
    ExternalTable("later", ["step", "loss"], store=database.store)
    assert database.sql("SELECT step, loss FROM python.later").num_rows == 0


def test_external_table_checks_rows(database: Database) -> None:
    t = ExternalTable("typed", [("a", pa.int32()), ("b", pa.string())], store=database.store)
    with pytest.raises(ValueError, match="2 columns"):
        t.append([1])
    with pytest.raises(ValueError, match="no column"):
        t.append({"zzz": 1})
    t.append([1, "x"])
    assert database.sql("SELECT arrow_typeof(a) AS t FROM python.typed").to_pylist() == [
        {"t": "Int32"}
    ]
    with pytest.raises(ValueError, match="already exists"):
        ExternalTable("typed", ["other"], store=database.store)


def test_store_tables_appear_in_their_schema(database: Database) -> None:
    with pytest.raises(QueryError):
        database.sql("SELECT * FROM demo.calls")
    database.store.table("demo", "calls").append_batch({"x": [1, 2, 3]})
    assert database.sql("SELECT sum(x) AS s FROM demo.calls").to_pylist() == [{"s": 6}]
    assert database.sql(
        "SELECT rows FROM probing.tables WHERE \"schema\" = 'demo'"
    ).to_pylist() == [{"rows": 3}]


def test_table_exist_and_fresh_snapshots(database: Database) -> None:
    schema = database.schema("demo2")
    database.store.table("demo2", "ev").append_batch({"x": [1]})
    assert schema.table_exist("ev") and not schema.table_exist("nope")
    assert database.sql("SELECT count(*) AS n FROM demo2.ev").to_pylist() == [{"n": 1}]
    database.store.table("demo2", "ev").append_batch({"x": [2]})
    database.sql("SELECT 1")  # a query that does not name the table
    assert database.sql("SELECT count(*) AS n FROM demo2.ev").to_pylist() == [{"n": 2}]
    assert schema.table("ev") is not None  # planning-time path (pyarrow) still answers


def test_a_read_that_writes_another_table_is_seen_by_the_same_query(database: Database) -> None:
    """As the sampler's read before python.samples adds its samples' stacks
    to python.stacks: a query joining the two sees every sample's stack,
    whichever table the store made first (a diagnose soon after a trace
    began found its straggler's samples without their functions)."""
    a_read_that_writes_another(database.store)
    sql = "SELECT r.id, n.name FROM demo.rows r LEFT JOIN demo.names n ON r.id = n.id"
    for _ in range(3):
        got = database.sql(sql).to_pylist()
        assert got and all(r["name"] == f"f{r['id']}" for r in got), got


def test_process_stacks_in_process(database) -> None:
    import threading

    ready, stop = threading.Event(), threading.Event()

    def parked_here() -> None:
        ready.set()
        stop.wait()

    t = threading.Thread(target=parked_here, name="parked", daemon=True)
    t.start()
    ready.wait()
    try:
        rows = database.sql(
            "SELECT tid, state, syscall, func, depth FROM process.stacks "
            "WHERE thread = 'parked' ORDER BY depth"
        ).to_pylist()
    finally:
        stop.set()
    assert rows and all(r["tid"] == t.native_id for r in rows)
    funcs = [r["func"].rsplit(".", 1)[-1] for r in rows]  # qualified names on 3.11+
    assert funcs.index("wait") < funcs.index("parked_here") < funcs.index("run")
    assert rows[0]["state"] == "waiting" and rows[0]["syscall"] == "futex"
    mine = database.sql("SELECT func FROM process.stacks WHERE thread = 'MainThread'")
    assert "test_process_stacks_in_process" in mine.column(0).to_pylist()


def test_concurrent_queries_keep_their_own_snapshots(database: Database) -> None:
    """Each query plans over its own snapshots: another thread's query, or a
    query that a table's producer runs while this one is planned (the
    ``analyze.*`` tables do), never drops them (issue 20: 1 in 150 failed
    with "table 'probing.comm.collectives' not found")."""
    calls = database.store.table("gloo", "calls")
    row = {n: [0] for n in calls.schema.names}
    calls.append_batch(row)

    def inner() -> pa.Table:  # as analyze.* does: the inner query on a thread of its own
        with ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(database.sql, "SELECT count(*) AS n FROM demo3.other").result()

    database.register_table("nested", "inner", inner)
    database.store.table("demo3", "other").append_batch({"x": [1]})
    queries = [
        "SELECT count(*) AS n FROM comm.collectives",
        "SELECT count(*) AS n FROM gloo.calls",
        "SELECT (SELECT count(*) FROM comm.collectives) AS n, i.n AS m FROM nested.inner i",
        "SELECT count(*) AS n FROM demo3.other",
    ]
    errors: list[str] = []

    def client(k: int) -> None:
        try:
            for i in range(60):
                database.sql(queries[(i + k) % len(queries)])
        except Exception as err:  # collected and asserted below
            errors.append(f"{type(err).__name__}: {err}")

    def writer() -> None:
        for _ in range(60):
            calls.append_batch(row)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    threads.append(threading.Thread(target=writer))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert database.sql("SELECT count(*) AS n FROM gloo.calls").to_pylist() == [{"n": 61}]


def test_deferred_tables_install_at_the_first_query_that_needs_them(database: Database) -> None:
    calls = []

    def install_late() -> None:
        calls.append(1)
        database.register_table("late", "rows", lambda: pa.table({"x": [1, 2]}))

    database.defer("late", install_late)
    database.sql("SELECT pid FROM process.info")
    assert calls == []  # a query over another schema does not install them
    names = database.sql(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'late'"
    )
    assert names.column(0).to_pylist() == ["rows"]
    assert database.sql("SELECT sum(x) AS s FROM late.rows").column(0).to_pylist() == [3]
    assert calls == [1]  # once


def test_probe_tables_leave_analyze_and_pyarrow_dataset_to_their_first_use() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from probing.node.assemble import install_tables\n"
        "from probing.node.probe.context import ProbeContext\n"
        "e = ProbeContext(installers=(install_tables,)).database\n"
        "e.sql('SELECT pid FROM process.info')\n"
        "print(sorted(m for m in ('probing.analyze', 'pyarrow.dataset') if m in sys.modules))\n"
        "e.sql('SELECT * FROM analyze.ranks')\n"
        "print('probing.analyze' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[:2] == ["[]", "True"]


ENGINE_POOLS = """
import collections, os, sys
import pyarrow as pa
from probing.node.service.engine import _few_threads
_few_threads()
import pyarrow.parquet as pq
from probing.node.sql import Database
from probing.node.store import Store
t = pa.table({"a": list(range(50_000)), "b": [str(i % 7) for i in range(50_000)]})
pq.write_table(t, sys.argv[1])
pq.read_table(sys.argv[1]).sort_by("a")
store = Store()
store.table("t", "x").append_batch(t)
Database(store).sql("SELECT b, sum(a) FROM t.x GROUP BY b")
names = collections.Counter(
    open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task"))
tokio = os.environ["TOKIO_WORKER_THREADS"]
print(pa.cpu_count(), pa.io_thread_count(), tokio, names["tokio-rt-worker"])
"""


def test_the_engines_native_pools_are_a_few_threads_whatever_the_cores(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Arrow's CPU and I/O pools and DataFusion's runtime are sized by the
    node (a thread a core; eight for I/O): the engine takes two each."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TOKIO_WORKER_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_POOLS, str(tmp_path / "t.parquet")],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    ).stdout.split()  # fmt: skip
    cpu, io, tokio, workers = (int(x) for x in out)
    assert cpu <= 2 and io == 2 and tokio == 2 and workers <= 3, out
