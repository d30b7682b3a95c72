"""HTTP on a unix socket (and, in cluster mode, a TCP port), one select() thread.

No timers and no polling: an idle probe is a thread blocked in ``select``
on the listening sockets and a wake-up pipe, so it costs no CPU. Each
connection is handled on a daemon thread of its own, which then waits 5 s
for the next one (a cluster query's burst reuses it) and exits; every
exception ends as an HTTP error, never in the host process.

The unix socket trusts its caller's uid (``SO_PEERCRED``). The TCP port
trusts only a bearer token, compared in constant time before the request
reaches any endpoint: without it the answer is 401 and nothing runs.
"""

from __future__ import annotations

import errno
import hmac
import json
import os
import queue
import select
import socket
import struct
import threading
from collections.abc import Callable
from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit


class Request(NamedTuple):
    method: str
    path: str
    query: dict[str, str]
    body: bytes
    peer_uid: int | None
    remote: str | None = None  # "host:port" of a TCP caller; None on the unix socket
    headers: dict[str, str] | None = None


class Response(NamedTuple):
    status: int
    content_type: str
    body: bytes

    @classmethod
    def json(cls, obj: object, status: int = 200) -> Response:
        return cls(status, "application/json", json.dumps(obj, default=str).encode())

    @classmethod
    def error(cls, status: int, msg: str, kind: str = "ProbingError") -> Response:
        return cls.json({"error": msg, "type": kind}, status)


App = Callable[[Request], Response]

MAX_BODY = 16 << 20


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", raw)[1]
    except OSError:
        return None


_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    413: "Payload Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class _Parsed(NamedTuple):
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


def _read_request(conn: socket.socket, token: bytes | None = None) -> _Parsed | None:
    """Parse one HTTP/1.x request, or None if malformed.

    A few lines instead of ``http.server``, which would pull ``email`` and
    ``ssl`` into every probed process. With ``token``, the request must
    carry ``Authorization: Bearer <token>``: checked after the headers and
    before the body is read, so an unauthenticated body is never even read.
    """
    f = conn.makefile("rb")
    try:
        line = f.readline(8192)
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return None
        headers: dict[str, str] = {}
        for _ in range(100):
            header = f.readline(8192)
            if header in (b"\r\n", b"\n", b""):
                break
            name, _, value = header.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if token is not None and not authorized(headers, token):
            raise Unauthorized("missing or wrong token")
        length = int(headers.get("content-length", "0") or 0)
        if length < 0 or length > MAX_BODY:
            raise ValueError("request body too large")
        body = f.read(length) if length else b""
        return _Parsed(parts[0], parts[1], headers, body)
    finally:
        f.close()


class Unauthorized(Exception):
    """A TCP request without the job's token."""


