"""The drain for real: a burst of launches through libcudart's uprobe, many
ring slices long, reaches the store whole, in order, named, and sealed.
Root-only; PROBING_REQUIRE_PRIVILEGED=1 (CI) turns skips into failures."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from probing.node.bpf import drain as drain_mod
from probing.node.bpf.tracer import Tracer
from probing.node.sql import Database
from probing.node.store import Store
from tests.conftest import require_bpf
from tests.jobs.lib_loop import installed_libraries

pytestmark = pytest.mark.privileged

LOOP_C = Path(__file__).resolve().parents[2] / "benchmarks" / "call_loop.c"


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """``launch(n)``: n calls of cudaLaunchKernel from a C loop."""
    require_bpf()
    cudart = next(
        (p for p in installed_libraries() if os.path.basename(p).startswith("libcudart")), None
    )
    if cudart is None:
        pytest.fail("libcudart is not installed (make setup installs NVIDIA's wheels)")
    out = tmp_path_factory.mktemp("loop") / "libcall_loop.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(out), str(LOOP_C)], check=True)
    loop, rt = ctypes.CDLL(str(out)), ctypes.CDLL(cudart)
    loop.launch_loop.restype = ctypes.c_double
    loop.launch_loop.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    fn = ctypes.cast(rt.cudaLaunchKernel, ctypes.c_void_p).value
    stub = ctypes.cast(loop.launch_loop, ctypes.c_void_p).value
    return lambda n: loop.launch_loop(fn, stub, n)


def test_a_burst_of_many_slices_reaches_the_store_whole(launches) -> None:  # type: ignore[no-untyped-def]
    n = 3 * drain_mod.DRAIN_SLICE + 1234
    store = Store(chunk_rows=1 << 14)
    tracer = Tracer(["cuda"], store=store, interval_s=3600)  # drained here, not by the timer
    tracer.start()
    try:
        launches(n)
        assert tracer.drain() == n
        table = store.table("cuda", "calls")
        table.flush()  # waits for the chunks the sealer thread compresses
        st = table.stats()
        assert st.rows == n and st.dropped_events == 0 and st.pending_rows == 0
        assert st.chunks >= 2  # slices of up to a chunk each (stages sent part full make them less)
        rows = Database(store).sql(
            "SELECT event_id, ts, api, kernel, grid, block FROM cuda.calls ORDER BY event_id"
        )
        ids = rows.column("event_id").to_numpy()
        assert (ids == np.arange(n)).all()
        assert (np.diff(rows.column("ts").to_numpy()) >= 0).all()  # in the order of the calls
        assert set(rows.column("api").to_pylist()) == {"cudaLaunchKernel"}
        assert set(rows.column("kernel").to_pylist()) == {"launch_loop"}
        assert rows.column("grid")[0].as_py() == [1, 1, 1]
        assert rows.column("block")[-1].as_py() == [32, 1, 1]
    finally:
        tracer.stop()
        store.close()
    assert tracer.status()["families"]["cuda"]["events"] == n


def test_a_burst_drained_while_it_runs_loses_nothing(launches) -> None:  # type: ignore[no-untyped-def]
    """The drain advances the ring's consumer position while launches fill
    it, with the CPUs oversubscribed so the drain is preempted at any point:
    no reserve ever fails, not even once (a position written byte by byte,
    seen half-written by the kernel, read as a full ring)."""
    n, each = 4_000_000, 100_000  # ~6x the ring, drained by the tracer's timer as it fills
    store = Store(chunk_rows=1 << 16)
    tracer = Tracer(["cuda"], store=store)
    hogs = [
        subprocess.Popen(["python3", "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)
    ]
    tracer.start()
    try:
        for _ in range(n // each):
            launches(each)
        tracer.drain()
        cuda = tracer.status()["families"]["cuda"]
        assert (cuda["events"], cuda["dropped"], cuda["saved"]) == (n, 0, 0)
        assert store.table("cuda", "calls").stats().dropped_events == 0
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        tracer.stop()
        store.close()


def test_staged_launches_of_threads_that_move_between_cpus_keep_their_order(launches) -> None:  # type: ignore[no-untyped-def]
    """Launches are staged per CPU and sent 8 at a time: two threads that
    launch in short bursts, sleep and move between CPUs get every launch
    into the store, each thread's in the order it made them (a CPU's stage
    is sent when a thread leaves it), with none held back at the end."""
    import threading
    import time

    store = Store(chunk_rows=1 << 14)
    tracer = Tracer(["cuda"], store=store)
    tracer.start()
    bursts, size = 150, 13  # 13: a burst leaves a stage part full
    try:

        def work() -> None:
            for _ in range(bursts):
                launches(size)
                time.sleep(0.0005)  # off the CPU: it may come back on another

        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows = Database(store).sql("SELECT event_id, ts, tid FROM cuda.calls ORDER BY event_id")
        assert rows.num_rows == 2 * bursts * size
        tids = rows.column("tid").to_numpy()
        ts = rows.column("ts").to_numpy()
        assert len(set(tids.tolist())) == 2
        for tid in set(tids.tolist()):
            assert (np.diff(ts[tids == tid]) >= 0).all(), f"thread {tid}'s launches out of order"
        cuda = tracer.status()["families"]["cuda"]
        assert (cuda["events"], cuda["dropped"]) == (2 * bursts * size, 0)
    finally:
        tracer.stop()
        store.close()
