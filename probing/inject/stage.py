"""A target in another mount namespace: what it loads, staged where it sees it.

A containerised agent (the Kubernetes DaemonSet: ``hostPID``, its own root
filesystem) sees the node's jobs, but a job cannot see the agent's files:
the injection library and the guest are at paths of the image
(``/opt/probing/...``) that the job's ``dlopen`` and ``open`` resolve in
the job's own mount namespace. When the target's mount namespace is not
ours (``/proc/<pid>/ns/mnt``), the injector:

1. checks that the target's runtime root (its ``PROBING_RUNTIME_DIR``, else
   ``/tmp``) is the very directory ours is: the engine's socket and the
   probe sockets live there, so the job (its guest) and the engine (here)
   both reach them (the DaemonSet mounts the node's ``/tmp``);
2. stages the library and the guest (standard library only) once per
   install in ``<runtime root>/probing-stage-<key>/``, written through
   ``/proc/<pid>/root`` (so it is the target's own file system, whatever it
   is): root-owned, mode 0755, files 0644/0755, ``key`` the hash of what
   is staged; a stage of another key that no process maps any more is
   removed when a new one is made (a node's stages: one per install in use,
   never one per job). The guest is still loaded from its files under one
   private name (``hook.load``), never through ``sys.path``;
3. starts the engine here (``python -m probing.node.service --daemon``, as
   the target's user, with the target's ``PROBING_*`` settings: the engine
   its guest looks for), and tells the guest never to start one itself
   (probing's Python is a path the job cannot run).

The engine then reads the job's memory through ``/proc`` (``hostPID``) and
attaches its uprobes to the job's libraries through ``/proc/<pid>/root``
(``probing.elf.host_path``).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from typing import Any, NamedTuple

from probing import proc
from probing.errors import AttachError, NoSuchProcess
from probing.guest import place, wire
from probing.guest.life import KEEP_ENV

PREFIX = "probing-stage-"
ENGINE_SPAWN_S = 30.0  # the engine's parent forks its daemon and exits at once


class Elsewhere(NamedTuple):
    """A target in another mount namespace, and its runtime root (the same
    directory here and there: ``shared_root``)."""

    pid: int
    uid: int
    gid: int
    root: str  # the target's runtime root, as it names it (and we do)

    def here(self, path: str) -> str:
        """``path`` of the target's file system, from here."""
        return proc.path(self.pid, "root") + path


class Staged(NamedTuple):
    lib: str  # the library, as the target names it
    lib_here: str  # the same file, from here (its symbols are read here)
    guest: str  # the guest's directory, as the target names it


def _mount_ns(pid: int | str) -> str:
    return os.readlink(proc.path(pid, "ns/mnt"))


def elsewhere(pid: int, uid: int, environ: dict[str, str]) -> Elsewhere | None:
    """The target, where its mount namespace is not ours; None where it is."""
    try:
        if _mount_ns(pid) == _mount_ns("self"):
            return None
        gid = int(proc.status(pid).get("Gid", "0").split()[0])
    except (FileNotFoundError, ProcessLookupError):
        raise NoSuchProcess(f"process {pid} has exited", pid=pid) from None
    target = Elsewhere(pid, uid, gid, place.runtime_root(environ))
    shared_root(target)
    return target


def shared_root(target: Elsewhere) -> None:
    """The target's runtime root must be ours: AttachError where it is not."""
    try:
        mine, theirs = os.stat(target.root), os.stat(target.here(target.root))
    except OSError as err:
        raise AttachError(
            f"process {target.pid}'s runtime directory {target.root} cannot be read "
            f"from here: {err.strerror}",
            pid=target.pid,
            hint="mount the node's /tmp into probing's container (-v /tmp:/tmp; "
            "the DaemonSet's hostPath), or set PROBING_RUNTIME_DIR for both",
        ) from None
    if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
        raise AttachError(
            f"process {target.pid} runs in another mount namespace whose {target.root} "
            "is not this one's: its probe could not reach the engine's socket",
            pid=target.pid,
            hint="mount the node's /tmp into probing's container (-v /tmp:/tmp; "
            "the DaemonSet's hostPath), or set PROBING_RUNTIME_DIR for both",
        )


# --- the stage --------------------------------------------------------------------------


def _files(lib: str, guest: str) -> list[tuple[str, str]]:
    """(name in the stage, file here): the library, then the guest's sources."""
    out = [(os.path.basename(lib), lib)]
    out += [
        (os.path.join("guest", name), os.path.join(guest, name))
        for name in sorted(os.listdir(guest))
        if name.endswith(".py")
    ]
    return out


