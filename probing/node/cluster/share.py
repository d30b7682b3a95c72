"""This peer's share of a cluster query: its own tables, tagged, through its database.

A peer answers the ``Work`` of a query (``probing.node.cluster.plan``) from its
own database: in ``agg`` mode the whole query over its tagged tables, else
one scan per table (the columns and filters the asker pushed down). The
SQL text comes from ``plan`` (``tagged_sql``, ``scan_sql``,
``over_tagged``); kept here are the columns of each table and the
rewritten aggregate queries, both dropped when a query fails (a table's
columns changed). A table this peer lacks adds no rows.

``Owner`` is what the share needs of the cluster node: its database, node
name and rank (the rank may be learned after the share was made).

``Together``: the shares of the ranks one engine serves, as one query over
all their rows (an engine answers for its node in one reply): over stored
tables only, whose rows it can read without asking any process.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from probing.errors import QueryError
from probing.node.cluster.identity import Identity

if TYPE_CHECKING:  # loaded on the first cluster query, not when the probe starts
    import pyarrow as pa

    from probing.node.cluster import plan as planner
    from probing.node.sql import Database
    from probing.node.store.table import EventTable, Snapshot

# A process runs at most this many peers' shares at once (one probe per
# process in a job; several in the benchmark): more at once only adds
# thread and allocator contention to the same CPU work.
_RUNNING = threading.BoundedSemaphore(max(1, os.cpu_count() or 1))
KEEP_REWRITTEN = 64  # aggregate queries whose rewriting is kept
# A rank's sealed range of files this small is read once and kept in memory
# by the queries together (``_Session``), up to SMALL_KEPT bytes of rows.
SMALL_BYTES = 256 << 10
SMALL_KEPT = 32 << 20
PRUNE_S = 10.0


class Owner(Protocol):
    """What a share needs of the cluster node (``probing.node.cluster.node.ClusterNode``)."""

    ident: Identity
    rank: int
    database: Callable[[], Database]


class Share:
    """Runs this peer's share of cluster queries (``run``), caching what it can."""

    def __init__(self, owner: Owner) -> None:
        self.owner = owner
        self._columns: dict[str, list[str]] = {}
        self._rewritten: dict[str, str] = {}  # agg SQL -> what I run over my tagged tables

    def run(self, work: planner.Work) -> dict[str, pa.Table]:
        """This peer's rows for ``work``: per-table scans, or the whole query."""
        with _RUNNING:
            try:
                return self._run(work)
            except QueryError:
                if not self._columns:
                    raise
                self._columns.clear()  # a table's columns changed since I cached them
                self._rewritten.clear()
                return self._run(work)

    def _run(self, work: planner.Work) -> dict[str, pa.Table]:
        from probing.node.cluster import plan as planner

        eng = self.owner.database()
        out: dict[str, pa.Table] = {}
        if work.mode is planner.Mode.AGG:
            sql = self._agg_sql(work.sql, eng)
            if sql is not None:  # else this peer has no such table: it adds no rows
                out[planner.PARTIAL] = eng.sql(sql, allow_code=False)
            return out
        for table in scan_order(work.scans, eng):
            if _exists(table, eng):
                sql = planner.scan_sql(table, self._tagged(table, eng), work.scans[table])
                out[table] = eng.sql(sql, allow_code=False)
        return out

    def _agg_sql(self, sql: str, eng: Any) -> str | None:
        """``sql`` over my tagged tables (None when I lack one). Kept per query
        text, like the columns it was built from (both dropped when a query fails)."""
        cached = self._rewritten.get(sql)
        if cached is not None:
            return cached
        from probing.node.cluster import plan as planner

        refs = planner.table_refs(sql, set(eng.catalog.schema_names()))
        if not refs or not all(_exists(ref.name, eng) for ref in refs):
            return None  # not even the table's schema is here
        text = planner.over_tagged(sql, refs, {r.name: self._tagged(r.name, eng) for r in refs})
        if len(self._rewritten) < KEEP_REWRITTEN:
            self._rewritten[sql] = text
        return text

    def _tagged(self, table: str, eng: Any) -> str:
        """``table`` as this peer serves it: plus node and rank."""
        from probing.node.cluster import plan as planner

        cols = self._columns.get(table)
        if cols is None:
            cols = eng.sql(f"SELECT * FROM {table} LIMIT 0", allow_code=False).schema.names
            self._columns[table] = cols
        return planner.tagged_sql(table, cols, self.owner.ident.node, self.owner.rank)


def scan_order(tables: Iterable[str], eng: Any) -> list[str]:
    """The order a peer scans ``tables`` in, one query each: the stored
    tables that no other rows refer to first, then the views and the
    tables referred to. Reading one may add rows to another (the sampler's
    read before python.samples adds its samples' stacks to python.stacks,
    which python.callsites reads); scanned before it, those rows would be
    missing from the answer (the planner names its tables alphabetically)."""

    def later(table: str) -> bool:
        tbl = eng.store.get(*table.split(".", 1))
        return tbl is None or tbl.referenced

    return sorted(tables, key=later)


