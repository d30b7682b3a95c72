"""A probe put together: the tables of the layers under the probe, the
``analyze`` tables, the cluster node and the always-on watch. The probe
(``probing.node.probe``) never imports these layers itself; the database's
service (``probing.node.service``) hands them to it from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

    from probing.node.cluster.node import ClusterNode
    from probing.node.detector.watch import Watch
    from probing.node.probe.context import ProbeContext
    from probing.node.sql import Database


def install_tables(database: Database, ctx: ProbeContext | None = None) -> None:
    """Every table of a probe: the base tables, then ``analyze.*`` (which read
    ``comm.collectives``). ``probing.analyze`` is imported at the first query
    that names the schema ``analyze`` or lists tables, not with the database."""
    from probing.node.tables import install

    install(database, ctx)
    database.defer("analyze", lambda: _install_analyze(database, ctx))


def _install_analyze(database: Database, ctx: ProbeContext | None) -> None:
    from probing.analyze import findings as kept
    from probing.node.tables import analysis

    analysis.install(database)

    def findings() -> pa.Table:
        node = ctx.cluster if ctx is not None else None
        detector = node.watch if node is not None else None
        return detector.table() if detector is not None else kept.empty()

    database.register_table("analyze", "findings", findings)


def cluster_node(ctx: ProbeContext) -> ClusterNode | None:
    """The cluster node of a process: a rank of a multi-process job, a
    process given ``PROBING_PEERS``, or one that may become a rank once it
    calls ``init_process_group`` (Lightning, ``mp.spawn``: the node waits
    for it); None with ``PROBING_CLUSTER=off``. Its TCP port and
    publication start in the background."""
    from probing import config
    from probing.node.cluster import identity

    environ = ctx.target.environ()
    if config.from_env(environ).cluster_off:
        return None
    from probing.node.cluster.node import ClusterNode

    ident = identity.from_env(environ)
    node = ClusterNode(ident, lambda: ctx.database, pid=ctx.pid, learn=ctx.target.distributed)
    node.detector = lambda: _detector(ctx, node)  # made at the first trace (POST /trace/start)
    node.recent = lambda since_ns, cursor_ns: _recent(ctx, node, since_ns, cursor_ns)
    node.waits = lambda since_ns: _waits(ctx, node, since_ns)
    return node


def _waits(ctx: ProbeContext, node: ClusterNode, since_ns: int) -> Any:
    """RUNQ_SQL's rows of ``node`` from ``since_ns``, tagged as a peer's
    answer, from what its sampler kept (``ClusterNode.runq_since``); None
    where it cannot say."""
    import pyarrow as pa

    from probing.node.cluster.share import tagged_rows

    tracer = ctx.tracer
    sampler = None if tracer is None else tracer.sampler
    got = None if sampler is None else sampler.waits_since(since_ns)
    if got is None:
        return None
    rows = pa.table({"kind": ["runq", "tick"], "dur_ns": pa.array(got, pa.int64())})
    return tagged_rows([(node, rows)])


def _recent(ctx: ProbeContext, node: ClusterNode, since_ns: int, cursor_ns: int) -> Any:
    """``node``'s collectives from ``since_ns`` ended from ``cursor_ns`` on
    or in flight, as a peer answers the detector's ask, from what its tracer
    kept (``ClusterNode.recent``); None where it cannot say."""
    import pyarrow as pa

    from probing.node.tables.trace import collectives_rows

    tracer = ctx.tracer
    kept = None if tracer is None else tracer.drained()
    got = None if kept is None else kept.collectives_since(cursor_ns, ctx.pid)
    if got is None:
        return None
    node_name, rank = node.ident.node, node.rank
    parts = [collectives_rows(b, t, node_name, rank, since_ns, cursor_ns) for b, t in got.items()]
    return pa.concat_tables(parts) if parts else None


def _detector(ctx: ProbeContext, node: ClusterNode) -> Watch:
    """The always-on detector of ``ctx`` (``probing.node.detector``)."""
    from probing.node.detector.watch import Watch

    def tracing() -> bool:  # asked by every rank's two beats: not its whole status
        tracer = ctx.tracer
        return tracer is not None and tracer.drained() is not None

    def dropped() -> dict[str, int]:
        tracer = ctx.tracer
        families = tracer.status().get("families", {}) if tracer is not None else {}
        return {f: int(v.get("dropped") or 0) for f, v in families.items()}

    def arrivals(since_ns: int) -> Any:
        tracer = ctx.tracer
        kept = None if tracer is None else tracer.drained()
        return None if kept is None else kept.arrivals(since_ns)

    return Watch(node, tracing, dropped, arrivals=arrivals)
