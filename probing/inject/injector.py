"""``probing inject --pid P``: start a probe in a Python process that has none.

1. Look before touching: the pid exists, is not stopped or traced, is a
   Python we support, we may ptrace it, and it has no probe yet.
2. Borrow one thread at a safe point (in a syscall other than mmap/brk/...,
   or running outside libc and the dynamic loader, so it holds no malloc or
   loader lock): PTRACE_SEIZE + PTRACE_INTERRUPT; the other threads run on.
3. Single-step a syscall instruction found in libc to ``mmap`` a private
   page for a 4-byte trampoline and the call arguments (no code of the
   target is overwritten), call ``dlopen(libprobing_boot.so)`` then
   ``probing_boot(args)``, which starts a thread that takes the GIL itself
   and runs ``bootstrap.py``; ``munmap`` the page; restore every register
   exactly (an interrupted syscall restarts) and detach.
4. Wait for the bootstrap's status file and the probe's socket.

A target in another mount namespace (a containerised agent's job) loads
the library and the guest from a stage in its runtime root, and its engine
is started here (``stage``).

SIGINT/SIGTERM/SIGHUP are held while a thread is borrowed and delivered
after it is given back, so an interrupted injector never leaves a thread
stopped or running our code.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pwd
import shutil
import signal
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from probing import elf, paths, proc, pyframes
from probing.errors import (
    AccessDenied,
    AttachError,
    NoSuchProcess,
    ProbingError,
    UnsupportedPython,
    no_such_pid,
)
from probing.guest import place
from probing.inject import build, stage
from probing.inject.arch import Arch, native
from probing.inject.ptrace import CallFailed, RegState, TargetGone, Tracee, TraceeMemory

PAGE = 4096
RTLD_NOW = 2
PROT_READ, PROT_EXEC = 1, 4
MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
MAGIC = struct.unpack("<Q", b"probing1")[0]
CALL_TIMEOUT_S = 10.0
SAFE_POINT_TRIES = 50
PY_API = ("Py_IsInitialized", "PyGILState_Ensure", "PyGILState_Release", "PyRun_SimpleStringFlags")


@dataclass
class Inspection:
    """What we learned about the process before touching it."""

    pid: int
    comm: str
    uid: int
    arch: type[Arch]
    python: tuple[int, int]
    py_api: dict[str, int]
    dlopen: int
    dlerror: int | None
    libc: elf.LoadedObject
    objects: dict[str, elf.LoadedObject] = field(repr=False)
    prepared: Prepared | None = field(default=None, repr=False)  # set before borrowing


@dataclass
class InjectResult:
    pid: int
    already: bool
    socket: str
    python: str = ""
    tid: int = 0
    stopped_s: float = 0.0  # how long the borrowed thread was stopped
    total_s: float = 0.0
    engine_pid: int = 0  # the node's engine, which serves the probe's socket


# --- 1. look before touching ---------------------------------------------------------


def _status(pid: int) -> dict[str, str]:
    try:
        return proc.status(pid)
    except ProcessLookupError:
        raise no_such_pid(pid) from None


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def permission_error(pid: int, uid: int, what: str) -> AccessDenied:
    """The one-line reason ptrace is refused here, with the fix that applies."""
    from probing.checks import CAP_SYS_PTRACE, effective_caps, has_cap

    me = os.geteuid()
    cap = has_cap(effective_caps(), CAP_SYS_PTRACE)
    try:
        scope = int(proc.node("sys/kernel/yama/ptrace_scope"))
    except (OSError, ValueError):
        scope = 0
    if me == 0 and not cap:
        hint = (
            "probing runs as root without CAP_SYS_PTRACE, as in a container started "
            "without it: docker run --cap-add SYS_PTRACE (or securityContext "
            "capabilities add SYS_PTRACE), or run probing on the host"
        )
    elif uid != me and not cap:
        owner = _user(uid)
        hint = f"the process belongs to {owner}: run probing as {owner}"
        hint += " or as root" if uid != 0 else ""
    elif scope >= 1 and not cap:
        hint = (
            f"kernel.yama.ptrace_scope={scope} allows only a parent to trace: run as root, "
            "grant CAP_SYS_PTRACE, or sysctl -w kernel.yama.ptrace_scope=0"
        )
    else:
        hint = "a security module (SELinux, AppArmor, seccomp) denies ptrace here"
    return AccessDenied(f"not permitted to {what} pid {pid}", pid=pid, hint=hint)


def inspect(pid: int) -> Inspection:
    """Everything injection needs, read without stopping anything."""
    if pid <= 0:
        raise no_such_pid(pid, "{pid} is not a valid pid")
    if pid == os.getpid():
        raise AttachError("probing cannot inject into itself", pid=pid)
    if place.is_engine(pid):  # it would serve itself, and never be idle
        raise AttachError(
            f"process {pid} is probing's own engine, not a job",
            pid=pid,
            hint="probing engine list shows the engines; probing ps the processes to probe",
        )
    st = _status(pid)
    comm = st.get("Name", "?").strip()
    uid = int(st.get("Uid", "0").split()[0])
    state = st.get("State", "?").strip()
    tracer = int(st.get("TracerPid", "0").strip() or 0)
    if state.startswith(("Z", "X")):
        raise NoSuchProcess(f"process {pid} ({comm}) has exited (zombie)", pid=pid)
    if tracer:
        tcomm = _status(tracer).get("Name", "?").strip() if proc.exists(tracer) else "?"
        raise AttachError(
            f"process {pid} ({comm}) is being traced by pid {tracer} ({tcomm})",
            pid=pid,
            hint="detach the debugger (gdb: detach; strace: Ctrl-C) and retry",
        )
    if state.startswith("T"):
        raise AttachError(
            f"process {pid} ({comm}) is stopped", pid=pid, hint=f"resume it with kill -CONT {pid}"
        )
    try:
        maps = proc.maps(pid)
        proc.readlink(pid, "exe")  # needs the same access as ptrace
    except PermissionError:
        raise permission_error(pid, uid, "trace") from None
    except (FileNotFoundError, ProcessLookupError):
        raise NoSuchProcess(f"process {pid} has exited", pid=pid) from None
    arch = native()
    objs = elf.loaded_objects(maps)
    py_api: dict[str, int] = {}
    python: tuple[int, int] | None = None
    runtime: int | None = None
    for obj in elf.python_candidates(pid, objs):
        syms = elf.symbols_of(pid, obj, (*PY_API, "Py_Version", "_PyRuntime"))
        if syms is None or "PyGILState_Ensure" not in syms.values:
            continue
        if syms.machine != arch.elf_machine:
            raise AttachError(f"{obj.path} is {syms.machine}, not {arch.name}", pid=pid)
        py_api = {name: syms.address(name, obj.base) or 0 for name in PY_API}
        python = _read_version(pid, syms, obj) or elf.version_from_name(obj.name)
        runtime = syms.address("_PyRuntime", obj.base)
        break
    if not py_api:
        exe = _exe(pid)
        raise AttachError(
            f"process {pid} ({comm}) is not a Python process: no libpython is mapped "
            f"and {exe} exports no Python C API",
            pid=pid,
        )
    missing = [n for n, a in py_api.items() if not a]
    if missing or python is None:
        raise AttachError(
            f"process {pid} ({comm}): cannot find {', '.join(missing) or 'the Python version'}",
            pid=pid,
        )
    version = f"{python[0]}.{python[1]}"
    if version not in pyframes.SUPPORTED:  # the versions whose frame layouts probing knows
        raise AttachError(
            f"process {pid} runs Python {version}, which probing does not support "
            f"(supported: {', '.join(pyframes.SUPPORTED)})",
            pid=pid,
        )
    _refuse_free_threaded(pid, version, runtime)
    libc = elf.find_libc(objs)
    if libc is None:
        raise AttachError(f"process {pid} ({comm}) maps no libc to call dlopen from", pid=pid)
    dlopen, dlerror = _find_dlopen(pid, libc, objs)
    return Inspection(pid, comm, uid, arch, python, py_api, dlopen, dlerror, libc, objs)


def _refuse_free_threaded(pid: int, version: str, runtime: int | None) -> None:
    """A free-threaded build (3.13t, 3.14t) is refused before anything is
    done to it: its frames and objects are not laid out as the table says."""
    if runtime is None:
        return
    from probing.pyframes import remote
    from probing.pyframes.memory import ProcessMemory

    try:
        threaded = remote.free_threaded(ProcessMemory(pid), runtime, pyframes.offsets_for(version))
    except (OSError, ProbingError):
        return
    if threaded:
        raise UnsupportedPython(
            f"process {pid} " + remote.FREE_THREADED.format(version=version), pid=pid
        )


def _exe(pid: int) -> str:
    try:
        return proc.readlink(pid, "exe")
    except OSError:
        return "its executable"


def _read_version(pid: int, syms: elf.Symbols, obj: elf.LoadedObject) -> tuple[int, int] | None:
    """``Py_Version`` (3.11+) from the target's memory: the truth for a static python."""
    addr = syms.address("Py_Version", obj.base)
    if addr is None:
        return None
    from probing.pyframes.memory import ProcessMemory

    try:
        hexversion = int.from_bytes(ProcessMemory(pid).read(addr, 4), "little")
    except (OSError, ProbingError):
        return None
    return (hexversion >> 24) & 0xFF, (hexversion >> 16) & 0xFF


