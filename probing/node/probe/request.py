"""A request as the probe's server reads it: parsed strictly, then answered.

``head_end`` finds where a request's head ends in what arrived so far, and
refuses a head that grows too long before it does; ``parse_head`` reads the
request line and headers of a whole head. Both raise ``HttpError`` with the
status the client gets: a line over 8 KiB or a head over 32 KiB is 431,
never split; duplicate ``Authorization``, ``Content-Length``, ``Host`` or
``Transfer-Encoding`` headers, a ``Content-Length`` that is not digits,
folded lines and control characters are 400, and chunked bodies 501.

``answer`` runs the app on a parsed request; whatever it raises becomes a
500, logged, never an exception in the host.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit

from probing.errors import log_unexpected
from probing.node.probe.http import App, Request, Response

MAX_BODY = 16 << 20
MAX_LINE = 8192  # request line or one header line, without its line end
MAX_HEAD = 32768  # request line and headers together
MAX_HEADERS = 100


class HttpError(Exception):
    """A request refused before it reaches the app: its status, why, and the
    ``type`` of the error answer (a class of ``probing.errors.ERRORS``, or
    ``Unauthorized``)."""

    def __init__(self, status: int, msg: str, kind: str = "ProbingError") -> None:
        super().__init__(msg)
        self.status = status
        self.kind = kind


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
    except BaseException as err:  # nothing escapes into the host: a bug answers 500
        log_unexpected(f"{head.method} {head.target} failed", err)
        return Response.error(500, f"{type(err).__name__}: {err}")
