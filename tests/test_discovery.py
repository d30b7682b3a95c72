"""Discovery without torch, and a probe that comes before the job's store (issue 20)."""

from __future__ import annotations

import datetime
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from probing.cli.demo import free_port
from probing.node.cluster.discovery import StoreDirectory
from probing.node.cluster.identity import Identity
from probing.node.cluster.node import ClusterNode
from probing.node.cluster.tcpstore import StoreError, TCPStoreClient
from probing.node.probe import switch
from probing.node.probe.server import UnixHTTPServer

dist = pytest.importorskip("torch.distributed")


def _master(port: int, libuv: bool = True):  # type: ignore[no-untyped-def]
    return dist.TCPStore(
        "127.0.0.1",
        port,
        1,
        True,
        timeout=datetime.timedelta(seconds=10),
        wait_for_workers=False,
        use_libuv=libuv,
    )


@pytest.mark.parametrize("libuv", [True, False], ids=["libuv", "legacy"])
def test_client_speaks_both_torch_servers(libuv: bool) -> None:
    master = _master(0, libuv)
    with TCPStoreClient("127.0.0.1", master.port) as c:
        assert not c.check("probing/r/peers")
        assert c.compare_set("probing/r/token", b"", b"first") == b"first"
        assert c.compare_set("probing/r/token", b"", b"second") == b"first"  # first one wins
        c.append("probing/r/peers", b"a\n")
        c.append("probing/r/peers", b"b\n")
        assert c.check("probing/r/peers")
        assert c.get("probing/r/peers") == b"a\nb\n"
        c.set("probing/r/x", b"1")
        # the same keys torch's own client reads and writes
        assert master.get("probing/r/peers") == b"a\nb\n"
        master.set("probing/r/y", b"from torch")
        assert c.get("probing/r/y") == b"from torch"


def test_client_errors_are_oserrors() -> None:
    with pytest.raises(StoreError, match="no rendezvous store answers"):
        TCPStoreClient("127.0.0.1", free_port(), timeout=0.5)
    # something that accepts and closes: not a store
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    threading.Thread(target=lambda: srv.accept()[0].close(), daemon=True).start()
    with pytest.raises(OSError):
        with TCPStoreClient("127.0.0.1", port, timeout=2) as c:
            c.check("k")
    srv.close()


def _ident(rank: int, port: int) -> Identity:
    return Identity(
        rank=rank,
        world_size=2,
        local_rank=rank,
        node="n",
        group_rank=0,
        master=("127.0.0.1", port),
        run_id="late",
        peers=(),
        port=0,
    )


def test_probes_before_the_store_join_when_it_appears(tmp_path: Path) -> None:
    """The srun/mpirun way: rank 0's init_process_group hosts the store,
    seconds after every probe started. Nobody gives up; both join."""
    port = free_port()
    servers = [UnixHTTPServer(str(tmp_path / f"{r}.sock"), lambda req: None) for r in (0, 1)]
    nodes = [ClusterNode(_ident(r, port), lambda: None) for r in (0, 1)]
    for srv, node in zip(servers, nodes, strict=True):
        srv.start()
        node.start(srv)
    try:
        for node in nodes:
            assert node.ready.wait(10)
            assert not node.published and "rendezvous store" in (node.error or "")
        time.sleep(0.3)  # the probes keep trying meanwhile
        master = _master(port)
        t0 = time.monotonic()
        deadline = t0 + 10
        while not all(n.published for n in nodes) and time.monotonic() < deadline:
            time.sleep(0.02)
        joined_s = time.monotonic() - t0
        assert all(n.published for n in nodes), [n.error for n in nodes]
        assert joined_s < 5, joined_s  # the backoff is capped at 0.5 s
        assert nodes[0].token == nodes[1].token  # one token for the job
        nodes[0].refresh()
        assert {p.rank for p in nodes[0].registry.peers()} == {0, 1}
        got = StoreDirectory(_ident(0, port)).read()
        assert sorted(p.rank for p in got) == [0, 1]
        del master
    finally:
        for srv in servers:
            srv.stop()


