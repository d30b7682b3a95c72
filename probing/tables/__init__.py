"""Table providers: process, python, probing (store statistics), external."""

from __future__ import annotations

from probing.engine import Engine
from probing.tables import meta, nvml, process, python, stacks, trace
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
    from probing import analyze  # after trace: its tables read comm.collectives

    analyze.install(engine)


__all__ = ["ExternalTable", "install"]
