"""HTTP on a unix socket (and, in cluster mode, a TCP port): one loop thread
reads requests, a few worker threads answer them.

No timers and no polling: an idle probe is a thread blocked in ``epoll`` on
the listening sockets and a wake-up pipe, so it costs no CPU. The loop
accepts connections and reads each request without blocking, under
deadlines: a slow or silent client costs a file descriptor and a buffer,
never a thread. A complete request goes to a bounded pool of worker
threads, each kept 5 s after its last request (a cluster query's burst
reuses them). Every exception ends as an HTTP error, never in the host.

The unix socket trusts its caller's uid (``SO_PEERCRED``). The TCP port
trusts only a bearer token, compared in constant time once the headers are
in and before the body is read: without it the answer is 401 and nothing
runs.

Limits, read from the environment when the server starts:

- ``PROBING_MAX_CONNECTIONS`` (64): open connections per listening socket.
  At the cap, the connection that has waited longest (at least 1 s) for its
  request is dropped to make room; when none has, the new one gets 503.
- ``PROBING_WORKERS`` (8): threads answering requests; the rest wait.
- ``PROBING_HEADER_TIMEOUT_S`` (10): time for the request line and headers.
- ``PROBING_IDLE_TIMEOUT_S`` (10): longest silence while a body arrives.
- File descriptors: a connection that would leave the host fewer than
  ``fd_reserve()`` descriptors below ``RLIMIT_NOFILE`` is answered 503 and
  closed. When ``accept`` fails (EMFILE, ENFILE, ...), one spare descriptor
  is given up to accept and drop the waiting connection, and the listeners
  rest (50 ms, doubling to 1 s) before the next try; the loop never ends
  but by ``stop()``.

Requests are parsed strictly (``parse_head``): a line over 8 KiB or a head
over 32 KiB is 431, never split; duplicate ``Authorization``,
``Content-Length``, ``Host`` or ``Transfer-Encoding`` headers, a
``Content-Length`` that is not digits, folded lines and control characters
are 400, and chunked bodies 501.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import selectors
import socket
import struct
import threading
import time
import weakref
from _operator import _compare_digest
from collections import deque
from collections.abc import Callable
from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit

from probing import config
from probing.errors import log_unexpected
from probing.probe.http import App, Request, Response, response_bytes
from probing.probe.imports import SWITCH

MAX_BODY = 16 << 20
MAX_LINE = 8192  # request line or one header line, without its line end
MAX_HEAD = 32768  # request line and headers together
MAX_HEADERS = 100
EVICT_AFTER_S = 1.0  # at the connection cap, a connection this old without its request makes room
WRITE_TIMEOUT_S = 30.0
BUSY_SWITCH_S = 0.0005  # the GIL switch interval while connections are in flight


def _peer_cred(conn: socket.socket) -> tuple[int, int] | None:
    """(pid, uid) of the other end of a unix socket, or None."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", raw)
        return pid, uid
    except OSError:
        return None


def _peer_uid(conn: socket.socket) -> int | None:
    cred = _peer_cred(conn)
    return None if cred is None else cred[1]


class HttpError(Exception):
    """A request refused before it reaches the app: its status and why."""

    def __init__(self, status: int, msg: str) -> None:
        super().__init__(msg)
        self.status = status


class Head(NamedTuple):
    """A request line and its headers (names lower-case), with the body's length."""

    method: str
    target: str
    headers: dict[str, str]
    length: int


_END = re.compile(rb"\r?\n\r?\n")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(rb"[\x21-\x7e]+")
_VERSION = re.compile(rb"HTTP/1\.[01]")
_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_DIGITS = re.compile(rb"[0-9]{1,15}")
_ONCE = {b"authorization", b"content-length", b"host", b"transfer-encoding"}


