"""Hangs told by PyTorch's Flight Recorder (``comm.flight`` of every rank).

torch numbers each process group's collectives in every rank alike
(``seq``: 1, 2, …), and records each as it is issued, retired once done,
whether probing traces or not. Gathered from every rank, the records say
where each rank stands in each group: the last collective it entered and
the last it completed. In a group whose ranks stand at different places,
the ranks behind never entered collective N = (the lowest place) + 1,
and the ranks ahead wait in it; where every rank entered the last one and
none completed it, the collective itself is stuck. Either counts as a hang
once the first record of N is ``hang_after_s`` old. Point-to-point records
(``is_p2p``) are left out: a send pairs two ranks, not the group.

Pure functions over rows (dicts with ``rank`` and the ``comm.flight``
columns); ``gather`` is the one that asks.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from probing.errors import ProbingError

# what every rank is asked; ``{tags}`` is ", node, rank" in a cluster query
FLIGHT_SQL = (
    "SELECT pg, pg_desc, op, seq, state, retired, input_sizes, input_dtypes, bytes, ts{tags} "
    "FROM comm.flight WHERE NOT is_p2p"
)
STATUS_SQL = "SELECT state, reason, records{tags} FROM comm.flight_status"
DEFAULT_PG = "default_pg"  # torch's description of the world group
# ops whose every rank gives tensors of one shape (scatter, gather and all-to-all
# may differ by rank: only their op is compared)
SAME_SHAPES = ("reduce", "broadcast", "all_gather", "allgather")
TURN_ON = "TORCH_FR_BUFFER_SIZE=2000 in the job's environment"


class Gathered(NamedTuple):
    """Every rank's records and its recorder's state (``comm.flight_status``)."""

    rows: list[dict[str, Any]]
    status: list[dict[str, Any]]


@dataclasses.dataclass
class Place:
    """Where one rank stands in one process group."""

    entered: int  # the last collective it entered (0: none recorded)
    completed: int  # the last it completed
    op: str | None  # the op of the last it entered


@dataclasses.dataclass
class Stall:
    pg: str
    desc: str
    seq: int
    op: str
    sizes: list[list[int]]  # input tensors' shapes
    dtypes: list[str]
    bytes: int | None
    missing_ranks: list[int]  # never entered ``seq`` (empty: every rank did, none left)
    waiting_ranks: list[int]
    age_s: float  # since the first rank entered ``seq``
    places: dict[int, Place]  # every member of the group
    disagree: dict[int, str]  # ranks that entered ``seq`` as another op or with other sizes


def gather(ask: Callable[[str], Any], remote: bool) -> Gathered | None:
    """``comm.flight`` and ``comm.flight_status`` of every rank (``ask``: SQL in
    every rank, one table tagged ``node`` and ``rank``); None from probes
    that have no such tables."""
    tags = ", node, rank" if remote else ""
    try:
        status = ask(STATUS_SQL.format(tags=tags)).to_pylist()
        on = any(s["state"] == "on" for s in status)
        rows = ask(FLIGHT_SQL.format(tags=tags)).to_pylist() if on else []
    except ProbingError:
        return None
    return Gathered(rows, status)


def places(rows: Sequence[dict[str, Any]]) -> dict[str, dict[int, Place]]:
    """Process group -> rank -> where it stands, from its collectives' records."""
    out: dict[str, dict[int, Place]] = defaultdict(dict)
    for r in rows:
        if r.get("seq") is None or r.get("is_p2p"):
            continue
        p = out[r["pg"]].setdefault(r["rank"], Place(0, 0, None))
        if r["seq"] > p.entered:
            p.entered, p.op = r["seq"], r.get("op")
        if _done(r) and r["seq"] > p.completed:
            p.completed = r["seq"]
    return dict(out)


def _done(r: dict[str, Any]) -> bool:
    """Completed: NCCL's watchdog saw it end; Gloo's record retires when its work ends."""
    return r.get("state") == "completed" or bool(r.get("retired"))


def stalls(
    rows: Sequence[dict[str, Any]],
    status: Sequence[dict[str, Any]],
    now_ns: int,
    hang_after_s: float,
) -> list[Stall]:
    """Every group whose ranks have stood apart (or all inside one collective)
    for ``hang_after_s``, the oldest first. A group's members are the ranks
    with records of it, and in the world group the ranks whose recorder is
    on with no record yet (at 0; one with records of other groups only may
    have lost the world's to its ring, so it is left out)."""
    empty = sorted(s["rank"] for s in status if s.get("state") == "empty")
    by_pg: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_pg[r["pg"]].append(r)
    out = []
    for pg, members in places(rows).items():
        desc = by_pg[pg][0].get("pg_desc") or ""
        if desc == DEFAULT_PG:
            members = {r: members.get(r, Place(0, 0, None)) for r in {*empty, *members}}
        stall = _stall(pg, desc, members, by_pg[pg], now_ns)
        if stall is not None and stall.age_s >= hang_after_s:
            out.append(stall)
    out.sort(key=lambda s: (-s.age_s, s.pg))
    return out


