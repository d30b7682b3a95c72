"""A host process that measures its own main-loop stalls, for attack tests and
``benchmarks/attack_bench.py``.

Run as a script (``python tests/stall_host.py``, with ``PROBING=1``), its main
thread spins in a tight Python loop timestamping every turn. ``SIGUSR1``
makes it print one JSON line: the longest gap between two turns since the
last report (``stall_ms``); the part of it the process's other threads
(the probe's) can have caused (``held_ms``: at most the CPU time they used
meanwhile; on a loaded machine the scheduler, not the probe, makes the
rest); its RSS, and
whether it could still open 16 file
descriptors (``open_ok``). ``SIGUSR2`` makes it take every free file
descriptor (``exhaust``), and the next ``SIGUSR2`` gives them back.
``STALL_NOFILE=N`` sets its ``RLIMIT_NOFILE`` first.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time

SCRIPT = os.path.abspath(__file__)


def other_threads_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``'s live threads but its main one (the probe's,
    in a host whose main thread spins), read from ``/proc``."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        if int(tid) == pid:
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _host() -> None:
    import resource

    nofile = os.environ.get("STALL_NOFILE")
    if nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (int(nofile), int(nofile)))
    state = {"max_gap": 0.0, "max_held": 0.0, "held": []}

    def others_cpu_s() -> float:
        """CPU time of every other thread of the process, exited ones included."""
        return time.process_time() - time.thread_time()

    def rss_mb() -> float | None:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
        except OSError:  # out of descriptors: what the attack did, not a reason to die
            return None

    def open_ok() -> bool:
        fds = []
        try:
            for _ in range(16):
                fds.append(os.open(os.devnull, os.O_RDONLY))
            return True
        except OSError:
            return False
        finally:
            for fd in fds:
                os.close(fd)

    def report(signum: int, frame: object) -> None:
        rss = rss_mb()
        line = {
            "stall_ms": round(state["max_gap"] * 1e3, 3),
            "held_ms": round(state["max_held"] * 1e3, 3),
            "rss_mb": None if rss is None else round(rss, 1),
            "open_ok": open_ok() if not state["held"] else None,
            "held": len(state["held"]),
        }
        print(json.dumps(line), flush=True)
        state["max_gap"] = state["max_held"] = 0.0

    def exhaust(signum: int, frame: object) -> None:
        held = state["held"]
        if held:
            for fd in held:
                os.close(fd)
            held.clear()
        else:
            try:
                while True:
                    held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
        print(json.dumps({"held": len(held)}), flush=True)

    signal.signal(signal.SIGUSR1, report)
    signal.signal(signal.SIGUSR2, exhaust)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    clock = time.perf_counter
    last = read_at = clock()
    others = others_cpu_s()
    pending: list[tuple[float, float, float]] = []  # (end, gap, others' CPU then)
    while True:
        now = clock()
        gap = now - last
        if gap > state["max_gap"]:
            state["max_gap"] = gap
        if gap > 0.002 or now - read_at > 0.001:  # about every ms
            o = others_cpu_s()
            if gap > 0.002:
                pending.append((now, gap, others))
            # another thread's CPU time shows once it is off the CPU: judge a
            # stall 5 ms after it, by the CPU the others used since it began
            while pending and now - pending[0][0] > 0.005:
                _, stalled, before = pending.pop(0)
                held = min(stalled, o - before)
                if held > state["max_held"]:
                    state["max_held"] = held
            others, read_at = o, now
        last = now


class StallHost:
    """Drives a running ``stall_host`` process from the test (or benchmark)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.pid = proc.pid
        first = self._line(30)
        assert "ready" in first, first
        self.report()  # start-up (imports, the probe's start) is not the attack

    def _line(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], deadline - time.monotonic())
            if r:
                line = self.proc.stdout.readline()
                if not line:
                    raise AssertionError(f"host exited: {self.proc.wait()}")
                return json.loads(line)
        raise AssertionError("the host did not answer its signal in time")

    def report(self) -> dict:
        """Longest stall (ms), RSS and fd headroom since the last report."""
        os.kill(self.pid, signal.SIGUSR1)
        return self._line(30)

    def toggle_exhaust(self) -> int:
        """Take every free descriptor in the host, or give them back; how many it holds."""
        os.kill(self.pid, signal.SIGUSR2)
        return self._line(30)["held"]

    def alive(self) -> bool:
        return self.proc.poll() is None


if __name__ == "__main__":
    _host()
