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

Per node (``--per-node``), as the node's engine serves its ranks: each
simulated node is one engine port (``probing.node.cluster.port``) serving
its 8 ranks, each with its own engine and store (``NODE_ROWS`` rows, sealed
in a chunk file: 4,096 stores of 100k rows would not fit here). A query fans out node to node
(``auto``): each node answers for its 8 ranks in one reply, its ranks'
shares run in-process. Side by side with the per-rank fan-out of before
(every rank its own port) at the same number of ranks. First, ``one_node``:
one node's engine answering a gather for its 8 ranks, alone in this
process, CPU per answer (the simulation puts 64 nodes in a process, whose
answers contend for its GIL: what a real node spends is this figure).

    python benchmarks/cluster_bench.py [--sizes 4,64,256] [--runs 5]
    python benchmarks/cluster_bench.py --per-node --sizes 1024,4096 --runs 5
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
NODE_ROWS = 1_000  # per rank, --per-node
RANKS_PER_NODE = 8
FAKE_PID = 1 << 22  # + rank: the simulated ranks' pids (the port routes by pid)
TOKEN = "bench-token"
PUSHED = "SELECT rank, count(*) AS n, avg(dur_ns) AS avg_dur FROM bench.events GROUP BY rank"
ROWS_SHIPPED = "SELECT rank, count(*) AS n, avg(dur_ns) AS avg_dur FROM bench.events GROUP BY 1"
FANOUT_ONLY = "SELECT rank, count(*) AS n FROM bench.one GROUP BY rank"  # one row per peer


class PeerHost:
    """What the probe's HTTP app needs of a probe: a database and a cluster node."""

    def __init__(self, database, cluster) -> None:  # type: ignore[no-untyped-def]
        self.database = database
        self.cluster = cluster
        self.queries = 0

    def note_query(self) -> None:
        self.queries += 1

    def describe(self) -> dict:
        return {"rank": self.cluster.rank, "queries": self.queries}


def bench_rank(rank: int, world: int, per_node: bool, ports: dict, servers: list):  # type: ignore[no-untyped-def]
    """One simulated rank: its store, engine and cluster node, served on its
    own port, or (``per_node``) on its node's port in ``ports``."""
    import types

    import numpy as np

    from probing.node.cluster.identity import Identity
    from probing.node.cluster.node import ClusterNode
    from probing.node.cluster.port import NodePort
    from probing.node.probe.api import make_app
    from probing.node.probe.server import UnixHTTPServer
    from probing.node.sql import Database
    from probing.node.store import Store

    rows = NODE_ROWS if per_node else ROWS
    store = Store(chunk_rows=1 << 16)
    rng = np.random.default_rng(rank)
    store.table("bench", "events").append_batch(
        {
            "ts": np.arange(rows, dtype=np.int64) * 1000,
            "dur_ns": rng.integers(1000, 100_000, rows, dtype=np.int64),
        }
    )
    store.table("bench", "one").append_batch({"x": np.zeros(1, dtype=np.int64)})
    if per_node:  # sealed now, as a traced process's rows are 2 s on: not at the first query
        for name in ("events", "one"):
            store.table("bench", name).flush()
    eng = Database(store)
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
    node = ClusterNode(ident, lambda eng=eng: eng, token=TOKEN.encode(), pid=FAKE_PID + rank)
    app = make_app(PeerHost(eng, node))
    node.register(app.routes)  # its /cluster/* routes
    if per_node:  # the node's one port: its server answers every rank of the node
        port = ports.get(ident.group_rank or 0)
        if port is None:
            port = ports[ident.group_rank or 0] = NodePort(first=0)
            port.server = UnixHTTPServer(None, port.route)
            port.server.start()
            servers.append(port.server)
        node.port = port
        node.setup(types.SimpleNamespace(app=app))
    else:
        server = UnixHTTPServer(None, app)
        server.start()
        node.setup(server)
        servers.append(server)
    return node


def one_node(runs: int) -> dict:
    """One node's engine answering a gather for its 8 ranks (their rows
    sealed), in this process, no other node beside it: the CPU of each
    answer, as a real node spends it."""
    from probing.node.cluster import coordinator
    from probing.node.cluster import plan as planner
    from probing.node.cluster.discovery import PeerInfo

    servers: list = []
    port: dict = {}  # the node's one port
    nodes = [bench_rank(r, 2 * RANKS_PER_NODE, True, port, servers) for r in range(8, 16)]
    try:
        for node in nodes:
            for o in nodes:
                if o is not node:
                    node.registry.upsert(PeerInfo(o.rank, o.ident.node, o.addr, o.pid))
        out = {}
        for name, sql, table in (("fanout", FANOUT_ONLY, "bench.one"),
                                 ("pushed", PUSHED, "bench.events")):  # fmt: skip
            eng = nodes[0].database()
            schema = eng.sql(f"SELECT * FROM {table} LIMIT 0", allow_code=False).schema
            known = set(eng.catalog.schema_names())
            work = planner.plan(sql, {table: planner.tagged_schema(schema)}, known).work()
            payload = {"work": work.to_json(), "members": [{"rank": n.rank} for n in nodes[1:]]}
            for _ in range(20):  # warm-up
                coordinator.answer_gather(nodes[0], payload, time.time_ns())
            cpu0, t0 = time.process_time(), time.perf_counter()
            for _ in range(runs):
                coordinator.answer_gather(nodes[0], payload, time.time_ns())
            out[name] = {"cpu_ms_per_answer": round((time.process_time() - cpu0) / runs * 1e3, 2),
                         "wall_ms": round((time.perf_counter() - t0) / runs * 1e3, 2)}  # fmt: skip
        return out
    finally:
        for s in servers:
            s.stop()


