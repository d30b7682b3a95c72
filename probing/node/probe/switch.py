"""The GIL switch interval the probe's server holds while it is busy.

A thread waiting for the GIL waits a whole switch interval (5 ms by default)
while another thread runs Python: the engine's drain and query threads would
hold each request's reads and writes that long. So the server loop holds a
shorter interval while connections are in flight (``server.BUSY_SWITCH_S``),
and gives it back when the loop is idle.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator


class SwitchInterval:
    """The holds on this process's GIL switch interval, one for the process.

    Holds from several servers overlap (an engine serves a socket per
    process), so they are counted here: the shortest one held is in force,
    and the process's own interval comes back when the last one is let go
    (unless it was changed meanwhile).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[float] = []
        self._own: float | None = None  # the process's own interval, while one is held
        self._ours: float | None = None

    def take(self, interval: float) -> None:
        """Hold ``interval``."""
        with self._lock:
            if not self._held:
                self._own = sys.getswitchinterval()
            self._held.append(interval)
            self._apply()

    def give(self, interval: float) -> None:
        with self._lock:
            self._held.remove(interval)
            self._apply()

    def _apply(self) -> None:
        assert self._own is not None
        current = sys.getswitchinterval()
        if self._ours is not None and current != self._ours:
            self._own = current  # set by someone else meanwhile: that is what comes back
        want = min([self._own, *self._held]) if self._held else self._own
        if want != current:
            # the interpreter keeps whole microseconds, truncating: an interval
            # of 0.007 reads back as 0.006999..., which must not become 6999 us
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
