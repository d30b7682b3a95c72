"""``python.samples``: where each thread's wall-clock time went, by Python
stack (``probing.node.bpf.sampler``, while tracing); typed and empty before."""

from __future__ import annotations

from probing.node.bpf.sampler import SCHEMA
from probing.node.sql import Database


def install(database: Database) -> None:
    database.store.table("python", "samples", SCHEMA)
