"""Where a query runs: a few threads of the probe's own, with a time limit.

Every query runs on a ``probing-query`` thread (an idle one, or a new one:
a query never waits for a slot, as a table's producer may run a query of
its own on another thread while its caller holds one; the server bounds
how many requests run at once). The threads are started with a stack of
``STACK_BYTES`` whatever the host set with ``threading.stack_size``:
DataFusion plans by recursion on the calling thread, and the depth
``check_sql`` allows must fit with room to spare.

The caller waits for its query and, every ``POLL_S``, checks its deadline
and whether its client went away. Either stops the query for real: the
thread gets ``Cancelled`` raised into it (``PyThreadState_SetAsyncExc``),
which datafusion-python (>= 51) delivers within a second even while a
single batch is being computed (it runs a line of Python every second
while it waits on the query), and dropping the stream aborts DataFusion's
tasks. A thread is idle-free: it exits ``LINGER_S`` after its last query.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import pyarrow as pa

from probing.errors import QueryError
from probing.node.sql.limits import LimitExceeded, Limits
from probing.worker import named

T = TypeVar("T")

STACK_BYTES = 64 << 20  # virtual: pages are committed only as deep as planning goes
POLL_S = 0.2
GRACE_S = 5.0  # after a cancel, how long the caller waits for the thread to let go


class Cancelled(BaseException):
    """Raised into a query thread to stop its query (never seen outside this module)."""


_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = (ctypes.c_ulong, ctypes.c_void_p)
_set_async_exc.restype = ctypes.c_int


def _interrupt(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in the thread at its next Python line (None: take it back).
    ``exc`` is a class this module keeps alive; the call takes its own reference."""
    _set_async_exc(thread_id, id(exc) if exc is not None else None)


_local = threading.local()  # .job: the job this thread is running (query threads only)


class _Job(Generic[T]):
    __slots__ = ("fn", "done", "result", "error", "state", "thread_id", "stopped")

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None
        self.state = "queued"  # -> running -> done, or queued -> dropped
        self.thread_id = 0
        self.stopped: BaseException | None = None  # why the caller stopped it


