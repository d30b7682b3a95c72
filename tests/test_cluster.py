"""Cluster queries across real peer processes on loopback.

Four peers are four Python processes with a probe each; they find each
other through ``PROBING_PEERS`` or through a real torch TCPStore.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from probing.cli.client import ProbeClient, cluster_query
from probing.errors import AccessDenied, PeerUnreachable
from tests.conftest import IDLE_LOOP, cli

TOKEN = "t0ken-for-tests"
GROUP_BY_RANK = "SELECT rank, count(*) AS n FROM process.threads GROUP BY rank ORDER BY rank"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_ready(pid: int, timeout: float = 15.0) -> dict:
    """The probe's /health once its cluster side is up (TCP bound, and the
    address published where the other ranks read it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = ProbeClient.for_pid(pid).health()
        cluster = health.get("cluster") or {}
        if cluster.get("addr") and cluster.get("published"):
            return health
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} never entered cluster mode: {health}")


def wait_rows(pid: int, table: str, rows: int, timeout: float = 15.0) -> None:
    """Until ``table`` holds ``rows`` rows in ``pid``'s probe (its script wrote them)."""
    deadline = time.monotonic() + timeout
    client = ProbeClient.for_pid(pid)
    while time.monotonic() < deadline:
        try:
            if client.query(f"SELECT count(*) AS n FROM {table}").to_pylist()[0]["n"] >= rows:
                return
        except Exception:  # no such table yet
            pass
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} never had {rows} rows in {table}")


@pytest.fixture
def listed_peers(spawn):
    """Four peers that know each other from PROBING_PEERS; returns (targets, addrs)."""
    addrs = [f"127.0.0.1:{p}" for p in free_ports(4)]
    env = {"PROBING_PEERS": ",".join(addrs), "PROBING_TOKEN": TOKEN}
    targets = [spawn(IDLE_LOOP, env={**env, "RANK": str(i)}) for i in range(4)]
    for t in targets:
        wait_ready(t.pid)
        ProbeClient.for_pid(t.pid).query("SELECT 1")  # engines loaded: timeouts below are tight
    return targets, addrs


