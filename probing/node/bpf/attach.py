"""Uprobes on the libraries a traced process maps.

``Uprobes.attach_new`` is handed the process's maps (``/proc/PID/maps``:
by path, never by library name) and the families loaded. A mapped file
whose name a family matches (``Family.libraries``) is attached once, by
inode: the family's functions found among its exported symbols (by name,
or by demangled name for C++), each at its file offset, an entry probe
and, where the family has one, a return probe. Every uprobe tried is a
``Probe``, attached or with why not: the ``probing.uprobes`` table.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import pyarrow as pa

from probing.node.bpf import families as fam
from probing.node.bpf.loader import Uprobe
from probing.node.bpf.symbols import (
    ELF_ERRORS,
    exported,
    exported_matching,
    file_offsets,
)
from probing.proc import Mapping
from probing.schema import schema_of, table_of

if TYPE_CHECKING:
    from probing.node.bpf.drain import Live


@dataclasses.dataclass
class Probe:
    """One uprobe (entry or return) as attached, or why not."""

    family: str
    library: str
    symbol: str
    kind: str  # "entry" | "return"
    attached: bool
    error: str | None = None


PROBES_SCHEMA = schema_of(Probe)  # trace.probes


# What ``symbols`` found, per family and file (by its identity: a library
# replaced on disk is read again). The ranks of a job map the same libraries,
# and an engine traces them all: libtorch is read once, not once a rank.
KEEP_SYMBOLS = 64
_found: OrderedDict[tuple[str, int, int, int, int], dict[str, tuple[str, int]]] = OrderedDict()
_found_lock = threading.Lock()


def symbols(f: fam.Family, path: str) -> dict[str, tuple[str, int]]:
    """Func.enum -> (the symbol to attach to in ``path``, its file offset)."""
    st = os.stat(path)
    key = (f.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _found_lock:
        got = _found.get(key)
        if got is not None:
            _found.move_to_end(key)
            return got
    got = _symbols(f, path)
    with _found_lock:
        _found[key] = got
        while len(_found) > KEEP_SYMBOLS:
            _found.popitem(last=False)
    return got


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
    looked at, and every ``Probe`` tried."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.probes: list[Probe] = []
        self._seen_files: set[tuple[int, int]] = set()

    def attach_new(self, maps: list[Mapping], live: list[Live]) -> None:
        """Attach the ``live`` families to every matching file of ``maps``
        not attached yet (by inode)."""
        for path in dict.fromkeys(m.path for m in maps):
            base = os.path.basename(path)
            wanted = [x for x in live if x.family.libraries.match(base)]
            if not wanted:
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in self._seen_files:
                continue
            self._seen_files.add(key)
            for family in wanted:
                self._attach_library(family, path)

    def _attach_library(self, live: Live, path: str) -> None:
        f = live.family
        try:
            found = symbols(f, path)
        except ELF_ERRORS as err:
            self.probes.append(Probe(f.name, path, "*", "entry", False, f"cannot read: {err}"))
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
        for sym, kind, ok, why in live.bpf.attach(path, wanted, self.pid):
            self.probes.append(Probe(f.name, path, sym, kind, ok, why))
        live.libraries.add(path)  # listed once its uprobes are in

    def attached(self, family: str) -> int:
        """How many of ``family``'s uprobes are attached."""
        return sum(1 for p in self.probes if p.family == family and p.attached)

    def detached(self) -> None:
        """Every uprobe was let go."""
        for p in self.probes:
            p.attached = False

    def table(self) -> pa.Table:
        return table_of(Probe, self.probes)