class QueryThreads:
    """Query threads, started on demand, each gone ``LINGER_S`` after its last query."""

    LINGER_S = 5.0

    def __init__(self, stack_bytes: int = STACK_BYTES) -> None:
        self.stack_bytes = stack_bytes
        self._lock = threading.Lock()  # a plain Lock: its ``with`` cannot be split by Cancelled
        self._jobs: queue.SimpleQueue[_Job[Any]] = queue.SimpleQueue()
        self._threads = 0
        self._busy = 0

    @property
    def threads(self) -> int:
        return self._threads

    def run(
        self,
        fn: Callable[[], T],
        *,
        timeout_s: float,
        gone: Callable[[], bool] | None = None,
        timeout_setting: str = "PROBING_QUERY_TIMEOUT_S",
    ) -> T:
        """``fn()`` on a query thread; its result, or its exception re-raised.

        Past ``timeout_s`` (waiting included) or once ``gone()`` is true the
        query is cancelled and this raises ``LimitExceeded`` / ``QueryError``.
        Called from a query thread (a table's producer running a query of its
        own), ``fn`` runs right there, under the outer query's limits.
        """
        if getattr(_local, "job", None) is not None:
            return fn()
        job: _Job[T] = _Job(fn)
        self._submit(job)
        deadline = time.monotonic() + timeout_s
        try:
            while not job.done.wait(max(0.0, min(POLL_S, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    self._stop(
                        job,
                        LimitExceeded(
                            f"the query ran past the time limit of {timeout_s:g} s "
                            "and was cancelled",
                            setting=timeout_setting,
                            limit=timeout_s,
                        ),
                    )
                    break
                if gone is not None and _safe(gone):
                    self._stop(job, QueryError("the client went away: the query was cancelled"))
                    break
        except BaseException:  # KeyboardInterrupt in the caller: the query stops too
            self._stop(job, QueryError("the caller was interrupted: the query was cancelled"))
            raise
        if job.stopped is not None:
            job.done.wait(GRACE_S)  # the thread lets go within a second or so
            raise job.stopped
        job.done.wait()  # it ended as the caller stopped waiting: its outcome is being set
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]

    def _submit(self, job: _Job[Any]) -> None:
        with self._lock:
            self._jobs.put(job)
            start = self._threads - self._busy < self._jobs.qsize()
            if start:
                self._threads += 1
        if start:
            try:
                _start_thread(self._work, self.stack_bytes)
            except RuntimeError:  # "can't start new thread": a running one takes it
                with self._lock:
                    self._threads -= 1
                if self._threads == 0:
                    raise QueryError("no thread could be started to run the query") from None

    def _stop(self, job: _Job[Any], why: BaseException) -> None:
        with self._lock:
            if job.state == "queued":
                job.state = "dropped"
                job.stopped = why
                job.done.set()
            elif job.state == "running" and job.stopped is None:
                job.stopped = why
                _interrupt(job.thread_id, Cancelled)

    def _work(self) -> None:
        me = threading.get_ident()
        job: _Job[Any] | None
        while True:
            try:
                job = self._jobs.get(timeout=self.LINGER_S)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():
                        self._threads -= 1
                        return
                continue
            with self._lock:
                if job.state != "queued":
                    continue  # stopped while it waited
                job.state = "running"
                job.thread_id = me
                self._busy += 1
            self._execute(job, me)
            job = None  # a lingering thread holds no result

    def _execute(self, job: _Job[Any], me: int) -> None:
        _local.job = job
        try:
            job.result = job.fn()
        except BaseException as err:  # handed to the caller
            # its frames would keep the DataFusion stream (and so the query)
            # alive as long as the error lives: only the lines are kept
            traceback.clear_frames(err.__traceback__)
            job.error = None if isinstance(err, Cancelled) else err
        finally:
            # A Cancelled sent just before the query ended may land anywhere
            # here: repeat until the job is marked done under the lock, after
            # which nothing is sent to this thread and nothing is pending.
            while True:
                try:
                    with self._lock:
                        job.state = "done"
                        self._busy -= 1
                        _interrupt(me, None)
                    break
                except Cancelled:
                    if job.state == "done":
                        break
            _local.job = None
            job.done.set()


# every database of the process runs its queries here: an engine's ranks share
# the threads idle between their queries (one pool a rank kept each rank's
# threads lingering after a detection asked every rank at once)
QUERY_THREADS = QueryThreads()


def _safe(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except OSError:  # a socket that cannot be asked: the query goes on
        return False


_stack_lock = threading.Lock()


def _start_thread(target: Callable[[], None], stack_bytes: int) -> None:
    """Start a daemon thread with a stack of ``stack_bytes``; the process's
    setting (``threading.stack_size``) is put back at once."""
    with _stack_lock:
        old = threading.stack_size()
        try:
            threading.stack_size(stack_bytes)
        except (ValueError, RuntimeError):  # a platform that refuses: its default
            pass
        try:
            threading.Thread(target=named("probing-query", target), name="probing-query",
                             daemon=True).start()  # fmt: skip
        finally:
            threading.stack_size(old)


def datafusion_error(err: BaseException) -> bool:
    """Whether ``err`` is DataFusion's answer about a query: it raises a plain
    ``Exception`` (execution) or ``ValueError`` (SQL, planning) with its
    message, and the batches it hands over may raise pyarrow's errors. Any
    other exception out of a query is a bug of probing's (answered 500)."""
    return type(err) in (Exception, ValueError) or isinstance(err, pa.ArrowException)


def collect(df: Any, limits: Limits, schema: pa.Schema | None = None) -> pa.Table:
    """Stream ``df``'s batches into a table, refusing a result over
    ``limits.result_bytes``; stopping early drops the stream, which aborts
    DataFusion's tasks."""
    stream = df.execute_stream()
    try:
        batches: list[pa.RecordBatch] = []
        total = 0
        for batch in stream:
            rb = batch.to_pyarrow()
            total += rb.nbytes
            if total > limits.result_bytes:
                raise LimitExceeded(
                    f"the result is over the limit of {limits.result_bytes >> 20} MiB "
                    f"(stopped after {sum(b.num_rows for b in batches) + rb.num_rows} rows); "
                    "add a LIMIT, a WHERE or an aggregate",
                    setting="PROBING_QUERY_MAX_RESULT_MB",
                    limit=limits.result_bytes >> 20,
                )
            batches.append(rb)
        if schema is None:
            schema = batches[0].schema if batches else df.schema()
        return pa.Table.from_batches(batches, schema=schema)
    finally:
        stream = None  # the traceback must not keep the query alive
