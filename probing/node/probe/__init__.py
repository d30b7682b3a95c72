"""The in-process runtime: the probe's context, HTTP server, endpoints.

Its names load on first use: a client that only needs the HTTP codec
(``probing.node.probe.http``) does not import the runtime with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from probing.node.probe.context import ProbeContext
    from probing.node.probe.runtime import context, current, disable, enable

__all__ = ["ProbeContext", "context", "current", "disable", "enable"]


def __getattr__(name: str) -> Any:
    if name == "ProbeContext":
        from probing.node.probe.context import ProbeContext

        return ProbeContext
    if name in __all__:
        from probing.node.probe import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'probing.node.probe' has no attribute {name!r}")
