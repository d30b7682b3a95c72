"""The connections of the probe's server: read by one loop, answered by workers.

A connection accepted (``Connections.open``) is read by the server's loop
thread without blocking, under deadlines: ``PROBING_HEADER_TIMEOUT_S`` for
the request line and headers, ``PROBING_IDLE_TIMEOUT_S`` of silence while a
body arrives; past them it is answered 408 and closed (``expire``). A slow
or silent client costs a file descriptor and a buffer, never a thread. A
TCP request's token is checked (``Access.check_tcp``) once its head is in,
before its body is read.

A complete request goes to ``Workers``: at most ``PROBING_WORKERS``
threads, each kept ``LINGER_S`` after its last request (a cluster query's
burst reuses them). A worker answers (``request.answer``), writes the
answer and closes the connection; a connection counts against its
listener's cap (``Listener.open``) until then.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from probing.errors import log_unexpected
from probing.node.probe.access import Access
from probing.node.probe.http import App, Response, response_bytes
from probing.node.probe.request import MAX_BODY, Head, HttpError, answer, head_end, parse_head
from probing.worker import named

EVICT_AFTER_S = 1.0  # at the connection cap, a connection this old without its request makes room
WRITE_TIMEOUT_S = 30.0


class Loop(Protocol):
    """What the connections and the listeners need of the loop that reads
    and watches them (``UnixHTTPServer``)."""

    def selector(self) -> selectors.BaseSelector | None: ...

    def wake(self) -> None: ...

    def in_loop(self) -> bool:
        """Whether the caller is the loop's own thread."""
        ...


def refuse(sock: socket.socket, status: int, msg: str, kind: str = "ProbingError") -> None:
    """Answer a short error without blocking (what does not fit is lost), then close."""
    try:
        sock.send(response_bytes(Response.error(status, msg, kind)), socket.MSG_DONTWAIT)
    except (OSError, ValueError):  # a TLS socket takes no flags: it is just closed
        pass
    try:
        sock.close()
    except OSError:
        pass


def _tls_waits(err: OSError) -> bool:
    """Whether a TLS socket only waits for more to arrive (it is read again
    at its next event; a handshake's rare wait to write, at the deadline)."""
    from probing.node.probe import tls

    return bool(tls.wants_io(err))


def hung_up(sock: socket.socket, tcp: bool) -> bool:
    """Whether the client closed its end while its request runs.

    A unix socket says so exactly (HUP once the peer closed it, not on a
    half-close). TCP cannot tell a close from ``shutdown(SHUT_WR)``: its EOF
    counts as gone, so a TCP client must keep its end open for the answer.
    """
    import select

    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLRDHUP)
        events = poller.poll(0)
    except (OSError, ValueError):
        return True  # the socket is gone already
    mask = events[0][1] if events else 0
    if mask & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
        return True
    return tcp and bool(mask & select.POLLRDHUP)


class Workers:
    """At most ``limit`` request threads, each kept ``LINGER_S`` after its last
    request: the requests of a burst (a cluster query every few seconds) reuse
    them rather than starting a thread each; an idle probe is back to none.
    Jobs beyond ``limit`` wait in order for a thread."""

    LINGER_S = 2.0  # a burst's requests come within ms; an engine has a server a rank

    def __init__(self, serve: Callable[[Conn, bytes], None], limit: int = 8) -> None:
        self._serve = serve
        self.limit = max(1, limit)
        self._cond = threading.Condition(threading.Lock())
        self._jobs: deque[tuple[Conn, bytes]] = deque()
        self._threads = 0
        self._idle = 0
        self._logged: set[str] = set()  # the errors its threads wrote to the log

    @property
    def threads(self) -> int:
        return self._threads

    def submit(self, job: tuple[Conn, bytes]) -> None:
        with self._cond:
            self._jobs.append(job)
            if self._idle >= len(self._jobs):
                self._cond.notify()
                return
            if self._threads >= self.limit:
                return  # a thread takes it when it is done with its own
            self._threads += 1
        try:
            threading.Thread(target=named("probing-request", self._run), name="probing-request",
                             daemon=True).start()  # fmt: skip
        except RuntimeError:  # "can't start new thread": a running one takes it
            with self._cond:
                self._threads -= 1

    def _run(self) -> None:
        while True:
            with self._cond:
                deadline = time.monotonic() + self.LINGER_S
                while not self._jobs:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._threads -= 1
                        return
                    self._idle += 1
                    self._cond.wait(left)
                    self._idle -= 1
                job = self._jobs.popleft()
            try:
                self._serve(*job)
            except BaseException as err:  # a worker never dies (its count would lie)
                log_unexpected("a request worker failed", err, self._logged)


