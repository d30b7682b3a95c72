from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from probing.node.sql import Database
from probing.node.store import CODECS, Store
from probing.node.tables import ExternalTable, install


def events(n: int, start: int = 0, seed: int = 0) -> pa.Table:
    """Realistic trace rows: monotonic ns timestamps, ~50 names, small ints."""
    rng = np.random.default_rng(seed)
    names = np.array([f"ncclKernel_AllReduce_RING_LL_Sum_f{i}" for i in range(50)])
    ts = 1_700_000_000_000_000_000 + start * 1000 + np.cumsum(rng.integers(200, 2000, n))
    return pa.table(
        {
            "ts": ts.astype(np.int64),
            "name": names[rng.zipf(1.5, n) % 50],
            "dur_ns": rng.integers(1_000, 50_000, n).astype(np.int64),
            "rank": (np.arange(n) % 8).astype(np.int32),
            "bytes": (1 << rng.integers(10, 24, n)).astype(np.int64),
        }
    )


def test_rows_are_visible_before_and_after_sealing() -> None:
    store = Store(chunk_rows=1000)
    tbl = store.table("t", "ev")
    tbl.append_batch(events(600))
    assert tbl.stats().chunks == 0 and tbl.to_arrow().num_rows == 600
    tbl.append_batch(events(600, start=600))
    st = tbl.stats()
    assert st.chunks == 1 and st.pending_rows == 0 and st.rows == 1200
    assert tbl.to_arrow().num_rows == 1200


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_every_codec_round_trips(codec: str) -> None:
    store = Store(chunk_rows=5000, codec=codec)
    data = events(12_000)
    tbl = store.table("t", "ev")
    for i in range(0, 12_000, 3000):
        tbl.append_batch(data.slice(i, 3000))
    tbl.flush()
    back = tbl.to_arrow().sort_by("ts")
    assert back.equals(data.sort_by("ts"))
    tbl.append_batch(data.slice(0, 10))  # and rows not sealed yet
    assert tbl.stats().chunks >= 2 and tbl.stats().pending_rows == 10
    ts = data.column("ts").to_pylist()
    one = tbl.to_arrow(["ts"])  # one column read
    assert one.column_names == ["ts"] and sorted(one.column(0).to_pylist()) == sorted(ts + ts[:10])


def test_mapping_of_arrays_appends() -> None:
    store = Store()
    tbl = store.table("t", "m")
    n = tbl.append_batch({"a": np.arange(5, dtype=np.int64), "b": ["x"] * 5})
    assert n == 5 and tbl.to_arrow().column("a").to_pylist() == [0, 1, 2, 3, 4]


def test_rows_that_do_not_fit_are_refused_and_counted() -> None:
    store = Store()
    tbl = store.table("t", "s", pa.schema([("a", pa.int64())]))
    with pytest.raises(ValueError, match="do not fit t.s"):
        tbl.append_batch({"b": [1, 2, 3]})
    assert tbl.stats().dropped_events == 3 and tbl.stats().rows == 0


def test_byte_budget_retires_oldest_chunks_and_counts_them() -> None:
    store = Store(chunk_rows=10_000, max_bytes=300_000)
    a, b = store.table("t", "a"), store.table("t", "b")
    for i in range(20):
        a.append_batch(events(10_000, start=i * 10_000, seed=i))
        b.append_batch(events(10_000, start=i * 10_000, seed=100 + i))
    assert sum(s.stored_bytes for s in store.stats()) <= 300_000
    for tbl in (a, b):
        st = tbl.stats()
        assert st.retired_rows > 0
        assert st.rows + st.retired_rows == 200_000
        # the newest rows survive, the oldest went
        assert (
            tbl.to_arrow().column("ts").to_numpy().max()
            == events(10_000, start=190_000, seed=19 if tbl is a else 119)
            .column("ts")
            .to_numpy()
            .max()
        )


def test_budget_holds_for_a_table_nobody_reads() -> None:
    """A trickle of rows (a traced job's collectives) far below ``chunk_rows``,
    and no query: aged rows are sealed as they come, and the budget holds."""
    store = Store(max_bytes=20_000, seal_after_s=0.0)
    tbl = store.table("t", "trickle")
    for i in range(200):
        tbl.append_batch(events(50, start=i * 50, seed=i))
    st = tbl.stats()
    assert st.retired_rows > 0 and st.rows + st.retired_rows == 10_000
    assert sum(s.stored_bytes for s in store.stats()) <= 20_000


