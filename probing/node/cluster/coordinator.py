"""One cluster query, end to end: plan it, gather the shares, run the final SQL.

``coordinate`` is the asker's side (``POST /cluster/query``): it learns the
schema of every table the query names from its own database, plans the query
(``probing.node.cluster.plan``), gathers every peer's share (``fanout.gather``;
a flat fan-out aggregates ``GROUP BY node`` here, not on the gatherers)
and runs the final SQL over what came. ``answer_gather`` is a gatherer's
side (``POST /cluster/gather``): its own share and its members', its node
aggregated where the plan says so. A gather request names its members by
rank only: where to connect, and so whom to send the job's token, comes
from this probe's own discovery (``known_members``).

``Asker`` is what both need of the cluster node.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from probing import procs
from probing.errors import PeerUnreachable, QueryError
from probing.node.cluster import fanout as asking  # "fanout" names a kind of fan-out here
from probing.node.cluster.discovery import PeerInfo, Registry, StoreDirectory
from probing.node.cluster.fanout import FANOUTS, Collected, concat, is_tree
from probing.node.cluster.identity import Identity
from probing.node.cluster.wire import MissingPeer, pack

if TYPE_CHECKING:  # loaded on the first cluster query, not when the probe starts
    import pyarrow as pa

    from probing.node.cluster import plan as planner
    from probing.node.sql import Database

MAX_MEMBERS = 65536  # ranks one gather request may name (a job's size bounds them anyway)
MAX_GATHER_S = 300.0  # the longest a gather request may ask me to wait for its members


class Asker(asking.Peer, Protocol):
    """What a query needs of the cluster node (``probing.node.cluster.node.ClusterNode``)."""

    ident: Identity
    rank: int
    pid: int
    database: Callable[[], Database]
    registry: Registry
    directory: StoreDirectory | None

    def refresh(self, budget: float = 2.0) -> None: ...

    def others(self) -> list[PeerInfo]: ...


def coordinate(
    node: Asker,
    sql: str,
    *,
    timeout: float = 5.0,
    strict: bool = False,
    fanout: str = "auto",
    skip: frozenset[int] = frozenset(),
) -> tuple[pa.Table, Collected, planner.Plan]:
    """Run ``sql`` over every peer's tables, but the ranks ``skip`` names
    (the caller has theirs); returns (result, who answered, plan)."""
    from probing.node.cluster import plan as planner

    if fanout not in FANOUTS:
        raise QueryError(f"unknown fan-out {fanout!r} (use one of {', '.join(FANOUTS)})")
    deadline = time.monotonic() + timeout
    eng = node.database()
    node.refresh(budget=min(2.0, max(1.0, timeout / 4)))
    known = set(eng.catalog.schema_names())
    schemas = _schemas(sql, eng, known)
    the_plan = planner.plan(sql, schemas, known)
    if the_plan.mode is planner.Mode.AGG_NODE and not is_tree(node.others(), fanout):
        the_plan = planner.plan_scan(sql, schemas, known)  # flat: the asker aggregates
    left = max(0.0, deadline - time.monotonic())
    members = [p for p in node.others() if p.rank not in skip]
    got = asking.gather(node, the_plan.work(), members, left, fanout,
                        with_self=node.rank not in skip)  # fmt: skip
    _undiscovered(node, got, skip)
    if strict and got.missing:
        names = ", ".join(f"rank {m.rank} ({m.addr}: {m.reason})" for m in got.missing)
        raise PeerUnreachable(f"{len(got.missing)} peer(s) did not answer: {names}")
    if the_plan.mode is planner.Mode.SCAN:
        result = _final_scan(the_plan, got.merged(), schemas, eng.threads)
    else:
        result = _final_agg(the_plan, got.merged(), schemas, known, eng.threads)
    got.peers.sort(key=lambda t: t.rank)
    got.missing.sort(key=lambda m: m.rank)
    return result, got, the_plan


def _schemas(sql: str, eng: Any, known: set[str]) -> dict[str, pa.Schema | None]:
    """Each table the query names, as the peers serve it (None: not here)."""
    from probing.node.cluster import plan as planner

    schemas: dict[str, pa.Schema | None] = {}
    for ref in planner.table_refs(sql, known):
        try:
            cols = eng.sql(f"SELECT * FROM {ref.name} LIMIT 0", allow_code=False).schema
            schemas[ref.name] = planner.tagged_schema(cols, ref.name)
        except QueryError:
            schemas[ref.name] = None
    return schemas


def _undiscovered(node: Asker, got: Collected, skip: frozenset[int] = frozenset()) -> None:
    """torchrun: the ranks never discovered are missing too; one its launcher
    started on this node with no process left here, as exited
    (``procs.NO_PROCESS``)."""
    if node.directory is None:
        return
    answered = {t.rank for t in got.peers} | {m.rank for m in got.missing} | skip
    never = [r for r in range(node.ident.world_size) if r not in answered]
    exited = set(procs.exited_ranks(node.pid)) if never else set()
    for rank in never:
        if rank in exited:
            got.missing.append(MissingPeer(rank, node.ident.node, "", procs.NO_PROCESS))
        else:
            got.missing.append(MissingPeer(rank, "?", "", "not discovered"))


def _final_scan(
    the_plan: planner.Plan,
    merged: dict[str, pa.Table],
    schemas: dict[str, pa.Schema | None],
    threads: Any,
) -> pa.Table:
    """The user's SQL over every peer's rows (an empty table where none came)."""
    import pyarrow as pa

    from probing.node.cluster import plan as planner

    tables: dict[str, pa.Table | pa.Schema] = {}
    for name in the_plan.scans:
        data = merged.get(name)
        sch = schemas.get(name)
        if data is None and sch is None:
            raise QueryError(f"table '{name}' not found here nor on any peer that answered")
        tables[name] = data if data is not None else (sch or pa.schema(list(planner.tags_of(name))))
    return planner.run_final(the_plan.final_sql, tables, threads)


def _final_agg(
    the_plan: planner.Plan,
    merged: dict[str, pa.Table],
    schemas: dict[str, pa.Schema | None],
    known: set[str],
    threads: Any,
) -> pa.Table:
    """The final SQL over the peers' partial results (and my node's rows in
    ``agg_node``, aggregated here)."""
    import pyarrow as pa

    from probing.node.cluster import plan as planner

    sql = the_plan.sql
    partial = merged.get(planner.PARTIAL)
    rows = {n: t for n, t in merged.items() if n != planner.PARTIAL}
    if the_plan.mode is planner.Mode.AGG_NODE and rows:  # my node's rows (and any re-asked)
        mine = planner.run_final(sql, rows, threads)
        partial = mine if partial is None else concat([partial, mine])
    if partial is None:
        ref = planner.table_refs(sql, known)[0].name
        empty = schemas[ref] or pa.schema(list(planner.tags_of(ref)))
        partial = planner.run_final(the_plan.sql, {ref: empty}, threads)
    return planner.run_final(the_plan.final_sql, {f"probing.{planner.PARTIAL}": partial}, threads)


# -- gathering for an asker: POST /cluster/gather ----------------------------------------


def answer_gather(node: Asker, payload: dict[str, Any], t_recv_ns: int) -> bytes:
    """POST /cluster/gather: my share, plus my members' when I gather for someone."""
    from probing.node.cluster import plan as planner

    work = planner.Work.from_json(payload["work"])
    members, unknown = known_members(node, payload.get("members") or [])
    timeout = min(max(float(payload.get("timeout", 5.0)), 0.0), MAX_GATHER_S)
    got = asking.gather(node, work, members, timeout, "flat")
    got.missing.extend(unknown)
    tables = got.merged()
    if work.mode is planner.Mode.AGG_NODE:
        refs = list(work.scans)
        inputs: dict[str, pa.Table | pa.Schema] = {n: tables[n] for n in refs if n in tables}
        if inputs:
            threads = node.database().threads
            tables = {planner.PARTIAL: planner.run_final(work.sql, inputs, threads)}
        else:
            tables = {}
    meta = {
        "rank": node.rank,
        "node": node.ident.node,
        "missing": [vars(m) for m in got.missing],
        "peers": [vars(t) for t in got.peers if t.rank != node.rank],
    }
    return pack(meta, tables, t_recv_ns)


def known_members(node: Asker, refs: list[Any]) -> tuple[list[PeerInfo], list[MissingPeer]]:
    """The members a gather request names, as my own discovery knows them.

    A request names members by rank only: where to connect (and so whom
    to send the job's token) comes from my registry (the TCPStore or
    PROBING_PEERS), never from the request. A rank I do not know, after
    one look at the store, is answered missing; myself and repeats are
    dropped, so the fan-out is at most the job's size.
    """
    ranks: list[int] = []
    for ref in refs[:MAX_MEMBERS]:
        try:
            rank = int(ref["rank"] if isinstance(ref, dict) else ref)
        except (KeyError, TypeError, ValueError):
            continue
        if rank != node.rank and rank not in ranks:
            ranks.append(rank)
    known = {p.rank: p for p in node.registry.peers()}
    if any(r not in known for r in ranks) and node.directory is not None:
        node.refresh(budget=1.0)
        known = {p.rank: p for p in node.registry.peers()}
    members = [known[r] for r in ranks if r in known]
    unknown = [
        MissingPeer(r, "?", "", "not among the peers this probe discovered")
        for r in ranks
        if r not in known
    ]
    return members, unknown
