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
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from probing.analyze.collectives import Collective, by_comm
from probing.analyze.hangs import short_path
from probing.analyze.stragglers import Straggler

MIN_DELTA_MS = 1.0  # a function's extra time per step worth naming ...
MIN_DELTA_SHARE = 0.15  # ... and this share of the straggler's own excess
TOP = 3  # functions named per straggler
STARVED_SHARE = 0.5  # starved: its extra wait for a CPU is this share of its lateness ...
STARVED_NOISE = 2.0  # ... and this many times the spread of the others' waits
CAUSES = ("function", "cpu_starvation", "cuda", "gpu", "cpu")  # what a verdict may blame
HARDWARE = ("gpu", "cpu")  # causes told by their figures, not by time per step
NOTHING = "unexplained"  # sampled, and no cause of its own found
UNREAD = "unread"  # its samples (or the others', to compare with) were not read


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
    share: float | None = None  # of the straggler's lateness per step, what this explains

    @property
    def extra_ms(self) -> float:
        return self.ms_per_step - self.others_ms_per_step


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
    cs = by_comm(collectives).get(comm, [])
    if len(cs) < 3:
        return None
    starts = np.array(sorted(min(c.ts.values()) for c in cs), dtype=np.float64)
    per = steps_per_collective(cs)
    return float((starts[-1] - starts[0]) / 1e6 / ((len(starts) - 1) * per))


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


def _profile(rows: list[dict[str, Any]], cuda: Sequence[dict[str, Any]] = ()) -> Profile:
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


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else 0.0


def lateness_ms(s: Straggler, step: float) -> float:
    """How late the straggler makes each step: where the job's step is known
    (``s.step_ms``), what the job loses to it per step; else its typical
    excess, or what the job waits for it per step where it is late at a few
    collectives only (FSDP's gathers: a median excess of nothing)."""
    if s.step_ms > 0:
        return max(s.late_ms, s.share_of_step * step, 0.0)
    return max(s.excess_ms_median, s.share_of_step * step, 0.0)


def per_collective(s: Straggler, done: list[Collective]) -> float:
    """Steps per collective of ``s``'s communicator: one over its period where
    the job's step is known, else as the long gaps between them say."""
    return 1.0 / s.period if s.period else steps_per_collective(done)


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
    prof = _profile(samples, cuda or [])
    r = s.rank
    others = [q for q in prof.funcs if q != r and prof.span.get(q)]
    out: list[Why] = []
    sampled = r in prof.funcs and bool(prof.span.get(r)) and bool(others)
    if sampled:
        out += _functions(s, prof, others, step)
    out += _cuda(s, cuda or [], step, collectives, prof.span)
    out += _gpu(s, gpus or [])
    out += _cpu(s, cpus or [])
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


THROTTLE = {  # nvmlClocksEventReason* bits: why a GPU runs below its clock
    0x4: "power cap", 0x8: "hardware slowdown", 0x20: "thermal slowdown",
    0x40: "hardware thermal slowdown", 0x80: "power brake", 0x2: "application clocks",
}  # fmt: skip
GPU_EMPTY: dict[str, Any] = {"reasons": 0, "xids": 0, "ecc": 0, "xid": None}
GPU_SLOWER = 0.9  # its SM clock below this share of the others': the GPU is slower
LINK_SLOWER = 0.5  # its PCIe or NVLink rate below this share of the others'


CPU_SLOWER = 0.85  # its CPU's clock below this share of the others': a slower CPU
STEAL_MORE = 10.0  # points of steal above the others' that make a hypervisor the cause


def _cpu(s: Straggler, rows: list[dict[str, Any]]) -> list[Why]:
    """The CPU the straggler runs on against the others': a lower clock, or
    more of its node's time taken by a hypervisor (steal)."""
    per = {row["rank"]: row for row in rows}
    r = s.rank
    others = [per[q] for q in per if q != r]
    if r not in per or not others:
        return []
    me, said = per[r], []

    def theirs(key: str) -> float | None:
        got = [float(o[key]) for o in others if o.get(key) is not None]
        return _median(got) if got else None

    mhz = theirs("mhz")
    slower = None
    if me.get("mhz") and mhz and me["mhz"] < CPU_SLOWER * mhz:
        slower = round(mhz / me["mhz"], 2)
        said.append(
            f"its CPU runs at {me['mhz'] / 1000:.2f} GHz vs {mhz / 1000:.2f} GHz on the others"
        )
    # steal is the node's: ranks of one node differ only by the instant each
    # read it (0.1 s of a noisy figure), so it is told against other nodes only
    elsewhere = [
        float(o["steal_pct"])
        for o in others
        if o.get("node") != me.get("node") and o.get("steal_pct") is not None
    ]
    steal = _median(elsewhere) if elsewhere else None
    if (
        steal is not None
        and me.get("steal_pct") is not None
        and me["steal_pct"] >= steal + STEAL_MORE
    ):
        said.append(
            f"a hypervisor takes {me['steal_pct']:.0f} % of its node's CPU time "
            f"({steal:.0f} % on the other nodes')"
        )
    if not said:
        return []
    return [Why(r, "cpu", said[0].split(" vs ")[0].split(" (")[0], None, None, 0.0, 0.0,
                slower=slower, text=f"rank {r}: " + "; ".join(said))]  # fmt: skip


