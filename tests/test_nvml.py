"""NVML sampling through pynvml's real code path, on a machine without a GPU.

A stand-in ``libnvidia-ml.so.1`` (``tests/fixtures/fake_nvml.c``, built here)
is found by pynvml's own ``CDLL("libnvidia-ml.so.1")`` through the target's
``LD_LIBRARY_PATH``, and answers with scripted values (see the C file).
"""

from __future__ import annotations

import ctypes.util
import statistics
import time
from pathlib import Path

import pytest

from probing.cli.client import ProbeClient
from probing.config import parse_interval
from probing.node.tables.nvml import visible_indices
from tests.conftest import SLOWDOWN, build_lib, cli

GIB, MIB = 1 << 30, 1 << 20


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fake-nvml")
    build_lib("fake_nvml.c", d / "libnvidia-ml.so.1", "-Werror")
    return d


IDLE = "import time\nwhile True: time.sleep(0.05)\n"


def _target(spawn, lib: Path | None, **env: str):  # type: ignore[no-untyped-def]
    """A job whose engine samples the stand-in NVML with the job's script."""
    full = {"LD_LIBRARY_PATH": str(lib)} if lib else {}
    full.update(env)
    job_only = ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK")  # the job's, read by the engine from it
    passed = [k for k in full if k not in job_only and not k.startswith("PROBING_")]
    full["PROBING_ENGINE_ENV"] = ",".join(passed)
    return spawn(IDLE, env=full)


def _rows(pid: int, sql: str) -> list[dict]:  # type: ignore[type-arg]
    return ProbeClient.for_pid(pid).query(sql).to_pylist()


def _wait_samples(pid: int, n: int, timeout: float = 20) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = _rows(pid, "SELECT * FROM nvml.status")[0]
        if status["samples"] >= n:
            return status
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} samples: {status}")


def test_scripted_values_nulls_errors_and_interval(spawn, fake_nvml: Path) -> None:
    t = _target(
        spawn,
        fake_nvml,
        PROBING_NVML_INTERVAL="100ms",
        FAKE_NVML_FAIL_UTIL_AT="3",
        FAKE_NVML_XID_AT="2",
        FAKE_NVML_UNSUPPORTED="power",
    )
    status = _wait_samples(t.pid, 12)
    assert status["state"] == "sampling" and status["interval_s"] == 0.1
    assert status["driver"] == "999.99-fake" and status["sampled"] == 2
    assert status["unsupported"] == "power", "an unsupported counter is not an error"
    assert status["errors"] == 1 and "utilization" in status["last_error"]

    rows = _rows(t.pid, "SELECT * FROM nvml.gpu ORDER BY ts, gpu")
    assert len(rows) >= 24
    by_gpu = {g: [r for r in rows if r["gpu"] == g] for g in (0, 1)}
    for g, series in by_gpu.items():
        for n, r in enumerate(series):
            want_util = None if (g, n) == (0, 3) else 10 * g + n % 50
            assert r["util_gpu"] == want_util, (g, n, r)
            assert r["power_w"] is None, "NOT_SUPPORTED is NULL"
            assert r["mem_used"] == (g + 1) * GIB + n * MIB and r["mem_total"] == 80 * GIB
            assert (r["sm_clock_mhz"], r["mem_clock_mhz"], r["temp_c"]) == (1400 + n, 2619, 40 + g)
            assert (r["pcie_tx_kbs"], r["pcie_rx_kbs"]) == (1000 + n, 2000 + n)
            assert (r["nvlink_tx_kib"], r["nvlink_rx_kib"]) == (1024 * n, 2048 * n)
            assert r["throttle_reasons"] == (4 if g == 1 else 0) and r["ecc_uncorrected"] == g
            assert r["uuid"].endswith(str(g))
    xids = [(r["gpu"], r["xid"], r["xid_count"]) for r in rows if r["xid"] is not None]
    assert xids == [(0, 79, 1)]
    # sampling went on after the error, at the asked interval (within 10 %)
    ts = [r["ts"] for r in by_gpu[0]]
    gaps = [(b - a) / 1e9 for a, b in zip(ts, ts[1:], strict=False)]
    assert abs(statistics.median(gaps) - 0.1) < 0.01, gaps
    devices = _rows(t.pid, "SELECT gpu, name, pci_bus_id, nvlink_count, sampled FROM nvml.devices")
    assert devices == [
        {"gpu": 0, "name": "Fake H100 0", "pci_bus_id": "00000000:18:00.0", "nvlink_count": 18,
         "sampled": True},
        {"gpu": 1, "name": "Fake H100 1", "pci_bus_id": "00000000:19:00.0", "nvlink_count": 18,
         "sampled": True},
    ]  # fmt: skip


