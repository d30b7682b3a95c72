"""``probing mcp``: probing's tools for AI agents, over the Model Context Protocol.

serve(Options(http=True, port=8765))

The server (``server``: tools, resources, prompt, on the official SDK) asks
the probes as the CLI does (``tools``), reads the SQL reference from
docs/sql.md (``reference``), gates and logs what changes a target
(``control``), and is reached over stdio or streamable HTTP (``transport``).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from probing.errors import ProbingError


@dataclass(frozen=True)
class Options:
    """How ``probing mcp`` serves: the command's options."""

    http: bool = False
    host: str = "127.0.0.1"
    port: int = 8765
    token: str | None = None
    out_dir: str | None = None
    allow_control: bool = False


def out_directory(given: str | None) -> Path:
    """The directory the server writes under (traces, the audit log): ``given``
    (made private when it is created here), else a fresh private temp directory."""
    if given is None:
        return Path(tempfile.mkdtemp(prefix="probing-mcp-")).resolve()
    path = Path(given).expanduser().resolve()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise ProbingError(
            f"cannot use --out-dir {given}: {err.strerror or err}",
            hint="give a directory you can write to, or leave --out-dir out (a private temp dir)",
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ProbingError(f"cannot write in --out-dir {path}", hint="give one you can write to")
    return path


def serve(options: Options) -> None:
    """Build the server and serve it over stdio or HTTP until the client goes
    (stdio) or Ctrl-C (HTTP)."""
    from probing.cli.mcp import transport
    from probing.cli.mcp.server import build
    from probing.cli.mcp.tools import note

    if options.http:  # refused before anything is built or written
        transport.check_binding(options.host, options.token)
    out_dir = out_directory(options.out_dir)
    server = build(out_dir, allow_control=options.allow_control)
    if options.allow_control:
        control = f"control tools on, each call logged to {out_dir / 'audit.jsonl'}"
    else:
        control = "control tools off (--allow-control turns them on)"
    note(f"writing under {out_dir}; {control}")
    if not options.http:
        transport.serve_stdio(server)
        return
    try:
        transport.serve_http(server, options.host, options.port, options.token, note)
    except KeyboardInterrupt:
        pass
