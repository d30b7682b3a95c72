"""The seam between the probe and the cluster: the cluster registers its
HTTP routes with a probe's app, and the node holds no modules."""

from __future__ import annotations

import json
import threading
import types
from typing import Any

import pytest

from probing.node.cluster.identity import Identity
from probing.node.cluster.node import ClusterNode
from probing.node.probe.api import ROUTES, Routes, make_app
from probing.node.probe.http import Request, Response

CLUSTER_ROUTES = {("POST", "/cluster/query"), ("POST", "/cluster/gather"),
                  ("POST", "/cluster/trace")}  # fmt: skip


def _post(path: str, body: object, remote: str | None = None) -> Request:
    headers = {"authorization": "Bearer t"} if remote else {}
    return Request("POST", path, {}, json.dumps(body).encode(), 0, remote, headers)


def _probe() -> Any:
    return types.SimpleNamespace(cluster=None, target=types.SimpleNamespace(pid=1),
                                 note_query=lambda: None)  # fmt: skip


def _node(rank: int = 0, world: int = 1) -> ClusterNode:
    ident = Identity(rank, world, rank, "n0", 0, None, "run", (), 0)
    node = ClusterNode(ident, lambda: pytest.fail("no query runs here"), token=b"t")
    node.ready.set()
    return node


def test_a_probe_without_a_cluster_has_no_cluster_route_and_says_why() -> None:
    app = make_app(_probe())
    assert not CLUSTER_ROUTES & set(app.routes) and not CLUSTER_ROUTES & set(ROUTES)
    for _, path in CLUSTER_ROUTES:
        answer = app(_post(path, {}))
        assert answer.status == 409, answer  # NotInCluster, as before the cluster had routes
        err = json.loads(answer.body)
        assert err["type"] == "NotInCluster" and "not in cluster mode" in err["error"]
    assert app(_post("/cluster/nothing", {})).status == 409
    assert app(_post("/nothing", {})).status == 404


def test_the_cluster_registers_its_routes_and_they_answer() -> None:
    probe, node = _probe(), _node()
    app = make_app(probe)
    node.register(app.routes)
    assert CLUSTER_ROUTES <= set(app.routes)
    # the probe's own route answers the rank's own row of a /cluster/trace
    stops: list[str] = []
    probe.stop_trace = lambda: stops.append("stop")
    probe.tracer = None  # not tracing: /trace/stop says so, in this rank's row
    rows = json.loads(app(_post("/cluster/trace", {"action": "stop", "timeout": 1})).body)
    assert [(r["rank"], r["ok"]) for r in rows] == [(0, True)] and not stops
    answer = app(_post("/cluster/query", {"no": "sql"}))
    assert answer.status == 400 and b"bad /cluster/query request" in answer.body
    # over TCP: /cluster/query and /cluster/gather are routes a peer reaches, /cluster/trace not
    assert app(_post("/cluster/gather", {}, remote="10.0.0.2:1")).status == 400
    assert app(_post("/cluster/trace", {}, remote="10.0.0.2:1")).status == 403


def test_a_route_is_registered_once_and_two_apps_are_apart() -> None:
    routes = Routes()
    handler = lambda probe, req: Response.json({})  # noqa: E731
    routes.register("GET", "/x", handler)
    with pytest.raises(ValueError, match="has a route already"):
        routes.register("GET", "/x", handler)
    with pytest.raises(ValueError, match="has a route already"):
        routes.register("GET", "/health", handler)  # nor a probe's own
    one, two = make_app(_probe()), make_app(_probe())
    _node().register(one.routes)
    assert CLUSTER_ROUTES <= set(one.routes) and not CLUSTER_ROUTES & set(two.routes)


def test_a_node_that_does_not_know_its_rank_says_so() -> None:
    node = _node()
    node.learn = lambda: None  # waiting for the job's process group
    node.error = "waiting for the job's process group"
    app = make_app(_probe())
    node.register(app.routes)
    answer = app(_post("/cluster/query", {"sql": "SELECT 1"}))
    assert answer.status == 409 and b"waiting for the job" in answer.body


def test_the_cluster_node_holds_no_module() -> None:
    node = _node()
    modules = {k for k, v in vars(node).items() if isinstance(v, types.ModuleType)}
    assert not modules
    for gone in ("endpoints", "coordinator", "asking"):
        assert not hasattr(node, gone)


def test_the_detector_asks_through_the_nodes_methods() -> None:
    """``coordinate`` and ``control``: what the detector calls, typed by the node."""
    node = _node(rank=0, world=2)
    node.refresh = lambda budget=2.0: None  # type: ignore[method-assign]
    rows = node.control("/query", b"{}", 0.5, {1})
    assert rows == [{"rank": 1, "node": "?", "addr": "", "status": 0,
                     "reason": "not discovered (no probe, or not joined yet)"}]  # fmt: skip
    done = threading.Event()
    node.detector = lambda: types.SimpleNamespace(start=done.set, stop=done.clear)  # type: ignore[assignment,return-value]
    assert node.ensure_watch() is node.watch and done.is_set()
    node.stop()
    assert not done.is_set()
