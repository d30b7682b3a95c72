"""ptrace(2) through ctypes: seize one thread, make it call, give it back.

Only the thread that is borrowed stops; the process's other threads keep
running. Memory is read and written through ``/proc/<pid>/mem`` (one
syscall per buffer, and it may write read-only code pages, as debuggers do).
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import time
from collections.abc import Callable
from typing import NamedTuple

from probing import proc
from probing.errors import AttachError, NoSuchProcess
from probing.inject.arch import Arch
from probing.pyframes.memory import IOVec, cstring

PTRACE_CONT = 7
PTRACE_SINGLESTEP = 9
PTRACE_DETACH = 17
PTRACE_GETREGSET = 0x4204
PTRACE_SETREGSET = 0x4205
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_EVENT_STOP = 128
NT_PRSTATUS = 1
WALL = 0x40000000

# signals a thread raises on itself when the code it runs is wrong: if our
# call raises one, the call is abandoned and the signal never delivered
FAULTS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})

_libc = ctypes.CDLL(None, use_errno=True)
_ptrace = _libc.ptrace
_ptrace.argtypes = (ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_ptrace.restype = ctypes.c_long


class TargetGone(NoSuchProcess):
    """The process exited while we held one of its threads."""


class CallFailed(AttachError):
    """The borrowed thread faulted or timed out inside our call."""


RegState = tuple[list[int], list[tuple[int, bytes]]]  # general registers, other regsets


class Stop(NamedTuple):
    sig: int
    event: int


def ptrace(request: int, tid: int, addr: int = 0, data: int | ctypes.c_void_p = 0) -> int:
    res = _ptrace(request, tid, ctypes.c_void_p(addr), data)
    if res == -1:
        err = ctypes.get_errno()
        if err:
            raise OSError(err, f"ptrace({request:#x}, {tid}): {os.strerror(err)}")
    return res


class TraceeMemory:
    """Read and write another process's memory through ``/proc/<pid>/mem``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = os.open(proc.path(pid, "mem"), os.O_RDWR | os.O_CLOEXEC)

    def read(self, addr: int, size: int) -> bytes:
        return os.pread(self.fd, size, addr)

    def read_cstring(self, addr: int, limit: int = 4096) -> str:
        return cstring(self, addr, limit).decode("utf-8", "replace")

    def write(self, addr: int, data: bytes) -> None:
        done = os.pwrite(self.fd, data, addr)
        if done != len(data):
            raise OSError(errno.EIO, f"short write at {addr:#x} in pid {self.pid}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Tracee:
    """One seized thread. Signals that arrive while we hold it are kept and
    delivered when it is given back, so the target loses none."""

    def __init__(self, pid: int, tid: int, arch: type[Arch]) -> None:
        self.pid = pid
        self.tid = tid
        self.arch = arch
        self.attached = False
        self.deferred: list[int] = []

    # --- attach / detach --------------------------------------------------------
    def stop(self, timeout: float = 2.0) -> None:
        """Stop the (running) thread."""
        ptrace(PTRACE_INTERRUPT, self.tid)
        self.wait_for(lambda stop: stop.event == PTRACE_EVENT_STOP, timeout, "to stop")

    def seize_and_stop(self) -> None:
        ptrace(PTRACE_SEIZE, self.tid)
        self.attached = True
        self.stop()

    def resume_briefly(self, seconds: float) -> None:
        """Let the thread run for ``seconds`` and stop it again."""
        ptrace(PTRACE_CONT, self.tid, 0, 0)
        time.sleep(seconds)
        self.stop()

    def detach(self) -> None:
        """Give the thread back; deliver what arrived meanwhile. Safe to call twice."""
        if not self.attached:
            return
        self.attached = False
        first, rest = (self.deferred[0], self.deferred[1:]) if self.deferred else (0, [])
        try:
            ptrace(PTRACE_DETACH, self.tid, 0, first)
        except OSError as err:
            if err.errno != errno.ESRCH:
                raise
        for sig in rest:
            try:
                os.kill(self.pid, sig)
            except OSError:
                pass

    # --- registers -----------------------------------------------------------------
    def _regset(self, request: int, nt: int, buf: ctypes.Array[ctypes.c_char]) -> int:
        iov = IOVec(ctypes.cast(buf, ctypes.c_void_p), len(buf))
        ptrace(request, self.tid, nt, ctypes.c_void_p(ctypes.addressof(iov)))
        return iov.len  # the kernel's size for this set

    def get_regset(self, nt: int, size: int) -> bytes:
        buf = ctypes.create_string_buffer(size)
        got = self._regset(PTRACE_GETREGSET, nt, buf)
        return buf.raw[:got]

    def set_regset(self, nt: int, raw: bytes) -> None:
        buf = ctypes.create_string_buffer(raw, len(raw))
        self._regset(PTRACE_SETREGSET, nt, buf)

    def get_regs(self) -> list[int]:
        return self.arch.unpack(self.get_regset(NT_PRSTATUS, self.arch.regset_size()))

    def set_regs(self, regs: list[int]) -> None:
        self.set_regset(NT_PRSTATUS, self.arch.pack(regs))

    def save_state(self) -> RegState:
        """Every register the thread has: general, FP/vector, and what the arch adds."""
        extra = []
        for nt, size in self.arch.extra_regsets:
            try:
                extra.append((nt, self.get_regset(nt, size)))
            except OSError as err:  # a set this CPU or kernel lacks (no AVX, no SVE)
                if err.errno not in (errno.EINVAL, errno.ENODEV, errno.EIO):
                    raise
        return self.get_regs(), extra

    def restore_state(self, state: RegState) -> None:
        regs, extra = state
        self.set_regs(regs)
        for nt, raw in extra:
            self.set_regset(nt, raw)

    # --- waiting --------------------------------------------------------------------
    def _wait_once(self, deadline: float) -> Stop | None:
        # polled, for the timeout: every 0.1 ms while a call or a syscall is
        # expected back (a borrowed thread waits on each poll's lateness),
        # then backing off to 5 ms
        delay, start = 0.0001, time.monotonic()
        while True:
            try:
                got, status = os.waitpid(self.tid, os.WNOHANG | WALL)
            except ChildProcessError as err:
                self.attached = False
                raise TargetGone(f"process {self.pid} is gone", pid=self.pid) from err
            if got:
                break
            if time.monotonic() > deadline:
                return None
            time.sleep(delay)
            if time.monotonic() - start > 0.02:
                delay = min(delay * 2, 0.005)
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            self.attached = False
            raise TargetGone(f"process {self.pid} exited during injection", pid=self.pid)
        return Stop(os.WSTOPSIG(status), status >> 16)

    def wait_for(
        self, done: Callable[[Stop], bool], timeout: float, what: str, resume: int = PTRACE_CONT
    ) -> Stop:
        """Wait until a stop satisfies ``done``; keep signals that arrive meanwhile.

        A fault raised by the thread (our call went wrong) ends the wait with
        CallFailed and is never delivered; other stops are resumed with
        ``resume`` (continue, or single-step again).
        """
        deadline = time.monotonic() + timeout
        while True:
            stop = self._wait_once(deadline)
            if stop is None:
                raise CallFailed(
                    f"thread {self.tid} of pid {self.pid} did not {what.strip()} "
                    f"within {timeout:g} s",
                    pid=self.pid,
                )
            if done(stop):
                return stop
            if stop.event == 0 and stop.sig in FAULTS:
                raise CallFailed(
                    f"thread {self.tid} got {signal.Signals(stop.sig).name} {what}",
                    pid=self.pid,
                )
            if stop.event == 0 and stop.sig != signal.SIGTRAP:
                self.deferred.append(stop.sig)  # an async signal: deliver at detach
            ptrace(resume, self.tid, 0, 0)

    # --- remote execution -------------------------------------------------------------
    def call(self, saved: list[int], func: int, args: tuple[int, ...], stub: int,
             timeout: float) -> int:  # fmt: skip
        """Make the thread run ``func(*args)``; return its result once it traps."""
        arch = self.arch
        self.set_regs(arch.prepare_call(saved, func, args, stub))
        ptrace(PTRACE_CONT, self.tid, 0, 0)
        self.wait_for(
            lambda s: (
                s.event == 0
                and s.sig == signal.SIGTRAP
                and arch.trapped_after_call(self.get_regs(), stub)
            ),
            timeout,
            f"in the call at {func:#x}",
        )
        return arch.result(self.get_regs())

    def syscall(self, saved: list[int], nr: int, args: tuple[int, ...], insn: int) -> int:
        """Execute one syscall instruction at ``insn`` by single-stepping it."""
        arch = self.arch
        self.set_regs(arch.prepare_syscall(saved, nr, args, insn))
        ptrace(PTRACE_SINGLESTEP, self.tid, 0, 0)
        self.wait_for(
            lambda s: s.event == 0 and s.sig == signal.SIGTRAP,
            2.0,
            f"in syscall {nr}",
            resume=PTRACE_SINGLESTEP,
        )
        regs = self.get_regs()
        if not arch.stepped_over_syscall(regs, insn):
            raise CallFailed(f"syscall {nr} did not complete in thread {self.tid}", pid=self.pid)
        return arch.result(regs)