def authorized(headers: dict[str, str], token: bytes) -> bool:
    """``Authorization: Bearer <token>``, compared in constant time."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode("latin-1", "replace"), token)


def _write_response(conn: socket.socket, resp: Response) -> None:
    head = (
        f"HTTP/1.0 {resp.status} {_REASONS.get(resp.status, 'Error')}\r\n"
        f"Server: probing\r\nContent-Type: {resp.content_type}\r\n"
        f"Content-Length: {len(resp.body)}\r\nConnection: close\r\n\r\n"
    )
    conn.sendall(head.encode("latin-1") + resp.body)


def handle_connection(
    conn: socket.socket, app: App, *, token: bytes | None = None, remote: str | None = None
) -> None:
    """Answer one request on ``conn``. Every failure becomes an HTTP error.

    ``remote`` (a TCP caller's address) means: authenticate with ``token``
    instead of the caller's uid; no token configured refuses everything.
    """
    try:
        peer_uid = None if remote is not None else _peer_uid(conn)
        if remote is None and peer_uid not in (os.getuid(), 0):
            resp = Response.error(403, "this probe belongs to another user", "AccessDenied")
        elif remote is not None and not token:
            resp = Response.error(401, "this probe has no token: TCP is closed", "Unauthorized")
        else:
            parsed = _read_request(conn, token if remote is not None else None)
            if parsed is None:
                resp = Response.error(400, "not an HTTP request")
            else:
                url = urlsplit(parsed.target)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                req = Request(
                    parsed.method, url.path, query, parsed.body, peer_uid, remote, parsed.headers
                )
                resp = app(req)
    except Unauthorized as err:
        resp = Response.error(401, str(err), "Unauthorized")
    except ValueError as err:
        resp = Response.error(413 if "too large" in str(err) else 400, str(err))
    except BaseException as err:  # noqa: BLE001 - nothing escapes into the host
        resp = Response.error(500, f"{type(err).__name__}: {err}")
    try:
        _write_response(conn, resp)
    except OSError:
        pass  # the client went away


class _Workers:
    """Request threads, each kept ``LINGER_S`` after its last request: the
    requests of a burst (a cluster query every few seconds) reuse them
    rather than starting a thread each; an idle probe is back to none."""

    LINGER_S = 5.0

    def __init__(self, serve: Callable[[socket.socket, str | None], None]) -> None:
        self._serve = serve
        self._lock = threading.Lock()
        self._idle = 0  # waiting threads no request has been promised to
        self._jobs: queue.SimpleQueue[tuple[socket.socket, str | None]] = queue.SimpleQueue()

    def submit(self, job: tuple[socket.socket, str | None]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._jobs.put(job)
                return
        threading.Thread(target=self._run, args=(job,), name="probing-request", daemon=True).start()

    def _run(self, job: tuple[socket.socket, str | None]) -> None:
        while True:
            self._serve(*job)
            with self._lock:
                self._idle += 1
            try:
                job = self._jobs.get(timeout=self.LINGER_S)
            except queue.Empty:
                with self._lock:
                    if self._idle:  # no request was promised to a waiting thread: leave
                        self._idle -= 1
                        return
                    job = self._jobs.get_nowait()  # one was, as I timed out


class UnixHTTPServer:
    """Serve ``app`` on a unix socket at ``path`` (mode 0600) until ``stop()``.

    ``path=None`` serves no unix socket (several cluster peers in one
    process, as the benchmark runs them). ``listen_tcp`` adds a TCP port to
    the same loop and the same ``app``, guarded by a token.
    """

    def __init__(self, path: str | None, app: App) -> None:
        self.path = path
        self.app = app
        self._sock: socket.socket | None = None
        self._tcp: socket.socket | None = None
        self._token: bytes | None = None
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._workers = _Workers(self._serve)

    def start(self) -> None:
        if self.path is not None:
            self._sock = self._bind_unix(self.path)
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._loop, name="probing-server", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind_unix(path: str) -> socket.socket:
        directory = os.path.dirname(path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.stat(directory)
        if st.st_uid != os.getuid():
            raise PermissionError(f"{directory} belongs to uid {st.st_uid}, not to this user")
        os.chmod(directory, 0o700)
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

        Call after ``start()``; the select loop picks the new socket up at once.
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
        self._tcp = sock
        self._wake()
        bound = sock.getsockname()
        return bound[0], bound[1]

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        if self._tcp is None:
            return None
        bound = self._tcp.getsockname()
        return bound[0], bound[1]

    def _wake(self) -> None:
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"w")
            except OSError:
                pass

    def _loop(self) -> None:
        while True:
            listeners = [s for s in (self._sock, self._tcp) if s is not None]
            try:
                ready, _, _ = select.select([*listeners, self._wake_r], [], [])
            except (OSError, ValueError) as err:
                if isinstance(err, OSError) and err.errno == errno.EINTR:
                    continue
                return
            if self._wake_r in ready:
                try:
                    if b"x" in os.read(self._wake_r, 64):
                        return
                except OSError:
                    return
            for sock in listeners:
                if sock not in ready:
                    continue
                try:
                    conn, addr = sock.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    return
                remote = None
                if sock is self._tcp:
                    remote = f"{addr[0]}:{addr[1]}"
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.setblocking(True)
                conn.settimeout(30)
                self._workers.submit((conn, remote))

    def _serve(self, conn: socket.socket, remote: str | None) -> None:
        try:
            handle_connection(conn, self.app, token=self._token, remote=remote)
        except BaseException:  # noqa: BLE001
            pass
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def stop(self, *, unlink: bool = True) -> None:
        """Stop serving; safe to call twice."""
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
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
        self._workers = _Workers(self._serve)  # the parent's threads do not exist here
        self._close_fds()

    def _close_fds(self) -> None:
        for sock in (self._sock, self._tcp):
            if sock is not None:
                sock.close()
        self._sock = self._tcp = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = -1
