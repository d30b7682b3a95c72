"""Where things are in a process: the files it maps, and the symbols of its ELF files.

The one ELF reader, for the injector (symbol addresses in a target),
``probing stack`` (libpython's runtime) and the tracer (uprobe offsets, the
names of kernels' host stubs):

* ``loaded_objects(maps)``: each file a process maps (``proc.maps(pid)``)
  with its load address.
* ``ElfFile(path)``: one ELF file read with pyelftools: its machine, its
  ``PT_LOAD`` segments, named symbols (``lookup``), functions by address
  (``functions``), the dynamic string table. ``Symbols`` is what the injector
  keeps of one: values of a few names and the lowest load address.

Files of another process are opened through ``/proc/<pid>/root`` so a process
in a container is read with its own files; a load address is the file's first
mapping minus its lowest ``PT_LOAD`` address. pyelftools loads on the first
look-up: a probe imports this module with its tables and may never look a
symbol up.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

from probing import proc

if TYPE_CHECKING:
    from elftools.elf.sections import Symbol


# -- the files a process maps --------------------------------------------------------------


class LoadedObject(NamedTuple):
    path: str  # as the target sees it
    base: int  # address of its first mapping (file offset 0)
    maps: tuple[proc.Mapping, ...]

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def executable_maps(self) -> list[proc.Mapping]:
        return [m for m in self.maps if "x" in m.perms]


def loaded_objects(maps: Iterable[proc.Mapping]) -> dict[str, LoadedObject]:
    """Every file mapped with its offset-0 mapping, by path."""
    by_path: dict[str, list[proc.Mapping]] = {}
    for m in maps:
        if m.path.startswith("/"):
            by_path.setdefault(m.path, []).append(m)
    out = {}
    for path, ms in by_path.items():
        first = [m for m in ms if m.offset == 0]
        if first:
            out[path] = LoadedObject(path, first[0].start, tuple(ms))
    return out


def host_path(pid: proc.Pid, path: str) -> str:
    """``path`` as seen from here: through the target's root when we can."""
    if path.endswith(" (deleted)"):
        path = path[: -len(" (deleted)")]
    via_root = proc.path(pid, f"root{path}")
    return via_root if os.path.exists(via_root) else path


# -- ELF files -----------------------------------------------------------------------------


def read_errors() -> tuple[type[Exception], ...]:
    """What reading an ELF file raises: unreadable, or not a well-formed ELF."""
    from elftools.common.exceptions import ELFError

    return (OSError, ValueError, ELFError)


class Segment(NamedTuple):
    """A ``PT_LOAD`` program header: ``size`` bytes at ``offset`` in the file
    are mapped at ``vaddr`` (plus the load bias)."""

    offset: int  # p_offset
    vaddr: int  # p_vaddr
    size: int  # p_filesz


class Function(NamedTuple):
    addr: int  # st_value: an ELF virtual address
    size: int
    name: str  # as in the file (mangled)


_FUNCTION_TYPES = ("STT_FUNC", "STT_GNU_IFUNC")


def _defined(sym: Symbol | None, functions: bool) -> bool:
    return (
        sym is not None
        and sym["st_value"] != 0
        and sym["st_shndx"] != "SHN_UNDEF"
        and (not functions or sym["st_info"]["type"] in _FUNCTION_TYPES)
    )


