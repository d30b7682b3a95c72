"""The one HTTP/1.0 codec of probing: what the probe's server writes, and
what the client (``probing.cli.client``) and the peers' exchange
(``probing.node.cluster.exchange``) send and read.

One request per connection, closed by the server after its answer
(``Connection: close``), so an answer is read to the end of the stream.
The server's strict request parser is ``probing.node.probe.request.parse_head``.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import NamedTuple

from probing.guest import place


class Request(NamedTuple):
    method: str
    path: str
    query: dict[str, str]
    body: bytes
    peer_uid: int | None
    remote: str | None = None  # "host:port" of a TCP caller; None on the unix socket
    headers: dict[str, str] | None = None
    gone: Callable[[], bool] | None = None  # true once the client hung up (cancels its query)


class Response(NamedTuple):
    status: int
    content_type: str
    body: bytes

    @classmethod
    def json(cls, obj: object, status: int = 200) -> Response:
        return cls(status, "application/json", json.dumps(obj, default=str).encode())

    @classmethod
    def error(cls, status: int, msg: str, kind: str = "ProbingError") -> Response:
        """``{"error": msg, "type": kind}``: ``kind`` names a class of
        ``probing.errors.ERRORS``, which the client raises again."""
        return cls.json({"error": msg, "type": kind}, status)


App = Callable[[Request], Response]

REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    409: "Conflict",
    413: "Payload Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}


def response_bytes(resp: Response) -> bytes:
    head = (
        f"HTTP/1.0 {resp.status} {REASONS.get(resp.status, 'Error')}\r\n"
        f"Server: probing\r\nContent-Type: {resp.content_type}\r\n"
        f"Content-Length: {len(resp.body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + resp.body


# this install of probing (``place.install``): a local probe answers only
# clients of its own install
INSTALL = place.install()


def request_bytes(
    path: str, body: bytes, token: bytes | str | None, method: str = "POST", pid: int = 0
) -> bytes:
    """One request: ``method path``, the bearer ``token`` if any, a JSON
    ``body``; for process ``pid`` when given (an engine's port serves several)."""
    if isinstance(token, str):
        token = token.encode()
    head = method.encode() + b" " + path.encode() + b" HTTP/1.0\r\n"
    head += b"Probing-Install: " + INSTALL.encode() + b"\r\n"  # who asks (the probe checks)
    if pid:
        head += b"Probing-Pid: " + str(pid).encode() + b"\r\n"
    if body:
        head += b"Content-Type: application/json\r\n"
    if token:
        head += b"Authorization: Bearer " + token + b"\r\n"
    return head + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


class Answer(NamedTuple):
    status: int
    content_type: str
    body: bytes


def parse_answer(data: bytes) -> Answer:
    """An answer read to its end; ``ConnectionResetError`` when it is no HTTP
    answer (the server went away mid-way)."""
    header, sep, payload = data.partition(b"\r\n\r\n")
    lines = header.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if not sep or len(parts) < 2 or not parts[1].isdigit():
        raise ConnectionResetError("not an HTTP answer")
    ctype = ""
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-type":
            ctype = value.strip().decode("latin-1")
    return Answer(int(parts[1]), ctype, payload)


def exchange(sock: socket.socket, request: bytes) -> Answer:
    """Send ``request`` on a connected blocking socket and read the answer
    (the socket's timeout bounds each step). A server that answers before
    reading the whole body (a refused token) is still heard."""
    try:
        sock.sendall(request)
    except (BrokenPipeError, ConnectionResetError):
        pass  # its answer, if any, is waiting to be read
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    return parse_answer(b"".join(chunks))
