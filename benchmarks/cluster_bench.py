"""Cluster query latency for 4, 64 and 256 peers on loopback; prints JSON.

Peers are simulated: several worker processes each host many peers, every
peer with its own engine, store (100k rows in ``bench.events``), TCP port
and identity (8 ranks per simulated node). The asker is rank 0; the clock
runs from the client's request to the merged answer, as a user sees it.

Side by side, in one run:
  fanout   GROUP BY rank over a one-row table: the cost of asking alone
  pushed   GROUP BY rank: each peer aggregates, the asker concatenates
  rows     the same question as GROUP BY 1 (not recognised): each peer
           ships its rows' projected column and the asker aggregates
  flat / tree   the asker talks to every peer / to each node's first rank,
           which gathers its node

    python benchmarks/cluster_bench.py [--sizes 4,64,256] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ROWS = 100_000
RANKS_PER_NODE = 8
TOKEN = "bench-token"
PUSHED = "SELECT rank, count(*) AS n, avg(dur_ns) AS avg_dur FROM bench.events GROUP BY rank"
ROWS_SHIPPED = "SELECT rank, count(*) AS n, avg(dur_ns) AS avg_dur FROM bench.events GROUP BY 1"
FANOUT_ONLY = "SELECT rank, count(*) AS n FROM bench.one GROUP BY rank"  # one row per peer


class PeerHost:
    """What the probe's HTTP app needs of a probe: an engine and a cluster node."""

    def __init__(self, engine, cluster) -> None:  # type: ignore[no-untyped-def]
        self.engine = engine
        self.cluster = cluster
        self.queries = 0

    def note_query(self) -> None:
        self.queries += 1

    def describe(self) -> dict:
        return {"rank": self.cluster.rank, "queries": self.queries}


def worker(ranks: list[int], world: int) -> None:
    """Host ``ranks``: print their addresses, read everyone's, serve until EOF."""
    import numpy as np

    from probing.node.cluster.discovery import PeerInfo
    from probing.node.cluster.identity import Identity
    from probing.node.cluster.node import ClusterNode
    from probing.node.probe.api import make_app
    from probing.node.probe.server import UnixHTTPServer
    from probing.node.sql import Engine
    from probing.node.store import Store

    servers, nodes = [], []
    for rank in ranks:
        store = Store(chunk_rows=1 << 16)
        rng = np.random.default_rng(rank)
        store.table("bench", "events").append_batch(
            {
                "ts": np.arange(ROWS, dtype=np.int64) * 1000,
                "dur_ns": rng.integers(1000, 100_000, ROWS, dtype=np.int64),
            }
        )
        store.table("bench", "one").append_batch({"x": np.zeros(1, dtype=np.int64)})
        eng = Engine(store)
        ident = Identity(
            rank=rank,
            world_size=world,
            local_rank=rank % RANKS_PER_NODE,
            node=f"n{rank // RANKS_PER_NODE}",
            group_rank=rank // RANKS_PER_NODE,
            master=None,
            run_id="bench",
            peers=(),
            port=0,  # any free port on 127.0.0.1: the parent collects them
        )
        node = ClusterNode(ident, lambda eng=eng: eng, token=TOKEN.encode())
        server = UnixHTTPServer(None, make_app(PeerHost(eng, node)))
        server.start()
        node.setup(server)
        servers.append(server)
        nodes.append(node)
    print(" ".join(f"{n.rank}={n.addr}" for n in nodes), flush=True)
    everyone = json.loads(sys.stdin.readline())  # rank -> addr, for whoever asks
    for node in nodes:
        for rank, addr in everyone.items():
            if int(rank) != node.rank:
                node.registry.upsert(PeerInfo(int(rank), f"n{int(rank) // RANKS_PER_NODE}", addr))
    sys.stdin.read()  # until the parent closes our stdin
    for s in servers:
        s.stop()


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def cpu_s(pids: list[int]) -> list[float]:
    import psutil

    out = []
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        out.append(t.user + t.system)
    return out


def timed(sql: str, addr: str, fanout: str, runs: int, pids: list[int]) -> dict:
    """Median wall time of ``runs`` queries, and CPU per query: all processes,
    the asker's process (rank 0 and the peers it hosts), the others' mean."""
    from probing.cli.client import cluster_query

    times, rows, missing = [], 0, 0
    cpu0 = cpu_s(pids)
    for _ in range(runs):
        t0 = time.perf_counter()
        res = cluster_query(sql, addr=addr, token=TOKEN, timeout=20.0, fanout=fanout)
        times.append((time.perf_counter() - t0) * 1e3)
        rows, missing = res.table.num_rows, len(res.missing)
    used = [(b - a) / runs * 1e3 for a, b in zip(cpu0, cpu_s(pids), strict=True)]
    return {
        "median_ms": round(statistics.median(times), 1),
        "min_ms": round(min(times), 1),
        "rows": rows,
        "missing": missing,
        "mode": res.plan.get("mode"),
        "cpu_ms_per_query": round(sum(used), 1),
        "asker_process_cpu_ms": round(used[0], 1),
        "other_process_cpu_ms": round(statistics.mean(used[1:]), 1) if len(used) > 1 else 0.0,
    }


