"""``ClusterResult``: what ``probing.cli.client.cluster_query`` answers.

result = cluster_query("SELECT rank, count(*) FROM process.threads GROUP BY rank", pid=1234)
result.table      # pyarrow.Table, rows tagged node and rank
result.missing    # [MissingPeer(rank, node, addr, reason)]
result.peers      # [PeerTiming(rank, node, addr, response_ms, clock_offset_ns)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from probing.node.cluster.wire import MissingPeer, PeerTiming

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass
class ClusterResult:
    """The merged answer, who did not answer, and how long each peer took."""

    table: pa.Table
    missing: list[MissingPeer] = field(default_factory=list)
    peers: list[PeerTiming] = field(default_factory=list)
    plan: dict[str, Any] = field(default_factory=dict)  # mode, and what the peers ran
