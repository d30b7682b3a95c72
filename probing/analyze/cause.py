"""A cause of a straggler's lateness (``Why``) and the measures every cause
is told by: a communicator's steps per collective, the job's step, the
straggler's lateness, the others' median (``probing.analyze.why`` puts the
causes together)."""

from __future__ import annotations

import dataclasses

import numpy as np

from probing.analyze.collectives import Collective, by_comm
from probing.analyze.stragglers import Straggler

MIN_DELTA_MS = 1.0  # a function's extra time per step worth naming ...
MIN_DELTA_SHARE = 0.15  # ... and this share of the straggler's own excess
TOP = 3  # functions named per straggler


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
    starts = np.array(sorted(c.first_ns for c in cs), dtype=np.float64)
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
    starts = np.array(sorted(c.first_ns for c in cs), dtype=np.float64)
    per = steps_per_collective(cs)
    return float((starts[-1] - starts[0]) / 1e6 / ((len(starts) - 1) * per))


def median(values: list[float]) -> float:
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
