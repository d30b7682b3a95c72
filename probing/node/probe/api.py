"""The probe's HTTP endpoints, one function each, transport-agnostic, and
the routes that reach them.

Each app has its own ``Routes``: the probe's own endpoints, and those a
layer above it registers there, as prometheus_client's registry takes
collectors (the cluster's ``/cluster/*``: ``probing.node.cluster.endpoints``).
What the endpoints use of a probe (``Probe``) and of its cluster node
(``Member``, ``Detector``) are Protocols: this layer imports neither the
context's parts above it nor the cluster.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from probing import config
from probing.errors import (
    AccessDenied,
    EvalError,
    NotInCluster,
    NotTracing,
    ProbingError,
    QueryError,
    http_status,
    wire_type,
)
from probing.node import openmetrics
from probing.node.probe.http import INSTALL, Request, Response

if TYPE_CHECKING:
    import pyarrow as pa

    from probing.node.bpf.tracer import Tracer
    from probing.node.probe.server import UnixHTTPServer
    from probing.node.sql import Database
    from probing.node.tables.nvml import GpuSampler
    from probing.target import Target


class Detector(Protocol):
    """A probe's always-on detector, as the probe and the engine see it
    (``probing.analyze.watch.Watch``)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def metrics(self) -> str: ...

    def table(self) -> pa.Table: ...


class Member(Protocol):
    """A probe's cluster node, as the probe sees it
    (``probing.node.cluster.node.ClusterNode``)."""

    @property
    def watch(self) -> Detector | None: ...

    def describe(self) -> dict[str, object]: ...

    def register(self, routes: Routes) -> None: ...

    def start(self, server: UnixHTTPServer) -> None: ...

    def stop(self) -> None: ...

    def ensure_watch(self, start: bool = True) -> Detector | None: ...

    def peers_table(self) -> pa.Table: ...


class Probe(Protocol):
    """What the endpoints use of a probe (``probing.node.probe.context.ProbeContext``)."""

    tracer: Tracer | None
    cluster: Member | None
    target: Target  # the process described

    @property
    def database(self) -> Database: ...

    @property
    def nvml(self) -> GpuSampler: ...

    def describe(self) -> dict[str, object]: ...

    def note_query(self) -> None: ...

    def start_trace(self, families: Sequence[str], **options: object) -> Tracer: ...

    def stop_trace(self) -> Tracer | None: ...


# an endpoint: the probe asked, the request; its answer
Handler = Callable[[Probe, Request], Response]


ARROW_STREAM = "application/vnd.apache.arrow.stream"
FORMATS = ("arrow", "json", "csv", "rows")


def _sql_request(req: Request) -> tuple[str, str]:
    fmt = req.query.get("format", "")
    if req.body[:1] == b"{":
        try:
            payload = json.loads(req.body)
        except ValueError as err:
            raise QueryError(f"request body is not JSON: {err}") from err
        sql = payload.get("sql", "")
        fmt = payload.get("format", fmt)
    else:
        sql = req.body.decode("utf-8", "replace")
    fmt = fmt or "arrow"
    if fmt not in FORMATS:
        raise QueryError(f"unknown format {fmt!r} (use one of {', '.join(FORMATS)})")
    return sql, fmt


# values (rows x columns) encoded per step: the GIL is held for one step at
# a time (a few ms), so the engine's other threads never wait long for it
ENCODE_VALUES = 20_000


