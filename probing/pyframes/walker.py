"""The frame walk in userspace: thread states, frame chains, code objects.

Everything reads through a ``ReadableMemory`` and trusts nothing it reads: a chain
that loops or runs past ``MAX_DEPTH`` stops, a pointer that is not mapped
ends the walk (``OSError``), a string that is not a string reads as "?".
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import NamedTuple

from probing.pyframes import Offsets, linetable
from probing.pyframes.memory import ReadableMemory, i32, u64

MAX_DEPTH = 128  # frames per stack in userspace (the BPF walk stops at 32)
MAX_THREADS = 4096
MAX_STR = 4096
STR_GUESS = 160  # characters of an ASCII str read with its header: a name, most paths
BYTES_GUESS = 256  # bytes of a bytes object read with its size: most line tables


class ThreadState(NamedTuple):
    addr: int
    thread_id: int  # pthread_t (threading.get_ident())
    native_id: int  # the kernel tid; -1 where the version does not record it (3.10)


class RawFrame(NamedTuple):
    """What the BPF side records per frame: the code object and the byte
    offset of the current instruction in its bytecode (-1: not started)."""

    code: int
    offset: int


class Frame(NamedTuple):
    file: str
    func: str
    line: int


def thread_states(mem: ReadableMemory, off: Offsets, interp: int) -> list[ThreadState]:
    """Every thread state of interpreter ``interp`` (newest first)."""
    out: list[ThreadState] = []
    ts = u64(mem, interp + off.interp_threads_head)
    seen: set[int] = set()
    while ts and ts not in seen and len(out) < MAX_THREADS:
        seen.add(ts)
        native = (
            u64(mem, ts + off.tstate_native_thread_id) if off.tstate_native_thread_id >= 0 else -1
        )
        out.append(ThreadState(ts, u64(mem, ts + off.tstate_thread_id), native))
        ts = u64(mem, ts + off.tstate_next)
    return out


def interpreters(mem: ReadableMemory, off: Offsets, runtime: int) -> list[int]:
    """The interpreter states listed in ``_PyRuntime`` (main interpreter last)."""
    out: list[int] = []
    interp = u64(mem, runtime + off.runtime_interpreters_head)
    while interp and interp not in out and len(out) < 64:
        out.append(interp)
        interp = u64(mem, interp)  # PyInterpreterState.next is its first field
    return out


def top_frame(mem: ReadableMemory, off: Offsets, tstate: int) -> int:
    if off.tstate_cframe >= 0:
        cframe = u64(mem, tstate + off.tstate_cframe)
        return u64(mem, cframe + off.cframe_current_frame) if cframe else 0
    return u64(mem, tstate + off.tstate_frame)


def raw_frames(
    mem: ReadableMemory, off: Offsets, tstate: int, limit: int = MAX_DEPTH
) -> list[RawFrame]:
    """The frame chain of ``tstate``, innermost first, as the BPF walk records it."""
    out: list[RawFrame] = []
    frame = top_frame(mem, off, tstate)
    seen: set[int] = set()
    while frame and frame not in seen and len(out) < limit:
        seen.add(frame)
        code = u64(mem, frame + off.frame_code) & ~off.frame_code_tag_bits
        c_owned = off.frame_owner >= 0 and off.frame_owned_by_cstack >= 0
        if c_owned and mem.read(frame + off.frame_owner, 1)[0] >= off.frame_owned_by_cstack:
            code = 0  # a shim frame of a C caller (3.12+), an entry frame (3.14)
        if code:
            if off.frame_instr >= 0:
                instr = u64(mem, frame + off.frame_instr)
                offset = instr - code - off.code_adaptive
            else:
                offset = 2 * i32(mem, frame + off.frame_lasti)
            out.append(RawFrame(code, offset if -2 <= offset < 1 << 31 else -1))
        frame = u64(mem, frame + off.frame_previous)
    return out


def _read_with(mem: ReadableMemory, addr: int, need: int, guess: int) -> bytes:
    """``need`` bytes at ``addr`` and, where they are mapped, the ``guess``
    after them too: an object's header and (most often) its data in one
    read, a read being a syscall."""
    try:
        return mem.read(addr, need + guess)
    except OSError:  # the guess runs past the end of a mapping: the header alone
        return mem.read(addr, need)


def read_str(mem: ReadableMemory, off: Offsets, addr: int) -> str:
    """A ``str`` object's text (compact ASCII or compact UCS1/2/4), or "?"."""
    try:
        lo = off.unicode_length
        # its length, its state and, where it is ASCII and short (a name, a
        # path), its text in one read
        need = off.unicode_state + 4 - lo
        head = _read_with(mem, addr + lo, need, off.unicode_ascii_data - lo - need + STR_GUESS)
        length = struct.unpack_from("<q", head, 0)[0]
        state = struct.unpack_from("<i", head, off.unicode_state - lo)[0]
        if not 0 <= length <= MAX_STR:
            return "?"
        kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
        if not compact or kind not in (1, 2, 4):
            return "?"
        codec = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind]
        start = off.unicode_ascii_data - lo
        if ascii_ and start + length <= len(head):
            return head[start : start + length].decode(codec, "replace")
        data = addr + (off.unicode_ascii_data if ascii_ else off.unicode_compact_data)
        raw = mem.read(data, length * kind) if length else b""
        return raw.decode(codec, "replace")
    except (OSError, struct.error):
        return "?"


