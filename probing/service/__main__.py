"""``python -m probing.service [--daemon]``: run this node's engine."""

from probing.service.engine import main

main()
