"""``collectives.match`` (columnar) against the matching rules written out row
by row: communicator keys (by pg, by a hash shared across processes, else by
backend, size and order of first use per process), per-rank seq offsets
(by ends for synchronous Gloo calls, else by arrivals), misaligned and
duplicated calls left out, calls in flight kept, P2P and op-less rows left out."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from probing.analyze import collectives as coll

T0 = 1_763_880_000 * 10**9
STEP = 10_000_000

# backend, members, the comm value in rank r, pg, op, collectives, first at (ns)
COMMS: list[tuple[str, list[int], Any, str | None, str, int, int]] = [
    ("gloo", [0, 1, 2, 3], lambda r: 0x1000 + r, "0", "allreduce", 30, 0),  # named by pg
    ("gloo", [1, 3], lambda r: 0x2000 + 16 * r, None, "allgather", 25, 1_000_000),  # n2#0
    ("gloo", [1, 3], lambda r: 0x3000 + 16 * r, None, "reduce_scatter", 20, 2_000_000),  # n2#1
    ("nccl", [0, 1, 2, 3], lambda r: 0xABCDEF12, None, "broadcast", 30, 3_000_000),  # hash
]


def scrambled(seed: int) -> pa.Table:
    """Four ranks (two nodes), four communicators, each rank's trace begun after
    a few collectives of each (its seqs start later); then a call still in
    flight, a duplicated row, a misaligned one (another op), rows without op,
    ts or seq, a P2P send, rows without nranks or rank; shuffled."""
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    for backend, members, ptr, pg, op, n, at in COMMS:
        skipped = {r: int(rng.integers(0, 4)) for r in members}
        skipped[members[0]] += 1  # the reference rank (the lowest) began after another
        skipped[members[-1]] = 0
        for k in range(n):
            t = T0 + at + k * STEP
            end = t + 2_000_000 + int(rng.integers(0, 5_000))  # Gloo: the ends line up
            for r in members:
                if k < skipped[r]:
                    continue
                if backend == "gloo":
                    ts = t + int(rng.integers(0, 1_000_000))
                    dur = end + int(rng.integers(0, 3_000)) - ts
                else:  # NCCL: the arrivals line up, the durations say nothing
                    ts = t + int(rng.integers(0, 30_000))
                    dur = int(rng.integers(10_000, 9_000_000))
                rows.append({
                    "backend": backend, "op": op, "comm": ptr(r), "seq": k - skipped[r],
                    "comm_rank": members.index(r), "nranks": len(members),
                    "bytes": 4096 + 16 * k + r, "ts": ts, "dur_ns": dur, "pid": 1000 + r,
                    "node": f"host{r // 2}", "rank": r, "pg": pg,
                })  # fmt: skip
    world = [i for i, r in enumerate(rows) if r["pg"] == "0"]
    nccl = [i for i, r in enumerate(rows) if r["backend"] == "nccl"]
    last2 = max((i for i in world if rows[i]["rank"] == 2), key=lambda i: rows[i]["seq"])
    rows[last2]["dur_ns"] = None  # still inside
    dup = dict(rows[int(rng.choice([i for i in world if rows[i]["rank"] == 1]))])
    dup["ts"] += 1_000  # traced twice
    rows.append(dup)
    rows[int(rng.choice([i for i in nccl if rows[i]["rank"] == 3]))]["op"] = "reduce"
    for i in rng.choice(len(rows), size=6, replace=False).tolist():
        rows[i]["nranks"] = None
    for i in rng.choice([i for i in world + nccl if rows[i]["rank"] != 0], size=4).tolist():
        rows[i]["rank"] = [None, -1][i % 2]  # then comm_rank, the same in a world comm
    extra = dict(rows[world[3]])
    rows += [
        {**extra, "op": "send", "seq": 0},
        {**extra, "op": None},
        {**extra, "op": ""},
        {**extra, "ts": None},
        {**extra, "seq": None, "ts": extra["ts"] + 7},
    ]
    order = rng.permutation(len(rows))
    return pa.Table.from_pylist([rows[i] for i in order.tolist()])


def expected(table: pa.Table) -> list[tuple[Any, ...]]:
    """The collectives, matched one row at a time by the rules."""
    rows = [
        r
        for r in table.to_pylist()
        if r.get("op") and r["op"] not in coll.P2P_OPS and r.get("ts") is not None
    ]
    procs: dict[tuple[Any, Any], set[tuple[Any, Any]]] = defaultdict(set)
    first: dict[tuple[Any, ...], int] = {}  # (node, pid, backend, comm) -> its first ts
    size: dict[tuple[Any, ...], int] = {}  # ... -> its last row's nranks
    for r in rows:
        procs[(r["backend"], r["comm"])].add((r["node"], r["pid"]))
        here = (r["node"], r["pid"], r["backend"], r["comm"])
        first[here] = min(first.get(here, r["ts"]), r["ts"])
        if r["nranks"]:
            size[here] = r["nranks"]

    def key(r: dict[str, Any]) -> str:
        if r["pg"] is not None:
            return f"{r['backend']}/pg{r['pg']}"
        if len(procs[(r["backend"], r["comm"])]) > 1 and r["comm"] is not None:
            return f"{r['backend']}:{r['comm']:x}"
        here = (r["node"], r["pid"], r["backend"], r["comm"])
        n = size.get(here, 0)
        alike = [c for c in first if c[:3] == here[:3] and size.get(c, 0) == n]
        return f"{r['backend']}/n{n}#{sorted(alike, key=first.__getitem__).index(here)}"

    def rank(r: dict[str, Any]) -> int:
        return r["rank"] if r["rank"] is not None and r["rank"] >= 0 else r["comm_rank"]

    per: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        per[key(r)][rank(r)].append(r)
    out = []
    for name, by_rank in per.items():
        ref = min(by_rank)
        ends = all(r["backend"] == "gloo" for r in by_rank[ref])

        theirs = times(by_rank[ref], ends)
        merged: dict[int, dict[str, Any]] = {}
        for q, rs in by_rank.items():
            shift = 0
            if q != ref and theirs and times(rs, ends):
                # each call's nearest reference call in time (a tie: the later one)
                near = [nearest(theirs, t) - s for s, t in times(rs, ends)]
                counts = Counter(near)
                shift = next(v for v in near if counts[v] == max(counts.values()))
            for r in rs:
                if r["seq"] is None:
                    continue
                new = {"op": r["op"], "nranks": 0, "bytes": r["bytes"], "ts": {}, "end": {}}
                c = merged.setdefault(r["seq"] + shift, new)
                if r["op"] != c["op"] or q in c["ts"]:
                    continue
                c["ts"][q] = r["ts"]
                c["end"][q] = None if r["dur_ns"] is None else r["ts"] + r["dur_ns"]
                c["nranks"] = max(c["nranks"], r["nranks"] or 0, len(c["ts"]))
        for s in sorted(merged):
            c = merged[s]
            out.append((name, s, c["op"], c["nranks"], c["bytes"], list(c["ts"].items()),
                        list(c["end"].items())))  # fmt: skip
    return out


def times(rs: list[dict[str, Any]], ends: bool) -> list[tuple[int, int]]:
    """(seq, time) of each call with a seq: its return (``ends``; returned calls
    only) or its arrival."""
    done = [r for r in rs if r["seq"] is not None and (r["dur_ns"] is not None or not ends)]
    return [(r["seq"], r["ts"] + r["dur_ns"] if ends else r["ts"]) for r in done]


def nearest(calls: list[tuple[int, int]], t: int) -> int:
    """The seq of the call nearest ``t`` in time (of two as near: the later)."""
    return min(calls, key=lambda c: (abs(t - c[1]), -c[1]))[0]


def got(table: pa.Table) -> list[tuple[Any, ...]]:
    return [
        (c.comm, c.seq, c.op, c.nranks, c.bytes, list(c.ts.items()), list(c.end.items()))
        for c in coll.match(table)
    ]


@pytest.mark.parametrize("seed", range(8))
def test_columnar_match_is_the_row_by_row_match(seed: int) -> None:
    table = scrambled(seed)
    want = expected(table)
    assert got(table) == want
    comms = {c[0] for c in want}
    assert {"gloo/pg0", "gloo/n2#0", "gloo/n2#1", "nccl:abcdef12"} <= comms
    assert any(c[0] != "gloo/pg0" and c[1] < 0 for c in want)  # a rank shifted below the ref
    assert any(None in dict(c[6]).values() for c in want)  # the call in flight kept


def test_matched_points_at_each_calls_row() -> None:
    table = scrambled(0)
    m = coll.matched(table)
    rows = table.to_pylist()
    assert len(m) == len(coll.match(table)) and m.first[-1] == len(m.row)
    for i, row in enumerate(m.row.tolist()):
        r = rows[row]
        rank = r["rank"] if r["rank"] is not None and r["rank"] >= 0 else r["comm_rank"]
        assert r["ts"] == m.ts[i] and rank == m.rank[i]
        assert m.done[i] == (r["dur_ns"] is not None)


def test_no_collective_rows() -> None:
    assert coll.match(pa.table({})) == []
    only_p2p = pa.Table.from_pylist([{"backend": "gloo", "op": "send", "ts": 1, "seq": 0}])
    assert coll.match(only_p2p) == [] and len(coll.matched(only_p2p)) == 0
    no_seq = pa.Table.from_pylist([{"backend": "gloo", "op": "allreduce", "ts": 1, "seq": None}])
    assert coll.match(no_seq) == []
