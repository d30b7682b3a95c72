"""Where an export (or the web UI) reads its rows: ``probing.cli.client.JobClient``, plus
the clock offsets the cluster query measures.

``Source.ask(sql)`` runs ``sql`` in every rank and returns one Arrow table
whose rows are tagged ``node`` and ``rank``, as ``JobClient`` does, the three ways
the CLI takes them:

* ``pids=[P]``: that one probe; ``pids=[P, Q, ...]``: each local probe;
* ``cluster=True`` with one pid, or ``addr``: the cluster query (any probe
  fans out to its peers), which also measures each peer's clock offset:
  ``offsets`` holds, per node, the median offset of its ranks (the peer's
  clock minus the asker's), which ``align`` subtracts so rows from different
  nodes line up; ``missing`` the ranks that did not answer.

Differences from ``JobClient``, on purpose: a local rank's rows keep their own
``node``/``rank`` columns as ``table_node``/``table_rank`` (what a cluster
query calls them, so a Parquet file reads the same however it was asked),
and ``client(pid)`` is the one place a local probe is reached.
"""

from __future__ import annotations

import socket
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from probing.cli.client import JobClient, ProbeClient, cluster_query
from probing.errors import ProbingError

RANKS_SQL = "SELECT pid, hostname{tags} FROM process.info"


@dataclass
class RankInfo:
    rank: int
    node: str
    pid: int


class Source(JobClient):
    def __init__(
        self,
        *,
        pids: list[int] | tuple[int, ...] = (),
        addr: str | None = None,
        cluster: bool = False,
        timeout: float = 10.0,
    ) -> None:
        super().__init__(pids=list(pids), addr=addr, cluster=cluster, timeout=timeout)
        if bool(self.pids) == bool(self.addr):
            raise ProbingError(
                "give exactly one of --pid or --addr",
                hint="e.g. --pid 1234 --cluster, or --addr 10.0.0.2:7070",
            )
        if self.cluster and len(self.pids) > 1:
            raise ProbingError(
                "--cluster asks the job through one probe: give a single --pid",
                hint="or leave out --cluster to ask each --pid's probe",
            )
        self.offsets: dict[str, int] = {}  # node -> ns to subtract
        self.missing: list[str] = []  # ranks the last cluster query did not reach
        self._lock = threading.Lock()

    def describe(self) -> str:
        if self.addr:
            return f"the job through {self.addr}"
        if self.cluster:
            return f"the job through pid {self.pids[0]}"
        return "pid " + ", ".join(str(p) for p in self.pids)

    def ask(self, sql: str) -> pa.Table:
        """``sql`` in every rank; one table tagged ``node`` and ``rank``. In
        ``sql``, ``{tags}`` stands for the tag columns a cluster query must
        select by name (``, node, rank``; nothing for local probes, whose rows
        are tagged here; ``SELECT *`` has them either way)."""
        return self.measured(sql)[0]

    def measured(self, sql: str) -> tuple[pa.Table, dict[str, int]]:
        """``ask``, and the clock offsets this very query measured: a cluster
        query measures them anew (``offsets`` then holds the last measured);
        local probes share this host's clock (``offsets`` as set)."""
        sql = sql.replace("{tags}", ", node, rank" if self.remote else "")
        if self.remote:
            return self._cluster(sql)
        return self._local(sql), dict(self.offsets)

    def _cluster(self, sql: str) -> tuple[pa.Table, dict[str, int]]:
        if self.addr:
            res = cluster_query(sql, addr=self.addr, timeout=self.timeout)
        else:
            res = cluster_query(sql, pid=self.pids[0], timeout=self.timeout)
        by_node: dict[str, list[int]] = {}
        for t in res.peers:
            by_node.setdefault(t.node, []).append(t.clock_offset_ns)
        with self._lock:
            if by_node:
                self.offsets = {n: int(statistics.median(v)) for n, v in by_node.items()}
            self.missing = [f"rank {m.rank} ({m.node or m.addr}): {m.reason}" for m in res.missing]
            return res.table, dict(self.offsets)

    def client(self, pid: int) -> Any:
        """The client of a local probe (anything with ``query(sql) -> pa.Table``)."""
        return ProbeClient.for_pid(pid, timeout=max(self.timeout, 1.0))

    def _local(self, sql: str) -> pa.Table:
        from probing.analyze.gather import process_rank

        node = socket.gethostname()

        def one(i: int) -> pa.Table:  # the ranks answer in parallel
            client = self.client(self.pids[i])
            rank = process_rank(client, self.pids[i])
            return tag(client.query(sql), node, rank if rank >= 0 else i)

        with ThreadPoolExecutor(max_workers=min(16, len(self.pids))) as pool:
            parts = list(pool.map(one, range(len(self.pids))))
        return pa.concat_tables(parts, promote_options="default")

    def ranks(self) -> list[RankInfo]:
        """Every rank that answers: its node and process id."""
        rows = self.ask(RANKS_SQL).to_pylist()
        seen = {r["rank"]: RankInfo(r["rank"], r["node"], r["pid"]) for r in rows}
        return [seen[r] for r in sorted(seen)]

    def align(
        self, table: pa.Table, column: str = "ts", offsets: dict[str, int] | None = None
    ) -> pa.Table:
        """``table`` with ``column`` moved onto the asker's clock: by the per-node
        ``offsets`` its query measured (``measured``), else the last measured."""
        offsets = self.offsets if offsets is None else offsets
        if not any(offsets.values()) or column not in table.column_names:
            return table
        if not table.num_rows:
            return table
        shift = [offsets.get(n, 0) for n in table.column("node").to_pylist()]
        moved = pc.subtract(table.column(column), pa.array(shift, pa.int64()))
        i = table.column_names.index(column)
        return table.set_column(i, column, moved.cast(table.schema.field(column).type))


def tag(table: pa.Table, node: str, rank: int) -> pa.Table:
    """Rows of one rank as a cluster query tags them (own node/rank renamed)."""
    names = [f"table_{n}" if n in ("node", "rank") else n for n in table.column_names]
    table = table.rename_columns(names)
    n = table.num_rows
    table = table.append_column("node", pa.array([node] * n, pa.string()))
    return table.append_column("rank", pa.array([rank] * n, pa.int64()))
