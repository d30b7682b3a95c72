"""pyframes on canned memory: each version's offsets drive a walk over a fake
address space laid out by those offsets, and the 3.11 row is checked
against the interpreter running the tests."""

from __future__ import annotations

import dataclasses
import struct
import sys

import pytest

from probing import pyframes
from probing.errors import UnsupportedPython
from probing.pyframes import linetable, remote, walker
from probing.pyframes.memory import ProcessMemory, u64


class FakeMemory:
    """A sparse address space: address -> bytes blocks."""

    def __init__(self) -> None:
        self.blocks: dict[int, bytearray] = {}
        self.next = 0x10000

    def alloc(self, size: int) -> int:
        addr = self.next
        self.blocks[addr] = bytearray(size)
        self.next += (size + 0xFFF) & ~0xFFF
        return addr

    def put(self, addr: int, data: bytes) -> None:
        for base, blk in self.blocks.items():
            if base <= addr and addr + len(data) <= base + len(blk):
                blk[addr - base : addr - base + len(data)] = data
                return
        raise AssertionError(f"{addr:#x} not allocated")

    def q(self, addr: int, value: int) -> None:
        self.put(addr, struct.pack("<Q", value))

    def read(self, addr: int, size: int) -> bytes:
        for base, blk in self.blocks.items():
            if base <= addr and addr + size <= base + len(blk):
                return bytes(blk[addr - base : addr - base + size])
        raise OSError(14, f"unmapped {addr:#x}")


def _str(mem: FakeMemory, off: pyframes.Offsets, text: str) -> int:
    a = mem.alloc(256)
    mem.put(a + off.unicode_length, struct.pack("<q", len(text)))
    mem.put(a + off.unicode_state, struct.pack("<I", (1 << 2) | (1 << 5) | (1 << 6)))
    mem.put(a + off.unicode_ascii_data, text.encode())
    return a


def _bytes(mem: FakeMemory, off: pyframes.Offsets, data: bytes) -> int:
    a = mem.alloc(64 + len(data))
    mem.put(a + off.bytes_size, struct.pack("<q", len(data)))
    mem.put(a + off.bytes_data, data)
    return a


def sample() -> int:
    x = 1
    y = x + 1
    return y


SAMPLE_FIRST = sample.__code__.co_firstlineno
# (3.10 format) 3 lines, 2 instructions each: +1, +1, +1 from firstlineno
LNOTAB310 = bytes([4, 1, 4, 1, 4, 1])


