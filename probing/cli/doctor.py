"""What this machine lacks for BPF, ptrace and NVML, and how to fix each."""

from __future__ import annotations

from probing.checks import (  # noqa: F401  (doctor's checks, shared with the tracer)
    CAP_BPF,
    CAP_PERFMON,
    CAP_SYS_ADMIN,
    CAP_SYS_PTRACE,
    Check,
    check_bcc,
    check_bpf_caps,
    check_btf,
    check_headers,
    check_kernel,
    check_ptrace,
    check_tracefs,
    effective_caps,
    has_cap,
    kernel_version,
    tracefs_dir,
)


def check_uprobe_multi() -> Check:
    """Multi-uprobe links: detach and exit pay one RCU grace period per
    library instead of one per uprobe (probing/node/bpf/loader.py)."""
    from probing.node.bpf.loader import has_uprobe_multi

    ok = has_uprobe_multi()
    return Check(
        "uprobe_multi",
        ok,
        "multi-uprobe links (BPF_TRACE_UPROBE_MULTI) " + ("available" if ok else "unavailable"),
        ""
        if ok
        else "a kernel >= 6.6 detaches and exits faster (one uprobe per "
        "function is used here; stop releases them in parallel)",
        required=False,
    )


def check_nvml() -> Check:
    try:
        import pynvml
    except ImportError as err:
        return Check(
            "nvml", False, f"pynvml missing: {err}", "pip install nvidia-ml-py", required=False
        )
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        from probing.node.tables.nvml import unavailable_reason

        return Check(
            "nvml",
            False,
            f"{unavailable_reason(err)}: nvml.* tables stay empty",
            "install the NVIDIA driver (libnvidia-ml.so.1) on a GPU machine",
            required=False,
        )
    try:
        n = pynvml.nvmlDeviceGetCount()
        drv = pynvml.nvmlSystemGetDriverVersion()
        return Check(
            "nvml",
            n > 0,
            f"driver {drv}, {n} device(s)",
            "" if n else "no NVIDIA device visible",
            required=False,
        )
    finally:
        pynvml.nvmlShutdown()


def run_all() -> list[Check]:
    return [
        check_kernel(),
        check_btf(),
        check_tracefs(),
        check_bcc(),
        check_headers(),
        check_bpf_caps(),
        check_ptrace(),
        check_uprobe_multi(),
        check_nvml(),
    ]
