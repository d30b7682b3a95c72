"""DataFusion catalog and schema providers backed by Python callables.

Two kinds of tables, as in the seed design:

* static tables: a fixed name whose rows a callable produces at query time
  (``process.info``), registered with ``ProbeSchema.add_table``;
* dynamic tables: names resolved on demand, either from the store (a table
  appears in its schema the moment something appends to it) or from a
  resolver callable (``python.`expr```).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Union

import pyarrow as pa
from datafusion import DataFrame, Expr, SessionContext, col, lit
from datafusion.catalog import CatalogProvider, SchemaProvider, Table

from probing.errors import ProbingError, ProviderError, log_unexpected
from probing.node.store import Store
from probing.node.store.chunks import CHUNK_COL
from probing.node.store.table import Snapshot, snapshots

if TYPE_CHECKING:
    import pyarrow.dataset as ds

# pyarrow.dataset (with pyarrow.compute and the filesystems: ~50 ms of a
# probe's first query) is imported only on the paths that read files
# through pyarrow; rows in memory reach DataFusion as batches
TableData = Union[pa.Table, "ds.Dataset"]
Producer = Callable[[], TableData]
Resolver = Callable[[str], TableData | None]


_code = threading.local()
_snapshots = threading.local()  # .stack: this thread's queries, innermost last
_failed = threading.local()  # .error: a provider that failed in this thread's query


def produce(schema: str, name: str, producer: Producer) -> TableData:
    """``producer()``, a provider's bug turned into ``ProviderError``: its
    traceback goes to the engine's log and the query
    answers it (500), never as bad SQL (DataFusion wraps what a provider
    raises; ``provider_failure()`` finds it again)."""
    try:
        return producer()
    except (ProbingError, PermissionError):
        raise
    except Exception as err:  # a provider is any code: its bug is logged, answered 500
        failure = ProviderError(f"the table {schema}.{name} failed: {type(err).__name__}: {err}")
        log_unexpected(f"the table {schema}.{name} failed", err)
        _failed.error = failure
        raise failure from err


def provider_failure() -> ProviderError | None:
    """The provider failure of this thread's last query, once."""
    failure = getattr(_failed, "error", None)
    _failed.error = None
    return failure


Prepared = dict[tuple[str, str], Table]


def current_snapshots() -> Prepared:
    """The prepared tables of the query being planned on this thread (the
    innermost one when a table's producer runs a query of its own)."""
    stack = getattr(_snapshots, "stack", None)
    return stack[-1] if stack else {}


def code_allowed() -> bool:
    """Whether a resolver that runs code may run on this thread now.

    Fail closed: only inside ``Database.sql(..., allow_code=True)`` on the
    calling thread. A query from a peer (TCP) never evaluates expressions.
    """
    return getattr(_code, "allowed", False)


def set_code_allowed(allowed: bool) -> bool:
    """Set this thread's flag; returns the previous value."""
    old = code_allowed()
    _code.allowed = allowed
    return old


def empty_frame(ctx: SessionContext, schema: pa.Schema) -> DataFrame:
    """No rows, but one partition: a table of no batches has no partitions,
    and a sort or union above it fails DataFusion's plan check. One batch
    of no rows has neither problem. Made once per session and schema, kept
    on the session (it goes with it): a frame is a plan, never changed, and
    a query of a job without NCCL built two a query, a tenth of its time."""
    kept: dict[pa.Schema, DataFrame] | None = getattr(ctx, "_probing_empty", None)
    if kept is None:
        kept = {}
        ctx._probing_empty = kept  # type: ignore[attr-defined]
    frame = kept.get(schema)
    if frame is None:
        frame = kept[schema] = ctx.read_batches([pa.RecordBatch.from_pylist([], schema=schema)])
    return frame


def rows_frame(ctx: SessionContext, data: pa.Table) -> DataFrame:
    """Rows in memory as a DataFrame (a memory table, never registered by name)."""
    batches = [b for b in data.to_batches() if b.num_rows]
    return ctx.read_batches(batches) if batches else empty_frame(ctx, data.schema)


def as_table(data: TableData, ctx: SessionContext | None = None) -> Table:
    if isinstance(data, pa.Table):
        if ctx is not None:
            return Table(rows_frame(ctx, data))
        import pyarrow.dataset as ds

        data = ds.dataset(data)
    return Table(data)


def _int_lit(value: int) -> Expr:
    """``lit`` of an int64 scalar: 10x cheaper than ``lit(int)`` (0.2 ms a call)."""
    return lit(pa.scalar(value, pa.int64()))