def _find_dlopen(
    pid: int, libc: elf.LoadedObject, objs: dict[str, elf.LoadedObject]
) -> tuple[int, int | None]:
    names = ("dlopen", "__libc_dlopen_mode", "dlerror")
    # glibc >= 2.34 and musl export dlopen (a hash look-up); only older glibc
    # needs __libc_dlopen_mode, which may mean reading the whole symbol table
    syms = elf.symbols_of(pid, libc, ("dlopen", "dlerror"))
    if syms is not None and not syms.address("dlopen", libc.base):
        syms = elf.symbols_of(pid, libc, names)
    if syms is None:
        raise AttachError(f"cannot read {libc.path} of process {pid}", pid=pid)
    for name in ("dlopen", "__libc_dlopen_mode"):
        addr = syms.address(name, libc.base)
        if addr:
            return addr, syms.address("dlerror", libc.base)
    libdl = elf.find_libdl(objs)
    dl = elf.symbols_of(pid, libdl, names) if libdl else None
    if libdl and dl and dl.address("dlopen", libdl.base):
        return dl.address("dlopen", libdl.base) or 0, dl.address("dlerror", libdl.base)
    raise AttachError(f"no dlopen in process {pid}'s libc ({libc.path})", pid=pid)


# --- 2-3. borrow a thread and make it call ------------------------------------------------


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP while a thread of the target is borrowed."""
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _threads(pid: int) -> list[int]:
    try:
        tids = proc.tasks(pid)
    except ProcessLookupError:
        raise TargetGone(f"process {pid} is gone", pid=pid) from None
    return sorted(tids, key=lambda t: t != pid)  # the main thread first


def _at_safe_point(target: Inspection, tracee: Tracee, unsafe: list[tuple[int, int]]) -> bool:
    nr = proc.task_syscall(tracee.tid, target.pid)
    if nr >= 0:
        return nr not in target.arch.memory_syscalls
    pc = target.arch.pc(tracee.get_regs())
    return not any(lo <= pc < hi for lo, hi in unsafe)


def _unsafe_ranges(target: Inspection) -> list[tuple[int, int]]:
    """Code where a thread may hold malloc's or the dynamic loader's lock."""
    out = []
    for obj in target.objects.values():
        if obj is target.libc or obj.name.startswith("ld-"):
            out += [(m.start, m.end) for m in obj.executable_maps()]
    return out


def _borrow(target: Inspection) -> Tracee:
    """Stop one thread at a safe point; every other thread keeps running."""
    unsafe = _unsafe_ranges(target)
    last: Exception | None = None
    for tid in _threads(target.pid):
        tracee = Tracee(target.pid, tid, target.arch)
        try:
            tracee.seize_and_stop()
        except OSError as err:
            tracee.attached = False
            if err.errno == 1:  # EPERM
                raise permission_error(target.pid, target.uid, "ptrace") from None
            last = err
            continue  # the thread exited meanwhile
        try:
            for _ in range(SAFE_POINT_TRIES):
                if _at_safe_point(target, tracee, unsafe):
                    return tracee
                tracee.resume_briefly(0.001)
        except (OSError, CallFailed) as err:
            last = err
        tracee.detach()
    if last and isinstance(last, TargetGone):
        raise last
    raise AttachError(
        f"no thread of process {target.pid} reached a safe point (all busy in libc or the "
        "dynamic loader)",
        pid=target.pid,
        hint="retry in a moment",
    )


def _find_syscall_insn(target: Inspection, mem: TraceeMemory) -> int:
    for m in target.libc.executable_maps():
        for at in range(m.start, m.end, 1 << 16):
            chunk = mem.read(at, min(1 << 16, m.end - at) + 8)
            found = target.arch.find_syscall_insn(chunk, at)
            if found is not None:
                return found
    raise AttachError(f"no syscall instruction in {target.libc.path}", pid=target.pid)


def boot_args_block(target: Inspection, source: str) -> bytes:
    """``struct probing_boot_args`` (see boot.c) followed by the source."""
    src = source.encode() + b"\0"
    api = target.py_api
    head = struct.pack(
        "<QQQQQQ",
        MAGIC,
        48 + len(src),
        api["Py_IsInitialized"],
        api["PyGILState_Ensure"],
        api["PyGILState_Release"],
        api["PyRun_SimpleStringFlags"],
    )
    return head + src


class Prepared(NamedTuple):
    """What a borrowed thread's calls need, worked out before it is stopped:
    the thread is then held only for the ptrace round trips themselves."""

    insn: int  # a syscall instruction in the target's libc
    size: int  # of the private page (stub, library path, boot args)
    image: bytes  # the page's contents, written in one go
    boot_value: int  # probing_boot's st_value in the library
    lib_min_vaddr: int  # where file offset 0 lands, relative to the load bias
    lib_here: str = ""  # the library from here, where the target names it otherwise (stage)


STUB_AT, PATH_AT, ARGS_AT = 0, 64, 512  # offsets in the private page


def prepare(target: Inspection, lib: str, source: str, lib_here: str = "") -> Prepared:
    """The page's contents; ``lib`` is the library as the target names it
    (``lib_here``: the same file from here, where that differs)."""
    arch = target.arch
    lib_bytes = lib.encode() + b"\0"
    if len(lib_bytes) > ARGS_AT - PATH_AT:
        raise AttachError(f"library path too long: {lib}")
    args = boot_args_block(target, source)
    image = bytearray(ARGS_AT + len(args))
    image[STUB_AT : STUB_AT + len(arch.trap_stub)] = arch.trap_stub
    image[PATH_AT : PATH_AT + len(lib_bytes)] = lib_bytes
    image[ARGS_AT:] = args
    size = (len(image) + PAGE - 1) // PAGE * PAGE
    mem = TraceeMemory(target.pid)
    try:
        insn = _find_syscall_insn(target, mem)
    finally:
        mem.close()
    # opened as named, never through realpath: a path through /proc/P/root
    # must keep the target's mounts (a chroot whose /tmp is a bind mount of
    # ours resolves, by realpath, to the directory under the mount)
    syms = elf.Symbols(lib_here or lib, ("probing_boot",))
    if "probing_boot" not in syms.values:
        raise AttachError(f"{lib} has no probing_boot", hint="rebuild it: make setup")
    return Prepared(
        insn, size, bytes(image), syms.values["probing_boot"], syms.min_vaddr, lib_here or lib
    )


def _boot_address(
    target: Inspection, mem: TraceeMemory, handle: int, prep: Prepared, lib: str
) -> int:
    """``probing_boot`` in the target: dlopen's handle starts with the load
    bias (glibc's ``link_map.l_addr``, musl's ``dso.base``), checked against
    the ELF header it must point at; else looked up in the maps."""
    try:
        bias = int.from_bytes(mem.read(handle, 8), "little")
        if mem.read(bias + prep.lib_min_vaddr, 4) == b"\x7fELF":
            return bias + prep.boot_value
    except OSError:
        pass
    return _symbol_in(target.pid, lib, "probing_boot")


def _run_in_target(target: Inspection, tracee: Tracee, lib: str, source: str) -> None:
    prep = target.prepared or prepare(target, lib, source)
    mem = TraceeMemory(target.pid)
    state = tracee.save_state()
    saved = state[0]
    page = 0
    try:
        page = tracee.syscall(
            saved,
            target.arch.sys_mmap,
            (0, prep.size, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0),
            prep.insn,
        )
        if page >= (1 << 64) - 4096:  # -errno
            page = 0
            raise AttachError(f"mmap in process {target.pid} failed", pid=target.pid)
        mem.write(page, prep.image)
        stub = page + STUB_AT
        handle = tracee.call(saved, target.dlopen, (page + PATH_AT, RTLD_NOW), stub, CALL_TIMEOUT_S)
        if not handle:
            reason = ""
            if target.dlerror:
                msg = tracee.call(saved, target.dlerror, (), stub, CALL_TIMEOUT_S)
                reason = mem.read_cstring(msg) if msg else ""
            raise AttachError(
                f"process {target.pid} could not load {lib}: {reason or 'dlopen failed'}",
                pid=target.pid,
                hint="the target's user must be able to read probing's install",
            )
        boot = _boot_address(target, mem, handle, prep, prep.lib_here or lib)
        rc = tracee.call(saved, boot, (page + ARGS_AT,), stub, CALL_TIMEOUT_S)
        if rc != 0:
            raise AttachError(f"the boot thread did not start in {target.pid} (error {rc})")
    finally:
        try:
            if tracee.attached:
                _give_back(tracee, state, (page, prep.size), prep.insn)
        finally:
            mem.close()


def _give_back(tracee: Tracee, state: RegState, mapping: tuple[int, int], insn: int) -> None:
    """Unmap our page (when there is one), restore every register, detach."""
    try:
        tracee.get_regs()
    except OSError:  # still running our call (it timed out): stop it first
        tracee.stop()
    page, size = mapping
    if page:
        try:
            tracee.syscall(state[0], tracee.arch.sys_munmap, (page, size), insn)
        except (OSError, ProbingError):
            pass  # a leaked private page is harmless; a stopped thread is not
    tracee.restore_state(state)
    tracee.detach()


def _symbol_in(pid: int, lib: str, name: str) -> int:
    """``name`` of ``lib`` (a path from here) where ``pid`` mapped it (the same file)."""
    real = lib  # as named: see prepare
    want = os.stat(real)
    for obj in elf.loaded_objects(proc.maps(pid)).values():
        try:
            st = os.stat(elf.host_path(pid, obj.path))
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            addr = elf.Symbols(real, (name,)).address(name, obj.base)
            if addr:
                return addr
    raise AttachError(f"{lib} is not mapped in process {pid} after dlopen", pid=pid)


# --- 4. the bootstrap and its report ---------------------------------------------------------


def guest_dir() -> str:
    """Where the guest's files are: the target loads them from there."""
    from probing import guest

    return os.path.dirname(os.path.abspath(guest.__file__))


