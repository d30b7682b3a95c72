"""The stack sampler on this process: on-CPU time lands on the function that
spins, blocked time on the one that sleeps, the wait for a CPU after a
wake-up is run-queue time, the probe's own threads are left out, stacks
resolve into python.stacks, and PROBING_SAMPLE_HZ turns it off. Root-only
(BPF perf events, the sched_switch and sched_wakeup tracepoints)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from probing.node.bpf import sampler as smp
from probing.node.store import Store
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
    # every stack a row counts was stored, taken out and resolved (collect_stored)
    assert {r["stack_id"] for r in rows if r["stack_id"]} <= inner.keys()
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


def nap_here(s: float) -> None:
    time.sleep(s)


def test_the_wait_for_a_cpu_after_a_wake_up_is_runq_not_blocked() -> None:
    """A thread that sleeps on a CPU a spinning process shares, at a low
    priority: after each sleep it waits for the CPU, and that wait is "runq";
    "off" is the sleep alone."""
    require_bpf()
    cpu = min(os.sched_getaffinity(0))
    spin = "import os; os.sched_setaffinity(0, {%d}); print(flush=True)\nwhile True: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin % cpu], stdout=subprocess.PIPE)
    naps, nap_s = 20, 0.02
    tids: list[int] = []
    took: list[float] = []
    go = threading.Event()

    def sleeper() -> None:
        tids.append(threading.get_native_id())
        os.sched_setaffinity(0, {cpu})  # this thread only
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # waits for its turn
        go.wait()
        t0 = time.perf_counter()
        for _ in range(naps):
            nap_here(nap_s)
        took.append(time.perf_counter() - t0)

    store = Store()
    s = smp.Sampler(store)
    try:
        assert spinner.stdout is not None and spinner.stdout.readline()  # pinned, spinning
        s.start()
        t = threading.Thread(target=sleeper, name="sleeper")
        t.start()
        s.read()  # the thread is known to the sampler: its stacks are walked
        go.set()
        t.join()
        time.sleep(0.1)  # its last wait is charged when it next leaves a CPU: it has ended
        kept = s.waits_since(0)  # the detector's RUNQ_SQL sums, no SQL
        last_read = s._waits[-1][0]
    finally:
        s.stop()
        spinner.kill()
        spinner.wait()
    rows = store.table("python", "samples").to_arrow().to_pylist()
    runq_sql = [sum(r["dur_ns"] for r in rows if r["kind"] == kind and r["ts"] <= last_read)
                for kind in ("runq", "tick")]  # fmt: skip
    assert kept == tuple(runq_sql) and runq_sql[0] > 0, (kept, runq_sql)
    frames = store.table("python", "stacks").to_arrow().to_pylist()
    inner = {f["stack_id"]: f["func"] for f in frames if f["depth"] == 0}
    ms: Counter[str] = Counter()
    for r in rows:
        if r["tid"] == tids[0] and inner.get(r["stack_id"]) == "nap_here":
            ms[r["kind"]] += r["dur_ns"] / 1e6
    slept = naps * nap_s * 1e3
    assert 0.85 * slept < ms["off"] < 1.3 * slept, (ms, slept)  # the sleeps, not the waits
    # the time it was away beyond its sleeps is the wait for the CPU after waking, as runq
    # (how long that is, the scheduler decides: 255 ms in one run, 0.2 ms in another)
    waited = took[0] * 1e3 - ms["off"]
    assert ms["runq"] > 0.5 * waited - 10, (ms, took)
    assert sum(ms.values()) < took[0] * 1e3 * 1.2, (ms, took)  # nothing counted twice


def _named_spinner(name: bytes, tids: list[int], stop: threading.Event) -> None:
    """A thread ``threading`` does not know of (as Gloo's and OpenMP's are not),
    called ``name`` by the kernel, spinning until ``stop``."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
    tids.append(threading.get_native_id())
    while not stop.is_set():
        spin_here(0.01)


def test_threads_python_did_not_start_are_named_by_the_kernel_and_the_engines_left_out() -> None:
    import _thread

    require_bpf()
    store = Store()
    s = smp.Sampler(store)
    stop = threading.Event()
    native: list[int] = []
    engine: list[int] = []
    s.start()
    try:
        _thread.start_new_thread(_named_spinner, (b"native-spin", native, stop))
        _thread.start_new_thread(_named_spinner, (b"tokio-rt-worker", engine, stop))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the sampler has seen it spin
            time.sleep(0.1)
            s.read()
            rows = store.table("python", "samples").to_arrow().to_pylist()
            if native and any(r["tid"] == native[0] and r["kind"] == "cpu" for r in rows):
                break
    finally:
        stop.set()
        s.stop()
    rows = store.table("python", "samples").to_arrow().to_pylist()
    mine = [r for r in rows if native and r["tid"] == native[0]]
    assert mine and {r["thread"] for r in mine} == {"native-spin"}, mine[:3]
    assert engine and not [r for r in rows if r["tid"] == engine[0]]
    assert not [r for r in rows if r["thread"] in smp.ENGINE_THREADS]


def test_a_hash_map_read_in_batches_is_the_map_read_key_by_key() -> None:
    # the sampler reads its counts every interval: a few bpf() calls, not two an entry
    import ctypes

    from probing.node.bpf import kernel, loader

    require_bpf()

    class Key(ctypes.Structure):
        _fields_ = [("tid", ctypes.c_uint32), ("stack_id", ctypes.c_uint32)]

    class Val(ctypes.Structure):
        _fields_ = [("count", ctypes.c_uint64), ("ns", ctypes.c_uint64)]

    spec = kernel.MapSpec("probing_test", 1, ctypes.sizeof(Key), ctypes.sizeof(Val), 4096, 0)
    fd = kernel.map_create(spec)
    try:
        m = loader.Map.__new__(loader.Map)
        m.map_fd, m.spec, m.name, m.Key, m.Leaf, m.batched = fd, spec, spec.name, Key, Val, True
        for i in range(3000):
            m[Key(i, i % 7)] = Val(i * 3, i * 1000)
        keys, vals = m.arrays()
        assert m.batched  # this kernel (>= 5.6) has batch lookups
        batched = {(int(k["tid"]), int(k["stack_id"])): (int(v["count"]), int(v["ns"]))
                   for k, v in zip(keys, vals, strict=True)}  # fmt: skip
        one_by_one = {(k.tid, k.stack_id): (v.count, v.ns) for k, v in m.items()}
        assert len(batched) == 3000 and batched == one_by_one
        # read and deleted at once (the sampler's reads): each entry once, then none
        keys, vals = m.arrays(delete=True)
        taken = {(int(k["tid"]), int(k["stack_id"])): (int(v["count"]), int(v["ns"]))
                 for k, v in zip(keys, vals, strict=True)}  # fmt: skip
        assert taken == one_by_one and not m.items()
        m[Key(1, 1)] = Val(5, 6)
        keys, vals = m.arrays(delete=True)
        assert len(keys) == 1 and int(vals["count"][0]) == 5 and not m.items()
    finally:
        os.close(fd)
