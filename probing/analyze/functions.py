"""A straggler's own Python code against the others': each function's time
per step on a CPU, off it and waiting for one (``python.samples``), from
the threads that train (``profile``); the functions it spends more in, the
extra work it does, or a CPU it is starved of (``functions``)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from probing.analyze.cause import (
    MIN_DELTA_MS,
    MIN_DELTA_SHARE,
    TOP,
    Why,
    lateness_ms,
    median,
)
from probing.analyze.hangs import short_path
from probing.analyze.stragglers import Straggler

STARVED_SHARE = 0.5  # starved: its extra wait for a CPU is this share of its lateness ...
STARVED_NOISE = 2.0  # ... and this many times the spread of the others' waits
MAIN_THREAD = "MainThread"  # Python's name for the thread that usually trains


@dataclasses.dataclass
class Profile:
    funcs: dict[int, dict[Any, dict[str, Any]]]  # rank -> (file, func) -> kind -> ns (and "line")
    span: dict[int, float]  # rank -> the sampled wall time (ns)
    native_runq: dict[int, float]  # rank -> ns its threads without Python waited for a CPU


def trains(row: dict[str, Any], issuers: dict[int, set[int]]) -> bool:
    """Whether a sampled row's thread is one that trains: it issued the rank's
    collectives (``trains``, SAMPLES_SQL) or launched its kernels (``issuers``:
    rank -> tids, ``launchers``), whatever its name (a launcher that runs the
    loop in a ``threading.Thread``), or it is the main thread."""
    if row.get("trains") or row.get("thread") == MAIN_THREAD:
        return True
    tid = row.get("tid")
    return tid is not None and tid in issuers.get(row["rank"], ())


def launchers(cuda: Sequence[dict[str, Any]]) -> dict[int, set[int]]:
    """rank -> the threads that launched its kernels (CUDA_SQL's rows): those
    that train; a pin-memory thread copies, it launches nothing."""
    out: dict[int, set[int]] = defaultdict(set)
    for call in cuda:
        if call.get("tid") is not None and "Launch" in str(call.get("api") or ""):
            out[call["rank"]].add(int(call["tid"]))
    return out


def profile(rows: list[dict[str, Any]], cuda: Sequence[dict[str, Any]] = ()) -> Profile:
    prof: dict[int, dict[Any, dict[str, Any]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(float))
    )
    lines: dict[tuple[int, Any, Any], dict[Any, float]] = defaultdict(lambda: defaultdict(float))
    vias: dict[tuple[int, Any, Any], dict[Any, float]] = defaultdict(lambda: defaultdict(float))
    span: dict[int, float] = defaultdict(float)
    native: dict[int, float] = defaultdict(float)
    # a Python thread other than those that train is off CPU while it idles
    # (Lightning's child observer, a pin-memory or logger thread, a launcher's
    # main thread waiting for the one that trains): only its work and its waits
    # for a CPU can delay the rank, not its sleep
    issuers = launchers(cuda)
    known = {row["rank"] for row in rows if row["kind"] != "tick" and trains(row, issuers)}
    for row in rows:
        r, kind, ns = row["rank"], row["kind"], float(row["dur_ns"] or 0)
        if kind == "tick":
            span[r] += ns
            continue
        if kind == "off" and r in known and not trains(row, issuers):
            continue
        key = (row.get("file"), row.get("func"))
        if row.get("loader"):  # waiting for its DataLoader's workers: their slowness
            key = LOADER
        elif key == (None, None):  # threads without Python (pools, Gloo's): idle, or working
            if kind == "runq":  # for a Python caller, whose own time says as much; but
                native[r] += ns  # their wait for a CPU delays that caller too
            continue
        prof[r][key][kind] += ns
        at = (r, *key)
        lines[at][row.get("line")] += ns
        if row.get("via_func"):
            vias[at][(row.get("via_file"), row["via_func"])] += ns
    for (r, *fn), by_line in lines.items():
        prof[r][tuple(fn)]["line"] = max(by_line, key=by_line.__getitem__) or 0
    for (r, *fn), by_via in vias.items():
        prof[r][tuple(fn)]["via"] = max(by_via, key=by_via.__getitem__)
    return Profile(prof, span, native)


LOADER = (None, "its DataLoader's worker processes")  # the key of time waiting for them
LOADER_SLOW = ": its workers take longer for a batch than the others'"


def via_text(via: tuple[str | None, str] | None) -> str:
    """`` via transformers Trainer._get_batch``: the library frame that called
    the user's function (its package, then its function)."""
    if not via:
        return ""
    file, func = via
    package = short_path(file).split("/", 1)[0] if file else ""
    return f" via {package} {func}" if package and not package.endswith(".py") else f" via {func}"


def _per_step(ns: float, span_ns: float, step: float) -> float:
    return ns / span_ns * step if span_ns else 0.0


class Delta(NamedTuple):
    """One function's time per step on the straggler against the others'."""

    extra: float  # mine - theirs
    key: tuple[Any, Any]  # (file, func)
    mine: float
    theirs: float


def functions(s: Straggler, p: Profile, others: list[int], step: float) -> list[Why]:
    """The straggler's functions against the ``others``' (time per step of
    ``step`` ms): CPU starvation where its wait for a CPU accounts for its
    lateness, then the (at most ``TOP``) functions it spends the most extra time
    in, each at least ``MIN_DELTA_MS`` and ``MIN_DELTA_SHARE`` of its lateness."""
    deltas = _deltas(s.rank, p, others, step)
    top = _extra_work(s.rank, p, others, step, deltas)
    floor = max(MIN_DELTA_MS, MIN_DELTA_SHARE * lateness_ms(s, step))
    starved = _starvation(s, p, others, step, deltas, top, floor)
    return starved + _slow_functions(s, p, step, deltas, floor)


def _ms(p: Profile, step: float, q: int, key: tuple[Any, Any], kinds: tuple[str, ...]) -> float:
    """Rank ``q``'s time per step in the function ``key`` (file, func), of ``kinds``."""
    got = p.funcs[q].get(key, {})
    return _per_step(sum(got.get(k, 0.0) for k in kinds), p.span[q], step)


def _deltas(r: int, p: Profile, others: list[int], step: float) -> list[Delta]:
    """Every function sampled on rank ``r`` or the others: its time per step
    (every kind) on ``r`` against the others' median, the most extra first."""
    ms = partial(_ms, p, step)
    keys = set(p.funcs[r]) | {k for q in others for k in p.funcs[q]}
    every = ("cpu", "off", "runq")
    deltas = []
    for key in keys:
        mine = ms(r, key, every)
        theirs = median([ms(q, key, every) for q in others])
        deltas.append(Delta(mine - theirs, key, mine, theirs))
    deltas.sort(key=lambda d: -d.extra)
    return deltas


def _extra_work(
    r: int, p: Profile, others: list[int], step: float, deltas: list[Delta]
) -> tuple[Any, Any] | None:
    """The function that differs most (the first of ``deltas``) where it is rank
    ``r``'s extra work; else None."""
    ms = partial(_ms, p, step)
    # the function that differs most, where it is extra work (over twice the others'
    # time on and off CPU), not the same code waiting longer for a CPU: that work
    # waits for a CPU as well, and it is the function's, not the machine's fault
    top: tuple[Any, Any] | None = None
    if deltas:
        key = deltas[0].key
        work = ("cpu", "off")
        if median([ms(q, key, work) for q in others]) < 0.5 * ms(r, key, work):
            top = key
    return top


def _starvation(
    s: Straggler, p: Profile, others: list[int], step: float, deltas: list[Delta],
    top: tuple[Any, Any] | None, floor: float,
) -> list[Why]:  # fmt: skip
    """CPU starvation of the straggler, where its wait for a CPU per step
    (outside ``top``, its extra work) is at least ``floor`` longer than the
    others' and accounts for its lateness (``STARVED_SHARE``, ``STARVED_NOISE``);
    with how much slower its other functions run."""
    r, prof, span = s.rank, p.funcs, p.span
    ms = partial(_ms, p, step)

    def runq_of(q: int) -> float:
        """Its wait for a CPU per step, every thread's, outside ``top``."""
        py = sum(ms(q, k, ("runq",)) for k in prof[q] if k != top)
        return py + _per_step(p.native_runq.get(q, 0.0), span[q], step)

    theirs_runq = [runq_of(q) for q in others]
    runq, runq_others = runq_of(r), median(theirs_runq)
    spread = max(theirs_runq) - min(theirs_runq) if theirs_runq else 0.0
    out = []
    # starved: the functions that differ least run slower too (not one function's
    # extra work waiting for a CPU on a busy machine): their on-CPU + run-queue
    # time against the others', weighted by the others' time, leaving out the top one
    ratios, weights = [], []
    for d in deltas[1:]:
        key = d.key
        theirs = median([ms(q, key, ("cpu", "runq")) for q in others])
        if theirs >= 0.5:
            ratios.append(ms(r, key, ("cpu", "runq")) / theirs)
            weights.append(theirs)
    slower = float(np.average(ratios, weights=weights)) if ratios else None
    # a wait for a CPU that accounts for most of its lateness, well beyond how
    # the others' waits differ among themselves (a busy machine that favours
    # them, a hog on its CPU); ``slower`` (every function slower) says it too
    extra = runq - runq_others
    starved = extra >= STARVED_SHARE * lateness_ms(s, step) and extra >= STARVED_NOISE * spread
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
    return out


def _slow_functions(
    s: Straggler, p: Profile, step: float, deltas: list[Delta], floor: float
) -> list[Why]:
    """The (at most ``TOP``) functions of ``deltas`` in which the straggler
    spends at least ``floor`` more time per step than the others, each with
    where it is and the kind of time most of it is."""
    r, prof = s.rank, p.funcs
    ms = partial(_ms, p, step)
    every = ("cpu", "off", "runq")
    out = []
    for d in deltas[:TOP]:
        if d.extra < floor:
            break
        key, mine, theirs = d.key, d.mine, d.theirs
        file, func = key
        parts = {k: ms(r, key, (k,)) for k in every}
        line = int(prof[r].get(key, {}).get("line", 0) or 0) or None
        where = f" ({short_path(file)}:{line})" if file else ""
        where += via_text(prof[r].get(key, {}).get("via"))
        most = max(parts, key=parts.__getitem__)
        how = {"cpu": "on CPU", "off": "off CPU", "runq": "waiting for a CPU"}[most]
        out.append(
            Why(
                r, "function", str(func), file, line, round(mine, 2), round(theirs, 2),
                on_cpu_ms=round(parts["cpu"], 2), off_cpu_ms=round(parts["off"], 2),
                runq_ms=round(parts["runq"], 2),
                text=f"rank {r}: {'waits for ' if key == LOADER else ''}{func}{where} "
                f"{mine:.1f} ms/step vs {theirs:.1f} ms on the others (mostly {how})"
                + (LOADER_SLOW if key == LOADER else ""),
            )
        )  # fmt: skip
    return out
