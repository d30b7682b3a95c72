"""Stacks of a process probing cannot run code in, read from outside.

``dump(pid)`` finds ``_PyRuntime`` through the ELF symbols of the target's
libpython (or executable) and its load address in ``/proc/P/maps``, reads
the interpreter's thread list and walks every thread's frames with
``process_vm_readv``: no ptrace stop, no code run in the target, so a job
whose thread holds the GIL forever (a C call that never returns) still
shows where it is. On 3.13+ the offsets come from the ``_Py_DebugOffsets``
the interpreter carries at the start of ``_PyRuntime``.
"""

from __future__ import annotations

import dataclasses
import struct
import sys

from probing import elf, proc
from probing.errors import AccessDenied, NoSuchProcess, ProbingError, UnsupportedPython
from probing.pyframes import Offsets, offsets_for, walker
from probing.pyframes.memory import ProcessMemory, ReadableMemory

DEBUG_COOKIE = b"xdebugpy"
# _Py_DebugOffsets (3.13+): cookie, version, free_threaded, then sections of
# u64 offsets, each opening with the struct's size.
_DBG_FREE_THREADED = 2  # word
_DBG_INTERPRETERS_HEAD = 40
_DBG_THREADS_HEAD = 72
_DBG_SCAN = 1024  # bytes of the struct searched for the thread-state section
FREE_THREADED = (
    "runs a free-threaded CPython ({version}t), which probing does not support yet: "
    "its frames and objects have another layout (run the job on the GIL build, python{version})"
)


def free_threaded(mem: ReadableMemory, runtime: int, base: Offsets) -> bool:
    """Whether the 3.13+ interpreter at ``runtime`` is a free-threaded build
    (``_Py_DebugOffsets.free_threaded``): its layouts are not the table's."""
    if base.debug_offsets < 0:
        return False
    raw = mem.read(runtime + base.debug_offsets, 8 * (_DBG_FREE_THREADED + 1))
    return raw[:8] == DEBUG_COOKIE and struct.unpack_from("<Q", raw, 8 * _DBG_FREE_THREADED)[0] != 0


def apply_debug_offsets(mem: ReadableMemory, runtime: int, base: Offsets) -> Offsets:
    """``base`` with the thread, frame and code offsets the running 3.13+
    interpreter publishes; ``base`` unchanged where it has none."""
    if base.debug_offsets < 0:
        return base
    raw = mem.read(runtime + base.debug_offsets, _DBG_SCAN)
    if raw[:8] != DEBUG_COOKIE:
        return base
    words = struct.unpack(f"<{_DBG_SCAN // 8}Q", raw)
    # the thread-state section: size, prev (0), next (8), interp (16), ...
    ts = next((i for i in range(7, len(words) - 30) if words[i + 1 : i + 4] == (0, 8, 16)), None)
    if ts is None:
        return base
    # 9 thread-state words, the frame's (6 on 3.13, 8 on 3.14), then the code object's
    fr = ts + 9
    co = fr + base.debug_frame_words
    return dataclasses.replace(
        base,
        runtime_interpreters_head=words[_DBG_INTERPRETERS_HEAD // 8],
        interp_threads_head=words[_DBG_THREADS_HEAD // 8],
        tstate_next=words[ts + 2],
        tstate_frame=words[ts + 4],
        tstate_thread_id=words[ts + 5],
        tstate_native_thread_id=words[ts + 6],
        frame_previous=words[fr + 1],
        frame_code=words[fr + 2],
        frame_instr=words[fr + 3],
        frame_owner=words[fr + 5],
        code_filename=words[co + 1],
        code_name=words[co + 2],
        code_qualname=words[co + 3],
        code_linetable=words[co + 4],
        code_firstlineno=words[co + 5],
        code_adaptive=words[co + 9],
    )


@dataclasses.dataclass
class Interpreter:
    """Where a process's interpreter lives, and how to read it."""

    pid: int
    mem: ReadableMemory
    offsets: Offsets
    runtime: int
    python: str  # "3.11"
    executable: str


def locate(pid: int) -> Interpreter:
    """The interpreter of ``pid``: version, ``_PyRuntime`` address, offsets."""
    try:
        maps = proc.maps(pid)
    except ProcessLookupError:
        raise NoSuchProcess(f"process {pid} has exited", pid=pid) from None
    except PermissionError:
        raise AccessDenied(
            f"not permitted to read /proc/{pid}/maps", pid=pid, hint="run as its user or root"
        ) from None
    mem = ProcessMemory(pid)
    for obj in elf.python_candidates(pid, elf.loaded_objects(maps)):
        syms = elf.symbols_of(pid, obj, ("_PyRuntime", "Py_Version"))
        runtime = syms.address("_PyRuntime", obj.base) if syms else None
        if syms is None or runtime is None:
            continue
        version = elf.version_from_name(obj.name)
        at = syms.address("Py_Version", obj.base)
        if at is not None:
            hexversion = struct.unpack("<I", mem.read(at, 4))[0]
            version = ((hexversion >> 24) & 0xFF, (hexversion >> 16) & 0xFF)
        if version is None:
            continue
        base = offsets_for(version)
        if free_threaded(mem, runtime, base):
            ver = f"{version[0]}.{version[1]}"
            raise UnsupportedPython(f"process {pid} " + FREE_THREADED.format(version=ver), pid=pid)
        off = apply_debug_offsets(mem, runtime, base)
        return Interpreter(pid, mem, off, runtime, f"{version[0]}.{version[1]}", obj.path)
    raise ProbingError(
        f"process {pid} is not a Python process: no mapped object exports _PyRuntime", pid=pid
    )


@dataclasses.dataclass
class ThreadStack:
    native_id: int
    thread_id: int
    frames: list[walker.Frame]


def dump(pid: int) -> tuple[Interpreter, list[ThreadStack]]:
    """Every thread's stack in ``pid``'s interpreters, innermost frame first."""
    interp = locate(pid)
    mem, off = interp.mem, interp.offsets
    resolver = walker.Resolver(mem, off)
    out = []
    for state in walker.interpreters(mem, off, interp.runtime):
        for ts in walker.thread_states(mem, off, state):
            try:
                frames = resolver.frames(walker.raw_frames(mem, off, ts.addr))
            except OSError:  # the thread moved on under us: what was read so far
                frames = []
            out.append(ThreadStack(ts.native_id, ts.thread_id, frames))
    return interp, out


def this_runtime() -> int:
    """``_PyRuntime`` of this process."""
    import ctypes

    return ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))


def this_interpreter() -> Interpreter:
    mem = ProcessMemory()
    runtime = this_runtime()
    off = apply_debug_offsets(mem, runtime, offsets_for(sys.version_info[:2]))
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    return Interpreter(mem.pid, mem, off, runtime, version, sys.executable)
