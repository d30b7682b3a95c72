"""HTTP on a unix socket (and, in cluster mode, a TCP port): one loop thread
reads requests, a few worker threads answer them.

No timers and no polling: an idle probe is a thread blocked in ``epoll`` on
the listening sockets and a wake-up pipe, so it costs no CPU. The loop
accepts connections and reads each request without blocking, under
deadlines: a slow or silent client costs a file descriptor and a buffer,
never a thread. A complete request goes to a bounded pool of worker
threads, each kept 5 s after its last request (a cluster query's burst
reuses them). Every exception ends as an HTTP error;
the loop never ends but by ``stop()``.

``UnixHTTPServer`` owns the lifecycle (the sockets bound, the loop thread,
its selector and wake-up pipe, a stop) and hands each event of
the loop to the part that owns it:

* ``accept``: the listeners and whom they let in (``Acceptor``: descriptor
  reserve, connection cap and eviction, rest after accept errors);
* ``connections``: the connections read and the workers that answer them
  (``Connections``, ``Workers``), with their deadlines;
* ``access``: who may ask (``Access``): the unix socket trusts its caller's
  uid (``SO_PEERCRED``), the TCP port only a bearer token, compared in
  constant time once the headers are in and before the body is read;
* ``request``: the strict parser (``parse_head``) and ``answer``.

Limits, read from the environment when the server starts:

- ``PROBING_MAX_CONNECTIONS`` (64): open connections per listening socket.
  At the cap, the connection that has waited longest (at least 1 s) for its
  request is dropped to make room; when none has, the new one gets 503.
- ``PROBING_WORKERS`` (8): threads answering requests; the rest wait.
- ``PROBING_HEADER_TIMEOUT_S`` (10): time for the request line and headers.
- ``PROBING_IDLE_TIMEOUT_S`` (10): longest silence while a body arrives.
- File descriptors: ``fd_reserve()`` below ``RLIMIT_NOFILE`` are left to
  the rest of the engine (``accept``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import selectors
import socket
import threading
import time

from probing import config
from probing.errors import log_unexpected
from probing.node.probe.accept import Acceptor
from probing.node.probe.access import Access, Token
from probing.node.probe.connections import Connections, Listener
from probing.node.probe.http import App
from probing.node.probe.switch import SWITCH
from probing.worker import named

BUSY_SWITCH_S = 0.0005  # the GIL switch interval while connections are in flight

_WAKE = object()
_BINDS = itertools.count()  # names the sockets this process binds before they are in place


class UnixHTTPServer:
    """Serve ``app`` on a unix socket at ``path`` (mode 0600) until ``stop()``.

    ``path=None`` serves no unix socket (several cluster peers in one
    process, as the benchmark runs them). ``listen_tcp`` adds a TCP port to
    the same loop and the same ``app``, guarded by a token.
    """

    def __init__(self, path: str | None, app: App) -> None:
        self.path = path
        env = config.load()
        self.stats = {"refused": 0, "dropped": 0, "accept_errors": 0, "evicted": 0}
        self.stats["loop_errors"] = 0  # counted; each distinct one also in the log
        self._logged: set[str] = set()  # the errors the loop wrote to the log
        self._access = Access()
        self._connections = Connections(
            self,
            app,
            self._access,
            self.stats,
            workers=env.workers,
            header_timeout=env.header_timeout_s,
            idle_timeout=env.idle_timeout_s,
        )
        self._acceptor = Acceptor(
            self, self._connections, self._access, self.stats, env.max_connections
        )
        self._sel: selectors.BaseSelector | None = None
        self._wake_r = self._wake_w = -1
        self._stopping = False
        self._switch_held = False  # a hold on the GIL switch interval (switch.SWITCH)
        self._thread: threading.Thread | None = None

    @property
    def app(self) -> App:
        return self._connections.app

    def start(self) -> None:
        if self.path is not None:
            self._acceptor.listeners.append(Listener(self._bind_unix(self.path), tcp=False))
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._acceptor.start(self._sel)
        self._thread = threading.Thread(
            target=named("probing-server", self._loop), name="probing-server", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _bind_unix(path: str) -> socket.socket:
        """Listen at ``path``, which appears only once it accepts: bound and
        listening under a name of its own first, then renamed into place (a
        client that sees the file never gets ECONNREFUSED)."""
        from probing.guest.place import ensure_private_dir

        directory = os.path.dirname(path)
        ensure_private_dir(directory)
        staging = os.path.join(directory, f"{os.getpid()}.bind-{next(_BINDS)}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old_umask = os.umask(0o177)
            try:
                sock.bind(staging)
            finally:
                os.umask(old_umask)
            sock.listen(64)
            os.rename(staging, path)  # replaces a socket left by a process gone
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(staging)
            raise
        sock.setblocking(False)
        return sock

    # -- the TCP port ----------------------------------------------------------
    def listen_tcp(self, host: str, port: int, token: Token) -> tuple[str, int]:
        """Also serve on TCP ``host:port`` (0: any free port); returns the bound address.

        ``token`` is the one every TCP request must carry, or what gives it
        for a request's headers (an engine's port, ``probing.node.cluster.port``).

        Call after ``start()``; the loop picks the new socket up at once.
        """
        from probing.node.probe import tls

        secure = tls.server_context()  # None: plain HTTP (no PROBING_TLS_CERT)
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
        self._access.token = token
        self._acceptor.add(Listener(sock, tcp=True, tls=secure))
        self.wake()
        bound = sock.getsockname()
        return bound[0], bound[1]

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        return self._acceptor.tcp_address()

    def close_tcp(self) -> None:
        """Leave the peers: the TCP port closes (a new caller is refused) and
        every TCP connection, in flight or not, is cut; the unix socket stays."""
        self._acceptor.closing_tcp = True
        self._connections.cut_tcp()
        self.wake()

    def connections(self) -> int:
        """Connections open now, over every listener."""
        return self._acceptor.connections()

    # -- the loop --------------------------------------------------------------
    def selector(self) -> selectors.BaseSelector | None:
        """The loop's selector; None once stopped."""
        return self._sel

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def wake(self) -> None:
        """Wake the loop (a listener to watch, a slot free, the TCP port to close)."""
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"w")
            except OSError:
                pass

    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._once()
            except BaseException as err:  # the loop never dies: rest and go on
                self.stats["loop_errors"] += 1
                log_unexpected("the server loop failed", err, self._logged)
                self._acceptor.rest()
                time.sleep(0.01)

    def _once(self) -> None:
        sel = self._sel
        if sel is None:
            self._stopping = True
            return
        now = time.monotonic()
        due = [self._connections.next_deadline(), self._acceptor.next_retry()]
        first = min((t for t in due if t is not None), default=None)
        timeout = None if first is None else max(0.0, first - now)
        try:
            events = sel.select(timeout)
        except InterruptedError:
            return
        for key, _ in events:
            what = key.data
            if what is _WAKE:
                self._drain_wake()
            elif isinstance(what, Listener):
                self._acceptor.accept(what)
            else:
                self._connections.read(what)
        now = time.monotonic()
        self._connections.expire(now)
        self._acceptor.resume(now)
        self._busy(self._connections.busy() or self._acceptor.capped())

    def _busy(self, busy: bool) -> None:
        """A short GIL switch interval while connections are in flight.

        Every socket call of this loop lets go of the GIL; while another of
        the engine's threads runs Python, taking it back waits a whole switch
        interval (5 ms), so a burst of connections would crawl. The hold is
        let go when the loop is idle (``switch.SWITCH`` counts the holds).
        """
        if busy != self._switch_held:
            (SWITCH.take if busy else SWITCH.give)(BUSY_SWITCH_S)
            self._switch_held = busy

    def _drain_wake(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except OSError:
            pass
        self._acceptor.on_wake()

    # -- stopping --------------------------------------------------------------
    def stop(self, *, unlink: bool = True) -> None:
        """Stop serving; safe to call twice."""
        self._stopping = True
        self._busy(False)
        self.wake()
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

    def _close_fds(self) -> None:
        sel, self._sel = self._sel, None
        if sel is not None:
            try:
                sel.close()
            except OSError:
                pass
        self._connections.close_all()
        self._acceptor.close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = -1
