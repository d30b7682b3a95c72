"""Chunk codecs: how a sealed chunk of rows becomes a compressed buffer.

The default, ``parquet-zstd``, dictionary-encodes strings, writes integers
with DELTA_BINARY_PACKED (monotonic timestamps shrink to a few bits a row),
floats with BYTE_STREAM_SPLIT, and compresses pages with zstd. The others
exist so ``benchmarks/store_bench.py`` can compare them in one run; the
default was picked from that comparison (see README, "Store").
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

_DELTA_TYPES = (pa.int32(), pa.int64(), pa.uint32(), pa.uint64())


def _is_string(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_dictionary(t)
    )


@dataclasses.dataclass(frozen=True)
class Codec:
    """One way to turn an Arrow table into a compressed, scannable buffer."""

    name: str
    container: str  # "parquet" or "ipc": the pyarrow.dataset format to read it back
    compression: str  # "zstd", "lz4" or "none"

    @property
    def extension(self) -> str:
        return ".parquet" if self.container == "parquet" else ".arrow"

    def decode(
        self, path: str, schema: pa.Schema | None = None, columns: list[str] | None = None
    ) -> pa.Table:
        """Read a chunk file back (DataFusion reads them natively; this is for
        Python), or only ``columns`` of it (for parquet, without loading
        ``pyarrow.dataset``: an engine starting takes over chunk files
        before its first query)."""
        if columns is None:
            if self.container == "parquet":
                return pq.read_table(path, schema=schema)
            with pa.memory_map(path) as source:
                return ipc.open_file(source).read_all()
        if self.container == "parquet":
            with pq.ParquetFile(path) as f:
                got = f.read(columns=columns)
        else:
            with pa.memory_map(path) as source:
                got = ipc.open_file(source).read_all().select(columns)
        if schema is None:
            return got
        want = pa.schema(schema.field(c) for c in columns)  # as read_table would give them
        return got if got.schema.equals(want) else got.cast(want)

    def describe(self, path: str) -> tuple[pa.Schema, int, int]:
        """A chunk file's schema, rows and bytes in memory, from its footer."""
        if self.container == "parquet":
            meta = pq.read_metadata(path)
            raw = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
            return pq.read_schema(path), meta.num_rows, raw
        table = self.decode(path)
        return table.schema, table.num_rows, table.nbytes

    def encode(self, table: pa.Table) -> pa.Buffer:
        sink = pa.BufferOutputStream()
        if self.container == "parquet":
            self._write_parquet(table, sink)
        else:
            options = ipc.IpcWriteOptions(
                compression=None if self.compression == "none" else self.compression
            )
            with ipc.new_file(sink, table.schema, options=options) as writer:
                writer.write_table(table)
        return sink.getvalue()

    def _write_parquet(self, table: pa.Table, sink: pa.BufferOutputStream) -> None:
        dict_cols, encodings = [], {}
        for field in table.schema:
            if _is_string(field.type):
                dict_cols.append(field.name)
            elif field.type in _DELTA_TYPES:
                encodings[field.name] = "DELTA_BINARY_PACKED"
            elif pa.types.is_floating(field.type):
                encodings[field.name] = "BYTE_STREAM_SPLIT"
        pq.write_table(
            table,
            sink,
            compression="lz4" if self.compression == "lz4" else self.compression,
            use_dictionary=dict_cols,
            column_encoding=encodings or None,
            row_group_size=max(table.num_rows, 1),
            write_statistics=True,
            store_schema=True,
        )


CODECS: dict[str, Codec] = {
    c.name: c
    for c in (
        Codec("parquet-zstd", "parquet", "zstd"),
        Codec("parquet-lz4", "parquet", "lz4"),
        Codec("ipc-zstd", "ipc", "zstd"),
        Codec("ipc-lz4", "ipc", "lz4"),
        Codec("ipc-none", "ipc", "none"),
    )
}
DEFAULT_CODEC = "parquet-zstd"


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r} (known: {', '.join(CODECS)})") from None
