"""The one background loop: a named daemon thread that runs a step until stopped.

The probe and the node run a few loops beside their real work: the tracer's
drain, the samplers, the detector's looks and full detections, the engine's
watch over its processes' deaths, the agent's scans, the webhook's sender,
an export's reader. Each is a ``Worker``: ``start()`` runs it on a daemon
thread of its own name (``ps`` and the tests look for ``probing-watch``,
``probing-nvml`` ...), ``run()`` on the calling thread instead (the engine and
the agent, whose main thread is the loop), ``stop()`` ends it.

Two ways to loop:

* periodic (``every_s`` given): ``step`` is called every ``every_s`` (first
  after one period, or at once with ``at_once``), the wait measured from
  the end of the step; ``sooner``, asked after each step (one that raised
  too), may shorten that wait: the seconds until the next step is due, or
  None. A loop with a pace of its own (a steady rate, a ring filling fast)
  says it through ``sooner``;
* once (``every_s`` None): ``step`` is the loop itself, and looks at
  ``stopping`` or sleeps with ``wait`` to end when asked.

A periodic worker made with ``shared=True`` runs on its name's ``Beat``:
one thread for every worker of that name in the process, each step when
it is due (the engine's ranks' drains, samplers and detectors: as many
threads as kinds of loop, not as ranks). Its steps must not wait on each
other: one that takes long delays the others of its name.

A step that raises never ends the loop: it is counted (``errors``), kept in
``last_error`` (a ``ProbingError`` by its text, anything else, a bug, as
``Type: text``), a bug is written to the log once (``log_unexpected``, when
the worker has a ``what`` to say it under), and ``on_error`` lets the owner
show it in its own status. The next step tries again.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable

from probing.errors import ProbingError, log_unexpected

DEFAULT_JOIN_S = 10.0  # how long stop() waits for the thread to end


_PR_SET_NAME = 15
_prctl = None


def os_name(name: str) -> None:
    """Give the calling thread ``name`` in the kernel too (its first 15 bytes,
    ``PR_SET_NAME``): ``top -H``, ``ps -L``, py-spy and ``/proc/PID/task/*/comm``
    then tell which of the engine's loops spends its CPU. A thread of ours
    only (never the process's main thread: that would rename the process)."""
    global _prctl
    try:
        if _prctl is None:
            import ctypes

            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        _prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # no prctl (not Linux): the name stays Python's
        pass


def named(name: str, target: Callable[..., object]) -> Callable[..., None]:
    """``target``, run under ``name`` in the kernel (``os_name``): a thread's target."""

    def run(*args: object) -> None:
        os_name(name)
        target(*args)

    return run


def error_text(err: BaseException) -> str:
    """How a status says ``err``: a ``ProbingError`` by its text (written to
    be read), anything else (a bug) with its type."""
    if isinstance(err, ProbingError):
        return str(err)
    return f"{type(err).__name__}: {err}"


class Worker:
    """``step`` on a daemon thread named ``name`` until ``stop()``: every
    ``every_s`` (or sooner), or once when ``every_s`` is None.

    ``what``: the words a bug in a step is logged under (None: counted and
    kept, not logged: a loop inside the traced job that must stay quiet);
    ``on_error``: told of every step that raised, after the counts;
    ``wake``: wakes a step that blocks on something other than ``wait`` (a
    pipe, a condition) when ``stop()`` is called; ``event``: the stop event,
    when its owner holds it (one event that stops several workers): the
    owner clears it to start again, ``start()`` does not (a stop asked
    before the start is kept).
    """

    def __init__(
        self,
        name: str,
        step: Callable[[], object],
        every_s: float | None = None,
        *,
        at_once: bool = False,
        sooner: Callable[[], float | None] | None = None,
        what: str | None = None,
        on_error: Callable[[Exception], None] | None = None,
        wake: Callable[[], None] | None = None,
        event: threading.Event | None = None,
        shared: bool = False,
    ) -> None:
        if shared and every_s is None:
            raise ValueError("a shared worker is periodic: give every_s")
        self.name = name
        self.step = step
        self.every_s = every_s  # read before each wait: a running loop takes a new period
        self.at_once = at_once
        self.sooner = sooner
        self.what = what
        self.on_error = on_error
        self.wake = wake
        self.steps = 0  # steps run, those that raised too
        self.errors = 0  # steps that raised
        self.last_error: str | None = None
        self._own_event = event is None
        self._stop = event if event is not None else threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._here = 0  # run() in progress on a caller's thread
        self._logged: set[str] = set()  # the bugs written to the log (each once)
        self._beat = Beat.of(name) if shared else None

    # -- state -----------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        """Whether it was asked to stop (a step that loops itself ends then)."""
        return self._stop.is_set()

    @property
    def running(self) -> bool:
        """Whether the loop runs and was not asked to stop."""
        return self._alive() and not self._stop.is_set()

    @property
    def state(self) -> str:
        """``running``, ``stopping`` (asked to, its step not ended yet) or ``stopped``."""
        if not self._alive():
            return "stopped"
        return "stopping" if self._stop.is_set() else "running"

    def _alive(self) -> bool:
        if self._beat is not None:
            return self._beat.holds(self)
        thread = self._thread
        return self._here > 0 or (thread is not None and thread.is_alive())

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Run the loop on its thread; a running worker is left alone (safe
        twice), a stopped one starts again (its owner clears an ``event``
        it holds first)."""
        with self._lock:
            if self.running:
                return
            if self._own_event:
                self._stop.clear()
            if self._beat is not None:
                self._beat.add(self, 0.0 if self.at_once else float(self.every_s or 0.0))
                return
            self._thread = threading.Thread(
                target=named(self.name, self.run), name=self.name, daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float | None = DEFAULT_JOIN_S) -> None:
        """Ask the loop to end (it does after the step in progress) and wait
        at most ``timeout`` s for its thread (None: as long as it takes);
        from the worker's own thread (a step that stops it), no wait."""
        self._stop.set()
        if self.wake is not None:
            self.wake()
        if self._beat is not None:
            self._beat.remove(self, timeout)
            return
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds``, or less when stopped meanwhile; whether it was."""
        return self._stop.wait(seconds)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        """The loop, on the calling thread (``start`` runs it on its own),
        until stopped; a stop asked before it began is kept."""
        with self._lock:
            self._here += 1
        try:
            if self.every_s is None:
                self._step()
                return
            wait = 0.0 if self.at_once else self.every_s
            while not self._stop.wait(wait):
                self._step()
                wait = self._next_wait()
        finally:
            with self._lock:
                self._here -= 1

    def _step(self) -> None:
        try:
            self.step()
        except Exception as err:  # the top of a loop: counted, kept, goes on
            self._failed(err)
        finally:
            self.steps += 1

    def _next_wait(self) -> float:
        """``every_s``, or what ``sooner`` says, when sooner."""
        wait = float(self.every_s or 0.0)
        if self.sooner is None:
            return wait
        try:
            due = self.sooner()
        except Exception as err:  # a bug in the pace: the period, and said
            self._failed(err)
            return wait
        return wait if due is None else max(0.0, min(wait, due))

    def _failed(self, err: Exception) -> None:
        self.errors += 1
        self.last_error = error_text(err)
        if self.what is not None and not isinstance(err, ProbingError):
            log_unexpected(self.what, err, self._logged)
        if self.on_error is not None:
            self.on_error(err)


class Beat:
    """The one thread ``name`` that runs every shared worker of that name,
    each step when it is due (``Worker(shared=True)``). The thread starts
    with the first worker and ends once none is left."""

    _all: dict[str, Beat] = {}
    _all_lock = threading.Lock()

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, Worker]] = []  # (monotonic s, token, worker)
        # each worker on it, by the token of its entry in _due (an entry of
        # another token is one left by a stop and a start since: skipped)
        self._members: dict[Worker, int] = {}
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._running: Worker | None = None  # the worker whose step runs now

    @classmethod
    def of(cls, name: str) -> Beat:
        """The process's beat of ``name``."""
        with cls._all_lock:
            beat = cls._all.get(name)
            if beat is None:
                beat = cls._all[name] = cls(name)
            return beat

    def holds(self, worker: Worker) -> bool:
        """Whether ``worker`` is on this beat (or its step runs)."""
        with self._cond:
            return worker in self._members or self._running is worker

    def add(self, worker: Worker, first_s: float) -> None:
        with self._cond:
            token = self._members[worker] = next(self._order)
            if self._running is not worker:  # else its step, once done, puts it back
                heapq.heappush(self._due, (time.monotonic() + first_s, token, worker))
            if self._thread is None:
                self._start_locked()
            self._cond.notify_all()

    def _start_locked(self) -> None:
        self._thread = threading.Thread(
            target=named(self.name, self._loop), name=self.name, daemon=True
        )
        self._thread.start()

    def remove(self, worker: Worker, timeout: float | None) -> None:
        """Take ``worker`` off; wait at most ``timeout`` s for its step in
        progress (none from the beat's own thread: a step that stops one)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._members.pop(worker, None)
            self._cond.notify_all()
            if threading.current_thread() is self._thread:
                return
            while self._running is worker:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._cond.wait(left)

    def _next(self) -> Worker | None:
        """The next worker due, once it is; None once none is left (the
        thread then ends). Called with the condition held."""
        while True:
            while self._due and self._members.get(self._due[0][2]) != self._due[0][1]:
                heapq.heappop(self._due)  # taken off meanwhile (or off and on again)
            if not self._due:
                self._thread = None
                return None
            at, _, worker = self._due[0]
            if worker.stopping:  # its event was set without stop(): off, as a thread ends
                heapq.heappop(self._due)
                self._members.pop(worker, None)
                continue
            wait = at - time.monotonic()
            if wait <= 0:
                heapq.heappop(self._due)
                self._running = worker
                return worker
            self._cond.wait(wait)

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    worker = self._next()
                if worker is None:
                    return
                self._turn(worker)
        except BaseException:  # not a step's error (those are counted): the
            with self._cond:  # others of the name go on, on a thread of their own
                self._running = None
                self._thread = None
                if self._members:
                    self._start_locked()
            raise

    def _turn(self, worker: Worker) -> None:
        """``worker``'s step, then its next turn (unless taken off meanwhile)."""
        wait = float(worker.every_s or 0.0)
        try:
            worker._step()
            wait = worker._next_wait()
        finally:
            with self._cond:
                self._running = None
                token = self._members.get(worker)
                if token is not None and not worker.stopping:
                    heapq.heappush(self._due, (time.monotonic() + wait, token, worker))
                else:
                    self._members.pop(worker, None)
                self._cond.notify_all()


def stop_on_signals(stop: Callable[[], None], signals: tuple[int, ...]) -> None:
    """``stop()`` when one of ``signals`` arrives, called on a thread of its own
    (``probing-signals``), never in the handler: a handler runs on whatever
    thread it interrupted, maybe inside the very lock ``stop()`` takes (an
    ``Event.set`` while that thread waits on the event: a SIGTERM at the wrong
    instant hung an engine for good). The handler only writes a byte to a
    pipe, which takes no lock; the thread reads it and stops. Call from the
    main thread (where Python runs handlers), before the loop it stops."""
    import os
    import signal

    read, write = os.pipe()
    os.set_blocking(write, False)  # a burst of signals never blocks the handler

    def wait() -> None:
        while True:
            try:
                if os.read(read, 1):
                    break
            except InterruptedError:
                continue
        stop()

    threading.Thread(target=wait, name="probing-signals", daemon=True).start()

    def handler(signum: int, _frame: object) -> None:
        try:
            os.write(write, bytes([signum & 0xFF]))
        except BlockingIOError:  # the pipe is full: a stop is on its way already
            pass

    for sig in signals:
        signal.signal(sig, handler)
