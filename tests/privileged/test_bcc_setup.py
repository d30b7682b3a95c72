"""make setup's promise: BCC compiles against the installed headers and a
uprobe fires in this process. Root-only; PROBING_REQUIRE_PRIVILEGED=1 (CI)
turns the skip into a failure."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import pytest

from probing import checks
from probing.cli import doctor
from tests.conftest import require_bpf

pytestmark = pytest.mark.privileged

COUNT_CALLS = """
BPF_ARRAY(calls, u64, 1);
int on_getppid(struct pt_regs *ctx) {
    int zero = 0;
    u64 *n = calls.lookup(&zero);
    if (n) __sync_fetch_and_add(n, 1);
    return 0;
}
"""


def test_doctor_is_green_for_bpf() -> None:
    require_bpf()
    for check in (doctor.check_kernel(), doctor.check_bpf_caps(), doctor.check_ptrace()):
        assert check.ok, check


def test_a_uprobe_counts_exact_calls() -> None:
    require_bpf()
    from bcc import BPF

    libc_path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_path)
    with open("/proc/self/maps") as f:
        mapped = next(line.split()[-1] for line in f if "libc.so" in line or "libc-" in line)
    bpf = BPF(text=COUNT_CALLS)
    try:
        bpf.attach_uprobe(name=mapped, sym="getppid", fn_name="on_getppid", pid=os.getpid())
        for _ in range(37):
            libc.getppid()
        assert bpf["calls"][ctypes.c_int(0)].value == 37
    finally:
        bpf.cleanup()
    with open(os.path.join(checks.tracefs_dir() or "/sys/kernel/tracing", "uprobe_events")) as f:
        assert f"_{os.getpid()}" not in f.read()  # nothing left attached
