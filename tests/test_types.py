"""Types instead of strings: errors over HTTP, provider bugs, read failures, states."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest

from probing import errors
from probing.cli.client import ProbeClient, UnixTransport
from probing.node.bpf.state import TracerState
from probing.node.probe.context import ProbeContext, base_tables
from probing.node.sql import Database
from probing.node.sql.limits import LimitExceeded
from probing.node.store import Store


@pytest.mark.parametrize("cls", sorted(errors.ERRORS.values(), key=lambda c: c.__name__))
def test_every_error_type_crosses_http_and_comes_back(cls: type[errors.ProbingError]) -> None:
    err = cls("it went wrong")
    back = errors.from_wire(errors.http_status(err), "it went wrong", errors.wire_type(err))
    assert type(back) is cls
    assert "it went wrong" in str(back)


def test_a_subclass_crosses_as_its_nearest_listed_class() -> None:
    err = LimitExceeded("too big", setting="PROBING_QUERY_MAX_RESULT_MB", limit=1)
    assert errors.wire_type(err) == "QueryError" and errors.http_status(err) == 400
    back = errors.from_wire(400, "too big", "NotAType")
    assert type(back) is errors.ProbingError and "probe answered 400" in str(back)
    assert isinstance(errors.from_wire(401, "no", ""), errors.AccessDenied)


def test_a_providers_bug_answers_500_with_its_traceback_in_the_log(runtime_dir, capfd) -> None:
    def broken() -> pa.Table:
        return {}["no such key"]  # type: ignore[return-value]

    def tables(database: Database, ctx: ProbeContext) -> None:
        base_tables(database, ctx)
        database.register_table("test", "broken", broken)

    path = runtime_dir / f"probing-{os.getuid()}" / "bug.sock"
    ctx = ProbeContext(installers=(tables,), socket_path=str(path))
    ctx.serve()
    try:
        client = ProbeClient(UnixTransport(ctx.socket_path, pid=os.getpid()))
        status, _, body = client.transport.request(
            "POST", "/query", json.dumps({"sql": "SELECT * FROM test.broken"}).encode()
        )
        assert status == 500 and json.loads(body)["type"] == "ProviderError"
        with pytest.raises(errors.ProviderError, match="test.broken failed: KeyError"):
            client.query("SELECT * FROM test.broken")
        with pytest.raises(errors.QueryError):  # bad SQL stays a 400
            client.query("SELEC 1")
        assert client.query("SELECT 1 AS one").to_pylist() == [{"one": 1}]
    finally:
        ctx.stop()
    log = capfd.readouterr().err
    assert "Traceback (most recent call last)" in log and "KeyError: 'no such key'" in log


def test_a_failed_flush_before_a_read_is_counted_in_probing_tables() -> None:
    database = Database(Store())
    from probing.node.tables import install

    install(database)
    table = database.store.table("test", "rows")
    table.append_batch(pa.RecordBatch.from_pydict({"a": [1, 2]}))
    calls = []

    def drain() -> None:
        calls.append(1)
        raise ValueError("undecodable event")

    table.add_before_read(drain)
    assert database.sql("SELECT count(*) AS n FROM test.rows").to_pylist() == [{"n": 2}]
    row = database.sql(
        "SELECT read_errors FROM probing.tables WHERE schema = 'test' AND \"table\" = 'rows'"
    ).to_pylist()
    assert row == [{"read_errors": len(calls)}] and len(calls) >= 2
    assert table.last_read_error == "ValueError: undecodable event"


def test_tracer_state_is_an_enum_that_reads_as_its_value() -> None:
    assert TracerState.TRACING == "tracing" and str(TracerState.STOPPED) == "stopped"
    assert json.dumps({"state": TracerState.TRACING}) == '{"state": "tracing"}'


def test_cluster_work_is_a_dataclass_with_a_mode_enum_on_the_wire() -> None:
    from probing.node.cluster.plan import Mode, ScanSpec, Work

    work = Work(Mode.AGG_NODE, "SELECT node, count(*) FROM t.x GROUP BY node",
                {"t.x": ScanSpec(["node"], "ts > 0")})  # fmt: skip
    back = Work.from_json(json.loads(json.dumps(work.to_json())))
    assert back == work and back.mode is Mode.AGG_NODE
    assert work.for_member().mode is Mode.SCAN and work.for_member().scans == work.scans
    assert Work(Mode.AGG, "q").for_member().mode is Mode.AGG
    for bad in ({"mode": "everything"}, {"scans": {}}, {"mode": "scan", "scans": [1]}, "scan"):
        with pytest.raises(ValueError, match="bad work"):
            Work.from_json(bad)


def test_one_http_codec_for_the_server_the_client_and_the_peers() -> None:
    from probing.node.probe import http
    from probing.node.probe.request import parse_head

    raw = http.request_bytes("/query", b'{"sql": "SELECT 1"}', b"tok")
    head = parse_head(raw[: raw.index(b"\r\n\r\n") + 4])  # the server's strict parser takes it
    assert (head.method, head.target) == ("POST", "/query")
    assert head.headers["authorization"] == "Bearer tok" and head.length == 19
    get = http.request_bytes("/health", b"", None, "GET")
    assert parse_head(get[: get.index(b"\r\n\r\n") + 4]).length == 0
    answer = http.parse_answer(http.response_bytes(http.Response.error(409, "not tracing")))
    assert (answer.status, answer.content_type) == (409, "application/json")
    assert json.loads(answer.body) == {"error": "not tracing", "type": "ProbingError"}
    with pytest.raises(ConnectionResetError):
        http.parse_answer(b"garbage")


def test_one_reading_of_a_rank_answer_to_a_start_or_a_stop() -> None:
    """``trace --cluster`` reads its peers' HTTP answers, ``trace --job`` its
    clients' exceptions: both with ``control_outcome``, so a rank already
    tracing (start) or already stopped (stop) counts as done either way."""
    from probing.errors import (
        AlreadyTracing,
        NoSuchProcess,
        NotTracing,
        control_outcome,
        from_wire,
        outcome_of,
        wire_type,
    )

    for err, state in ((AlreadyTracing("busy"), "tracing"), (NotTracing("idle"), "stopped")):
        back = from_wire(409, str(err), wire_type(err))  # what a client raises
        assert type(back) is type(err)
        did = outcome_of(back)
        assert did == control_outcome(409, {"type": wire_type(err), "error": str(err)})
        assert (did["ok"], did["done"], did["state"]) == (True, False, state)
    gone = outcome_of(NoSuchProcess("pid 7 has exited"))
    assert not gone["ok"] and gone["reason"] == "pid 7 has exited"
    assert control_outcome(200, {"state": "tracing"})["state"] == "tracing"
    refused = [{"symbol": "cudaFree", "kind": "entry", "library": "x", "error": "no"}] * 2
    families = {"cuda": {"refused": refused}, "gloo": {"refused": []}}
    partly = control_outcome(200, {"state": "tracing", "families": families})
    assert partly["ok"] and partly["reason"] == "2 uprobes not attached (probing.uprobes says why)"
    assert control_outcome(0, {}, "timed out")["reason"] == "timed out"
