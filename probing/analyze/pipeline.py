"""Pipeline parallelism, from the point-to-point transfers every stage traced.

A pipeline stage computes, then hands its activations to the next stage
(``send``) and waits for its inputs (``recv``); in the backward pass the
gradients go the other way. Gloo's ``send``/``recv`` rows of
``comm.collectives`` carry the time each transfer spent blocked in its
``wait()`` (``wait_ns``): what a stage did *not* spend computing.

* The slow stage is the one that is busy while the others wait: its share of
  the window outside p2p waits is the largest, by a margin over the others'
  median. Its neighbours wait on it; they are victims, not stragglers.
* The bubble is the stages' idle share: time blocked in p2p waits over the
  window, averaged over the stages. Over a window of several steps it is
  the bubble's share of a step.
* A hang: a stage blocked in a ``recv`` from a peer for long. Following
  each waiting stage to the peer it waits for (through sends waiting
  for their receive too) ends at the stage that is in no transfer: the one
  that never sent, or never received, what the others wait for.

Pure functions over gathered rows, like ``collectives``.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import numpy as np

from probing.analyze.collectives import P2P_OPS, global_rank, seq_offset

MIN_TRANSFERS = 8  # complete transfers per stage for a verdict
SLOW_GAP = 0.15  # the slow stage is busy this share of the window more than the others' median
VICTIM_WAIT = 0.10  # a stage blocked this share of the window waits on the slow one


@dataclasses.dataclass
class Stage:
    rank: int
    node: str
    transfers: int
    busy_share: float  # of the window: outside p2p waits
    recv_wait_share: float
    send_wait_share: float
    peers: list[int]  # the ranks it exchanges with


@dataclasses.dataclass
class Pipeline:
    stages: list[Stage]
    window_ms: float
    bubble_share: float  # the stages' mean share of the window blocked in p2p waits
    slow: int | None  # the slow stage's rank
    victims: list[int]  # the stages that wait on it

    def stage(self, rank: int) -> Stage:
        return next(s for s in self.stages if s.rank == rank)

    def text(self) -> str:
        """One sentence: the slow stage and who waits on it, or the bubble."""
        bubble = f"bubble {100 * self.bubble_share:.0f} % of the step"
        if self.slow is None:
            busy = ", ".join(f"{s.rank}: {100 * s.busy_share:.0f} %" for s in self.stages)
            return f"pipeline of {len(self.stages)} stages, no slow stage (busy {busy}); {bubble}"
        s = self.stage(self.slow)
        node = f" on node {s.node}" if s.node else ""
        wait = ", ".join(
            f"{v} ({100 * (1 - self.stage(v).busy_share):.0f} %)" for v in self.victims
        )
        return (
            f"pipeline: rank {s.rank}{node} is the slow stage, busy {100 * s.busy_share:.0f} % "
            f"of the time vs {100 * others_busy(self.stages, s.rank):.0f} % for the other stages"
            + (f"; ranks {wait} wait on it in send/recv" if self.victims else "")
            + f"; {bubble}"
        )


def p2p_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("op") in P2P_OPS and r.get("ts") is not None]


def peer_rank(row: dict[str, Any], ranks_of: dict[str, list[int]]) -> int:
    """A transfer's peer as a global rank: its group's ranks where
    ``comm.groups`` names them, else the group is the whole job."""
    peer = int(row["peer"])
    ranks = ranks_of.get(str(row.get("pg") or ""))
    return ranks[peer] if ranks and 0 <= peer < len(ranks) else peer


def analyze(
    rows: list[dict[str, Any]], nodes: dict[int, str], ranks_of: dict[str, list[int]] | None = None
) -> Pipeline | None:
    """The pipeline the complete, timed transfers show (None: too few)."""
    ranks_of = ranks_of or {}
    per: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in p2p_rows(rows):
        if r.get("dur_ns") is not None and r.get("wait_ns") is not None:
            per[global_rank(r)].append(r)
    per = {q: rs for q, rs in per.items() if len(rs) >= MIN_TRANSFERS}
    if len(per) < 2:
        return None
    # the window every stage traced: from the last first transfer to the first last end
    lo = max(min(r["ts"] for r in rs) for rs in per.values())
    hi = min(max(r["ts"] + r["dur_ns"] for r in rs) for rs in per.values())
    if hi <= lo:
        return None
    window = float(hi - lo)
    stages = []
    for q, rs in sorted(per.items()):
        waited = {"send": 0.0, "recv": 0.0}
        for r in rs:
            end = r["ts"] + r["dur_ns"]
            start = end - r["wait_ns"]
            waited[r["op"]] += max(0, min(end, hi) - max(start, lo))
        blocked = min(window, waited["send"] + waited["recv"])
        stages.append(
            Stage(
                rank=q,
                node=nodes.get(q, ""),
                transfers=len(rs),
                busy_share=round(1 - blocked / window, 3),
                recv_wait_share=round(waited["recv"] / window, 3),
                send_wait_share=round(waited["send"] / window, 3),
                peers=sorted({peer_rank(r, ranks_of) for r in rs}),
            )
        )
    bubble = float(np.mean([1 - s.busy_share for s in stages]))
    slow, victims = _slow_stage(stages)
    return Pipeline(stages, round(window / 1e6, 1), round(bubble, 3), slow, victims)


def others_busy(stages: list[Stage], rank: int) -> float:
    """The median busy share of the stages other than ``rank``'s (0: none)."""
    others = [s.busy_share for s in stages if s.rank != rank]
    return float(np.median(others)) if others else 0.0


