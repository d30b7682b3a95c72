"""The cluster's HTTP endpoints, one function each, as ``probing.node.probe.api``'s.

``probing.node.probe.api`` routes ``POST /cluster/query`` and ``POST
/cluster/gather`` to the cluster node, which answers with these: each reads
its JSON request (``400`` when it is not one), asks the coordinator
(``probing.node.cluster.coordinator``) and encodes the answer: the rows as JSON,
or the cluster's wire format (``probing.node.cluster.wire``: a JSON head line,
then Arrow IPC streams). They live on this side of the probe because the
probe's layer does not import the cluster's.
"""

from __future__ import annotations

import json
import time

from probing.node.cluster import coordinator
from probing.node.cluster.coordinator import Asker
from probing.node.cluster.wire import CLUSTER_CONTENT_TYPE, pack
from probing.node.probe.http import Request, Response


def cluster_query(node: Asker, req: Request) -> Response:
    """POST /cluster/query {"sql", "timeout", "strict", "fanout", "format"}."""
    from probing.node.probe.api import json_rows, result_limit

    t_recv = time.time_ns()
    try:
        payload = json.loads(req.body or b"{}")
        sql = payload["sql"]
        timeout = float(payload.get("timeout", 5.0))
        strict = bool(payload.get("strict", False))
        fanout = str(payload.get("fanout", "auto"))
        fmt = payload.get("format", "arrow")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return Response.error(400, f'bad /cluster/query request (want {{"sql": ...}}): {err}')
    result, got, plan = coordinator.coordinate(
        node, sql, timeout=timeout, strict=strict, fanout=fanout
    )
    meta = {
        "missing": [vars(m) for m in got.missing],
        "peers": [vars(t) for t in got.peers],
        "plan": {"mode": plan.mode.value, "pushed": plan.pushed},
    }
    if fmt == "json":
        body = json_rows(result, result_limit(), prefix=b'{"rows": ')
        body += b", " + json.dumps(meta, default=str).encode()[1:]
        return Response(200, "application/json", bytes(body))
    return Response(200, CLUSTER_CONTENT_TYPE, pack(meta, {"result": result}, t_recv))


def cluster_gather(node: Asker, req: Request) -> Response:
    """POST /cluster/gather: a peer's share of a cluster query (peers call it)."""
    t_recv = time.time_ns()
    from probing.node.cluster import plan as planner

    try:
        payload = json.loads(req.body)
        planner.Work.from_json(payload["work"])
    except (ValueError, KeyError, TypeError) as err:
        return Response.error(400, f"bad /cluster/gather request: {err}")
    return Response(200, CLUSTER_CONTENT_TYPE, coordinator.answer_gather(node, payload, t_recv))