def _gpu(s: Straggler, rows: list[dict[str, Any]]) -> list[Why]:
    """The straggler's GPU against the others' (NVML over the window): a
    lower SM clock (and the throttle reasons only it has), XID or
    uncorrected ECC errors only it has, a slower PCIe or NVLink."""
    per: dict[int, dict[str, Any]] = {}
    for row in rows:  # several GPUs per rank: their mean clock, every reason and error
        p = per.setdefault(row["rank"], dict(GPU_EMPTY, mhz=[], pcie=[], nvlink=[], temp=[]))
        if row.get("sm_mhz") is not None:
            p["mhz"].append(float(row["sm_mhz"]))
        p["reasons"] |= int(row.get("reasons") or 0)
        p["xids"] += int(row.get("xids") or 0)
        p["xid"] = row.get("xid") or p["xid"]
        p["ecc"] = max(p["ecc"], int(row.get("ecc") or 0))
        if row.get("pcie_kbs") is not None:
            p["pcie"].append(float(row["pcie_kbs"]))
        if row.get("nvlink_kib") is not None and row.get("span_ns"):
            p["nvlink"].append(float(row["nvlink_kib"]) / (row["span_ns"] / 1e9))
        if row.get("temp_c") is not None:
            p["temp"].append(float(row["temp_c"]))
    r = s.rank
    others = [q for q in per if q != r]
    if r not in per or not others:
        return []
    me = per[r]

    def theirs(key: str) -> float:
        return _median([float(np.mean(per[q][key])) for q in others if per[q][key]])

    out = []
    said: list[str] = []
    if me["mhz"] and theirs("mhz") > 0 and np.mean(me["mhz"]) < GPU_SLOWER * theirs("mhz"):
        common = -1
        for q in others:
            common &= per[q]["reasons"]
        only = [name for bit, name in THROTTLE.items() if me["reasons"] & bit & ~common]
        if me["temp"] and any("thermal" in name for name in only):
            only.append(f"{np.mean(me['temp']):.0f} C")
        why = f" ({', '.join(only)})" if only else ""
        said.append(
            f"its GPU runs at {np.mean(me['mhz']) / 1000:.2f} GHz vs "
            f"{theirs('mhz') / 1000:.2f} GHz on the others{why}"
        )
    if me["xids"] and not any(per[q]["xids"] for q in others):
        said.append(f"its GPU reported {me['xids']} XID error(s) (last: XID {me['xid']})")
    if me["ecc"] > max(per[q]["ecc"] for q in others):
        said.append(f"its GPU has {me['ecc']} uncorrected ECC error(s)")
    for key, name in (("pcie", "PCIe"), ("nvlink", "NVLink")):
        if me[key] and theirs(key) > 0 and np.mean(me[key]) < LINK_SLOWER * theirs(key):
            said.append(
                f"its {name} moves {np.mean(me[key]) / 1024:.0f} MB/s vs "
                f"{theirs(key) / 1024:.0f} MB/s on the others"
            )
    if said:
        out.append(
            Why(
                r, "gpu", said[0].split(" vs ")[0], None, None, 0.0, 0.0,
                text=f"rank {r}: " + "; ".join(said),
            )
        )  # fmt: skip
    return out


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


def _functions(s: Straggler, p: Profile, others: list[int], step: float) -> list[Why]:
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
        theirs = _median([ms(q, key, every) for q in others])
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
        if _median([ms(q, key, work) for q in others]) < 0.5 * ms(r, key, work):
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
    runq, runq_others = runq_of(r), _median(theirs_runq)
    spread = max(theirs_runq) - min(theirs_runq) if theirs_runq else 0.0
    out = []
    # starved: the functions that differ least run slower too (not one function's
    # extra work waiting for a CPU on a busy machine): their on-CPU + run-queue
    # time against the others', weighted by the others' time, leaving out the top one
    ratios, weights = [], []
    for d in deltas[1:]:
        key = d.key
        theirs = _median([ms(q, key, ("cpu", "runq")) for q in others])
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
    theirs = _median([total[q] / count[q] / per for q in total if q != s.rank])
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
