"""Entry point of probing's own ``probing.pth`` hook: ``PROBING=1`` starts the
guest (``probing.guest.hook``), with this Python as the engine's.

Nothing here may raise into the interpreter that is starting up.
"""

from __future__ import annotations

import os
import sys
from typing import Any

GUEST = "_probing_guest"  # the name probing.guest.hook loads the guest under


def guest_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "guest")


def hook() -> dict[str, Any]:
    """``probing.guest.hook``, run from its file (as every ``.pth`` hook runs it)."""
    path = os.path.join(guest_dir(), "hook.py")
    ns: dict[str, Any] = {"__name__": "_probing_hook"}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), ns)  # our own file
    return ns


def boot() -> None:
    """``PROBING=1``: start the guest unless it is off. Never raises."""
    try:
        ns = hook()
    except (OSError, SyntaxError) as err:
        print(f"probing: probe not started: {err}", file=sys.stderr)
        return
    ns["boot"](guest_dir(), sys.executable)


def guest() -> Any:
    """This process's guest package (``_probing_guest``), loaded from its
    files once: the hook's file is read only while it is not loaded."""
    return sys.modules.get(GUEST) or hook()["load"](guest_dir())


def start(wait: bool = True) -> Any:
    """The guest of this process, serving and handed to the engine."""
    return guest().start(sys.executable, wait=wait)
