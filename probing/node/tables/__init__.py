"""Table providers: process, python, probing (store statistics), external.

``install(database, ctx)`` registers them; ``ctx`` (a ``ProbeContext``) gives
the parts of the probe they show: its tracer, NVML sampler and cluster
node. Without one (a database built alone, as in tests) those tables answer
as an idle probe's would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from probing.node.sql import Database
from probing.node.tables import flight, groups, meta, nvml, process, python, samples, stacks, trace
from probing.node.tables.external import ExternalTable, Puller

if TYPE_CHECKING:
    import pyarrow as pa

    from probing.node.bpf.tracer import Tracer
    from probing.target import Target


class Peers(Protocol):
    """What ``probing.peers`` reads of a cluster node
    (``probing.node.cluster.node.ClusterNode``)."""

    def peers_table(self) -> pa.Table: ...


class Context(Protocol):
    """What the tables read of a probe (``probing.node.probe.context.ProbeContext``)."""

    @property
    def tracer(self) -> Tracer | None: ...

    @property
    def cluster(self) -> Peers | None: ...  # a ClusterNode in cluster mode

    @property
    def target(self) -> Target: ...  # the process described (Local or GuestProcess)

    @property
    def nvml(self) -> nvml.GpuSampler: ...

    def trace_intervals(self) -> list[dict[str, object]]: ...


class Alone:
    """The ``Context`` of a database outside a probe: no tracer, no peers."""

    def __init__(self, database: Database) -> None:
        from probing.target import Local

        self.tracer: Tracer | None = None
        self.cluster: Peers | None = None
        self.target: Target = Local()
        self.nvml = nvml.GpuSampler(database.store)

    def trace_intervals(self) -> list[dict[str, object]]:
        return []


def install(database: Database, ctx: Context | None = None) -> None:
    """Register every built-in table with ``database``."""
    probe: Context = ctx if ctx is not None else Alone(database)
    target = probe.target
    comm_groups = groups.provider(target.groups, database.store)
    where = process.PlaceCache(comm_groups)
    database.register_table("process", "info", lambda: process.info(target, where))
    database.register_table("process", "threads", lambda: process.threads(target))
    database.register_table("process", "cpu", lambda: process.cpu(target))
    database.register_table("process", "stacks", stacks.provider(target.stacks))
    database.register_table("probing", "tables", lambda: _pulled(puller, database))
    gpu = probe.nvml  # creates the (typed, maybe empty) nvml.gpu table
    database.register_table("nvml", "status", gpu.status_table)
    database.register_table("nvml", "devices", gpu.devices_table)
    puller = Puller(target.external, database.store)
    database.register_resolver("python", python.resolver(target.expr, puller.pull, database.store))
    trace.install(database, lambda: probe.tracer, probe.trace_intervals)
    samples.install(database)
    database.register_table("comm", "groups", comm_groups)
    database.register_table("comm", "flight", flight.provider(target.flight))
    database.register_table("comm", "flight_status", flight.status_provider(target.flight))
    database.register_table("probing", "peers", lambda: _peers(probe.cluster))


def _pulled(puller: Any, database: Database) -> Any:
    """``probing.tables``, with the process's ExternalTables taken first."""
    puller.pull()
    return meta.tables(database.store)


def _peers(node: Peers | None) -> pa.Table:
    """``probing.peers`` of a probe (no rows outside cluster mode)."""
    if node is not None:
        return node.peers_table()
    table: pa.Table = meta.PEERS_SCHEMA.empty_table()
    return table


__all__ = ["Alone", "Context", "ExternalTable", "Peers", "install"]