def _slow_stage(stages: list[Stage]) -> tuple[int | None, list[int]]:
    best = max(stages, key=lambda s: s.busy_share)
    if len(stages) < 2 or best.busy_share - others_busy(stages, best.rank) < SLOW_GAP:
        return None, []
    victims = [s.rank for s in stages if s is not best and 1 - s.busy_share >= VICTIM_WAIT]
    return best.rank, victims


@dataclasses.dataclass
class Blocked:
    """A stage blocked in a transfer still in flight."""

    rank: int
    op: str
    peer: int  # global rank
    tag: int | None
    seq: int | None
    pg: str
    age_s: float


def blocked(
    rows: list[dict[str, Any]],
    now_ns: int,
    after_s: float,
    ranks_of: dict[str, list[int]] | None = None,
) -> list[Blocked]:
    """Transfers in flight for ``after_s`` or more, the oldest per rank."""
    out: dict[int, Blocked] = {}
    for r in p2p_rows(rows):
        if r.get("dur_ns") is not None or r.get("peer") is None:
            continue
        age = (now_ns - int(r["ts"])) / 1e9
        q = global_rank(r)
        if age < after_s or (q in out and out[q].age_s >= age):
            continue
        out[q] = Blocked(
            q, str(r["op"]), peer_rank(r, ranks_of or {}), r.get("tag"), r.get("seq"),
            str(r.get("pg") or r.get("comm") or ""), round(age, 1),
        )  # fmt: skip
    return [out[q] for q in sorted(out)]


def culprit(waits: list[Blocked]) -> tuple[int, list[int]] | None:
    """The stage the others wait for, and the stages waiting on it: from each
    rank blocked in a transfer, follow the peer it waits for (a ``recv`` for
    the sender, a ``send`` for the receiver, Gloo's sends waiting for the
    receive) until a rank that is not in a transfer itself. None when no
    rank waits to receive, or the waits go round in a circle."""
    if not any(b.op == "recv" for b in waits):
        return None
    recv = {b.rank: b.peer for b in waits}
    ends: dict[int, int] = {}
    for start in recv:
        seen, q = {start}, recv[start]
        while q in recv and q not in seen:
            seen.add(q)
            q = recv[q]
        if q in recv:  # a circle: nobody outside it is to blame
            continue
        ends[start] = q
    if not ends:
        return None
    # the one most ranks wait on, through however many stages
    votes: dict[int, int] = defaultdict(int)
    for q in ends.values():
        votes[q] += 1
    root = max(votes, key=lambda q: (votes[q], -q))
    return root, sorted(s for s, q in ends.items() if q == root)


@dataclasses.dataclass
class Transfer:
    """One send matched with its receive: the k-th from ``src`` to ``dst``
    with ``tag`` in group ``pg``."""

    pg: str
    src: int
    dst: int
    tag: int | None
    seq: int  # the sender's count of such transfers since it was traced
    bytes: int | None
    sent_ns: int | None  # the send posted (None: not traced at the sender)
    received_ns: int | None  # the receive returned (None: in flight, or not traced)
    send_wait_ms: float | None
    recv_wait_ms: float | None


def match_transfers(
    rows: list[dict[str, Any]], ranks_of: dict[str, list[int]] | None = None
) -> list[Transfer]:
    """Every traced send paired with the receive it feeds, across ranks. Each
    side counts its transfers since its own trace began, so the receiver's
    count is shifted onto the sender's where their completions line up."""
    ranks_of = ranks_of or {}
    sides: dict[tuple[str, int, int, Any], dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: {"send": [], "recv": []}
    )
    for r in p2p_rows(rows):
        if r.get("peer") is None or r.get("seq") is None:
            continue
        me, peer = global_rank(r), peer_rank(r, ranks_of)
        src, dst = (me, peer) if r["op"] == "send" else (peer, me)
        sides[(str(r.get("pg") or r.get("comm") or ""), src, dst, r.get("tag"))][r["op"]].append(r)
    out = []
    for (pg, src, dst, tag), side in sorted(sides.items(), key=lambda kv: kv[0][1:3]):
        sends, recvs = side["send"], side["recv"]

        def ends(rs: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
            done = [r for r in rs if r.get("dur_ns") is not None]
            return (
                np.array([r["seq"] for r in done], dtype=np.int64),
                np.array([r["ts"] + r["dur_ns"] for r in done], dtype=np.int64),
            )

        shift = seq_offset(*ends(recvs), *ends(sends)) if sends and recvs else 0
        by_seq: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
        for r in sends:
            by_seq[int(r["seq"])]["send"] = r
        for r in recvs:
            by_seq[int(r["seq"]) + shift]["recv"] = r
        for k in sorted(by_seq):
            s, v = by_seq[k].get("send"), by_seq[k].get("recv")
            done = v is not None and v.get("dur_ns") is not None
            out.append(
                Transfer(
                    pg, src, dst, tag, k, (s or v or {}).get("bytes"),
                    s["ts"] if s else None, v["ts"] + v["dur_ns"] if done else None,  # type: ignore[index]
                    _ms(s.get("wait_ns")) if s else None, _ms(v.get("wait_ns")) if v else None,
                )
            )  # fmt: skip
    return out


def _ms(ns: Any) -> float | None:
    return None if ns is None else round(ns / 1e6, 3)
