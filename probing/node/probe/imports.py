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


class SwitchInterval:
    """The probe's holds on the host's GIL switch interval, one for the process.

    In a host whose thread spins in Python, every file read or socket call
    of a probe thread hands the GIL over and waits a whole switch interval
    (5 ms by default) to get it back: hundreds of reads turn a 0.3 s import
    into seconds. So a probe thread that loads modules or serves a burst of
    connections holds a shorter interval while it does. Holds from several
    threads overlap (the injector's boot, the engine's preload, a request,
    the server loop), so they are counted here: the shortest one held is
    in force, and the host's own interval comes back when the last one is
    let go (unless the host changed it meanwhile).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[float] = []
        self._host: float | None = None  # the host's interval, while ours is set
        self._ours: float | None = None

    def take(self, interval: float, *, host: float | None = None) -> None:
        """Hold ``interval``; ``host``: the host's own interval, when a caller
        set ours before this registry could be imported."""
        with self._lock:
            if not self._held:
                self._host = host if host is not None else sys.getswitchinterval()
            self._held.append(interval)
            self._apply()

    def give(self, interval: float) -> None:
        with self._lock:
            self._held.remove(interval)
            self._apply()

    def _apply(self) -> None:
        assert self._host is not None
        current = sys.getswitchinterval()
        if self._ours is not None and current != self._ours:
            self._host = current  # the host set its own meanwhile: that is what comes back
        want = min([self._host, *self._held]) if self._held else self._host
        if want != current:
            # the interpreter keeps whole microseconds, truncating: the host's
            # 0.007 reads back as 0.006999..., which must not become 6999 us
            sys.setswitchinterval((round(want * 1e6) + 0.25) / 1e6)
        # read back: the interpreter keeps whole microseconds
        self._ours = sys.getswitchinterval() if self._held else None

    @contextlib.contextmanager
    def hold(self, interval: float) -> Iterator[None]:
        self.take(interval)
        try:
            yield
        finally:
            self.give(interval)


SWITCH = SwitchInterval()


def quick_gil_handoff() -> contextlib.AbstractContextManager[None]:
    """A short GIL switch interval while the probe loads its modules (see
    ``SwitchInterval``)."""
    return SWITCH.hold(LOAD_SWITCH_INTERVAL_S)
