"""``probing export --format parquet``: the window as one Parquet file per table.

``-o DIR`` receives ``nccl.calls.parquet``, ``gloo.calls.parquet``,
``cuda.calls.parquet``, ``nvml.gpu.parquet`` (the window, ts on the asker's
clock) and ``python.stacks.parquet``, ``comm.groups.parquet``,
``process.info.parquet`` (as they are now). Every row carries ``node`` and
``rank``; each file's metadata (``probing.cli.export``) says the window, the
clock offsets applied and what ``--max-events`` dropped. Files are written
chunk by chunk (``pyarrow.parquet.ParquetWriter``).
"""

from __future__ import annotations

import json
import os
import time

import pyarrow.parquet as pq

from probing.cli.export.timeline import ExportReport
from probing.cli.export.window import EVENT_TABLES, ExportWindow
from probing.errors import ProbingError

SNAPSHOT_TABLES = ("python.stacks", "comm.groups", "process.info")
META_KEY = b"probing.export"


def export_parquet(win: ExportWindow, out_dir: str) -> ExportReport:
    t0 = time.perf_counter()
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ProbingError(
            f"{out_dir} is a file: parquet export writes one file per table into a directory",
            hint="give -o a directory name",
        )
    os.makedirs(out_dir, exist_ok=True)
    src = win.source
    ranks = src.ranks()
    win.count()
    writers: dict[str, pq.ParquetWriter] = {}
    rows: dict[str, int] = {}
    paths = {t: os.path.join(out_dir, f"{t}.parquet") for t in EVENT_TABLES + SNAPSHOT_TABLES}
    try:
        for table, part, _ in win.read(EVENT_TABLES):
            if table not in writers:
                writers[table] = pq.ParquetWriter(paths[table], part.schema)
            writers[table].write_table(part.cast(writers[table].schema))
            rows[table] = rows.get(table, 0) + part.num_rows
        meta = {
            "since_ns": win.since_ns,
            "until_ns": win.now_ns,
            "clock_offsets_ns": src.offsets,
            "max_events": win.cap.limit,
            "dropped": win.cap.dropped,
            "note": win.cap.message(),
        }
        md = {META_KEY: json.dumps(meta).encode()}
        for table in EVENT_TABLES:  # every file says what the export was (in its footer)
            if table not in writers:
                empty = win.whole(f"SELECT * FROM {table} LIMIT 0")
                writers[table] = pq.ParquetWriter(paths[table], empty.schema)
                writers[table].write_table(empty)
            writers[table].add_key_value_metadata(md)
    finally:
        for w in writers.values():
            w.close()
    for table in SNAPSHOT_TABLES:
        try:
            data = win.whole(f"SELECT * FROM {table}")
        except ProbingError:
            continue
        rows[table] = data.num_rows
        pq.write_table(
            data.replace_schema_metadata({**(data.schema.metadata or {}), **md}), paths[table]
        )
    size = sum(os.path.getsize(p) for p in paths.values() if os.path.exists(p))
    return ExportReport(
        path=out_dir,
        format="parquet",
        ranks=len(ranks),
        events=sum(rows.get(t, 0) for t in EVENT_TABLES),
        seconds=round(time.perf_counter() - t0, 3),
        bytes=size,
        cap=win.cap,
        tables=rows,
        missing=list(src.missing),
    )
