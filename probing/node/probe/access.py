"""Who may ask the probe's server.

The unix socket trusts its caller's uid (``SO_PEERCRED``): the probe's own
user, or root; another user's connection is refused (403) before anything
of it is read. The TCP port trusts only a bearer token, compared in
constant time once the headers are in and before the body is read: without
it the answer is 401 and nothing runs. A probe that never opened its TCP
port has no token, and refuses every TCP request.
"""

from __future__ import annotations

import os
import socket
import struct
from _operator import _compare_digest
from collections.abc import Callable, Mapping

from probing.node.probe.request import Head, HttpError

# the TCP port's token, or what gives it for a request's headers (None: refused)
Token = bytes | Callable[[Mapping[str, str]], bytes | None]


def peer_cred(conn: socket.socket) -> tuple[int, int] | None:
    """(pid, uid) of the other end of a unix socket, or None."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", raw)
        return pid, uid
    except OSError:
        return None


def peer_uid(conn: socket.socket) -> int | None:
    cred = peer_cred(conn)
    return None if cred is None else cred[1]


def bearer(headers: Mapping[str, str]) -> bytes:
    """The token of ``Authorization: Bearer <token>``; empty when none."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return b""
    return given.strip().encode("latin-1", "replace")


def authorized(headers: Mapping[str, str], token: bytes) -> bool:
    """``Authorization: Bearer <token>``, compared in constant time."""
    given = bearer(headers)
    # hmac's own constant-time compare without hmac, which loads OpenSSL
    # (4 MB of every idle probe's RSS) for a check only TCP requests make
    return bool(given) and _compare_digest(given, token)


class Access:
    """The checks of one server: the unix caller's uid, the TCP ``token``:
    one for the port, or (an engine's port, shared by several jobs) the one
    ``token`` gives for a request's headers (``probing.node.cluster.port``)."""

    def __init__(self) -> None:
        self.token: Token | None = None  # set when the TCP port opens

    def unix_caller(self, conn: socket.socket) -> int:
        """The uid of the caller of a unix connection; ``HttpError(403)``
        when it is neither this process's user nor root (or unknown)."""
        uid = peer_uid(conn)
        if uid is None or uid not in (os.getuid(), 0):
            raise HttpError(403, "this probe belongs to another user", "AccessDenied")
        return uid

    def check_tcp(self, head: Head) -> None:
        """``HttpError(401)`` unless the head of a TCP request has the token."""
        token = self.token(head.headers) if callable(self.token) else self.token
        if not token:
            raise HttpError(401, "this probe has no token: TCP is closed", "Unauthorized")
        if not authorized(head.headers, token):
            raise HttpError(401, "missing or wrong token", "Unauthorized")
