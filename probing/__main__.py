"""``python -m probing run script.py args…`` runs a script with the probe on;
any other arguments go to the ``probing`` command."""

from __future__ import annotations

import sys


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        from probing.cli import run_script

        sys.exit(run_script(sys.argv[2:]))
    from probing.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
