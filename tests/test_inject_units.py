"""Injection pieces that need no ptrace: both architectures, ELF look-ups, boot.c."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from probing import elf, proc
from probing.errors import AccessDenied
from probing.inject import build, injector
from probing.inject.arch import X86_64, AArch64

EM = {"EM_X86_64": 62, "EM_AARCH64": 183}


def make_elf(machine: str, symbols: dict[str, int], vaddr: int = 0, et_dyn: bool = True) -> bytes:
    """A minimal ELF64 with one PT_LOAD and a .dynsym/.dynstr naming ``symbols``."""
    dynstr = b"\0" + b"".join(n.encode() + b"\0" for n in symbols)
    syms = [b"\0" * 24]
    off = 1
    for name, value in symbols.items():
        syms.append(struct.pack("<IBBHQQ", off, 0x12, 0, 1, value, 16))  # GLOBAL FUNC, shndx 1
        off += len(name) + 1
    dynsym = b"".join(syms)
    shstr = b"\0.dynstr\0.dynsym\0.shstrtab\0"
    ehsize, phsize, shsize = 64, 56, 64
    data_at = ehsize + phsize
    dynstr_at, dynsym_at = data_at, data_at + len(dynstr)
    shstr_at = dynsym_at + len(dynsym)
    sh_at = (shstr_at + len(shstr) + 7) & ~7
    header = (
        b"\x7fELF\x02\x01\x01" + b"\0" * 9
        + struct.pack("<HHIQQQIHHHHHH", 3 if et_dyn else 2, EM[machine], 1, vaddr, ehsize,
                      sh_at, 0, ehsize, phsize, 1, shsize, 4, 3)
    )  # fmt: skip
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, vaddr, vaddr, sh_at, sh_at, 0x1000)
    shdrs = b"\0" * shsize + b"".join(
        struct.pack("<IIQQQQIIQQ", *fields)
        for fields in (
            (1, 3, 2, vaddr + dynstr_at, dynstr_at, len(dynstr), 0, 0, 1, 0),  # .dynstr
            (9, 11, 2, vaddr + dynsym_at, dynsym_at, len(dynsym), 1, 1, 8, 24),  # .dynsym
            (17, 3, 0, 0, shstr_at, len(shstr), 0, 0, 1, 0),  # .shstrtab
        )
    )
    body = header + phdr + dynstr + dynsym + shstr
    return body + b"\0" * (sh_at - len(body)) + shdrs


# --- architectures -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", [X86_64, AArch64])
def test_registers_round_trip_and_call_setup(arch) -> None:
    raw = struct.pack(f"<{len(arch.reg_names)}Q", *range(100, 100 + len(arch.reg_names)))
    regs = arch.unpack(raw)
    assert arch.pack(regs) == raw
    sp_name = "rsp" if arch is X86_64 else "sp"
    arch.set(regs, sp_name, 0x7FFF_0000_1238)
    saved = list(regs)
    call = arch.prepare_call(saved, 0x4000, (0x11, 0x22), 0x9000)
    assert saved == regs, "the saved registers are never edited"
    assert arch.get(call, sp_name) % 16 == 0
    assert arch.get(call, sp_name) <= 0x7FFF_0000_1238 - 128  # below x86's red zone
    if arch is X86_64:
        assert (arch.get(call, "rdi"), arch.get(call, "rsi")) == (0x11, 0x22)
        assert arch.get(call, "r11") == 0x4000 and arch.pc(call) == 0x9000
        assert arch.get(call, "orig_rax") == (1 << 64) - 1  # no syscall restart over us
        done = list(call)
        arch.set(done, "rip", 0x9000 + len(arch.trap_stub))  # int3 leaves rip past itself
    else:
        assert (arch.get(call, "x0"), arch.get(call, "x1")) == (0x11, 0x22)
        assert arch.pc(call) == 0x4000 and arch.get(call, "x30") == 0x9000
        done = list(call)
        arch.set(done, "pc", 0x9000)  # brk does not advance pc
    arch.set(done, arch.ret_reg, 0xABC)
    assert arch.trapped_after_call(done, 0x9000)
    assert not arch.trapped_after_call(call, 0x9000 + 4)
    assert arch.result(done) == 0xABC


@pytest.mark.parametrize("arch", [X86_64, AArch64])
def test_syscall_setup_and_instruction_search(arch) -> None:
    regs = arch.unpack(bytes(arch.regset_size()))
    sc = arch.prepare_syscall(regs, arch.sys_mmap, (0, 4096, 5, 0x22, -1, 0), 0x7000)
    assert arch.pc(sc) == 0x7000
    nr_reg = "rax" if arch is X86_64 else "x8"
    assert arch.get(sc, nr_reg) == arch.sys_mmap
    assert arch.get(sc, arch.arg_regs[4]) == (1 << 64) - 1  # fd -1
    after = list(sc)
    arch.set(after, "rip" if arch is X86_64 else "pc", 0x7000 + len(arch.syscall_insn))
    assert arch.stepped_over_syscall(after, 0x7000)
    # an occurrence off the instruction grid is no instruction on aarch64
    code = b"\x90" * 2 + arch.syscall_insn + b"\x90" * 2 + arch.syscall_insn
    found = arch.find_syscall_insn(code, 0x1000)
    assert found == (0x1002 if arch is X86_64 else 0x1008)
    assert arch.find_syscall_insn(b"\x90" * 64, 0x1000) is None


# --- ELF and maps -----------------------------------------------------------------------------


@pytest.mark.parametrize("machine", ["EM_X86_64", "EM_AARCH64"])
def test_symbols_with_load_bias(tmp_path: Path, machine: str) -> None:
    lib = tmp_path / "libpython3.12.so.1.0"
    lib.write_bytes(make_elf(machine, {"PyGILState_Ensure": 0x1234, "Py_Version": 0x2000}))
    syms = elf.Symbols(str(lib), ("PyGILState_Ensure", "Py_Version", "absent"))
    assert syms.machine == machine
    assert syms.address("PyGILState_Ensure", 0x7F00_0000_0000) == 0x7F00_0000_1234
    assert syms.address("absent", 0x7F00_0000_0000) is None
    exe = tmp_path / "python3.10"  # a non-PIE static python: addresses are absolute
    exe.write_bytes(make_elf(machine, {"PyRun_SimpleStringFlags": 0x401234}, 0x400000, False))
    assert (
        elf.Symbols(str(exe), ("PyRun_SimpleStringFlags",)).address(
            "PyRun_SimpleStringFlags", 0x400000
        )
        == 0x401234
    )
    assert elf.version_from_name(lib.name) == (3, 12)
    assert elf.version_from_name(exe.name) == (3, 10)


def test_maps_objects_and_libc() -> None:
    text = textwrap.dedent(
        """\
        55d0a0000000-55d0a0001000 r--p 00000000 08:01 11 /usr/bin/python3.11
        55d0a0001000-55d0a0300000 r-xp 00001000 08:01 11 /usr/bin/python3.11
        7f0000000000-7f0000028000 r--p 00000000 08:01 22 /usr/lib/x86_64-linux-gnu/libc.so.6
        7f0000028000-7f000019d000 r-xp 00028000 08:01 22 /usr/lib/x86_64-linux-gnu/libc.so.6
        7f1000000000-7f1000001000 r-xp 00000000 08:01 33 /usr/lib/ld-linux-x86-64.so.2
        7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0  [stack]
        """
    )
    maps = proc.parse_maps(text)
    assert len(maps) == 6 and maps[-1].path == "[stack]"
    objs = elf.loaded_objects(maps)
    assert set(objs) == {
        "/usr/bin/python3.11",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/ld-linux-x86-64.so.2",
    }
    libc = elf.find_libc(objs)
    assert libc is not None and libc.base == 0x7F0000000000
    assert [m.start for m in libc.executable_maps()] == [0x7F0000028000]


# --- the boot library, in this very process ----------------------------------------------------


def test_boot_library_runs_source_in_a_thread_that_takes_the_gil(tmp_path: Path) -> None:
    """probing_boot() with this interpreter's own C API: the thread runs our source."""
    lib = ctypes.CDLL(build.library_path())
    api = ctypes.pythonapi
    addr = {n: ctypes.cast(getattr(api, n), ctypes.c_void_p).value for n in injector.PY_API}
    target = injector.Inspection(
        os.getpid(), "self", os.getuid(), X86_64, sys.version_info[:2], addr, 0, None,
        elf.LoadedObject("/", 0, ()), {},
    )  # fmt: skip
    marker = tmp_path / "ran"
    block = injector.boot_args_block(target, f"open({str(marker)!r}, 'w').write('yes')")
    buf = ctypes.create_string_buffer(block, len(block))
    assert lib.probing_boot(buf) == 0
    deadline = time.monotonic() + 10
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # lets the GIL go to the boot thread
    assert marker.read_text() == "yes"
    bad = ctypes.create_string_buffer(b"\0" * 64, 64)
    assert lib.probing_boot(bad) == -1  # wrong magic: nothing started


