"""The cause on the timeline (issue 43): each rank's training thread as a
track of its Python functions from the sampler, beside its collectives, and
the spans a rank was not tracing. Over the scripted 4-rank job of
``test_export`` (rank SLOW longer in ``load_batch``), parsed back with
Perfetto's protos, and the layout itself on hand-made reads."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pyarrow as pa
import pytest

from probing.cli.export import export
from probing.cli.export.flame import Read, Slice, lay_out, training_threads
from probing.node.tables.trace import INTERVALS_SCHEMA
from tests.test_export import (  # noqa: F401
    LOAD_MS,
    READ_NS,
    READS,
    SLOW,
    STEPS,
    WORLD,
    DatabaseProbe,
    ScriptedJob,
    job,
    parse,
    rank_tables,
)

S = 1_000_000_000
MS = 1_000_000


def track(rank: int) -> str:
    return f"Python: MainThread ({2000 + rank}), sampled"


def test_each_rank_has_its_training_threads_python_functions(job, tmp_path: Path) -> None:  # noqa: F811
    path = tmp_path / "job.pftrace"
    report = export(job, str(path), window_s=60)
    got = parse(path)
    # the training thread's only (not Gloo's), on a track of its own per rank
    assert sorted(got["tracks"]) == [(r, track(r)) for r in range(WORLD)]
    assert report.python == dict.fromkeys(range(WORLD), 9) and report.untraced == {}
    for r in range(WORLD):
        slices = got["tracks"][(r, track(r))]
        named = {n: [s for s in slices if s["name"] == n] for n in {s["name"] for s in slices}}
        # a frame that goes on from one read to the next is one slice: <module> and
        # main span every read; the frame that ends a read goes on first in the next
        # (load_batch and backward take turns, the longer ending the first read)
        longer, shorter = ("load_batch", "backward") if r == SLOW else ("backward", "load_batch")
        assert {n: len(v) for n, v in named.items()} == {
            "<module>": 1, "main": 1, longer: 3, shorter: 4}  # fmt: skip
        [main] = named["main"]
        assert (main["ts"], main["dur"]) == (job.base, READS * READ_NS)
        assert main["args"]["file"] == "/job/train.py"
        # in the calls' time base: the steps' collectives and CUDA calls lie under main
        assert len(got["slice_ts"][r]) > STEPS
        assert all(main["ts"] <= t < main["ts"] + main["dur"] for t in got["slice_ts"][r])
        load = sum(s["dur"] for s in named["load_batch"])
        assert load == READS * (LOAD_MS.get(r, 60) + 10) * MS
        assert sum(s["args"]["off_cpu_ms"] for s in named["load_batch"]) == pytest.approx(
            READS * LOAD_MS.get(r, 60)
        )
        assert sum(s["args"]["on_cpu_ms"] for s in named["load_batch"]) == pytest.approx(READS * 10)
        for s in named["load_batch"] + named["backward"]:  # nested in main
            assert main["ts"] <= s["ts"] and s["ts"] + s["dur"] <= main["ts"] + main["dur"]
    shares = {r: sum(s["dur"] for s in got["tracks"][(r, track(r))] if s["name"] == "load_batch")
              for r in range(WORLD)}  # fmt: skip
    assert max(shares, key=shares.__getitem__) == SLOW


def test_the_spans_a_rank_was_not_tracing_are_marked(tmp_path: Path) -> None:
    """Rank 3 stopped tracing for a second and traced again, rank 0 died
    tracing, rank 2 never traced: each span on a ``not tracing`` track, with why."""
    base = time.time_ns() - 30 * S

    def intervals(*rows: tuple[int, int | None, str]) -> pa.Table:
        return pa.Table.from_pylist(
            [dict(start_ns=a, stop_ns=b, state=s, families="gloo") for a, b, s in rows],
            schema=INTERVALS_SCHEMA,
        )

    traced = {
        0: intervals((base - S, base + 5 * S // 2, "died")),
        1: intervals((base - S, None, "tracing")),
        2: intervals(),
        3: intervals((base - S, base + S, "stopped"), (base + 2 * S, None, "tracing")),
    }
    src = ScriptedJob(pids=[1000 + r for r in range(WORLD)])
    src.base = base
    src.probes = {1000 + r: DatabaseProbe({**rank_tables(r, base), "trace.intervals": traced[r]})
                  for r in range(WORLD)}  # fmt: skip
    before = time.time_ns()
    report = export(src, str(tmp_path / "gaps.pftrace"), window_s=60)
    got = parse(tmp_path / "gaps.pftrace")
    gaps = {r: got["tracks"].get((r, "not tracing"), []) for r in range(WORLD)}
    assert report.untraced == {0: 1, 2: 1, 3: 1}
    assert [(g["ts"] - base, g["dur"], g["args"]["why"]) for g in gaps[3]] == [
        (S, S, "tracing stopped")
    ]
    [died] = gaps[0]
    assert (died["ts"], died["args"]["why"]) == (base + 5 * S // 2, "the process died")
    assert died["ts"] + died["dur"] >= before  # to the export's now
    [never] = gaps[2]
    assert (never["ts"], never["args"]["why"]) == (base, "not traced in the window")
    assert gaps[1] == []


def _slices_by_name(slices: list[Slice]) -> dict[str, list[tuple[int, int, int]]]:
    out: dict[str, list[tuple[int, int, int]]] = {}
    for s in sorted(slices, key=lambda s: (s.start, s.depth)):
        out.setdefault(s.key[0], []).append((s.start, s.end, s.depth))
    return out


FRAMES = {1: [("main", "t.py"), ("step", "t.py")], 2: [("main", "t.py"), ("wait", "t.py")],
          3: [("main", "t.py"), ("step", "t.py"), ("matmul", "t.py")]}  # fmt: skip


def test_a_block_charged_when_it_ends_is_drawn_over_the_time_it_took() -> None:
    """Blocked 2.5 s: the sampler charges it at the read after it ends; it is
    drawn over those 2.5 s, not squeezed into the read that charged it."""
    t0 = 1_000 * S
    reads = [Read(t0 + k * S // 2, S // 2) for k in range(1, 7)]
    reads[0].stacks = {1: [S // 2, 0, 0]}  # on a CPU in step, then ...
    reads[5].stacks = {2: [0, 5 * S // 2, 0]}  # ... 2.5 s blocked in wait
    got = _slices_by_name(lay_out(reads, FRAMES.__getitem__))
    assert got == {"main": [(t0, t0 + 3 * S, 0)], "step": [(t0, t0 + S // 2, 1)],
                   "wait": [(t0 + S // 2, t0 + 3 * S, 1)]}  # fmt: skip


def test_reads_a_little_short_are_drawn_up_to_the_next_and_a_stop_is_a_gap() -> None:
    """Reads charged 10 % short (the rest comes with the next) are drawn end to
    end; a sampler restarted later (a new trace) starts a new chart."""
    t0 = 1_000 * S
    reads = [Read(t0 + k * S // 2, S // 2, {1: [45 * S // 100, 0, 0]}) for k in range(1, 5)]
    later = t0 + 10 * S
    reads += [Read(later + k * S // 2, S // 2, {1: [S // 2, 0, 0]}) for k in range(1, 3)]
    got = _slices_by_name(lay_out(reads, FRAMES.__getitem__))
    first = t0 + S // 2 - 45 * S // 100  # the first read's time, up to its own end
    assert got["main"] == [(first, t0 + 2 * S, 0), (later, later + S, 0)]
    assert got["step"] == [(first, t0 + 2 * S, 1), (later, later + S, 1)]


def test_the_frame_that_ends_a_read_goes_on_first_in_the_next() -> None:
    """main's own time (code of main itself) never cuts the frame that goes on:
    step, drawn last in a read, goes first in the next and is one slice."""
    t0 = 1_000 * S
    own = {4: [100 * MS, 0, 0], 1: [400 * MS, 0, 0]}  # stack 4: main itself
    reads = [Read(t0 + k * S // 2, S // 2, dict(own)) for k in range(1, 5)]
    frames = {**FRAMES, 4: [("main", "t.py")]}
    got = _slices_by_name(lay_out(reads, frames.__getitem__))
    assert got["main"] == [(t0, t0 + 2 * S, 0)]
    # read 1: main's own time, then step; read 2: step, then main's own; and again
    assert got["step"] == [(t0 + 100 * MS, t0 + 900 * MS, 1), (t0 + 1100 * MS, t0 + 1900 * MS, 1)]


def test_any_reads_lay_out_as_properly_nested_slices() -> None:
    """Random reads of random stacks: slices at one depth never overlap, each
    lies in a slice one level up, and each read's time is drawn whole."""
    rng = random.Random(43)
    frames = {sid: [(f"f{rng.randrange(3)}", "x.py") for _ in range(rng.randrange(1, 5))]
              for sid in range(1, 30)}  # fmt: skip
    t0, reads = 5_000 * S, []
    for k in range(1, 80):
        stacks = {sid: [rng.randrange(0, 90 * MS) for _ in range(3)]
                  for sid in rng.sample(range(1, 30), rng.randrange(0, 6))}  # fmt: skip
        reads.append(Read(t0 + k * S // 2 + rng.randrange(-5 * MS, 5 * MS), S // 2, stacks))
    slices = lay_out(reads, frames.__getitem__)
    by_depth: dict[int, list[Slice]] = {}
    for s in slices:
        assert s.end > s.start
        by_depth.setdefault(s.depth, []).append(s)
    for d, level in by_depth.items():
        level.sort(key=lambda s: s.start)
        assert all(a.end <= b.start for a, b in zip(level, level[1:], strict=False))
        if d:
            up = by_depth[d - 1]
            assert all(any(p.start <= s.start and s.end <= p.end for p in up) for s in level)
    drawn = sum(s.end - s.start for s in by_depth[0])
    charged = sum(r.total for r in reads)
    assert 0.9 * charged <= drawn <= 1.25 * charged  # stretched a little, or squeezed at the start


def test_the_training_thread_issued_the_collectives_else_is_the_main_thread() -> None:
    threads = [dict(rank=0, tid=5, thread="MainThread", ns=10), dict(rank=0, tid=6, thread="loop",
               ns=90), dict(rank=1, tid=7, thread="MainThread", ns=1),
               dict(rank=1, tid=8, thread="worker", ns=50), dict(rank=2, tid=9, thread="a", ns=3),
               dict(rank=2, tid=11, thread="b", ns=30)]  # fmt: skip
    issuers = [dict(rank=0, tid=6, n=40), dict(rank=0, tid=5, n=2)]
    assert training_threads(issuers, threads) == {0: (6, "loop"), 1: (7, "MainThread"),
                                                  2: (11, "b")}  # fmt: skip
