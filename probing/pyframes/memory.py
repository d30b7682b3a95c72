"""Reading another process's (or this process's) memory without trusting it.

``ProcessMemory`` reads with ``process_vm_readv``, as ``py-spy dump`` does:
an address that is not mapped is an ``OSError``, never a crash, so the same
reader serves the probe (reading its own interpreter while other threads run)
and ``probing stack`` (reading a process it cannot run code in).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from typing import Protocol

from probing.errors import AccessDenied, NoSuchProcess


class ReadableMemory(Protocol):
    """Something whose bytes can be read by address."""

    def read(self, addr: int, size: int) -> bytes: ...


class IOVec(ctypes.Structure):
    """``struct iovec`` (``process_vm_readv``, ``PTRACE_GETREGSET``)."""

    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_readv = _libc.process_vm_readv
_readv.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(IOVec),
    ctypes.c_ulong,
    ctypes.POINTER(IOVec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_readv.restype = ctypes.c_ssize_t


class ProcessMemory:
    """``process_vm_readv`` on ``pid`` (this process by default)."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid

    def read(self, addr: int, size: int) -> bytes:
        if addr <= 0 or size <= 0 or addr + size >= 1 << 64:
            raise OSError(errno.EFAULT, f"bad address {addr:#x}")
        buf = ctypes.create_string_buffer(size)
        local = IOVec(ctypes.cast(buf, ctypes.c_void_p), size)
        remote = IOVec(addr, size)
        got = _readv(self.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got != size:
            err = ctypes.get_errno() if got < 0 else errno.EFAULT
            if err == errno.ESRCH:
                raise NoSuchProcess(f"no process with pid {self.pid}", pid=self.pid)
            if err == errno.EPERM:
                raise AccessDenied(
                    f"not permitted to read the memory of pid {self.pid}",
                    pid=self.pid,
                    hint="run as the same user with ptrace allowed, or as root "
                    "(or add CAP_SYS_PTRACE)",
                )
            raise OSError(err, f"cannot read {size} bytes at {addr:#x} in pid {self.pid}")
        return buf.raw


PAGE = 4096


def cstring(mem: ReadableMemory, addr: int, limit: int = 512) -> bytes:
    """The NUL-terminated bytes at ``addr`` (at most ``limit``), read a page
    at a time: a string that ends just before an unmapped page is read
    whole. ``OSError`` when its first byte cannot be read."""
    out = b""
    while len(out) < limit:
        at = addr + len(out)
        chunk = mem.read(at, min(limit - len(out), PAGE - at % PAGE))
        end = chunk.find(b"\0")
        if end >= 0:
            return out + chunk[:end]
        out += chunk
        try:
            mem.read(addr + len(out), 1)
        except OSError:  # the next page is not mapped: what we have is all of it
            return out
    return out


def u64(mem: ReadableMemory, addr: int) -> int:
    return int(struct.unpack("<Q", mem.read(addr, 8))[0])


def i32(mem: ReadableMemory, addr: int) -> int:
    return int(struct.unpack("<i", mem.read(addr, 4))[0])
