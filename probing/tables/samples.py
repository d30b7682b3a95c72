"""``python.samples``: where each thread's wall-clock time went, by Python
stack (``probing.bpf.sampler``, while tracing); typed and empty before."""

from __future__ import annotations

from probing.bpf.sampler import SCHEMA
from probing.engine import Engine


def install(engine: Engine) -> None:
    engine.store.table("python", "samples", SCHEMA)