def bootstrap_source(status: str, guest: str = "", spawn: bool = True) -> str:
    """The bootstrap with its ``ARGS``: the status file and the guest's
    directory as the target names them; ``spawn``: whether the guest may
    start the engine (with this Python) when none answers."""
    from probing.inject import bootstrap

    with open(bootstrap.__file__) as f:
        body = f.read()
    args = {
        "status": status,
        "guest": guest or guest_dir(),
        "engine_python": sys.executable,  # the engine's key names it, started or not
        "spawn": spawn,
    }
    namespace = f"{{'__name__': {bootstrap.NAME!r}, 'ARGS': {args!r}}}"
    return f"__import__('builtins').exec({body!r}, {namespace})\n"


def _status_dir(target: Inspection, there: stage.Elsewhere | None) -> tuple[str, str]:
    """A directory the target writes its report in: from here, and as it names it."""
    d = tempfile.mkdtemp(prefix="probing-inject-", dir=there.here(there.root) if there else None)
    if os.geteuid() == 0 and target.uid != 0:
        os.chown(d, target.uid, -1)  # the target writes its report here
    return d, os.path.join(there.root, os.path.basename(d)) if there else d


def _wait_report(target: Inspection, status: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(status) as f:
                return json.load(f)
        except (FileNotFoundError, ValueError):
            pass
        if not proc.exists(target.pid):
            raise NoSuchProcess(f"process {target.pid} exited during injection", pid=target.pid)
        time.sleep(0.001)
    raise AttachError(
        f"process {target.pid}: the probe did not start within {timeout:g} s",
        pid=target.pid,
        hint="a thread holds the GIL and does not let go (C code that never releases it); "
        "the probe starts as soon as it is released",
    )


def _alive(pid: int, wait: bool = False) -> bool:
    """Whether ``pid`` still runs; ``wait``: give a dying process a second to show it."""
    deadline = time.monotonic() + (1.0 if wait else 0.0)
    while True:
        stat = proc.task_stat(pid, pid)  # the main thread's state is the process's
        if stat is None or stat[0] in ("Z", "X"):
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.01)


