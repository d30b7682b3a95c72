"""Cross-node SQL: peers find each other and answer one query together.

``identity`` (who am I in the job), ``discovery`` (the rendezvous store or
PROBING_PEERS), ``node`` (the TCP peer: answering and asking), ``plan``
(what the peers run and what the asker runs), ``wire`` (the messages).
Asking a probe for a cluster query is the client's: ``probing.client.cluster_query``.
"""

from probing.cluster.query import ClusterResult
from probing.cluster.wire import MissingPeer, PeerTiming

__all__ = ["ClusterResult", "MissingPeer", "PeerTiming"]
