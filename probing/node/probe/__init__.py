"""A probe of the engine: one served process's context, HTTP server, endpoints.

Its names load on first use: a client that only needs the HTTP codec
(``probing.node.probe.http``) does not import the context with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from probing.node.probe.context import ProbeContext

__all__ = ["ProbeContext"]


def __getattr__(name: str) -> Any:
    if name == "ProbeContext":
        from probing.node.probe.context import ProbeContext

        return ProbeContext
    raise AttributeError(f"module 'probing.node.probe' has no attribute {name!r}")
