"""The in-process runtime: lifecycle, HTTP server, endpoints."""

from probing.probe.runtime import Probe, current, disable, enable

__all__ = ["Probe", "current", "disable", "enable"]
