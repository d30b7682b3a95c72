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

The maps and the ELF files are read by ``probing.elf`` (the injector's
reader too); this module adds what only the tracer asks of them.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import os
import re
from collections.abc import Callable, Iterable

from probing import elf, proc

# what reading a library's symbols raises: unreadable, or not a well-formed ELF
ELF_ERRORS = elf.read_errors()


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


def exported(path: str, names: Iterable[str]) -> dict[str, int]:
    """``{name: ELF virtual address}`` for the names ``path`` exports as functions."""
    with elf.ElfFile(path) as f:
        return f.lookup(names, functions=True, symtab=False)


def exported_matching(
    path: str, prefix: bytes | tuple[bytes, ...], accept: Callable[[str], str | None]
) -> dict[str, tuple[str, int]]:
    """Exported functions whose mangled name starts with ``prefix`` and whose
    demangled name ``accept`` maps to a key: ``{key: (mangled, address)}``."""
    prefixes = (prefix,) if isinstance(prefix, bytes) else prefix
    alternatives = b"|".join(re.escape(p) for p in prefixes)
    with elf.ElfFile(path) as f:
        raw = f.dynamic_strings()
        candidates = {
            m.group(0).decode() for m in re.finditer(rb"(?:" + alternatives + rb")[^\x00]*", raw)
        }
        keys: dict[str, str] = {}
        for mangled in sorted(candidates):
            key = accept(demangle(mangled))
            if key is not None and key not in keys:
                keys[key] = mangled
        addrs = f.lookup(keys.values(), functions=True, symtab=False)
    return {key: (m, addrs[m]) for key, m in keys.items() if m in addrs}


def mapped_files(pid: int | str = "self") -> list[proc.Mapping]:
    """The mappings of files that still exist (named by path), from /proc/P/maps."""
    return [
        m for m in proc.maps(pid) if m.path.startswith("/") and not m.path.endswith(" (deleted)")
    ]


def file_offsets(path: str, vaddrs: Iterable[int]) -> dict[int, int]:
    """ELF virtual address -> offset in the file (what a uprobe attaches at),
    through the PT_LOAD segment that holds it; addresses in none are left out."""
    with elf.ElfFile(path) as f:
        segs = f.segments
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
        with elf.ElfFile(path) as f:
            self.segments = f.segments
            functions = f.functions()
        self.addrs = [fn.addr for fn in functions]
        self.sizes = [fn.size for fn in functions]
        self.names = [fn.name for fn in functions]

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
        self._maps: list[proc.Mapping] = []
        self._files: dict[str, _FileSymbols | None] = {}
        self._cache: dict[int, str | None] = {}

    def _mapping(self, addr: int) -> proc.Mapping | None:
        for m in self._maps:
            if m.start <= addr < m.end:
                return m
        return None

    def _symbols(self, path: str) -> _FileSymbols | None:
        """The file's symbols, read once (None: not an ELF, unreadable)."""
        if path not in self._files:
            try:
                self._files[path] = _FileSymbols(path)
            except ELF_ERRORS:
                self._files[path] = None
        return self._files[path]

    def name(self, addr: int) -> str | None:
        if addr in self._cache:
            return self._cache[addr]
        m = self._mapping(addr)
        if m is None:
            self._maps = mapped_files(self.pid)
            m = self._mapping(addr)
        name = None
        if m is not None:
            syms = self._symbols(elf.host_path(self.pid, m.path))  # the file, from here
            if syms is not None:
                vaddr = syms.vaddr(addr - m.start + m.offset)
                raw = syms.name_at(vaddr) if vaddr is not None else None
                name = demangle(raw) if raw else None
        self._cache[addr] = name
        return name


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
