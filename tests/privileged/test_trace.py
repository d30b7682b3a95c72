"""``probing trace`` for real: BPF uprobes on NVIDIA's own libcudart and
libnccl (from their wheels; calls fail without a GPU, but the uprobes fire
and the arguments decode), a stand-in libcuda, and a real torch Gloo job.
Root-only; PROBING_REQUIRE_PRIVILEGED=1 (CI) turns skips into failures."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from probing import checks
from probing.cli import doctor
from probing.cli.client import ProbeClient
from probing.cli.demo import free_port
from probing.node.bpf import families as fam
from probing.node.bpf.tracer import Tracer
from probing.node.sql import Database
from probing.node.store import Store
from tests.conftest import SLOWDOWN, build_lib, cli
from tests.privileged.helpers import (
    installed_lib,
    no_uprobes_left,
    perf_uprobes,
    require_privileged,
    wait_line,
)

pytestmark = pytest.mark.privileged


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_lib("fake_libcuda.c", tmp_path_factory.mktemp("fake-cuda") / "libcuda.so.1")


@pytest.fixture(scope="module")
def fake_cudart(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A stripped stand-in runtime that launches through the driver."""
    out = tmp_path_factory.mktemp("fake-cudart") / "libcudart.so.99"
    return build_lib("fake_cudart.c", out, "-s", "-ldl")


class _Traced:
    """This (test) process traced into a private store."""

    def __init__(self, families: list[str]) -> None:
        self.store = Store()
        self.tracer = Tracer(families, store=self.store)

    def __enter__(self) -> _Traced:
        self.tracer.start()
        return self

    def rows(self, sql: str) -> list[dict]:  # type: ignore[type-arg]
        self.tracer.drain()
        return Database(self.store).sql(sql).to_pylist()

    def __exit__(self, *exc: object) -> None:
        self.tracer.stop()
        self.store.close()


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


P = ctypes.c_void_p
SZ = ctypes.c_size_t


def test_a_runtime_launch_is_one_launch_named_by_the_runtime(
    fake_libcuda: str, fake_cudart: str
) -> None:
    """The runtime launches through the driver's cuLaunchKernel (seen on an
    H100 with torch: every kernel came twice); only a direct driver launch,
    Triton's way, is a cuLaunchKernel row. The stub has no symbol: the
    runtime's cudaFuncGetName names it."""
    require_privileged()
    runtime = ctypes.CDLL(fake_cudart)
    assert runtime.probing_use_driver(fake_libcuda.encode()) == 1
    runtime.probing_hidden_stub.restype = P
    stub = runtime.probing_hidden_stub()
    driver = ctypes.CDLL(fake_libcuda)
    with _Traced(["cuda"]) as t:
        assert set(t.tracer.status()["families"]["cuda"]["libraries"]) >= {
            fake_libcuda,
            fake_cudart,
        }
        for _ in range(3):
            assert (
                runtime.cudaLaunchKernel(P(stub), Dim3(8, 1, 1), Dim3(64, 1, 1), None, 0, None) == 0
            )
        driver.cuLaunchKernel(P(0x10), 1, 1, 1, 32, 1, 1, 0, None, None, None)
        rows = t.rows("SELECT api, kernel, grid FROM cuda.calls ORDER BY event_id")
    assert [r["api"] for r in rows] == ["cudaLaunchKernel"] * 3 + ["cuLaunchKernel"]
    assert {r["kernel"] for r in rows[:3]} == {"hidden_stub(float*, int)"}
    assert rows[0]["grid"] == [8, 1, 1]


