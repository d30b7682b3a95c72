"""Where a user's probe sockets live (stdlib only: the guest uses it too).

``$PROBING_RUNTIME_DIR`` (default ``/tmp``) holds one ``probing-<uid>``
directory per user, mode 0700. In it: ``<pid>.sock``, the pid's probe (served
by the node's engine, ``probing.node.service``); ``<pid>.guest``, the guest inside
the pid; ``<pid>.trace``, what it traces (kept by the engine, for the next
one); ``engine-<key>.sock``, ``.lock``, ``.log`` and ``.stopped``, an
engine's own (one per install of probing and set of ``PROBING_*`` settings: ``engine_key``).
"""

from __future__ import annotations

import os
import stat

RUNTIME_DEFAULT = "/tmp"
VERSION = "0.1.0"  # probing's version (``probing.__version__``)
_FIX = " (remove it if it is not yours, or point PROBING_RUNTIME_DIR elsewhere)"


class UnsafePath(PermissionError):
    """A runtime directory or socket that another user could control."""


def runtime_root(environ: os._Environ[str] | dict[str, str] = os.environ) -> str:
    return environ.get("PROBING_RUNTIME_DIR") or RUNTIME_DEFAULT


def user_dir(uid: int | None = None, root: str | None = None) -> str:
    return os.path.join(root or runtime_root(), f"probing-{os.getuid() if uid is None else uid}")


def guest_path(pid: int, directory: str | None = None) -> str:
    return os.path.join(directory or user_dir(), f"{pid}.guest")


def trace_path(pid: int, directory: str | None = None) -> str:
    """``<pid>.trace``: what the pid traces, for the next engine (JSON)."""
    return os.path.join(directory or user_dir(), f"{pid}.trace")


# settings that differ between the ranks of one job: they reach the engine
# through each process's own environment (probing.target), not the engine's
PER_PROCESS = ("PROBING", "PROBING_RANK", "PROBING_FORK")
# the engine's allocators: a daemon that serves hundreds of jobs from many
# threads, for hours. glibc's arenas (one a thread, up to 8 a core) keep what
# each job freed; mimalloc's (Arrow's and DataFusion's) keep the pages they
# freed and their arenas committed: let go at once, a 4-rank trace's engine
# held 42 MB more after 25 min than in its first 5, not 111, and 60 MB less
# all along (``engine_hour.py --engine-env``, docs/measurements.md, issue 52)
ENGINE_ALLOCATOR = {
    "MALLOC_ARENA_MAX": "2",
    "MIMALLOC_PURGE_DELAY": "0",
    "MIMALLOC_ARENA_EAGER_COMMIT": "0",
}


def engine_settings(environ: dict[str, str]) -> dict[str, str]:
    """What an engine runs with, from a host's environment: the ``PROBING_*``
    settings, and the variables ``PROBING_ENGINE_ENV`` names (a stand-in NVML's
    ``LD_LIBRARY_PATH``, say)."""
    extra = {n.strip() for n in environ.get("PROBING_ENGINE_ENV", "").split(",") if n.strip()}
    return {
        k: v
        for k, v in environ.items()
        if (k.startswith("PROBING_") and k not in PER_PROCESS) or k in extra
    }


def install(environ: dict[str, str] | None = None, python: str | None = None) -> str:
    """This install of probing, as guests, engines and clients state it at
    their handshakes: ``<version>@<environment>``, the environment being the
    one of probing's own Python (``python``; this interpreter by default),
    which runs the engine. Two venvs or two versions of probing on one node
    are two installs, each with its own engine (a guest copied into a job's
    environment by ``probing hook`` names its probing's Python).
    ``PROBING_VERSION_OVERRIDE`` states another version (tests)."""
    import sys

    env = os.environ if environ is None else environ
    version = env.get("PROBING_VERSION_OVERRIDE") or VERSION
    where = os.path.dirname(os.path.dirname(os.path.abspath(python or sys.executable)))
    return f"{version}@{where}"


def engine_key(environ: dict[str, str], python: str | None = None) -> str:
    """The name of the engine for a host with this environment and probing's
    Python (``install``): the ranks of a job share one (same install, same
    settings), a process set up otherwise, or with another install of
    probing, gets its own."""
    import hashlib

    text = "\n".join(f"{k}={v}" for k, v in sorted(engine_settings(environ).items()))
    text += f"\ninstall={install(environ, python)}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def engine_path(directory: str | None = None, key: str = "", suffix: str = "sock") -> str:
    """``engine-<key>.sock`` (or ``.lock``, ``.log``, ``.start``) in ``directory``."""
    return os.path.join(directory or user_dir(), f"engine-{key}.{suffix}")


def engine_pid(directory: str, key: str) -> int:
    """The pid the engine of ``key`` wrote in its lock file (0: none)."""
    try:
        with open(engine_path(directory, key, "lock")) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def is_engine(pid: int) -> bool:
    """Whether ``pid`` runs probing's engine (``python -m probing.node.service``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return False
    return b"probing.node.service" in args[:4]


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