class Listener:
    """A listening socket (the unix one, or the TCP port) and its connections' count."""

    __slots__ = ("sock", "tcp", "tls", "open", "capped", "retry_at")

    def __init__(self, sock: socket.socket, tcp: bool, tls: Any = None) -> None:
        self.sock = sock
        self.tcp = tcp
        self.tls = tls  # an ssl.SSLContext: its connections speak TLS only (probe.tls)
        self.open = 0  # its connections not yet closed (reading, queued or answered)
        self.capped = False  # at the cap: not accepting (callers wait in the kernel's backlog)
        self.retry_at = 0.0  # when its oldest silent connection may make room


class Conn:
    """One connection, from its accept until its answer is written."""

    __slots__ = ("sock", "listener", "remote", "peer_uid", "buf", "head", "opened", "deadline",
                 "shaking")  # fmt: skip

    def __init__(
        self, sock: socket.socket, listener: Listener, remote: str | None, peer_uid: int | None
    ) -> None:
        self.sock = sock
        self.listener = listener
        self.remote = remote
        self.peer_uid = peer_uid
        self.buf = bytearray()
        self.head: Head | None = None
        self.opened = time.monotonic()
        self.deadline = 0.0
        self.shaking = listener.tls is not None  # its TLS handshake is not done yet


