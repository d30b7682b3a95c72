"""Entry point of probing's own ``probing.pth`` hook: ``PROBING=1`` starts the
guest (``probing.guest.hook``), with this Python as the engine's.

Nothing here may raise into the interpreter that is starting up.
"""

from __future__ import annotations

import os
import sys


def guest_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "guest")


def boot() -> None:
    directory = guest_dir()
    ns: dict[str, object] = {"__name__": "_probing_hook"}
    try:
        path = os.path.join(directory, "hook.py")
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), ns)  # noqa: S102 - our own file
    except (OSError, SyntaxError) as err:
        print(f"probing: probe not started: {err}", file=sys.stderr)
        return
    ns["boot"](directory, sys.executable)  # type: ignore[operator]
