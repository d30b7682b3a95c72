"""The truth a framework job here records for ``benchmarks/accuracy.py``,
only where ``ACCURACY_TRUTH`` is set (stdlib only: it imports nothing from
probing, nor from the framework).

Each rank appends to ``$ACCURACY_TRUTH`` + ``.rank{r}`` the lines
``benchmarks/accuracy_jobs/train.py`` writes:

- once at start: ``{"fault", "rank", "onset_step", "ms", "pid", "tid",
  "shape", "self"}`` (``rank``: the slowed rank, ``SLOW_RANK``; ``fault``
  and ``shape``: ``ACCURACY_FAULT`` and ``ACCURACY_SHAPE``, the runner's names);
- on the slowed rank, when the slowdown first acts: ``{"fault", "rank",
  "onset": time.time(), "ms", "step"}``;
- one line per optimizer step: ``{"rank", "step", "t0", "t1", "t_arrive",
  "t_collective", "injected_ms", "runq_ms"}``. A step runs from the end of
  the one before to the end of its own (its data loading included, wherever
  the framework does it); ``t_arrive`` and ``t_collective`` are None where
  the job stamps no first collective; ``injected_ms`` is the time spent in
  the slowdown during the step (``perf_counter``), ``runq_ms`` the training
  thread's wait for a CPU (``/proc/thread-self/schedstat``).

The slowdown acts from step ``ONSET_STEP`` (default 0: from the start, as
the tests run these jobs). Without ``ACCURACY_TRUTH`` nothing is written.
A slowdown in a DataLoader worker process (HF's ``WORKERS``) counts its steps
and spends its time in that process: the truth holds the training process's.
"""

from __future__ import annotations

import json
import os
import threading
import time


def runq_ns() -> int:
    """The calling thread's time waiting for a CPU so far."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class Truth:
    """This rank's steps and the time it spent slowed (a file only with
    ``ACCURACY_TRUTH``; the step count and the onset always)."""

    def __init__(self) -> None:
        self.path = os.environ.get("ACCURACY_TRUTH", "")
        self.onset = int(os.environ.get("ONSET_STEP", "0"))
        self.slow_rank = int(os.environ.get("SLOW_RANK", "-1"))
        self.ms = float(os.environ.get("SLOW_MS", "0"))
        self.fault = os.environ.get("ACCURACY_FAULT", "")
        self.rank = -1
        self.f = None
        self.lock = threading.Lock()
        self.step = 0
        self.fired = False
        self.injected_ms = 0.0
        self.t0 = time.time()
        self.q0 = runq_ns()

    def start(self, rank: int) -> None:
        """The header, once this rank knows its rank; its first step starts now."""
        self.rank = rank
        if self.path:
            self.f = open(f"{self.path}.rank{rank}", "a", buffering=1)
        self.write(
            {
                "fault": self.fault, "rank": self.slow_rank, "onset_step": self.onset,
                "ms": self.ms, "pid": os.getpid(), "tid": threading.get_native_id(),
                "shape": os.environ.get("ACCURACY_SHAPE", ""), "self": rank,
            }
        )  # fmt: skip
        self.t0, self.q0 = time.time(), runq_ns()

    def write(self, obj: dict) -> None:  # type: ignore[type-arg]
        if self.f is not None:
            with self.lock:
                self.f.write(json.dumps(obj) + "\n")
                self.f.flush()

    def slowing(self) -> bool:
        """Whether the slowdown acts now (from ``ONSET_STEP``); the onset
        line the first time it does."""
        if self.step < self.onset:
            return False
        if not self.fired:
            self.fired = True
            self.write(
                {"fault": self.fault, "rank": self.rank, "onset": time.time(), "ms": self.ms,
                 "step": self.step}
            )  # fmt: skip
        return True

    def spent(self, since: float) -> None:
        """The slowdown that began at ``perf_counter()`` ``since`` is over."""
        self.injected_ms += (time.perf_counter() - since) * 1e3

    def step_end(self, t_arrive: float | None = None, t_collective: float | None = None) -> None:
        """The optimizer step is done: its line; the next step starts now."""
        t1, q1 = time.time(), runq_ns()
        self.write(
            {
                "rank": self.rank, "step": self.step, "t0": self.t0, "t1": t1,
                "t_arrive": t_arrive, "t_collective": t_collective,
                "injected_ms": round(self.injected_ms, 3),
                "runq_ms": round((q1 - self.q0) / 1e6, 3),
            }
        )  # fmt: skip
        self.step += 1
        self.t0, self.q0, self.injected_ms = t1, q1, 0.0


TRUTH = Truth()
