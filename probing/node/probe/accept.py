"""The listening sockets of the probe's server, and whom they let in.

The loop accepts at most 8 connections a wake-up from a listener; each is
then admitted or refused at once, without reading anything:

- File descriptors: a connection that would leave the engine fewer than
  ``fd_reserve()`` descriptors below ``RLIMIT_NOFILE`` is answered 503 and
  closed. When ``accept`` fails (EMFILE, ENFILE, ...), one spare descriptor
  is given up to accept and drop the waiting connection, and the listeners
  rest (50 ms, doubling to 1 s) before the next try.
- The unix socket's caller must be this process's user or root
  (``Access.unix_caller``): else 403.
- ``PROBING_MAX_CONNECTIONS`` (64) open connections per listener. At the
  cap, the connection that has waited longest (at least ``EVICT_AFTER_S``)
  for its request is dropped to make room; when none has, the new one gets
  503 and the listener stops accepting (``capped``) until a connection
  closes or one may make room: the next callers wait in the kernel's
  backlog, and a flood costs the engine no accept-and-refuse churn.

The TCP port's listener is bound by ``UnixHTTPServer.listen_tcp`` from any
thread and watched by the loop from its next wake-up (``on_wake``), which
also closes it when the probe leaves its peers.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import threading
import time

from probing.node.probe.access import Access
from probing.node.probe.connections import EVICT_AFTER_S, Connections, Listener, Loop, refuse
from probing.node.probe.request import HttpError

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


def fd_reserve(soft_limit: int) -> int:
    """Descriptors always left to the rest of the engine below its ``RLIMIT_NOFILE``.

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


def _open_spare() -> int:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


