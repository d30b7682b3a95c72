"""The guest's HTTP over unix sockets (stdlib only): a small server for what
only the process knows, and the client the guest and the engine share.

One request per connection, JSON both ways, ``Connection: close``: the same
HTTP/1.0 shape as the probe's own server (``probing.node.probe.server``), so the
guest's client also talks to the engine. Only the process's own user and
root may connect (``SO_PEERCRED``), on top of the directory's mode 0700.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    Handler = Callable[[dict[str, Any]], Any]

MAX_BODY = 16 << 20
HEAD_LIMIT = 16 << 10


class WireError(Exception):
    """An answer other than 200, or no answer: ``status`` 0 when none came."""

    def __init__(
        self, status: int, message: str, kind: str = "ProbingError", detail: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.detail = detail


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed before the end of the head")
        buf += chunk
        if len(buf) > HEAD_LIMIT and b"\r\n\r\n" not in buf:
            raise ValueError("head too large")
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


def _read_body(sock: socket.socket, rest: bytes, length: int | None) -> bytes:
    parts = [rest]
    got = len(rest)
    while length is None or got < length:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _length(lines: list[bytes]) -> int | None:
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return None


def _request(method: str, url: str, body: bytes) -> bytes:
    return (
        f"{method} {url} HTTP/1.0\r\nHost: probing\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def request(path: str, method: str, url: str, payload: Any = None, timeout: float = 30.0) -> Any:
    """``payload`` sent as JSON to ``url`` on the unix socket ``path``; the
    JSON answer. WireError for an answer other than 200 or none at all."""
    body = b"" if payload is None else json.dumps(payload).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(path)
            sock.sendall(_request(method, url, body))
            head, rest = _read_head(sock)
            lines = head.split(b"\r\n")
            status = int(lines[0].split()[1])
            data = _read_body(sock, rest, _length(lines))
        except (OSError, ValueError, IndexError) as err:
            raise WireError(0, f"no answer at {path}: {err}") from None
    finally:
        sock.close()
    try:
        answer = json.loads(data) if data else None
    except ValueError:
        raise WireError(status, data[:200].decode("utf-8", "replace")) from None
    if status != 200:
        problem = answer if isinstance(answer, dict) else {}
        raise WireError(
            status,
            str(problem.get("error", answer)),
            str(problem.get("type", "ProbingError")),
            str(problem.get("detail") or ""),
        )
    return answer


def send(path: str, method: str, url: str, payload: Any = None) -> None:
    """``payload`` sent to ``url`` without waiting for the answer (a host
    starting up must not wait on anyone). OSError when nothing listens."""
    body = b"" if payload is None else json.dumps(payload).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(1.0)
    try:
        sock.connect(path)
        sock.sendall(_request(method, url, body))
    finally:
        sock.close()


def _peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end (``SO_PEERCRED``)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", raw)
    return pid, uid


def _answer(conn: socket.socket, status: int, obj: Any) -> None:
    body = json.dumps(obj, default=repr).encode()
    reason = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found"}.get(
        status, "Error"
    )
    conn.sendall(
        f"HTTP/1.0 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )


class Server:
    """``routes``: ``"METHOD /path"`` -> handler(JSON body) -> JSON answer.
    A handler's ``GuestError`` is a 400 with its message; anything else a
    500. One daemon thread accepts, one daemon thread answers each request:
    the process's exit never waits for either."""

    def __init__(
        self, path: str, routes: dict[str, Handler], on_peer: Callable[[int], None] | None = None
    ) -> None:
        self.path = path
        self.routes = routes
        self.on_peer = on_peer  # told each caller's pid (the guest lets its engine ptrace)
        self.sock: socket.socket | None = None
        self._stopped = False

    def start(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        sock.listen(64)
        self.sock = sock
        threading.Thread(target=self._accept, name="probing-guest", daemon=True).start()

    def _accept(self) -> None:
        sock = self.sock
        pause = 0.0
        while sock is not None and not self._stopped:
            try:
                conn, _ = sock.accept()
                pause = 0.0
            except OSError:  # closed (stop), or the host is out of descriptors: wait
                if self._stopped or sock.fileno() < 0:
                    return
                pause = min(1.0, max(0.01, pause * 2))
                time.sleep(pause)
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="probing-guest-call", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(60)
            pid, uid = _peer(conn)
            if uid not in (0, os.getuid()):
                _answer(conn, 403, {"error": "not this process's user", "type": "AccessDenied"})
                return
            if self.on_peer is not None:
                self.on_peer(pid)
            head, rest = _read_head(conn)
            lines = head.split(b"\r\n")
            method, url = lines[0].decode("latin-1").split()[:2]
            length = _length(lines)
            if length is not None and length > MAX_BODY:
                _answer(conn, 400, {"error": "request too large"})
                return
            body = _read_body(conn, rest, length or 0) if length else b""
            handler = self.routes.get(f"{method} {url.split('?')[0]}")
            if handler is None:
                _answer(conn, 404, {"error": f"no {method} {url} here", "type": "ProbingError"})
                return
            try:
                args = json.loads(body) if body else {}
                result = handler(args if isinstance(args, dict) else {})
            except GuestError as err:
                _answer(conn, 400, {"error": str(err), "type": err.kind, "detail": err.detail})
                return
            except Exception as err:  # answered, never raised into the host
                _answer(conn, 500, {"error": f"{type(err).__name__}: {err}"})
                return
            _answer(conn, 200, result)
        except (OSError, ValueError, IndexError):
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        """Close the socket and remove its file. Safe twice."""
        self._stopped = True
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def abandon(self) -> None:
        """In a forked child: the parent's socket is the parent's; close our fd."""
        sock, self.sock = self.sock, None
        self._stopped = True
        if sock is not None:
            sock.close()


class GuestError(Exception):
    """A request the guest answers with an error (bad code, a failed expression)."""

    def __init__(self, message: str, kind: str = "QueryError", detail: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.detail = detail
