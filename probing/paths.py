"""Where a process's probe socket lives: one well-known path per pid.

``$PROBING_RUNTIME_DIR`` (default ``/tmp``) holds one ``probing-<uid>``
directory per user, mode 0700, with ``<pid>.sock`` sockets mode 0600 inside:
only the process's user (and root) can talk to its probe.

A pid's socket is looked for only in the directory of the uid that owns the
pid, and that directory is trusted only when it is a real directory (never
a symbolic link), owned by that uid, with mode 0700: another local user can
neither plant a socket for someone else's pid nor re-point the directory.
"""

from __future__ import annotations

import glob
import os
import re
import stat

from probing import config, proc
from probing.guest import place
from probing.guest.place import UnsafePath

_SOCK = re.compile(r"^(\d+)\.sock$")


def runtime_root() -> str:
    return config.load().runtime_dir


def user_dir(uid: int | None = None) -> str:
    return place.user_dir(uid, runtime_root())


def findings_log(uid: int | None = None) -> str:
    """``findings.jsonl``: every finding of this user's probes on this node,
    new and cleared, one JSON object a line (for Loki or Elastic, and a
    copy the job's own log cannot write over)."""
    return os.path.join(user_dir(uid), "findings.jsonl")


def socket_path(pid: int, uid: int | None = None) -> str:
    return os.path.join(user_dir(uid), f"{pid}.sock")


def pid_owner(pid: int) -> int | None:
    """The uid that owns process ``pid``, or None when there is no such process."""
    try:
        return os.stat(proc.path(pid)).st_uid
    except OSError:
        return None


def check_dir(directory: str, uid: int) -> None:
    """UnsafePath unless ``directory`` is a real directory of ``uid`` with mode 0700."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return  # nothing there: no socket either
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{directory} is a symbolic link, not the probe's directory")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{directory} is not a directory")
    if st.st_uid != uid:
        raise UnsafePath(f"{directory} belongs to uid {st.st_uid}, not to uid {uid}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise UnsafePath(f"{directory} has mode {stat.S_IMODE(st.st_mode):o}, not 700")


def check_socket(path: str, uid: int) -> bool:
    """True when ``path`` is a socket of ``uid``; False when absent; UnsafePath else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafePath(f"{path} is not a socket")
    if st.st_uid != uid:
        raise UnsafePath(f"{path} belongs to uid {st.st_uid}, not to uid {uid}")
    return True


class OtherUser(Exception):
    """``pid`` is another user's process: only that user (or root) may probe it."""

    def __init__(self, pid: int, uid: int) -> None:
        super().__init__(f"process {pid} belongs to {user_name(uid)}, not to {user_name()}")
        self.pid, self.uid = pid, uid


def user_name(uid: int | None = None) -> str:
    """``uid``'s name (this process's user by default), or ``uid N``."""
    import pwd

    uid = os.getuid() if uid is None else uid
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"


def mine(pid: int) -> bool:
    """Whether this user may probe ``pid``: its own process, or any as root."""
    return os.getuid() == 0 or pid_owner(pid) in (None, os.getuid())


def find_socket(pid: int) -> str | None:
    """The socket of ``pid``'s probe, in the directory of the uid that owns
    ``pid`` (ours when ``pid`` has exited: its engine may keep what it left),
    or None. UnsafePath when what is there could have been put there by
    someone else; OtherUser when ``pid`` is another user's and we are not root."""
    uid = pid_owner(pid)
    if uid is None:  # exited: the engine may still answer for it, in our own directory
        uid = os.getuid()
    if uid != os.getuid() and os.getuid() != 0:
        raise OtherUser(pid, uid)
    directory = user_dir(uid)
    check_dir(directory, uid)
    path = os.path.join(directory, f"{pid}.sock")
    return path if check_socket(path, uid) else None


def all_sockets() -> dict[int, str]:
    """pid -> socket path for every probe socket this user can see, each in
    the directory of its process's own user."""
    found: dict[int, str] = {}
    for path in glob.glob(os.path.join(runtime_root(), "probing-*", "*.sock")):
        m = _SOCK.match(os.path.basename(path))
        if not m:
            continue
        pid = int(m.group(1))
        uid = pid_owner(pid)
        if uid is None:  # exited: kept by the engine, in our own directory only
            uid = os.getuid()
        if os.path.dirname(path) != user_dir(uid):
            continue
        try:
            check_dir(os.path.dirname(path), uid)
            if check_socket(path, uid):
                found[pid] = path
        except UnsafePath:
            continue
    return found
