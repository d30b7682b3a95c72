"""HTTP on a unix socket, served by one daemon thread that sleeps in select().

No timers and no polling: an idle probe is a thread blocked in ``select``
on the listening socket and a wake-up pipe, so it costs no CPU. Each
connection is handled on its own short-lived daemon thread, and every
exception ends as an HTTP error, never in the host process.
"""

from __future__ import annotations

import errno
import json
import os
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
    403: "Forbidden",
    404: "Not Found",
    413: "Payload Too Large",
    500: "Internal Server Error",
}


def _read_request(conn: socket.socket) -> tuple[str, str, bytes] | None:
    """Parse one HTTP/1.x request: (method, target, body), or None if malformed.

    A few lines instead of ``http.server``, which would pull ``email`` and
    ``ssl`` into every probed process.
    """
    f = conn.makefile("rb")
    try:
        line = f.readline(8192)
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return None
        length = 0
        for _ in range(100):
            header = f.readline(8192)
            if header in (b"\r\n", b"\n", b""):
                break
            name, _, value = header.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        if length < 0 or length > MAX_BODY:
            raise ValueError("request body too large")
        body = f.read(length) if length else b""
        return parts[0], parts[1], body
    finally:
        f.close()


def _write_response(conn: socket.socket, resp: Response) -> None:
    head = (
        f"HTTP/1.0 {resp.status} {_REASONS.get(resp.status, 'Error')}\r\n"
        f"Server: probing\r\nContent-Type: {resp.content_type}\r\n"
        f"Content-Length: {len(resp.body)}\r\nConnection: close\r\n\r\n"
    )
    conn.sendall(head.encode("latin-1") + resp.body)


def handle_connection(conn: socket.socket, app: App) -> None:
    """Answer one request on ``conn``. Every failure becomes an HTTP error."""
    try:
        peer_uid = _peer_uid(conn)
        if peer_uid not in (os.getuid(), 0):
            resp = Response.error(403, "this probe belongs to another user", "AccessDenied")
        else:
            parsed = _read_request(conn)
            if parsed is None:
                resp = Response.error(400, "not an HTTP request")
            else:
                method, target, body = parsed
                url = urlsplit(target)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                resp = app(Request(method, url.path, query, body, peer_uid))
    except ValueError as err:
        resp = Response.error(413 if "too large" in str(err) else 400, str(err))
    except BaseException as err:  # noqa: BLE001 - nothing escapes into the host
        resp = Response.error(500, f"{type(err).__name__}: {err}")
    try:
        _write_response(conn, resp)
    except OSError:
        pass  # the client went away


class UnixHTTPServer:
    """Serve ``app`` on a unix socket at ``path`` (mode 0600) until ``stop()``."""

    def __init__(self, path: str, app: App) -> None:
        self.path = path
        self.app = app
        self._sock: socket.socket | None = None
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        directory = os.path.dirname(self.path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.stat(directory)
        if st.st_uid != os.getuid():
            raise PermissionError(f"{directory} belongs to uid {st.st_uid}, not to this user")
        os.chmod(directory, 0o700)
        self._unlink_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old_umask)
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._loop, name="probing-server", daemon=True)
        self._thread.start()

    def _unlink_stale(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _loop(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                ready, _, _ = select.select([sock, self._wake_r], [], [])
            except OSError as err:
                if err.errno == errno.EINTR:
                    continue
                return
            if self._wake_r in ready:
                return
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return
            conn.setblocking(True)
            conn.settimeout(30)
            threading.Thread(
                target=self._serve, args=(conn,), name="probing-request", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            handle_connection(conn, self.app)
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

    def abandon_after_fork(self) -> None:
        """In a forked child: drop the parent's socket without touching its path."""
        self._thread = None
        self._close_fds()

    def _close_fds(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = -1
