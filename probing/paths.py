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

from probing import config

_SOCK = re.compile(r"^(\d+)\.sock$")


_FIX = " (remove it if it is not yours, or point PROBING_RUNTIME_DIR elsewhere)"


class UnsafePath(PermissionError):
    """A runtime directory or socket that another user could control."""


def runtime_root() -> str:
    return config.load().runtime_dir


def user_dir(uid: int | None = None) -> str:
    return os.path.join(runtime_root(), f"probing-{os.getuid() if uid is None else uid}")


def socket_path(pid: int, uid: int | None = None) -> str:
    return os.path.join(user_dir(uid), f"{pid}.sock")


def pid_owner(pid: int) -> int | None:
    """The uid that owns process ``pid``, or None when there is no such process."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def ensure_private_dir(directory: str) -> None:
    """Create ``directory`` mode 0700, or accept it only if it is a real
    directory of ours (its mode is then set to 0700); UnsafePath otherwise.

    Opened with ``O_NOFOLLOW``: a symbolic link there (one another user could
    re-point) is refused, never followed.
    """
    parent = os.path.dirname(directory.rstrip("/")) or "/"
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if os.path.islink(directory):
            raise UnsafePath(f"{directory} is a symbolic link: not followed{_FIX}") from err
        raise UnsafePath(f"{directory} is not a directory: {err.strerror}{_FIX}") from err
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise UnsafePath(f"{directory} belongs to uid {st.st_uid}, not to this user{_FIX}")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


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


def find_socket(pid: int) -> str | None:
    """The socket of ``pid``'s probe, in the directory of the uid that owns
    ``pid``, or None (no such process, or no probe). UnsafePath when what is
    there could have been put there by someone else."""
    uid = pid_owner(pid)
    if uid is None:
        return None
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
        if uid is None or os.path.dirname(path) != user_dir(uid):
            continue
        try:
            check_dir(os.path.dirname(path), uid)
            if check_socket(path, uid):
                found[pid] = path
        except UnsafePath:
            continue
    return found