def test_bootstrap_gives_main_thread_back() -> None:
    """threading imported first in another thread still names the real main thread."""
    code = textwrap.dedent(
        """
        import _thread, os, sys, time
        sys.path.insert(0, sys.argv[1])
        done = []
        def boot():
            from probing.inject import bootstrap
            bootstrap._main_thread_fixed(False)
            done.append(1)
        _thread.start_new_thread(boot, ())
        while not done:
            time.sleep(0.01)
        import threading
        assert threading.main_thread().ident == threading.get_ident(), "main thread lost"
        assert threading.current_thread() is threading.main_thread()
        assert threading.main_thread().native_id == os.getpid()
        print("ok")
        """
    )
    repo = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run(
        [sys.executable, "-c", code, repo], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "ok", out.stderr
    assert out.stderr == "", "the interpreter's exit complained"


# --- error messages -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("euid", "caps", "uid", "needle"),
    [
        (0, 0, 1000, "without CAP_SYS_PTRACE"),
        (1000, 0, 0, "belongs to root: run probing as root"),
    ],
)
def test_permission_error_names_the_fix(monkeypatch, euid, caps, uid, needle) -> None:
    import probing.checks

    monkeypatch.setattr(os, "geteuid", lambda: euid)
    monkeypatch.setattr(probing.checks, "effective_caps", lambda *a: caps)
    err = injector.permission_error(42, uid, "ptrace")
    assert isinstance(err, AccessDenied)
    assert needle in str(err) and "pid 42" in str(err)
    assert "\n" not in str(err)


