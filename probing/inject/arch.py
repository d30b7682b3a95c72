"""What differs between x86_64 and aarch64 when making a stopped thread call.

Registers travel as the kernel's ``NT_PRSTATUS`` regset (``user_regs_struct``
on x86_64, ``user_pt_regs`` on aarch64), unpacked into a list of u64 so the
same code edits both. Nothing here touches a process: every function maps
registers (and a trampoline address) to registers, so both architectures are
tested on canned data on any machine.
"""

from __future__ import annotations

import platform
import struct
from typing import ClassVar

MASK64 = (1 << 64) - 1


class Arch:
    name: ClassVar[str]
    elf_machine: ClassVar[str]  # pyelftools' e_machine name
    reg_names: ClassVar[tuple[str, ...]]
    arg_regs: ClassVar[tuple[str, ...]]
    syscall_insn: ClassVar[bytes]
    insn_align: ClassVar[int]
    trap_stub: ClassVar[bytes]  # written at the trampoline: calls, then traps
    sys_mmap: ClassVar[int]
    sys_munmap: ClassVar[int]
    memory_syscalls: ClassVar[frozenset[int]]  # may hold malloc's locks
    ret_reg: ClassVar[str]
    pc_reg: ClassVar[str]
    sp_reg: ClassVar[str]
    nr_reg: ClassVar[str]  # the syscall number
    # what keeps the kernel from restarting an interrupted syscall over our code
    no_restart: ClassVar[dict[str, int]] = {}
    # register sets saved and restored besides the general ones: (NT_* type, max size).
    # The callee clobbers vector registers (libc's memcpy and strlen use them):
    # a thread stopped inside SIMD code would go on with wrong values.
    extra_regsets: ClassVar[tuple[tuple[int, int], ...]] = ()
    red_zone: ClassVar[int] = 256

    @classmethod
    def regset_size(cls) -> int:
        return 8 * len(cls.reg_names)

    @classmethod
    def unpack(cls, raw: bytes) -> list[int]:
        return list(struct.unpack(f"<{len(cls.reg_names)}Q", raw[: cls.regset_size()]))

    @classmethod
    def pack(cls, regs: list[int]) -> bytes:
        return struct.pack(f"<{len(cls.reg_names)}Q", *(r & MASK64 for r in regs))

    @classmethod
    def get(cls, regs: list[int], name: str) -> int:
        return regs[cls.reg_names.index(name)]

    @classmethod
    def set(cls, regs: list[int], name: str, value: int) -> None:
        regs[cls.reg_names.index(name)] = value & MASK64

    @classmethod
    def pc(cls, regs: list[int]) -> int:
        return cls.get(regs, cls.pc_reg)

    @classmethod
    def result(cls, regs: list[int]) -> int:
        """The return value of the call or syscall that just finished."""
        return cls.get(regs, cls.ret_reg)

    @classmethod
    def find_syscall_insn(cls, code: bytes, base: int) -> int | None:
        """Address of a syscall instruction in ``code`` (mapped at ``base``)."""
        at = code.find(cls.syscall_insn)
        while at >= 0 and (base + at) % cls.insn_align:
            at = code.find(cls.syscall_insn, at + 1)
        return None if at < 0 else base + at

    @classmethod
    def prepare_call(
        cls, saved: list[int], func: int, args: tuple[int, ...], stub: int
    ) -> list[int]:
        """Registers that make the thread call ``func(*args)`` then trap in ``stub``."""
        raise NotImplementedError

    @classmethod
    def trapped_after_call(cls, regs: list[int], stub: int) -> bool:
        raise NotImplementedError

    @classmethod
    def prepare_syscall(
        cls, saved: list[int], nr: int, args: tuple[int, ...], insn: int
    ) -> list[int]:
        """Registers that execute one syscall instruction at ``insn`` (single-step)."""
        fixed = {cls.nr_reg: nr, cls.pc_reg: insn, **cls.no_restart}
        return cls._with(saved, cls.arg_regs, args, fixed)

    @classmethod
    def stepped_over_syscall(cls, regs: list[int], insn: int) -> bool:
        return cls.pc(regs) == insn + len(cls.syscall_insn)

    @classmethod
    def _with(
        cls, saved: list[int], names: tuple[str, ...], args: tuple[int, ...], fixed: dict[str, int]
    ) -> list[int]:
        """A copy of ``saved`` with ``args`` in ``names`` and the ``fixed`` registers set."""
        regs = list(saved)
        for name, value in (*zip(names, args, strict=False), *fixed.items()):
            cls.set(regs, name, value)
        return regs

    @classmethod
    def _stack(cls, saved: list[int]) -> int:
        # below the interrupted frame (and x86's 128-byte red zone), 16-aligned
        return (cls.get(saved, cls.sp_reg) - cls.red_zone) & ~0xF


