"""The peer protocol under attack (issue 21): a gather request cannot steer the
probe (or its token) anywhere, and a peer cannot flood the asker's memory."""

from __future__ import annotations

import socket
import threading
import time

from probing.node.cluster import coordinator
from probing.node.cluster.discovery import PeerInfo
from probing.node.cluster.exchange import Exchange, PeerFailure, Reply
from probing.node.cluster.identity import Identity
from probing.node.cluster.node import ClusterNode
from probing.node.cluster.wire import unpack
from probing.node.probe.http import request_bytes


def listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


def addr(s: socket.socket) -> str:
    return f"127.0.0.1:{s.getsockname()[1]}"


def test_gather_members_come_from_discovery_not_from_the_request() -> None:
    peer, trap = listener(), listener()  # rank 1 as discovery knows it; an attacker's port
    ident = Identity(0, 2, 0, "n0", 0, None, "run", ("127.0.0.1:1", addr(peer)), 0)
    node = ClusterNode(ident, lambda: object(), token=b"job-token")
    node.registry.upsert(PeerInfo(1, "n0", addr(peer), source="peers"))
    seen: list[bytes] = []

    def serve() -> None:
        conn, _ = peer.accept()
        data = b""
        while b'"timeout"' not in data:
            data += conn.recv(65536)
        seen.append(data)
        conn.sendall(b"HTTP/1.0 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    members = [
        {"rank": 1, "node": "evil", "addr": addr(trap)},  # a known rank, a foreign address
        {"rank": 7, "node": "evil", "addr": addr(trap)},  # a rank discovery never saw
        {"rank": 0, "node": "n0", "addr": addr(trap)},  # myself: never asked
        *({"rank": 1, "addr": addr(trap)} for _ in range(100)),  # repeats: asked once
    ]
    payload = {"work": {"mode": "scan", "scans": {}}, "members": members, "timeout": 3.0}
    head, _ = unpack(coordinator.answer_gather(node, payload, time.time_ns()))
    trap.setblocking(False)
    try:
        trap.accept()
        raise AssertionError("the probe connected where the request told it to")
    except BlockingIOError:
        pass
    assert len(seen) == 1 and b"Authorization: Bearer job-token" in seen[0]
    assert b'"members": []' in seen[0]
    missing = {m["rank"]: m["reason"] for m in head["missing"]}
    assert missing == {1: "401", 7: "not among the peers this probe discovered"}
    for s in (peer, trap):
        s.close()


def test_a_reply_over_the_cap_is_cut_off_and_named() -> None:
    big, small = listener(), listener()

    def serve(s: socket.socket, size: int) -> None:
        conn, _ = s.accept()
        conn.recv(65536)
        try:
            conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * size)
        except OSError:
            pass  # the asker stopped reading
        conn.close()

    threading.Thread(target=serve, args=(big, 8 << 20), daemon=True).start()
    threading.Thread(target=serve, args=(small, 1000), daemon=True).start()
    ex = Exchange(time.monotonic() + 10, max_reply=1 << 20)
    req = request_bytes("/cluster/gather", b"{}", b"tok")
    ex.add("127.0.0.1", big.getsockname()[1], req)
    ex.add("127.0.0.1", small.getsockname()[1], req)
    got = ex.run()
    assert isinstance(got[0], PeerFailure)
    assert "over 1 MiB" in got[0].reason and "PROBING_MAX_REPLY_MB" in got[0].reason
    assert isinstance(got[1], Reply) and len(got[1].body) == 1000
    for s in (big, small):
        s.close()


def test_replies_together_are_capped_too() -> None:
    peers = [listener() for _ in range(4)]

    def serve(s: socket.socket) -> None:
        conn, _ = s.accept()
        conn.recv(65536)
        try:
            conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * (900 << 10))
        except OSError:
            pass
        conn.close()

    for s in peers:
        threading.Thread(target=serve, args=(s,), daemon=True).start()
    ex = Exchange(time.monotonic() + 10, max_reply=1 << 20, max_total=2 << 20)
    for s in peers:
        ex.add("127.0.0.1", s.getsockname()[1], request_bytes("/x", b"{}", None))
    got = ex.run()
    cut = [g.reason for g in got if isinstance(g, PeerFailure)]
    assert cut and all("in all" in g for g in cut), got
    assert sum(len(g.body) for g in got if isinstance(g, Reply)) <= 2 << 20
    for s in peers:
        s.close()