def _steps(table: object) -> Iterator[object]:
    import pyarrow as pa

    assert isinstance(table, pa.Table)
    rows = max(1, ENCODE_VALUES // max(1, table.num_columns))
    yield from table.to_batches(max_chunksize=rows)


def _over(what: str, size: int, limit: int) -> ProbingError:
    from probing.node.sql.limits import LimitExceeded  # the database loads on the first query

    return LimitExceeded(
        f"the result as {what} is over the limit of {limit >> 20} MiB (at {size >> 20} MiB); "
        "ask for fewer rows, or for format arrow (compact)",
        setting="PROBING_QUERY_MAX_RESULT_MB",
        limit=limit >> 20,
    )


def result_limit() -> int:
    from probing.node.sql.limits import Limits

    return Limits.from_env().result_bytes


def json_rows(table: object, limit: int, prefix: bytes = b"") -> bytearray:
    """``table`` as a JSON array of row objects, encoded a bounded step at a
    time into one growing buffer (no copy of the whole answer while the GIL
    is held), after ``prefix``; over ``limit`` bytes it stops with
    ``LimitExceeded``."""
    out = bytearray(prefix + b"[")
    first = len(out)
    for batch in _steps(table):
        rows = batch.to_pylist()  # type: ignore[attr-defined]
        if not rows:
            continue
        if len(out) > first:
            out += b","
        out += json.dumps(rows, default=str).encode()[1:-1]
        if len(out) > limit:
            raise _over("JSON", len(out), limit)
    out += b"]"
    return out


def _plain(values: list[Any]) -> list[Any]:
    """Values JSON keeps as they are (null, booleans, numbers, text); any
    other (a timestamp, a list, a struct) as its ``str()``."""
    return [v if v is None or isinstance(v, bool | int | float | str) else str(v) for v in values]


def _column(col: Any) -> list[Any]:
    """A column's values for ``json_columns``; a nanosecond timestamp (which
    ``datetime`` cannot hold) as Arrow's text of it."""
    try:
        return _plain(col.to_pylist())
    except ValueError:
        import pyarrow as pa

        if not pa.types.is_timestamp(col.type):
            raise
        text: list[Any] = col.cast(pa.string()).to_pylist()
        return text


def json_columns(table: object, limit: int) -> bytearray:
    """``table`` as ``{"columns": [name...], "rows": [[value...]...]}``, the
    values as ``_plain`` gives them: every column, in order, even with no
    rows, and rows a terminal table is printed from without pyarrow in the
    client (``probing query``). Encoded in bounded steps, as ``json_rows``."""
    names = list(table.column_names)  # type: ignore[attr-defined]
    out = bytearray(b'{"columns": ' + json.dumps(names).encode() + b', "rows": [')
    first = len(out)
    for batch in _steps(table):
        cols = [_column(col) for col in batch.columns]  # type: ignore[attr-defined]
        n = batch.num_rows  # type: ignore[attr-defined]
        rows = [list(r) for r in zip(*cols, strict=True)] if cols else [[]] * n
        if not rows:
            continue
        if len(out) > first:
            out += b","
        out += json.dumps(rows).encode()[1:-1]
        if len(out) > limit:
            raise _over("JSON", len(out), limit)
    out += b"]}"
    return out


def encode(table: object, fmt: str, limit: int | None = None) -> Response:
    """``table`` in ``fmt`` (arrow, json, csv, rows), at most ``limit`` bytes
    (``PROBING_QUERY_MAX_RESULT_MB`` when None)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.ipc as ipc

    assert isinstance(table, pa.Table)
    if limit is None:
        limit = result_limit()
    if fmt == "json":
        return Response(200, "application/json", json_rows(table, limit))  # type: ignore[arg-type]
    if fmt == "rows":
        return Response(200, "application/json", json_columns(table, limit))  # type: ignore[arg-type]
    sink = pa.BufferOutputStream()
    if fmt == "csv":
        with pacsv.CSVWriter(sink, table.schema) as writer:
            for batch in _steps(table):
                writer.write_batch(batch)
                if sink.tell() > limit:
                    raise _over("CSV", sink.tell(), limit)
        return Response(200, "text/csv", sink.getvalue().to_pybytes())
    with ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return Response(200, ARROW_STREAM, sink.getvalue().to_pybytes())


def health(probe: Probe, req: Request) -> Response:
    return Response.json(probe.describe())


def query(probe: Probe, req: Request) -> Response:
    sql, fmt = _sql_request(req)
    resp = encode(probe.database.sql(sql, allow_code=_code_allowed(req), gone=req.gone), fmt)
    probe.note_query()
    return resp


def tables(probe: Probe, req: Request) -> Response:
    """GET /tables: schema, table and kind (live, view, stored) of every
    table, none of them read."""
    return Response.json(probe.database.kinds())


def evaluate(probe: Probe, req: Request) -> Response:
    """POST /eval {"code": ...}: local (unix socket) callers only; the
    process runs it (``probing.guest.inside.run``)."""
    if not _code_allowed(req):
        return Response.error(403, "eval is served on the local socket only", AccessDenied.__name__)
    try:
        code = json.loads(req.body)["code"]
    except (ValueError, KeyError, TypeError):
        return Response.error(400, 'body must be JSON: {"code": "..."}')
    try:
        return Response.json(probe.target.eval(code))
    except EvalError as err:
        body = {"error": str(err), "type": wire_type(err), "detail": err.detail}
        return Response.json(body, http_status(err))


def nvml(probe: Probe, req: Request) -> Response:
    """POST /nvml {"interval": "100ms"} starts (or re-times) sampling; {"stop": true} stops."""
    try:
        payload = json.loads(req.body or b"{}")
        sampler = probe.nvml
        if payload.get("stop"):
            sampler.stop()
        else:
            sampler.start(config.parse_interval(payload.get("interval", "100ms")))
    except (ValueError, AttributeError) as err:
        return Response.error(400, f"bad /nvml request: {err}")
    return Response.json(sampler.status_table().to_pylist()[0])


def trace_start(probe: Probe, req: Request) -> Response:
    """POST /trace/start {"families": ["nccl", "cuda", "gloo"], "output": path,
    "stacks": true, "launch_stacks": false}."""
    try:
        payload = json.loads(req.body or b"{}")
        families = list(payload.get("families") or ("nccl", "cuda", "gloo"))
        output = payload.get("output")
        stacks = bool(payload.get("stacks", True))
        launch_stacks = bool(payload.get("launch_stacks", False))
    except (ValueError, AttributeError, TypeError) as err:
        return Response.error(400, f"bad /trace/start request: {err}")
    if output and req.remote is not None:  # a peer names no file to write on this node
        return Response.error(
            403, "a trace started over TCP writes no file (no output)", AccessDenied.__name__
        )
    started = probe.start_trace(families, output=output, stacks=stacks, launch_stacks=launch_stacks)
    if probe.cluster is not None:  # the job is watched from its first trace on
        probe.cluster.ensure_watch()
    return Response.json(started.status())


def trace_stop(probe: Probe, req: Request) -> Response:
    """POST /trace/stop: drain, detach every uprobe; the tables stay."""
    from probing.node.bpf.state import TracerState

    current = probe.tracer
    if current is None or current.state is not TracerState.TRACING:
        raise NotTracing("this process is not tracing", hint="nothing to stop")
    probe.stop_trace()
    return Response.json(current.status())


def trace_thread(probe: Probe, req: Request) -> Response:
    """POST /trace/thread {"tid", "tstate"}: a new thread of the traced process,
    told by its guest as it starts (local socket only)."""
    if req.remote is not None:
        return Response.error(403, "served on the local socket only", AccessDenied.__name__)
    try:
        payload = json.loads(req.body)
        tid, tstate = int(payload["tid"]), int(payload["tstate"])
    except (ValueError, KeyError, TypeError) as err:
        return Response.error(400, f"bad /trace/thread request: {err}")
    current = probe.tracer
    if current is not None:
        current.register_thread(tid, tstate)
    return Response.json({"ok": True})


def trace_status(probe: Probe, req: Request) -> Response:
    current = probe.tracer
    return Response.json(current.status() if current else {"state": "stopped", "families": {}})


def peers(probe: Probe, req: Request) -> Response:
    """GET /peers: ``probing.peers`` as JSON (empty outside cluster mode)."""
    node = probe.cluster
    return Response.json(node.peers_table().to_pylist() if node is not None else [])


def metrics(probe: Probe, req: Request) -> Response:
    """GET /metrics: OpenMetrics for Prometheus (on the peer port: the token
    as bearer): the step, each rank's lateness, the findings active, the
    events dropped, from this probe's always-on detector; Prometheus' text
    format 0.0.4 to a scraper whose ``Accept`` does not name OpenMetrics
    (``curl ... | promtool check metrics``)."""
    node = probe.cluster  # before any trace: no detection yet, the counters at 0
    detector = node.ensure_watch(start=False) if node is not None else None
    if detector is None:
        raise ProbingError(
            "no detector here: /metrics is served in cluster mode",
            hint="a rank of a multi-process job, or PROBING_PEERS",
        )
    text = detector.metrics()
    if openmetrics.wants_openmetrics((req.headers or {}).get("accept")):
        return Response(200, openmetrics.OPENMETRICS, text.encode())
    return Response(200, openmetrics.TEXT_FORMAT, openmetrics.text_format(text).encode())


def _code_allowed(req: Request) -> bool:
    """Code runs for local callers; over TCP only with PROBING_REMOTE_CODE=1."""
    return req.remote is None or config.load().remote_code


# what a TCP caller (with the token) may reach without PROBING_REMOTE_CODE=1:
# reading, and starting or stopping a trace (a control action: no file written)
TCP_ROUTES = {
    ("GET", "/health"),
    ("GET", "/tables"),
    ("GET", "/peers"),
    ("POST", "/query"),
    ("POST", "/trace/start"),
    ("POST", "/trace/stop"),
    ("GET", "/metrics"),
}

# the probe's own endpoints; the layers above register theirs in an app's ``Routes``
ROUTES: dict[tuple[str, str], Handler] = {
    ("GET", "/health"): health,
    ("POST", "/query"): query,
    ("GET", "/tables"): tables,
    ("POST", "/eval"): evaluate,
    ("POST", "/nvml"): nvml,
    ("POST", "/trace/start"): trace_start,
    ("POST", "/trace/stop"): trace_stop,
    ("GET", "/trace/status"): trace_status,
    ("POST", "/trace/thread"): trace_thread,
    ("GET", "/peers"): peers,
    ("GET", "/metrics"): metrics,
}

CLUSTER = "/cluster/"  # the paths the cluster registers (``probing.node.cluster.endpoints``)


class Routes:
    """One app's routes: the probe's own (``ROUTES``) and those registered by
    the layers above it, each once. ``tcp``: a TCP caller with the token
    reaches it without ``PROBING_REMOTE_CODE=1``."""

    def __init__(self) -> None:
        self._handlers: dict[tuple[str, str], Handler] = dict(ROUTES)
        self._tcp: set[tuple[str, str]] = set(TCP_ROUTES)

    def register(self, method: str, path: str, handler: Handler, *, tcp: bool = False) -> None:
        """Route ``method path`` to ``handler``; a route is registered once."""
        if (method, path) in self._handlers:
            raise ValueError(f"{method} {path} has a route already")
        self._handlers[(method, path)] = handler
        if tcp:
            self._tcp.add((method, path))

    def find(self, method: str, path: str) -> Handler | None:
        return self._handlers.get((method, path))

    def over_tcp(self, method: str, path: str) -> bool:
        return (method, path) in self._tcp

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(list(self._handlers))


def not_in_cluster(why: str = "", hint: str = "") -> NotInCluster:
    """The answer to a cluster request a probe cannot serve: no cluster node
    (``why`` empty), or one that does not know its rank yet."""
    return NotInCluster(
        f"this probe is not in cluster mode{': ' + why if why else ''}",
        hint=hint
        or "leave --cluster out to ask this process alone; PROBING_CLUSTER=off, or its "
        "cluster settings were refused (the job's stderr says why)",
    )


def _other_install(pid: int, theirs: str) -> str:
    """A client of another install of probing asked this probe."""
    import sys

    return (
        f"pid {pid} is served by probing {INSTALL} (engine pid {os.getpid()}), and this "
        f"command is probing {theirs}: ask with the probing that serves it "
        f"({sys.executable} -m probing ...), or restart the job under this one "
        "(docs/config.md: upgrades)"
    )


class ProbeApp:
    """A probe's HTTP app: a request answered by its route in ``routes``."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.routes = Routes()

    def __call__(self, req: Request) -> Response:
        theirs = (req.headers or {}).get("probing-install")
        if theirs and req.remote is None and theirs != INSTALL:
            return Response.error(409, _other_install(self.probe.target.pid, theirs), "AttachError")
        route = self.routes.find(req.method, req.path)
        if route is None and req.path.startswith(CLUSTER):
            if not any(path.startswith(CLUSTER) for _, path in self.routes):
                err = not_in_cluster()
                return Response.error(http_status(err), str(err), wire_type(err))
        if route is None:
            known = ", ".join(f"{m} {p}" for m, p in self.routes)
            return Response.error(404, f"no endpoint {req.method} {req.path} (known: {known})")
        if not self.routes.over_tcp(req.method, req.path) and not _code_allowed(req):
            return Response.error(
                403, f"{req.method} {req.path} is served on the local socket only", "AccessDenied"
            )
        try:
            return route(self.probe, req)
        except ProbingError as err:
            return Response.error(http_status(err), str(err), wire_type(err))


def make_app(probe: Probe) -> ProbeApp:
    """``probe``'s app, with the probe's own routes (``ProbeApp.routes`` takes more)."""
    return ProbeApp(probe)