class Acceptor:
    """The server's listeners: accepting on them, admitting or refusing each
    connection (into ``conns``), resting after accept errors."""

    def __init__(
        self,
        loop: Loop,
        conns: Connections,
        access: Access,
        stats: dict[str, int],
        max_connections: int,
    ) -> None:
        self._loop = loop
        self._conns = conns
        self._access = access
        self.stats = stats  # the server's counters: "refused", "dropped", "accept_errors"
        self.max_connections = max_connections
        self.listeners: list[Listener] = []
        self._new: list[Listener] = []  # bound by listen_tcp, registered by the loop
        self._lock = threading.Lock()  # the lists (listen_tcp runs on any thread)
        self._spare = -1  # given up to accept-and-drop when the process is out of fds
        self._paused_until = 0.0
        self._backoff = 0.0
        self.closing_tcp = False  # UnixHTTPServer.close_tcp(): the loop closes the TCP listeners

    def start(self, sel: selectors.BaseSelector) -> None:
        """Keep a spare descriptor, and watch the listeners bound so far."""
        self._spare = _open_spare()
        for lst in self.listeners:
            sel.register(lst.sock, selectors.EVENT_READ, lst)

    def add(self, lst: Listener) -> None:
        """A listener bound while the loop runs: watched from its next wake-up."""
        with self._lock:
            self._new.append(lst)
            self.listeners.append(lst)

    def connections(self) -> int:
        """Connections open now, over every listener."""
        return sum(lst.open for lst in self.listeners)

    def tcp_address(self) -> tuple[str, int] | None:
        tcp = next((lst for lst in self.listeners if lst.tcp), None)
        if tcp is None:
            return None
        try:
            bound = tcp.sock.getsockname()
        except OSError:  # closed meanwhile (close_tcp), not yet out of the list
            return None
        return bound[0], bound[1]

    # -- accepting ---------------------------------------------------------------
    def accept(self, lst: Listener) -> None:
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
                self.rest()
                return
            self._backoff = 0.0
            self._admit(lst, conn, addr)

    def _drop_one(self, lst: Listener) -> None:
        """Out of descriptors: give up the spare one to accept and drop a caller."""
        if self._spare < 0:
            return
        os.close(self._spare)
        self._spare = -1
        try:
            conn, _ = lst.sock.accept()
            self.stats["dropped"] += 1
            refuse(conn, 503, "the process is out of file descriptors: try again later")
        except OSError:
            pass
        self._spare = _open_spare()

    def _admit(self, lst: Listener, conn: socket.socket, addr: object) -> None:
        limit = _nofile()
        if conn.fileno() >= limit - fd_reserve(limit):
            self.stats["refused"] += 1
            refuse(conn, 503, "the process is near its file-descriptor limit: try again later")
            return
        remote = peer_uid = None
        if lst.tcp:
            remote = f"{addr[0]}:{addr[1]}"  # type: ignore[index]
        else:
            try:
                peer_uid = self._access.unix_caller(conn)
            except HttpError as err:
                refuse(conn, err.status, str(err), err.kind)
                return
        if lst.open >= self.max_connections and not self._conns.evict(lst):
            self.stats["refused"] += 1
            self._cap(lst)
            refuse(
                conn,
                503,
                f"the probe has {lst.open} connections open (PROBING_MAX_CONNECTIONS): "
                "try again later",
            )
            return
        self._conns.open(conn, lst, remote, peer_uid)

    def _cap(self, lst: Listener) -> None:
        """Stop accepting on ``lst`` until a connection closes or its oldest
        silent one may make room: the next callers wait in the kernel's
        backlog, and a flood costs the engine no accept-and-refuse churn."""
        lst.capped = True
        first = self._conns.first_opened(lst)
        lst.retry_at = first + EVICT_AFTER_S if first is not None else 0.0
        try:
            self._loop.selector().unregister(lst.sock)  # type: ignore[union-attr]
        except (KeyError, ValueError, OSError, AttributeError):
            pass

    # -- resting and resuming ----------------------------------------------------
    def rest(self) -> None:
        """Stop accepting for a while (50 ms, doubling to 1 s while it lasts)."""
        self._backoff = min(1.0, max(0.05, self._backoff * 2))
        self._paused_until = time.monotonic() + self._backoff
        sel = self._loop.selector()
        for lst in self.listeners:
            try:
                if sel is not None:
                    sel.unregister(lst.sock)
            except (KeyError, ValueError, OSError):
                pass

    def capped(self) -> bool:
        """Whether a listener waits for room."""
        return any(x.capped for x in self.listeners)

    def next_retry(self) -> float | None:
        """When the rest ends, or a capped listener may accept again."""
        times = [self._paused_until] + [x.retry_at for x in self.listeners if x.capped]
        return min((t for t in times if t), default=None)

    def resume(self, now: float) -> None:
        """Accept again on the listeners whose cap or rest is over."""
        for lst in self.listeners:
            if lst.capped and (
                lst.open < self.max_connections or (lst.retry_at and now >= lst.retry_at)
            ):
                lst.capped = False
                if not self._paused_until:
                    self._watch(lst)
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            for lst in self.listeners:
                if not lst.capped:
                    self._watch(lst)

    def on_wake(self) -> None:
        """On the loop, woken: close the TCP listeners if asked, watch the new ones."""
        if self.closing_tcp:
            self._close_tcp_listeners()
        with self._lock:
            new, self._new = self._new, []
        if not self._paused_until:
            for lst in new:
                self._watch(lst)
        # a worker closed a connection: the end of _once lets capped listeners in again

    def _watch(self, lst: Listener) -> None:
        sel = self._loop.selector()
        if sel is None:
            return
        try:
            sel.register(lst.sock, selectors.EVENT_READ, lst)
        except KeyError:
            pass  # already watched
        except (OSError, ValueError):
            pass  # closed meanwhile

    # -- closing -----------------------------------------------------------------
    def _close_tcp_listeners(self) -> None:
        with self._lock:
            tcp = [x for x in self.listeners if x.tcp]
            self.listeners = [x for x in self.listeners if not x.tcp]
            self._new = [x for x in self._new if not x.tcp]
        for lst in tcp:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._loop.selector().unregister(lst.sock)  # type: ignore[union-attr]
            lst.sock.close()

    def close(self) -> None:
        """Close every listener and the spare descriptor (the server stops)."""
        for lst in self.listeners:
            try:
                lst.sock.close()
            except OSError:
                pass
        self.listeners = []
        self._new = []
        if self._spare >= 0:
            try:
                os.close(self._spare)
            except OSError:
                pass
        self._spare = -1
