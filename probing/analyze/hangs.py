"""Hangs: a collective some ranks entered and others have not, for N seconds.

Three kinds of evidence, all pure functions here:

* traced: a call still in flight (``<family>.inflight``, NULL ``dur_ns``)
  in some ranks, its matched k-th collective absent in others, entered at
  least ``hang_after_s`` ago;
* snapshot, when probing attached after the job already hung (no call
  enters or returns any more, so nothing is traced): every rank's
  collective count per process group (torch's own sequence numbers) and its
  current Python stacks. Ranks whose count is ahead entered a collective
  the others never reached, and their stacks sit in one now; the counts
  must not have moved for ``hang_after_s`` (the caller observes that: a
  trace that stopped says nothing of how long they stood still);
* recorded, traced or not: PyTorch's Flight Recorder (``comm.flight``)
  of every rank, its own sequence numbers, ops and sizes, stamped with
  when each collective was issued (``probing.analyze.flight``).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Collection, Mapping
from typing import Any

from probing.analyze import flight
from probing.analyze.collectives import Collective

HANG_AFTER_S = 10.0

# a Python frame that is waiting on a collective (torch.distributed, DDP, autograd)
_IN_COLLECTIVE = re.compile(
    r"torch/(distributed|nn/parallel|autograd)/|(^|\.)(all_reduce|allreduce|barrier|"
    r"broadcast|all_gather|reduce_scatter|all_to_all)$"
)


@dataclasses.dataclass
class Hang:
    comm: str
    seq: int
    op: str | None
    missing_ranks: list[int]
    waiting_ranks: list[int]
    age_s: float  # how long the first waiting rank has waited (a lower bound)
    evidence: str  # "traced", "flight recorder", "stacks and counts" or "stacks"
    stacks: dict[int, list[str]]  # rank -> its main thread, innermost frame first
    detail: str = ""  # what else the evidence says (the recorder's tensors, last ops)


@dataclasses.dataclass
class RankState:
    """One rank's snapshot: collective counts per group and its Python stacks."""

    rank: int
    node: str
    counts: dict[str, int]  # process group -> collectives issued so far
    frames: list[dict[str, Any]]  # process.stacks rows


# a thread that only waits for another to finish (a launcher's main thread
# joining the one that trains): its innermost frame is in threading's join
_JOINS = re.compile(r"(^|\.)(join|_wait_for_tstate_lock)$")


def main_stack(frames: list[dict[str, Any]], trainers: Collection[int] = ()) -> list[str]:
    """The frames of the thread that trains, innermost first: the one that
    issued the rank's collectives (``trainers``: their tids), else one that
    sits in a collective now, else the main thread unless it only joins
    another (a launcher's loop in a ``threading.Thread``): then the deepest
    other thread; else the first thread."""
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for f in frames:
        by_thread[(f.get("tid"), f.get("thread"))].append(f)
    if not by_thread:
        return []
    pick = _trainer(by_thread, trainers)
    rows = sorted(by_thread[pick], key=lambda f: f.get("depth") or 0)
    state = rows[0].get("state") if rows else None
    head = [f"thread {pick[1]} ({pick[0]}) {state or ''}".rstrip()]
    return head + [f"{f.get('func')} ({short_path(f.get('file'))}:{f.get('line')})" for f in rows]


def _trainer(by_thread: dict[Any, list[dict[str, Any]]], trainers: Collection[int]) -> Any:
    """``main_stack``'s choice of thread (a ``(tid, name)`` key of ``by_thread``)."""
    issued = [t for t in by_thread if t[0] is not None and t[0] in trainers]
    inside = [t for t in by_thread if in_collective(by_thread[t])]
    for chosen in ([t for t in issued if t in inside], issued, inside):
        if chosen:
            return chosen[0]
    main = next((t for t in by_thread if t[1] == "MainThread"), None)
    others = [t for t in by_thread if t != main]
    if main is not None and not (others and _only_joins(by_thread[main])):
        return main
    return max(others, key=lambda t: len(by_thread[t])) if others else next(iter(by_thread))


def _only_joins(frames: list[dict[str, Any]]) -> bool:
    """Whether a thread's innermost frames wait for another thread to end."""
    inner = sorted(frames, key=lambda f: f.get("depth") or 0)[:2]
    return any(_JOINS.search(str(f.get("func") or "")) for f in inner)


def short_path(path: str | None) -> str:
    """``.../site-packages/torch/autograd/graph.py`` -> ``torch/autograd/graph.py``."""
    text = str(path or "?")
    for marker in ("site-packages/", "dist-packages/", "/lib/python3."):
        if marker in text:
            rest = text.split(marker, 1)[1]
            return rest.split("/", 1)[1] if marker.startswith("/lib") and "/" in rest else rest
    return text


