from __future__ import annotations

import json

from probing import checks
from probing.cli import doctor
from probing.cli.render import format_rows
from tests.conftest import cli

ROOT_CAPS = 0x000001FFFFFFFFFF  # a root shell with every capability
NO_CAPS = 0


def test_caps_are_read_from_proc_status(tmp_path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nCapInh:\t0\nCapEff:\t000001ffffffffff\n")
    caps = checks.effective_caps(str(status))
    assert checks.has_cap(caps, checks.CAP_BPF) and checks.has_cap(caps, checks.CAP_SYS_PTRACE)
    assert doctor.check_bpf_caps(caps, euid=0).ok
    bad = doctor.check_bpf_caps(NO_CAPS, euid=1000)
    assert not bad.ok and "CAP_BPF" in bad.fix


def test_ptrace_scope_advice(tmp_path) -> None:
    scope = tmp_path / "scope"
    scope.write_text("1\n")
    c = doctor.check_ptrace(NO_CAPS, str(scope))
    assert not c.ok and "ptrace_scope" in c.fix and "SYS_PTRACE" in c.fix
    assert doctor.check_ptrace(1 << checks.CAP_SYS_PTRACE, str(scope)).ok
    scope.write_text("3\n")
    assert not doctor.check_ptrace(ROOT_CAPS, str(scope)).ok
    assert doctor.check_ptrace(NO_CAPS, str(tmp_path / "absent")).ok


def test_kernel_versions() -> None:
    assert checks.kernel_version("6.18.44-fc-v657") == (6, 18)
    assert checks.kernel_version("5.4.0-150-generic") == (5, 4)
    assert not doctor.check_kernel("5.4.0").ok and doctor.check_kernel("5.15.0-1").ok


def test_headers_check_names_the_fix() -> None:
    c = doctor.check_headers("0.0.0-nosuch")
    assert not c.ok and "linux-headers-0.0.0-nosuch" in c.fix


def test_doctor_command_prints_every_check() -> None:
    r = cli("doctor", "--format", "json")
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert set(checks) == {
        "kernel",
        "btf",
        "tracefs",
        "bcc",
        "headers",
        "cap_bpf",
        "ptrace",
        "uprobe_multi",
        "nvml",
    }
    failed_required = [c for c in checks.values() if c["required"] and not c["ok"]]
    assert r.returncode == (1 if failed_required else 0)
    # without a GPU the NVML line explains itself instead of a traceback
    assert checks["nvml"]["detail"] and "Traceback" not in r.stderr
    text = cli("doctor")
    assert all(  # a check's line, or the rest of one under its text (its fix too)
        line.split()[0] in ("OK", "FAIL", "WARN") or line.startswith(" ")
        for line in text.stdout.splitlines()
    )


def test_render_fits_80_columns() -> None:
    rows = [[1, "x" * 200, 3.5], [22, None, None]]
    out = format_rows(["id", "long", "val"], rows, width=80)
    assert all(len(line) <= 80 for line in out.splitlines())
    assert "NULL" in out and "…" in out


def test_help_ends_with_examples() -> None:
    for args in ([], ["query"], ["ps"], ["doctor"], ["tables"]):
        r = cli(*args, "--help")
        assert "Examples" in r.stdout, args


def test_query_without_pid_is_a_usage_error() -> None:
    r = cli("query", "SELECT 1")
    assert r.returncode == 2 and "--pid" in r.stderr
