"""This peer's share of a cluster query: its own tables, tagged, through its engine.

A peer answers the ``Work`` of a query (``probing.node.cluster.plan``) from its
own engine: in ``agg`` mode the whole query over its tagged tables, else
one scan per table (the columns and filters the asker pushed down). The
SQL text comes from ``plan`` (``tagged_sql``, ``scan_sql``,
``over_tagged``); kept here are the columns of each table and the
rewritten aggregate queries, both dropped when a query fails (a table's
columns changed). A table this peer lacks adds no rows.

``Owner`` is what the share needs of the cluster node: its engine, node
name and rank (the rank may be learned after the share was made).

``Together``: the shares of the ranks one engine serves, as one query over
all their rows (an engine answers for its node in one reply): over stored
tables only, whose rows it can read without asking any process.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from probing.errors import QueryError
from probing.node.cluster.identity import Identity

if TYPE_CHECKING:  # loaded on the first cluster query, not when the probe starts
    import pyarrow as pa

    from probing.node.cluster import plan as planner
    from probing.node.store.table import Snapshot

# A process runs at most this many peers' shares at once (one probe per
# process in a job; several in the benchmark): more at once only adds
# thread and allocator contention to the same CPU work.
_RUNNING = threading.BoundedSemaphore(max(1, os.cpu_count() or 1))
KEEP_REWRITTEN = 64  # aggregate queries whose rewriting is kept


class Owner(Protocol):
    """What a share needs of the cluster node (``probing.node.cluster.node.ClusterNode``)."""

    ident: Identity
    rank: int
    engine: Callable[[], Any]


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

        eng = self.owner.engine()
        out: dict[str, pa.Table] = {}
        if work.mode is planner.Mode.AGG:
            sql = self._agg_sql(work.sql, eng)
            if sql is not None:  # else this peer has no such table: it adds no rows
                out[planner.PARTIAL] = eng.sql(sql, allow_code=False)
            return out
        for table, spec in work.scans.items():
            if _exists(table, eng):
                sql = planner.scan_sql(table, self._tagged(table, eng), spec)
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

        if len(owners) < 2:
            return None
        engines = [o.engine() for o in owners]
        refs: list[planner.TableRef] = []
        if work.mode is planner.Mode.AGG:
            refs = planner.table_refs(work.sql, set(engines[0].catalog.schema_names()))
            if len(refs) != 1:
                return None
            names = [refs[0].name]
        else:
            names = list(work.scans)
        snaps: dict[str, list[Any]] = {}
        for table in names:
            got = _stored(table, owners, engines)
            if got is None:
                return None
            snaps[table] = got
        return cls(owners, work, snaps, refs)

    def run(self) -> dict[str, pa.Table]:
        """The rows (``scan``) or partial aggregate (``agg``) of every rank at once."""
        from probing.node.cluster import plan as planner
        from probing.node.sql import run
        from probing.node.sql.limits import check_sql
        from probing.node.sql.session import READ_ONLY

        eng = self.owners[0].engine()
        limits = eng.limits
        queries: dict[str, str] = {}
        if self.work.mode is planner.Mode.AGG:
            [(table, snaps)] = self.snaps.items()
            if snaps:
                queries[planner.PARTIAL] = planner.over_tagged(
                    self.work.sql, self.refs, {table: _union(table, snaps)}
                )
        else:
            for table, snaps in self.snaps.items():
                if snaps:
                    spec = self.work.scans[table]
                    queries[table] = planner.scan_sql(table, _union(table, snaps), spec)
        for sql in queries.values():
            check_sql(sql, limits)

        def job() -> dict[str, pa.Table]:
            ctx = _context(self.snaps, limits)
            return {
                name: run.collect(ctx.sql_with_options(sql, READ_ONLY), limits)
                for name, sql in queries.items()
            }

        with _RUNNING:
            got: dict[str, pa.Table] = eng.threads.run(job, timeout_s=limits.timeout_s)
        return got


def _stored(table: str, owners: list[Owner], engines: list[Any]) -> list[Any] | None:
    """``table``'s snapshot on each rank that has it; None where one serves
    it otherwise than stored, or with other columns."""
    sch, name = table.split(".", 1)
    got: list[tuple[Owner, Snapshot]] = []
    for owner, eng in zip(owners, engines, strict=True):
        schema = eng.catalog.schema(sch)
        kind = None if schema is None else schema.kind(name)
        if kind is None:
            continue  # this rank lacks it: no rows
        tbl = eng.store.get(sch, name) if kind == "stored" else None
        if tbl is None:  # made per process, or gone since
            return None
        snap = tbl.snapshot()
        if got and not snap.schema.equals(got[0][1].schema):
            return None
        got.append((owner, snap))
    return got


def _hidden(table: str, rank: int | str) -> str:
    """The name in schema ``together`` of rank ``rank``'s sealed rows of
    ``table`` in a ``Together`` query (``mem``: every rank's rows not sealed yet)."""
    return f"{table}.{rank}".replace(".", "__")


def _union(table: str, snaps: list[Any]) -> str:
    """Every rank's rows of ``table``, tagged: the rows not sealed yet of
    all of them, tagged here (one memory table: planning a branch a rank
    costs more than the rows), then each rank's sealed chunks (a native
    scan of its files, tagged in SQL)."""
    from probing.node.cluster import plan as planner

    cols = snaps[0][1].schema.names
    branches = [f'SELECT * FROM "together"."{_hidden(table, "mem")}"']
    for o, snap in snaps:
        if snap.chunk_dir is not None:
            hidden = f"together.{_hidden(table, o.rank)}"
            branches.append(planner.tagged_sql(hidden, cols, o.ident.node, o.rank))
    return " UNION ALL ".join(branches)


def _context(snaps: dict[str, list[Any]], limits: Any) -> Any:
    """A fresh session holding every rank's rows of every table (``_hidden``)."""
    from datafusion import SessionConfig, SessionContext
    from datafusion.catalog import Catalog, Schema

    from probing.node.sql.providers import rows_frame, snapshot_frame
    from probing.node.sql.session import runtime_env

    ctx = SessionContext(
        SessionConfig().with_default_catalog_and_schema("probing", "together"),
        runtime_env(limits),
    )
    catalog = Catalog.memory_catalog()
    ctx.register_catalog_provider("probing", catalog)
    schema = Schema.memory_schema()
    catalog.register_schema("together", schema)
    for table, got in snaps.items():
        pending = _tagged_rows([(o, snap.pending) for o, snap in got])
        schema.register_table(_hidden(table, "mem"), rows_frame(ctx, pending).into_view())
        for owner, snap in got:
            if snap.chunk_dir is not None:  # its sealed chunks alone: its pending rows are above
                sealed = snap._replace(pending=snap.pending.schema.empty_table())
                schema.register_table(
                    _hidden(table, owner.rank), snapshot_frame(ctx, sealed).into_view()
                )
    return ctx


def _tagged_rows(parts: list[tuple[Owner, pa.Table]]) -> pa.Table:
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