def test_inspect_refuses_bad_pids() -> None:
    from probing.errors import AttachError, NoSuchProcess

    with pytest.raises(NoSuchProcess):
        injector.inspect(0)
    with pytest.raises(AttachError, match="itself"):
        injector.inspect(os.getpid())


# --- the borrowed thread's call to probing_boot --------------------------------------------------


class _Mem:
    """Target memory as a dict of address -> bytes."""

    def __init__(self, cells: dict[int, bytes]) -> None:
        self.cells = cells

    def read(self, addr: int, size: int) -> bytes:
        if addr not in self.cells:
            raise OSError(5, "Input/output error")
        return self.cells[addr][:size]


def test_probing_boot_is_found_from_dlopens_handle(monkeypatch) -> None:
    prep = injector.Prepared(0, 4096, b"", boot_value=0x1234, lib_min_vaddr=0)
    bias = 0x7F0000000000
    handle = 0x5555000
    mem = _Mem({handle: bias.to_bytes(8, "little"), bias: b"\x7fELF\x02"})

    def maps_lookup(*args: object) -> int:
        raise AssertionError("the maps are read only when the handle says nothing")

    monkeypatch.setattr(injector, "_symbol_in", maps_lookup)
    assert injector._boot_address(None, mem, handle, prep, "lib.so") == bias + 0x1234  # type: ignore[arg-type]


