"""The node's findings, as the agent sees them: every user's ``findings.jsonl`` followed.

Each job's detector writes each new or cleared finding as one line of its
user's ``findings.jsonl`` (``probing.analyze.findings.log_findings``, in the
engine); the agent reads what each file gained since its last look
(``Feed.poll``), which costs it a ``stat`` and a ``read`` a file and never
a question to a probe. From those lines it knows the findings active now
(``Feed.active``), for ``/metrics``, and what is new, for the webhook.

A file the agent finds at its start is read from its end (what it holds was
said before the agent came: only the findings still active are taken from
its last ``REPLAY_BYTES``); one that appears later is read from its start.
A line whose ``pid`` is a live process of another user than the file's is
not believed: a user can write to their own file only.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

from probing import paths

REPLAY_BYTES = 4 << 20  # what is read back of a file found at the start
READ_BYTES = 4 << 20  # what is read of a file in one look at most (the rest: the next look)


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


class Feed:
    """What every user's findings log on this node gained, and what is active."""

    def __init__(self) -> None:
        self._files: dict[str, _Followed] = {}
        self._active: dict[Key, dict[str, Any]] = {}
        self._started = False

    def poll(self) -> list[dict[str, Any]]:
        """The findings logged since the last look, new and cleared, in order."""
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
        return out

    def active(self) -> list[dict[str, Any]]:
        """The findings active now whose detector's process lives."""
        for key in [k for k, row in self._active.items() if not _alive(row.get("pid"))]:
            del self._active[key]
        return list(self._active.values())

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
                self._active[_key(row)] = row
            else:
                self._active.pop(_key(row), None)
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


def _alive(pid: Any) -> bool:
    return isinstance(pid, int) and paths.pid_owner(pid) is not None