def in_collective(frames: list[dict[str, Any]]) -> bool:
    """Whether any Python thread sits in a collective (or waits on one)."""
    return any(
        _IN_COLLECTIVE.search(str(f.get(key) or "")) for f in frames for key in ("file", "func")
    )


def traced_hangs(
    collectives: list[Collective],
    ranks: list[int],
    now_ns: int,
    hang_after_s: float = HANG_AFTER_S,
    frames: dict[int, list[dict[str, Any]]] | None = None,
    trainers: Mapping[int, Collection[int]] | None = None,
) -> list[Hang]:
    """Collectives in flight in some ranks and not entered by others for long enough;
    or entered by every rank and left by none (the collective itself is stuck).
    A collective of a size not said (a Gloo context traced after its creation)
    entered by one rank alone is not "every rank": the other ranks that
    answered (``ranks``) are its members, and those not in it never entered it."""
    out = []
    # a communicator's members: the ranks seen in it (a subgroup is not the world),
    # or every rank where it spans the world and one was never seen
    seen: dict[str, set[int]] = defaultdict(set)
    for c in collectives:
        seen[c.comm] |= set(c.ts)
    for c in collectives:
        inside = [r for r, e in c.end.items() if e is None]
        if not inside:
            continue
        members = seen[c.comm]
        if len(members) < c.nranks and len(ranks) == c.nranks:
            members = set(ranks)
        elif len(members) < 2 <= len(ranks):  # its size unknown: not one rank's group
            members = set(ranks)
        missing = sorted(members - set(c.ts))
        age = (now_ns - min(c.ts[r] for r in inside)) / 1e9
        stuck = not missing and len(inside) == len(c.ts) >= max(c.nranks, 2)
        if (not missing and not stuck) or age < hang_after_s:
            continue
        out.append(Hang(c.comm, c.seq, c.op, missing, sorted(inside), round(age, 1), "traced", {}))
    out.sort(key=lambda h: (-h.age_s, h.comm, h.seq))  # the first stall first, every time
    return _with_stacks(out, frames or {}, trainers)


def snapshot_hangs(
    states: list[RankState],
    stalled_s: float,
    hang_after_s: float = HANG_AFTER_S,
    trainers: Mapping[int, Collection[int]] | None = None,
) -> list[Hang]:
    """From counts and stacks alone: ranks ahead in a group wait for those behind."""
    if stalled_s < hang_after_s:
        return []
    groups: dict[str, dict[int, int]] = defaultdict(dict)
    for s in states:
        for g, n in s.counts.items():
            groups[g][s.rank] = n
    out = []
    frames = {s.rank: s.frames for s in states}
    for g, counts in groups.items():
        top = max(counts.values())
        missing = sorted(r for r, n in counts.items() if n < top)
        waiting = sorted(r for r, n in counts.items() if n == top)
        if not missing:
            continue
        if any(frames.get(r) and not in_collective(frames[r]) for r in waiting):
            continue  # a rank ahead that is not in a collective now does not wait in one
        label = f"process group {g}"
        out.append(Hang(label, top - 1, None, missing, waiting, stalled_s, "stacks and counts", {}))
    if not groups:  # no counts at all: who sits in a collective, who does not
        inside = sorted(s.rank for s in states if in_collective(s.frames))
        outside = sorted(s.rank for s in states if not in_collective(s.frames))
        if inside and outside:
            out.append(Hang("?", -1, None, outside, inside, stalled_s, "stacks", {}))
    return _with_stacks(out, {s.rank: s.frames for s in states}, trainers)


def recorded_hangs(
    recorded: flight.Gathered,
    now_ns: int,
    hang_after_s: float = HANG_AFTER_S,
    frames: dict[int, list[dict[str, Any]]] | None = None,
    trainers: Mapping[int, Collection[int]] | None = None,
) -> list[Hang]:
    """From every rank's Flight Recorder: ranks behind in a group never entered
    the collective the others wait in (or all wait in it and none leaves)."""
    out = [
        Hang(
            flight.group_name(s.pg, s.desc), s.seq, s.op, s.missing_ranks, s.waiting_ranks,
            s.age_s, "flight recorder", {}, flight.detail(s),
        )
        for s in flight.stalls(recorded.rows, recorded.status, now_ns, hang_after_s)
    ]  # fmt: skip
    return _with_stacks(out, frames or {}, trainers)


def _with_stacks(
    hangs: list[Hang],
    frames: dict[int, list[dict[str, Any]]],
    trainers: Mapping[int, Collection[int]] | None = None,
) -> list[Hang]:
    """``hangs`` with the stacks of their missing ranks and first waiting one:
    each rank's thread that trains (``main_stack``; ``trainers``: rank -> the
    tids that issued its collectives)."""
    trainers = trainers or {}
    for h in hangs:
        shown = [*h.missing_ranks, *h.waiting_ranks[:1]]
        h.stacks = {r: main_stack(frames[r], trainers.get(r, ())) for r in shown if frames.get(r)}
    return hangs
