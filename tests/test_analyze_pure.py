"""``probing/analyze`` is analysis only: tables in, verdicts out. No module
under it starts a thread, opens a socket or a file to write, or sleeps (read
from each module's syntax tree, its lazy imports inside functions too), and
none is over ``MAX_LINES``."""

from __future__ import annotations

import ast
from pathlib import Path

import probing.analyze

ROOT = Path(probing.analyze.__file__).parent
# modules whose import means a thread, a socket, a pool or a process
FORBIDDEN = ("threading", "_thread", "socket", "concurrent", "multiprocessing", "subprocess",
             "asyncio", "selectors")  # fmt: skip
MAX_LINES = 500
WRITE_ATTRS = {"write_text", "write_bytes", "open", "fdopen", "write", "writelines", "mkdir",
               "touch", "unlink", "rename"}  # fmt: skip


def _modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def _write_mode(call: ast.Call) -> bool:
    """Whether the builtin ``open(...)`` call writes: a mode with w, a, x or +
    (one not written as a constant is taken to write)."""
    mode: ast.expr | None = call.args[1] if len(call.args) > 1 else None
    for kw in call.keywords:
        if kw.arg == "mode":
            mode = kw.value
    if mode is None:
        return False
    if not isinstance(mode, ast.Constant) or not isinstance(mode.value, str):
        return True
    return any(c in mode.value for c in "wax+")


def offences(source: str) -> list[str]:
    """What in ``source`` is not analysis: the forbidden imports, sleeps and
    file writes, each ``line: what``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            out += [f"{line}: import {a.name}" for a in node.names if _forbidden(a.name)]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if _forbidden(mod):
                out.append(f"{line}: from {mod} import")
            if mod == "time" and any(a.name == "sleep" for a in node.names):
                out.append(f"{line}: from time import sleep")
        elif isinstance(node, ast.Attribute) and node.attr == "sleep":
            out.append(f"{line}: .sleep")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "open" and _write_mode(node):
                out.append(f"{line}: open(..., a write mode)")
            elif isinstance(f, ast.Attribute) and f.attr in WRITE_ATTRS:
                out.append(f"{line}: .{f.attr}(...)")
    return out


def test_the_check_sees_what_it_forbids() -> None:
    bad = """
import threading
import concurrent.futures
from concurrent.futures import ThreadPoolExecutor
from socket import gethostname
import time
from time import sleep
def f(p, os):
    import socket
    time.sleep(1)
    open("x", "a")
    open("x", mode="w")
    p.write_text("x")
    p.write_bytes(b"x")
    p.open("w")
    os.write(1, b"x")
"""
    assert len(offences(bad)) == 13
    good = """
import time
import numpy as np
def f(path):
    with open(path) as fh:
        return fh.read(), open(path, "rb"), time.time_ns()
"""
    assert offences(good) == []


def test_analyze_starts_no_thread_opens_no_socket_writes_no_file_never_sleeps() -> None:
    found = {
        str(path.relative_to(ROOT)): bad
        for path in _modules()
        if (bad := offences(path.read_text()))
    }
    assert _modules() and found == {}, found


def test_no_analyze_module_is_over_max_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}  # fmt: skip
    assert long == {}, long