def head_end(buf: bytes | bytearray) -> int:
    """Where the head in ``buf`` ends (after its blank line), -1 when it has not
    yet; HttpError(431) as soon as a line or the head is too long."""
    m = _END.search(buf, 0, MAX_HEAD + 4)
    if m is not None:
        return m.end()
    if len(buf) > MAX_HEAD:
        raise HttpError(431, f"request head over {MAX_HEAD} bytes")
    if len(buf) - (buf.rfind(b"\n") + 1) > MAX_LINE + 1:
        raise HttpError(431, f"a request line or header over {MAX_LINE} bytes")
    return -1


def parse_head(raw: bytes) -> Head:
    """The request line and headers of ``raw`` (a whole head), strictly.

    >>> parse_head(b"POST /query HTTP/1.0\\r\\nContent-Length: 2\\r\\n\\r\\n").length
    2
    """
    lines = raw.split(b"\n")
    while lines and lines[-1] in (b"", b"\r"):
        lines.pop()
    if not lines:
        raise HttpError(400, "empty request")
    for i, line in enumerate(lines):
        if line.endswith(b"\r"):
            line = lines[i] = line[:-1]
        if len(line) > MAX_LINE:
            raise HttpError(431, f"a request line or header over {MAX_LINE} bytes")
        if b"\r" in line:
            raise HttpError(400, "a bare CR in the request head")
    if len(lines) - 1 > MAX_HEADERS:
        raise HttpError(431, f"more than {MAX_HEADERS} headers")
    parts = lines[0].split(b" ")
    if (
        len(parts) != 3
        or not _TOKEN.fullmatch(parts[0])
        or not _TARGET.fullmatch(parts[1])
        or not _VERSION.fullmatch(parts[2])
    ):
        raise HttpError(400, "not an HTTP/1.x request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            raise HttpError(400, "malformed header line (or a folded one)")
        value = value.strip(b" \t")
        if _CTL.search(value):
            raise HttpError(400, "a control character in a header value")
        key = name.lower()
        if key in _ONCE and key.decode() in headers:
            raise HttpError(400, f"duplicate {name.decode()} header")
        headers[key.decode()] = value.decode("latin-1")
    if "transfer-encoding" in headers:
        raise HttpError(501, "Transfer-Encoding is not supported: send a Content-Length")
    length = 0
    if "content-length" in headers:
        given = headers["content-length"].encode("latin-1")
        if not _DIGITS.fullmatch(given):
            raise HttpError(400, "Content-Length must be digits only")
        length = int(given)
    return Head(parts[0].decode(), parts[1].decode(), headers, length)


def authorized(headers: dict[str, str], token: bytes) -> bool:
    """``Authorization: Bearer <token>``, compared in constant time."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    # hmac's own constant-time compare without hmac, which loads OpenSSL
    # (4 MB of every idle probe's RSS) for a check only TCP requests make
    return _compare_digest(given.strip().encode("latin-1", "replace"), token)


def _refuse(sock: socket.socket, status: int, msg: str, kind: str = "ProbingError") -> None:
    """Answer a short error without blocking (what does not fit is lost), then close."""
    try:
        sock.send(response_bytes(Response.error(status, msg, kind)), socket.MSG_DONTWAIT)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


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


def answer(
    app: App,
    head: Head,
    body: bytes,
    peer_uid: int | None,
    remote: str | None,
    gone: Callable[[], bool] | None = None,
) -> Response:
    """Run ``app`` on one parsed request; every failure becomes an HTTP error."""
    try:
        url = urlsplit(head.target)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        req = Request(head.method, url.path, query, body, peer_uid, remote, head.headers, gone)
        return app(req)
    except BaseException as err:  # noqa: BLE001 - nothing escapes into the host: a bug answers 500
        log_unexpected(f"{head.method} {head.target} failed", err)
        return Response.error(500, f"{type(err).__name__}: {err}")


class _Workers:
    """At most ``limit`` request threads, each kept ``LINGER_S`` after its last
    request: the requests of a burst (a cluster query every few seconds) reuse
    them rather than starting a thread each; an idle probe is back to none.
    Jobs beyond ``limit`` wait in order for a thread."""

    LINGER_S = 5.0

    def __init__(self, serve: Callable[..., None], limit: int = 8) -> None:
        self._serve = serve
        self.limit = max(1, limit)
        self._cond = threading.Condition(threading.Lock())
        self._jobs: deque[tuple] = deque()
        self._threads = 0
        self._idle = 0
        self._logged: set[str] = set()  # the errors its threads wrote to the log

    @property
    def threads(self) -> int:
        return self._threads

    def submit(self, job: tuple) -> None:
        with self._cond:
            self._jobs.append(job)
            if self._idle >= len(self._jobs):
                self._cond.notify()
                return
            if self._threads >= self.limit:
                return  # a thread takes it when it is done with its own
            self._threads += 1
        try:
            threading.Thread(target=self._run, name="probing-request", daemon=True).start()
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
            except BaseException as err:  # noqa: BLE001 - a worker never dies (its count would lie)
                log_unexpected("a request worker failed", err, self._logged)


class _Listener:
    __slots__ = ("sock", "tcp", "open", "capped", "retry_at")

    def __init__(self, sock: socket.socket, tcp: bool) -> None:
        self.sock = sock
        self.tcp = tcp
        self.open = 0  # its connections not yet closed (reading, queued or answered)
        self.capped = False  # at the cap: not accepting (callers wait in the kernel's backlog)
        self.retry_at = 0.0  # when its oldest silent connection may make room


class _Conn:
    __slots__ = ("sock", "listener", "remote", "peer_uid", "buf", "head", "opened", "deadline")

    def __init__(
        self, sock: socket.socket, listener: _Listener, remote: str | None, peer_uid: int | None
    ) -> None:
        self.sock = sock
        self.listener = listener
        self.remote = remote
        self.peer_uid = peer_uid
        self.buf = bytearray()
        self.head: Head | None = None
        self.opened = time.monotonic()
        self.deadline = 0.0


def fd_reserve(soft_limit: int) -> int:
    """Descriptors always left to the host below its ``RLIMIT_NOFILE``.

    >>> fd_reserve(1024), fd_reserve(200), fd_reserve(1 << 20)
    (128, 25, 256)
    """
    return min(256, max(16, soft_limit // 8))


def _nofile() -> int:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return soft if soft > 0 else 1 << 20
    except (ImportError, OSError, ValueError):
        return 1 << 20


_WAKE = object()
_ACCEPT_ERRORS_TRANSIENT = {
    errno.ECONNABORTED,
    errno.EPROTO,
    errno.EPERM,
    errno.ENETDOWN,
    errno.ENOPROTOOPT,
    errno.EHOSTDOWN,
    errno.ENONET,
    errno.EHOSTUNREACH,
    errno.EOPNOTSUPP,
    errno.ENETUNREACH,
    errno.ETIMEDOUT,
}


class UnixHTTPServer:
    """Serve ``app`` on a unix socket at ``path`` (mode 0600) until ``stop()``.

    ``path=None`` serves no unix socket (several cluster peers in one
    process, as the benchmark runs them). ``listen_tcp`` adds a TCP port to
    the same loop and the same ``app``, guarded by a token.
    """

    def __init__(self, path: str | None, app: App) -> None:
        self.path = path
        self.app = app
        env = config.load()
        self.max_connections = env.max_connections
        self.header_timeout = env.header_timeout_s
        self.idle_timeout = env.idle_timeout_s
        self._token: bytes | None = None
        self._listeners: list[_Listener] = []
        self._new: list[_Listener] = []  # bound by listen_tcp, registered by the loop
        self._conns: dict[int, _Conn] = {}  # fd -> connection the loop is reading
        self._lock = threading.Lock()  # the listeners' counts (workers close connections)
        self._sel: selectors.BaseSelector | None = None
        self._wake_r = self._wake_w = -1
        self._spare = -1  # given up to accept-and-drop when the process is out of fds
        self._stopping = False
        self._paused_until = 0.0
        self._backoff = 0.0
        self._switch_held = False  # a hold on the GIL switch interval (imports.SWITCH)
        self.stats = {"refused": 0, "dropped": 0, "accept_errors": 0, "evicted": 0}
        self.stats["loop_errors"] = 0  # counted; each distinct one also in the log
        self._logged: set[str] = set()  # the errors the loop wrote to the log
        self._thread: threading.Thread | None = None
        self._workers = _Workers(self._serve, env.workers)
        self._tcp_conns: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._drop_tcp = False  # close_tcp(): the loop closes the TCP listeners

    def start(self) -> None:
        if self.path is not None:
            self._listeners.append(_Listener(self._bind_unix(self.path), tcp=False))
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._spare = _open_spare()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        for lst in self._listeners:
            self._sel.register(lst.sock, selectors.EVENT_READ, lst)
        self._thread = threading.Thread(target=self._loop, name="probing-server", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind_unix(path: str) -> socket.socket:
        from probing.paths import ensure_private_dir

        ensure_private_dir(os.path.dirname(path))
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old_umask)
        sock.listen(64)
        sock.setblocking(False)
        return sock

    def listen_tcp(self, host: str, port: int, token: bytes) -> tuple[str, int]:
        """Also serve on TCP ``host:port`` (0: any free port); returns the bound address.

        Call after ``start()``; the loop picks the new socket up at once.
        """
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(256)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._token = token
        lst = _Listener(sock, tcp=True)
        with self._lock:
            self._new.append(lst)
            self._listeners.append(lst)
        self._wake()
        bound = sock.getsockname()
        return bound[0], bound[1]

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        tcp = next((lst for lst in self._listeners if lst.tcp), None)
        if tcp is None:
            return None
        bound = tcp.sock.getsockname()
        return bound[0], bound[1]

    def connections(self) -> int:
        """Connections open now, over every listener."""
        return sum(lst.open for lst in self._listeners)

    def _wake(self) -> None:
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"w")
            except OSError:
                pass

    # -- the loop --------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._once()
            except BaseException as err:  # noqa: BLE001 - the loop never dies: rest and go on
                self.stats["loop_errors"] += 1
                log_unexpected("the server loop failed", err, self._logged)
                self._rest()
                time.sleep(0.01)

    def _once(self) -> None:
        sel = self._sel
        if sel is None:
            self._stopping = True
            return
        now = time.monotonic()
        timeout = None
        if self._conns:
            timeout = max(0.0, min(c.deadline for c in self._conns.values()) - now)
        for t in [self._paused_until] + [x.retry_at for x in self._listeners if x.capped]:
            if t:
                left = max(0.0, t - now)
                timeout = left if timeout is None else min(timeout, left)
        try:
            events = sel.select(timeout)
        except InterruptedError:
            return
        for key, _ in events:
            what = key.data
            if what is _WAKE:
                self._drain_wake()
            elif isinstance(what, _Listener):
                self._accept(what)
            else:
                self._read(what)
        now = time.monotonic()
        for c in [c for c in self._conns.values() if c.deadline <= now]:
            what = "request head" if c.head is None else "request body"
            self._close(c, 408, f"the {what} did not arrive in time")
        for lst in self._listeners:
            if lst.capped and (
                lst.open < self.max_connections or (lst.retry_at and now >= lst.retry_at)
            ):
                lst.capped = False
                if not self._paused_until:
                    self._watch(lst)
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            for lst in self._listeners:
                if not lst.capped:
                    self._watch(lst)
        self._busy(bool(self._conns) or any(x.capped for x in self._listeners))

    def _busy(self, busy: bool) -> None:
        """A short GIL switch interval while connections are in flight.

        Every socket call of this loop lets go of the GIL; in a host whose
        thread spins in Python, taking it back waits a whole switch interval
        (5 ms), so a burst of connections would crawl. The hold is let go
        when the loop is idle (``imports.SWITCH`` counts the probe's holds).
        """
        if busy != self._switch_held:
            (SWITCH.take if busy else SWITCH.give)(BUSY_SWITCH_S)
            self._switch_held = busy

    def close_tcp(self) -> None:
        """Leave the peers: the TCP port closes (a new caller is refused) and
        every TCP connection, in flight or not, is cut; the unix socket stays."""
        self._drop_tcp = True
        for conn in list(self._tcp_conns):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._wake()

    def _drain_wake(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except OSError:
            pass
        if self._drop_tcp:
            self._close_tcp_listeners()
        with self._lock:
            new, self._new = self._new, []
        if not self._paused_until:
            for lst in new:
                self._watch(lst)
        # a worker closed a connection: the end of _once lets capped listeners in again

    def _close_tcp_listeners(self) -> None:
        with self._lock:
            tcp = [x for x in self._listeners if x.tcp]
            self._listeners = [x for x in self._listeners if not x.tcp]
            self._new = [x for x in self._new if not x.tcp]
        for lst in tcp:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(lst.sock)  # type: ignore[union-attr]
            lst.sock.close()

    def _watch(self, lst: _Listener) -> None:
        sel = self._sel
        if sel is None:
            return
        try:
            sel.register(lst.sock, selectors.EVENT_READ, lst)
        except KeyError:
            pass  # already watched
        except (OSError, ValueError):
            pass  # closed meanwhile

    def _rest(self) -> None:
        """Stop accepting for a while (50 ms, doubling to 1 s while it lasts)."""
        self._backoff = min(1.0, max(0.05, self._backoff * 2))
        self._paused_until = time.monotonic() + self._backoff
        sel = self._sel
        for lst in self._listeners:
            try:
                if sel is not None:
                    sel.unregister(lst.sock)
            except (KeyError, ValueError, OSError):
                pass

    def _accept(self, lst: _Listener) -> None:
        for _ in range(8):  # the rest at the next wake-up: reading goes on meanwhile
            try:
                conn, addr = lst.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                self.stats["accept_errors"] += 1
                if err.errno in _ACCEPT_ERRORS_TRANSIENT:
                    continue
                if err.errno in (errno.EMFILE, errno.ENFILE):
                    self._drop_one(lst)
                self._rest()
                return
            self._backoff = 0.0
            self._admit(lst, conn, addr)

    def _drop_one(self, lst: _Listener) -> None:
        """Out of descriptors: give up the spare one to accept and drop a caller."""
        if self._spare < 0:
            return
        os.close(self._spare)
        self._spare = -1
        try:
            conn, _ = lst.sock.accept()
            self.stats["dropped"] += 1
            _refuse(conn, 503, "the process is out of file descriptors: try again later")
        except OSError:
            pass
        self._spare = _open_spare()

    def _admit(self, lst: _Listener, conn: socket.socket, addr: object) -> None:
        limit = _nofile()
        if conn.fileno() >= limit - fd_reserve(limit):
            self.stats["refused"] += 1
            _refuse(conn, 503, "the process is near its file-descriptor limit: try again later")
            return
        remote = peer_uid = None
        if lst.tcp:
            remote = f"{addr[0]}:{addr[1]}"  # type: ignore[index]
        else:
            peer_uid = _peer_uid(conn)
            if peer_uid not in (os.getuid(), 0):
                _refuse(conn, 403, "this probe belongs to another user", "AccessDenied")
                return
        if lst.open >= self.max_connections and not self._evict(lst):
            self.stats["refused"] += 1
            self._cap(lst)
            _refuse(
                conn,
                503,
                f"the probe has {lst.open} connections open (PROBING_MAX_CONNECTIONS): "
                "try again later",
            )
            return
        try:
            conn.setblocking(False)
            if lst.tcp:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._tcp_conns.add(conn)
            c = _Conn(conn, lst, remote, peer_uid)
            c.deadline = c.opened + self.header_timeout
            self._sel.register(conn, selectors.EVENT_READ, c)  # type: ignore[union-attr]
        except (OSError, ValueError, KeyError):
            conn.close()
            return
        with self._lock:
            lst.open += 1
        self._conns[conn.fileno()] = c

    def _cap(self, lst: _Listener) -> None:
        """Stop accepting on ``lst`` until a connection closes or its oldest
        silent one may make room: the next callers wait in the kernel's
        backlog, and a flood costs the host no accept-and-refuse churn."""
        lst.capped = True
        waiting = [c.opened for c in self._conns.values() if c.listener is lst]
        lst.retry_at = min(waiting) + EVICT_AFTER_S if waiting else 0.0
        try:
            self._sel.unregister(lst.sock)  # type: ignore[union-attr]
        except (KeyError, ValueError, OSError, AttributeError):
            pass

    def _evict(self, lst: _Listener) -> bool:
        """Close the connection of ``lst`` that has waited longest for its request."""
        now = time.monotonic()
        waiting = [c for c in self._conns.values() if c.listener is lst]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.opened)
        if now - oldest.opened < EVICT_AFTER_S:
            return False
        self.stats["evicted"] += 1
        self._close(oldest, 408, "dropped to make room: the request took too long to arrive")
        return True

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(c)
            return
        if not data:
            self._close(c)
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
                    if not self._token:
                        raise HttpError(401, "this probe has no token: TCP is closed")
                    if not authorized(c.head.headers, self._token):
                        raise HttpError(401, "missing or wrong token")
                if c.head.length > MAX_BODY:
                    raise HttpError(413, f"request body too large (over {MAX_BODY} bytes)")
            c.deadline = time.monotonic() + self.idle_timeout
            if len(c.buf) < c.head.length:
                return
        except HttpError as err:
            kind = "Unauthorized" if err.status == 401 else "ProbingError"
            self._close(c, err.status, str(err), kind)
            return
        self._forget(c)
        body = bytes(c.buf[: c.head.length])
        c.buf = bytearray()
        self._workers.submit((c, body))

    def _forget(self, c: _Conn) -> None:
        self._conns.pop(c.sock.fileno(), None)
        try:
            self._sel.unregister(c.sock)  # type: ignore[union-attr]
        except (KeyError, ValueError, OSError):
            pass

    def _close(self, c: _Conn, status: int = 0, msg: str = "", kind: str = "ProbingError") -> None:
        self._forget(c)
        if status:
            _refuse(c.sock, status, msg, kind)
        else:
            c.sock.close()
        self._closed(c)

    def _closed(self, c: _Conn) -> None:
        with self._lock:
            c.listener.open -= 1
        if c.listener.capped and threading.current_thread() is not self._thread:
            self._wake()  # a slot is free: the loop accepts on it again

    def _serve(self, c: _Conn, body: bytes) -> None:
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

    # -- stopping --------------------------------------------------------------
    def stop(self, *, unlink: bool = True) -> None:
        """Stop serving; safe to call twice."""
        self._stopping = True
        self._busy(False)
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self._close_fds()
        if unlink:
            self._unlink_stale()

    def _unlink_stale(self) -> None:
        if self.path is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def abandon_after_fork(self) -> None:
        """In a forked child: drop the parent's sockets without touching its path."""
        self._thread = None
        self._stopping = True
        self._workers = _Workers(self._serve, self._workers.limit)  # no threads here
        self._lock = threading.Lock()
        self._close_fds()

    def _close_fds(self) -> None:
        sel, self._sel = self._sel, None
        if sel is not None:
            try:
                sel.close()
            except OSError:
                pass
        for c in list(self._conns.values()):
            try:
                c.sock.close()
            except OSError:
                pass
        self._conns.clear()
        for lst in self._listeners:
            try:
                lst.sock.close()
            except OSError:
                pass
        self._listeners = []
        self._new = []
        for fd in (self._wake_r, self._wake_w, self._spare):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = self._spare = -1


def _open_spare() -> int:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1
