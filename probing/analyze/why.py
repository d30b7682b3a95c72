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

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from probing.analyze import functions as fn
from probing.analyze import hardware as hd
from probing.analyze.cause import (
    MIN_DELTA_MS,
    MIN_DELTA_SHARE,
    TOP,
    Why,
    lateness_ms,
    median,
    per_collective,
    step_ms,
)
from probing.analyze.collectives import Collective, by_comm
from probing.analyze.stragglers import Straggler

CAUSES = ("function", "cpu_starvation", "cuda", "gpu", "cpu")  # what a verdict may blame
HARDWARE = ("gpu", "cpu")  # causes told by their figures, not by time per step
NOTHING = "unexplained"  # sampled, and no cause of its own found
UNREAD = "unread"  # its samples (or the others', to compare with) were not read


def explain(
    s: Straggler,
    samples: list[dict[str, Any]],
    collectives: list[Collective],
    cuda: list[dict[str, Any]] | None = None,
    *,
    step: float | None = None,
    unit: str = "step",
    gpus: list[dict[str, Any]] | None = None,
    cpus: list[dict[str, Any]] | None = None,
) -> list[Why]:
    """What makes ``s.rank`` slow: the causes by how much of its lateness each
    explains (``share``), the largest first, then the collectives. ``step``
    (ms): the job's step, else from its collectives; ``unit`` names it;
    ``gpus``: NVML's figures per rank and GPU over the window (``NVML_SQL``);
    ``cpus``: the CPU each rank runs on, its clock and its node's steal (``CPU_SQL``)."""
    step = step or s.step_ms or step_ms(collectives, s.comm)
    if not step:
        return []
    prof = fn.profile(samples, cuda or [])
    r = s.rank
    others = [q for q in prof.funcs if q != r and prof.span.get(q)]
    out: list[Why] = []
    sampled = r in prof.funcs and bool(prof.span.get(r)) and bool(others)
    if sampled:
        out += fn.functions(s, prof, others, step)
    out += _cuda(s, cuda or [], step, collectives, prof.span)
    out += hd.gpu(s, gpus or [])
    out += hd.cpu(s, cpus or [])
    late = lateness_ms(s, step)
    for w in out:  # the GPU's share is that of what it makes the rank wait in (headline)
        if late > 0 and w.kind not in HARDWARE:
            w.share = round(min(1.0, max(0.0, w.extra_ms) / late), 2)
        if unit != "step":
            w.text = w.text.replace("ms/step", f"ms/{unit}")
    if sampled and not any(w.kind in CAUSES for w in out):  # its samples say: not its own
        out.append(Why(r, NOTHING, "nothing of its own", None, None, 0.0, 0.0, text=(
            f"rank {r}: nothing of its own explains it: its functions, their waits for a "
            "CPU, its CUDA calls and its hardware are as the others' (another process "
            "on its CPU, or its network?)")))  # fmt: skip
    return by_share(out) + _collectives(s, collectives, step)


def unread(s: Straggler, samples: list[dict[str, Any]] | None, unheard: set[int]) -> Why:
    """Why ``s.rank``'s cause is not known, where nothing was found: what of
    its samples (SAMPLES_SQL rows; None: not asked or not answered) is
    missing, and what to do about it."""
    r = s.rank
    mine = [row for row in samples or [] if row.get("rank", r) == r]
    theirs = [row for row in samples or [] if row.get("rank", r) != r]
    if samples is None:
        why = "its stack samples could not be read (diagnose again, or with a longer --timeout)"
    elif r in unheard:
        why = (
            f"rank {r} did not answer in time for its stack samples (diagnose again, "
            "or with a longer --timeout)"
        )
    elif not mine:
        why = (
            f"no stack samples of rank {r} in the window: trace it with stacks "
            "(probing trace, without --no-stacks)"
        )
    elif not theirs:
        why = "no stack samples of the other ranks to compare it with"
    else:
        why = "its samples were too few to compare with the others'"
    return Why(
        r, UNREAD, "not read", None, None, 0.0, 0.0, text=f"rank {r}: its cause is not known: {why}"
    )


def _waited(w: Why) -> bool:
    """A function slower by its wait for a CPU, not by more work: its time
    on and off CPU within twice the others' whole time, and less than its wait."""
    work = (w.on_cpu_ms or 0) + (w.off_cpu_ms or 0)
    return w.kind == "function" and work <= 2 * w.others_ms_per_step and (w.runq_ms or 0) > work


def by_share(why: Sequence[Why]) -> list[Why]:
    """The causes, the one that explains most first; where the rank is starved,
    a function slower by its wait for a CPU comes after the starvation (that
    wait is the starvation's, told function by function)."""
    starved = {w.rank: w.extra_ms for w in why if w.kind == "cpu_starvation"}

    def key(w: Why) -> float:
        if w.rank in starved and _waited(w):
            return -min(w.extra_ms, starved[w.rank]) + 1e-6
        return -w.extra_ms

    return sorted(why, key=key)