def test_age_limit_retires_sealed_chunks() -> None:
    store = Store(chunk_rows=100, max_age_s=0.0)
    tbl = store.table("t", "a")
    tbl.append_batch(events(150))  # sealed at once: over chunk_rows
    tbl.append_batch(events(50, start=150))  # stays pending
    store.enforce_retention()
    st = tbl.stats()
    assert st.retired_rows == 150 and st.rows == 50


def test_a_million_events_compress_5x_and_sum_right() -> None:
    store = Store()
    database = Database(store)
    install(database)
    ext = ExternalTable("events", ["ts", "name", "dur_ns", "rank", "bytes"], store=store)
    data = events(1_000_000, seed=7)
    cols = [data.column(i).to_pylist() for i in range(data.num_columns)]
    ext.append_many(zip(*cols, strict=True))
    stats = database.sql(
        "SELECT rows, compression_ratio FROM probing.tables WHERE \"table\" = 'events'"
    ).to_pylist()[0]
    assert stats["rows"] == 1_000_000
    assert stats["compression_ratio"] >= 5.0, stats
    got = database.sql(
        "SELECT name, count(*) AS n, sum(dur_ns) AS d, sum(bytes) AS b "
        "FROM python.events GROUP BY name ORDER BY name"
    ).to_pylist()
    expect = (
        data.group_by("name")
        .aggregate([("name", "count"), ("dur_ns", "sum"), ("bytes", "sum")])
        .sort_by("name")
        .to_pylist()
    )
    assert [(r["name"], r["n"], r["d"], r["b"]) for r in got] == [
        (r["name"], r["name_count"], r["dur_ns_sum"], r["bytes_sum"]) for r in expect
    ]


def test_idle_pending_rows_are_sealed_at_the_next_read() -> None:
    store = Store(seal_after_s=0.0)
    ext = ExternalTable("slow", ["a", "b"], store=store)
    for i in range(300):
        ext.append([i, "x"])
    tbl = store.get("python", "slow")
    assert tbl.to_arrow().num_rows == 300
    st = tbl.stats()
    assert st.chunks == 1 and st.pending_rows == 0 and st.stored_bytes < st.raw_bytes


@pytest.mark.parametrize("defer_seal", [False, True], ids=["writer-seals", "sealer-thread"])
def test_queries_during_appends_never_see_a_row_twice(defer_seal: bool) -> None:
    """Snapshots are consistent while a writer (or the store's sealer thread,
    as for the tracer's drain) seals chunks underneath them."""
    import threading

    store = Store(chunk_rows=3000, max_bytes=1 << 30)
    database = Database(store)
    install(database)
    tbl = store.table("t", "seqs")
    stop = threading.Event()
    batch = 1000

    tbl.append_batch({"seq": np.arange(0, batch, dtype=np.int64)})

    def writer() -> None:
        i = 1
        while not stop.is_set() and i < 400:
            rows = {"seq": np.arange(i * batch, (i + 1) * batch, dtype=np.int64)}
            tbl.append_batch(rows, defer_seal=defer_seal)
            i += 1

    w = threading.Thread(target=writer)
    w.start()
    seen = []
    try:
        for _ in range(40):
            r = database.sql(
                "SELECT count(*) AS n, count(DISTINCT seq) AS d, max(seq) AS m FROM t.seqs"
            ).to_pylist()[0]
            seen.append(r)
    finally:
        stop.set()
        w.join()
    for r in seen:
        assert r["n"] == r["d"], r  # no duplicates
        assert r["n"] % batch == 0 and r["m"] == r["n"] - 1, r  # no gaps
    assert [r["n"] for r in seen] == sorted(r["n"] for r in seen)


def test_deferred_seals_keep_rows_readable_and_flush_waits_for_them() -> None:
    store = Store(chunk_rows=10_000)
    tbl = store.table("t", "d")
    data = events(50_000)
    for i in range(0, 50_000, 5_000):
        tbl.append_batch(data.slice(i, 5_000), defer_seal=True)
        assert tbl.to_arrow().num_rows == i + 5_000  # sealed, being sealed or pending
    tbl.flush()
    st = tbl.stats()
    assert st.chunks == 5 and st.pending_rows == 0 and st.rows == 50_000
    assert tbl.to_arrow().sort_by("ts").equals(data.sort_by("ts"))
    assert st.stored_bytes < st.raw_bytes


