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
        if not all(_exists(ref.name, eng) for ref in refs):
            return None
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
