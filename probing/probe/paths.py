"""Where a process's probe socket lives: one well-known path per pid.

``$PROBING_RUNTIME_DIR`` (default ``/tmp``) holds one ``probing-<uid>``
directory per user, mode 0700, with ``<pid>.sock`` sockets mode 0600 inside:
only the process's user (and root) can talk to its probe.
"""

from __future__ import annotations

import glob
import os
import re

_SOCK = re.compile(r"^(\d+)\.sock$")


def runtime_root() -> str:
    return os.environ.get("PROBING_RUNTIME_DIR") or "/tmp"


def user_dir(uid: int | None = None) -> str:
    return os.path.join(runtime_root(), f"probing-{os.getuid() if uid is None else uid}")


def socket_path(pid: int, uid: int | None = None) -> str:
    return os.path.join(user_dir(uid), f"{pid}.sock")


def find_socket(pid: int) -> str | None:
    """The socket of ``pid``'s probe, whichever user runs it, or None."""
    for path in glob.glob(os.path.join(runtime_root(), "probing-*", f"{pid}.sock")):
        return path
    return None


def all_sockets() -> dict[int, str]:
    """pid -> socket path for every probe socket this user can see."""
    found: dict[int, str] = {}
    for path in glob.glob(os.path.join(runtime_root(), "probing-*", "*.sock")):
        m = _SOCK.match(os.path.basename(path))
        if m:
            found[int(m.group(1))] = path
    return found
