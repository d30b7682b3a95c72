"""Where an export (or the web UI) reads its rows: one probe, local ranks, or the job.

``Source`` asks every rank the same SQL and returns one Arrow table whose
rows are tagged ``node`` and ``rank`` (a table's own ``node``/``rank``
columns become ``table_node``/``table_rank``, as the cluster query names
them). Three ways, as the CLI takes them:

* ``pids=[P]``: that one probe (its rank from torch.distributed or RANK);
* ``pids=[P, Q, ...]``: each local probe over its unix socket;
* ``cluster=True`` with one pid, or ``addr``: the cluster query of
  ``probing.cluster`` (any probe fans out to its peers), which also measures
  each peer's clock offset: ``offsets`` then holds, per node, the median
  offset of its ranks (the peer clock minus the asker's), which
  ``align`` subtracts so rows from different nodes line up.
"""

from __future__ import annotations

import socket
import statistics
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from probing.errors import ProbingError

RANKS_SQL = "SELECT pid, hostname{tags} FROM process.info"


@dataclass
class RankInfo:
    rank: int
    node: str
    pid: int


@dataclass
class Source:
    pids: Sequence[int] = ()
    addr: str | None = None
    cluster: bool = False
    timeout: float = 10.0
    offsets: dict[str, int] = field(default_factory=dict)  # node -> ns to subtract
    missing: list[str] = field(default_factory=list)  # ranks a cluster query did not reach
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.pids = list(self.pids)
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

    @property
    def remote(self) -> bool:
        """True when rows come through the cluster query (one pid + --cluster, or --addr)."""
        return self.cluster or self.addr is not None

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
        sql = sql.replace("{tags}", ", node, rank" if self.remote else "")
        if self.remote:
            return self._ask_cluster(sql)
        return self._ask_local(sql)

    def _ask_cluster(self, sql: str) -> pa.Table:
        from probing.client import cluster_query

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
        return res.table

    def client(self, pid: int) -> Any:
        """The client of a local probe (anything with ``query(sql) -> pa.Table``)."""
        from probing.client import ProbeClient

        return ProbeClient.for_pid(pid, timeout=max(self.timeout, 1.0))

    def _ask_local(self, sql: str) -> pa.Table:
        from probing.analyze.gather import process_rank

        node = socket.gethostname()

        def one(i_pid: tuple[int, int]) -> pa.Table:
            i, pid = i_pid
            client = self.client(pid)
            rank = process_rank(client, pid)
            return tag(client.query(sql), node, rank if rank >= 0 else i)

        with ThreadPoolExecutor(max_workers=min(16, len(self.pids))) as pool:
            parts = list(pool.map(one, enumerate(self.pids)))
        return pa.concat_tables(parts, promote_options="default")

    def ranks(self) -> list[RankInfo]:
        """Every rank that answers: its node and process id."""
        rows = self.ask(RANKS_SQL).to_pylist()
        seen = {r["rank"]: RankInfo(r["rank"], r["node"], r["pid"]) for r in rows}
        return [seen[r] for r in sorted(seen)]

    def align(self, table: pa.Table, column: str = "ts") -> pa.Table:
        """``table`` with ``column`` moved onto the asker's clock (per-node offsets)."""
        if not self.offsets or column not in table.column_names or not table.num_rows:
            return table
        if not any(self.offsets.values()):
            return table
        shift = [self.offsets.get(n, 0) for n in table.column("node").to_pylist()]
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
