"""``cluster_query``: one SQL query over every peer of the job.

result = cluster_query("SELECT rank, count(*) FROM process.threads GROUP BY rank", pid=1234)
result.table      # pyarrow.Table, rows tagged node and rank
result.missing    # [MissingPeer(rank, node, addr, reason)]
result.peers      # [PeerTiming(rank, node, addr, response_ms, clock_offset_ns)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from probing.cluster.wire import MissingPeer, PeerTiming
from probing.errors import ProbingError

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass
class ClusterResult:
    """The merged answer, who did not answer, and how long each peer took."""

    table: pa.Table
    missing: list[MissingPeer] = field(default_factory=list)
    peers: list[PeerTiming] = field(default_factory=list)
    plan: dict[str, Any] = field(default_factory=dict)  # mode, and what the peers ran


def cluster_query(
    sql: str,
    *,
    pid: int | None = None,
    addr: str | None = None,
    timeout: float = 5.0,
    strict: bool = False,
    token: str | None = None,
    fanout: str = "auto",
) -> ClusterResult:
    """Ask a probe to run ``sql`` across the job: the local probe of ``pid``
    (unix socket, no token) or a remote one at ``addr`` ("host:port", with
    ``token`` or ``$PROBING_TOKEN``). Peers that do not answer within
    ``timeout`` are listed in ``missing``; ``strict`` raises PeerUnreachable.
    """
    from probing.client import ProbeClient

    if (pid is None) == (addr is None):
        raise ProbingError("cluster_query needs exactly one of pid= or addr=")
    if pid is not None:
        client = ProbeClient.for_pid(pid, timeout=timeout + 30)
    else:
        client = ProbeClient.for_addr(addr or "", token=token, timeout=timeout + 30)
    with client:
        return client.cluster_query(sql, timeout=timeout, strict=strict, fanout=fanout)
