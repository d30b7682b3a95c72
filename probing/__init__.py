"""probing: an eBPF-assisted, system-level tracer for distributed AI training.

The package import is cheap on purpose: the ``.pth`` hook imports it in every
interpreter of the environment. In a job, probing is its guest
(``probing.guest``, the standard library only, loaded as ``_probing_guest``)
and the node's engine beside it: ``probing.enable()``, ``PROBING=1 python
train.py`` and ``python -m probing run train.py`` all start the guest, which
hands the process to the engine. Nothing of the engine (numpy, pyarrow,
datafusion) is loaded into the job: ``probing.query`` answers plain rows.
"""

from __future__ import annotations

import sys
from typing import Any

from probing.errors import (
    AccessDenied,
    AttachError,
    BPFUnavailable,
    NoProbe,
    NoSuchProcess,
    PeerUnreachable,
    ProbingError,
    QueryError,
    from_wire,
)
from probing.guest.place import VERSION as __version__


def _guest(module: str) -> Any:
    """A module of this process's guest (``_probing_guest.<module>``),
    loaded from its files, not started."""
    import importlib

    from probing import _boot

    return importlib.import_module(f"{_boot.guest().__name__}.{module}")


def enable() -> None:
    """Start this process's guest and hand the process to the node's engine
    (started when none runs), waiting for its answer; idempotent. Then
    ``probing query --pid <this pid>`` and ``probing trace`` reach it."""
    from probing import _boot

    _boot.start(wait=True)


def disable() -> None:
    """Stop this process's guest, if any: the engine keeps what it recorded
    (``probing query --pid`` still answers from it), and what only the
    process knows (threads, stacks, ``python.*``) is not asked until
    ``enable()`` again."""
    from probing import _boot

    guest = sys.modules.get(_boot.GUEST)
    current = guest.current() if guest is not None else None
    if current is not None:
        current.stop()


def query(sql: str, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Run read-only SQL over this process's tables in the node's engine,
    through this process's guest (started, as ``enable()``, if it is not).

    Returns the rows as a list of dicts, column name to value: numbers,
    text, booleans and None as they are, lists and structs as lists and
    dicts, timestamps and other values as their text (the engine's JSON
    answer; no pyarrow in the job). Raises ``QueryError`` (bad SQL, a
    table that does not exist) or another ``ProbingError`` as the engine
    says.
    """
    life, wire = _guest("life"), _guest("wire")
    current = life.current()
    if current is None or current.server is None:
        enable()
        current = life.current()
    try:
        return list(current.query(sql, timeout=timeout))
    except wire.WireError as err:
        if not err.status:  # no answer at all: the engine is gone or stuck
            raise ProbingError(f"the engine did not answer: {err}") from None
        raise from_wire(err.status, str(err), err.kind, detail=err.detail) from None


def __getattr__(name: str) -> Any:
    if name == "ExternalTable":
        # rows wait in this process's guest until the engine takes them (at its
        # next query of python.*): the guest is loaded here, started by enable()
        table = _guest("outbox").Table
        globals()["ExternalTable"] = table
        return table
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
