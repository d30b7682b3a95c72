"""``probing export``: a window of every rank's events as a Perfetto trace or Parquet.

report = export(Source(pids=[1234], cluster=True), "job.pftrace", fmt="perfetto")
print(report.summary())
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from probing.cli.export.source import Source
    from probing.cli.export.timeline import ExportReport

FORMATS = ("perfetto", "parquet")
_LAZY = {"Source": "probing.cli.export.source", "ExportReport": "probing.cli.export.timeline"}


def __getattr__(name: str) -> Any:
    """Source and ExportReport load on first use: pyarrow/perfetto cost 1/3 s,
    more than a command that needs neither should pay for importing this."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


def export(
    source: Source,
    path: str,
    *,
    fmt: str = "perfetto",
    window_s: float = 60.0,
    max_events: int | None = None,
) -> ExportReport:
    """Write the last ``window_s`` seconds of ``source`` to ``path`` (a file for
    perfetto, a directory for parquet); ``max_events`` keeps the newest events."""
    from probing.cli.export.window import ExportWindow
    from probing.errors import ProbingError

    win = ExportWindow(source, window_s=window_s, max_events=max_events)
    if fmt == "perfetto":
        from probing.cli.export.timeline import export_perfetto

        return export_perfetto(win, path)
    if fmt == "parquet":
        from probing.cli.export.tables import export_parquet

        return export_parquet(win, path)
    raise ProbingError(f"unknown export format {fmt!r}", hint="use perfetto or parquet")


__all__ = ["FORMATS", "ExportReport", "Source", "export"]