def test_only_visible_gpus_start_stop_and_join(spawn, fake_nvml: Path) -> None:
    t = _target(spawn, fake_nvml, CUDA_VISIBLE_DEVICES="1")
    status = _rows(t.pid, "SELECT state, reason FROM nvml.status")[0]
    assert status["state"] == "stopped" and "probing nvml" in status["reason"]
    out = cli("nvml", "--pid", str(t.pid), "--interval", "50ms")
    assert out.returncode == 0 and "state=sampling" in out.stdout, out.stderr
    _wait_samples(t.pid, 5)
    assert cli("nvml", "--pid", str(t.pid), "--stop").returncode == 0
    n = _rows(t.pid, "SELECT samples FROM nvml.status")[0]["samples"]
    time.sleep(0.3)
    assert _rows(t.pid, "SELECT samples, state FROM nvml.status")[0] == {
        "samples": n,
        "state": "stopped",
    }
    assert {r["gpu"] for r in _rows(t.pid, "SELECT DISTINCT gpu FROM nvml.gpu")} == {1}
    sampled = _rows(t.pid, "SELECT gpu, sampled FROM nvml.devices ORDER BY gpu")
    assert sampled == [{"gpu": 0, "sampled": False}, {"gpu": 1, "sampled": True}]

    # the README's join: the nearest sample beside each event
    samples = _rows(t.pid, "SELECT ts, util_gpu FROM nvml.gpu ORDER BY ts")
    mid = [(a["ts"] + b["ts"]) // 2 + 1 for a, b in zip(samples, samples[1:], strict=False)]
    ProbeClient.for_pid(t.pid).eval(
        "import probing\n"
        "ev = probing.ExternalTable('calls', ['ts', 'gpu', 'name'])\n"
        f"ev.append_many([[ts, 1, 'k'] for ts in {mid!r}]); ev.flush()"
    )
    joined = _rows(
        t.pid,
        """
        SELECT ts, sample_ts, util_gpu FROM (
          SELECT c.ts, g.ts AS sample_ts, g.util_gpu,
                 row_number() OVER (PARTITION BY c.ts, c.gpu ORDER BY abs(g.ts - c.ts)) AS k
          FROM python.calls c JOIN nvml.gpu g
            ON g.gpu = c.gpu AND g.ts BETWEEN c.ts - 1000000000 AND c.ts + 1000000000
        ) WHERE k = 1 ORDER BY ts
        """,
    )
    assert [j["sample_ts"] for j in joined] == [s["ts"] for s in samples[1:]]


def _own(pid: int, want: set[int], timeout: float = 20) -> None:
    """Wait until the newest sample marks exactly ``want`` as the job's GPUs."""
    deadline = time.monotonic() + timeout
    while True:
        rows = _rows(pid, "SELECT gpu, own FROM nvml.gpu WHERE ts = (SELECT max(ts) FROM nvml.gpu)")
        own = {r["gpu"] for r in rows if r["own"]}
        if own == want and len(rows) == 4:
            return
        assert time.monotonic() < deadline, f"own {own}, not {want}: {rows}"
        time.sleep(0.1)


def test_the_gpu_a_rank_works_on_among_every_visible_one(
    spawn, fake_nvml: Path, tmp_path: Path
) -> None:
    """Every GPU visible, one a rank (torchrun, Lightning): NVML's process list
    says which it works on; before it made a CUDA context, its LOCAL_RANK."""
    procs = tmp_path / "procs"
    t = _target(spawn, fake_nvml, PROBING_NVML_INTERVAL="50ms", FAKE_NVML_GPUS="4",
                FAKE_NVML_PROCS=str(procs), LOCAL_RANK="1")  # fmt: skip
    _own(t.pid, {1})
    procs.write_text(f"0 {t.pid + 100000}\n2 {t.pid}\n3 {t.pid + 100001}\n")
    _own(t.pid, {2})
    bare = _target(spawn, fake_nvml, PROBING_NVML_INTERVAL="50ms", FAKE_NVML_GPUS="4")
    _own(bare.pid, {0, 1, 2, 3})  # nothing tells: every visible one is its own


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"FAKE_NVML_INIT_ERROR": "9"}, "NVIDIA driver not loaded"),
        ({"FAKE_NVML_GPUS": "0"}, "no NVIDIA GPU found"),
        ({"CUDA_VISIBLE_DEVICES": ""}, "CUDA_VISIBLE_DEVICES hides every GPU"),
    ],
)
def test_unavailable_says_why(spawn, fake_nvml: Path, env: dict, reason: str) -> None:  # type: ignore[type-arg]
    t = _target(spawn, fake_nvml, PROBING_NVML_INTERVAL="50ms", **env)
    deadline = time.monotonic() + 30 * SLOWDOWN  # NVML starts in the background
    while True:
        status = _rows(t.pid, "SELECT state, reason FROM nvml.status")[0]
        if status["state"] != "stopped" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status == {"state": "unavailable", "reason": reason}
    assert _rows(t.pid, "SELECT count(*) AS n FROM nvml.gpu") == [{"n": 0}]
    out = cli("nvml", "--pid", str(t.pid))
    assert out.returncode == 1 and reason in out.stdout and "Traceback" not in out.stderr


def test_no_library_at_all(spawn) -> None:
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has a real NVML")
    t = _target(spawn, None)
    out = cli("nvml", "--pid", str(t.pid))
    assert out.returncode == 1 and "state=unavailable" in out.stdout
    assert "NVML library not found" in out.stdout and "Traceback" not in out.stderr
    assert _rows(t.pid, "SELECT count(*) AS n FROM nvml.gpu") == [{"n": 0}]
    doctor = cli("doctor")
    assert "NVML library not found" in doctor.stdout


def test_visible_indices_and_intervals() -> None:
    uuids = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]
    assert visible_indices(3, uuids, None) == [0, 1, 2]
    assert visible_indices(3, uuids, "2,0") == [2, 0]
    assert visible_indices(3, uuids, "GPU-bb") == [1]
    assert visible_indices(3, uuids, "1,7,2") == [1], "CUDA stops at the first bad entry"
    assert visible_indices(3, uuids, "") == []
    assert parse_interval("100ms") == 0.1 and parse_interval("2s") == 2.0
    assert parse_interval("0.25") == 0.25 and parse_interval(0.5) == 0.5
    for bad in ("fast", "0ms", "2h"):
        with pytest.raises(ValueError):
            parse_interval(bad)