def test_a_query_joins_at_once_when_the_store_is_there(tmp_path: Path) -> None:
    """A cluster query does not wait for the background's next try."""
    port = free_port()
    srv = UnixHTTPServer(str(tmp_path / "q.sock"), lambda req: None)
    srv.start()
    node = ClusterNode(_ident(1, port), lambda: None)
    node._server = srv
    try:
        assert not node.try_join(0.5)
        master = _master(port)
        node.refresh(budget=2.0)
        assert node.published and node.addr
        assert [p.rank for p in StoreDirectory(_ident(0, port)).read()] == [1]
        del master
    finally:
        srv.stop()


def test_overlapping_holds_on_the_switch_interval_give_the_process_its_own_back() -> None:
    """Servers (one per served process) hold a short GIL switch interval,
    overlapping in any order: the shortest held is in force, the process's
    own comes back with the last, exactly (the interpreter truncates to
    whole microseconds), and an interval set meanwhile is the one that
    comes back."""
    old = sys.getswitchinterval()
    reg = switch.SwitchInterval()
    try:
        sys.setswitchinterval(0.007)
        reg.take(0.00005)
        reg.take(0.0005)  # another server's loop
        reg.give(0.00005)  # the first is done first
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        with reg.hold(0.00005):
            assert sys.getswitchinterval() == pytest.approx(0.00005)
        reg.give(0.0005)
        assert round(sys.getswitchinterval() * 1e6) == 7000
        for _ in range(100):  # no microsecond lost per round
            with reg.hold(0.0005):
                pass
        assert round(sys.getswitchinterval() * 1e6) == 7000
        with reg.hold(0.00005):
            sys.setswitchinterval(0.02)  # set by someone else, while ours is held
            with reg.hold(0.0005):
                assert sys.getswitchinterval() == pytest.approx(0.00005)  # the shortest
        assert sys.getswitchinterval() == pytest.approx(0.02)
    finally:
        sys.setswitchinterval(old)


def test_a_restarted_rank_is_found_by_the_others(tmp_path: Path) -> None:
    """torchrun restarts a failed worker: a new process, the same rank and
    run id, a new address. The next cluster query's refresh finds it."""
    master = _master(free_port())
    port = master.port
    servers, nodes = [], []
    try:
        for name, rank in (("r0", 0), ("r1-old", 1), ("r1-new", 1)):
            srv = UnixHTTPServer(str(tmp_path / f"{name}.sock"), lambda req: None)
            srv.start()
            servers.append(srv)
            node = ClusterNode(_ident(rank, port), lambda: None)
            node.setup(srv)
            nodes.append(node)
            if name == "r1-old":
                nodes[0].refresh()
                assert {p.rank: p.addr for p in nodes[0].registry.peers()}[1] == node.addr
                srv.stop()  # the worker dies
        nodes[0].refresh()
        assert {p.rank: p.addr for p in nodes[0].registry.peers()}[1] == nodes[2].addr
        assert nodes[1].addr != nodes[2].addr
    finally:
        for srv in servers:
            srv.stop()


IDLE_RANK = """
import time
print("up", flush=True)
time.sleep(600)
"""


def test_an_idle_probe_uses_no_cpu_once_joined(spawn) -> None:  # type: ignore[no-untyped-def]
    """After discovery settles nothing of the probe runs; while the store is
    not there yet, the retries cost little. Both measured and printed."""
    import psutil

    from tests.test_cluster import wait_ready

    port = free_port()
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    t = spawn(IDLE_RANK, env=env)
    assert t.proc.stdout.readline().strip() == "up"
    proc = psutil.Process(t.pid)

    def cpu_s(seconds: float) -> float:
        before = sum(proc.cpu_times()[:2])
        time.sleep(seconds)
        return sum(proc.cpu_times()[:2]) - before

    waiting = cpu_s(2.0)  # retrying every 0.5 s: no store yet
    master = _master(port)
    wait_ready(t.pid, 10)  # joined: bound and published
    joined = cpu_s(3.0)
    wait_ms, joined_ms = waiting / 2 * 1e3, joined / 3 * 1e3
    print(f"idle probe CPU: {wait_ms:.2f} ms/s waiting, {joined_ms:.2f} ms/s joined")
    assert waiting < 0.2  # generous: 10 % of a core would be a regression
    assert joined < 0.05
    del master
