"""Many HTTP/1.0 POSTs at once from one thread: non-blocking sockets, one selector.

An asker talks to hundreds of peers per query. A thread each costs more
than the asking: starting 256 threads takes longer than the answers (each
start waits for the GIL), and they then fight over it to parse their
answers. Here the calling thread connects to every peer, writes each
request as its socket becomes writable and reads each answer as it
arrives, until every peer has answered or failed, or the deadline passes.

An answer is read up to ``max_reply`` bytes (``PROBING_MAX_REPLY_MB``,
default 256 MiB) and all of them together up to ``max_total`` (four times
that): a peer sending more is cut off and named missing with the reason,
rather than growing the asker's memory without end.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from probing import config
from probing.errors import PeerUnreachable
from probing.node.probe.http import parse_answer


def reply_limit() -> int:
    """Bytes one peer's answer may take: ``PROBING_MAX_REPLY_MB`` (default 256)."""
    return int(config.load().max_reply_mb * (1 << 20))


@dataclass
class Reply:
    """An HTTP answer: status, body, and our clock when we sent and when it was in."""

    status: int
    body: bytes
    t_send_ns: int
    t_done_ns: int


@dataclass
class _Call:
    index: int
    sock: socket.socket
    out: memoryview | None  # what is left to send; None once sent
    t0: int
    connected: bool = False
    shaking: bool = False  # TLS: connected, its handshake not done yet
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0


class PeerFailure(PeerUnreachable):
    """One peer gave no usable answer; ``reason`` says why, as
    ``MissingPeer.reason`` and ``probing.peers`` show it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PeerLate(PeerFailure):
    """The deadline passed before the peer answered (so did its members')."""

    def __init__(self) -> None:
        super().__init__("timeout")


def failure(err: OSError) -> PeerFailure:
    """Why a peer did not answer, from the socket error."""
    if isinstance(err, ConnectionRefusedError):
        return PeerFailure("refused")
    if isinstance(err, TimeoutError):
        return PeerLate()
    if isinstance(err, (ConnectionResetError, BrokenPipeError)):
        return PeerFailure("connection closed")
    return PeerFailure(f"unreachable: {err}")


class Exchange:
    """``add`` every request, then ``run``: ``results[i]`` is the i-th request's
    Reply, the ``PeerFailure`` that says why it has none (``refused``,
    ``connection closed``, ...), or None when the deadline passed first."""

    def __init__(
        self, deadline: float, max_reply: int | None = None, max_total: int | None = None
    ) -> None:
        self.deadline = deadline  # time.monotonic()
        self.max_reply = max_reply if max_reply is not None else reply_limit()
        self.max_total = max_total if max_total is not None else 4 * self.max_reply
        self._total = 0
        self.results: list[Reply | PeerFailure | None] = []
        self._sel: selectors.BaseSelector | None = None  # made by the first add
        from probing.node.probe import tls

        self._tls = tls.client_context()  # None: plain HTTP (no PROBING_TLS_CERT)
        self._resolved: dict[str, tuple[socket.AddressFamily, tuple[Any, ...]]] = {}

    def add(self, host: str, port: int, request: bytes) -> int:
        """Start one request (connect now, send when writable); returns its index."""
        i = len(self.results)
        self.results.append(None)
        t0 = time.time_ns()
        sock = None
        try:
            family, addr = self._address(host, port)
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            err = sock.connect_ex(addr)
            if err not in (0, errno.EINPROGRESS):
                raise OSError(err, os.strerror(err))
        except OSError as err:
            if sock is not None:
                sock.close()
            self.results[i] = failure(err)
            return i
        if self._sel is None:
            self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_WRITE, _Call(i, sock, memoryview(request), t0))
        return i

    def _address(self, host: str, port: int) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
        """Resolved once per host (a node's ranks share it); IP literals at once."""
        known = self._resolved.get(host)
        if known is None:
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            known = self._resolved[host] = (info[0], info[4])
        family, addr = known
        return family, (addr[0], port, *addr[2:])

    def run(self) -> list[Reply | PeerFailure | None]:
        """Serve every socket until all are done or the deadline passes."""
        sel = self._sel
        if sel is None:
            return self.results
        try:
            while sel.get_map():
                left = self.deadline - time.monotonic()
                if left <= 0:
                    break
                for key, _ in sel.select(left):
                    self._step(sel, key.data)
        finally:
            for key in list(sel.get_map().values()):  # the deadline passed: None
                sel.unregister(key.fileobj)
                key.data.sock.close()
            sel.close()
        return self.results

    def _secure(self, sel: selectors.BaseSelector, call: _Call) -> None:
        """Connected: the socket becomes TLS, its handshake next (``PROBING_TLS_CERT``)."""
        from probing.node.probe import tls

        sel.unregister(call.sock)
        call.sock = tls.wrap(self._tls, call.sock, server=False)
        call.shaking = True
        sel.register(call.sock, selectors.EVENT_WRITE, call)

    @staticmethod
    def _waits(sel: selectors.BaseSelector, call: _Call, err: OSError) -> bool:
        """A TLS socket that only waits to read or to write: watched for that."""
        from probing.node.probe import tls

        want = tls.wants_io(err)
        if not want:
            return False
        event = selectors.EVENT_READ if want == 1 else selectors.EVENT_WRITE
        sel.modify(call.sock, event, call)
        return True

    def _finish(
        self, sel: selectors.BaseSelector, call: _Call, result: Reply | PeerFailure
    ) -> None:
        sel.unregister(call.sock)
        call.sock.close()
        self.results[call.index] = result

    def _cut(self, sel: selectors.BaseSelector, call: _Call, why: str) -> None:
        self._total -= call.size
        call.chunks = []
        self._finish(sel, call, PeerFailure(f"{why} (PROBING_MAX_REPLY_MB raises the limit)"))

    def _step(self, sel: selectors.BaseSelector, call: _Call) -> None:
        try:
            if call.out is not None:
                if not call.connected:
                    err = call.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        raise OSError(err, os.strerror(err))
                    call.connected = True
                    if self._tls is not None:
                        self._secure(sel, call)
                if call.shaking:
                    call.sock.do_handshake()  # type: ignore[attr-defined]
                    call.shaking = False
                    sel.modify(call.sock, selectors.EVENT_WRITE, call)
                sent = call.sock.send(call.out)
                call.out = call.out[sent:] if sent < len(call.out) else None
                if call.out is None:
                    sel.modify(call.sock, selectors.EVENT_READ, call)
                return
            chunk = call.sock.recv(1 << 20)
            while self._tls is not None and chunk and call.sock.pending():  # type: ignore[attr-defined]
                chunk += call.sock.recv(1 << 20)  # decrypted already: no event will say so
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            if self._tls is not None and self._waits(sel, call, err):
                return
            self._finish(sel, call, failure(err))
            return
        if chunk:
            call.chunks.append(chunk)
            call.size += len(chunk)
            self._total += len(chunk)
            if call.size > self.max_reply:
                self._cut(sel, call, f"answer over {self.max_reply >> 20} MiB")
            elif self._total > self.max_total:
                self._cut(sel, call, f"answers over {self.max_total >> 20} MiB in all")
            return
        t3 = time.time_ns()
        try:
            status, _, body = parse_answer(b"".join(call.chunks))
        except ConnectionResetError as err:
            self._finish(sel, call, failure(err))
            return
        self._finish(sel, call, Reply(status, body, call.t0, t3))
