"""The probe's threads import only while the host imports nothing.

With ``PROBING=1`` the probe starts before the host's own imports, and an
injected probe may answer its first query while the host is importing torch.
A probe thread importing a package the host's main thread is half-way
through importing can hand the host a half-initialised module: a probe
thread importing ``torch.distributed`` during the host's ``import torch``
left ``torch._C`` broken and killed every rank of a ``torchrun`` job.

So every probe thread that may import (a request's worker, the NVML
sampler's start, the tracer) first calls ``settle()``: it waits, polling
``sys.modules`` at 10 ms, until no module is initializing. A host that
never stops importing (its training runs at a module's top level) is given
``SETTLE_TIMEOUT_S``, after which the probe goes on: the module locks of
``importlib`` still serialise two threads importing the same module.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

SETTLE_TIMEOUT_S = 10.0
POLL_S = 0.01

# modules seen initializing for longer than the timeout: a host running its
# job inside an import; they no longer hold the probe back
_stuck: set[str] = set()


def importing() -> list[str]:
    """The modules some thread is importing now (in ``sys.modules``, not done)."""
    busy = []
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if spec is not None and getattr(spec, "_initializing", False) and name not in _stuck:
            busy.append(name)
    return busy


def settle(timeout: float = SETTLE_TIMEOUT_S) -> list[str]:
    """Wait until no thread is importing a module; return what still was at
    the timeout (and is from then on ignored). The main thread returns at
    once: it is the host, and cannot wait for its own imports."""
    if threading.current_thread() is threading.main_thread():
        return []
    deadline = time.monotonic() + timeout
    while busy := importing():
        if time.monotonic() >= deadline:
            _stuck.update(busy)
            return busy
        time.sleep(POLL_S)
    return []


LOAD_SWITCH_INTERVAL_S = 0.00005


@contextlib.contextmanager
def quick_gil_handoff() -> Iterator[None]:
    """A shorter GIL switch interval while the probe loads its modules.

    In a host whose thread spins in Python, every file read of an import
    hands the GIL over and waits a whole switch interval (5 ms) to get it
    back: hundreds of reads turn a 0.4 s import into seconds. The host's
    own interval comes back afterwards (unless it changed it meanwhile).
    """
    old = sys.getswitchinterval()
    sys.setswitchinterval(min(old, LOAD_SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        if sys.getswitchinterval() == min(old, LOAD_SWITCH_INTERVAL_S):
            sys.setswitchinterval(old)