def _image(version: str, frames: list[tuple[str, str, int]]):  # type: ignore[no-untyped-def]
    """A runtime with one interpreter, one thread and ``frames`` (innermost
    first: file, func, byte offset); returns (memory, offsets, runtime, tid)."""
    off = pyframes.offsets_for(version)
    mem = FakeMemory()
    runtime, interp, ts = mem.alloc(4096), mem.alloc(4096), mem.alloc(4096)
    if off.debug_offsets >= 0:  # 3.13: _Py_DebugOffsets says where the lists are
        off = _debug_offsets(mem, runtime, off)
    mem.q(runtime + off.runtime_interpreters_head, interp)
    mem.q(interp + off.interp_threads_head, ts)
    mem.q(ts + off.tstate_thread_id, 0xABC)
    if off.tstate_native_thread_id >= 0:
        mem.q(ts + off.tstate_native_thread_id, 4242)
    table = LNOTAB310 if version == "3.10" else sample.__code__.co_linetable
    first = mem.alloc(4096)
    prev = 0
    addrs = []
    for file, func, _ in frames:
        code = mem.alloc(512)
        mem.q(code + off.code_filename, _str(mem, off, file))
        name_off = off.code_qualname if off.code_qualname >= 0 else off.code_name
        mem.q(code + name_off, _str(mem, off, func))
        mem.put(code + off.code_firstlineno, struct.pack("<i", SAMPLE_FIRST))
        mem.q(code + off.code_linetable, _bytes(mem, off, table))
        addrs.append(code)
    if off.frame_owned_by_cstack >= 0:  # the interpreter's entry frame: left out
        prev = _entry_frame(mem, off)
    for i in reversed(range(len(frames))):  # outermost first, each links to the previous
        fr = mem.alloc(256)
        code, offset = addrs[i], frames[i][2]
        # 3.14: a _PyStackRef, its low bit a tag (deferred reference counting)
        mem.q(fr + off.frame_code, code | (1 if off.frame_code_tag_bits else 0))
        mem.q(fr + off.frame_previous, prev)
        if off.frame_instr >= 0:
            mem.q(fr + off.frame_instr, code + off.code_adaptive + offset)
        else:
            mem.put(fr + off.frame_lasti, struct.pack("<i", offset // 2))
        prev = fr
    if off.tstate_cframe >= 0:
        mem.q(ts + off.tstate_cframe, first)
        mem.q(first + off.cframe_current_frame, prev)
    else:
        mem.q(ts + off.tstate_frame, prev)
    return mem, off, runtime


def _entry_frame(mem: FakeMemory, off: pyframes.Offsets) -> int:
    """A frame no Python code runs in (3.12+: a C caller's shim; 3.14: the
    entry frame, f_executable None): what the walk skips."""
    fr = mem.alloc(256)
    mem.q(fr + off.frame_code, mem.alloc(64) | (1 if off.frame_code_tag_bits else 0))
    mem.put(fr + off.frame_owner, bytes([off.frame_owned_by_cstack]))
    return fr


def _debug_offsets(
    mem: FakeMemory, runtime: int, base: pyframes.Offsets, free_threaded: int = 0
) -> pyframes.Offsets:
    """A 3.13+ _Py_DebugOffsets whose values differ from the static row, so
    the test shows they are the ones used (3.14: two frame words more)."""
    words = [0] * 64
    words[2] = free_threaded
    words[5], words[9] = 24, 40  # runtime interpreters_head, interp threads_head
    ts = 6 + 13  # header (3) + runtime (3) + interpreter section (13 words)
    words[ts : ts + 9] = [400, 0, 8, 16, 80, 160, 168, 0, 0]
    frame = [80, 16, 0, 56, 72, 70] + [88, 0][: base.debug_frame_words - 6]
    words[ts + 9 : ts + 9 + len(frame)] = frame
    co = ts + 9 + len(frame)
    words[co : co + 10] = [220, 120, 128, 136, 144, 76, 0, 0, 0, 208]
    blob = b"xdebugpy" + struct.pack("<63Q", *words[1:])
    mem.put(runtime + base.debug_offsets, blob)
    off = remote.apply_debug_offsets(mem, runtime, base)
    assert (off.tstate_frame, off.code_filename, off.code_adaptive) == (80, 120, 208)
    return off


@pytest.mark.parametrize("version", pyframes.SUPPORTED)
def test_walk_canned_interpreter(version: str) -> None:
    x_line = SAMPLE_FIRST + 1
    mem, off, runtime = _image(
        version, [("/app/model.py", "Model.forward", 4), ("/app/train.py", "train_step", 8)]
    )
    (interp,) = walker.interpreters(mem, off, runtime)
    (ts,) = walker.thread_states(mem, off, interp)
    assert ts.thread_id == 0xABC
    assert ts.native_id == (4242 if off.tstate_native_thread_id >= 0 else -1)
    raws = walker.raw_frames(mem, off, ts.addr)
    frames = walker.Resolver(mem, off).frames(raws)
    assert [f.file for f in frames] == ["/app/model.py", "/app/train.py"]
    assert [f.func for f in frames] == ["Model.forward", "train_step"]
    if version == "3.10":
        assert [f.line for f in frames] == [SAMPLE_FIRST + 2, SAMPLE_FIRST + 3]
    else:
        want = [line_at(4), line_at(8)]
        assert [f.line for f in frames] == want and x_line in want


def test_a_free_threaded_interpreter_is_refused_with_one_line() -> None:
    base = pyframes.offsets_for("3.14")
    mem = FakeMemory()
    runtime = mem.alloc(4096)
    _debug_offsets(mem, runtime, base, free_threaded=1)
    assert remote.free_threaded(mem, runtime, base)
    msg = remote.FREE_THREADED.format(version="3.14")
    assert "\n" not in msg and "3.14t" in msg and "not support" in msg
    _debug_offsets(mem, runtime, base, free_threaded=0)
    assert not remote.free_threaded(mem, runtime, base)
    assert not remote.free_threaded(mem, runtime, pyframes.offsets_for("3.12"))


def line_at(offset: int) -> int:
    return next(ln for s, e, ln in sample.__code__.co_lines() if s <= offset < e)


def test_unsupported_version_lists_the_supported() -> None:
    with pytest.raises(
        UnsupportedPython,
        match=r"Unsupported version of Python: 3\.9 "
        r"\(supported: 3\.10, 3\.11, 3\.12, 3\.13, 3\.14\)",
    ):
        pyframes.offsets_for((3, 9))


def test_location_table_matches_co_lines() -> None:
    for code in (sample.__code__, test_walk_canned_interpreter.__code__, pytest.main.__code__):
        for start, end, line in code.co_lines():
            for offset in range(start, end, 2):
                got = linetable.locations_line(code.co_linetable, code.co_firstlineno, offset)
                assert got == line, (code.co_name, offset)


def test_a_code_objects_line_table_is_decoded_once_for_all_its_offsets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sampler's new stacks are mostly new offsets in code resolved
    before: each code's table is decoded once, each offset a lookup in it."""
    interp = remote.this_interpreter()
    resolver = walker.Resolver(interp.mem, interp.offsets)
    decoded: list[object] = []
    real = linetable.spans
    monkeypatch.setattr(linetable, "spans", lambda *a: decoded.append(a) or real(*a))
    code = test_walk_canned_interpreter.__code__
    want = [(o, line) for start, end, line in code.co_lines() if line is not None
            for o in range(start, end, 2)]  # fmt: skip
    got = [(o, resolver.frame(walker.RawFrame(id(code), o)).line) for o, _ in want]
    assert len(want) > 50 and got == want
    assert len(decoded) == 1


def test_lnotab310_deltas() -> None:
    # 2 instructions at +1, 1 with no line (-128), 2 at +2 from there
    table = bytes([4, 1, 2, 0x80, 4, 2])
    assert [linetable.lnotab310_line(table, 10, o) for o in (0, 2, 4, 6, 8)] == [
        11,
        11,
        None,
        13,
        13,
    ]


@pytest.mark.skipif(
    sys.version_info[:2] not in ((3, 11), (3, 13)),
    reason="checks the 3.11 row, and 3.13's against _Py_DebugOffsets, live (make vm-test)",
)
def test_the_running_interpreter_agrees_with_its_row() -> None:
    off = pyframes.current()
    mem = ProcessMemory()
    co = sample.__code__
    assert u64(mem, id(co) + off.code_filename) == id(co.co_filename)
    assert u64(mem, id(co) + off.code_qualname) == id(co.co_qualname)
    assert u64(mem, id(co) + off.code_linetable) == id(co.co_linetable)
    assert struct.unpack("<i", mem.read(id(co) + off.code_firstlineno, 4))[0] == SAMPLE_FIRST
    interp = remote.this_interpreter()
    live, row = dataclasses.asdict(interp.offsets), dataclasses.asdict(off)
    # 3.13: _Py_DebugOffsets agrees with every field of the row and fills the
    # two it leaves out (-1); 3.11 has no debug offsets: the row is used as is
    filled = {k for k, v in row.items() if v == -1 and live[k] != -1}
    assert filled == (
        {"runtime_interpreters_head", "interp_threads_head"} if off.debug_offsets >= 0 else set()
    )
    assert {k: v for k, v in live.items() if k not in filled} == {
        k: v for k, v in row.items() if k not in filled
    }
    off = interp.offsets
    import threading

    states = [
        walker.thread_states(mem, off, i) for i in walker.interpreters(mem, off, interp.runtime)
    ]
    natives = {t.native_id: t.thread_id for s in states for t in s}
    assert natives[threading.get_native_id()] == threading.get_ident()
    assert walker.read_str(mem, off, id("héllo wörld")) == "héllo wörld"


def test_the_committed_table_is_the_generators_output() -> None:
    from pathlib import Path

    from probing.pyframes import gen_offsets

    assert Path(gen_offsets.__file__).with_name("offsets_table.py").read_text() == (
        gen_offsets.render()
    )


def test_callsites_view_gives_the_innermost_user_frame() -> None:
    import pyarrow as pa

    from probing.node.bpf.pystacks import STACKS_SCHEMA, is_user_file
    from probing.node.sql import Database
    from probing.node.store import Store
    from probing.node.tables import install

    lib = f"{sys.prefix}/lib/python3/site-packages/torch/distributed/c10d.py"
    assert not is_user_file(lib) and not is_user_file("<frozen runpy>")
    assert is_user_file("/home/me/train.py")
    frames = [  # stack 7: torch frames inside the user's; stack 9: no user frame
        (7, 0, lib, "all_reduce", 10),
        (7, 1, "/home/me/train.py", "train_step", 42),
        (7, 2, "/home/me/train.py", "<module>", 60),
        (9, 0, lib, "barrier", 20),
        (9, 1, lib, "wrapper", 5),
    ]
    database = Database(Store())
    install(database)
    cols = list(zip(*frames, strict=True))
    batch = pa.RecordBatch.from_arrays(
        [*(pa.array(c, type=f.type) for c, f in zip(cols, STACKS_SCHEMA, strict=False)),
         pa.array([is_user_file(f[2]) for f in frames])],
        schema=STACKS_SCHEMA,
    )  # fmt: skip
    database.store.table("python", "stacks").append_batch(batch)
    rows = database.sql(
        "SELECT stack_id, callsite AS site FROM python.callsites ORDER BY 1"
    ).to_pylist()
    assert rows == [
        {"stack_id": 7, "site": "/home/me/train.py:42 train_step"},
        {"stack_id": 9, "site": f"{lib}:20 barrier"},
    ]


def test_a_garbled_line_table_gives_the_first_line_not_an_error() -> None:
    """A line table read from another process can be cut short or belong to
    reused memory (a traced stop once answered 500 with IndexError)."""
    import random

    from probing.pyframes.linetable import line_of

    rng = random.Random(7)
    for fmt in ("lnotab310", "locations"):
        for n in range(2000):
            table = bytes(rng.randrange(256) for _ in range(n % 40))
            assert isinstance(line_of(fmt, table, 10, 1000), int)
    assert line_of("locations", b"c\xb9=a\xc0\x99K!++\xcb\x97", 10, 1000) == 10


def test_a_c_string_is_read_up_to_its_nul_or_an_unmapped_page() -> None:
    """``cstring``: one reader of C strings in another process's memory (the
    CUDA kernel names, the injector's dlerror), page by page."""
    import ctypes
    import mmap

    from probing.pyframes.memory import PAGE, cstring

    buf = mmap.mmap(-1, 2 * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    buf[PAGE - 10 : PAGE - 6] = b"ab\0c"
    buf[PAGE - 5 : PAGE] = b"tail!"  # no NUL before the page that cannot be read
    assert libc.mprotect(base + PAGE, PAGE, 0) == 0  # PROT_NONE
    try:
        mem = ProcessMemory()
        assert cstring(mem, base + PAGE - 10) == b"ab"
        assert cstring(mem, base + PAGE - 5) == b"tail!"
        assert cstring(mem, base + PAGE - 10, limit=1) == b"a"
        with pytest.raises(OSError):
            cstring(mem, base + PAGE)
    finally:
        libc.mprotect(base + PAGE, PAGE, mmap.PROT_READ | mmap.PROT_WRITE)


def test_new_stacks_are_stored_frame_by_frame_innermost_first() -> None:
    """``PyStacks.collect`` on this process's own frames, as the BPF side
    records them (code, instruction offset; 0: a frame C owns): one row a
    frame, innermost first, each resolved as ``Resolver.frame`` resolves
    it, C's frames left out; a stack already stored is not again."""
    import ctypes

    import numpy as np

    from probing.node.bpf import pystacks
    from probing.node.store import Store

    class Stack(ctypes.Structure):  # struct py_stack (bpf/pyframes.h)
        _fields_ = [("depth", ctypes.c_uint32), ("pad", ctypes.c_uint32),
                    ("code", ctypes.c_uint64 * 32), ("offset", ctypes.c_int32 * 32)]  # fmt: skip

    def recorded(extra: int, c_at: int | None = None) -> Stack:
        if extra:
            return recorded(extra - 1, c_at)
        st, f, d = Stack(), sys._getframe(), 0
        while f is not None and d < 32:
            st.code[d], st.offset[d] = id(f.f_code), f.f_lasti * 2
            f, d = f.f_back, d + 1
        st.depth = d
        if c_at is not None:
            st.code[c_at] = 0
        return st

    class Map(dict):  # type: ignore[type-arg]
        def __getitem__(self, key: ctypes.c_uint32) -> Stack:
            return dict.__getitem__(self, key.value)  # type: ignore[no-any-return]

        def clear(self) -> None:
            pass

    stacks = Map({1: recorded(0), 2: recorded(3), 3: recorded(2, c_at=1), 4: recorded(1)})
    store = Store()
    try:
        py = pystacks.PyStacks(store)
        assert py.collect({"py_stacks": stacks}, np.array([2, 1, 3, 0, 1], np.uint32)) == 3
        rows = py.table.to_arrow().to_pylist()
        for sid in (1, 2, 3):
            st = stacks[ctypes.c_uint32(sid)]
            raws = [walker.RawFrame(st.code[i], st.offset[i]) for i in range(st.depth)]
            frames = py.resolver.frames(r for r in raws if r.code)
            mine = [r for r in rows if r["stack_id"] == sid]
            assert [r["depth"] for r in mine] == list(range(len(frames)))
            assert [(r["file"], r["func"], r["line"]) for r in mine] == [tuple(f) for f in frames]
            assert all(r["user"] == pystacks.is_user_file(r["file"]) for r in mine)
        names = [r["func"].split(".")[-1] for r in rows if r["stack_id"] == 2][:5]
        assert names == ["recorded"] * 4 + [
            test_new_stacks_are_stored_frame_by_frame_innermost_first.__name__
        ]
        assert len([r for r in rows if r["stack_id"] == 3]) == stacks[ctypes.c_uint32(3)].depth - 1
        assert py.collect({"py_stacks": stacks}, np.array([1, 2, 3, 4], np.uint32)) == 1
        assert {r["stack_id"] for r in py.table.to_arrow().to_pylist()} == {1, 2, 3, 4}
    finally:
        store.close()


def test_a_str_and_a_bytes_are_read_whole_short_long_or_at_a_mappings_end() -> None:
    """``read_str``, ``read_bytes``: the header and the data guessed in one
    read; longer, not ASCII, or where the guess runs past what is mapped,
    the data read apart."""
    import ctypes
    import mmap
    import sys

    from probing.pyframes.memory import PAGE

    mem, off = ProcessMemory(), remote.this_interpreter().offsets
    n = walker.STR_GUESS
    ascii_ = ("", "a", "x" * (n - 1), "y" * n, "z" * (n + 1), "w" * 1000)
    for text in (*ascii_, "héllo", "日本語", "😀"):
        assert walker.read_str(mem, off, id(text)) == text
    m = walker.BYTES_GUESS
    for data in (b"", b"a", bytes(range(256)), bytes(m + 1), bytes(5000)):
        assert walker.read_bytes(mem, off, id(data)) == data
    text = "a str that ends where the readable memory does"
    buf = mmap.mmap(-1, 2 * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    at = base + PAGE - sys.getsizeof(text)
    ctypes.memmove(at, id(text), sys.getsizeof(text))  # a copy of the object, at the end
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(base + PAGE, PAGE, 0) == 0  # PROT_NONE after it
    try:
        assert walker.read_str(mem, off, at) == text
    finally:
        libc.mprotect(base + PAGE, PAGE, mmap.PROT_READ | mmap.PROT_WRITE)
