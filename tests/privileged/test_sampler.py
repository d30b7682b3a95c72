"""The stack sampler on this process: on-CPU time lands on the function that
spins, blocked time on the one that sleeps, the probe's own threads are left
out, stacks resolve into python.stacks, and PROBING_SAMPLE_HZ turns it off.
Root-only (BPF perf events and the sched_switch tracepoint)."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from probing.bpf import sampler as smp
from probing.store import Store
from tests.conftest import require_bpf

pytestmark = pytest.mark.privileged


def spin_here(s: float) -> None:
    end = time.perf_counter() + s
    while time.perf_counter() < end:
        pass


def sleep_here(s: float) -> None:
    time.sleep(s)


def test_time_lands_on_the_function_that_spends_it() -> None:
    require_bpf()
    store = Store()
    s = smp.Sampler(store)
    s.start()
    try:
        for _ in range(10):
            spin_here(0.05)
            sleep_here(0.05)
    finally:
        s.stop()
    rows = store.table("python", "samples").to_arrow().to_pylist()
    frames = store.table("python", "stacks").to_arrow().to_pylist()
    inner = {f["stack_id"]: f["func"] for f in frames if f["depth"] == 0}
    ms: Counter[tuple[str, str | None]] = Counter()
    for r in rows:
        ms[(r["kind"], inner.get(r["stack_id"]))] += r["dur_ns"] / 1e6
    # 500 ms of each: spinning is on a CPU or waiting for one, sleeping is off it
    assert 300 < ms[("cpu", "spin_here")] + ms[("runq", "spin_here")] < 900, ms
    assert 400 < ms[("off", "sleep_here")] < 900, ms
    assert ms[("cpu", "sleep_here")] < 50 and ms[("off", "spin_here")] < 100, ms
    assert sum(r["dur_ns"] for r in rows if r["kind"] == "tick") / 1e9 > 0.9  # reads cover it
    assert not [r for r in rows if (r["thread"] or "").startswith("probing")]
    assert s.reads >= 1 and s.bpf is None  # stopped: unloaded


def test_the_rate_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, hz in (("", smp.SAMPLE_HZ), ("-1", smp.SAMPLE_HZ), ("0", 0), ("49", 49)):
        monkeypatch.setenv("PROBING_SAMPLE_HZ", raw)
        assert smp.sample_hz() == hz