def test_cuda_runtime_and_driver_calls_decode_exactly(fake_libcuda: str) -> None:
    require_privileged()
    cudart = ctypes.CDLL(installed_lib("libcudart"))
    driver = ctypes.CDLL(fake_libcuda)
    stub = ctypes.cast(driver.probing_test_kernel_stub, P).value
    with _Traced(["cuda"]) as t:
        assert set(t.tracer.status()["families"]["cuda"]["libraries"]) >= {fake_libcuda}
        ptr = P()
        for size in (1000, 1001, 1002):
            cudart.cudaMalloc(ctypes.byref(ptr), SZ(size))
        cudart.cudaFree(P(0x1234))
        cudart.cudaMemcpy(P(0x10), P(0x20), SZ(4096), 1)
        cudart.cudaMemcpyAsync(P(0x30), P(0x40), SZ(512), 2, P(0x99))
        cudart.cudaStreamSynchronize(P(0x99))
        cudart.cudaDeviceSynchronize()
        cudart.cudaEventSynchronize(P(0x55))
        cudart.cudaGraphLaunch(P(0x66), P(0x99))
        cudart.cudaLaunchKernel(P(stub), Dim3(2, 3, 4), Dim3(32, 1, 1), None, SZ(128), P(0x97))
        fn = P()
        assert driver.cuModuleGetFunction(ctypes.byref(fn), None, b"triton_matmul_0") == 0
        driver.cuLaunchKernel(fn, 5, 6, 7, 64, 2, 1, 256, P(0x98), None, None)
        rows = t.rows(
            "SELECT api, kernel, grid, block, bytes, kind, stream, ptr, func, ret, dur_ns, tid "
            "FROM cuda.calls ORDER BY event_id"
        )
    by_api: dict[str, list[dict]] = {}  # type: ignore[type-arg]
    for r in rows:
        by_api.setdefault(r["api"], []).append(r)
    expected = {
        "cudaMalloc": 3, "cudaFree": 1, "cudaMemcpy": 1, "cudaMemcpyAsync": 1,
        "cudaStreamSynchronize": 1, "cudaDeviceSynchronize": 1, "cudaEventSynchronize": 1,
        "cudaGraphLaunch": 1, "cudaLaunchKernel": 1, "cuModuleGetFunction": 1,
        "cuLaunchKernel": 1,
    }  # fmt: skip
    assert {a: len(v) for a, v in by_api.items()} == expected
    assert all(r["tid"] == ctypes.CDLL(None).gettid() for r in rows)
    assert [r["bytes"] for r in by_api["cudaMalloc"]] == [1000, 1001, 1002]
    # no driver here: every runtime call fails, with its real return code and duration
    assert all(r["ret"] == 35 and r["dur_ns"] > 0 for r in by_api["cudaMalloc"])
    assert by_api["cudaFree"][0]["ptr"] == 0x1234
    m = by_api["cudaMemcpy"][0]
    assert (m["bytes"], m["kind"], m["ptr"]) == (4096, "HostToDevice", 0x10)
    assert m["dur_ns"] is not None and m["ret"] is not None
    a = by_api["cudaMemcpyAsync"][0]
    assert (a["bytes"], a["kind"], a["stream"], a["dur_ns"]) == (512, "DeviceToHost", 0x99, None)
    assert by_api["cudaStreamSynchronize"][0]["stream"] == 0x99
    assert by_api["cudaStreamSynchronize"][0]["ret"] is not None
    assert by_api["cudaEventSynchronize"][0]["stream"] == 0x55
    assert (by_api["cudaGraphLaunch"][0]["func"], by_api["cudaGraphLaunch"][0]["stream"]) == (
        0x66, 0x99)  # fmt: skip
    k = by_api["cudaLaunchKernel"][0]
    assert (k["kernel"], k["grid"], k["block"], k["bytes"], k["stream"]) == (
        "probing_test_kernel_stub", [2, 3, 4], [32, 1, 1], 128, 0x97)  # fmt: skip
    d = by_api["cuLaunchKernel"][0]
    assert (d["kernel"], d["grid"], d["block"], d["bytes"], d["stream"]) == (
        "triton_matmul_0", [5, 6, 7], [64, 2, 1], 256, 0x98)  # fmt: skip


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_uint8 * 128)]


def _fnv_words(raw: bytes) -> int:
    h = 0xCBF29CE484222325
    for i in range(0, 128, 8):
        h ^= int.from_bytes(raw[i : i + 8], "little")
        h = (h * 0x100000001B3) & (2**64 - 1)
    return h


# a handler the verifier refuses, for real: r0 = r2, a register never written
REFUSED = bytes([0xBF, 0x20, 0, 0, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0])