def snapshot_frame(ctx: SessionContext, snap: Snapshot) -> DataFrame:
    """A store table as DataFusion sees it: a native scan of the sealed chunk
    files (projection, and pruning on their min/max statistics, with no
    Python and no GIL in the loop) unioned with the rows not sealed yet.

    Building it blocks on DataFusion's runtime (file listing), so it must
    run outside a query: ``ProbeCatalog.prepare`` does it before planning.
    """
    frames = []
    if snap.chunk_dir is not None:
        parts = [(CHUNK_COL, pa.int64())]
        if snap.container == "parquet":
            df = ctx.read_parquet(snap.chunk_dir, table_partition_cols=parts, schema=snap.schema)
        else:
            df = ctx.read_arrow(snap.chunk_dir, file_partition_cols=parts, schema=snap.schema)
        in_range = (col(CHUNK_COL) >= _int_lit(snap.first_chunk)) & (
            col(CHUNK_COL) <= _int_lit(snap.last_chunk)
        )
        # rows in flight are read from `pending`; a merged chunk's parts, from it
        for chunk_id in (*snap.sealing, *snap.merged):
            in_range = in_range & (col(CHUNK_COL) != _int_lit(chunk_id))
        frames.append(df.filter(in_range).select(*[col(n) for n in snap.schema.names]))
    if snap.pending.num_rows:
        # not ctx.from_arrow: it registers a temporary table in the default
        # schema, which is ours and keeps no such tables
        frames.append(rows_frame(ctx, snap.pending))
    elif not frames:
        frames.append(empty_frame(ctx, snap.schema))
    df = frames[0]
    for other in frames[1:]:
        df = df.union(other)
    return df


def snapshot_dataset(snap: Snapshot) -> ds.Dataset:
    """The same rows as a pyarrow dataset: slower (DataFusion pulls batches
    through Python), but it can be built while a query is being planned."""
    import pyarrow.dataset as ds

    parts: list[ds.Dataset] = []
    if snap.paths:
        parts.append(ds.dataset(list(snap.paths), schema=snap.schema, format=snap.container))
    if snap.pending.num_rows or not parts:
        parts.append(ds.dataset(snap.pending))
    return parts[0] if len(parts) == 1 else ds.dataset(parts)


class ProbeSchema(SchemaProvider):
    """One SQL schema: static producers, store tables, then an optional resolver."""

    def __init__(
        self,
        name: str,
        store: Store | None = None,
        ctx: Callable[[], SessionContext | None] = lambda: None,
    ) -> None:
        self.name = name
        self._store = store
        self._ctx = ctx
        self._producers: dict[str, Producer] = {}
        self._views: set[str] = set()
        self._view_columns: dict[str, pa.Schema] = {}  # each view's, once planned
        self._resolver: Resolver | None = None
        self._lock = threading.Lock()
        self._deferred: list[Callable[[], None]] = []
        self._pending = False  # until every deferred install has run
        self._load_lock = threading.RLock()

    def defer(self, install: Callable[[], None]) -> None:
        """``install()`` registers more of this schema's tables, at the first
        query that names the schema or lists tables (not at database build):
        a layer whose tables few queries read is not imported before."""
        with self._load_lock:
            self._deferred.append(install)
            self._pending = True

    def _load(self) -> None:
        if not self._pending:
            return
        with self._load_lock:  # a second caller waits for the tables, then lists them
            while self._deferred:
                install = self._deferred.pop(0)
                try:
                    install()
                except Exception as err:  # its tables are missing; the rest answer
                    log_unexpected(f"the tables of {self.name} were not installed", err)
            self._pending = False

    def add_table(self, name: str, producer: Producer) -> None:
        with self._lock:
            self._producers[name] = producer

    def add_view(self, name: str) -> None:
        with self._lock:
            self._views.add(name)

    def planned_view(self, name: str, columns: pa.Schema) -> None:
        """The columns the view ``name`` was planned with (for
        information_schema, which may ask on DataFusion's own threads)."""
        with self._lock:
            self._view_columns[name] = columns

    def produced(self, name: str) -> pa.Table | None:
        """The rows a scan of ``name`` reads, where a function makes them
        (no SQL: the detector's asks of its engine's own ranks); None where
        ``name`` is a store's table, a view or unknown."""
        self._load()
        with self._lock:
            producer = self._producers.get(name)
        if producer is None:
            return None
        data = produce(self.name, name, producer)
        return data if isinstance(data, pa.Table) else data.to_table()

    def set_resolver(self, resolver: Resolver) -> None:
        self._resolver = resolver

    # -- SchemaProvider -------------------------------------------------------
    def owner_name(self) -> str | None:
        return "probing"

    # datafusion-python reads ``table_names`` as an attribute holding a
    # sequence (not a method) when it lists tables for information_schema.
    @property
    def table_names(self) -> list[str]:  # type: ignore[override]
        self._load()
        with self._lock:
            names = set(self._producers) | self._views
        if self._store is not None:
            names.update(t.name for t in self._store.tables(self.name))
        return sorted(names)

    def table(self, name: str) -> Table | None:
        self._load()
        with self._lock:
            producer = self._producers.get(name)
        if producer is not None:
            return as_table(produce(self.name, name, producer), self._ctx())
        if name in self._views:
            prepared = current_snapshots().get((self.name, name))
            if prepared is None:
                # information_schema (SHOW COLUMNS) reads tables on DataFusion's
                # threads, where the query's snapshots are not: the view's
                # columns, which are all it reads (scans are bound at planning)
                with self._lock:
                    columns = self._view_columns.get(name)
                ctx = self._ctx()
                if columns is not None and ctx is not None:
                    return Table(empty_frame(ctx, columns))
            return prepared
        if self._store is not None and (tbl := self._store.get(self.name, name)) is not None:
            prepared = current_snapshots().get((self.name, name))
            return prepared if prepared is not None else Table(snapshot_dataset(tbl.snapshot()))
        if self._resolver is not None and not code_allowed():
            raise PermissionError(
                f"{self.name}.`{name}` runs code in the target: local unix socket only"
            )
        if self._resolver is not None and (data := self._resolver(name)) is not None:
            return as_table(data, self._ctx())
        return None

    def table_exist(self, name: str) -> bool:
        return name in self.table_names

    def kind(self, name: str) -> str | None:
        """How the table ``name`` answers, as ``table()`` finds it: ``live``
        (made when queried), ``view`` (SQL over other tables), ``stored``
        (rows kept in the store); None where it has no such table."""
        self._load()
        with self._lock:
            if name in self._producers:
                return "live"
            if name in self._views:
                return "view"
        if self._store is not None and self._store.get(self.name, name) is not None:
            return "stored"
        return None


