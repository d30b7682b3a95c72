"""Attach to a running Python process: ``probing inject --pid P``.

``inject(pid)`` borrows one thread with ptrace, has it load a tiny library
whose thread takes the GIL and starts the probe, then gives the thread back
exactly as it was. See ``injector`` for the steps and ``arch`` for the two
architectures.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # keep ``python -m probing.inject.build`` light
    if name in ("InjectResult", "inject", "inspect"):
        from probing.inject import injector

        return getattr(injector, name)
    raise AttributeError(name)


__all__ = ["InjectResult", "inject", "inspect"]
