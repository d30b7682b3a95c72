"""The SQL a diagnosis asks of every rank (``queries``), and what a probe
that lacks a table answers (``optional``). Text only: the asking is the
command line's (``probing.cli.asking``), the analysis ``probing.analyze.diagnose``."""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

from probing.analyze import coverage as cv
from probing.errors import ProbingError

# what every rank is asked; ``{tags}`` is ", node, rank" in a cluster query,
# where those are the peer's tags and the view's own ``rank`` is ``table_rank``
COLLECTIVES_SQL = (
    "SELECT backend, op, comm, seq, {comm_rank} AS comm_rank, nranks, bytes, ts, dur_ns, "
    "pid, tid, peer, tag, wait_ns{tags} FROM comm.collectives "
    "WHERE ts >= {since_ns} OR dur_ns IS NULL"
)  # calls still in flight however long ago they began: a hang older than the window
# each traced Gloo context's torch process group, named the same in every rank
GROUPS_SQL = "SELECT backend, comm, pg, ranks{tags} FROM comm.groups"
# the ranks that died (a killed rank's probe answers with what it left)
DEAD_SQL = "SELECT pid, alive, died_ns{tags} FROM process.info"
STACKS_SQL = "SELECT tid, thread, state, depth, func, file, line{tags} FROM process.stacks"
# torch's own count of collectives issued per process group (no tracing needed)
COUNTS_EXPR = (
    "(lambda d: [{{'group': str(n), 'size': g.size(), "
    "'count': g._get_sequence_number_for_group()}} "
    "for g, n in d.distributed_c10d._world.pg_names.items()] "
    "if d is not None and d.is_initialized() else [])(sys.modules.get('torch.distributed'))"
)
COUNTS_SQL = "SELECT *{tags} FROM python.`" + COUNTS_EXPR + "`"


# where each rank issues its collectives from, when the trace records Python
# stacks (``stack_id`` and ``python.callsites``); absent: no callsites, no error
# stack ids are per process: over a cluster, a stack joins its own rank's calls only
CALLSITES_SQL = (
    "SELECT s.callsite AS callsite, count(*) AS n{tags} FROM comm.collectives c "
    "JOIN python.callsites s ON c.stack_id = s.stack_id{same_rank} WHERE c.ts >= {since_ns} "
    "GROUP BY s.callsite{group}"
)


# where each rank spent its time (python.samples, by the innermost user frame,
# whether it waited for its DataLoader's worker processes, and whether its
# thread issued collectives: the thread that trains, whatever its name) and in
# CUDA calls (by the thread that made them): asked only when there is a straggler to explain
SAMPLES_SQL = (
    "SELECT s.kind AS kind, c.file AS file, c.func AS func, c.line AS line, "
    "c.via_file AS via_file, c.via_func AS via_func, l.stack_id IS NOT NULL AS loader, "
    "s.thread AS thread, s.tid AS tid, t.tid IS NOT NULL AS trains, sum(s.dur_ns) AS dur_ns, "
    "sum(s.count) AS n{tags} FROM python.samples s "
    "LEFT JOIN python.callsites c ON s.stack_id = c.stack_id{same_rank} "
    "LEFT JOIN (SELECT DISTINCT stack_id{ltags} FROM python.stacks "
    "WHERE file LIKE '%torch/utils/data/dataloader.py' AND func LIKE '%._get_data') l "
    "ON s.stack_id = l.stack_id{loader_rank} "
    "LEFT JOIN (SELECT DISTINCT tid{ltags} FROM comm.collectives WHERE ts >= {since_ns}) t "
    "ON s.tid = t.tid{issuer_rank} WHERE s.ts >= {since_ns} "
    "GROUP BY s.kind, c.file, c.func, c.line, c.via_file, c.via_func, l.stack_id IS NOT NULL, "
    "s.thread, s.tid, t.tid IS NOT NULL{group}"
)  # by thread too: the threads without Python (Gloo's, OpenMP's) wait for a CPU as well
CUDA_SQL = (
    "SELECT api, tid, sum(dur_ns) AS dur_ns, count(*) AS n{tags} FROM cuda.calls "
    "WHERE ts >= {since_ns} GROUP BY api, tid{group}"
)


# each rank's GPUs over the window (NVML, when sampled), those it works on
# (``own``): asked only when there is a straggler to explain
NVML_SQL = (
    "SELECT gpu, avg(sm_clock_mhz) AS sm_mhz, bit_or(throttle_reasons) AS reasons, "
    "avg(power_w) AS power_w, max(temp_c) AS temp_c, sum(xid_count) AS xids, max(xid) AS xid, "
    "max(ecc_uncorrected) AS ecc, avg(pcie_tx_kbs + pcie_rx_kbs) AS pcie_kbs, "
    "max(nvlink_tx_kib + nvlink_rx_kib) - min(nvlink_tx_kib + nvlink_rx_kib) AS nvlink_kib, "
    "max(ts) - min(ts) AS span_ns{tags} FROM nvml.gpu WHERE ts >= {since_ns} AND own "
    "GROUP BY gpu{group}"
)


# how long each rank's threads waited for a CPU (``runq``) over the wall time the
# sampler covered (``tick``): asked only when a slow link is to be told from a starved CPU
RUNQ_SQL = (
    "SELECT kind, sum(dur_ns) AS dur_ns{tags} FROM python.samples "
    "WHERE ts >= {since_ns} AND kind IN ('runq', 'tick') GROUP BY kind{group}"
)


# the CPU each rank runs on: its clock, its node's steal (asked with NVML_SQL)
CPU_SQL = "SELECT cpu, mhz, max_mhz, steal_pct, busy_pct{tags} FROM process.cpu"


def queries(remote: bool) -> dict[str, str]:
    """The SQL for local ranks (tagged by ``gather``) or for a cluster query."""
    rank = ", node, rank" if remote else ""
    # every query's tags, its GROUP BY's, and ``{since_ns}`` left for the caller
    tags = {"tags": rank, "group": rank, "since_ns": "{since_ns}"}
    out = {
        name: sql.format(**tags)
        for name, sql in (
            ("stacks", STACKS_SQL), ("groups", GROUPS_SQL), ("dead", DEAD_SQL),
            ("counts", COUNTS_SQL), ("cuda", CUDA_SQL), ("cpu", CPU_SQL),
            ("runq", RUNQ_SQL), ("nvml", NVML_SQL), ("intervals", cv.INTERVALS_SQL),
        )
    }  # fmt: skip
    out["collectives"] = COLLECTIVES_SQL.format(
        comm_rank="table_rank" if remote else "rank", **tags
    )
    out["callsites"] = CALLSITES_SQL.format(
        tags=", c.rank AS rank" if remote else "",
        same_rank=" AND c.node = s.node AND c.rank = s.rank" if remote else "",
        group=", c.rank" if remote else "",
        since_ns="{since_ns}",
    )  # fmt: skip
    out["samples"] = SAMPLES_SQL.format(
        tags=", s.node AS node, s.rank AS rank" if remote else "",
        same_rank=" AND c.node = s.node AND c.rank = s.rank" if remote else "",
        ltags=rank,
        loader_rank=" AND l.node = s.node AND l.rank = s.rank" if remote else "",
        issuer_rank=" AND t.node = s.node AND t.rank = s.rank" if remote else "",
        group=", s.node, s.rank" if remote else "",
        since_ns="{since_ns}",
    )  # fmt: skip
    return out


def optional(ask: Callable[[str], pa.Table], sql: str) -> pa.Table | None:
    """``ask(sql)``, or None from a probe without the table (that part is left out)."""
    try:
        return ask(sql)
    except ProbingError:
        return None
