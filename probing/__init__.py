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

from probing.config import VERSION as __version__
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

if TYPE_CHECKING:
    from probing.engine import Engine
    from probing.probe.context import ProbeContext
    from probing.tables.external import ExternalTable  # noqa: F401


# -- what the layers above the probe add to it: probing.enable() is where the
# probe (probing.probe) meets the analyze tables and the cluster node, which
# it never imports itself


def install_tables(engine: Engine, ctx: ProbeContext | None = None) -> None:
    """Every table of a probe: the base tables, then ``analyze.*`` (which read
    ``comm.collectives``). ``probing.analyze`` is imported at the first query
    that names the schema ``analyze`` or lists tables, not with the engine."""
    from probing.tables import install

    install(engine, ctx)
    engine.defer("analyze", lambda: _install_analyze(engine, ctx))


def _install_analyze(engine: Engine, ctx: ProbeContext | None) -> None:
    from probing import analyze
    from probing.analyze import watch

    analyze.install(engine)

    def findings() -> Any:
        detector = getattr(ctx.cluster, "watch", None) if ctx is not None else None
        return detector.table() if detector is not None else watch.empty()

    engine.register_table("analyze", "findings", findings)


def cluster_node(ctx: ProbeContext) -> Any:
    """The cluster node of a process: a rank of a multi-process job, a
    process given ``PROBING_PEERS``, or one that may become a rank once it
    calls ``init_process_group`` (Lightning, ``mp.spawn``: the node waits
    for it); None with ``PROBING_CLUSTER=off``. Its TCP port and
    publication start in the background."""
    from probing import config
    from probing.cluster import identity

    environ = ctx.target.environ()
    if config.from_env(environ).cluster_off:
        return None
    from probing.cluster.node import ClusterNode

    ident = identity.from_env(environ)
    node = ClusterNode(ident, lambda: ctx.engine, pid=ctx.pid, learn=ctx.target.distributed)
    node.detector = lambda: _detector(ctx, node)  # made at the first trace (POST /trace/start)
    return node


def _detector(ctx: ProbeContext, node: Any) -> Any:
    """The always-on detector of ``ctx`` (``probing.analyze.watch``)."""
    from probing.analyze.watch import Watch

    def tracing() -> bool:
        tracer = ctx.tracer
        return tracer is not None and tracer.status().get("state") == "tracing"

    def dropped() -> dict[str, int]:
        tracer = ctx.tracer
        families = tracer.status().get("families", {}) if tracer is not None else {}
        return {f: int(v.get("dropped") or 0) for f, v in families.items()}

    return Watch(node, tracing, dropped)


def context() -> ProbeContext:
    """This process's probe context (created on first use, not serving)."""
    from probing.probe import runtime

    return runtime.context(installers=(install_tables,), cluster=cluster_node)


def enable() -> ProbeContext:
    """Start the probe in this process (idempotent); returns its context."""
    from probing.probe import runtime

    return runtime.enable(installers=(install_tables,), cluster=cluster_node)


def disable() -> None:
    """Stop this process's probe, if any. Data already stored stays."""
    from probing.probe import runtime

    runtime.disable()


def query(sql: str) -> Any:
    """Run read-only SQL in this process's engine; returns a ``pyarrow.Table``."""
    return context().engine.sql(sql)


def __getattr__(name: str) -> Any:
    if name == "ExternalTable":
        guest = sys.modules.get("_probing_guest")
        if guest is not None and guest.current() is not None:
            # this process's probe is its guest: rows go to the engine through it
            return guest.outbox.Table  # noqa: F821 - loaded with the guest
        from probing.tables import external

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
