"""The node's findings, as the agent sees them: every user's ``findings.jsonl`` followed.

Each job's detector writes each new or cleared finding as one line of its
user's ``findings.jsonl`` (``probing.node.detector.book.log_findings``, in the
engine); the agent reads what each file gained since its last look
(``Feed.poll``), which costs it a ``stat`` and a ``read`` a file and never
a question to a probe. From those lines it knows the findings active now
(``Feed.active``), for ``/metrics``, and what is new, for the webhook.

A file the agent finds at its start is read from its end (what it holds was
said before the agent came: only the findings still active are taken from
its last ``REPLAY_BYTES``); one that appears later is read from its start.
A line whose ``pid`` is a live process of another user than the file's is
not believed: a user can write to their own file only.

A finding ends with its job. Each line names the detector's process that
wrote it (``pid``, and ``pid_started``: its start, so that a later process
given the same pid is not taken for it; a line without it, of an older
probe, is taken for a process that started before the finding). A finding
whose detector's process is gone (exited, killed, a zombie) can be cleared
by no one else, so the feed clears it at its next look: it appends the
``cleared`` line itself (``cleared_ns`` now, ``reason``: ``job gone``, or
what ``reason`` says), says it as news (the webhook), and ``active`` never
counts it, nor one read back at the start whose process is gone already
(an agent started after the job died never serves it). A cleared line of a
finding that is not active (one already cleared, the feed's own line read
back) is no news.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import stat
import time
from collections.abc import Callable
from typing import Any

import psutil

from probing import paths, proc

REPLAY_BYTES = 4 << 20  # what is read back of a file found at the start
READ_BYTES = 4 << 20  # what is read of a file in one look at most (the rest: the next look)
# an older line (no pid_started): its pid is another process where that one
# started this long after the finding (a process's start is known to 1 s)
STARTED_SLACK_S = 1.0
JOB_GONE = "job gone"


@dataclasses.dataclass
class _Followed:
    uid: int
    offset: int
    partial: bytes = b""
    inode: int = 0


Key = tuple[Any, ...]


def _key(row: dict[str, Any]) -> Key:
    """One finding's identity: its new line and its cleared line share it."""
    return (row.get("pid"), row.get("ts"), row.get("kind"), row.get("rank"), row.get("comm"))


@dataclasses.dataclass
class _Active:
    row: dict[str, Any]
    path: str  # the log it came from (its cleared line goes there)
    uid: int  # that log's owner


class Feed:
    """What every user's findings log on this node gained, and what is active.
    ``clock``: wall ns (a cleared line's ``cleared_ns``)."""

    def __init__(self, clock: Callable[[], int] = time.time_ns) -> None:
        self._files: dict[str, _Followed] = {}
        self._active: dict[Key, _Active] = {}
        self._started = False
        self._clock = clock

    def poll(
        self, reason: Callable[[dict[str, Any]], str | None] | None = None
    ) -> list[dict[str, Any]]:
        """The findings logged since the last look, new and cleared, in order;
        then those it cleared itself, their process gone (``reason``: why, for
        a row, None to decide at a later look; ``JOB_GONE`` without it)."""
        pattern = os.path.join(paths.runtime_root(), "probing-*", "findings.jsonl")
        first, self._started = not self._started, True
        out: list[dict[str, Any]] = []
        for path in sorted(glob.glob(pattern)):
            followed = self._files.get(path)
            if followed is None:
                uid = _owner(path)
                if uid is None:
                    continue
                followed = _Followed(uid, 0)
                self._files[path] = followed
                if first:  # said before the agent came: what is still active, not news
                    self._lines(path, followed, replay=True)
                    continue
            out += self._lines(path, followed, replay=False)
        for path in [p for p in self._files if not os.path.exists(p)]:
            del self._files[path]
        return out + self._end_gone(reason)

    def active(self) -> list[dict[str, Any]]:
        """The findings active now whose detector's process lives (one whose
        process is gone waits for the next ``poll`` to be cleared, unserved)."""
        return [a.row for a in self._active.values() if _alive(a.row)]

    def _end_gone(
        self, reason: Callable[[dict[str, Any]], str | None] | None
    ) -> list[dict[str, Any]]:
        """Clear each active finding whose detector's process is gone: its
        ``cleared`` line appended to its log, and returned."""
        out = []
        for key, active in list(self._active.items()):
            if _alive(active.row):
                continue
            why = reason(active.row) if reason is not None else JOB_GONE
            if why is None:
                continue
            del self._active[key]
            row = {k: v for k, v in active.row.items() if k != "state"}
            row.update(cleared_ns=self._clock(), reason=why)
            _append(active.path, active.uid, json.dumps(row, default=str) + "\n")
            out.append({**row, "state": "cleared"})
        return out

    def _lines(self, path: str, followed: _Followed, replay: bool) -> list[dict[str, Any]]:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                size = st.st_size
                if size < followed.offset or st.st_ino != followed.inode:  # truncated, replaced
                    followed.offset, followed.partial, followed.inode = 0, b"", st.st_ino
                if replay and size > REPLAY_BYTES:
                    followed.offset = size - REPLAY_BYTES
                f.seek(followed.offset)
                data = f.read(READ_BYTES)
        except OSError:
            return []
        followed.offset += len(data)
        data = followed.partial + data
        *lines, followed.partial = data.split(b"\n")
        if replay and size > REPLAY_BYTES and lines:
            lines = lines[1:]  # the first was cut
        out = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict) or not _believed(row, followed.uid):
                continue
            row["state"] = "new" if row.get("cleared_ns") is None else "cleared"
            if row["state"] == "new":
                self._active[_key(row)] = _Active(row, path, followed.uid)
            elif self._active.pop(_key(row), None) is None:
                continue  # cleared already (by the feed: its own line read back)
            out.append(row)
        return out


def _owner(path: str) -> int | None:
    """The uid of a findings log's directory, when that directory is safe."""
    directory = os.path.dirname(path)
    try:
        uid = os.lstat(directory).st_uid
        paths.check_dir(directory, uid)
    except (OSError, paths.UnsafePath):
        return None
    return uid


def _believed(row: dict[str, Any], uid: int) -> bool:
    pid = row.get("pid")
    if not isinstance(pid, int):
        return False
    owner = paths.pid_owner(pid)
    return owner is None or owner == uid or uid == 0


def _alive(row: dict[str, Any]) -> bool:
    """Whether the process that wrote ``row`` lives: its pid runs, is no
    zombie, and is the same process (``pid_started``; without it, one that
    started before the finding)."""
    pid, started = row.get("pid"), row.get("pid_started")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        fields = proc.stat(pid)
        state, ticks = fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return False
    if state in ("Z", "X"):
        return False
    if isinstance(started, int):
        return ticks == started
    ts = row.get("ts")
    try:
        began = psutil.Process(pid).create_time()
    except psutil.Error:
        return False
    return not (isinstance(ts, int) and ts > 0 and began > ts / 1e9 + STARTED_SLACK_S)


def _append(path: str, uid: int, line: str) -> bool:
    """``line`` appended to the findings log ``path`` of ``uid``, one write;
    False where it cannot be (not ours to write, gone, not a regular file
    of ``uid`` in a directory of ``uid``: nothing followed through a link)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        dirfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        st = os.fstat(dirfd)
        if st.st_uid != uid or st.st_mode & 0o077:
            return False
        fd = os.open(os.path.basename(path), flags, dir_fd=dirfd)
    except OSError:
        return False
    finally:
        os.close(dirfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return False
        os.write(fd, line.encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
