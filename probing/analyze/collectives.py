"""Match collectives across ranks; find stragglers and slow links.

Pure functions over the gathered ``comm.collectives`` rows (a pyarrow Table
with ``node`` and ``rank`` tags, see ``probing.analyze.gather``). The method
follows C4 (per-collective timestamps across ranks: the last rank to arrive
is the one the others wait for) and FALCON (a change point over the
per-iteration series tells since when), with robust statistics: medians,
MADs and a binomial test, so one noisy step raises nothing.

Comm identity across processes: NCCL rows carry the unique-id hash when the
communicator's init was traced, the same number in every rank. A Gloo
context (and an NCCL comm traced only after its init) is a local pointer;
those communicators are named by their torch process group where the
rank's ``comm.groups`` knows it (``pg``: ``gloo/pg1``, the same name in every
rank, so two groups of one size never mix), else by backend, size and their
order of first use in each process (``gloo/n4#0``: the first 4-rank Gloo
group). Sequence numbers count from when tracing started in each process,
so per process an offset is found that lines its calls up with a reference
rank's: for synchronous calls (Gloo, durations known) the calls' *ends*
coincide across ranks, otherwise their arrivals.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from typing import Any

import numpy as np
import pyarrow as pa

MAD_SCALE = 1.4826  # MAD -> standard deviation for normal noise
MIN_COLLECTIVES = 5  # fewer complete collectives than this: no verdict
MIN_LAG_MS = 2.0  # a straggler arrives at least this late (median excess)
NOISE_FACTOR = 3.0  # ... and this many robust sigmas above the others' jitter
LAST_SHARE = 0.5  # ... and is the last to arrive at least this often
P_VALUE = 1e-3  # ... which chance (1/nranks per collective) explains with p < this
SLOW_LINK_MIN_MS = 5.0  # a collective's transfer time above this and ...
SLOW_LINK_FACTOR = 4.0  # ... this many times the modelled time, and ...
SLOW_LINK_SHARE = 0.15  # ... taking this share of the wall time is a slow link
LINK_LATENCY_MS = 0.25  # model: per ring step (one hop, TCP on a LAN or loopback)
LINK_GBPS = 1.0  # model: bytes per ns (1 GB/s, a slow LAN)


@dataclasses.dataclass
class Collective:
    """The k-th collective of one communicator, as every rank saw it."""

    comm: str
    seq: int
    op: str
    nranks: int
    bytes: int | None
    ts: dict[int, int]  # rank -> arrival (wall ns)
    end: dict[int, int | None]  # rank -> return (None: still inside)

    @property
    def complete(self) -> bool:
        return len(self.ts) >= self.nranks and all(e is not None for e in self.end.values())

    def lags_ns(self) -> dict[int, int]:
        first = min(self.ts.values())
        return {r: t - first for r, t in self.ts.items()}

    def transfer_ns(self) -> int | None:
        """Time from the last arrival to the first return: what the wire took."""
        ends = [e for e in self.end.values() if e is not None]
        if len(ends) < len(self.end) or not ends:
            return None
        return max(0, min(ends) - max(self.ts.values()))


@dataclasses.dataclass
class Straggler:
    rank: int
    node: str
    lag_ms_mean: float  # arrival after the first rank, over every collective
    lag_ms_p99: float
    excess_ms_median: float  # arrival after the median of the other ranks
    last_share: float  # share of collectives it arrived last at
    share_of_step: float  # share of the job's wall time spent waiting for it
    since: str  # ISO-8601 UTC: the change point, or the first traced collective
    since_ns: int
    since_start: bool  # True: it was already slow when tracing began
    comm: str
    op: str
    collectives: int
    p_value: float


@dataclasses.dataclass
class SlowLink:
    comm: str
    op: str
    nodes: list[str]
    transfer_ms_median: float
    baseline_ms: float
    skew_ms_median: float
    share_of_step: float
    since: str
    since_ns: int
    collectives: int


def iso(ns: int) -> str:
    import datetime as dt

    t = dt.datetime.fromtimestamp(ns / 1e9, tz=dt.timezone.utc)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    want = ["backend", "op", "comm", "seq", "comm_rank", "nranks", "bytes", "ts", "dur_ns"]
    want += ["pid", "node", "rank", "pg"]
    have = [c for c in want if c in table.column_names]
    return table.select(have).to_pylist()


def _global_rank(r: dict[str, Any]) -> int:
    rank = r.get("rank")
    if rank is None or rank < 0:
        rank = r.get("comm_rank")
    return -1 if rank is None else int(rank)


def comm_keys(rows: list[dict[str, Any]]) -> list[str]:
    """A cross-process name for every row's communicator (see the module doc)."""
    procs_of: dict[tuple[str, Any], set[tuple[Any, Any]]] = defaultdict(set)
    first: dict[tuple[Any, Any, str, Any], int] = {}
    nranks_of: dict[tuple[Any, Any, str, Any], int] = {}
    for r in rows:
        proc = (r.get("node"), r.get("pid"))
        procs_of[(r["backend"], r["comm"])].add(proc)
        k = (*proc, r["backend"], r["comm"])
        first[k] = min(first.get(k, r["ts"]), r["ts"])
        nranks_of[k] = r.get("nranks") or nranks_of.get(k) or 0
    ordinal: dict[tuple[Any, Any, str, Any], int] = {}
    groups: dict[tuple[Any, Any, str, int], list[tuple[int, Any]]] = defaultdict(list)
    for k, ts in first.items():
        groups[(k[0], k[1], k[2], nranks_of[k])].append((ts, k[3]))
    for (node, pid, backend, _), comms in groups.items():
        for i, (_, comm) in enumerate(sorted(comms, key=lambda c: c[0])):
            ordinal[(node, pid, backend, comm)] = i
    keys = []
    for r in rows:
        if r.get("pg") is not None:
            keys.append(f"{r['backend']}/pg{r['pg']}")
        elif len(procs_of[(r["backend"], r["comm"])]) > 1 and r["comm"] is not None:
            keys.append(f"{r['backend']}:{int(r['comm']):x}")
        else:
            k = (r.get("node"), r.get("pid"), r["backend"], r["comm"])
            keys.append(f"{r['backend']}/n{nranks_of[k]}#{ordinal[k]}")
    return keys


