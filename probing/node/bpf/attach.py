"""Uprobes on the libraries a traced process maps.

``Uprobes.attach_new`` is handed the process's maps (``/proc/PID/maps``:
by path, never by library name) and the families loaded. A mapped file
whose name a family matches (``Family.libraries``) is attached once, by
inode: the family's functions found among its exported symbols (by name,
or by demangled name for C++), each at its file offset, an entry probe
and, where the family has one, a return probe. Every uprobe tried is a
``UprobeAttempt``, attached or with why not: the ``probing.uprobes`` table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import pyarrow as pa

from probing import elf, proc
from probing.node.bpf import families as fam
from probing.node.bpf.loader import Uprobe
from probing.node.bpf.symbols import (
    ELF_ERRORS,
    exported,
    exported_matching,
    file_offsets,
)
from probing.proc import Mapping, parse_maps
from probing.schema import schema_of, table_of

if TYPE_CHECKING:
    from probing.node.bpf.drain import Live


@dataclasses.dataclass
class UprobeAttempt:
    """One uprobe (entry or return) as attached, or why not."""

    family: str
    library: str
    symbol: str
    kind: str  # "entry" | "return"
    attached: bool
    error: str | None = None


PROBES_SCHEMA = schema_of(UprobeAttempt)  # trace.probes


# What ``symbols`` found, per family and file (by its identity: a library
# replaced on disk is read again). The ranks of a job map the same libraries,
# and an engine traces them all: libtorch is read once, not once a rank, and
# ranks asking at once wait for the one reading it. An engine keeps what it
# found on disk too (``keep_symbols_in``): the engine that follows a killed one
# re-traces every rank without reading libtorch again (a third of its CPU).
KEEP_SYMBOLS = 64
Key = tuple[str, int, int, int, int]
_found: OrderedDict[Key, dict[str, tuple[str, int]]] = OrderedDict()
_found_lock = threading.Lock()
_reading: dict[Key, threading.Lock] = {}
_kept = {"dir": "", "salt": ""}  # where found symbols are kept, and for which install


def keep_symbols_in(directory: str, salt: str) -> None:
    """Keep found symbols in ``directory`` (private to the user), for the
    engines of the install ``salt`` (another version may look for others)."""
    _kept.update(dir=directory, salt=salt)


def _said(error: str) -> str:
    """An attempt's error in one line: its first, without the errno, and
    where the verifier refused a handler, its reason (the log's last line
    before its count)."""
    first, *log = error.strip().splitlines() or [""]
    first = re.sub(r"^\[Errno \d+\] ", "", first)
    counts = ("processed ", "verification time", "stack depth")
    why = [line for line in log if line.strip() and not line.startswith(counts)]
    return f"{first}: {why[-1].strip()}" if why else first


def symbols(f: fam.Family, path: str) -> dict[str, tuple[str, int]]:
    """Func.enum -> (the symbol to attach to in ``path``, its file offset)."""
    st = os.stat(path)
    key = (f.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _found_lock:
        got = _found.get(key)
        if got is not None:
            _found.move_to_end(key)
            return got
        reading = _reading.setdefault(key, threading.Lock())
    with reading:  # one reads a file; the ranks asking meanwhile wait for what it found
        try:
            with _found_lock:
                got = _found.get(key)
            if got is None:
                got = _from_disk(key)
                if got is None:
                    got = _symbols(f, path)
                    _to_disk(key, got)
                with _found_lock:
                    _found[key] = got
                    while len(_found) > KEEP_SYMBOLS:
                        _found.popitem(last=False)
        finally:
            with _found_lock:
                if _reading.get(key) is reading:
                    del _reading[key]
    return got


def _kept_path(key: Key) -> str | None:
    if not _kept["dir"]:
        return None
    digest = hashlib.sha256(repr((_kept["salt"], *key)).encode()).hexdigest()[:32]
    return os.path.join(_kept["dir"], f"{key[0]}-{digest}.json")


def _from_disk(key: Key) -> dict[str, tuple[str, int]] | None:
    path = _kept_path(key)
    if path is None:
        return None
    try:
        with open(path) as fh:
            got = json.load(fh)
        os.utime(path)  # the least recently used go first (_to_disk)
        return {str(e): (str(sym), int(off)) for e, (sym, off) in got.items()}
    except (OSError, ValueError, TypeError, AttributeError):  # none, or not ours: read the file
        return None


def _to_disk(key: Key, found: dict[str, tuple[str, int]]) -> None:
    path = _kept_path(key)
    if path is None:
        return
    try:
        os.makedirs(_kept["dir"], mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            json.dump(found, fh)
        os.replace(tmp, path)
        kept = sorted(os.scandir(_kept["dir"]), key=lambda e: e.stat().st_mtime_ns)
        for old in kept[:-KEEP_SYMBOLS]:
            os.unlink(old.path)
    except OSError:  # a full or read-only disk: the next engine reads the file again
        pass


def _symbols(f: fam.Family, path: str) -> dict[str, tuple[str, int]]:
    if f.demangled is not None:
        found = exported_matching(path, f.mangled_prefix, f.demangled)
    else:
        names = exported(path, [s for fn in f.funcs for s in fn.symbols])
        found = {}
        for fn in f.funcs:
            sym = next((s for s in fn.symbols if s in names), None)
            if sym is not None:
                found[fn.enum] = (sym, names[sym])
    offsets = file_offsets(path, [addr for _, addr in found.values()])
    return {e: (sym, offsets[a]) for e, (sym, a) in found.items() if a in offsets}


class Uprobes:
    """The uprobes of one trace of process ``pid``: which files were
    looked at, and every ``UprobeAttempt`` tried."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.probes: list[UprobeAttempt] = []
        self._seen_files: set[tuple[int, int]] = set()
        self._known_paths: set[str] = set()  # every file path a scan handed over
        self._code = ""  # the size of the process's executable mappings at the last look

    def look(self, pid: int, *, always: bool = True) -> list[Mapping] | None:
        """``news`` of process ``pid``'s maps. Not ``always``: only where the
        size of its executable mappings changed (``VmLib`` of its status, 40
        µs to read) since the last look, as a ``dlopen`` changes it. A
        uprobe goes only on code, and torch's maps take 1-5 ms to read and
        split; its whole size (``vsize``) changes with its large allocations."""
        code = proc.status(pid).get("VmLib", "")
        if not always and code and code == self._code:  # absent: looked at every time
            return None
        self._code = code
        return self.news(proc.read(pid, "maps"))

    def news(self, text: str) -> list[Mapping] | None:
        """The file mappings of ``text`` (``/proc/PID/maps``), or None where it
        maps no file path it did not map at the last look: most looks (a job
        maps its libraries as it starts), which then cost a read and a split."""
        paths = {line[i + 1 :] for line in text.splitlines() if (i := line.find(" /")) >= 0}
        if paths <= self._known_paths:
            return None
        self._known_paths |= paths
        return [m for m in parse_maps(text)
                if m.path.startswith("/") and not m.path.endswith(" (deleted)")]  # fmt: skip

    def attach_new(self, maps: list[Mapping], live: list[Live]) -> None:
        """Attach the ``live`` families to every matching file of ``maps``
        not attached yet (by inode). Each file is read and probed through
        the process's root (``elf.host_path``): the path it maps may not be
        ours (an engine in a container, the job on the node)."""
        for path in dict.fromkeys(m.path for m in maps):
            base = os.path.basename(path)
            wanted = [x for x in live if x.family.libraries.match(base)]
            if not wanted:
                continue
            here = elf.host_path(self.pid, path)
            try:
                st = os.stat(here)
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in self._seen_files:
                continue
            self._seen_files.add(key)
            for family in wanted:
                self._attach_library(family, path, here)

    def _attach_library(self, live: Live, path: str, here: str) -> None:
        """``live``'s uprobes on the library the process maps at ``path``
        (``here``: the same file from this process)."""
        f = live.family
        try:
            found = symbols(f, here)
        except ELF_ERRORS as err:
            self.probes.append(
                UprobeAttempt(f.name, path, "*", "entry", False, f"cannot read: {err}")
            )
            return
        if not found:
            return
        wanted = []
        for fn in f.funcs:
            if fn.enum not in found:
                continue
            sym, offset = found[fn.enum]
            wanted.append(Uprobe(fn.entry, sym, offset, False))
            if fn.ret is not None:
                wanted.append(Uprobe(fn.ret, sym, offset, True))
        for sym, kind, ok, why in live.bpf.attach(here, wanted, self.pid):
            self.probes.append(UprobeAttempt(f.name, path, sym, kind, ok, why))
        live.libraries.add(path)  # listed once its uprobes are in

    def attached(self, family: str) -> int:
        """How many of ``family``'s uprobes are attached."""
        return sum(1 for p in self.probes if p.family == family and p.attached)

    def refused(self, family: str) -> list[dict[str, str]]:
        """``family``'s uprobes that could not be attached, and why in one
        line (``_said``): the kernel refused a handler, a library could not
        be read."""
        return [
            {"symbol": p.symbol, "kind": p.kind, "library": p.library, "error": _said(p.error)}
            for p in self.probes
            if p.family == family and not p.attached and p.error
        ]  # fmt: skip

    def detached(self) -> None:
        """Every uprobe was let go."""
        for p in self.probes:
            p.attached = False

    def table(self) -> pa.Table:
        return table_of(UprobeAttempt, self.probes)