def _stall(
    pg: str, desc: str, members: dict[int, Place], rows: Sequence[dict[str, Any]], now_ns: int
) -> Stall | None:
    """The stall of one group (``rows``: its records), however young; None if none."""
    low = min(p.entered for p in members.values())
    top = max(p.entered for p in members.values())
    if low < top:  # some never entered low + 1
        seq = low + 1
        missing = sorted(r for r, p in members.items() if p.entered < seq)
    elif all(p.completed < top for p in members.values()):  # all inside, none left
        seq, missing = top, []
    else:
        return None
    waiting = sorted(r for r in members if r not in missing)
    recs = sorted(
        (r for r in rows if r.get("seq") == seq and r["rank"] in members and not r.get("is_p2p")),
        key=lambda r: r["rank"],
    )
    if not recs:
        return None
    usual = Counter(_shape(r) for r in recs).most_common(1)[0][0]
    first = next(r for r in recs if _shape(r) == usual)
    disagree = {
        r["rank"]: f"{r.get('op')} {r.get('input_sizes')} {_dtypes(r.get('input_dtypes'))}"
        for r in recs
        if _shape(r) != usual
    }
    return Stall(
        pg=pg,
        desc=desc,
        seq=seq,
        op=str(first.get("op") or "?"),
        sizes=[list(s) for s in first.get("input_sizes") or []],
        dtypes=list(first.get("input_dtypes") or []),
        bytes=first.get("bytes"),
        missing_ranks=missing,
        waiting_ranks=waiting,
        age_s=round(max(0, now_ns - min(r["ts"] for r in recs)) / 1e9, 1),
        places=dict(sorted(members.items())),
        disagree=disagree,
    )


def _shape(r: dict[str, Any]) -> tuple[Any, ...]:
    """What every rank must agree on for a collective: its op, and for most ops
    its tensors' shapes and dtypes."""
    op = str(r.get("op") or "")
    if not any(k in op for k in SAME_SHAPES):
        return (op,)
    sizes = tuple(tuple(s) for s in r.get("input_sizes") or [])
    return (op, sizes, tuple(r.get("input_dtypes") or []))


def group_name(pg: str, desc: str) -> str:
    """``process group 0``, with torch's description where the job gave one."""
    named = desc and desc not in ("undefined", DEFAULT_PG)
    return f"process group {pg}" + (f" ({desc})" if named else "")


def detail(s: Stall) -> str:
    """What the records add to a hang's sentence: the tensors, the missing
    ranks' last collective, and ranks that entered it differently."""
    parts = [f"Flight Recorder: {s.op} #{s.seq} of {_tensors(s)}"]
    for r in s.missing_ranks:
        p = s.places[r]
        last = f"{p.op} #{p.entered}" if p.entered else "none recorded"
        parts.append(f"rank {r}'s last: {last}")
    for r, what in sorted(s.disagree.items()):
        parts.append(f"rank {r} entered it as {what}")
    return "; ".join(parts)


def _tensors(s: Stall) -> str:
    if not s.sizes:
        return "no tensor"
    shapes = ", ".join("x".join(map(str, shape)) or "scalar" for shape in s.sizes)
    size = f", {_bytes(s.bytes)}" if s.bytes is not None else ""
    return f"{shapes} {_dtypes(s.dtypes)}{size}"


def _dtypes(dtypes: Sequence[str] | None) -> str:
    return "/".join(sorted(set(dtypes or []))) or "?"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def off_note(status: Sequence[dict[str, Any]]) -> str:
    """Which ranks have no Flight Recorder and why ("" where every rank has one)."""
    off = defaultdict(list)
    for s in status:
        if s.get("state") != "on":
            off[(s.get("state"), s.get("reason") or "")].append(s["rank"])
    if not off:
        return ""
    said = []
    for (state, reason), ranks in sorted(off.items(), key=lambda kv: min(kv[1])):
        who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))
        what = "has no record" if state == "empty" else f"is {state}"
        said.append(f"Flight Recorder {what} in {who}: {reason}")
    return "; ".join(said)