@pytest.mark.parametrize("cells", [{}, {0x5555000: (0x1000).to_bytes(8, "little")}])
def test_probing_boot_falls_back_to_the_maps(monkeypatch, cells: dict[int, bytes]) -> None:
    class T:
        pid = 42

    prep = injector.Prepared(0, 4096, b"", boot_value=0x1234, lib_min_vaddr=0)
    monkeypatch.setattr(injector, "_symbol_in", lambda pid, lib, name: 0xABC)
    got = injector._boot_address(T(), _Mem(cells), 0x5555000, prep, "lib.so")  # type: ignore[arg-type]
    assert got == 0xABC


def test_the_page_image_holds_stub_path_and_args() -> None:
    lib = build.library_path()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)
        target = injector.inspect(proc.pid)
        prep = injector.prepare(target, lib, "pass")
    finally:
        proc.kill()
        proc.wait()
    assert prep.image.startswith(target.arch.trap_stub)
    assert prep.image[injector.PATH_AT :].startswith(lib.encode() + b"\0")
    assert prep.image[injector.ARGS_AT :] == injector.boot_args_block(target, "pass")
    assert prep.size % injector.PAGE == 0 and prep.size >= len(prep.image)
    assert prep.boot_value == elf.Symbols(lib, ("probing_boot",)).values["probing_boot"]


def test_a_probe_socket_gone_after_injection_is_waited_for_then_named(
    monkeypatch, runtime_dir: Path
) -> None:
    """An engine that said it serves the probe, whose socket is not there:
    one that appears meanwhile (the guest handed to the next engine) is
    used; one that never does is an AttachError naming the engine's log."""
    import socket
    import threading

    import probing.inject
    from probing import paths
    from probing.cli import client
    from probing.inject.injector import InjectResult

    pid = os.getpid()  # a live process of ours, with no probe socket yet
    sock_path = paths.user_dir() + f"/{pid}.sock"
    os.makedirs(paths.user_dir(), mode=0o700, exist_ok=True)
    said = InjectResult(pid, False, sock_path, engine_pid=4321)  # ... by an engine
    monkeypatch.setattr(probing.inject, "inject", lambda p, timeout: said)
    with pytest.raises(client.AttachError) as err:
        client.attach(pid, inject=True, timeout=0.3)
    assert f"engine (pid 4321) took process {pid}" in str(err.value)
    assert "engine-*.log" in (err.value.hint or "")

    listener = socket.socket(socket.AF_UNIX)
    late = threading.Timer(0.2, lambda: listener.bind(sock_path))
    late.start()
    try:
        got = client.attach(pid, inject=True, timeout=5.0)
        assert got.transport.path == sock_path
    finally:
        late.join()
        listener.close()
        os.unlink(sock_path)


def test_a_free_threaded_target_is_refused_in_one_line_before_anything_is_done(
    monkeypatch,
) -> None:
    from probing.errors import UnsupportedPython
    from probing.pyframes import remote

    runtime = remote.this_runtime()
    injector._refuse_free_threaded(os.getpid(), "3.11", runtime)  # this GIL build: let be
    monkeypatch.setattr(remote, "free_threaded", lambda mem, at, base: at == runtime)
    with pytest.raises(UnsupportedPython) as err:
        injector._refuse_free_threaded(os.getpid(), "3.14", runtime)
    msg = str(err.value)
    assert "\n" not in msg and f"process {os.getpid()} runs a free-threaded CPython (3.14t)" in msg