def _offset(seq: np.ndarray, t: np.ndarray, ref_seq: np.ndarray, ref_t: np.ndarray) -> int:
    """The shift of ``seq`` that lines its times up with the reference's (the mode)."""
    if len(t) == 0 or len(ref_t) == 0:
        return 0
    order = np.argsort(ref_t)
    rt, rs = ref_t[order], ref_seq[order]
    j = np.clip(np.searchsorted(rt, t), 1, len(rt) - 1) if len(rt) > 1 else np.zeros_like(t)
    if len(rt) > 1:
        left_closer = np.abs(t - rt[j - 1]) < np.abs(t - rt[j])
        j = np.where(left_closer, j - 1, j)
    shifts = Counter((rs[j] - seq).tolist())
    return shifts.most_common(1)[0][0]


def match(table: pa.Table) -> list[Collective]:
    """Every collective, matched across ranks by communicator and aligned sequence."""
    rows = [r for r in _rows(table) if r.get("op") and r.get("ts") is not None]
    if not rows:
        return []
    keys = comm_keys(rows)
    per: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for key, r in zip(keys, rows, strict=True):
        per[key][_global_rank(r)].append(r)
    out: list[Collective] = []
    for key, by_rank in per.items():
        ref = max(by_rank, key=lambda rk: len(by_rank[rk]))

        def series(rs: list[dict[str, Any]], ends: bool) -> tuple[np.ndarray, np.ndarray]:
            done = [r for r in rs if r.get("seq") is not None and (r["dur_ns"] is not None)]
            if not ends:
                done = [r for r in rs if r.get("seq") is not None]
            s = np.array([r["seq"] for r in done], dtype=np.int64)
            t = np.array(
                [r["ts"] + (r["dur_ns"] or 0) if ends else r["ts"] for r in done], dtype=np.int64
            )
            return s, t

        # Gloo on CPU is synchronous: a call returns when the collective is done,
        # so the returns line up across ranks (calls still in flight are left out)
        synchronous = all(r["backend"] == "gloo" for r in by_rank[ref])
        ref_s, ref_t = series(by_rank[ref], synchronous)
        merged: dict[int, Collective] = {}
        for rank, rs in by_rank.items():
            shift = 0 if rank == ref else _offset(*series(rs, synchronous), ref_s, ref_t)
            for r in rs:
                if r.get("seq") is None:
                    continue
                k = int(r["seq"]) + shift
                c = merged.get(k)
                if c is None:
                    c = merged[k] = Collective(
                        key, k, r["op"], int(r.get("nranks") or 0), r.get("bytes"), {}, {}
                    )
                if r["op"] != c.op or rank in c.ts:
                    continue  # misaligned or duplicated: leave it out
                c.ts[rank] = int(r["ts"])
                c.end[rank] = None if r["dur_ns"] is None else int(r["ts"] + r["dur_ns"])
                c.nranks = max(c.nranks, int(r.get("nranks") or 0), len(c.ts))
        out.extend(merged[k] for k in sorted(merged))
    return out


