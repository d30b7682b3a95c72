"""Where things are in a target: its mappings, and symbol addresses in them.

Symbols come from the ELF files themselves (pyelftools, ``.dynsym`` then
``.symtab``), opened through ``/proc/<pid>/root`` so a process in a container
is read with its own files; a load address is the file's first mapping minus
its lowest ``PT_LOAD`` address. pyelftools loads on the first look-up: a
probe imports this module with its tables and may never look a symbol up.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from elftools.elf.sections import Symbol


class Mapping(NamedTuple):
    start: int
    end: int
    perms: str
    offset: int
    path: str


def parse_maps(text: str) -> list[Mapping]:
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        lo, hi = parts[0].split("-")
        path = parts[5].strip() if len(parts) == 6 else ""
        out.append(Mapping(int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16), path))
    return out


def read_maps(pid: int) -> list[Mapping]:
    with open(f"/proc/{pid}/maps") as f:
        return parse_maps(f.read())


class LoadedObject(NamedTuple):
    path: str  # as the target sees it
    base: int  # address of its first mapping (file offset 0)
    maps: tuple[Mapping, ...]

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def executable_maps(self) -> list[Mapping]:
        return [m for m in self.maps if "x" in m.perms]


def loaded_objects(maps: Iterable[Mapping]) -> dict[str, LoadedObject]:
    """Every file mapped with its offset-0 mapping, by path."""
    by_path: dict[str, list[Mapping]] = {}
    for m in maps:
        if m.path.startswith("/"):
            by_path.setdefault(m.path, []).append(m)
    out = {}
    for path, ms in by_path.items():
        first = [m for m in ms if m.offset == 0]
        if first:
            out[path] = LoadedObject(path, first[0].start, tuple(ms))
    return out


def host_path(pid: int, path: str) -> str:
    """``path`` as seen from here: through the target's root when we can."""
    if path.endswith(" (deleted)"):
        path = path[: -len(" (deleted)")]
    via_root = f"/proc/{pid}/root{path}"
    return via_root if os.path.exists(via_root) else path


class Symbols:
    """Values of the named symbols in one ELF file, and its lowest load address.

    The hash tables answer ``.dynsym`` look-ups without reading the whole
    table (libpython's has thousands of entries); ``.symtab`` is read only
    for names the dynamic table lacks.
    """

    def __init__(self, path: str, names: Iterable[str]) -> None:
        from elftools.elf.elffile import ELFFile
        from elftools.elf.hash import ELFHashSection, GNUHashSection
        from elftools.elf.sections import SymbolTableSection

        self.path = path
        self.values: dict[str, int] = {}
        wanted = set(names)
        with open(path, "rb") as f:
            elf = ELFFile(f)
            self.machine = elf["e_machine"]
            loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            # file offset 0 is mapped at load bias + (p_vaddr - p_offset) of the first segment
            first = min(loads, key=lambda s: s["p_offset"], default=None)
            self.min_vaddr = first["p_vaddr"] - first["p_offset"] if first is not None else 0
            for section in elf.iter_sections():
                if isinstance(section, GNUHashSection | ELFHashSection):
                    for name in wanted - self.values.keys():
                        self._keep(name, section.get_symbol(name))
            for table in (".dynsym", ".symtab"):
                missing = wanted - self.values.keys()
                section = elf.get_section_by_name(table)
                if not missing or not isinstance(section, SymbolTableSection):
                    continue
                for sym in section.iter_symbols():
                    if sym.name in missing:
                        self._keep(sym.name, sym)

    def _keep(self, name: str, sym: Symbol | None) -> None:
        if sym is not None and sym["st_value"] and sym["st_shndx"] != "SHN_UNDEF":
            self.values[name] = sym["st_value"]

    def address(self, name: str, base: int) -> int | None:
        value = self.values.get(name)
        return None if value is None else base - self.min_vaddr + value


def symbols_of(pid: int, obj: LoadedObject, names: Iterable[str]) -> Symbols | None:
    from elftools.common.exceptions import ELFError

    try:
        return Symbols(host_path(pid, obj.path), names)
    except (OSError, ELFError, ValueError):
        return None


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
        exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    except OSError:
        exe = ""
    rest = [o for o in objs.values() if o.path == exe]
    return libs + rest
