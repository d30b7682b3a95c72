"""Store figures, every codec side by side in one run; prints one JSON object.

- append_rows_per_s: rows/s appended in batches of 65,536 (sealing included)
- external_rows_per_s: rows/s through ExternalTable.append (one Python row each)
- compression_ratio: raw Arrow bytes / stored bytes, on realistic event rows
- group_by_ms: median of 3 runs of a GROUP BY over every row, through SQL
- group_by_ms_busy_host: the same while a host thread spins in Python (the
  GIL is busy, as in a Python-heavy training loop); and the longest the host
  thread waited for the GIL meanwhile (host_max_stall_ms)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np
import pyarrow as pa

from probing.node.sql import Database
from probing.node.store import CODECS, DEFAULT_CODEC, Store
from probing.node.tables import ExternalTable, install

ROWS = int(os.environ.get("BENCH_ROWS", 10_000_000))
BATCH = 1 << 16
EXTERNAL_ROWS = 200_000


def event_batches(rows: int) -> list[pa.RecordBatch]:
    """Trace-like rows: monotonic ns ts, ~50 kernel names (zipf), small ints."""
    rng = np.random.default_rng(42)
    names = np.array([f"ncclDevKernel_AllReduce_Sum_f32_RING_LL_{i}" for i in range(50)])
    ts0 = 1_700_000_000_000_000_000
    out = []
    for start in range(0, rows, BATCH):
        n = min(BATCH, rows - start)
        ts = ts0 + start * 900 + np.cumsum(rng.integers(200, 1600, n))
        out.append(
            pa.record_batch(
                {
                    "ts": ts.astype(np.int64),
                    "name": pa.array(names[rng.zipf(1.4, n) % 50]),
                    "dur_ns": rng.integers(2_000, 40_000, n).astype(np.int64),
                    "pid": np.full(n, 4242, dtype=np.int32),
                    "tid": (4242 + rng.integers(0, 4, n)).astype(np.int32),
                    "bytes": (1 << rng.integers(10, 26, n)).astype(np.int64),
                    "seq": np.arange(start, start + n, dtype=np.int64),
                }
            )
        )
    ts0 += 1
    return out


def bench_codec(codec: str, batches: list[pa.RecordBatch]) -> dict:
    store = Store(codec=codec, max_bytes=4 << 30)
    database = Database(store)
    install(database)
    tbl = store.table("bench", "events")
    t0 = time.perf_counter()
    for b in batches:
        tbl.append_batch(b)
    tbl.flush()
    append_s = time.perf_counter() - t0
    st = tbl.stats()
    sql = (
        "SELECT name, count(*) AS n, sum(dur_ns) AS d, max(ts) AS last "
        "FROM bench.events GROUP BY name"
    )
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        database.sql(sql)
        times.append(time.perf_counter() - t0)
    busy_ms, stall_ms = busy_host(lambda: database.sql(sql))
    window = f"SELECT count(*) FROM bench.events WHERE ts > {batches[-1].column('ts')[0].as_py()}"
    t0 = time.perf_counter()
    database.sql(window)
    window_ms = (time.perf_counter() - t0) * 1e3
    return {
        "rows": st.rows,
        "append_rows_per_s": round(st.rows / append_s),
        "raw_mb": round(st.raw_bytes / 2**20, 1),
        "stored_mb": round(st.stored_bytes / 2**20, 1),
        "compression_ratio": st.compression_ratio,
        "group_by_ms": round(statistics.median(times) * 1e3, 1),
        "group_by_ms_busy_host": busy_ms,
        "host_max_stall_ms": stall_ms,
        "last_chunk_window_ms": round(window_ms, 1),
    }


def busy_host(query) -> tuple[float, float]:
    """Run ``query`` while another thread spins in Python; return the query's
    time and the longest gap between two iterations of the spinning thread."""
    done = threading.Event()
    worst = [0.0]

    def spin() -> None:
        last = time.perf_counter()
        while not done.is_set():
            sum(range(100))
            now = time.perf_counter()
            worst[0] = max(worst[0], now - last)
            last = now

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    query()
    dt = time.perf_counter() - t0
    done.set()
    t.join()
    return round(dt * 1e3, 1), round(worst[0] * 1e3, 1)


def bench_external() -> dict:
    store = Store()
    t = ExternalTable("steps", ["step", "ts", "loss", "phase"], store=store)
    t0 = time.perf_counter()
    for i in range(EXTERNAL_ROWS):
        t.append((i, time.time_ns(), 1.0 / (i + 1), "fwd" if i % 2 else "bwd"))
    t.flush()
    dt = time.perf_counter() - t0
    return {
        "rows": EXTERNAL_ROWS,
        "rows_per_s": round(EXTERNAL_ROWS / dt),
        "compression_ratio": store.get("python", "steps").stats().compression_ratio,
    }


def main() -> None:
    batches = event_batches(ROWS)
    result = {
        "benchmark": "store",
        "rows": ROWS,
        "batch_rows": BATCH,
        "default_codec": DEFAULT_CODEC,
        "codecs": {name: bench_codec(name, batches) for name in CODECS},
        "external_table_append": bench_external(),
    }
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
