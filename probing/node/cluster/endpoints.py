"""The cluster's HTTP endpoints, registered with a probe's routes.

``register`` puts ``POST /cluster/query``, ``POST /cluster/gather`` (both
reached over TCP with the token) and ``POST /cluster/trace`` into an app's
``probing.node.probe.api.Routes``, bound to the cluster node; the probe's
layer does not import the cluster's, and an app without them answers a
``/cluster/*`` request with ``NotInCluster``. Each reads its JSON request
(``400`` when it is not one), asks the coordinator
(``probing.node.cluster.coordinator``) or the peers (``fanout.control``)
and encodes the answer: the rows as JSON, or the cluster's wire format
(``probing.node.cluster.wire``: a JSON head line, then Arrow IPC streams).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Protocol

from probing.errors import ProbingError, control_outcome, http_status, log_unexpected, wire_type
from probing.node.cluster import coordinator, fanout
from probing.node.cluster.coordinator import Asker
from probing.node.cluster.wire import CLUSTER_CONTENT_TYPE, pack
from probing.node.probe.api import Probe, Routes, not_in_cluster
from probing.node.probe.http import Request, Response


class Answering(Asker, Protocol):
    """What the endpoints need of the cluster node (``probing.node.cluster.node.Answering``)."""

    ready: threading.Event  # set once the first attempt to join is over
    error: str | None

    @property
    def learning(self) -> bool: ...


def register(node: Answering, routes: Routes) -> None:
    """``node``'s endpoints, routed in ``routes`` (a probe's app)."""
    routes.register("POST", "/cluster/query", lambda probe, req: cluster_query(node, probe, req),
                    tcp=True)  # fmt: skip
    routes.register("POST", "/cluster/gather", lambda probe, req: cluster_gather(node, probe, req),
                    tcp=True)  # fmt: skip
    routes.register("POST", "/cluster/trace",
                    lambda probe, req: cluster_trace(node, routes, probe, req))  # fmt: skip


def joined(node: Answering) -> Answering:
    """``node``, once its first attempt to join is over (5 s at most);
    ``NotInCluster`` while it does not know its rank."""
    node.ready.wait(5.0)
    if node.learning:
        raise not_in_cluster(
            str(node.error),
            hint="the process is not a rank of a job: leave --cluster out to ask it alone; "
            "it joins once the job calls torch.distributed.init_process_group, "
            "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, or PROBING_PEERS",
        )
    return node


def cluster_query(node: Answering, probe: Probe, req: Request) -> Response:
    """POST /cluster/query {"sql", "timeout", "strict", "fanout", "format"}: this
    probe asks every peer and answers with the merged result, the missing
    peers and each peer's response time and clock offset."""
    resp = _query(joined(node), req)
    if resp.status == 200:
        probe.note_query()
    return resp


def _query(node: Answering, req: Request) -> Response:
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


def cluster_gather(node: Answering, probe: Probe, req: Request) -> Response:
    """POST /cluster/gather: a peer's share of a cluster query (peers call it)."""
    t_recv = time.time_ns()
    from probing.node.cluster import plan as planner

    joined(node)
    try:
        payload = json.loads(req.body)
        planner.Work.from_json(payload["work"])
    except (ValueError, KeyError, TypeError) as err:
        return Response.error(400, f"bad /cluster/gather request: {err}")
    resp = Response(200, CLUSTER_CONTENT_TYPE, coordinator.answer_gather(node, payload, t_recv))
    probe.note_query()
    return resp


CONTROL = {"start": "/trace/start", "stop": "/trace/stop"}  # POST /cluster/trace's actions


def cluster_trace(node: Answering, routes: Routes, probe: Probe, req: Request) -> Response:
    """POST /cluster/trace {"action": "start" | "stop", "families", "stacks",
    "launch_stacks", "timeout", "ranks"}: the same on this process (its
    route in ``routes``) and, over the peer port with the token, on every
    peer (of ``ranks``, all when absent); one row per rank: ``rank, node,
    addr, ok`` (tracing, or stopped), ``done`` (by this request: not tracing
    already), ``state``, ``reason`` (``probing trace --cluster``)."""
    joined(node)
    try:
        payload = json.loads(req.body or b"{}")
        path = CONTROL[payload.get("action")]
        timeout = min(max(float(payload.get("timeout", 10.0)), 1.0), 600.0)
        options = {k: payload[k] for k in ("families", "stacks", "launch_stacks") if k in payload}
        ranks = None if payload.get("ranks") is None else {int(r) for r in payload["ranks"]}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return Response.error(400, f'bad /cluster/trace request (want {{"action": ...}}): {err}')
    body = json.dumps(options).encode()
    rows = []
    if ranks is None or node.rank in ranks:
        rows.append(_mine(node, routes, probe, req._replace(path=path, body=body)))
    rows += fanout.control(node, path, body, timeout, ranks)
    out = []
    for row in rows:
        did = control_outcome(row["status"], row.get("reply") or {}, row.get("reason"))
        out.append({"rank": row["rank"], "node": row["node"], "addr": row["addr"], **did})
    return Response.json(sorted(out, key=lambda r: r["rank"]))


def _mine(node: Answering, routes: Routes, probe: Probe, req: Request) -> dict[str, Any]:
    """This process's row of a ``/cluster/trace``: its own route's answer."""
    route = routes.find(req.method, req.path)
    assert route is not None  # the probe's own /trace/start and /trace/stop
    try:
        mine = route(probe, req)
    except ProbingError as err:  # this process could not: said in its row, the peers go on
        mine = Response.error(http_status(err), str(err), wire_type(err))
    except Exception as err:  # a bug: logged, said in its row, peers go on
        log_unexpected("trace control", err)
        mine = Response.error(500, f"{type(err).__name__}: {err}")
    try:
        reply = json.loads(mine.body)
    except ValueError:
        reply = {}
    return {"rank": node.rank, "node": node.ident.node, "addr": node.addr or "local",
            "status": mine.status, "reply": reply}  # fmt: skip
