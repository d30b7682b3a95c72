"""ELF symbols for the tracer: where to attach, and what a kernel is called.

* ``exported(path, names)``: addresses of exported functions, looked up in
  the GNU hash table (one lookup each, not a walk over 75k symbols).
* ``exported_matching(path, prefix, accept)``: C++ entry points found by
  their demangled names (gloo's collectives in libtorch_cpu), by scanning the
  dynamic string table for the mangled prefix.
* ``Symbolizer``: address in this process -> function name (demangled), for
  the host stubs that cudaLaunchKernel receives.
* ``RuntimeNames``: the same, asked of the CUDA runtime the process loaded,
  for stubs whose symbols were stripped (torch's).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import os
import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.hash import ELFHashSection, GNUHashSection

# what reading a library's symbols raises: unreadable, or not a well-formed ELF
ELF_ERRORS = (OSError, ValueError, ELFError)


@functools.cache
def _cxa_demangle() -> Callable[..., int] | None:
    name = ctypes.util.find_library("stdc++") or "libstdc++.so.6"
    try:
        fn = ctypes.CDLL(name).__cxa_demangle
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    return fn


_libc_free = ctypes.CDLL(None).free
_libc_free.argtypes = [ctypes.c_void_p]


def demangle(name: str) -> str:
    """``_ZN4gloo9allreduceERKNS_16AllreduceOptionsE`` -> ``gloo::allreduce(...)``;
    anything that is not a mangled C++ name comes back unchanged."""
    fn = _cxa_demangle()
    if fn is None or not name.startswith("_Z"):
        return name
    status = ctypes.c_int(0)
    out = fn(name.encode(), None, None, ctypes.byref(status))
    if status.value != 0 or not out:
        return name
    try:
        return ctypes.string_at(out).decode("utf-8", "replace")
    finally:
        _libc_free(out)


def _lookup_section(elf: ELFFile) -> GNUHashSection | ELFHashSection | None:
    for name in (".gnu.hash", ".hash"):
        sec = elf.get_section_by_name(name)
        if isinstance(sec, GNUHashSection | ELFHashSection):
            return sec
    return None


def _defined_function(sym: object) -> bool:
    return (
        sym is not None
        and sym["st_shndx"] != "SHN_UNDEF"
        and sym["st_info"]["type"] in ("STT_FUNC", "STT_GNU_IFUNC")
        and sym["st_value"] != 0
    )


def exported(path: str, names: Iterable[str]) -> dict[str, int]:
    """``{name: ELF virtual address}`` for the names ``path`` exports as functions."""
    out: dict[str, int] = {}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        table = _lookup_section(elf)
        wanted = list(names)
        if table is not None:
            for name in wanted:
                sym = table.get_symbol(name)
                if _defined_function(sym):
                    out[name] = sym["st_value"]
            return out
        dynsym = elf.get_section_by_name(".dynsym")
        if dynsym is None:
            return out
        want = set(wanted)
        for sym in dynsym.iter_symbols():
            if sym.name in want and _defined_function(sym):
                out[sym.name] = sym["st_value"]
    return out


def exported_matching(
    path: str, prefix: bytes | tuple[bytes, ...], accept: Callable[[str], str | None]
) -> dict[str, tuple[str, int]]:
    """Exported functions whose mangled name starts with ``prefix`` and whose
    demangled name ``accept`` maps to a key: ``{key: (mangled, address)}``."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        dynstr = elf.get_section_by_name(".dynstr")
        if dynstr is None:
            return {}
        raw = dynstr.data()
        prefixes = (prefix,) if isinstance(prefix, bytes) else prefix
        alternatives = b"|".join(re.escape(p) for p in prefixes)
        candidates = {
            m.group(0).decode() for m in re.finditer(rb"(?:" + alternatives + rb")[^\x00]*", raw)
        }
    keys: dict[str, str] = {}
    for mangled in sorted(candidates):
        key = accept(demangle(mangled))
        if key is not None and key not in keys:
            keys[key] = mangled
    addrs = exported(path, keys.values())
    return {key: (m, addrs[m]) for key, m in keys.items() if m in addrs}


class Mapping(NamedTuple):
    start: int
    end: int
    offset: int
    path: str


