"""Four peers as four hosts: one network namespace each, joined by a bridge.

Each peer has its own address (10.77.0.1-4) and reaches the others over
veth links; the link to one of them is slowed, and the cluster query's
per-peer response time must show it. ``tc netem`` adds the delay where the
kernel has it; kernels built without it (CONFIG_NET_SCH_NETEM off, as on
this project's VM) get a token bucket (``tbf``) on a small-MTU link instead:
every segment past the first waits for the bucket, in both directions.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from probing.cli.client import cluster_query
from tests.conftest import IDLE_LOOP, cli, require
from tests.test_cluster import TOKEN, wait_ready

pytestmark = pytest.mark.privileged

N = 4
SLOW = 2  # the rank whose link is slowed
DELAY_MS = 150
BRIDGE = "p7br"


def ns(i: int) -> str:
    return f"p7h{i}"


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def teardown_net() -> None:
    for i in range(N):
        subprocess.run(["ip", "netns", "del", ns(i)], capture_output=True)
        subprocess.run(["ip", "link", "del", f"p7b{i}"], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def slow_link() -> None:
    """Packets to and from the slow host wait at least DELAY_MS."""
    outside = ["tc", "qdisc", "add", "dev", f"p7b{SLOW}", "root"]
    try:
        sh(*outside, "netem", "delay", f"{DELAY_MS}ms")
        return
    except subprocess.CalledProcessError as err:
        if "unknown" not in err.stderr:
            raise
    inside = ["ip", "netns", "exec", ns(SLOW)]
    for prefix, dev in (([], f"p7b{SLOW}"), (inside, f"p7v{SLOW}")):
        # 4 KB/s and a 600-byte bucket: a 576-byte segment waits ~DELAY_MS for the next
        sh(*prefix, "ip", "link", "set", dev, "mtu", "576")
        tbf = ["tbf", "rate", "32kbit", "burst", "600", "latency", "5s"]
        sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", *tbf)


@pytest.fixture
def hosts():
    require(os.geteuid() == 0, "needs root (ip netns, veth, tc)")
    require(shutil.which("ip") is not None and shutil.which("tc") is not None, "needs ip and tc")
    teardown_net()  # what an interrupted run left
    try:
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "link", "set", BRIDGE, "up")
        for i in range(N):
            sh("ip", "netns", "add", ns(i))
            sh("ip", "link", "add", f"p7b{i}", "type", "veth", "peer", "name", f"p7v{i}")
            sh("ip", "link", "set", f"p7v{i}", "netns", ns(i))
            sh("ip", "link", "set", f"p7b{i}", "master", BRIDGE)
            sh("ip", "link", "set", f"p7b{i}", "up")
            inside = ["ip", "netns", "exec", ns(i), "ip"]
            sh(*inside, "addr", "add", f"10.77.0.{i + 1}/24", "dev", f"p7v{i}")
            sh(*inside, "link", "set", f"p7v{i}", "up")
            sh(*inside, "link", "set", "lo", "up")
        slow_link()
    except subprocess.CalledProcessError as err:
        teardown_net()
        require(False, f"cannot build the test network: {err.stderr.strip()}")
    yield [f"10.77.0.{i + 1}:7070" for i in range(N)]
    teardown_net()


def test_peers_on_separate_hosts_and_a_slow_link(hosts, spawn) -> None:
    env = {"PROBING_PEERS": ",".join(hosts), "PROBING_TOKEN": TOKEN}
    targets = []
    for i in range(N):
        argv = ["ip", "netns", "exec", ns(i), sys.executable, "-c", textwrap.dedent(IDLE_LOOP)]
        # `ip netns exec` execs: the pid is the Python process's
        t = spawn("", argv=argv, env={**env, "RANK": str(i), "PROBING_NODE": f"host{i}"})
        targets.append(t)
    for t in targets:
        wait_ready(t.pid)
    sql = "SELECT node, rank, count(*) AS n FROM process.threads GROUP BY node, rank ORDER BY rank"
    cluster_query(sql, pid=targets[0].pid, timeout=5.0)  # every peer loads its engine
    res = cluster_query(sql, pid=targets[0].pid, timeout=5.0)
    assert res.missing == []
    assert res.table.column("node").to_pylist() == [f"host{i}" for i in range(N)]
    ms = {p.rank: p.response_ms for p in res.peers}
    assert ms[SLOW] >= DELAY_MS, ms
    assert all(ms[SLOW] > ms[r] + DELAY_MS / 2 for r in (1, 3)), ms
    assert {p.rank: p.addr for p in res.peers}[SLOW] == hosts[SLOW]
    r = cli("query", "-p", str(targets[0].pid), "--cluster", sql)
    assert r.returncode == 0 and f"slowest rank {SLOW} (host{SLOW})" in r.stderr
    # a host that vanishes from the network: named, the rest still answer in time
    sh("ip", "netns", "exec", ns(3), "ip", "link", "set", "p7v3", "down")
    res = cluster_query(sql, pid=targets[0].pid, timeout=1.5)
    assert res.table.column("rank").to_pylist() == [0, 1, 2]
    assert [(m.rank, m.addr) for m in res.missing] == [(3, hosts[3])]
    assert res.missing[0].reason in ("timeout", "unreachable: [Errno 113] No route to host")


def test_one_command_traces_every_host(hosts, spawn) -> None:  # type: ignore[no-untyped-def]
    """``trace --cluster`` from host 0 starts and stops tracing on all four
    hosts over their peer ports (the slow one included); a host that left
    the network is named with its reason."""
    from tests.conftest import require_bpf

    require_bpf()
    env = {"PROBING_PEERS": ",".join(hosts), "PROBING_TOKEN": TOKEN}
    targets = []
    for i in range(N):
        argv = ["ip", "netns", "exec", ns(i), sys.executable, "-c", textwrap.dedent(IDLE_LOOP)]
        targets.append(
            spawn("", argv=argv, env={**env, "RANK": str(i), "PROBING_NODE": f"host{i}"})
        )
    for t in targets:
        wait_ready(t.pid)
    start = ["trace", "--pid", str(targets[0].pid), "--cluster", "--no-nccl", "--no-cuda"]
    r = cli(*start, "--background", "--timeout", "90", timeout=150)  # BPF built cold on each host
    assert r.returncode == 0 and r.stdout.startswith(f"{N} of {N} ranks tracing\n"), (
        r.stdout + r.stderr
    )
    assert all(addr in r.stdout for addr in hosts), r.stdout
    r = cli("trace", "--pid", str(targets[0].pid), "--cluster", "--stop", timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"{N} of {N} ranks stopped\n"), r.stdout
    # docs/cli.md's recipe for many nodes without cluster mode: one command per
    # host (pdsh, srun --overlap), each reaching the ranks of its own host
    for i, t in enumerate(targets):
        probing = [sys.executable, "-m", "probing", "trace", "--pid", str(t.pid), "--job"]
        on_host = ["ip", "netns", "exec", ns(i), *probing, "--background", "--no-nccl", "--no-cuda"]
        r = subprocess.run(on_host, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("1 of 1 ranks tracing\n"), r.stdout
    r = cli("trace", "--pid", str(targets[2].pid), "--cluster", "--stop", timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"{N} of {N} ranks stopped\n"), r.stdout
    sh("ip", "netns", "exec", ns(3), "ip", "link", "set", "p7v3", "down")
    r = cli(*start, "--background", "--timeout", "10", timeout=120)
    assert r.returncode == 2 and r.stdout.startswith(f"{N - 1} of {N} ranks tracing\n"), r.stdout
    [row] = [line for line in r.stdout.splitlines()[1:] if line.split()[:1] == ["3"]]
    assert hosts[3] in row and ("timeout" in row or "No route" in row), r.stdout


def test_peers_over_tls_and_a_host_without_the_certificate(hosts, spawn, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With the fleet's certificate (``PROBING_TLS_*``), the peer port speaks
    TLS across the hosts; a host without it is refused both ways."""
    from tests.test_tls import make_certs

    fleet = make_certs(tmp_path)
    env = {"PROBING_PEERS": ",".join(hosts), "PROBING_TOKEN": TOKEN}
    targets = []
    for i in range(N):
        argv = ["ip", "netns", "exec", ns(i), sys.executable, "-c", textwrap.dedent(IDLE_LOOP)]
        secure = fleet if i != N - 1 else {}  # the last host has no certificate
        t = spawn("", argv=argv, env={**env, **secure, "RANK": str(i), "PROBING_NODE": f"host{i}"})
        targets.append(t)
    for t in targets:
        wait_ready(t.pid)
    sql = "SELECT node, rank, count(*) AS n FROM process.threads GROUP BY node, rank ORDER BY rank"
    res = cluster_query(sql, pid=targets[0].pid, timeout=5.0)
    assert res.table.column("node").to_pylist() == [f"host{i}" for i in range(N - 1)]
    assert [m.rank for m in res.missing] == [N - 1], res.missing
    res = cluster_query(sql, pid=targets[-1].pid, timeout=5.0)  # it asks: nobody answers it
    assert res.table.column("rank").to_pylist() == [N - 1]
    assert sorted(m.rank for m in res.missing) == list(range(N - 1)), res.missing