class X86_64(Arch):
    name = "x86_64"
    elf_machine = "EM_X86_64"
    reg_names = (
        "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8",
        "rax", "rcx", "rdx", "rsi", "rdi", "orig_rax", "rip", "cs", "eflags",
        "rsp", "ss", "fs_base", "gs_base", "ds", "es", "fs", "gs",
    )  # fmt: skip
    arg_regs = ("rdi", "rsi", "rdx", "r10", "r8", "r9")  # syscall order
    call_regs = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
    ret_reg, pc_reg, sp_reg, nr_reg = "rax", "rip", "rsp", "rax"
    no_restart = {"orig_rax": -1}
    extra_regsets = ((2, 512), (0x202, 1 << 16))  # NT_PRFPREG (x87, SSE), NT_X86_XSTATE (AVX…)
    syscall_insn = b"\x0f\x05"
    insn_align = 1
    trap_stub = b"\x41\xff\xd3\xcc"  # call r11; int3
    sys_mmap, sys_munmap = 9, 11
    memory_syscalls = frozenset({9, 10, 11, 12, 25, 28})  # mmap mprotect munmap brk mremap madvise

    @classmethod
    def prepare_call(
        cls, saved: list[int], func: int, args: tuple[int, ...], stub: int
    ) -> list[int]:
        fixed = {
            "r11": func,  # the stub does `call r11`
            "rax": 0,  # no vector registers for a variadic callee
            "rsp": cls._stack(saved),  # `call` pushes: entry rsp = 8 mod 16
            "rip": stub,
            **cls.no_restart,
        }
        return cls._with(saved, cls.call_regs, args, fixed)

    @classmethod
    def trapped_after_call(cls, regs: list[int], stub: int) -> bool:
        return cls.pc(regs) == stub + len(cls.trap_stub)  # int3 leaves rip after itself


class AArch64(Arch):
    name = "aarch64"
    elf_machine = "EM_AARCH64"
    reg_names = (*(f"x{i}" for i in range(31)), "sp", "pc", "pstate")
    arg_regs = ("x0", "x1", "x2", "x3", "x4", "x5")
    ret_reg, pc_reg, sp_reg, nr_reg = "x0", "pc", "sp", "x8"
    # NT_PRFPREG (v0-v31, fpsr, fpcr), NT_ARM_SVE, NT_ARM_SYSTEM_CALL (the interrupted syscall)
    extra_regsets = ((2, 528), (0x405, 1 << 16), (0x404, 4))
    syscall_insn = struct.pack("<I", 0xD4000001)  # svc #0
    insn_align = 4
    trap_stub = struct.pack("<I", 0xD4200000)  # brk #0; the call returns here through lr
    sys_mmap, sys_munmap = 222, 215
    memory_syscalls = frozenset({214, 215, 216, 222, 226, 233})

    @classmethod
    def prepare_call(
        cls, saved: list[int], func: int, args: tuple[int, ...], stub: int
    ) -> list[int]:
        fixed = {"x30": stub, "sp": cls._stack(saved), "pc": func}  # lr: return into the brk
        return cls._with(saved, cls.arg_regs, args, fixed)

    @classmethod
    def trapped_after_call(cls, regs: list[int], stub: int) -> bool:
        return cls.pc(regs) == stub  # brk does not advance pc


ARCHES: dict[str, type[Arch]] = {
    "x86_64": X86_64,
    "amd64": X86_64,
    "aarch64": AArch64,
    "arm64": AArch64,
}


def native() -> type[Arch]:
    machine = platform.machine().lower()
    try:
        return ARCHES[machine]
    except KeyError:
        from probing.errors import AttachError

        raise AttachError(
            f"injection supports x86_64 and aarch64, not {machine}",
            hint="use PROBING=1 at start-up instead",
        ) from None
