"""probing: an eBPF-assisted, system-level tracer for distributed AI training.

The package import is cheap on purpose: the ``.pth`` hook imports it in every
interpreter of the environment, so heavy modules (datafusion, pyarrow) load
only when a probe answers its first query or a table is created.

Start the probe from code with ``probing.enable()``, or without touching the
code with ``PROBING=1 python train.py`` or ``python -m probing run train.py``.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from probing.errors import (
    AccessDenied,
    AttachError,
    BPFUnavailable,
    NoProbe,
    NoSuchProcess,
    PeerUnreachable,
    ProbingError,
    QueryError,
)
from probing.guest.place import VERSION as __version__

if TYPE_CHECKING:
    from probing.node.probe.context import ProbeContext
    from probing.node.tables.external import ExternalTable


def context() -> ProbeContext:
    """This process's probe context (created on first use, not serving)."""
    from probing.node import assemble

    return assemble.context()


def enable() -> ProbeContext:
    """Start the probe in this process (idempotent); returns its context."""
    from probing.node import assemble

    return assemble.enable()


def disable() -> None:
    """Stop this process's probe, if any. Data already stored stays."""
    from probing.node import assemble

    assemble.disable()


def query(sql: str) -> Any:
    """Run read-only SQL in this process's engine; returns a ``pyarrow.Table``."""
    return context().engine.sql(sql)


def __getattr__(name: str) -> Any:
    if name == "ExternalTable":
        guest = sys.modules.get("_probing_guest")
        if guest is not None and guest.current() is not None:
            # this process's probe is its guest: rows go to the engine through it
            return guest.outbox.Table  # loaded with the guest
        from probing.node.tables import external

        class ExternalTable(external.ExternalTable):
            __doc__ = external.ExternalTable.__doc__

            def __init__(self, name: str, columns: Any, *, store: Any = None) -> None:
                super().__init__(name, columns, store=store or context().store)

        globals()["ExternalTable"] = ExternalTable
        return ExternalTable
    raise AttributeError(f"module 'probing' has no attribute {name!r}")


__all__ = [
    "AccessDenied",
    "AttachError",
    "BPFUnavailable",
    "ExternalTable",
    "NoProbe",
    "NoSuchProcess",
    "PeerUnreachable",
    "ProbingError",
    "QueryError",
    "__version__",
    "context",
    "disable",
    "enable",
    "query",
]
