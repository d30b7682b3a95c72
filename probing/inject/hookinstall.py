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
from probing.guest import hook

PTH = "_probing_hook.pth"


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
    site = site_packages(python)
    source = os.path.dirname(os.path.abspath(hook.__file__))
    target = os.path.join(site, hook.GUEST)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    pth = os.path.join(site, PTH)
    with open(pth, "w") as f:
        f.write(hook.pth_line(target, engine_python))
    return Installed(site, pth, target)


def remove(python: str) -> Installed:
    site = site_packages(python)
    pth, target = os.path.join(site, PTH), os.path.join(site, hook.GUEST)
    if os.path.exists(pth):
        os.unlink(pth)
    shutil.rmtree(target, ignore_errors=True)
    return Installed(site, pth, target)
