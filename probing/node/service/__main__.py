"""``python -m probing.node.service [--daemon]``: run this node's engine."""

from probing.node.service.engine import main

main()
