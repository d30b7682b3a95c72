"""probing: an eBPF-assisted, system-level tracer for distributed AI training.

The package import is cheap on purpose: the ``.pth`` hook imports it in every
interpreter of the environment, so heavy modules (datafusion, pyarrow) load
only when a probe answers its first query or a table is created.

Start the probe from code with ``probing.enable()``, or without touching the
code with ``PROBING=1 python train.py`` or ``python -m probing run train.py``.
"""

from __future__ import annotations

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

__version__ = "0.1.0"

if TYPE_CHECKING:
    from probing.probe.runtime import Probe
    from probing.tables.external import ExternalTable


def enable() -> Probe:
    """Start the probe in this process (idempotent); returns it."""
    from probing.probe import runtime

    return runtime.enable()


def disable() -> None:
    """Stop this process's probe, if any. Data already stored stays."""
    from probing.probe import runtime

    runtime.disable()


def query(sql: str) -> Any:
    """Run read-only SQL in this process's engine; returns a ``pyarrow.Table``."""
    from probing.probe import runtime

    return runtime.engine().sql(sql)


def __getattr__(name: str) -> Any:
    if name == "ExternalTable":
        from probing.tables.external import ExternalTable

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
    "disable",
    "enable",
    "query",
]
