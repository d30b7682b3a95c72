"""``python.samples``: where each thread's wall-clock time went, by Python
stack (``probing.node.bpf.sampler``, while tracing); typed and empty before."""

from __future__ import annotations

from probing.node.bpf.sampler import SCHEMA
from probing.node.sql import Engine


def install(engine: Engine) -> None:
    engine.store.table("python", "samples", SCHEMA)
