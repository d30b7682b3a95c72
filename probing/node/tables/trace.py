"""The traced tables: ``<family>.calls`` (store), ``<family>.inflight``,
``probing.uprobes``, ``trace.intervals`` (when the process was traced),
``python.stacks`` (store) and the views
``comm.collectives`` and ``python.callsites``.

The store tables exist, typed and empty, before any tracing, so queries and
views over them work whether or not a trace ever ran.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from probing.node.bpf import families
from probing.node.bpf.pystacks import CALLSITES_SQL, STACKS_SCHEMA
from probing.node.sql import Database

if TYPE_CHECKING:
    from probing.node.bpf.tracer import Tracer

_COLLECTIVE_COLUMNS = (
    "op, {comm} AS comm, seq, rank, nranks, bytes, ts, dur_ns, pid, tid, stack_id, {p2p}"
)
# send/recv: the peer rank (in the group), the tag and the time blocked in
# wait() where the backend has them (NCCL's peer column holds a root too)
_COMM = {
    "nccl": ("COALESCE(comm_id, comm)", "CASE WHEN op IN ('send', 'recv') THEN peer END AS peer, "
             "CAST(NULL AS INT) AS tag, CAST(NULL AS BIGINT) AS wait_ns"),
    "gloo": ("comm", "peer, tag, wait_ns"),
}  # fmt: skip

# every collective and point-to-point call of every backend, finished or not
# (a call still in flight has a NULL dur_ns: where a hang shows)
COLLECTIVES_SQL = "\nUNION ALL\n".join(
    f"SELECT '{backend}' AS backend, {_COLLECTIVE_COLUMNS.format(comm=comm, p2p=p2p)} "
    f"FROM {backend}.{table} WHERE op IS NOT NULL"
    for backend, (comm, p2p) in _COMM.items()
    for table in ("calls", "inflight")
)


def collectives_rows(
    backend: str, calls: pa.Table, node: str, rank: int, since_ns: int, cursor_ns: int
) -> pa.Table:
    """What a peer answers the detector's ask of ``comm.collectives``
    (``queries(remote=True)["collectives"]`` from ``since_ns``, the calls
    ended from ``cursor_ns`` on or in flight) of ``calls`` (``backend``'s
    ``calls`` rows, finished or not), as its branch of ``COLLECTIVES_SQL``
    makes them and a peer tags them (``node``, ``rank``; the table's own
    rank is ``comm_rank``), with no SQL: the rows a tracer of this engine
    kept (``Drainer.collectives_since``). ``tests/test_watch.py`` holds the two alike."""
    import pyarrow.compute as pc

    if calls.num_rows:
        calls = calls.combine_chunks()  # a batch a drain: each compute would pay for each
        end = pc.add(calls["ts"], calls["dur_ns"])
        flying = pc.is_null(calls["dur_ns"])
        keep = pc.and_kleene(
            pc.is_valid(calls["op"]),
            pc.and_kleene(
                pc.or_kleene(pc.greater_equal(calls["ts"], since_ns), flying),
                pc.or_kleene(flying, pc.greater_equal(end, cursor_ns)),
            ),
        )
        calls = calls.filter(pc.fill_null(keep, False))
    n = calls.num_rows
    if backend == "nccl":
        comm = pc.coalesce(calls["comm_id"], calls["comm"])
        p2p = pc.is_in(calls["op"], pa.array(["send", "recv"]))
        peer = pc.if_else(pc.fill_null(p2p, False), calls["peer"], pa.nulls(n, pa.int32()))
        tag, wait = pa.nulls(n, pa.int32()), pa.nulls(n, pa.int64())
    else:
        comm, peer, tag, wait = calls["comm"], calls["peer"], calls["tag"], calls["wait_ns"]
    columns = {
        "backend": pa.repeat(pa.scalar(backend, pa.string()), n), "op": calls["op"], "comm": comm,
        "seq": calls["seq"], "comm_rank": calls["rank"], "nranks": calls["nranks"],
        "bytes": calls["bytes"], "ts": calls["ts"], "dur_ns": calls["dur_ns"],
        "pid": calls["pid"], "tid": calls["tid"], "peer": peer, "tag": tag, "wait_ns": wait,
        "node": pa.repeat(pa.scalar(node, pa.string()), n),
        "rank": pa.repeat(pa.scalar(rank, pa.int64()), n),
    }  # fmt: skip
    return pa.table(columns)


# the probe's tracer now (None before the first trace): ProbeContext.tracer
CurrentTracer = Callable[[], "Tracer | None"]


def _inflight(family: str, current: CurrentTracer) -> Callable[[], pa.Table]:
    schema = families.FAMILIES[family].schema

    def produce() -> pa.Table:
        tracer = current()
        return tracer.inflight(family) if tracer is not None else schema.empty_table()

    return produce


def _uprobes(current: CurrentTracer) -> Callable[[], pa.Table]:
    def produce() -> pa.Table:
        from probing.node.bpf.attach import PROBES_SCHEMA

        tracer = current()
        return tracer.probes_table() if tracer is not None else PROBES_SCHEMA.empty_table()

    return produce


# when the process was traced: one row a trace, stop_ns NULL while it traces;
# state 'tracing', 'stopped' or 'died' (it died tracing: stop_ns is its death)
INTERVALS_SCHEMA = pa.schema(
    [("start_ns", pa.int64()), ("stop_ns", pa.int64()), ("state", pa.string()),
     ("families", pa.string())]
)  # fmt: skip


def install(
    database: Database,
    current: CurrentTracer = lambda: None,
    intervals: Callable[[], list[dict[str, Any]]] = list,
) -> None:
    for name, family in families.FAMILIES.items():
        database.store.table(family.table, "calls", family.schema)
        database.register_table(family.table, "inflight", _inflight(name, current))
    database.register_table("probing", "uprobes", _uprobes(current))
    database.register_table(
        "trace", "intervals", lambda: pa.Table.from_pylist(intervals(), schema=INTERVALS_SCHEMA)
    )
    database.register_view("comm", "collectives", COLLECTIVES_SQL)
    database.store.table("python", "stacks", STACKS_SCHEMA)
    database.register_view("python", "callsites", CALLSITES_SQL)
