"""The NVML, CUDA and NCCL paths on a real NVIDIA GPU: counters of a GPU
under a matmul loop, and BPF uprobes on the libcudart and libnccl that torch
itself loads (a one-rank NCCL job), with the Python stack of each call.
Off-GPU every test skips with its reason; the BPF one needs root as well."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from probing.cli.client import ProbeClient
from probing.cli.demo import free_port
from tests.conftest import require_bpf
from tests.privileged.helpers import MARK, line_after, wait_line

pytestmark = pytest.mark.gpu


def _require_gpu() -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as e:  # no library, no driver
        pytest.skip(f"no NVIDIA GPU here ({type(e).__name__}: {e})")
    if count == 0:
        pytest.skip("no NVIDIA GPU here (NVML sees 0 devices)")
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here (CPU build)")


LOAD = """
import sys, time, torch
x = torch.randn(8192, 8192, device="cuda")
held = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")  # 2 GiB that NVML must see
torch.cuda.synchronize()
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(20):
        y = x @ x
    torch.cuda.synchronize()
print("done", flush=True)
time.sleep(600)
"""


def test_nvml_samples_a_real_gpu_under_load(spawn) -> None:  # type: ignore[no-untyped-def]
    _require_gpu()
    t = spawn("", argv=[sys.executable, "-c", LOAD, "4"], env={"PROBING_NVML_INTERVAL": "100ms"})
    wait_line(t, "ready")
    wait_line(t, "done")
    client = ProbeClient.for_pid(t.pid)
    status = client.query("SELECT * FROM nvml.status").to_pylist()[0]
    assert status["state"] == "sampling", status
    assert status["errors"] == 0, status
    dev = client.query("SELECT * FROM nvml.devices WHERE sampled").to_pylist()
    assert dev and dev[0]["name"].startswith("NVIDIA"), dev
    row = client.query(
        "SELECT count(*) AS n, max(util_gpu) AS util, max(mem_used) AS mem, "
        "max(sm_clock_mhz) AS sm, max(power_w) AS power, max(temp_c) AS temp FROM nvml.gpu"
    ).to_pylist()[0]
    facts = {**row, "device": dev[0]["name"], "unsupported": status["unsupported"]}
    print("nvml", json.dumps(facts))
    assert row["n"] >= 30  # 4 s of load at 10 Hz
    assert row["util"] >= 50  # back-to-back 8192^3 matmuls
    assert row["mem"] >= 2 << 30
    assert row["sm"] > 0 and row["power"] > 0 and row["temp"] > 0


# train_step: a kernel launched through the runtime (an in-place add), a
# device-to-host copy, and an NCCL all-reduce; mark() notes the line of each.
NCCL_JOB = (
    """
import json, os, sys, time, traceback
import torch, torch.distributed as dist

port, go, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
"""
    + MARK
    + """

def train_step(t):
    t.add_(1.0)
    dist.all_reduce(mark("all_reduce", t))
    return t.sum().item()


t = torch.zeros(1 << 20, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.02)
for _ in range(steps):
    last = train_step(t)
torch.cuda.synchronize()
print("marks " + json.dumps(marks), flush=True)
print("result", last, flush=True)
time.sleep(600)
"""
)


def test_trace_sees_torch_cuda_and_nccl_on_a_real_gpu(spawn, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _require_gpu()
    require_bpf()
    steps = 20
    script = tmp_path / "job.py"
    script.write_text(NCCL_JOB)
    go = tmp_path / "go"
    t = spawn("", argv=[sys.executable, str(script), str(free_port()), str(go), str(steps)])
    wait_line(t, "ready")
    client = ProbeClient.for_pid(t.pid)
    status = client.trace_start(["nccl", "cuda"])
    libs = {f: s["libraries"] for f, s in status["families"].items()}
    print("libraries", json.dumps(libs))
    assert any("libnccl" in p for p in libs["nccl"]), libs
    assert any("libcudart" in p for p in libs["cuda"]), libs
    go.touch()
    marks = json.loads(line_after(t, "marks ", timeout=120))
    line_after(t, "result ", timeout=120)
    time.sleep(0.2)

    ar = client.query(
        "SELECT count(*) AS n, min(ret) AS ret_min, max(ret) AS ret_max, min(bytes) AS b0, "
        "max(bytes) AS b1, min(nranks) AS nranks, min(dur_ns) AS dmin, "
        "approx_median(dur_ns) AS dmed FROM nccl.calls WHERE api = 'ncclAllReduce'"
    ).to_pylist()[0]
    print("allreduce", json.dumps(ar))
    assert ar["n"] == steps
    assert ar["ret_min"] == ar["ret_max"] == 0  # ncclSuccess on a real GPU
    assert ar["b0"] == ar["b1"] == 4 << 20
    assert ar["nranks"] == 1

    seqs = client.query(
        "SELECT seq FROM comm.collectives WHERE backend = 'nccl' ORDER BY seq"
    ).to_pylist()
    assert [r["seq"] for r in seqs][-steps:] == list(range(len(seqs) - steps, len(seqs)))

    frames = client.query(
        "SELECT s.file, s.line, s.func FROM nccl.calls c JOIN python.stacks s "
        "ON s.stack_id = c.stack_id WHERE c.api = 'ncclAllReduce' ORDER BY s.depth"
    ).to_pylist()
    got = {(f["file"], f["line"], f["func"]) for f in frames}
    assert tuple(marks["all_reduce"]) in got, (marks, sorted(got)[:10])

    apis = client.query("SELECT api, count(*) AS n FROM cuda.calls GROUP BY api").to_pylist()
    print("cuda apis", json.dumps(apis))
    launches = client.query(
        "SELECT kernel, count(*) AS n, max(ret) AS ret FROM cuda.calls "
        "WHERE api LIKE 'cudaLaunchKernel%' GROUP BY kernel ORDER BY n DESC"
    ).to_pylist()
    print("kernels", json.dumps(launches[:8]))
    assert sum(k["n"] for k in launches) >= steps  # at least the add_ of each step
    # the runtime launches through the driver's cuLaunchKernel: not a second launch
    assert not [a for a in apis if a["api"] == "cuLaunchKernel"], apis
    assert all(k["ret"] is None for k in launches)  # launches are probed at entry only
    assert any(k["kernel"] and "add" in k["kernel"].lower() for k in launches), launches
    copies = client.query(
        "SELECT api, kind, bytes, ret FROM cuda.calls WHERE api LIKE 'cudaMemcpy%'"
    ).to_pylist()
    print("copies", len(copies), json.dumps(copies[:3]))
    assert any(c["bytes"] == 4 and c["kind"] == "DeviceToHost" for c in copies), copies  # .item()
    client.trace_stop()
