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
    except Exception as err:  # noqa: BLE001 - never break the host's start-up
        from probing.errors import ProbingError, log_unexpected

        if isinstance(err, ProbingError | OSError):  # said in one line
            print(f"probing: probe not started: {err}", file=sys.stderr)
        else:  # a bug of ours: its traceback, so it is seen
            log_unexpected("probe not started", err)