def headline(why: Sequence[Why], rank: int) -> Why | None:
    """The cause that explains most of ``rank``'s lateness (None: no cause found).
    Slower hardware heads what it makes longer: its GPU the CUDA waits (and
    the functions whose time is in them), its CPU a wait for a CPU or the
    same code running slower; never a function's extra work."""
    mine = by_share([w for w in why if w.rank == rank and w.kind in CAUSES])
    mine = [w for w in mine if w.kind not in HARDWARE]
    top = mine[0] if mine else None
    # a function doing work the others do not do is the cause, even where the
    # rank waits for a CPU meanwhile (on a loaded node, extra work waits too)
    work = next((w for w in mine if w.kind == "function" and (w.share or 0) >= MIN_DELTA_SHARE
                 and (w.on_cpu_ms or 0) + (w.off_cpu_ms or 0) > 2 * w.others_ms_per_step),
                None)  # fmt: skip
    if top is not None and top.kind == "cpu_starvation" and work is not None:
        top = work
    gpu = next((w for w in why if w.rank == rank and w.kind == "gpu"), None)
    cpu = next((w for w in why if w.rank == rank and w.kind == "cpu"), None)
    if top is None:
        return gpu or cpu
    in_cuda = top.kind == "cuda" or any(
        w.kind == "cuda" and w.extra_ms >= 0.5 * top.extra_ms for w in mine
    )
    extra_work = top.kind == "function" and top.others_ms_per_step < 0.5 * top.ms_per_step
    off_cpu = (top.off_cpu_ms or 0) >= (top.on_cpu_ms or 0)
    # the same code on a slower CPU: the function slower by no more than the clock
    clocked = (
        cpu is not None and cpu.slower is not None and top.kind == "function" and not off_cpu
        and top.others_ms_per_step > 0
        and top.ms_per_step / top.others_ms_per_step <= 1.25 * cpu.slower
    )  # fmt: skip
    for hw, heads in (
        (gpu, in_cuda or (top.kind == "function" and off_cpu and not extra_work)),
        (cpu, top.kind == "cpu_starvation" or clocked),
    ):
        if hw is not None and heads:
            hw.share = top.share
            return hw
    return top


def _collectives(s: Straggler, collectives: list[Collective], step: float) -> list[Why]:
    """Time inside collectives per step: the others wait there for the straggler.
    Collectives in flight at once (DDP's buckets, launched back to back) count
    once: the time some collective of the rank's was in flight."""
    spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    count: dict[int, int] = defaultdict(int)
    done = by_comm(collectives).get(s.comm, [])
    if not done:
        return []
    per = per_collective(s, done)
    for c in done:
        for q, t in c.ts.items():
            end = c.end.get(q)
            if end is not None:
                spans[q].append((t, end))
                count[q] += 1
    total = {q: _covered_ns(v) / 1e6 for q, v in spans.items()}
    if s.rank not in total or len(total) < 2:
        return []
    mine = total[s.rank] / count[s.rank] / per
    theirs = median([total[q] / count[q] / per for q in total if q != s.rank])
    return [
        Why(
            s.rank, "collectives", f"collectives on {s.comm}", None, None, round(mine, 2),
            round(theirs, 2),
            text=f"rank {s.rank}: inside collectives {mine:.1f} ms/step vs {theirs:.1f} ms "
            "on the others (they wait there for it)",
        )
    ]  # fmt: skip


def _covered_ns(spans: list[tuple[int, int]]) -> int:
    """The time some of ``spans`` (start, end ns) covers: their union's length."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def _cuda(
    s: Straggler,
    rows: list[dict[str, Any]],
    step: float,
    collectives: list[Collective],
    span: dict[int, float],
) -> list[Why]:
    """CUDA call time (launches, copies, synchronisation) per API, per step:
    over the time sampled where the sampler ran (``span``, ns: as the
    functions' time), else over the steps its collectives count."""
    if not rows:
        return []
    steps: dict[int, float] = defaultdict(float)
    done = by_comm(collectives).get(s.comm, [])
    per = per_collective(s, done) if done else 1.0
    for c in done:
        for q in c.ts:
            steps[q] += per
    for q, ns in span.items():
        if ns and q in steps:
            steps[q] = ns / 1e6 / step
    by: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for row in rows:
        by[str(row.get("api"))][row["rank"]] += float(row.get("dur_ns") or 0) / 1e6
    out = []
    floor = max(MIN_DELTA_MS, MIN_DELTA_SHARE * lateness_ms(s, step))
    for api, per_rank in by.items():
        if not steps.get(s.rank):
            continue
        mine = per_rank.get(s.rank, 0.0) / steps[s.rank]
        theirs = median([per_rank.get(q, 0.0) / n for q, n in steps.items() if q != s.rank])
        if mine - theirs >= floor:
            out.append(
                Why(
                    s.rank, "cuda", api, None, None, round(mine, 2), round(theirs, 2),
                    text=f"rank {s.rank}: CUDA {api} {mine:.1f} ms/step vs {theirs:.1f} ms "
                    "on the others",
                )
            )  # fmt: skip
    return sorted(out, key=lambda w: w.others_ms_per_step - w.ms_per_step)[:TOP]
