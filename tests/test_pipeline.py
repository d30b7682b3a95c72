"""analyze.pipeline on simulated GPipe schedules: the slow stage, its victims,
the bubble, and the stage a hang waits on."""

from __future__ import annotations

import pytest

from probing.analyze import pipeline as pp

MS = 1_000_000


def gpipe(compute_ms: list[float], steps: int = 6, micro: int = 4) -> list[dict]:
    """comm.collectives rows of a GPipe job: per step, every micro-batch
    forward through the stages, then backward; a stage receives (blocking
    until the sender sent), computes, sends (buffered: 0.05 ms)."""
    n = len(compute_ms)
    clock = [0.0] * n  # each stage's time, ms
    sent: dict[tuple[str, int, int, int], float] = {}  # (dir, from stage, step, mb) -> time
    rows: list[dict] = []

    count: dict[tuple[str, int, int], int] = {}

    def transfer(op: str, stage: int, peer: int, ts: float, dur: float, wait: float) -> None:
        seq = count[(op, stage, peer)] = count.get((op, stage, peer), -1) + 1  # as BPF counts
        rows.append(
            {"op": op, "rank": stage, "comm_rank": stage, "peer": peer, "tag": 0,
             "ts": int(ts * MS), "dur_ns": int(dur * MS), "wait_ns": int(wait * MS),
             "backend": "gloo", "seq": seq, "bytes": 4096}
        )  # fmt: skip

    for step in range(steps):
        for direction, order in (("fwd", range(n)), ("bwd", range(n - 1, -1, -1))):
            upstream = -1 if direction == "fwd" else 1
            for mb in range(micro):
                for s in order:
                    src = s + upstream
                    if 0 <= src < n:  # wait for what the neighbour sent
                        post = clock[s]
                        ready = sent[(direction, src, step, mb)]
                        clock[s] = max(post, ready)
                        transfer("recv", s, src, post, clock[s] - post, clock[s] - post)
                    clock[s] += compute_ms[s] / 2
                    dst = s - upstream
                    if 0 <= dst < n:
                        transfer("send", s, dst, clock[s], 0.05, 0.05)
                        clock[s] += 0.05
                        sent[(direction, s, step, mb)] = clock[s]
        for s in range(n):  # the optimizer step
            clock[s] += 2.0
    return rows


def test_a_balanced_pipeline_has_no_slow_stage_and_a_bubble() -> None:
    p = pp.analyze(gpipe([10, 10, 10, 10]), {})
    assert p is not None and p.slow is None and p.victims == []
    assert [s.rank for s in p.stages] == [0, 1, 2, 3]
    assert 0.1 < p.bubble_share < 0.7  # (stages - 1) / (micro + stages - 1) = 3/7 in theory
    assert p.stages[1].peers == [0, 2]
    assert "no slow stage" in p.text()


@pytest.mark.parametrize("slow", [0, 2, 3])
def test_the_slow_stage_is_named_and_the_others_are_its_victims(slow: int) -> None:
    compute = [10.0] * 4
    compute[slow] = 40.0
    p = pp.analyze(gpipe(compute), {slow: "node-b"})
    assert p is not None and p.slow == slow
    assert slow not in p.victims and p.victims
    assert p.stage(slow).busy_share > 0.8
    text = p.text()
    assert f"rank {slow} on node node-b is the slow stage" in text and "bubble" in text


def test_too_few_transfers_give_no_verdict() -> None:
    rows = gpipe([10, 10], steps=1, micro=1)
    assert pp.analyze(rows, {}) is None


def test_a_peer_in_a_subgroup_is_named_by_its_global_rank() -> None:
    row = {"peer": 1, "pg": "pp0"}
    assert pp.peer_rank(row, {"pp0": [4, 6]}) == 6
    assert pp.peer_rank(row, {}) == 1


def _waiting(rank: int, op: str, peer: int, age_s: float) -> dict:
    now = 100 * 10**9
    return {"op": op, "rank": rank, "peer": peer, "tag": 0, "seq": 7, "pg": "0",
            "ts": now - int(age_s * 1e9), "dur_ns": None, "wait_ns": None}  # fmt: skip


def test_a_hang_names_the_stage_that_never_sent() -> None:
    now = 100 * 10**9
    rows = [_waiting(3, "recv", 2, 40), _waiting(2, "recv", 1, 41), _waiting(0, "recv", 1, 39)]
    rows.append(_waiting(1, "send", 2, 0.5))  # too young to count
    waits = pp.blocked(rows, now, after_s=10)
    assert [(b.rank, b.peer, b.age_s) for b in waits] == [(0, 1, 39.0), (2, 1, 41.0), (3, 2, 40.0)]
    assert pp.culprit(waits) == (1, [0, 2, 3])


def test_a_stage_waiting_to_send_leads_to_the_stage_that_never_received() -> None:
    now = 100 * 10**9
    # the last stage is stuck: rank 2's send to it waits, ranks 0 and 1 wait upstream
    rows = [_waiting(0, "recv", 1, 30), _waiting(1, "recv", 2, 31), _waiting(2, "send", 3, 32)]
    assert pp.culprit(pp.blocked(rows, now, after_s=10)) == (3, [0, 1, 2])


def test_waits_in_a_circle_blame_nobody() -> None:
    now = 100 * 10**9
    rows = [_waiting(0, "recv", 1, 30), _waiting(1, "recv", 0, 30)]
    assert pp.culprit(pp.blocked(rows, now, after_s=10)) is None
    assert pp.culprit([]) is None


def test_sends_meet_their_receives_though_the_ranks_began_tracing_apart() -> None:
    rows = gpipe([10, 10, 10, 10], steps=3)
    # rank 2 was traced later: its first 5 receives from rank 1 are not there,
    # and it numbers the rest from 0
    late = sorted((r for r in rows if r["rank"] == 2 and r["op"] == "recv" and r["peer"] == 1),
                  key=lambda r: r["ts"])  # fmt: skip
    for r in late[:5]:
        rows.remove(r)
    for r in late[5:]:
        r["seq"] -= 5
    pairs = [t for t in pp.match_transfers(rows) if (t.src, t.dst) == (1, 2)]
    assert len(pairs) == 12  # 3 steps x 4 micro-batches forward
    got = [t for t in pairs if t.received_ns is not None]
    assert len(got) == 7 and all(t.seq >= 5 for t in got)  # the receiver's count shifted
    # each receive returned after its send was posted, before the next one was
    for t, after in zip(got, got[1:], strict=False):
        assert t.sent_ns is not None and t.sent_ns <= t.received_ns < after.sent_ns + 60 * MS
    assert {(t.src, t.dst) for t in pp.match_transfers(rows)} == {
        (0, 1),
        (1, 2),
        (2, 3),
        (3, 2),
        (2, 1),
        (1, 0),
    }