def test_a_handler_the_kernel_refuses_is_said_and_the_others_trace(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The verifier refusing one handler (as a stack walk grown past its
    limit once made it) leaves that call untraced, and ``probing trace``
    says which and why; the family's other calls, which share its
    multi-uprobe link, still trace."""
    require_privileged()
    from probing.cli.render import TraceMonitor
    from probing.node.bpf import tracer as tracer_mod

    real = tracer_mod.compile_family

    def compile_family(f, flags):  # type: ignore[no-untyped-def]
        compiled, cached = real(f, flags)
        if f.name == "cuda":  # a copy: the node's cache keeps the real one
            programs = dict(compiled.programs, cuda_streamsynchronize=(REFUSED, []))
            compiled = dataclasses.replace(compiled, programs=programs)
        return compiled, cached

    monkeypatch.setattr(tracer_mod, "compile_family", compile_family)
    cudart = ctypes.CDLL(installed_lib("libcudart"))
    with _Traced(["cuda"]) as t:  # every libcudart this process maps (an earlier test's too)
        status = t.tracer.status()
        refused = status["families"]["cuda"]["refused"]
        assert refused and all(r["kind"] == "entry" for r in refused), refused
        assert {r["symbol"] for r in refused} == {"cudaStreamSynchronize"}, refused
        error = refused[0]["error"]  # one line: what was refused, and the verifier's reason
        assert error.startswith("the kernel refused BPF program cuda_streamsynchronize"), error
        assert error.endswith(": R2 !read_ok"), error
        said = TraceMonitor(os.getpid(), status).started()
        n = len(refused)
        assert f"! cuda: {n} uprobe{'s' * (n != 1)} not attached, their calls not" in said, said
        assert f"      cudaStreamSynchronize: {error}\n" in said, said
        assert "SELECT * FROM probing.uprobes WHERE NOT attached" in said
        ptr = P()
        cudart.cudaMalloc(ctypes.byref(ptr), SZ(1000))
        cudart.cudaStreamSynchronize(P(0x99))
        cudart.cudaFree(P(0x1234))
        apis = [r["api"] for r in t.rows("SELECT api FROM cuda.calls ORDER BY event_id")]
        attempts = t.tracer.probes_table().to_pylist()  # probing.uprobes
    assert apis == ["cudaMalloc", "cudaFree"], apis
    assert sum(not a["attached"] for a in attempts) == n and len(attempts) > 10 * n, attempts


def test_nccl_calls_decode_exactly() -> None:
    require_privileged()
    nccl = ctypes.CDLL(installed_lib("libnccl"))
    # zeroed stand-ins for communicators: NCCL checks their magic and
    # returns ncclInvalidArgument (4) instead of touching a GPU
    bufs = [ctypes.create_string_buffer(1 << 20) for _ in range(2)]
    A, B = (P(ctypes.addressof(b)) for b in bufs)
    s, r = P(0x1000), P(0x2000)
    uid = UniqueId()
    for i in range(128):
        uid.internal[i] = (i * 7 + 3) % 256
    with _Traced(["nccl"]) as t:
        for _ in range(3):
            nccl.ncclAllReduce(s, r, SZ(1024), 7, 0, A, P(0x51))
        nccl.ncclAllGather(s, r, SZ(100), 0, B, P(0x52))
        nccl.ncclReduceScatter(s, r, SZ(10), 8, 2, A, P(0x53))
        nccl.ncclBroadcast(s, r, SZ(16), 2, 1, A, P(0x54))
        nccl.ncclReduce(s, r, SZ(8), 5, 3, 2, B, P(0x55))
        nccl.ncclSend(s, SZ(32), 6, 3, A, P(0x56))
        nccl.ncclRecv(r, SZ(32), 9, 0, B, P(0x57))
        nccl.ncclGroupStart()
        nccl.ncclGroupEnd()
        comm = P()
        init_ret = nccl.ncclCommInitRank(ctypes.byref(comm), 4, uid, 2)
        rows = t.rows(
            "SELECT api, op, comm, comm_id, seq, rank, nranks, count, dtype, bytes, redop, "
            "peer, stream, ret FROM nccl.calls ORDER BY event_id"
        )
    got = [(r["api"], r["op"], r["seq"], r["bytes"], r["redop"], r["peer"], r["stream"])
           for r in rows if r["op"]]  # fmt: skip
    a, b = A.value, B.value
    assert got == [
        ("ncclAllReduce", "allreduce", 0, 4096, "sum", None, 0x51),
        ("ncclAllReduce", "allreduce", 1, 4096, "sum", None, 0x51),
        ("ncclAllReduce", "allreduce", 2, 4096, "sum", None, 0x51),
        ("ncclAllGather", "allgather", 0, 100, None, None, 0x52),
        ("ncclReduceScatter", "reducescatter", 3, 80, "max", None, 0x53),
        ("ncclBroadcast", "broadcast", 4, 64, None, 1, 0x54),
        ("ncclReduce", "reduce", 1, 64, "min", 2, 0x55),
        ("ncclSend", "send", 5, 64, None, 3, 0x56),
        ("ncclRecv", "recv", 2, 64, None, 0, 0x57),
    ]
    collectives = [r for r in rows if r["op"]]
    assert [r["comm"] for r in collectives] == [a, a, a, b, a, a, b, a, b]
    assert all(r["ret"] == 4 for r in collectives)
    assert [r["dtype"] for r in collectives][3:] == [
        "int8", "float64", "int32", "uint64", "float16", "bfloat16"]  # fmt: skip
    assert [r["api"] for r in rows if not r["op"]] == [
        "ncclGroupStart", "ncclGroupEnd", "ncclCommInitRank"]  # fmt: skip
    init = rows[-1]
    assert (init["rank"], init["nranks"], init["ret"]) == (2, 4, init_ret)
    assert init["comm_id"] == _fnv_words(bytes(uid.internal))


GLOO_START = """
import os, sys, time
import torch, torch.distributed as dist
rank, world, port, go = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.02)
"""


def _gloo_rank(body: str) -> str:
    """A Gloo rank's code: its group joined, it waits for the file ``go``
    (every rank traced), then runs ``body``, prints done and lingers."""
    return GLOO_START + body + 'print("done", flush=True)\ntime.sleep(600)\n'


GLOO_RANK = _gloo_rank("""
t = torch.ones(1000)
for _ in range(10):
    dist.all_reduce(t)