def _sealers() -> int:
    import threading

    return sum(1 for t in threading.enumerate() if t.name == "probing-seal")


def _until_sealers(n: int, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while _sealers() != n:
        assert time.monotonic() < deadline, f"{_sealers()} sealer threads, not {n}"
        time.sleep(0.01)


def test_stores_share_one_sealer_thread_that_ends_once_idle(monkeypatch) -> None:
    """An engine's ranks each have a store: one sealer thread for all of
    them, which ends once no chunk comes (and the next starts it again)."""

    from probing.node.store import store as store_mod

    monkeypatch.setattr(store_mod, "SEALER_IDLE_S", 0.1)
    stores = [Store(chunk_rows=1_000) for _ in range(4)]
    tables = [s.table("t", f"shared{i}") for i, s in enumerate(stores)]
    for tbl in tables:
        tbl.append_batch(events(2_500), defer_seal=True)  # two chunks each to the sealer
    assert store_mod.SEALER.running
    _until_sealers(1)  # one for the four (a thread of an earlier test's may be ending)
    for tbl in tables:
        tbl.flush()
        assert tbl.stats().chunks >= 1 and tbl.stats().pending_rows == 0
        assert tbl.stats().rows == 2_500
    _until_sealers(0)
    assert not store_mod.SEALER.running
    chunks = tables[0].stats().chunks
    tables[0].append_batch(events(1_000), defer_seal=True)
    assert store_mod.SEALER.running
    tables[0].flush()
    assert tables[0].stats().chunks == chunks + 1
    for s in stores:
        s.close()


def test_a_closed_store_is_let_go_by_the_sealer() -> None:
    """An engine retires the store of every process it served: nothing
    keeps it alive after, a chunk it handed over too."""
    import gc
    import weakref

    store = Store(chunk_rows=1_000)
    tbl = store.table("t", "c")
    tbl.append_batch(events(2_500), defer_seal=True)  # two chunks to the sealer
    tbl.flush()
    store.close()
    assert not store.seal_later(tbl, 99, [])  # closed: nothing more queued
    gone = weakref.ref(store)
    del store, tbl
    gc.collect()
    assert gone() is None


def test_a_settled_store_keeps_its_rows_sealed() -> None:
    """A process that exited writes no more: what it left is sealed and
    stays queryable until the engine retires it."""
    store = Store(chunk_rows=1_000)
    tbl = store.table("t", "s")
    data = events(2_500)
    tbl.append_batch(data, defer_seal=True)
    store.settle()
    assert tbl.stats().pending_rows == 0 and tbl.stats().rows == 2_500
    assert tbl.to_arrow().sort_by("ts").equals(data.sort_by("ts"))
    store.close()


def test_a_writer_that_outruns_the_sealer_seals_itself(monkeypatch) -> None:
    """Past SEAL_QUEUE chunks waiting, append_batch seals in the writer: the
    rows held in memory stay bounded."""
    from probing.node.store import store as store_mod

    monkeypatch.setattr(store_mod, "SEAL_QUEUE", 0)
    store = Store(chunk_rows=1_000)
    tbl = store.table("t", "q")
    tbl.append_batch(events(1_500), defer_seal=True)
    assert tbl.stats().chunks == 1  # sealed before append_batch returned


def test_chunk_files_live_in_one_directory_per_process(tmp_path, monkeypatch) -> None:
    import os
    import subprocess
    import sys

    monkeypatch.setenv("PROBING_CHUNK_DIR", str(tmp_path))
    code = (
        "import os, sys, numpy as np\n"
        "from probing.node.store import Store\n"
        "s = Store(chunk_rows=10)\n"
        "s.table('t', 'x').append_batch({'a': np.arange(100)})\n"
        "print(s.chunk_root(), flush=True)\n"
        "os.kill(os.getpid(), 9) if sys.argv[1] == 'kill' else None\n"
    )
    env = {**os.environ, "PROBING_CHUNK_DIR": str(tmp_path)}
    killed = subprocess.run(
        [sys.executable, "-c", code, "kill"], env=env, capture_output=True, text=True
    )
    left = killed.stdout.strip()
    assert os.path.isdir(left) and any(
        f.endswith(".parquet") for _, _, fs in os.walk(left) for f in fs
    )
    clean = subprocess.run(
        [sys.executable, "-c", code, "exit"], env=env, capture_output=True, text=True
    )
    assert clean.returncode == 0, clean.stderr
    assert not os.path.exists(left)  # the dead process's files were removed
    assert not os.path.exists(clean.stdout.strip())  # and its own at exit


def test_chunk_dir_never_follows_a_symlink(tmp_path, monkeypatch) -> None:
    """``probing-<uid>`` under the chunk base planted as a symlink (by another
    user, in a shared /dev/shm) is refused, never followed."""
    from probing.paths import UnsafePath

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / f"probing-{os.getuid()}").symlink_to(elsewhere)
    monkeypatch.setenv("PROBING_CHUNK_DIR", str(tmp_path))
    with pytest.raises(UnsafePath, match="symbolic link"):
        Store().chunk_root()
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("how", ["killed", "kept"])
def test_a_new_engine_takes_over_what_the_last_one_sealed_for_a_live_process(
    how: str, tmp_path, monkeypatch
) -> None:
    """An engine's store for a process (``owner``), left by an engine that was
    killed or that stopped with ``keep``, is taken over by the next engine's
    store for the same process; a later process given the same pid gets nothing."""
    import subprocess
    import sys

    monkeypatch.setenv("PROBING_CHUNK_DIR", str(tmp_path))
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = (
            "import os, sys, numpy as np\n"
            "from probing.node.store import Store\n"
            f"s = Store(chunk_rows=10, owner={owner.pid})\n"
            "s.table('t', 'x').append_batch({'a': np.arange(105)})\n"
            "print(s.chunk_root(), flush=True)\n"
            "s.keep() if sys.argv[1] == 'kept' else os.kill(os.getpid(), 9)\n"
        )
        env = {**os.environ, "PROBING_CHUNK_DIR": str(tmp_path)}
        old = subprocess.run([sys.executable, "-c", code, how], env=env, capture_output=True,
                             text=True).stdout.strip()  # fmt: skip
        assert os.path.isdir(old), old
        Store(owner=os.getpid()).chunk_root()  # another store cleans up: this one stays
        assert os.path.isdir(old)
        mine = Store(chunk_rows=10, owner=owner.pid)
        n = 105  # sealed at once, in one chunk
        assert mine.adopt() == n
        assert not os.path.exists(old)
        got = Database(mine).sql("SELECT count(*) AS n, sum(a) AS s FROM t.x").to_pylist()
        assert got == [{"n": n, "s": sum(range(n))}]
        mine.table("t", "x").append_batch({"a": np.arange(3)})  # and it goes on
        assert Database(mine).sql("SELECT count(*) AS n FROM t.x").to_pylist() == [{"n": n + 3}]
        mine.close()
    finally:
        owner.kill()
        owner.wait()


