"""Why a straggler is slow: differential observability across ranks.

Every rank runs the same code, so where one rank spends its wall-clock time
differently from the others is where it is slow (PerfTracker, EROICA). Per
rank and per Python function (the innermost frame of the user's own code),
``python.samples`` gives time on a CPU, blocked off it, and waiting for one
(run queue); ``comm.collectives`` the time inside collectives; ``cuda.calls``
the time in CUDA calls (synchronising ones included). Each is put per step
(the job's step time, the same for every rank of a synchronous job) and the
straggler's figure is compared with the median of the others'.

A CPU-starved rank runs the same code slower everywhere and waits for a
CPU: its run-queue time stands out, and its functions' on-CPU + run-queue
time is a similar multiple of the others'. Pure functions over gathered rows.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import numpy as np

from probing.analyze.collectives import Collective, Straggler
from probing.analyze.hangs import short_path

MIN_DELTA_MS = 1.0  # a function's extra time per step worth naming ...
MIN_DELTA_SHARE = 0.15  # ... and this share of the straggler's own excess
TOP = 3  # functions named per straggler
STARVED_SLOWER = 1.5  # starved: the other functions this many times slower, on average
STARVED_SHARE = 0.5  # ... or its extra wait for a CPU is this share of its lateness


@dataclasses.dataclass
class Why:
    rank: int
    kind: str  # function | cpu_starvation | collectives | cuda
    what: str  # the function, "run queue", "collectives", the CUDA API
    file: str | None
    line: int | None
    ms_per_step: float
    others_ms_per_step: float
    on_cpu_ms: float | None = None  # of ms_per_step: on a CPU
    off_cpu_ms: float | None = None  # blocked (sleep, I/O, a lock, a wait)
    runq_ms: float | None = None  # runnable, waiting for a CPU
    slower: float | None = None  # cpu_starvation: the functions' typical slowdown
    text: str = ""


def steps_per_collective(cs: list[Collective]) -> float:
    """Steps per collective of one communicator: DDP issues one or a few
    all-reduces per step; the long gaps between them are the steps'."""
    starts = np.array(sorted(min(c.ts.values()) for c in cs), dtype=np.float64)
    if len(starts) < 3:
        return 1.0
    gaps = np.diff(starts)
    long = gaps > 0.5 * np.percentile(gaps, 90)
    return max(1, int(long.sum())) / len(gaps)


def step_ms(collectives: list[Collective], comm: str) -> float | None:
    """The job's step time: the median interval between its collectives on
    ``comm``, times the collectives per step."""
    cs = [c for c in collectives if c.comm == comm and c.complete]
    if len(cs) < 3:
        return None
    starts = np.array(sorted(min(c.ts.values()) for c in cs), dtype=np.float64)
    per = steps_per_collective(cs)
    return float((starts[-1] - starts[0]) / 1e6 / ((len(starts) - 1) * per))


@dataclasses.dataclass
class Profile:
    funcs: dict[int, dict]  # rank -> (file, func) -> kind -> ns (and "line")
    span: dict[int, float]  # rank -> the sampled wall time (ns)
    native_runq: dict[int, float]  # rank -> ns its threads without Python waited for a CPU


def _profile(rows: list[dict[str, Any]]) -> Profile:
    prof: dict[int, dict] = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    lines: dict[tuple[int, Any, Any], dict[Any, float]] = defaultdict(lambda: defaultdict(float))
    span: dict[int, float] = defaultdict(float)
    native: dict[int, float] = defaultdict(float)
    for row in rows:
        r, kind, ns = row["rank"], row["kind"], float(row["dur_ns"] or 0)
        if kind == "tick":
            span[r] += ns
            continue
        key = (row.get("file"), row.get("func"))
        if key == (None, None):  # threads without Python (pools, Gloo's): idle, or working
            if kind == "runq":  # for a Python caller, whose own time says as much; but
                native[r] += ns  # their wait for a CPU delays that caller too
            continue
        prof[r][key][kind] += ns
        lines[(r, *key)][row.get("line")] += ns
    for (r, *key), by_line in lines.items():
        prof[r][tuple(key)]["line"] = max(by_line, key=by_line.__getitem__) or 0
    return Profile(prof, span, native)


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else 0.0