def existing_probe(pid: int) -> str | None:
    from probing.procs import socket_alive

    try:
        path = paths.find_socket(pid)
    except paths.UnsafePath:
        return None  # the probe started now refuses that directory and says why
    return path if path and socket_alive(path) else None


def inject(pid: int, *, timeout: float = 30.0) -> InjectResult:
    """Start a probe in ``pid``: the guest inside it, handed to the node's
    engine (started when none runs); a no-op (``already=True``) when it has
    one. ``timeout`` covers the engine's start."""
    t0 = time.monotonic()
    found = existing_probe(pid)
    if found:
        return InjectResult(pid, True, found, total_s=time.monotonic() - t0)
    target = inspect(pid)
    lib, lib_here, guest = build.library_path(), "", guest_dir()
    environ = proc.environ(pid)
    there = stage.elsewhere(pid, target.uid, environ)  # None: our mount namespace
    if there is not None:  # the target loads a stage, and its engine is started here
        lib, lib_here, guest = stage.stage(there, lib, guest)
        stage.start_engine(there, environ)
    status_dir, status_dir_there = _status_dir(target, there)
    status = os.path.join(status_dir, "status.json")
    try:
        source = bootstrap_source(
            os.path.join(status_dir_there, "status.json"), guest, spawn=there is None
        )
        target.prepared = prepare(target, lib, source, lib_here)
        with held_signals():
            tracee = _borrow(target)
            stopped = time.monotonic()
            try:
                _run_in_target(target, tracee, lib, source)
            finally:
                tracee.detach()
                stopped = time.monotonic() - stopped
        report = _wait_report(target, status, timeout)
    except (TargetGone, OSError) as err:
        if isinstance(err, TargetGone) or not _alive(pid, wait=err.errno == errno.ESRCH):
            raise NoSuchProcess(f"process {pid} exited during injection", pid=pid) from err
        raise AttachError(f"injection into process {pid} failed: {err}", pid=pid) from err
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)
    if not report.get("ok"):
        raise AttachError(
            f"the probe did not start in process {pid}: {report.get('error')}", pid=pid
        )
    return InjectResult(
        pid,
        bool(report.get("already")),
        report.get("socket", ""),
        python=report.get("python", ""),
        tid=tracee.tid,
        stopped_s=stopped,
        total_s=time.monotonic() - t0,
        engine_pid=int(report.get("engine_pid") or 0),
    )