def test_a_chunk_queued_behind_another_stores_is_let_go_once_its_store_closed(monkeypatch) -> None:
    """One sealer for every store: a store retired while its chunk waits
    behind another store's has that chunk dropped, its directory not made
    again, and nothing of it kept."""
    import threading

    from probing.node.store.table import EventTable

    busy, release = threading.Event(), threading.Event()
    slow_seal = EventTable._seal

    def seal(self, chunk_id, batches):  # type: ignore[no-untyped-def]
        if self.name == "slow":
            busy.set()
            release.wait(10)
        slow_seal(self, chunk_id, batches)

    monkeypatch.setattr(EventTable, "_seal", seal)
    first, second = Store(chunk_rows=1_000), Store(chunk_rows=1_000)
    first.table("t", "slow").append_batch(events(1_000), defer_seal=True)
    assert busy.wait(10)
    queued = second.table("t", "queued")
    queued.append_batch(events(1_000), defer_seal=True)  # behind the slow one
    second.close()
    release.set()
    queued.flush(timeout_s=10)  # returns once the chunk was let go
    assert not queued._sealing  # its rows not held
    assert queued.stats().chunks == 0 and second._root is None and second._queued == 0
    first.close()


def _sealed_by_age(store: Store, name: str, batches: int, rows: int = 50) -> pa.Table:
    """``batches`` appends to ``name``, each sealed at once (rows pending
    longer than ``seal_after_s`` 0): as many small chunks, merged on the way."""
    tbl = store.table("t", name)
    data = events(batches * rows, seed=3)
    for i in range(batches):
        tbl.append_batch(data.slice(i * rows, rows))
    tbl.flush()
    return data


