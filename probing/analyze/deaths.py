"""The ranks whose process died while their probe watched (``kill -9``,
OOM): the collective each died in or after (``deaths``), in words
(``death_text``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from probing.analyze import collectives as coll
from probing.analyze.verdict import hms


@dataclasses.dataclass
class Death:
    """A rank whose process died while its probe watched (``kill -9``, OOM)."""

    pid: int
    died_ns: int
    where: str  # "in allreduce #41 of gloo/pg0", "after ... (it never entered #41)", ""


def deaths(rows: list[dict[str, Any]], matched: list[coll.Collective]) -> dict[int, Death]:
    """The dead ranks of ``DEAD_SQL``'s rows, and the collective each died in
    (entered, never left) or after (the last it left: it never entered the next)."""
    out = {}
    for row in rows:
        if row.get("alive") is not False:
            continue
        r, died = int(row["rank"]), int(row.get("died_ns") or 0)
        mine = [c for c in matched if r in c.ts]
        where = ""
        inside = [c for c in mine if c.end.get(r) is None]
        if inside:
            c = min(inside, key=lambda c: c.ts[r])
            where = f"in {c.op} #{c.seq} of {c.comm}"
        elif mine:
            c = max(mine, key=lambda c: c.ts[r])
            where = f"after {c.op} #{c.seq} of {c.comm} (it never entered #{c.seq + 1})"
        out[r] = Death(int(row.get("pid") or 0), died, where)
    return out


def death_text(dead: dict[int, Death]) -> str:
    """``rank 3 (pid 1234) died at 14:05:01 UTC in allreduce #41 of gloo/pg0``,
    the first to die first (a killed Gloo rank takes the others with it)."""
    first = sorted(dead.items(), key=lambda rx: (rx[1].died_ns or 0, rx[0]))
    from probing.procs import NO_PROCESS

    return "; ".join(
        f"rank {r} (pid {x.pid}) died{f' at {hms(x.died_ns)}' if x.died_ns else ''}"
        f"{f' {x.where}' if x.where else ''}"
        if x.pid
        else f"rank {r}: {NO_PROCESS}"
        for r, x in first
    )
