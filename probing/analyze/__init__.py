"""Stragglers, slow links and hangs, from every rank's collectives and stacks.

``analyze`` is pure and works on the gathered table; ``diagnose`` asks a
``Job`` (``probing.cli.client.Job``: local pids, or the cluster) and analyzes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from probing.analyze.diagnose import Diagnosis, Job, analyze, diagnose, local_tables

SQL_TABLES = (
    "stragglers", "slow_links", "hangs", "ranks", "collectives", "why", "stages", "transfers",
)  # fmt: skip


def install(engine: Any) -> None:
    """``analyze.*`` in a probe: over this probe's own rows (one rank)."""

    def producer(name: str) -> Callable[[], Any]:
        return lambda: local_tables(engine)[name]

    for name in SQL_TABLES:
        engine.register_table("analyze", name, producer(name))


__all__ = ["Diagnosis", "Job", "analyze", "diagnose", "install"]