def lateness_ms(s: Straggler, step: float) -> float:
    """How late the straggler makes each step: its typical excess, or what
    the job waits for it per step where it is late at a few collectives only
    (FSDP's gathers: a median excess of nothing)."""
    return max(s.excess_ms_median, s.share_of_step * step, 0.0)


def explain(
    s: Straggler,
    samples: list[dict[str, Any]],
    collectives: list[Collective],
    cuda: list[dict[str, Any]] | None = None,
) -> list[Why]:
    """What makes ``s.rank`` slow, largest difference first."""
    step = step_ms(collectives, s.comm)
    if not step:
        return []
    prof = _profile(samples)
    r = s.rank
    others = [q for q in prof.funcs if q != r and prof.span.get(q)]
    out: list[Why] = []
    if r in prof.funcs and prof.span.get(r) and others:
        out += _functions(s, prof, others, step)
    out += _collectives(s, collectives, step)
    out += _cuda(s, cuda or [], step, collectives)
    return out


def _per_step(ns: float, span_ns: float, step: float) -> float:
    return ns / span_ns * step if span_ns else 0.0


def _functions(s: Straggler, p: Profile, others: list[int], step: float) -> list[Why]:
    r, prof, span = s.rank, p.funcs, p.span
    keys = set(prof[r]) | {k for q in others for k in prof[q]}

    def ms(q: int, key: tuple[Any, Any], kinds: tuple[str, ...]) -> float:
        got = prof[q].get(key, {})
        return _per_step(sum(got.get(k, 0.0) for k in kinds), span[q], step)

    every = ("cpu", "off", "runq")
    deltas = []
    for key in keys:
        mine = ms(r, key, every)
        theirs = _median([ms(q, key, every) for q in others])
        deltas.append((mine - theirs, key, mine, theirs))
    deltas.sort(key=lambda d: -d[0])
    # the function that differs most, where it is extra work (over twice the others'
    # time), not the same code running slower: that work waits for a CPU as well
    top = deltas[0][1] if deltas and deltas[0][3] < 0.5 * deltas[0][2] else None

    def runq_of(q: int) -> float:
        """Its wait for a CPU per step, every thread's, outside ``top``."""
        py = sum(ms(q, k, ("runq",)) for k in prof[q] if k != top)
        return py + _per_step(p.native_runq.get(q, 0.0), span[q], step)

    runq, runq_others = runq_of(r), _median([runq_of(q) for q in others])
    out = []
    floor = max(MIN_DELTA_MS, MIN_DELTA_SHARE * lateness_ms(s, step))
    # starved: the functions that differ least run slower too (not one function's
    # extra work waiting for a CPU on a busy machine): their on-CPU + run-queue
    # time against the others', weighted by the others' time, leaving out the top one
    ratios, weights = [], []
    for _, key, _, _ in deltas[1:]:
        theirs = _median([ms(q, key, ("cpu", "runq")) for q in others])
        if theirs >= 0.5:
            ratios.append(ms(r, key, ("cpu", "runq")) / theirs)
            weights.append(theirs)
    slower = float(np.average(ratios, weights=weights)) if ratios else None
    # every function slower, or a wait for a CPU that accounts for its lateness
    # (the others wait for CPUs too: a busy machine that favours them)
    starved = (slower or 0.0) >= STARVED_SLOWER or (
        runq - runq_others >= STARVED_SHARE * lateness_ms(s, step)
    )
    if runq - runq_others >= floor and starved:
        alike = f"; every function ~{slower:.1f}x slower" if slower is not None else ""
        out.append(
            Why(
                r, "cpu_starvation", "run queue", None, None, round(runq, 2),
                round(runq_others, 2), runq_ms=round(runq, 2),
                slower=round(slower, 2) if slower is not None else None,
                text=f"rank {r}: CPU starvation: waits {runq:.1f} ms/step for a CPU "
                f"({runq_others:.1f} ms on the others){alike}",
            )
        )  # fmt: skip
    for delta, key, mine, theirs in deltas[:TOP]:
        if delta < floor:
            break
        file, func = key
        parts = {k: ms(r, key, (k,)) for k in every}
        line = int(prof[r].get(key, {}).get("line", 0) or 0) or None
        where = f" ({short_path(file)}:{line})" if file else ""
        top = max(parts, key=parts.__getitem__)
        how = {"cpu": "on CPU", "off": "off CPU", "runq": "waiting for a CPU"}[top]
        out.append(
            Why(
                r, "function", str(func), file, line, round(mine, 2), round(theirs, 2),
                on_cpu_ms=round(parts["cpu"], 2), off_cpu_ms=round(parts["off"], 2),
                runq_ms=round(parts["runq"], 2),
                text=f"rank {r}: {func}{where} {mine:.1f} ms/step vs {theirs:.1f} ms "
                f"on the others (mostly {how})",
            )
        )  # fmt: skip
    return out


