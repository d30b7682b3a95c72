"""HTTP on a unix socket, served by one daemon thread that sleeps in select().

No timers and no polling: an idle probe is a thread blocked in ``select``
on the listening socket and a wake-up pipe, so it costs no CPU. Each
connection is handled on its own short-lived daemon thread, and every
exception ends as an HTTP error, never in the host process.
"""

from __future__ import annotations

import errno
import http.server
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


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "probing"
    protocol_version = "HTTP/1.0"
    app: App

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # never write into the host's stderr

    def _dispatch(self) -> None:
        try:
            peer_uid = _peer_uid(self.connection)
            if peer_uid not in (os.getuid(), 0):
                resp = Response.error(403, "this probe belongs to another user", "AccessDenied")
            else:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    resp = Response.error(413, "request body too large")
                else:
                    body = self.rfile.read(length) if length else b""
                    url = urlsplit(self.path)
                    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                    resp = self.app(Request(self.command, url.path, query, body, peer_uid))
        except BaseException as err:  # noqa: BLE001 - nothing escapes into the host
            resp = Response.error(500, f"{type(err).__name__}: {err}")
        try:
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.content_type)
            self.send_header("Content-Length", str(len(resp.body)))
            self.end_headers()
            self.wfile.write(resp.body)
        except OSError:
            pass  # the client went away

    do_GET = do_POST = _dispatch


class UnixHTTPServer:
    """Serve ``app`` on a unix socket at ``path`` (mode 0600) until ``stop()``."""

    def __init__(self, path: str, app: App) -> None:
        self.path = path
        self.handler = type("Handler", (_Handler,), {"app": staticmethod(app)})
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
            self.handler(conn, "", self)
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
