"""``python -m probing run script.py args…`` runs a script with the probe on;
any other arguments go to the ``probing`` command."""

from __future__ import annotations

import os
import runpy
import sys


def run_script(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m probing run SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    script = argv[0]
    if not os.path.exists(script):
        print(f"probing: error: no such script: {script}", file=sys.stderr)
        return 2
    import probing

    probing.enable()
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        sys.exit(run_script(sys.argv[2:]))
    from probing.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