# -- robust statistics ----------------------------------------------------------------


def mad(x: np.ndarray) -> float:
    return float(np.median(np.abs(x - np.median(x)))) if len(x) else 0.0


def binom_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), in log space (no scipy)."""
    if k <= 0:
        return 1.0
    logs = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
        + i * math.log(p) + (n - i) * math.log1p(-p)
        for i in range(k, n + 1)
    ]  # fmt: skip
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def change_point(x: np.ndarray, min_size: int = 3) -> tuple[int, float]:
    """The one split of ``x`` that best separates two means (CUSUM / binary
    segmentation's first step): its index and a robust t-like score."""
    n = len(x)
    if n < 2 * min_size:
        return 0, 0.0
    c = np.cumsum(x - x.mean())
    i = np.arange(1, n)
    stat = np.abs(c[:-1]) / np.sqrt(i * (n - i) / n)
    stat[: min_size - 1] = 0
    stat[n - min_size :] = 0
    k = int(np.argmax(stat)) + 1
    a, b = x[:k], x[k:]
    spread = MAD_SCALE * max(mad(a), mad(b)) or 1e-9
    return k, float(abs(np.median(b) - np.median(a)) / spread)


# -- stragglers -------------------------------------------------------------------------


def stragglers(collectives: list[Collective], nodes: dict[int, str]) -> list[Straggler]:
    """Ranks that keep arriving last, by a margin above the others' jitter."""
    by_comm: dict[str, list[Collective]] = defaultdict(list)
    for c in collectives:
        if c.complete and c.nranks > 1:
            by_comm[c.comm].append(c)
    found: dict[int, Straggler] = {}
    for comm, cs in by_comm.items():
        if len(cs) < MIN_COLLECTIVES:
            continue
        ranks = sorted({r for c in cs for r in c.ts})
        n = len(cs)
        # excess[r][k]: arrival after the median of the other ranks
        excess = {r: np.zeros(n) for r in ranks}
        lags = {r: np.zeros(n) for r in ranks}
        last = Counter()
        for k, c in enumerate(cs):
            ts = c.ts
            last[max(ts, key=ts.__getitem__)] += 1
            first = min(ts.values())
            for r in ranks:
                others = [t for o, t in ts.items() if o != r]
                excess[r][k] = (ts[r] - float(np.median(others))) / 1e6
                lags[r][k] = (ts[r] - first) / 1e6
        starts = np.array([min(c.ts.values()) for c in cs], dtype=np.int64)
        span_ms = max((starts[-1] - starts[0]) / 1e6, 1e-9)
        for r in ranks:
            med = float(np.median(excess[r]))
            noise = max(
                MAD_SCALE * mad(excess[o]) + abs(float(np.median(excess[o])))
                for o in ranks
                if o != r
            )
            p = binom_tail(last[r], n, 1.0 / len(ranks))
            if med < max(MIN_LAG_MS, NOISE_FACTOR * noise) or last[r] / n < LAST_SHARE:
                continue
            if p >= P_VALUE or released_late(cs, r, med):
                continue
            k, score = change_point(excess[r])
            thr = max(MIN_LAG_MS, NOISE_FACTOR * noise)
            began = k > 0 and score > 3.0 and float(np.median(excess[r][:k])) < thr
            k0 = k if began else 0  # the figures describe the slow period only
            seg = cs[k0:]
            # the job waits, per collective, from the next-latest arrival to this one
            lost = sum(
                max(0.0, (c.ts[r] - max(t for o, t in c.ts.items() if o != r)) / 1e6) for c in seg
            )
            seg_ms = max((starts[-1] - starts[k0]) / 1e6, 1e-9) if len(seg) > 1 else span_ms
            last_seg = sum(1 for c in seg if max(c.ts, key=c.ts.__getitem__) == r)
            s = Straggler(
                rank=r,
                node=nodes.get(r, ""),
                lag_ms_mean=round(float(lags[r][k0:].mean()), 3),
                lag_ms_p99=round(float(np.percentile(lags[r][k0:], 99)), 3),
                excess_ms_median=round(float(np.median(excess[r][k0:])), 3),
                last_share=round(last_seg / len(seg), 4),
                share_of_step=round(min(1.0, lost / seg_ms), 4),
                since=iso(int(starts[k0])),
                since_ns=int(starts[k0]),
                since_start=not began,
                comm=comm,
                op=Counter(c.op for c in cs).most_common(1)[0][0],
                collectives=len(seg),
                p_value=p,
            )
            if r not in found or s.share_of_step > found[r].share_of_step:
                found[r] = s
    return sorted(found.values(), key=lambda s: -s.share_of_step)


def released_late(cs: list[Collective], rank: int, excess_ms: float) -> bool:
    """Whether ``rank`` arrives late only because the previous collective let it
    go late (a rank behind a slow link), not because of its own work between
    collectives. Needs return times (synchronous backends); else False."""
    own = []  # its time from a return to its next arrival, minus the others' median
    for prev, c in zip(cs, cs[1:], strict=False):
        if c.seq != prev.seq + 1 or any(prev.end.get(o) is None for o in c.ts):
            continue
        gaps = {o: c.ts[o] - prev.end[o] for o in c.ts if o in prev.end}  # type: ignore[operator]
        if rank in gaps and len(gaps) > 1:
            others = [g for o, g in gaps.items() if o != rank]
            own.append((gaps[rank] - float(np.median(others))) / 1e6)
    if len(own) < MIN_COLLECTIVES:
        return False
    return float(np.median(own)) < 0.5 * excess_ms


# -- slow links -------------------------------------------------------------------------


def model_ms(nbytes: int | None, nranks: int) -> float:
    """A ring collective's expected time on a slow but healthy network."""
    steps = 2 * max(nranks - 1, 1)
    wire = 2 * (nranks - 1) / max(nranks, 1) * (nbytes or 0) / LINK_GBPS / 1e6
    return steps * LINK_LATENCY_MS + wire


def slow_links(collectives: list[Collective], nodes: dict[int, str]) -> list[SlowLink]:
    """Communicators whose collectives are slow for every rank, with no arrival skew."""
    by_comm: dict[str, list[Collective]] = defaultdict(list)
    for c in collectives:
        if c.complete and c.nranks > 1 and c.transfer_ns() is not None:
            by_comm[c.comm].append(c)
    out = []
    for comm, cs in by_comm.items():
        if len(cs) < MIN_COLLECTIVES:
            continue
        transfer = np.array([c.transfer_ns() for c in cs], dtype=np.float64) / 1e6
        skew = np.array([max(c.lags_ns().values()) for c in cs], dtype=np.float64) / 1e6
        baseline = float(np.median([model_ms(c.bytes, c.nranks) for c in cs]))
        med = float(np.median(transfer))
        starts = np.array([min(c.ts.values()) for c in cs], dtype=np.int64)
        ends = np.array([max(e for e in c.end.values() if e is not None) for c in cs])
        span_ms = max((ends[-1] - starts[0]) / 1e6, 1e-9)
        share = float(transfer.sum() / span_ms)
        if med < max(SLOW_LINK_MIN_MS, SLOW_LINK_FACTOR * baseline):
            continue
        if share < SLOW_LINK_SHARE or float(np.median(skew)) > med:
            continue
        k, score = change_point(transfer)
        began = k > 0 and score > 3.0 and float(np.median(transfer[:k])) < SLOW_LINK_MIN_MS
        since_ns = int(starts[k]) if began else int(starts[0])
        ranks = sorted({r for c in cs for r in c.ts})
        out.append(
            SlowLink(
                comm=comm,
                op=Counter(c.op for c in cs).most_common(1)[0][0],
                nodes=sorted({nodes.get(r, "") for r in ranks}),
                transfer_ms_median=round(med, 3),
                baseline_ms=round(baseline, 3),
                skew_ms_median=round(float(np.median(skew)), 3),
                share_of_step=round(min(1.0, share), 4),
                since=iso(since_ns),
                since_ns=since_ns,
                collectives=len(cs),
            )
        )
    return out


@dataclasses.dataclass
class Summary:
    """The figures that show a job is healthy (or how it is not)."""

    collectives: int
    ranks: int
    comms: int
    skew_ms_median: float | None
    skew_ms_p99: float | None
    transfer_ms_median: float | None
    last_share_max: float | None  # the most any one rank was last


def summarize(collectives: list[Collective]) -> Summary:
    done = [c for c in collectives if c.complete and c.nranks > 1]
    skew = np.array([max(c.lags_ns().values()) / 1e6 for c in done])
    transfer = [c.transfer_ns() for c in done]
    tr = np.array([t / 1e6 for t in transfer if t is not None])
    last = Counter(max(c.ts, key=c.ts.__getitem__) for c in done)
    return Summary(
        collectives=len(done),
        ranks=len({r for c in collectives for r in c.ts}),
        comms=len({c.comm for c in collectives}),
        skew_ms_median=round(float(np.median(skew)), 3) if len(skew) else None,
        skew_ms_p99=round(float(np.percentile(skew, 99)), 3) if len(skew) else None,
        transfer_ms_median=round(float(np.median(tr)), 3) if len(tr) else None,
        last_share_max=round(max(last.values()) / len(done), 4) if done else None,
    )