def key_of(files: list[tuple[str, str]]) -> str:
    """What is staged, hashed: one stage per install's contents."""
    digest = hashlib.sha256()
    for name, path in files:
        with open(path, "rb") as f:
            digest.update(name.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()[:12]


def _trusted(path: str, ours: bool) -> bool:
    """A real directory no other user can write to (``ours``: and ours)."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return False
    if ours:
        return st.st_uid == os.geteuid() and not st.st_mode & 0o022
    return True


def stage(target: Elsewhere, lib: str, guest: str) -> Staged:
    """The library and the guest staged in the target's runtime root (made
    once per contents: ``<root>/probing-stage-<key>``)."""
    files = _files(lib, guest)
    there = os.path.join(target.root, PREFIX + key_of(files))
    here = target.here(there)
    if not os.path.isdir(here):
        _make(target, here, files)
    if not _trusted(here, ours=True):
        raise AttachError(
            f"{there} is not a directory of this user's that others cannot write to",
            pid=target.pid,
            hint=f"remove {there} (probing makes it again), then retry",
        )
    name = os.path.basename(lib)
    return Staged(os.path.join(there, name), os.path.join(here, name), os.path.join(there, "guest"))


def _make(target: Elsewhere, here: str, files: list[tuple[str, str]]) -> None:
    """Write the stage beside its place, then rename it there (atomic: the
    first of two injectors wins, the other's copy goes); older stages that
    no process maps any more go."""
    parent = os.path.dirname(here)
    tmp = tempfile.mkdtemp(prefix=".probing-staging-", dir=parent)
    try:
        os.mkdir(os.path.join(tmp, "guest"), 0o755)
        for name, path in files:
            shutil.copyfile(path, os.path.join(tmp, name))
            os.chmod(os.path.join(tmp, name), 0o755 if name.endswith(".so") else 0o644)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, here)
        except OSError:  # made meanwhile by another injector
            if not os.path.isdir(here):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune(parent, keep=os.path.basename(here))


def prune(parent: str, keep: str) -> list[str]:
    """Remove this user's stages in ``parent`` other than ``keep`` that no
    process maps (their library dlopened stays mapped for the process's
    life); what was removed."""
    others = [
        p
        for p in glob.glob(os.path.join(parent, PREFIX + "*"))
        if os.path.basename(p) != keep and _trusted(p, ours=True)
    ]
    if not others:
        return []
    mapped = _mapped_names()
    gone = []
    for path in others:
        if os.path.basename(path) not in mapped:
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


def _mapped_names() -> set[str]:
    """The stage directories' names some process of the node maps a file of."""
    names = set()
    for maps in glob.glob(proc.path("[0-9]*", "maps")):
        with contextlib.suppress(OSError):
            with open(maps) as f:
                text = f.read()
            at = text.find(PREFIX)
            while at >= 0:
                names.add(text[at : at + len(PREFIX) + 12])
                at = text.find(PREFIX, at + 1)
    return names


# --- the engine -------------------------------------------------------------------------


def engine_env(environ: dict[str, str]) -> dict[str, str]:
    """The engine's environment: ours for where things are, the target's
    ``PROBING_*`` settings (those its guest hashes into the engine's key)."""
    env = {k: v for k, v in os.environ.items() if k in KEEP_ENV}
    env.update(place.ENGINE_ALLOCATOR)  # as the guest starts it (guest.life)
    env.update(place.engine_settings(environ))
    return env


def start_engine(target: Elsewhere, environ: dict[str, str]) -> str:
    """The engine the target's guest looks for, started here by probing's
    own Python (as the target's user) unless it answers; its socket."""
    directory = place.user_dir(target.uid, root=target.root)
    key = place.engine_key(environ)  # this Python's: the engine's, and the guest's (it is told)
    sock = place.engine_path(directory, key)
    with contextlib.suppress(wire.WireError):
        wire.request(sock, "GET", "/health", None, timeout=5.0)
        return sock
    user: dict[str, Any] = {}
    if target.uid != os.geteuid():
        user = {"user": target.uid, "group": target.gid, "extra_groups": []}
    with tempfile.TemporaryFile("w+") as err:  # not a pipe: the daemon it forks keeps none
        done = subprocess.run(
            [sys.executable, "-m", "probing.node.service", "--daemon"],
            env=engine_env(environ), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=err, timeout=ENGINE_SPAWN_S, check=False, **user,
        )  # fmt: skip
        err.seek(0)
        said = err.read().strip()
    if done.returncode != 0:
        raise AttachError(
            f"the engine for process {target.pid} did not start (exit {done.returncode}): "
            f"{said[-300:] or 'nothing said'}",
            pid=target.pid,
            hint=f"its log: {place.engine_path(directory, key, 'log')}",
        )
    return sock