dist.broadcast(t, 0)
""")


def _traced_gloo_job(spawn, tmp_path: Path, code: str, world: int):  # type: ignore[no-untyped-def]
    """A ``world``-rank Gloo job running ``code``, every rank traced (every
    Gloo uprobe attached) before it starts; its ranks once each printed done."""
    port, go = free_port(), tmp_path / "go"
    ranks = [
        spawn("", argv=[sys.executable, "-c", code, str(r), str(world), str(port), str(go)])
        for r in range(world)
    ]
    for t in ranks:
        wait_line(t, "ready")
    for t in ranks:
        status = ProbeClient.for_pid(t.pid, timeout=30 * SLOWDOWN).trace_start(["gloo"])
        handlers = sum(1 + (f.ret is not None) for f in fam.GLOO_FUNCS)
        assert status["families"]["gloo"]["uprobes"] == handlers
        assert perf_uprobes(t.pid), "uprobes attached while tracing"
    go.touch()
    for t in ranks:
        wait_line(t, "done")
    return ranks


def test_gloo_job_every_rank_matches(spawn, tmp_path: Path) -> None:
    require_privileged()
    world = 3
    ranks = _traced_gloo_job(spawn, tmp_path, GLOO_RANK, world)
    seen_ranks = []
    for t in ranks:
        client = ProbeClient.for_pid(t.pid)
        rows = client.query(
            "SELECT op, seq, rank, nranks, bytes, dur_ns FROM gloo.calls ORDER BY seq"
        ).to_pylist()
        assert [r["op"] for r in rows] == ["allreduce"] * 10 + ["broadcast"]
        assert [r["seq"] for r in rows] == list(range(11))
        assert all(r["bytes"] == 4000 for r in rows[:10])  # 1000 float32
        assert {(r["rank"], r["nranks"]) for r in rows} == {(rows[0]["rank"], world)}
        assert all(r["dur_ns"] > 0 for r in rows)
        seen_ranks.append(rows[0]["rank"])
        view = client.query(
            "SELECT backend, count(*) AS n, max(seq) AS last FROM comm.collectives GROUP BY backend"
        ).to_pylist()
        assert view == [{"backend": "gloo", "n": 11, "last": 10}]
        client.trace_stop()
        no_uprobes_left(t.pid)  # every uprobe detached
        # the data stays queryable after the trace
        assert client.query("SELECT count(*) AS n FROM gloo.calls").to_pylist() == [{"n": 11}]
    assert sorted(seen_ranks) == list(range(world))


GLOO_REDUCE_SCATTERS = 6
GLOO_REDUCE_SCATTER = _gloo_rank(f"""
out = torch.zeros(250)
for _ in range({GLOO_REDUCE_SCATTERS}):
    dist.reduce_scatter_tensor(out, torch.ones(250 * world))  # FSDP2's, ZeRO's
