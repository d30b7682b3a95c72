"""A trace's copy on disk (``probing trace --output F.parquet``).

The drain hands ``OutputWriter`` every batch it appends to the store; the
writer keeps them until a row group's worth (``ROWS_PER_GROUP``) is in,
then writes it to one Parquet file (zstd). The tracer closes it when the
trace stops, and the file is complete only then.
"""

from __future__ import annotations

import os
import threading

import pyarrow as pa

from probing.node.bpf import families as fam


class OutputWriter:
    """Everything traced, into one Parquet file: a ``table`` column names the
    source table; the other columns are the union of the tables' columns."""

    ROWS_PER_GROUP = 1 << 16

    def __init__(self, path: str) -> None:
        import pyarrow.parquet as pq

        fields: dict[str, pa.Field] = {"table": pa.field("table", pa.string())}
        for f in fam.FAMILIES.values():
            for field in f.schema:
                have = fields.setdefault(field.name, field)
                assert have.type == field.type, f"{field.name}: {have.type} vs {field.type}"
        self.schema = pa.schema(list(fields.values()))
        self.path = os.path.abspath(path)
        self._pending: list[pa.Table] = []
        self._rows = 0
        self._lock = threading.Lock()
        self._writer = pq.ParquetWriter(self.path, self.schema, compression="zstd")

    def write(self, table: str, batch: pa.RecordBatch) -> None:
        n = batch.num_rows
        cols = []
        for field in self.schema:
            if field.name == "table":
                cols.append(pa.array([table] * n, pa.string()))
            elif field.name in batch.schema.names:
                cols.append(batch.column(field.name))
            else:
                cols.append(pa.nulls(n, field.type))
        with self._lock:
            self._pending.append(pa.Table.from_arrays(cols, schema=self.schema))
            self._rows += n
            if self._rows >= self.ROWS_PER_GROUP:
                self._flush_locked()

    def _flush_locked(self) -> None:
        if self._pending and self._writer is not None:
            self._writer.write_table(pa.concat_tables(self._pending))
        self._pending, self._rows = [], 0

    def close(self) -> None:
        with self._lock:
            self._flush_locked()
            if self._writer is not None:
                self._writer.close()
                self._writer = None