def _collectives(s: Straggler, collectives: list[Collective], step: float) -> list[Why]:
    """Time inside collectives per step: the others wait there for the straggler."""
    total: dict[int, float] = defaultdict(float)
    count: dict[int, int] = defaultdict(int)
    done = [c for c in collectives if c.comm == s.comm and c.complete]
    if not done:
        return []
    per = steps_per_collective(done)
    for c in done:
        for q, t in c.ts.items():
            end = c.end.get(q)
            if end is not None:
                total[q] += (end - t) / 1e6
                count[q] += 1
    if s.rank not in total or len(total) < 2:
        return []
    mine = total[s.rank] / count[s.rank] / per
    theirs = _median([total[q] / count[q] / per for q in total if q != s.rank])
    return [
        Why(
            s.rank, "collectives", f"collectives on {s.comm}", None, None, round(mine, 2),
            round(theirs, 2),
            text=f"rank {s.rank}: inside collectives {mine:.1f} ms/step vs {theirs:.1f} ms "
            "on the others (they wait there for it)",
        )
    ]  # fmt: skip


def _cuda(
    s: Straggler, rows: list[dict[str, Any]], step: float, collectives: list[Collective]
) -> list[Why]:
    """CUDA call time (launches, copies, synchronisation) per API, per step."""
    if not rows:
        return []
    steps: dict[int, float] = defaultdict(float)
    done = [c for c in collectives if c.comm == s.comm and c.complete]
    per = steps_per_collective(done) if done else 1.0
    for c in done:
        for q in c.ts:
            steps[q] += per
    by: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for row in rows:
        by[str(row.get("api"))][row["rank"]] += float(row.get("dur_ns") or 0) / 1e6
    out = []
    floor = max(MIN_DELTA_MS, MIN_DELTA_SHARE * lateness_ms(s, step))
    for api, per_rank in by.items():
        if not steps.get(s.rank):
            continue
        mine = per_rank.get(s.rank, 0.0) / steps[s.rank]
        theirs = _median([per_rank.get(q, 0.0) / n for q, n in steps.items() if q != s.rank])
        if mine - theirs >= floor:
            out.append(
                Why(
                    s.rank, "cuda", api, None, None, round(mine, 2), round(theirs, 2),
                    text=f"rank {s.rank}: CUDA {api} {mine:.1f} ms/step vs {theirs:.1f} ms "
                    "on the others",
                )
            )  # fmt: skip
    return sorted(out, key=lambda w: w.others_ms_per_step - w.ms_per_step)[:TOP]
