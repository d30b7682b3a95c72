"""``probing hook``: ``PROBING=1`` in a job environment that lacks probing.

What goes in the job's ``site-packages`` is small and stdlib-only: the
guest's files, under the private name ``_probing_guest``, and one ``.pth``
line that starts it when ``PROBING`` is set (``probing.guest.hook``), with
this probing's Python as the engine's. No numpy, no pyarrow, nothing that
the job would import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import NamedTuple

from probing.errors import ProbingError

PTH = "_probing_hook.pth"
GUEST = "_probing_guest"


class Installed(NamedTuple):
    site: str
    pth: str
    guest: str


def site_packages(python: str) -> str:
    """Where ``python`` installs pure packages (its venv's ``site-packages``)."""
    try:
        out = subprocess.run(
            [python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as err:
        raise ProbingError(
            f"cannot ask {python} where its packages go: {err}",
            hint="pass the job's interpreter, e.g. --python /path/to/venv/bin/python",
        ) from err
    return out.stdout.strip()


def install(python: str, engine_python: str = sys.executable) -> Installed:
    """The hook and the guest into ``python``'s environment (again: replaced)."""
    from probing import guest

    site = site_packages(python)
    source = os.path.dirname(os.path.abspath(guest.__file__))
    target = os.path.join(site, GUEST)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    ns: dict[str, object] = {}
    hook = os.path.join(target, "hook.py")
    with open(hook) as f:
        exec(compile(f.read(), hook, "exec"), ns)  # noqa: S102 - our own file
    pth = os.path.join(site, PTH)
    with open(pth, "w") as f:
        f.write(ns["pth_line"](target, engine_python))  # type: ignore[operator]
    return Installed(site, pth, target)


def remove(python: str) -> Installed:
    site = site_packages(python)
    pth, target = os.path.join(site, PTH), os.path.join(site, GUEST)
    if os.path.exists(pth):
        os.unlink(pth)
    shutil.rmtree(target, ignore_errors=True)
    return Installed(site, pth, target)
