"""What BPF tracing and ptrace need from this machine, one check each, with
the fix: plain functions of the kernel's files and this process's
capabilities, so the tracer, the injector and ``probing doctor`` share them
(from the bottom layer: they import nothing of probing but where ``proc``
says the kernel's files are)."""

from __future__ import annotations

import os
import platform
from typing import NamedTuple

from probing import proc

CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39


class Check(NamedTuple):
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def effective_caps(status_path: str = proc.path("self", "status")) -> int:
    with open(status_path) as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def has_cap(caps: int, bit: int) -> bool:
    return bool(caps >> bit & 1)


def kernel_version(release: str) -> tuple[int, int]:
    parts = release.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def check_kernel(release: str | None = None) -> Check:
    release = release or platform.release()
    ok = kernel_version(release) >= (5, 8)
    return Check(
        "kernel",
        ok,
        f"{release} (BPF ring buffers need >= 5.8)",
        "" if ok else "run on a kernel >= 5.8",
    )


def check_btf() -> Check:
    ok = os.path.exists("/sys/kernel/btf/vmlinux")
    return Check(
        "btf",
        ok,
        "/sys/kernel/btf/vmlinux" + (" present" if ok else " missing"),
        "" if ok else "use a kernel built with CONFIG_DEBUG_INFO_BTF=y",
        required=False,
    )


def tracefs_dir() -> str | None:
    for d in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        if os.path.exists(os.path.join(d, "uprobe_events")):
            return d
    return None


def check_tracefs() -> Check:
    d = tracefs_dir()
    return Check(
        "tracefs",
        d is not None,
        f"mounted at {d}" if d else "not mounted",
        "" if d else "mount -t tracefs nodev /sys/kernel/tracing (or: make setup)",
    )


def check_bcc() -> Check:
    try:
        import bcc
    except (ImportError, OSError, AttributeError) as err:  # no bcc; no libbcc; an old libbcc
        return Check(
            "bcc",
            False,
            f"not importable: {err}",
            "apt-get install python3-bpfcc, then make setup (links it into the venv)",
        )
    version = getattr(bcc, "__version__", "?")
    return Check("bcc", True, f"{version} from {os.path.dirname(bcc.__file__)}")


def check_headers(release: str | None = None) -> Check:
    release = release or platform.release()
    build = f"/lib/modules/{release}/build"
    ok = os.path.isdir(os.path.join(build, "include"))
    if ok:
        target = os.path.realpath(build)
        return Check("headers", True, f"{build} -> {target}")
    return Check(
        "headers",
        False,
        f"{build} missing (BCC compiles against it)",
        f"apt-get install linux-headers-{release} (or: make setup, which links "
        "the distribution's headers there)",
    )


def check_bpf_caps(caps: int | None = None, euid: int | None = None) -> Check:
    caps = effective_caps() if caps is None else caps
    euid = os.geteuid() if euid is None else euid
    bpf = has_cap(caps, CAP_BPF) or has_cap(caps, CAP_SYS_ADMIN)
    perf = has_cap(caps, CAP_PERFMON) or has_cap(caps, CAP_SYS_ADMIN)
    ok = bpf and perf
    detail = f"euid {euid}, CAP_BPF {'yes' if bpf else 'no'}, CAP_PERFMON {'yes' if perf else 'no'}"
    return Check(
        "cap_bpf",
        ok,
        detail,
        ""
        if ok
        else "run as root, or grant CAP_BPF and CAP_PERFMON (setcap, or "
        "docker run --cap-add BPF --cap-add PERFMON)",
    )


def check_ptrace(
    caps: int | None = None, scope_path: str = proc.node_path("sys/kernel/yama/ptrace_scope")
) -> Check:
    caps = effective_caps() if caps is None else caps
    cap = has_cap(caps, CAP_SYS_PTRACE)
    try:
        with open(scope_path) as f:
            scope = int(f.read().strip())
    except (OSError, ValueError):
        scope = None
    if scope == 3:
        return Check(
            "ptrace",
            False,
            "yama ptrace_scope=3: ptrace is off until reboot",
            "boot with kernel.yama.ptrace_scope < 3",
        )
    # no Yama (no such file): the classic rules, same-user attach allowed
    yama = "no Yama ptrace_scope" if scope is None else f"ptrace_scope={scope}"
    if cap:
        return Check("ptrace", True, f"CAP_SYS_PTRACE held ({yama})")
    if scope in (None, 0):
        return Check("ptrace", True, f"same-user attach allowed ({yama})")
    return Check(
        "ptrace",
        False,
        f"yama ptrace_scope={scope} without CAP_SYS_PTRACE",
        "run as root, add SYS_PTRACE (docker --cap-add SYS_PTRACE), or "
        "echo 0 > /proc/sys/kernel/yama/ptrace_scope",
    )
