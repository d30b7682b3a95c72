"""Build ``libprobing_boot.so`` from ``boot.c``: at set-up, or on first use.

The file name carries a hash of the source, so a changed ``boot.c`` is never
served by a stale build. It is built next to the source when the package
directory is writable, else under a per-user directory in the temp dir; both
are readable by other users (a root injector may load it into their process)
and writable only by us.

    python -m probing.inject.build      # prints the library's path
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

from probing.errors import AttachError

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot.c")
CFLAGS = ("-shared", "-fPIC", "-O2", "-pthread", "-Wall", "-Werror")


def _name() -> str:
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + " ".join(CFLAGS).encode()).hexdigest()[:12]
    return f"libprobing_boot-{digest}.so"


def _dirs() -> list[str]:
    return [
        os.path.join(os.path.dirname(SOURCE), "_lib"),
        os.path.join(tempfile.gettempdir(), f"probing-lib-{os.getuid()}"),
    ]


def library_path(*, build: bool = True) -> str:
    """Path of the built library; builds it when missing (``build=True``)."""
    name = _name()
    for d in _dirs():
        path = os.path.join(d, name)
        if os.path.exists(path):
            return path
    if not build:
        raise AttachError("the bootstrap library is not built", hint="run: make setup")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise AttachError(
            "no C compiler to build the injection library",
            hint="apt-get install gcc (make setup does), then retry",
        )
    errors = []
    for d in _dirs():
        try:
            os.makedirs(d, mode=0o755, exist_ok=True)
            if os.stat(d).st_uid != os.getuid():
                raise PermissionError(f"{d} belongs to another user")
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
            os.close(fd)
        except OSError as err:
            errors.append(f"{d}: {err}")
            continue
        try:
            proc = subprocess.run(
                [cc, *CFLAGS, "-o", tmp, SOURCE], capture_output=True, text=True, timeout=120
            )
            if proc.returncode != 0:
                raise AttachError(f"building {SOURCE} failed: {proc.stderr.strip()[-400:]}")
            os.chmod(tmp, 0o755)
            path = os.path.join(d, name)
            os.replace(tmp, path)
            for old in os.listdir(d):  # earlier builds (a process may still map one: fine)
                if old.startswith("libprobing_boot-") and old != name:
                    os.unlink(os.path.join(d, old))
            return path
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise AttachError("no directory to build the injection library in: " + "; ".join(errors))


if __name__ == "__main__":
    try:
        print(library_path())
    except AttachError as err:
        print(f"probing: error: {err}", file=sys.stderr)
        sys.exit(1)