def _exists(table: str, eng: Any) -> bool:
    sch, name = table.split(".", 1)
    schema = eng.catalog.schema(sch)
    return schema is not None and name in schema.table_names


class Together:
    """The shares of ranks one engine serves, run as one query over the
    union of their rows: what each ``Share.run`` would compute for its own
    rank, together (one DataFusion query a node, not one a rank).

    ``prepare`` says whether it can: every table the work reads is stored
    (rows a trace keeps; a live table or a view is made per process) with
    the same columns on every rank that has it, and in ``agg`` mode the
    query reads one table (a join must never meet another rank's rows).
    A rank that lacks a table adds no rows, as on its own.
    """

    def __init__(
        self,
        owners: list[Owner],
        work: planner.Work,
        snaps: dict[str, list[Any]],
        refs: list[planner.TableRef],
    ) -> None:
        self.owners = owners
        self.work = work
        self.snaps = snaps  # table -> [(owner, Snapshot)] of the ranks that have it
        self.refs = refs  # agg: where the query names its one table

    @classmethod
    def prepare(cls, owners: list[Owner], work: planner.Work) -> Together | None:
        from probing.node.cluster import plan as planner
        from probing.node.store.table import snapshots

        if len(owners) < 2:
            return None
        databases = [o.database() for o in owners]
        refs: list[planner.TableRef] = []
        if work.mode is planner.Mode.AGG:
            refs = planner.table_refs(work.sql, set(databases[0].catalog.schema_names()))
            if len(refs) != 1:
                return None
            names = [refs[0].name]
        else:
            names = list(work.scans)
        found: dict[str, list[tuple[Owner, EventTable]]] = {}
        for table in names:
            got = _stored(table, owners, databases)
            if got is None:
                return None
            found[table] = got
        taken = iter(snapshots([tbl for on in found.values() for _, tbl in on]))
        snaps: dict[str, list[tuple[Owner, Snapshot]]] = {
            table: [(o, next(taken)) for o, _ in on] for table, on in found.items()
        }
        for ranks in snaps.values():  # a rank's table with other columns: not one union
            if any(not snap.schema.equals(ranks[0][1].schema) for _, snap in ranks):
                return None
        return cls(owners, work, snaps, refs)

    def run(self) -> dict[str, pa.Table]:
        """The rows (``scan``) or partial aggregate (``agg``) of every rank at once."""
        from probing.node.cluster import plan as planner
        from probing.node.sql import run
        from probing.node.sql.limits import check_sql
        from probing.node.sql.session import READ_ONLY

        eng = self.owners[0].database()
        limits = eng.limits
        session = _session(limits)
        names: dict[str, tuple[str, dict[int, str]]] = {}
        try:
            for table, snaps in self.snaps.items():
                names[table] = session.enter(table, snaps)
            queries: dict[str, str] = {}
            if self.work.mode is planner.Mode.AGG:
                [(table, snaps)] = self.snaps.items()
                if snaps:
                    union = _union(snaps, *names[table])
                    queries[planner.PARTIAL] = planner.over_tagged(
                        self.work.sql, self.refs, {table: union}
                    )
            else:
                for table, snaps in self.snaps.items():
                    if snaps:
                        union = _union(snaps, *names[table])
                        queries[table] = planner.scan_sql(table, union, self.work.scans[table])
            for sql in queries.values():
                check_sql(sql, limits)

            def job() -> dict[str, pa.Table]:
                return {
                    name: run.collect(session.ctx.sql_with_options(sql, READ_ONLY), limits)
                    for name, sql in queries.items()
                }

            with _RUNNING:
                got: dict[str, pa.Table] = eng.threads.run(job, timeout_s=limits.timeout_s)
            return got
        finally:
            session.leave([n for mem, sealed in names.values() for n in (mem, *sealed.values())])


def _stored(
    table: str, owners: list[Owner], databases: list[Any]
) -> list[tuple[Owner, EventTable]] | None:
    """``table`` on each rank that has it; None where one serves it
    otherwise than stored."""
    sch, name = table.split(".", 1)
    got: list[tuple[Owner, EventTable]] = []
    for owner, eng in zip(owners, databases, strict=True):
        schema = eng.catalog.schema(sch)
        kind = None if schema is None else schema.kind(name)
        if kind is None:
            continue  # this rank lacks it: no rows
        tbl = eng.store.get(sch, name) if kind == "stored" else None
        if tbl is None:  # made per process, or gone since
            return None
        got.append((owner, tbl))
    return got


