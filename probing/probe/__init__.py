"""The in-process runtime: the probe's context, HTTP server, endpoints."""

from probing.probe.context import ProbeContext
from probing.probe.runtime import context, current, disable, enable

__all__ = ["ProbeContext", "context", "current", "disable", "enable"]
