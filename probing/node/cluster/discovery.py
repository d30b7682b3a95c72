"""Who the peers are: the job's own rendezvous store, or an explicit list.

torchrun jobs: every rank appends ``{"rank", "node", "addr", ...}`` to the
key ``probing/<run id>/peers`` of the TCPStore at MASTER_ADDR:MASTER_PORT
(as a client: nothing new to deploy) and reads the same key back when it
asks a cluster query. The first rank to come stores a random token under
``probing/<run id>/token`` (compare-and-set); everyone uses that one.

The store is touched only from background threads and at query time, each
call bounded by a timeout; when the store is gone, what was read last stays.
Without torchrun, ``PROBING_PEERS`` lists the addresses: rank = position.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from probing.node.cluster.identity import Identity
from probing.node.cluster.tcpstore import TCPStoreClient

if TYPE_CHECKING:
    import pyarrow as pa

STORE_TIMEOUT_S = 2.0
ENGINE = "engine"  # a peer's source: a rank its engine serves too, found there (not the store)
T = TypeVar("T")


@dataclass
class PeerInfo:
    """One row of ``probing.peers``."""

    rank: int
    node: str
    addr: str
    pid: int | None = None
    source: str = ""
    last_seen_ns: int | None = None  # wall-clock ns of its last answer (or its publication)
    status: str = "unknown"  # self, up, missing, unknown (never asked yet)
    reason: str | None = None
    response_ms: float | None = None
    clock_offset_ns: int | None = None

    def ref(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "addr": self.addr}


def peers_schema() -> pa.Schema:
    """``probing.peers``'s columns (the table exists, empty, outside cluster mode)."""
    from probing.node.tables.meta import PEERS_SCHEMA

    return PEERS_SCHEMA


class Registry:
    """The peers this probe knows, by rank; updated by discovery and by answers."""

    def __init__(self) -> None:
        self._peers: dict[int, PeerInfo] = {}
        self._lock = threading.Lock()

    def upsert(self, info: PeerInfo) -> None:
        """A (re)published address; what was measured stays while it is the same peer."""
        with self._lock:
            old = self._peers.get(info.rank)
            if old is not None and old.addr == info.addr and old.status != "unknown":
                old.node, old.pid = info.node, info.pid
                return
            self._peers[info.rank] = info

    def peers(self) -> list[PeerInfo]:
        with self._lock:
            return [self._peers[r] for r in sorted(self._peers)]

    def mark_up(self, rank: int, response_ms: float, offset_ns: int) -> None:
        with self._lock:
            p = self._peers.get(rank)
            if p is not None and p.status != "self":
                p.status, p.reason = "up", None
                p.response_ms, p.clock_offset_ns = response_ms, offset_ns
                p.last_seen_ns = time.time_ns()

    def mark_missing(self, rank: int, reason: str) -> None:
        with self._lock:
            p = self._peers.get(rank)
            if p is not None and p.status != "self":
                p.status, p.reason = "missing", reason

    def table(self) -> pa.Table:
        import pyarrow as pa

        rows = [vars(p) for p in self.peers()]
        return pa.Table.from_pylist(rows, schema=peers_schema())


def static_peers(ident: Identity, self_rank: int, self_pid: int) -> list[PeerInfo]:
    """The ``PROBING_PEERS`` list as peers; node names come with the first answer."""
    return [
        PeerInfo(rank=i, node="?", addr=addr, source="peers")
        if i != self_rank
        else PeerInfo(
            rank=i,
            node=ident.node,
            addr=addr,
            pid=self_pid,
            source="peers",
            status="self",
            last_seen_ns=time.time_ns(),
        )
        for i, addr in enumerate(ident.peers)
    ]


class StoreDirectory:
    """The job's TCPStore as a phone book, under ``probing/<run id>/``.

    Spoken to with the probe's own client (``tcpstore``), never torch's: the
    probe's threads must not import torch while the host may be importing it.
    """

    def __init__(self, ident: Identity) -> None:
        assert ident.master is not None
        self.host, self.port = ident.master
        self.prefix = f"probing/{ident.run_id}/"
        self._store: TCPStoreClient | None = None
        self._lock = threading.Lock()

    def _client(self, budget: float = STORE_TIMEOUT_S) -> TCPStoreClient:
        if self._store is None:
            self._store = TCPStoreClient(self.host, self.port, timeout=budget)
        return self._store

    def _call(self, budget: float, op: Callable[[TCPStoreClient], T]) -> T:
        """``op`` on the store; after any failure the next call reconnects."""
        with self._lock:
            try:
                return op(self._client(budget))
            except OSError:
                if self._store is not None:
                    self._store.close()
                self._store = None
                raise

    def token(self, budget: float = STORE_TIMEOUT_S) -> bytes:
        """The job's token: the first rank's random one (compare-and-set)."""
        fresh = secrets.token_hex(16).encode()
        return self._call(budget, lambda s: s.compare_set(self.prefix + "token", b"", fresh))

    def publish(self, info: PeerInfo, budget: float = STORE_TIMEOUT_S) -> None:
        entry = json.dumps(
            {"rank": info.rank, "node": info.node, "addr": info.addr, "pid": info.pid}
        )
        self._call(budget, lambda s: s.append(self.prefix + "peers", (entry + "\n").encode()))

    def read(self, budget: float = STORE_TIMEOUT_S) -> list[PeerInfo]:
        """Every published peer (the latest entry per rank); raises OSError
        when the store does not answer."""
        key = self.prefix + "peers"
        raw = self._call(budget, lambda s: s.get(key) if s.check(key) else b"")
        return parse_published(raw)

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
            self._store = None


def parse_published(raw: bytes) -> list[PeerInfo]:
    latest: dict[int, PeerInfo] = {}
    for line in raw.splitlines():
        try:
            e = json.loads(line)
            latest[int(e["rank"])] = PeerInfo(
                rank=int(e["rank"]),
                node=str(e["node"]),
                addr=str(e["addr"]),
                pid=e.get("pid"),
                source="torchrun",
            )
        except (ValueError, KeyError, TypeError):
            continue  # a torn or foreign line
    return [latest[r] for r in sorted(latest)]
