"""A client of torch's TCPStore that needs no torch: its wire protocol on a socket.

The probe talks to the job's rendezvous store from the engine's threads,
with no torch: probing's Python need not have it, and one engine serves
jobs of any torch version. The store's protocol is small and stable, and
both of torch's servers (the libuv one and the legacy one) speak it, so the
probe speaks it itself, with the standard library alone.

A request is one command byte and its arguments; a string or a byte vector
goes as a native-endian uint64 length and the bytes. A client's first message
is ``VALIDATE`` with the magic number. Every call here is bounded by the
socket's timeout, and ``StoreError`` is an ``OSError``: whoever calls treats
a store that misbehaves like one that does not answer.
"""

from __future__ import annotations

import socket
import struct
from enum import IntEnum

MAGIC = 0x3C85F7CE
MAX_VALUE = 64 << 20  # a reply larger than this is not from a store we want to read


class Cmd(IntEnum):
    """The command byte (torch's ``QueryType``); the order is the protocol."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9


READY = 0  # CheckResponseType::READY


class StoreError(OSError):
    """The store closed, timed out or answered something that is not its protocol."""


def _blob(data: bytes) -> bytes:
    return struct.pack("=Q", len(data)) + data


def _key(key: str) -> bytes:
    """A key as torch's own client sends it (its ``TCPStore`` prefixes ``/``),
    so ``store.get(key)`` in torch reads what this client wrote."""
    return _blob(("/" + key).encode())


class TCPStoreClient:
    """One connection to a TCPStore at ``host:port``; every call waits at most ``timeout`` s."""

    def __init__(self, host: str, port: int, timeout: float = 2.0) -> None:
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as err:
            raise StoreError(f"no rendezvous store answers at {host}:{port} ({err})") from err
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.address = f"{host}:{port}"
        self._send(struct.pack("=BI", Cmd.VALIDATE, MAGIC))

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> TCPStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the commands ----------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        self._send(bytes([Cmd.SET]) + _key(key) + _blob(value))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (empty: if it is
        unset); returns what it holds afterwards."""
        self._send(bytes([Cmd.COMPARE_SET]) + _key(key) + _blob(expected) + _blob(desired))
        return self._recv_blob()

    def append(self, key: str, value: bytes) -> None:
        self._send(bytes([Cmd.APPEND]) + _key(key) + _blob(value))

    def check(self, key: str) -> bool:
        """Whether ``key`` is set (never waits for it)."""
        self._send(bytes([Cmd.CHECK]) + struct.pack("=Q", 1) + _key(key))
        return self._recv(1)[0] == READY

    def get(self, key: str) -> bytes:
        """The value of ``key``; ask ``check`` first: a missing key is not an answer."""
        self._send(bytes([Cmd.GET]) + _key(key))
        return self._recv_blob()

    # -- the socket --------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as err:
            raise StoreError(f"rendezvous store at {self.address}: {err}") from err

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self._sock.recv(n - len(buf))
            except OSError as err:
                raise StoreError(f"rendezvous store at {self.address}: {err}") from err
            if not chunk:
                raise StoreError(f"rendezvous store at {self.address} closed the connection")
            buf += chunk
        return bytes(buf)

    def _recv_blob(self) -> bytes:
        (size,) = struct.unpack("=Q", self._recv(8))
        if size > MAX_VALUE:
            raise StoreError(f"rendezvous store at {self.address} sent a {size}-byte value")
        return self._recv(size) if size else b""