class ElfFile:
    """One ELF file read with pyelftools, open until ``close()`` (a context
    manager): its machine, its ``PT_LOAD`` segments and its symbols."""

    def __init__(self, path: str) -> None:
        from elftools.elf.elffile import ELFFile

        self.path = path
        self._file = open(path, "rb")  # closed by close()
        try:
            self._elf = ELFFile(self._file)
            self.machine: str = self._elf["e_machine"]  # "EM_X86_64"
            self.segments = [
                Segment(s["p_offset"], s["p_vaddr"], s["p_filesz"])
                for s in self._elf.iter_segments()
                if s["p_type"] == "PT_LOAD"
            ]
        except BaseException:
            self._file.close()
            raise

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ElfFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def min_vaddr(self) -> int:
        """The address file offset 0 is mapped at, less the load bias: the
        first segment's ``p_vaddr - p_offset`` (0 for a PIE or a library)."""
        first = min(self.segments, key=lambda s: s.offset, default=None)
        return first.vaddr - first.offset if first is not None else 0

    def lookup(
        self, names: Iterable[str], *, functions: bool = False, symtab: bool = True
    ) -> dict[str, int]:
        """``{name: st_value}`` for the named symbols the file defines (only
        functions, if asked). ``.dynsym`` is asked through its hash table, one
        look-up a name as the dynamic linker does (libpython has thousands of
        symbols, libtorch_cpu 75k), and walked only in a file without one;
        ``.symtab``, when ``symtab``, is walked for the names still missing."""
        from elftools.elf.hash import ELFHashSection, GNUHashSection
        from elftools.elf.sections import SymbolTableSection

        wanted = list(names)
        out: dict[str, int] = {}
        hashes = [
            section
            for section in map(self._elf.get_section_by_name, (".gnu.hash", ".hash"))
            if isinstance(section, GNUHashSection | ELFHashSection)
        ]
        for name in wanted:
            found = (t.get_symbol(name) for t in hashes)
            sym = next((s for s in found if _defined(s, functions)), None)
            if sym is not None:
                out[name] = sym["st_value"]
        walked = ([] if hashes else [".dynsym"]) + ([".symtab"] if symtab else [])
        for table in walked:
            missing = set(wanted) - out.keys()
            section = self._elf.get_section_by_name(table)
            if not missing or not isinstance(section, SymbolTableSection):
                continue
            for sym in section.iter_symbols():
                if sym.name in missing and _defined(sym, functions):
                    out[sym.name] = sym["st_value"]
        return out

    def functions(self) -> list[Function]:
        """Every function symbol, by address: ``.symtab``, else ``.dynsym``."""
        from elftools.elf.sections import SymbolTableSection

        table = self._elf.get_section_by_name(".symtab") or self._elf.get_section_by_name(".dynsym")
        if not isinstance(table, SymbolTableSection):
            return []
        return sorted(
            Function(s["st_value"], s["st_size"], s.name)
            for s in table.iter_symbols()
            if s["st_info"]["type"] == "STT_FUNC" and s["st_value"]
        )

    def dynamic_strings(self) -> bytes:
        """The ``.dynstr`` section: every name the file exports or imports."""
        section = self._elf.get_section_by_name(".dynstr")
        return section.data() if section is not None else b""


class Symbols:
    """Values of the named symbols in one ELF file, its machine and its
    lowest load address: what the injector keeps of an ``ElfFile``."""

    def __init__(self, path: str, names: Iterable[str]) -> None:
        self.path = path
        with ElfFile(path) as f:
            self.machine = f.machine
            self.min_vaddr = f.min_vaddr
            self.values = f.lookup(names)

    def address(self, name: str, base: int) -> int | None:
        value = self.values.get(name)
        return None if value is None else base - self.min_vaddr + value


def symbols_of(pid: int, obj: LoadedObject, names: Iterable[str]) -> Symbols | None:
    try:
        return Symbols(host_path(pid, obj.path), names)
    except read_errors():
        return None


# -- what a Python process maps ------------------------------------------------------------

_LIBC = re.compile(r"^(libc\.so\.\d+|libc-[\d.]+\.so|ld-musl-.*\.so\.\d+|libc\.musl-.*)$")
_LIBDL = re.compile(r"^libdl(\.so\.\d+|-[\d.]+\.so)$")
_LIBPYTHON = re.compile(r"^libpython(\d)\.(\d+)t?d?m?\.so")
_PYEXE = re.compile(r"python(\d)\.(\d+)")


def find_libc(objs: dict[str, LoadedObject]) -> LoadedObject | None:
    return next((o for o in objs.values() if _LIBC.match(o.name)), None)


def find_libdl(objs: dict[str, LoadedObject]) -> LoadedObject | None:
    return next((o for o in objs.values() if _LIBDL.match(o.name)), None)


def version_from_name(name: str) -> tuple[int, int] | None:
    m = _LIBPYTHON.match(name) or _PYEXE.search(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def python_candidates(pid: int, objs: dict[str, LoadedObject]) -> list[LoadedObject]:
    """Objects that may hold the interpreter: libpython first, then the executable."""
    libs = [o for o in objs.values() if _LIBPYTHON.match(o.name)]
    try:
        exe = proc.readlink(pid, "exe").removesuffix(" (deleted)")
    except OSError:
        exe = ""
    rest = [o for o in objs.values() if o.path == exe]
    return libs + rest
