"""What this machine lacks for BPF, ptrace and NVML, and how to fix each."""

from __future__ import annotations

from probing.checks import (  # doctor's checks, shared with the tracer and the injector
    Check,
    check_bcc,
    check_bpf_caps,
    check_btf,
    check_headers,
    check_kernel,
    check_ptrace,
    check_tracefs,
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


def format_checks(checks: list[Check], width: int = 80) -> str:
    """One line a check (``OK``, ``FAIL`` or ``WARN``, its name, what was
    found), its names in one column, the fix below a failed one; a long line
    goes on under its text, all within ``width`` columns."""
    name_w = max(len(c.name) for c in checks) if checks else 0
    indent = " " * (6 + name_w + 1)  # under the detail: status (5), a space, the name, a space
    out = []
    for c in checks:
        status = "OK" if c.ok else ("FAIL" if c.required else "WARN")
        head = f"{status:<5} {c.name:<{name_w}} "
        out.append(_fill(c.detail, width, head, indent))
        if not c.ok and c.fix:
            out.append(_fill(c.fix, width, f"{indent}fix: ", indent))
    return "\n".join(out)


def _fill(text: str, width: int, first: str, rest: str) -> str:
    import textwrap

    return textwrap.fill(
        text,
        width,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,  # a path stays whole, if longer than the line
        break_on_hyphens=False,
    )


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
