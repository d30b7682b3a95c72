"""A table's sealed chunks on disk: one file each, in a directory of its own.

Each chunk lies at ``<table's chunk dir>/__probing_chunk=<id>/<id><ext>``
(hive-style: DataFusion reads the id as the partition column ``CHUNK_COL``,
so a query can keep to the chunks of its snapshot). The files are written,
removed and taken over from another store here; which chunks a table holds,
and its lock, stay with the table (``table.EventTable``).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time

import pyarrow as pa

from probing.node.store.codec import Codec

CHUNK_COL = "__probing_chunk"  # hive-style partition column: one directory per chunk
# a merged chunk's schema metadata: the ids of the chunks it holds the rows of
# (files that may outlive it a while: an engine taking the directory over skips them)
MERGED_KEY = b"probing.merged"

_chunk_ids = itertools.count()


def next_id() -> int:
    """A chunk id unique in this process (ids grow: a newer chunk, a larger id)."""
    return next(_chunk_ids)


@dataclasses.dataclass
class Chunk:
    id: int
    path: str
    rows: int
    raw_bytes: int
    stored_bytes: int
    sealed_at: float  # time.monotonic()


@dataclasses.dataclass
class Merged:
    """The parts of a table's merges, each kept on disk a while after (for
    the queries whose snapshot was taken before) and out of every snapshot
    taken since. The table's lock guards it."""

    parts: list[tuple[float, Chunk]] = dataclasses.field(default_factory=list)  # (when, part)

    @staticmethod
    def due(held: list[Chunk], chunk_rows: int, at: int) -> list[Chunk]:
        """The oldest ``at`` chunks of ``held`` of fewer than ``chunk_rows``
        rows, where there are that many (else none): to merge."""
        small = [c for c in held if c.rows < chunk_rows][:at]
        return small if len(small) == at else []

    def commit(
        self, held: list[Chunk], parts: list[Chunk], merged: Chunk, now: float
    ) -> list[Chunk] | None:
        """``held`` with ``parts`` replaced by ``merged`` (where the first was),
        the parts kept from now; None where one of them is gone (retired)."""
        if not all(c in held for c in parts):
            return None
        at = held.index(parts[0])
        rest = [c for c in held if c not in parts]
        self.parts += [(now, c) for c in parts]
        return [*rest[:at], merged, *rest[at:]]

    def expire(self, now: float, kept_s: float) -> list[Chunk]:
        """The parts merged ``kept_s`` ago or more, no longer kept (to remove)."""
        gone = [c for at, c in self.parts if now - at >= kept_s]
        self.parts = [(at, c) for at, c in self.parts if now - at < kept_s]
        return gone

    def ids(self, first: int, last: int) -> tuple[int, ...]:
        """The ids of the parts kept, from ``first`` to ``last``."""
        return tuple(c.id for _, c in self.parts if first <= c.id <= last)


def path_of(chunk_dir: str, chunk_id: int, codec: Codec) -> str:
    """Where chunk ``chunk_id`` of the table whose chunks are in ``chunk_dir`` lies."""
    return os.path.join(chunk_dir, f"{CHUNK_COL}={chunk_id}", f"{chunk_id}{codec.extension}")


def write(chunk_dir: str, chunk_id: int, table: pa.Table, codec: Codec) -> Chunk:
    """``table`` encoded with ``codec`` into chunk ``chunk_id``'s file, which
    appears whole (written aside, then renamed); raises what the disk or the
    encoder raises."""
    path = path_of(chunk_dir, chunk_id, codec)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    buf = codec.encode(table)
    tmp = path + ".tmp"  # queries list *.parquet / *.arrow only
    with open(tmp, "wb") as f:
        f.write(buf)
    os.rename(tmp, path)
    return Chunk(chunk_id, path, table.num_rows, table.nbytes, buf.size, time.monotonic())


def remove(chunk: Chunk) -> None:
    """``chunk``'s file and directory gone (a query that already opened it
    still reads it); one gone already is no error."""
    try:
        os.unlink(chunk.path)
        os.rmdir(os.path.dirname(chunk.path))
    except OSError:
        pass


def id_of(path: str) -> int:
    """The id of the chunk file at ``path``."""
    return int(os.path.basename(os.path.dirname(path)).partition("=")[2])


def merged_ids(schema: pa.Schema) -> set[int]:
    """The chunks a merged chunk of ``schema`` holds the rows of (none: not merged)."""
    value = (schema.metadata or {}).get(MERGED_KEY, b"")
    return {int(x) for x in value.split(b",") if x}


def found(directory: str, codec: Codec) -> list[str]:
    """The chunk files under ``directory`` (another store's directory of a
    table), oldest first."""
    ids = []
    for part in os.listdir(directory):
        col, _, number = part.partition("=")
        if col == CHUNK_COL and number.isdigit():
            ids.append(int(number))
    return [path_of(directory, old, codec) for old in sorted(ids)]


def described(directory: str, codec: Codec) -> list[tuple[str, pa.Schema, int, int]]:
    """The chunk files under ``directory`` (another store's directory of a
    table), oldest first, each with its schema, rows and bytes decoded; one
    that cannot be read, and the parts of a merged chunk left beside it
    (their rows are in it), left out."""
    out = []
    for path in found(directory, codec):
        try:
            out.append((path, *codec.describe(path)))
        except (OSError, pa.ArrowException):
            continue
    merged = {i for _, schema, _, _ in out for i in merged_ids(schema)}
    return [(p, unmerged(schema), n, raw) for p, schema, n, raw in out if id_of(p) not in merged]


def unmerged(schema: pa.Schema) -> pa.Schema:
    """``schema`` without a merged chunk's list of parts (a table's schema
    never carries it: its ids would name other chunks later)."""
    meta = {k: v for k, v in (schema.metadata or {}).items() if k != MERGED_KEY}
    return schema.with_metadata(meta) if meta else schema.remove_metadata()


def merge(parts: list[Chunk], schema: pa.Schema, chunk_dir: str, codec: Codec) -> Chunk | None:
    """One new chunk of every row of ``parts`` (``schema``'s), which names
    them (``MERGED_KEY``) and counts as sealed when the newest was; None
    where a part cannot be read (retired meanwhile) or the disk refuses."""
    try:
        table = pa.concat_tables([codec.decode(c.path, schema) for c in parts])
        ids = ",".join(str(c.id) for c in parts).encode()
        table = table.replace_schema_metadata({**(schema.metadata or {}), MERGED_KEY: ids})
        merged = write(chunk_dir, next_id(), table, codec)
    except (OSError, pa.ArrowException):
        return None
    merged.sealed_at = max(c.sealed_at for c in parts)
    return merged


def move(path: str, chunk_dir: str, codec: Codec, rows: int, raw_bytes: int) -> Chunk | None:
    """The chunk file at ``path`` (of ``rows`` rows, ``raw_bytes`` decoded)
    moved into ``chunk_dir`` under a new id; None where it cannot be."""
    chunk_id = next_id()
    new = path_of(chunk_dir, chunk_id, codec)
    try:
        os.makedirs(os.path.dirname(new), exist_ok=True)
        os.rename(path, new)
        size = os.stat(new).st_size
    except OSError:
        return None
    return Chunk(chunk_id, new, rows, raw_bytes, size, time.monotonic())
