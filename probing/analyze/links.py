"""Slow links: a communicator whose collectives take far longer than a
model of the link says (``slow_links``), unless its ranks wait for a CPU."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from probing.analyze.collectives import MIN_COLLECTIVES, Collective, by_comm, iso
from probing.analyze.evidence import change_point

SLOW_LINK_MIN_MS = 5.0  # a collective's transfer time above this and ...
SLOW_LINK_FACTOR = 4.0  # ... this many times the modelled time, and ...
SLOW_LINK_SHARE = 0.15  # ... taking this share of the wall time is a slow link
# ... unless its ranks wait for a CPU at least this share of the excess per collective:
# a starved CPU slows every rank's transfer alike (each hop waits to be scheduled)
CPU_EXPLAINS = 0.5
LINK_LATENCY_MS = 0.25  # model: per ring step (one hop, TCP on a LAN or loopback)
LINK_GBPS = 1.0  # model: bytes per ns (1 GB/s, a slow LAN)


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


# -- slow links -------------------------------------------------------------------------


def model_ms(nbytes: int | None, nranks: int) -> float:
    """A ring collective's expected time on a slow but healthy network."""
    steps = 2 * max(nranks - 1, 1)
    wire = 2 * (nranks - 1) / max(nranks, 1) * (nbytes or 0) / LINK_GBPS / 1e6
    return steps * LINK_LATENCY_MS + wire


def slow_links(
    collectives: list[Collective], nodes: dict[int, str], runq: dict[int, float] | None = None
) -> list[SlowLink]:
    """Communicators whose collectives are slow for every rank, with no arrival skew,
    and not because their ranks wait for a CPU (``runq``: each rank's threads' time
    runnable but not running, ms per s, from ``python.samples``; None: not sampled)."""
    out = []
    for comm, every in by_comm(collectives).items():
        cs = [c for c in every if c.transfer_ns() is not None]
        if len(cs) < MIN_COLLECTIVES:
            continue
        transfer = np.array([c.transfer_ns() for c in cs], dtype=np.float64) / 1e6
        skew = np.array([c.skew_ns for c in cs], dtype=np.float64) / 1e6
        baseline = float(np.median([model_ms(c.bytes, c.nranks) for c in cs]))
        med = float(np.median(transfer))
        starts = np.array([c.first_ns for c in cs], dtype=np.int64)
        ends = np.array([c.released_ns for c in cs])  # each returned: a transfer
        span_ms = max((ends[-1] - starts[0]) / 1e6, 1e-9)
        share = float(transfer.sum() / span_ms)
        if med < max(SLOW_LINK_MIN_MS, SLOW_LINK_FACTOR * baseline):
            continue
        if share < SLOW_LINK_SHARE or float(np.median(skew)) > med:
            continue
        ranks = sorted({r for c in cs for r in c.ts})
        waits = [runq[r] for r in ranks if runq and r in runq]
        if waits:  # ms a rank waited for a CPU per collective of this comm
            wait_ms = float(np.median(waits)) / 1e3 * span_ms / len(cs)
            if wait_ms >= CPU_EXPLAINS * (med - baseline):
                continue
        k, score = change_point(transfer)
        began = k > 0 and score > 3.0 and float(np.median(transfer[:k])) < SLOW_LINK_MIN_MS
        since_ns = int(starts[k]) if began else int(starts[0])
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