def _union(snaps: list[Any], mem: str, sealed: dict[int, str]) -> str:
    """Every rank's rows of a table, tagged: the rows not sealed yet of all
    of them and their small sealed ranges, tagged in ``mem`` (one memory
    table: planning a branch a rank costs more than the rows), then the
    other ranks' sealed chunks (``sealed``: rank -> a native scan of its
    files, tagged in SQL)."""
    from probing.node.cluster import plan as planner

    cols = snaps[0][1].schema.names
    branches = [f'SELECT * FROM "together"."{mem}"']
    for o, _ in snaps:
        if o.rank in sealed:
            branches.append(
                planner.tagged_sql(f"together.{sealed[o.rank]}", cols, o.ident.node, o.rank)
            )
    return " UNION ALL ".join(branches)


class _Session:
    """The DataFusion session an engine's ``Together`` queries share. A
    rank's sealed chunks are registered once for each range of them (its
    directory listed, each file's footer read and kept by DataFusion's
    caches, once), until a newer range of the same directory replaces
    them; the rows not sealed yet, for one query. A name a query reads is
    deregistered only once no query reads it. A small range (``SMALL_BYTES``
    of files) is read once instead, its rows kept in memory (``SMALL_KEPT``
    bytes in all) and queried with the rows not sealed yet. 8 ranks' few
    sealed rows (``GROUP BY rank``): 5.6 ms of CPU a query in a session of
    its own, 3.9 ms here scanned, 1.7 ms in memory."""

    KEEP = 4096  # ranges of sealed chunks kept registered, the least recently read go

    def __init__(self, limits: Any) -> None:
        from datafusion import SessionConfig, SessionContext
        from datafusion.catalog import Catalog, Schema

        from probing.node.sql.session import FOOTERS_CACHE, runtime_env

        self.ctx = SessionContext(
            SessionConfig()
            .with_default_catalog_and_schema("probing", "together")
            .with_target_partitions(2),  # as a rank's engine (probing.node.sql.session)
            runtime_env(limits),
        )
        # a chunk directory's listing is never reused (a range registered
        # here may be scanned after more chunks were sealed beside it); the
        # footers of chunk files, immutable, are kept
        self.ctx.sql("SET datafusion.runtime.list_files_cache_limit = 0")
        self.ctx.sql(f"SET datafusion.runtime.metadata_cache_limit = '{FOOTERS_CACHE}'")
        catalog = Catalog.memory_catalog()
        self.ctx.register_catalog_provider("probing", catalog)
        self.schema = Schema.memory_schema()
        catalog.register_schema("together", self.schema)
        self._lock = threading.Lock()
        self._next = 0
        self._sealed = _Ranges(self.KEEP, lambda name: 1)  # range -> the name it is under
        self._reading: dict[str, int] = {}  # name -> queries reading it
        self._doomed: set[str] = set()  # to go once no query reads them
        self._rows = _Ranges(SMALL_KEPT, lambda rows: rows.nbytes)  # small range -> its rows
        self._pruned = time.monotonic()

    def enter(self, table: str, got: list[Any]) -> tuple[str, dict[int, str]]:
        """``table``'s rows of the ranks of ``got`` (``[(owner, Snapshot)]``)
        registered: the name of the rows in memory (those not sealed yet, and
        the small sealed ranges), and the other ranks' sealed chunks by rank;
        the query ``leave``s every name after."""
        import pyarrow as pa

        from probing.node.sql.providers import rows_frame, snapshot_frame

        self._prune()
        rows = [tagged_rows([(o, snap.pending) for o, snap in got])]
        sealed: dict[int, str] = {}
        for owner, snap in got:
            if snap.chunk_dir is None:
                continue
            key = (snap.chunk_dir, snap.container, snap.schema.to_string(),  # its directory,
                   snap.first_chunk, snap.last_chunk, snap.sealing, snap.merged)  # fmt: skip
            name = self._read(key)
            if name is None:  # its pending rows are in the memory table
                only = snap._replace(pending=snap.pending.schema.empty_table())
                small = self._small(owner, only, key)
                if small is not None:
                    rows.append(small)
                    continue
                name = self._register(snapshot_frame(self.ctx, only), key)
            sealed[owner.rank] = name
        return self._register(rows_frame(self.ctx, pa.concat_tables(rows)), None), sealed

    def _small(self, owner: Owner, sealed: Any, key: tuple[Any, ...]) -> pa.Table | None:
        """A rank's sealed range (``sealed``: its snapshot without pending
        rows), tagged, when its files are small (read once, kept in memory:
        eight scans of a few rows cost more than the rows)."""
        import pyarrow as pa

        from probing.node.sql.providers import snapshot_dataset

        mine = (*key, owner.ident.node, owner.rank)
        with self._lock:
            got = self._rows.get(mine)
        if got is not None:
            return got
        try:
            if sum(os.path.getsize(p) for p in sealed.paths) > SMALL_BYTES:
                return None
            got = snapshot_dataset(sealed).to_table()
        except (OSError, pa.ArrowException):  # retired meanwhile: the scan says what is left
            return None
        got = tagged_rows([(owner, got)])
        with self._lock:
            self._rows.put(mine, got)
        return got

    def _prune(self) -> None:
        """Forget, every ``PRUNE_S``, the ranges of directories that are gone
        (their processes retired): an engine serves hundreds of jobs."""
        now = time.monotonic()
        with self._lock:
            if now - self._pruned < PRUNE_S:
                return
            self._pruned = now
            self._rows.prune()
            for name in self._sealed.prune():
                self._drop(name)

    def _read(self, key: tuple[Any, ...]) -> str | None:
        with self._lock:
            name: str | None = self._sealed.get(key)
            if name is not None:
                self._reading[name] = self._reading.get(name, 0) + 1
            return name

    def _register(self, frame: Any, key: tuple[Any, ...] | None) -> str:
        with self._lock:
            got: str | None = None if key is None else self._sealed.get(key)
            if got is not None:  # another query registered it meanwhile
                name = got
            else:
                self._next += 1
                name = f"t{self._next}"
                self.schema.register_table(name, frame.into_view())
                if key is None:
                    self._doomed.add(name)  # one query's rows
                else:
                    for gone in self._sealed.put(key, name):
                        self._drop(gone)
            self._reading[name] = self._reading.get(name, 0) + 1
        return name

    def _drop(self, name: str) -> None:
        if self._reading.get(name):
            self._doomed.add(name)
        else:
            self.schema.deregister_table(name)

    def leave(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                left = self._reading.get(name, 1) - 1
                if left > 0:
                    self._reading[name] = left
                    continue
                self._reading.pop(name, None)
                if name in self._doomed:
                    self._doomed.discard(name)
                    self.schema.deregister_table(name)


class _Ranges:
    """What a ``_Session`` keeps per range of a rank's sealed chunks (a key:
    its directory, ``key[:3]``, then the range), for the newest range of
    each directory only, the least recently read going first once their
    ``size`` adds up past ``bound`` (one always stays). ``put`` and
    ``prune`` return what they let go. The session's lock guards it."""

    def __init__(self, bound: int, size: Callable[[Any], int]) -> None:
        self.items: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self.total = 0  # the items' size
        self._bound = bound
        self._size = size
        self._newest: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # directory -> its range

    def get(self, key: tuple[Any, ...]) -> Any:
        got = self.items.get(key)
        if got is not None:
            self.items.move_to_end(key)
        return got

    def put(self, key: tuple[Any, ...], value: Any) -> list[Any]:
        old = self._newest.get(key[:3])
        gone = [self._pop(old)] if old is not None and old != key and old in self.items else []
        self._newest[key[:3]] = key
        self.items[key] = value
        self.total += self._size(value)
        while self.total > self._bound and len(self.items) > 1:
            gone.append(self._pop(next(iter(self.items))))
        return gone

    def prune(self) -> list[Any]:
        """What was kept for directories that are gone (their processes retired)."""
        return [self._pop(k) for k in [k for k in self.items if not os.path.isdir(k[0])]]

    def _pop(self, key: tuple[Any, ...]) -> Any:
        value = self.items.pop(key)
        self.total -= self._size(value)
        if self._newest.get(key[:3]) == key:
            del self._newest[key[:3]]
        return value


_sessions: dict[int, _Session] = {}
_sessions_lock = threading.Lock()


def _session(limits: Any) -> _Session:
    """This process's session for ``Together`` queries under ``limits``'s memory."""
    with _sessions_lock:
        got = _sessions.get(limits.memory)
        if got is None:
            got = _sessions[limits.memory] = _Session(limits)
        return got


def tagged_rows(parts: list[tuple[Owner, pa.Table]]) -> pa.Table:
    """Rows of several ranks as one table, tagged as ``plan.tagged_sql`` tags
    a rank's (its own ``node``/``rank`` renamed ``table_node``/``table_rank``)."""
    import pyarrow as pa

    from probing.node.cluster import plan as planner

    out = []
    for owner, rows in parts:
        names = [f"table_{n}" if n in ("node", "rank") else n for n in rows.column_names]
        rows = rows.rename_columns(names)
        rows = rows.append_column("node", pa.array([owner.ident.node] * rows.num_rows, pa.string()))
        out.append(rows.append_column("rank", pa.array([owner.rank] * rows.num_rows, pa.int64())))
    return pa.concat_tables(out).cast(
        pa.schema([*out[0].schema][:-2] + [pa.field(n, t, nullable=False) for n, t in planner.TAGS])
    )