dist.reduce_scatter(out, [torch.ones(250) for _ in range(world)])  # the list form
""")


def test_a_gloo_reduce_scatter_is_one_collective_per_call(spawn, tmp_path: Path) -> None:
    """torch runs Gloo's reduce-scatter as all-reduces (one per rank for the
    list form): each call is still one reducescatter row, matched
    across ranks by its group and seq, its bytes what each rank receives."""
    require_privileged()
    world, n = 2, GLOO_REDUCE_SCATTERS + 1
    per_rank = []
    for t in _traced_gloo_job(spawn, tmp_path, GLOO_REDUCE_SCATTER, world):
        client = ProbeClient.for_pid(t.pid)
        rows = client.query(
            "SELECT c.op, c.seq, c.rank, c.nranks, c.bytes, c.dur_ns, c.tid, g.pg"
            " FROM comm.collectives c JOIN comm.groups g ON c.comm = g.comm ORDER BY c.seq"
        ).to_pylist()
        assert [r["op"] for r in rows] == ["reducescatter"] * n
        assert [r["bytes"] for r in rows] == [1000] * n  # 250 float32 received
        assert all(r["dur_ns"] > 0 for r in rows)
        assert {(r["nranks"], r["tid"]) for r in rows} == {(world, t.pid)}  # the main thread
        per_rank.append((rows[0]["rank"], [(r["pg"], r["seq"]) for r in rows]))
        apis = client.query("SELECT api FROM gloo.calls ORDER BY seq").to_pylist()
        assert [r["api"] for r in apis] == [
            "c10d::ProcessGroupGloo::_reduce_scatter_base"
        ] * GLOO_REDUCE_SCATTERS + ["c10d::ProcessGroupGloo::reduce_scatter"]
    assert sorted(rank for rank, _ in per_rank) == list(range(world))
    assert per_rank[0][1] == per_rank[1][1] == [("0", seq) for seq in range(n)]


CUDA_LOOP = """
import ctypes, os, sys, time
go, n = sys.argv[2], int(sys.argv[3])
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.01)
cudart = ctypes.CDLL(sys.argv[1])
while os.environ.get("GO_CALLS") and not os.path.exists(os.environ["GO_CALLS"]):
    time.sleep(0.01)
p = ctypes.c_void_p()
for i in range(n):
    cudart.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(5000 + i))
    time.sleep(0.002)
print("done", flush=True)
if n < 0 or os.environ.get("LINGER"):
    time.sleep(600)