def mapped_files(pid: int | str = "self") -> list[Mapping]:
    """File-backed executable-or-not mappings of a process, from /proc/P/maps."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].rstrip("\n")
            if path.endswith(" (deleted)"):
                continue
            out.append(Mapping(lo, hi, int(parts[2], 16), path))
    return out


def file_offsets(path: str, vaddrs: Iterable[int]) -> dict[int, int]:
    """ELF virtual address -> offset in the file (what a uprobe attaches at),
    through the PT_LOAD segment that holds it; addresses in none are left out."""
    with open(path, "rb") as f:
        segs = [
            (s["p_offset"], s["p_vaddr"], s["p_filesz"])
            for s in ELFFile(f).iter_segments("PT_LOAD")
        ]
    out = {}
    for v in vaddrs:
        for off, vaddr, size in segs:
            if vaddr <= v < vaddr + size:
                out[v] = v - vaddr + off
                break
    return out


class _FileSymbols:
    """Function symbols of one ELF file, sorted by address (.symtab, else .dynsym)."""

    def __init__(self, path: str) -> None:
        self.addrs: list[int] = []
        self.names: list[str] = []
        self.segments: list[tuple[int, int, int]] = []  # (p_offset, p_vaddr, p_filesz)
        with open(path, "rb") as f:
            elf = ELFFile(f)
            for seg in elf.iter_segments("PT_LOAD"):
                self.segments.append((seg["p_offset"], seg["p_vaddr"], seg["p_filesz"]))
            table = elf.get_section_by_name(".symtab") or elf.get_section_by_name(".dynsym")
            syms = []
            if table is not None:
                for s in table.iter_symbols():
                    if s["st_info"]["type"] == "STT_FUNC" and s["st_value"]:
                        syms.append((s["st_value"], s["st_size"], s.name))
        syms.sort()
        self.addrs = [a for a, _, _ in syms]
        self.sizes = [n for _, n, _ in syms]
        self.names = [name for _, _, name in syms]

    def vaddr(self, file_offset: int) -> int | None:
        for off, vaddr, size in self.segments:
            if off <= file_offset < off + size:
                return vaddr + (file_offset - off)
        return None

    def name_at(self, vaddr: int) -> str | None:
        i = bisect.bisect_right(self.addrs, vaddr) - 1
        if i < 0:
            return None
        if vaddr - self.addrs[i] >= max(self.sizes[i], 1):
            return None
        return self.names[i]


class Symbolizer:
    """Names the functions at addresses in this process (cached per address)."""

    def __init__(self, pid: int | str = "self") -> None:
        self.pid = pid
        self._maps: list[Mapping] = []
        self._files: dict[str, _FileSymbols | None] = {}
        self._cache: dict[int, str | None] = {}

    def _mapping(self, addr: int) -> Mapping | None:
        for m in self._maps:
            if m.start <= addr < m.end:
                return m
        return None

    def name(self, addr: int) -> str | None:
        if addr in self._cache:
            return self._cache[addr]
        m = self._mapping(addr)
        if m is None:
            self._maps = mapped_files(self.pid)
            m = self._mapping(addr)
        name = None
        if m is not None:
            syms = self._files.get(m.path, False)
            if syms is False:
                try:
                    syms = _FileSymbols(m.path)
                except ELF_ERRORS:  # not an ELF, unreadable
                    syms = None
                self._files[m.path] = syms
            if syms is not None:
                vaddr = syms.vaddr(addr - m.start + m.offset)
                raw = syms.name_at(vaddr) if vaddr is not None else None
                name = demangle(raw) if raw else None
        self._cache[addr] = name
        return name

    def forget_maps(self) -> None:
        self._maps = []


class RuntimeNames:
    """Kernel names the CUDA runtime knows: ``cudaFuncGetName`` (CUDA 12.3+)
    of a host stub registered with a libcudart this process has loaded.

    Torch's stubs are hidden symbols stripped from its libraries, so the ELF
    files name none of them. A runtime that is not loaded is never loaded
    here (RTLD_NOLOAD); an older one without the function names nothing."""

    def __init__(self) -> None:
        self._fns: dict[str, Callable[..., int] | None] = {}
        self._cache: dict[int, str | None] = {}

    def _fn(self, path: str) -> Callable[..., int] | None:
        if path not in self._fns:
            try:
                fn = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).cudaFuncGetName
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p]
            except (OSError, AttributeError):
                fn = None
            self._fns[path] = fn
        return self._fns[path]

    def name(self, addr: int, runtimes: Iterable[str]) -> str | None:
        if addr in self._cache:
            return self._cache[addr]
        name = None
        for path in runtimes:
            fn = self._fn(path)
            out = ctypes.c_char_p()
            if fn is not None and fn(ctypes.byref(out), addr) == 0 and out.value:
                name = demangle(out.value.decode("utf-8", "replace"))
                break
        self._cache[addr] = name
        return name
