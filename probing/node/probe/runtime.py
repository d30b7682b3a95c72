"""The process's one ``ProbeContext`` slot: enable, disable, fork.

The slot is the only module-level state of the probe: ``enable()`` fills it
(``probing.enable()`` hands it the layers above the probe: the analyze
tables and the cluster node), ``disable()`` closes the socket and keeps the
data, and one fork handler carries the context into a child in order
(``ProbeContext.after_fork``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from probing.errors import log_unexpected
from probing.node.probe.context import ClusterFactory, Installer, ProbeContext, base_tables

_context: ProbeContext | None = None
_lock = threading.Lock()


def context(
    *, installers: Sequence[Installer] = (base_tables,), cluster: ClusterFactory | None = None
) -> ProbeContext:
    """This process's context, created (not serving) on first use."""
    global _context
    with _lock:
        if _context is None:
            _context = ProbeContext(installers=installers, cluster=cluster)
        return _context


def current() -> ProbeContext | None:
    """This process's context while it serves, else None."""
    ctx = _context
    return ctx if ctx is not None and ctx.serving else None


def enable(
    *, installers: Sequence[Installer] = (base_tables,), cluster: ClusterFactory | None = None
) -> ProbeContext:
    """Serve this process's probe if it does not yet; return its context."""
    ctx = context(installers=installers, cluster=cluster)
    with _lock:
        if not ctx.serving:
            ctx.serve()
    return ctx


def disable() -> None:
    """Close the probe's socket; the context and its data stay."""
    ctx = _context
    if ctx is not None:
        with _lock:
            ctx.stop()


def _after_fork_in_child() -> None:
    """The child never inherits a half-working probe: it gets none, or its own
    (``PROBING_FORK=child``); see ``ProbeContext.after_fork``."""
    global _lock
    _lock = threading.Lock()  # a lock held by another thread at fork stays held
    ctx = _context
    if ctx is None:
        return
    try:
        ctx.after_fork()
    except Exception as err:  # a fork handler in the host's child: never break it
        log_unexpected(f"no probe in forked child {os.getpid()}", err)


os.register_at_fork(after_in_child=_after_fork_in_child)