class Connections:
    """The connections the loop reads requests from, and the workers that
    answer them with ``app``."""

    def __init__(
        self,
        loop: Loop,
        app: App,
        access: Access,
        stats: dict[str, int],
        *,
        workers: int,
        header_timeout: float,
        idle_timeout: float,
    ) -> None:
        self._loop = loop
        self.app = app
        self._access = access
        self.stats = stats  # the server's counters: "evicted" here
        self.header_timeout = header_timeout
        self.idle_timeout = idle_timeout
        self._reading: dict[int, Conn] = {}  # fd -> connection the loop is reading
        self._lock = threading.Lock()  # the listeners' counts (workers close connections)
        self.workers = Workers(self._serve, workers)
        self._tcp: weakref.WeakSet[socket.socket] = weakref.WeakSet()  # cut by cut_tcp()

    def open(
        self, sock: socket.socket, lst: Listener, remote: str | None, peer_uid: int | None
    ) -> None:
        """Read a request from ``sock``, a connection ``lst`` accepted."""
        try:
            sock.setblocking(False)
            if lst.tcp:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._tcp.add(sock)
            if lst.tls is not None:
                from probing.node.probe import tls

                sock = tls.wrap(lst.tls, sock, server=True)
            c = Conn(sock, lst, remote, peer_uid)
            c.deadline = c.opened + self.header_timeout
            self._loop.selector().register(sock, selectors.EVENT_READ, c)  # type: ignore[union-attr]
        except (OSError, ValueError, KeyError):
            sock.close()
            return
        with self._lock:
            lst.open += 1
        self._reading[sock.fileno()] = c

    def busy(self) -> bool:
        """Whether the loop reads a connection now."""
        return bool(self._reading)

    # -- deadlines and room ------------------------------------------------------
    def next_deadline(self) -> float | None:
        """When the first connection read now runs out of time."""
        return min((c.deadline for c in self._reading.values()), default=None)

    def expire(self, now: float) -> None:
        """Answer 408 to every connection read now whose deadline passed."""
        for c in [c for c in self._reading.values() if c.deadline <= now]:
            what = "request head" if c.head is None else "request body"
            self.close(c, 408, f"the {what} did not arrive in time")

    def first_opened(self, lst: Listener) -> float | None:
        """When the oldest connection of ``lst`` read now was opened."""
        return min((c.opened for c in self._reading.values() if c.listener is lst), default=None)

    def evict(self, lst: Listener) -> bool:
        """Close the connection of ``lst`` that has waited longest for its request."""
        now = time.monotonic()
        waiting = [c for c in self._reading.values() if c.listener is lst]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.opened)
        if now - oldest.opened < EVICT_AFTER_S:
            return False
        self.stats["evicted"] += 1
        self.close(oldest, 408, "dropped to make room: the request took too long to arrive")
        return True

    # -- reading -----------------------------------------------------------------
    def read(self, c: Conn) -> None:
        """What arrived on ``c``; a whole request goes to the workers."""
        try:
            if c.shaking:
                c.sock.do_handshake()  # type: ignore[attr-defined]
                c.shaking = False
            data = c.sock.recv(65536)
            while c.listener.tls is not None and data and c.sock.pending():  # type: ignore[attr-defined]
                data += c.sock.recv(65536)  # decrypted already: no event will say so
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            if c.listener.tls is not None and _tls_waits(err):
                return
            if c.shaking:  # no certificate, or not ours: nothing of it was read
                self.stats["tls_refused"] = self.stats.get("tls_refused", 0) + 1
            self.close(c)
            return
        if not data:
            self.close(c)
            return
        c.buf += data
        try:
            if c.head is None:
                end = head_end(c.buf)
                if end < 0:
                    return
                c.head = parse_head(bytes(c.buf[:end]))
                del c.buf[:end]
                if c.remote is not None:
                    self._access.check_tcp(c.head)
                if c.head.length > MAX_BODY:
                    raise HttpError(413, f"request body too large (over {MAX_BODY} bytes)")
            c.deadline = time.monotonic() + self.idle_timeout
            if len(c.buf) < c.head.length:
                return
        except HttpError as err:
            self.close(c, err.status, str(err), err.kind)
            return
        self._forget(c)
        body = bytes(c.buf[: c.head.length])
        c.buf = bytearray()
        self.workers.submit((c, body))

    def _forget(self, c: Conn) -> None:
        self._reading.pop(c.sock.fileno(), None)
        try:
            self._loop.selector().unregister(c.sock)  # type: ignore[union-attr]
        except (KeyError, ValueError, OSError):
            pass

    def close(self, c: Conn, status: int = 0, msg: str = "", kind: str = "ProbingError") -> None:
        """Stop reading ``c`` and close it, answering ``status`` first if given."""
        self._forget(c)
        if status:
            refuse(c.sock, status, msg, kind)
        else:
            c.sock.close()
        self._closed(c)

    def _closed(self, c: Conn) -> None:
        with self._lock:
            c.listener.open -= 1
        if c.listener.capped and not self._loop.in_loop():
            self._loop.wake()  # a slot is free: the loop accepts on it again

    def _serve(self, c: Conn, body: bytes) -> None:
        """On a worker thread: answer one request and close its connection."""
        try:
            assert c.head is not None
            tcp = c.remote is not None
            resp = answer(
                self.app, c.head, body, c.peer_uid, c.remote, lambda: hung_up(c.sock, tcp)
            )
            c.sock.settimeout(WRITE_TIMEOUT_S)
            c.sock.sendall(response_bytes(resp))
        except OSError:  # the client went away (a bug goes to the worker's log)
            pass
        finally:
            try:
                c.sock.close()
            except OSError:
                pass
            self._closed(c)

    # -- closing -----------------------------------------------------------------
    def cut_tcp(self) -> None:
        """Cut every TCP connection, in flight or not."""
        for conn in list(self._tcp):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def close_all(self) -> None:
        """Close every connection read now (the server stops)."""
        for c in list(self._reading.values()):
            try:
                c.sock.close()
            except OSError:
                pass
        self._reading.clear()
