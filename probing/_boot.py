"""Entry point of the ``probing.pth`` hook: ``PROBING=1`` starts the probe.

Nothing here may raise into the interpreter that is starting up.
"""

from __future__ import annotations

import os
import sys


def wanted(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    from probing.config import from_env

    return from_env(environ).probing


def boot() -> None:
    if not wanted():
        return
    try:
        import probing

        probing.enable()
    except Exception as err:  # never break the host's start-up
        print(f"probing: probe not started: {err}", file=sys.stderr)