def test_small_chunks_are_merged_and_every_row_read_once(monkeypatch) -> None:
    """A long trace seals a chunk every few seconds: every MERGE_AT small
    ones become one, so queries list and open a few files, not thousands;
    SQL, ``to_arrow`` and a snapshot taken before a merge read every row
    exactly once, and the merged parts go once MERGED_KEPT_S passed."""
    from probing.node.sql.providers import snapshot_frame
    from probing.node.store import table as table_mod

    store = Store(chunk_rows=10_000, seal_after_s=0.0)
    db = Database(store)
    tbl = store.table("t", "m")
    data = events(50 * 40, seed=3)
    tbl.append_batch(data.slice(0, 50))
    tbl.flush()
    for i in range(1, 15):
        tbl.append_batch(data.slice(i * 50, 50))
    tbl.flush()
    before = tbl.snapshot()  # 15 chunks: the next makes 16, merged
    assert len(before.paths) == 15
    for i in range(15, 40):
        tbl.append_batch(data.slice(i * 50, 50))
    tbl.flush()
    assert tbl.stats().chunks < 40 - table_mod.MERGE_AT + 2
    assert tbl.stats().rows == 2_000
    got = db.sql("SELECT count(*) AS n, count(DISTINCT ts) AS d, sum(dur_ns) AS s FROM t.m")
    assert got.to_pylist() == [{"n": 2_000, "d": 2_000, "s": pc.sum(data["dur_ns"]).as_py()}]
    assert tbl.to_arrow().sort_by("ts").equals(data.sort_by("ts"))
    # the snapshot before the merge still reads its 750 rows from the parts, kept
    old = snapshot_frame(db.ctx, before).count()
    assert old == 750
    monkeypatch.setattr(table_mod, "MERGED_KEPT_S", 0.0)
    kept = tbl._merged.parts[:]
    assert kept and all(os.path.exists(c.path) for _, c in kept)
    tbl.append_batch(data.slice(0, 1).set_column(0, "ts", pa.array([1], pa.int64())))
    tbl.flush()
    assert not tbl._merged.parts and not any(os.path.exists(c.path) for _, c in kept)
    store.close()


def test_a_new_engine_takes_over_a_merged_chunk_not_its_parts_left_beside_it(tmp_path) -> None:
    """An engine killed while a merge's parts are still on disk: the next
    one takes over the merged chunk, and skips the parts (no row twice)."""
    old = Store(chunk_rows=10_000, seal_after_s=0.0)
    data = _sealed_by_age(old, "x", 20)
    tbl = old.table("t", "x")
    assert tbl._merged.parts  # parts kept on disk, out of every snapshot
    new = Store(chunk_rows=10_000)
    took = new.table("t", "x").take_chunks(tbl.chunk_dir, old.codec)
    assert took == 1_000
    got = Database(new).sql("SELECT count(*) AS n, count(DISTINCT ts) AS d FROM t.x").to_pylist()
    assert got == [{"n": 1_000, "d": 1_000}]
    assert new.table("t", "x").to_arrow().sort_by("ts").equals(data.sort_by("ts"))
    new.close()
    old.close()


def test_a_table_taken_over_never_carries_a_merged_chunks_list_of_parts() -> None:
    """The schema a table takes from a merged chunk it took over has no list
    of parts: chunks it seals later, in an engine whose ids start again,
    would name other chunks as parts of theirs."""
    from probing.node.store import chunks

    old = Store(chunk_rows=10_000, seal_after_s=0.0)
    _sealed_by_age(old, "y", 20)
    new = Store(chunk_rows=10_000)
    tbl = new.table("t", "y")
    tbl.take_chunks(old.table("t", "y").chunk_dir, old.codec)
    assert tbl.schema is not None and not chunks.merged_ids(tbl.schema)
    new.close()
    old.close()
