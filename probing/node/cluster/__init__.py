"""Cross-node SQL: peers find each other and answer one query together.

``identity`` (who am I in the job), ``discovery`` (the rendezvous store or
PROBING_PEERS), ``join`` (joining in the background, however late), ``node``
(the TCP peer: its membership; it registers the endpoints), ``share`` (this
peer's rows of a query), ``fanout`` (asking many peers at once over
``exchange``), ``coordinator`` (one query end to end), ``endpoints`` (its
HTTP requests and answers), ``plan`` (what the peers run and what the asker
runs), ``wire`` (the messages).
Asking a probe for a cluster query is the client's: ``probing.cli.client.cluster_query``.
"""

from probing.node.cluster.query import ClusterResult
from probing.node.cluster.wire import MissingPeer, PeerTiming

__all__ = ["ClusterResult", "MissingPeer", "PeerTiming"]
