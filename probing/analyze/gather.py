"""Gather rows from every rank of a job into one table tagged ``node`` and ``rank``.

Two paths behind one function:

* local pids (``pids=[...]``): one query per process's probe over its unix
  socket; the rank is the process's ``torch.distributed`` rank (or ``RANK``);
* the cluster (``cluster=True``, or ``addr``): the cross-node query of
  ``probing.cluster`` (any probe fans the query out to its peers).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from probing.errors import ProbingError

MISSING_KEY = b"probing.missing"
RANK_EXPR = (
    "(lambda d: d.get_rank() if d is not None and d.is_initialized() "
    "else int(os.environ.get('RANK', '-1')))(sys.modules.get('torch.distributed'))"
)


def _tag(table: pa.Table, node: str, rank: int) -> pa.Table:
    for name in ("node", "rank"):
        if name in table.column_names:
            table = table.drop_columns([name])
    n = table.num_rows
    table = table.append_column("node", pa.array([node] * n, type=pa.string()))
    return table.append_column("rank", pa.array([rank] * n, type=pa.int64()))


_RANKS: dict[tuple[int, float], int] = {}  # (pid, its start time) -> rank


def process_rank(client: object, pid: int) -> int:
    """A local process's rank in its job (-1 when it has none); asked once per process."""
    key = (pid, _start_time(pid))
    if key in _RANKS:
        return _RANKS[key]
    try:
        value = client.query(f"SELECT value FROM python.`{RANK_EXPR}`")  # type: ignore[attr-defined]
        rank = int(value.column(0)[0].as_py())
    except (ProbingError, ValueError, TypeError, IndexError):
        return -1
    if rank >= 0:
        _RANKS[key] = rank
    return rank


def _start_time(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def gather(
    sql: str,
    *,
    pids: Sequence[int] | None = None,
    addr: str | None = None,
    cluster: bool = False,
    timeout: float = 5.0,
) -> pa.Table:
    """``sql`` run in every rank; one table, each row tagged ``node`` and ``rank``."""
    if cluster or addr:
        return _cluster(sql, pids=pids, addr=addr, timeout=timeout)
    if not pids:
        raise ProbingError("nothing to ask: give --pid (repeatable), --addr or --cluster")
    from probing.client import ProbeClient

    node = socket.gethostname()
    clients = [ProbeClient.for_pid(pid, timeout=max(timeout, 1.0)) for pid in pids]

    def one(i: int) -> pa.Table:  # the ranks answer in parallel
        rank = process_rank(clients[i], pids[i])
        return _tag(clients[i].query(sql), node, rank if rank >= 0 else i)

    with ThreadPoolExecutor(max_workers=min(16, len(clients))) as pool:
        parts = list(pool.map(one, range(len(clients))))
    return pa.concat_tables(parts, promote_options="default")


def _cluster(sql: str, *, pids: Sequence[int] | None, addr: str | None, timeout: float) -> pa.Table:
    try:
        from probing.client import cluster_query
    except ImportError as err:
        raise ProbingError(
            "cross-node queries are not available in this build (no probing.cluster)",
            hint="give the local ranks with --pid P --pid Q ...",
        ) from err
    if addr:
        res = cluster_query(sql, addr=addr, timeout=timeout)
    elif pids:
        res = cluster_query(sql, pid=pids[0], timeout=timeout)
    else:
        raise ProbingError("--cluster needs one local rank (--pid P) or a peer (--addr H:PORT)")
    table = res.table
    if res.missing:  # ranks that did not answer: the diagnosis says it works without them
        gone = [f"rank {m.rank} ({m.node or m.addr}): {m.reason}" for m in res.missing]
        meta = dict(table.schema.metadata or {})
        meta[MISSING_KEY] = json.dumps(gone).encode()
        table = table.replace_schema_metadata(meta)
    return table


def missing_ranks(table: pa.Table) -> list[str]:
    """The ranks a cluster gather could not reach (from the table's metadata)."""
    raw = (table.schema.metadata or {}).get(MISSING_KEY)
    return json.loads(raw) if raw else []