def worker(ranks: list[int], world: int, per_node: bool = False) -> None:
    """Host ``ranks``: print their addresses, read everyone's, serve until EOF.
    ``per_node``: each node's ranks behind one port, as an engine serves them."""
    from probing.node.cluster.discovery import PeerInfo

    servers: list = []
    ports: dict = {}  # per_node: node -> its engine's port
    nodes = [bench_rank(rank, world, per_node, ports, servers) for rank in ranks]
    print(" ".join(f"{n.rank}={n.addr}" for n in nodes), flush=True)
    everyone = json.loads(sys.stdin.readline())  # rank -> addr, for whoever asks
    for node in nodes:
        for rank, addr in everyone.items():
            where = f"n{int(rank) // RANKS_PER_NODE}"
            if int(rank) == node.rank:
                continue
            # per node, only the asker needs everyone: a gatherer is asked for
            # its own node's ranks (here a process hosts many nodes, whose
            # registries of every rank would take more memory and collection
            # than a node's engine ever holds)
            if per_node and node.rank != 0 and where != node.ident.node:
                continue
            node.registry.upsert(PeerInfo(int(rank), where, addr, FAKE_PID + int(rank)))
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


def measure(n: int, runs: int, workers: int, per_node: bool = False) -> dict:
    w = min(workers, n // RANKS_PER_NODE or 1)  # a process hosts whole simulated nodes
    nodes = -(-n // RANKS_PER_NODE)
    groups = [
        list(range(i * nodes // w * RANKS_PER_NODE, min(n, (i + 1) * nodes // w * RANKS_PER_NODE)))
        for i in range(w)
    ]
    if per_node and w > 1 and nodes > w:  # the asker's node alone: its CPU is its own
        groups = [list(range(RANKS_PER_NODE))] + [
            [r for r in range(RANKS_PER_NODE, n) if (r // RANKS_PER_NODE - 1) % (w - 1) == i]
            for i in range(w - 1)
        ]
    mode = ["--per-node"] if per_node else []
    procs = []
    try:
        for ranks in groups:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        ",".join(map(str, ranks)),
                        str(n),
                        *mode,
                    ],
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
        if per_node:
            return per_node_figures(n, asker, runs, pids, len(procs))
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


def per_node_figures(n: int, asker: str, runs: int, pids: list[int], procs: int) -> dict:
    """Node-to-node (``auto``: one request per other node) and, for
    comparison in the same processes, one request per rank (``flat``). The
    asker's process hosts its node alone: ``asker_process_cpu_ms`` is the
    asking node's (its 8 shares, the requests, the merge)."""
    nodes = -(-n // RANKS_PER_NODE)
    timed(FANOUT_ONLY, asker, "auto", 2, pids)  # warm-up: engines load
    out: dict = {"ranks": n, "nodes": nodes, "rows_per_rank": NODE_ROWS, "processes": procs}
    for name, sql in (("fanout", FANOUT_ONLY), ("pushed", PUSHED)):
        got = timed(sql, asker, "auto", runs, pids)
        got["cpu_ms_per_node"] = round(got["cpu_ms_per_query"] / nodes, 3)
        got["asker_cpu_ms_per_node"] = round(got["asker_process_cpu_ms"] / nodes, 3)
        out[f"{name}_per_node"] = got
    got = timed(FANOUT_ONLY, asker, "flat", max(1, runs // 2), pids)
    got["cpu_ms_per_node"] = round(got["cpu_ms_per_query"] / nodes, 3)
    out["fanout_per_rank_same_port"] = got
    return out


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
        worker([int(r) for r in sys.argv[2].split(",")], int(sys.argv[3]), "--per-node" in sys.argv)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,64,256")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=8, help="processes hosting the peers")
    ap.add_argument("--per-node", action="store_true", help="an engine port per node, vs per rank")
    args = ap.parse_args()
    sizes = [int(n) for n in args.sizes.split(",") if n.strip()]
    out: dict = {"benchmark": "cluster_query", "cpus": os.cpu_count()}
    out["load_avg_1m"] = round(os.getloadavg()[0], 1)
    if args.per_node:
        out["one_node"] = one_node(200)
        out["per_node"] = [measure(n, args.runs, args.workers, per_node=True) for n in sizes]
        out["per_rank"] = [measure(n, args.runs, args.workers) for n in sizes if n <= 1024]
        print(json.dumps(out))
        return
    out["idle_probe"] = idle_cost()
    out["real_probes_cli"] = real_probes(args.runs)
    out["results"] = [measure(n, args.runs, args.workers) for n in sizes]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
