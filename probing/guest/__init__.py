"""The guest: the part of probing that lives inside the job (stdlib only).

It is loaded into the target under one private name (``_probing_guest``),
from its files, never through ``sys.path``: the job imports what it imported
before and finds what it found before. It brings no compiled module, no
numpy, no pyarrow, so the same source runs in every CPython probing supports
(``probing.pyframes.SUPPORTED``).

What it keeps in the process is what only the process knows (``inside``):
its threads and stacks, ``python.`expr```, ``eval``, torch's process groups.
Everything else (BPF, the store, SQL, NVML, the cluster) is the node's
engine (``probing.node.service``), run by probing's own Python beside the job;
the guest hands it the process at start (``life``) over a unix socket.
Nothing starts on import: ``start()`` does.
"""

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


FREE_THREADED = (
    "free-threaded CPython ({}t) is not supported yet: no probe runs in it "
    "(run the job on the GIL build of CPython)"
)


def start(engine_python: str, *, wait: bool = True, spawn: bool = True) -> "Any":
    """This process's guest, serving and handed to the engine (``life.start``).
    A free-threaded build is refused: the engine cannot read its frames."""
    import sys

    if "t" in getattr(sys, "abiflags", ""):
        raise RuntimeError(FREE_THREADED.format("{}.{}".format(*sys.version_info[:2])))
    from .life import start as _start

    return _start(engine_python, wait=wait, spawn=spawn)


def current() -> "Any":
    """This process's guest, or None."""
    from .life import current as _current

    return _current()
