"""Table providers: process, python, probing (store statistics), external."""

from __future__ import annotations

from probing.engine import Engine
from probing.tables import groups, meta, nvml, process, python, stacks, trace
from probing.tables.external import ExternalTable


def install(engine: Engine) -> None:
    """Register every built-in table with ``engine``."""
    engine.register_table("process", "info", process.info)
    engine.register_table("process", "threads", process.threads)
    engine.register_table("process", "stacks", stacks.stacks)
    engine.register_table("probing", "tables", lambda: meta.tables(engine.store))
    gpu = nvml.sampler(engine.store)  # creates the (typed, maybe empty) nvml.gpu table
    engine.register_table("nvml", "status", gpu.status_table)
    engine.register_table("nvml", "devices", gpu.devices_table)
    engine.register_resolver("python", python.evaluate)
    trace.install(engine)
    engine.register_table(
        "comm", "groups", lambda: groups.groups(groups.traced_gloo_contexts(engine.store))
    )
    engine.register_table("probing", "peers", _peers)
    from probing import analyze  # after trace: its tables read comm.collectives

    analyze.install(engine)


def _peers():  # type: ignore[no-untyped-def]
    """``probing.peers`` of this process's probe (no rows outside cluster mode)."""
    from probing.cluster.discovery import Registry
    from probing.probe import runtime

    probe = runtime.current()
    node = probe.cluster if probe is not None else None
    return (node.registry if node is not None else Registry()).table()


__all__ = ["ExternalTable", "install"]