def read_bytes(mem: ReadableMemory, off: Offsets, addr: int, limit: int = 1 << 20) -> bytes:
    """A ``bytes`` object's data (a line table), its size and most often its
    data in one read."""
    guess = off.bytes_data - off.bytes_size - 8 + BYTES_GUESS
    head = _read_with(mem, addr + off.bytes_size, 8, guess)
    size = struct.unpack_from("<q", head, 0)[0]
    if not 0 <= size <= limit:
        return b""
    start = off.bytes_data - off.bytes_size
    if start + size <= len(head):
        return head[start : start + size]
    return mem.read(addr + off.bytes_data, size) if size else b""


class CodeInfo(NamedTuple):
    file: str
    func: str
    firstlineno: int
    lines: linetable.Spans  # its line table, decoded once: each offset a bisection


class Resolver:
    """Code object address -> file, function and line table, read once and
    cached: a traced job runs the same few hundred code objects forever."""

    def __init__(self, mem: ReadableMemory, off: Offsets) -> None:
        self.mem = mem
        self.off = off
        # a sampler's new stacks are mostly new offsets in known code (FSDP2's
        # are many): a code's line table is decoded as it is read, and a
        # frame once resolved is kept (most of a new stack's frames are known)
        self._codes: dict[int, CodeInfo | None] = {}
        self._frames: dict[RawFrame, Frame] = {}
        self._files: dict[int, str] = {}  # a module's code objects share its file's str

    def _file(self, addr: int) -> str:
        got = self._files.get(addr)
        if got is None:
            got = read_str(self.mem, self.off, addr)
            if len(self._files) > 1 << 12:
                self._files.clear()
            if got != "?":  # unreadable now: asked again with the next code
                self._files[addr] = got
        return got

    def code(self, addr: int) -> CodeInfo | None:
        if addr in self._codes:
            return self._codes[addr]
        off, mem = self.off, self.mem
        name_off = off.code_qualname if off.code_qualname >= 0 else off.code_name
        fields = (off.code_filename, name_off, off.code_firstlineno, off.code_linetable)
        lo = min(fields)
        try:  # the code object's fields in one read (a read is a syscall)
            head = mem.read(addr + lo, max(fields) + 8 - lo)

            def ptr(field: int) -> int:
                return int(struct.unpack_from("<Q", head, field - lo)[0])

            first = int(struct.unpack_from("<i", head, off.code_firstlineno - lo)[0])
            table = read_bytes(mem, off, ptr(off.code_linetable))
            info: CodeInfo | None = CodeInfo(
                self._file(ptr(off.code_filename)),
                read_str(mem, off, ptr(name_off)),
                first,
                linetable.spans(off.linetable_format, table, first),
            )
        except OSError:
            info = None
        if len(self._codes) > 1 << 16:
            self._codes.clear()
        self._codes[addr] = info
        return info

    def frame(self, raw: RawFrame) -> Frame:
        got = self._frames.get(raw)
        if got is not None:
            return got
        info = self.code(raw.code)
        if info is None:
            return Frame("?", f"<code {raw.code:#x}>", 0)
        got = Frame(
            info.file, info.func, linetable.line_at(info.lines, info.firstlineno, raw.offset)
        )
        if len(self._frames) > 1 << 16:
            self._frames.clear()
        self._frames[raw] = got
        return got

    def frames(self, raws: Iterable[RawFrame]) -> list[Frame]:
        return [self.frame(r) for r in raws]
