"""``probing.tables``: what the store holds, table by table."""

from __future__ import annotations

import dataclasses

import pyarrow as pa

from probing.node.store import Store, TableStats

SCHEMA = pa.schema(
    [
        ("schema", pa.string()),
        ("table", pa.string()),
        ("rows", pa.int64()),
        ("raw_bytes", pa.int64()),
        ("stored_bytes", pa.int64()),
        ("compression_ratio", pa.float64()),
        ("chunks", pa.int64()),
        ("pending_rows", pa.int64()),
        ("retired_rows", pa.int64()),
        ("retired_bytes", pa.int64()),
        ("dropped_events", pa.int64()),
        ("read_errors", pa.int64()),
    ]
)
# probing.peers (filled by the cluster node: probing.node.cluster.discovery)
PEERS_SCHEMA = pa.schema(
    [
        ("rank", pa.int64()),
        ("node", pa.string()),
        ("addr", pa.string()),
        ("pid", pa.int64()),
        ("source", pa.string()),
        ("last_seen_ns", pa.int64()),
        ("status", pa.string()),
        ("reason", pa.string()),
        ("response_ms", pa.float64()),
        ("clock_offset_ns", pa.int64()),
    ]
)
assert SCHEMA.names == [f.name for f in dataclasses.fields(TableStats)]


def tables(store: Store) -> pa.Table:
    rows = [dataclasses.asdict(s) for s in store.stats()]
    return pa.Table.from_pylist(rows, schema=SCHEMA)