def post(addr: str, path: str, body: bytes, token: str | None) -> tuple[int, bytes]:
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    auth = f"Authorization: Bearer {token}\r\n" if token is not None else ""
    s.sendall(f"POST {path} HTTP/1.0\r\n{auth}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    head, _, payload = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


def test_cli_cluster_group_by_rank_over_peers_list(listed_peers) -> None:
    targets, addrs = listed_peers
    r = cli("query", "--pid", str(targets[2].pid), "--cluster", GROUP_BY_RANK, "-f", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["rank"] for row in rows] == [0, 1, 2, 3]
    assert all(row["n"] >= 3 for row in rows)  # main, two loaders, the probe's own
    assert "4 peer(s) answered" in r.stderr
    table = cli("query", "-p", str(targets[0].pid), "--cluster", "--timings", GROUP_BY_RANK)
    assert table.returncode == 0 and "(4 rows)" in table.stdout
    assert all(a in table.stderr for a in addrs[1:])  # one timing line per peer
    for bad, why in (
        ("SELECT nope FROM process.threads", "nope"),
        ("SELECT 1", "schema.table"),
        ("SELECT * FROM process.nonexistent", "nonexistent"),
    ):
        r = cli("query", "-p", str(targets[0].pid), "--cluster", bad)
        assert r.returncode == 1 and r.stdout == "", (bad, r.stdout)
        assert len(r.stderr.splitlines()) == 1 and why in r.stderr, (bad, r.stderr)


def test_rows_are_tagged_and_filters_pushed(listed_peers) -> None:
    targets, _ = listed_peers
    res = cluster_query(
        "SELECT node, rank, name FROM process.threads WHERE name LIKE 'loader%' "
        "ORDER BY rank, name",
        pid=targets[1].pid,
    )
    assert res.plan["mode"] == "scan" and "LIKE 'loader%'" in res.plan["pushed"]
    assert res.table.column("rank").to_pylist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert set(res.table.column("name").to_pylist()) == {"loader-0", "loader-1"}
    assert res.missing == [] and sorted(p.rank for p in res.peers) == [0, 1, 2, 3]
    peers = {p["rank"]: p for p in ProbeClient.for_pid(targets[1].pid).peers()}
    assert peers[1]["status"] == "self" and all(peers[r]["status"] == "up" for r in (0, 2, 3))
    assert all(peers[r]["response_ms"] > 0 for r in (0, 2, 3))
    # loopback: one clock; the NTP estimate is within the round trip
    assert all(abs(peers[r]["clock_offset_ns"]) <= peers[r]["response_ms"] * 1e6 for r in (0, 2, 3))


def test_cluster_query_over_tcp_with_the_token(listed_peers) -> None:
    targets, addrs = listed_peers
    res = cluster_query(GROUP_BY_RANK, addr=addrs[3], token=TOKEN)
    assert res.table.column("rank").to_pylist() == [0, 1, 2, 3]
    with pytest.raises(AccessDenied):
        cluster_query(GROUP_BY_RANK, addr=addrs[3], token="wrong")
    r = cli(
        "query",
        "--addr",
        addrs[1],
        "SELECT pid FROM process.info",
        "-f",
        "json",
        env={"PROBING_TOKEN": TOKEN},
    )
    assert r.returncode == 0 and json.loads(r.stdout) == [{"pid": targets[1].pid}]
    env = {k: v for k, v in os.environ.items() if k != "PROBING_TOKEN"}
    r = subprocess.run(
        [sys.executable, "-m", "probing", "query", "--addr", addrs[1], "SELECT 1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and r.stdout == "" and "PROBING_TOKEN" in r.stderr
    r = cli("query", "SELECT 1")
    assert r.returncode == 2 and "--pid or --addr" in r.stderr


def test_wrong_token_is_401_and_nothing_runs(listed_peers) -> None:
    targets, addrs = listed_peers
    before = ProbeClient.for_pid(targets[0].pid).health()["queries"]
    body = json.dumps({"sql": "SELECT 1", "format": "json"}).encode()
    for token in ("wrong", None, TOKEN[:-1]):
        status, payload = post(addrs[0], "/query", body, token)
        assert status == 401 and json.loads(payload)["type"] == "Unauthorized"
    assert ProbeClient.for_pid(targets[0].pid).health()["queries"] == before
    status, _ = post(addrs[0], "/query", body, TOKEN)
    assert status == 200
    assert ProbeClient.for_pid(targets[0].pid).health()["queries"] == before + 1


def test_tcp_serves_no_code(listed_peers) -> None:
    targets, addrs = listed_peers
    marker = f"/tmp/p7-marker-{os.getpid()}"
    expr = f"open('{marker}', 'w').write('ran')"
    body = json.dumps({"sql": f"SELECT * FROM python.`{expr}`", "format": "json"}).encode()
    status, payload = post(addrs[0], "/query", body, TOKEN)
    assert status == 400 and b"local unix socket only" in payload
    status, _ = post(addrs[0], "/eval", json.dumps({"code": expr}).encode(), TOKEN)
    assert status == 403
    # starting a trace is a control action a peer may take, but it writes no file here
    out = json.dumps({"families": ["gloo"], "output": marker}).encode()
    status, payload = post(addrs[0], "/trace/start", out, TOKEN)
    assert status == 403 and b"writes no file" in payload
    assert not os.path.exists(marker)


def test_a_stopped_peer_is_answered_for_and_a_killed_one_answers_dead(listed_peers) -> None:
    """A peer whose process is stopped (SIGSTOP) holds up nothing: the node's
    engine answers for it in time, from what it keeps, without its guest.
    Killed, its probe (kept by the engine) answers with what the process
    left, marked dead."""
    targets, _ = listed_peers
    victim = targets[3]
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        res = cluster_query(GROUP_BY_RANK, pid=targets[0].pid, timeout=2.0)
        assert time.monotonic() - t0 < 2.0 + 2.0
        assert res.table.column("rank").to_pylist() == [0, 1, 2, 3]
        assert res.missing == []
    finally:
        os.kill(victim.pid, signal.SIGKILL)
    alive = "SELECT rank, alive, died_ns IS NOT NULL AS dead FROM process.info ORDER BY rank"
    deadline = time.monotonic() + 30
    while True:
        rows = cluster_query(alive, pid=targets[0].pid, timeout=5.0).table.to_pylist()
        if len(rows) == 4 and rows[3]["dead"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(r["rank"], r["alive"], r["dead"]) for r in rows] == [
        (0, True, False), (1, True, False), (2, True, False), (3, False, True)
    ], rows  # fmt: skip


def test_a_peer_that_does_not_answer_is_named_and_strict_refuses(spawn) -> None:
    """A listed peer with nothing behind its address: named missing with the
    reason, the others answered; ``--strict`` refuses the partial answer."""
    addrs = [f"127.0.0.1:{p}" for p in free_ports(4)]
    env = {"PROBING_PEERS": ",".join(addrs), "PROBING_TOKEN": TOKEN}
    targets = [spawn(IDLE_LOOP, env={**env, "RANK": str(i)}) for i in range(3)]  # not rank 3
    for t in targets:
        wait_ready(t.pid)
    res = cluster_query(GROUP_BY_RANK, pid=targets[0].pid, timeout=2.0)
    assert res.table.column("rank").to_pylist() == [0, 1, 2]
    assert [(m.rank, m.reason) for m in res.missing] == [(3, "refused")]
    strict = cli("query", "-p", str(targets[0].pid), "--cluster", "--strict", "--timeout",
                 "2", GROUP_BY_RANK)  # fmt: skip
    assert strict.returncode == 1 and strict.stdout == ""
    assert "did not answer" in strict.stderr and "rank 3" in strict.stderr
    with pytest.raises(PeerUnreachable):
        cluster_query(GROUP_BY_RANK, pid=targets[0].pid, strict=True, timeout=2.0)


def test_torch_tcpstore_discovery(spawn) -> None:
    dist = pytest.importorskip("torch.distributed")
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master.port),
        "TORCHELASTIC_RUN_ID": f"p7-{os.getpid()}",
    }
    targets = [
        spawn(IDLE_LOOP, env={**env, "RANK": str(i), "LOCAL_RANK": str(i), "GROUP_RANK": "0"})
        for i in range(4)
    ]
    for t in targets:
        wait_ready(t.pid, timeout=60)  # each imports torch for the store client
    res = cluster_query(GROUP_BY_RANK, pid=targets[1].pid)
    health = ProbeClient.for_pid(targets[1].pid).health()
    assert res.table.column("rank").to_pylist() == [0, 1, 2, 3] and res.missing == [], health
    peers = ProbeClient.for_pid(targets[1].pid).peers()
    assert sorted(p["rank"] for p in peers) == [0, 1, 2, 3]
    assert {p["pid"] for p in peers} == {t.pid for t in targets}
    assert all(p["source"] == "torchrun" for p in peers)
    # the token came from the store: one for the whole job, and a TCP caller needs it
    token = bytes(master.get(f"probing/{env['TORCHELASTIC_RUN_ID']}/token")).decode()
    addr = next(p["addr"] for p in peers if p["rank"] == 2)
    assert cluster_query(GROUP_BY_RANK, addr=addr, token=token).table.num_rows == 4
    # the store goes away (the job's agent died): what was read last still serves
    del master
    gc.collect()
    t0 = time.monotonic()
    res = cluster_query(GROUP_BY_RANK, pid=targets[1].pid, timeout=2.0)
    assert res.table.column("rank").to_pylist() == [0, 1, 2, 3]
    assert time.monotonic() - t0 < 2.0 + 1.0
    assert "rendezvous store" in ProbeClient.for_pid(targets[1].pid).health()["cluster"]["error"]


def test_bad_cluster_settings_leave_the_host_and_local_probe_alone(spawn) -> None:
    bad = spawn(IDLE_LOOP, env={"PROBING_PEERS": "no-port-here", "PROBING_TOKEN": TOKEN})
    no_token = spawn(IDLE_LOOP, env={"PROBING_PEERS": "127.0.0.1:1", "PROBING_TOKEN": ""})
    for t in (bad, no_token):
        client = ProbeClient.for_pid(t.pid)
        assert client.query("SELECT pid FROM process.info").to_pylist() == [{"pid": t.pid}]
    r = cli("query", "-p", str(bad.pid), "--cluster", GROUP_BY_RANK)
    assert r.returncode == 1 and "not in cluster mode" in r.stderr
    deadline = time.monotonic() + 10
    while ProbeClient.for_pid(no_token.pid).health()["cluster"]["error"] is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for t, why in ((bad, "bad peer address"), (no_token, "PROBING_TOKEN")):
        t.proc.kill()
        _, err = t.proc.communicate(timeout=10)
        lines = [line for line in err.splitlines() if line.startswith("probing:")]
        assert len(lines) == 1 and "cluster mode off" in lines[0] and why in lines[0], err


STEPS = """
import os, time, probing, pyarrow as pa
cols = [("step", pa.int64()), ("rank", pa.int64()), ("ms", pa.float64())]
t = probing.ExternalTable("steps", cols)
me = int(os.environ["RANK"])
for s in range(10):
    t.append([s, 100 + me, 10.0 * (me + 1) + s])
t.flush()
while True:
    time.sleep(0.05)
"""


def test_user_tables_joins_and_an_own_rank_column(spawn) -> None:
    import pyarrow as pa

    addrs = [f"127.0.0.1:{p}" for p in free_ports(3)]
    env = {"PROBING_PEERS": ",".join(addrs), "PROBING_TOKEN": TOKEN}
    targets = [spawn(STEPS, env={**env, "RANK": str(i)}) for i in range(3)]
    for t in targets:
        wait_ready(t.pid)
        wait_rows(t.pid, "python.steps", 10)  # the probe answers before the script runs
    pid = targets[0].pid
    # the table's own `rank` is kept as table_rank; `rank` is the peer's
    res = cluster_query(
        "SELECT rank, min(table_rank) AS own, max(ms) AS slowest FROM python.steps "
        "GROUP BY rank ORDER BY slowest DESC",
        pid=pid,
    )
    assert res.plan["mode"] == "agg"
    assert res.table.to_pylist() == [
        {"rank": 2, "own": 102, "slowest": 39.0},
        {"rank": 1, "own": 101, "slowest": 29.0},
        {"rank": 0, "own": 100, "slowest": 19.0},
    ]
    # a join across ranks: which rank was slowest at each step (straggler per step)
    res = cluster_query(
        "SELECT s.step, s.rank FROM python.steps s JOIN "
        "(SELECT step, max(ms) AS ms FROM python.steps GROUP BY step) m "
        "ON s.step = m.step AND s.ms = m.ms WHERE s.step < 3 ORDER BY s.step",
        pid=pid,
    )
    assert res.plan["mode"] == "scan"
    assert res.table.to_pylist() == [{"step": k, "rank": 2} for k in range(3)]
    assert res.table.schema.field("rank").type == pa.int64()
    # GROUP BY node over three peers of one node: computed once, by the asker
    res = cluster_query("SELECT node, count(*) AS n FROM python.steps GROUP BY node", pid=pid)
    assert res.table.column("n").to_pylist() == [30]


def test_a_job_wide_table_keeps_the_rank_its_rows_are_about(spawn) -> None:
    """``analyze.*`` asked across the cluster: ``rank`` is the rank a row is
    about (a finding's, whichever probe keeps it), the probe that answered
    is ``probe_rank``; no ``table_rank``."""
    addrs = [f"127.0.0.1:{p}" for p in free_ports(3)]
    env = {"PROBING_PEERS": ",".join(addrs), "PROBING_TOKEN": TOKEN}
    targets = [spawn(IDLE_LOOP, env={**env, "RANK": str(i)}) for i in range(3)]
    for t in targets:
        wait_ready(t.pid)
    res = cluster_query("SELECT * FROM analyze.findings ORDER BY ts", pid=targets[0].pid)
    names = res.table.column_names
    assert "rank" in names and "probe_rank" in names and "table_rank" not in names, names
    assert [m.rank for m in res.missing] == [], res.missing
    res = cluster_query(
        "SELECT probe_rank, count(*) AS n FROM analyze.findings GROUP BY probe_rank",
        pid=targets[0].pid,
    )
    assert res.table.num_rows == 0 and res.plan["mode"] == "scan"