class ProbeCatalog(CatalogProvider):
    """The ``probing`` catalog: schemas registered by name, plus every store schema."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._schemas: dict[str, ProbeSchema] = {}
        self._views: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self.ctx: SessionContext | None = None  # set by the Database that owns it

    def close(self) -> None:
        """Let go of every schema, view and the session: the session holds
        this catalog in Rust, where Python's collector cannot see the cycle
        (catalog -> tables -> the probe -> its database -> the session), so a
        retired probe would never be freed."""
        with self._lock:
            self._schemas.clear()
            self._views.clear()
        self.ctx = None

    def add_view(self, schema: str, name: str, sql: str) -> None:
        self.schema_for(schema).add_view(name)
        with self._lock:
            self._views[(schema, name)] = sql

    @contextlib.contextmanager
    def snapshot(self, ctx: SessionContext, sql: str) -> Iterator[Prepared]:
        """Snapshot the store tables ``sql`` may read, as native scans, for
        this query alone while it is planned on this thread.

        Taken before planning (outside DataFusion's runtime). Every query
        has its own: a concurrent query on another thread, or one that a
        table's producer runs inside this one, never sees or drops it.
        Tables whose name does not appear in the text are still answered,
        through the slower pyarrow path. Each snapshot is consistent on its own.
        """
        text = sql.lower()
        everything = "information_schema" in text or "show" in text
        with self._lock:
            views = dict(self._views)
        # a view named in the query brings the tables its own SQL names
        named_views = []
        for (schema, name), view_sql in views.items():
            if everything or name.lower() in text:
                named_views.append(((schema, name), view_sql))
                text += "\n" + view_sql.lower()
        named = [t for t in self._store.tables() if everything or t.name.lower() in text]
        mine: Prepared = {
            (tbl.schema_name, tbl.name): Table(snapshot_frame(ctx, snap))
            for tbl, snap in zip(named, snapshots(named), strict=True)
        }
        stack = getattr(_snapshots, "stack", None)
        if stack is None:
            stack = _snapshots.stack = []
        stack.append(mine)
        try:
            for key, view_sql in named_views:  # planned over the snapshots just taken
                df = ctx.sql(view_sql)
                self.schema_for(key[0]).planned_view(key[1], df.schema())
                mine[key] = Table(df)
            yield mine
        finally:
            stack.pop()

    def schema_for(self, name: str) -> ProbeSchema:
        """The schema ``name``, created (backed by the store) on first use."""
        with self._lock:
            sch = self._schemas.get(name)
            if sch is None:
                sch = self._schemas[name] = ProbeSchema(name, self._store, lambda: self.ctx)
            return sch

    def schema_names(self) -> set[str]:
        with self._lock:
            names = set(self._schemas)
        names.update(t.schema_name for t in self._store.tables())
        return names

    def schema(self, name: str) -> ProbeSchema | None:  # type: ignore[override]
        # datafusion-python accepts the provider itself here and wraps it.
        if name not in self.schema_names():
            return None
        return self.schema_for(name)