def measure(n: int, runs: int, workers: int) -> dict:
    w = min(workers, n)  # contiguous ranks: a process hosts whole simulated nodes
    groups = [list(range(i * n // w, (i + 1) * n // w)) for i in range(w)]
    procs = []
    try:
        for ranks in groups:
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", ",".join(map(str, ranks)), str(n)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        addrs: dict[int, str] = {}
        for p in procs:
            assert p.stdout is not None and p.stdin is not None
            for item in p.stdout.readline().split():
                rank, addr = item.split("=")
                addrs[int(rank)] = addr
        assert len(addrs) == n, f"{n - len(addrs)} peers did not start"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(json.dumps(addrs) + "\n")
            p.stdin.flush()
        asker = addrs[0]
        pids = [p.pid for p in procs]
        timed(PUSHED, asker, "flat", 2, pids)  # warm-up: engines load
        out: dict = {"peers": n, "rows_per_peer": ROWS, "processes": len(procs)}
        out["fanout_flat"] = timed(FANOUT_ONLY, asker, "flat", runs, pids)
        out["fanout_tree"] = timed(FANOUT_ONLY, asker, "tree", runs, pids)
        out["pushed_flat"] = timed(PUSHED, asker, "flat", runs, pids)
        out["pushed_tree"] = timed(PUSHED, asker, "tree", runs, pids)
        if n <= 64:  # 256 x 100k rows shipped is what pushing down avoids
            out["rows_flat"] = timed(ROWS_SHIPPED, asker, "flat", max(1, runs // 2), pids)
            out["rows_tree"] = timed(ROWS_SHIPPED, asker, "tree", max(1, runs // 2), pids)
        return out
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


IDLE = "import time; time.sleep(60)"
THREADS_BY_RANK = "SELECT rank, count(*) FROM process.threads GROUP BY rank"


def real_probes(runs: int) -> dict:
    """4 real probes (PROBING=1 processes, PROBING_PEERS): the CLI end to end
    (a fresh `probing` process each time) and the API call from a warm client."""
    from probing import paths
    from probing.cli.client import cluster_query

    peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(4))
    env = dict(os.environ, PROBING="1", PROBING_TOKEN=TOKEN, PROBING_PEERS=peers)
    procs = [
        subprocess.Popen([sys.executable, "-c", IDLE], env=dict(env, RANK=str(i))) for i in range(4)
    ]
    try:
        for p in procs:
            while not os.path.exists(paths.socket_path(p.pid)):
                time.sleep(0.05)
        pid = procs[0].pid
        cluster_query(THREADS_BY_RANK, pid=pid, timeout=20)  # engines load
        cli, api = [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "probing",
                    "query",
                    "-p",
                    str(pid),
                    "--cluster",
                    THREADS_BY_RANK,
                    "-f",
                    "json",
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            cli.append((time.perf_counter() - t0) * 1e3)
            assert len(json.loads(out.stdout)) == 4
            t0 = time.perf_counter()
            assert cluster_query(THREADS_BY_RANK, pid=pid).table.num_rows == 4
            api.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "probing", "--help"], capture_output=True)
        return {
            "peers": 4,
            "cli_median_ms": round(statistics.median(cli), 1),
            "cli_startup_only_ms": round((time.perf_counter() - t0) * 1e3, 1),
            "api_median_ms": round(statistics.median(api), 1),
        }
    finally:
        for p in procs:
            p.kill()
            p.wait()


def idle_cost(seconds: float = 5.0) -> dict:
    """CPU and threads of an idle probe, without and with cluster mode (4 peers listed)."""
    import psutil

    from probing import paths

    peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(4))
    out = {}
    for label, extra in (("local_only", {}), ("cluster", {"PROBING_PEERS": peers})):
        env = dict(os.environ, PROBING="1", PROBING_TOKEN=TOKEN, **extra)
        proc = subprocess.Popen([sys.executable, "-c", IDLE], env=env)
        try:
            deadline = time.monotonic() + 20
            while not os.path.exists(paths.socket_path(proc.pid)) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)  # start-up done (cluster: bound and listed)
            p = psutil.Process(proc.pid)
            c0 = sum(p.cpu_times()[:2])
            time.sleep(seconds)
            c1 = sum(p.cpu_times()[:2])
            out[label] = {
                "cpu_ms_per_s": round((c1 - c0) / seconds * 1e3, 3),
                "threads": p.num_threads(),
                "rss_mb": round(p.memory_info().rss / 2**20, 1),
            }
        finally:
            proc.kill()
            proc.wait()
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker([int(r) for r in sys.argv[2].split(",")], int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,64,256")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=8, help="processes hosting the peers")
    args = ap.parse_args()
    sizes = [int(n) for n in args.sizes.split(",") if n.strip()]
    out: dict = {"benchmark": "cluster_query", "cpus": os.cpu_count()}
    out["load_avg_1m"] = round(os.getloadavg()[0], 1)
    out["idle_probe"] = idle_cost()
    out["real_probes_cli"] = real_probes(args.runs)
    out["results"] = [measure(n, args.runs, args.workers) for n in sizes]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