"""


def _cuda_target(spawn, tmp_path: Path, n: int, lib: str | None = None, **env: str):  # type: ignore[no-untyped-def]
    go = tmp_path / "go"
    argv = [sys.executable, "-c", CUDA_LOOP, lib or installed_lib("libcudart"), str(go), str(n)]
    t = spawn("", argv=argv, env=env)
    wait_line(t, "ready")
    return t, go


def test_cli_output_is_complete_when_the_target_exits(spawn, tmp_path: Path) -> None:
    require_privileged()
    calls = tmp_path / "calls"  # made once the library loaded later is attached
    t, go = _cuda_target(spawn, tmp_path, 200, GO_CALLS=str(calls))
    out = tmp_path / "trace.parquet"
    proc = subprocess.Popen(
        [sys.executable, "-m", "probing", "trace", "--pid", str(t.pid), "--no-nccl",
         "--no-gloo", "--output", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if ProbeClient.for_pid(t.pid).trace_status()["state"] == "tracing":
                break
        except Exception:
            pass
        time.sleep(0.05)
    go.touch()  # the library is loaded only now: found by the tracer's next look at the maps
    client = ProbeClient.for_pid(t.pid)
    while not client.trace_status()["families"]["cuda"]["libraries"]:
        assert time.monotonic() < deadline, "the library loaded later was never attached"
        time.sleep(0.05)
    calls.touch()
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "cuda.calls" in stdout and "no library mapped yet" in stdout
    assert f"pid {t.pid} exited" in stderr and "complete (200 events)" in stderr
    table = pq.read_table(out)
    assert table.column("table").to_pylist() == ["cuda.calls"] * 200
    assert table.column("bytes").to_pylist() == [5000 + i for i in range(200)]
    assert table.column("event_id").to_pylist() == list(range(200))


def test_background_stop_and_a_library_loaded_later(spawn, tmp_path: Path) -> None:
    require_privileged()
    lib_dir = tmp_path / "elsewhere"  # not on sys.path: found when it is mapped
    lib_dir.mkdir()
    copy = lib_dir / "libcudart.so.12"
    shutil.copy(installed_lib("libcudart"), copy)
    # the tracer looks for newly mapped libraries every second: the job calls
    # once it has found this one (GO_CALLS), not after a guess at how long
    calls = tmp_path / "calls"
    t, go = _cuda_target(spawn, tmp_path, 4, lib=str(copy), LINGER="1", GO_CALLS=str(calls))
    started = cli("trace", "--pid", str(t.pid), "--no-nccl", "--no-gloo", "--background")
    assert started.returncode == 0, started.stderr
    assert "--stop" in started.stdout
    status = ProbeClient.for_pid(t.pid).trace_status()
    assert status["state"] == "tracing" and str(copy) not in status["families"]["cuda"]["libraries"]
    # no CUDA library mapped: its program (and its 64 MiB ring) not loaded yet
    assert status["families"]["cuda"]["loaded"] is False, status["families"]
    go.touch()
    deadline = time.monotonic() + 30 * SLOWDOWN
    while True:
        cuda = ProbeClient.for_pid(t.pid).trace_status()["families"]["cuda"]
        if str(copy) in cuda["libraries"] and cuda["loaded"]:
            break
        assert time.monotonic() < deadline, f"the library mapped later was not found: {cuda}"
        time.sleep(0.1)
    calls.touch()
    wait_line(t, "done")
    stopped = cli("trace", "--pid", str(t.pid), "--stop")
    assert stopped.returncode == 0, stopped.stderr
    assert "every uprobe detached" in stopped.stdout
    no_uprobes_left(t.pid)
    cuda = ProbeClient.for_pid(t.pid).trace_status()["families"]["cuda"]
    assert str(copy) in cuda["libraries"] and cuda["loaded"], cuda
    q = cli("query", "--pid", str(t.pid), "-f", "json", "SELECT bytes FROM cuda.calls ORDER BY 1")
    assert [r["bytes"] for r in json.loads(q.stdout)] == [5000, 5001, 5002, 5003]
    again = cli("trace", "--pid", str(t.pid), "--stop")
    assert again.returncode == 0 and "already stopped" in again.stdout  # as --job says


def test_a_target_killed_mid_trace_leaves_no_uprobes(spawn, tmp_path: Path) -> None:
    require_privileged()
    t, go = _cuda_target(spawn, tmp_path, 10**6)
    client = ProbeClient.for_pid(t.pid)
    client.trace_start(["cuda", "nccl"])
    go.touch()  # the library loads, and is attached at the tracer's next look
    deadline = time.monotonic() + 60
    while not client.trace_status()["families"]["cuda"]["libraries"]:
        assert time.monotonic() < deadline, "libcudart was never attached"
        time.sleep(0.05)
    assert perf_uprobes(t.pid)
    time.sleep(0.3)
    os.kill(t.pid, signal.SIGKILL)
    t.proc.wait(timeout=10)
    no_uprobes_left(t.pid)
    with open(os.path.join(checks.tracefs_dir() or "/sys/kernel/tracing", "uprobe_events")) as f:
        assert f"_{t.pid}" not in f.read()


def test_no_bpf_permission_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from probing.errors import BPFUnavailable

    failing = doctor.Check("caps", False, "CAP_BPF missing", "run as root")
    monkeypatch.setattr(checks, "check_bpf_caps", lambda: failing)
    with pytest.raises(BPFUnavailable, match=r"cannot load BPF programs.*CAP_BPF missing"):
        Tracer(["cuda"], store=Store()).start()
