"""The trace path's pure parts on canned bytes: ring-buffer records, the
C/Python mirror of every event, decoders, symbols. No privileges needed."""

from __future__ import annotations

import ctypes
import os
import shutil
import struct
import subprocess
from importlib.resources import files
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from probing.node.bpf import families as fam
from probing.node.bpf.output import OutputWriter
from probing.node.bpf.ringbuf import BUSY_BIT, DISCARD_BIT, record_size, take_records
from probing.node.bpf.symbols import RuntimeNames, Symbolizer, demangle, exported, exported_matching
from probing.node.tables.trace import COLLECTIVES_SQL
from tests.jobs.lib_loop import installed_libraries

SAMPLE = np.dtype([("a", "<u8"), ("b", "<u4"), ("c", "<u4")])  # 16 bytes


def _ring(records: list[tuple[int, int, int, int]], size: int = 256, start: int = 0) -> bytes:
    """A data area of ``size`` bytes holding records from position ``start``,
    mapped twice in a row as the kernel does."""
    area = bytearray(size)
    pos = start
    rec = record_size(SAMPLE.itemsize)
    for flags, a, b, c in records:
        raw = struct.pack("<IIQII", SAMPLE.itemsize | flags, 0, a, b, c)
        for i, byte in enumerate(raw.ljust(rec, b"\0")):
            area[(pos + i) % size] = byte
        pos += rec
    return bytes(area) * 2


def test_records_in_order_discards_skipped_busy_stops() -> None:
    recs = [(0, 1, 10, 100), (DISCARD_BIT, 2, 20, 200), (0, 3, 30, 300), (BUSY_BIT, 4, 0, 0)]
    data = _ring(recs)
    rec = record_size(SAMPLE.itemsize)
    out, cons = take_records(data, 0, 4 * rec, 255, SAMPLE)
    assert out["a"].tolist() == [1, 3] and out["c"].tolist() == [100, 300]
    assert cons == 3 * rec  # the busy record is left for the next read


def test_records_wrapping_around_the_end() -> None:
    rec = record_size(SAMPLE.itemsize)
    start = 256 - rec  # the second record starts at the beginning again
    data = _ring([(0, 7, 1, 2), (0, 8, 3, 4), (0, 9, 5, 6)], start=start)
    out, cons = take_records(data, 1024 + start, 1024 + start + 3 * rec, 255, SAMPLE)
    assert out["a"].tolist() == [7, 8, 9]
    assert cons == 1024 + start + 3 * rec


def test_a_record_of_another_size_is_an_error() -> None:
    data = bytearray(_ring([(0, 1, 2, 3)]))
    struct.pack_into("<I", data, 0, 40)
    with pytest.raises(ValueError, match="40 bytes, expected 16"):
        take_records(bytes(data), 0, record_size(16), 255, SAMPLE)


def test_empty_ring() -> None:
    out, cons = take_records(_ring([]), 64, 64, 255, SAMPLE)
    assert len(out) == 0 and cons == 64


@pytest.mark.parametrize("name", sorted(fam.FAMILIES))
def test_python_mirrors_the_c_enum(name: str) -> None:
    text = (files("probing.node.bpf") / "programs" / f"{name}.h").read_text()
    enum = fam.parse_enum(text)
    family = fam.FAMILIES[name]
    assert [f.enum for f in family.funcs] == sorted(enum, key=enum.__getitem__)
    assert [enum[f.enum] for f in family.funcs] == list(range(len(family.funcs)))
    source = (files("probing.node.bpf") / "programs" / family.source).read_text()
    for f in family.funcs:  # every function has its probe in C (loaded in tests/privileged)
        assert f.enum in source or f"int {f.entry}(" in source, f.enum


def test_event_sizes_follow_c_layout() -> None:
    # struct sizes with natural alignment, as the C compiler lays them out
    assert fam.NCCL_EVENT.itemsize == 88
    assert fam.CUDA_EVENT.itemsize == 96
    assert fam.GLOO_EVENT.itemsize == 104


def _events(event_type: np.dtype, **cols: list) -> np.ndarray:  # type: ignore[type-arg]
    n = len(next(iter(cols.values())))
    ev = np.zeros(n, event_type)
    for k, v in cols.items():
        ev[k] = v
    return ev


def _fn(funcs: tuple[fam.Func, ...], enum: str) -> int:
    return [f.enum for f in funcs].index(enum)


def test_nccl_decode() -> None:
    ar, gs, send = (
        _fn(fam.NCCL_FUNCS, e) for e in ("NCCL_ALLREDUCE", "NCCL_GROUPSTART", "NCCL_SEND")
    )
    ev = _events(
        fam.NCCL_EVENT,
        ts=[1000, 2000, 3000],
        dur_ns=[5, 6, 7],
        flags=[1, 1, 0],
        tid=[11, 11, 12],
        fn=[ar, gs, send],
        comm=[0xA0, 0, 0xB0],
        count=[1024, 0, 10],
        dtype=[9, 0, 4],  # bfloat16, -, int64
        op=[4, 255, 255],
        seq=[3, 0, 8],
        rank=[1, -1, -1],
        nranks=[4, -1, -1],
        peer=[-1, -1, 2],
        uid=[0xFEED, 0, 0],
        ret=[0, 0, 0],
    )
    d = fam.Decoded(clock_offset_ns=10**18, pid=77)
    rows = fam.to_batch(fam.FAMILIES["nccl"], ev, d, 40).to_pylist()
    assert [r["event_id"] for r in rows] == [40, 41, 42]
    a, g, s = rows
    assert a["ts"] == 10**18 + 1000 and a["dur_ns"] == 5 and a["pid"] == 77
    assert (a["api"], a["op"], a["dtype"], a["bytes"], a["redop"]) == (
        "ncclAllReduce", "allreduce", "bfloat16", 2048, "avg")  # fmt: skip
    assert (a["seq"], a["rank"], a["nranks"], a["comm_id"]) == (3, 1, 4, 0xFEED)
    assert g["op"] is None and g["seq"] is None and g["bytes"] is None and g["comm"] is None
    assert (s["op"], s["peer"], s["bytes"], s["dtype"], s["redop"]) == (
        "send",
        2,
        80,
        "int64",
        None,
    )
    assert s["dur_ns"] is None and s["ret"] is None  # entry only: no return seen


def test_cuda_decode_without_names() -> None:
    launch, memcpy = (_fn(fam.CUDA_FUNCS, e) for e in ("CUDA_LAUNCHKERNEL", "CUDA_MEMCPY"))
    ev = _events(
        fam.CUDA_EVENT,
        fn=[launch, memcpy],
        flags=[0, 1],
        func=[0x1234, 0],
        grid=[[2, 3, 4], [0, 0, 0]],
        block=[[32, 1, 1], [0, 0, 0]],
        bytes=[128, 4096],
        kind=[255, 2],
        stream=[0x77, 0],
    )
    rows = fam.to_batch(fam.FAMILIES["cuda"], ev, fam.Decoded(0, 1), 0).to_pylist()
    k, m = rows
    assert (k["grid"], k["block"], k["bytes"], k["stream"], k["kind"]) == (
        [2, 3, 4], [32, 1, 1], 128, 0x77, None)  # fmt: skip
    assert (m["kind"], m["bytes"], m["grid"], m["stream"]) == ("DeviceToHost", 4096, None, None)


def test_a_gloo_collective_is_the_thread_that_enqueued_it() -> None:
    """A collective run by ProcessGroupGloo's worker (tid 50) for the thread
    that trains (tid 7) is that thread's; a call with no enqueuer (a send's
    wait, on the thread that waits) stays its own thread's."""
    ar, send = (_fn(fam.GLOO_FUNCS, e) for e in ("GLOO_ALLREDUCE", "GLOO_SEND"))
    ev = _events(fam.GLOO_EVENT, fn=[ar, send], flags=[1, 1], tid=[50, 8], caller=[7, 0],
                 context=[0xC0, 0xD0])  # fmt: skip
    rows = fam.to_batch(fam.FAMILIES["gloo"], ev, fam.Decoded(0, 1), 0).to_pylist()
    assert [(r["op"], r["tid"]) for r in rows] == [("allreduce", 7), ("send", 8)]


@pytest.mark.parametrize("vtable", [False, True])
def test_gloo_context_rank_and_size_with_or_without_vtable(vtable: bool) -> None:
    ranks, sizes = np.array([0, 3, 1]), np.array([4, 4, 2])
    words = (sizes.astype(np.uint64) << np.uint64(32)) | ranks.astype(np.uint64)
    vptr = np.full(3, 0x7F1234567890, dtype=np.uint64)
    head = np.stack([vptr, words] if vtable else [words, np.zeros(3, np.uint64)], axis=1)
    rank, size = fam.gloo_rank_size(head)
    assert rank.tolist() == ranks.tolist() and size.tolist() == sizes.tolist()


def test_gloo_entry_points_by_demangled_name() -> None:
    assert (
        fam.gloo_entry_point("gloo::allreduce(gloo::AllreduceOptions const&)") == "GLOO_ALLREDUCE"
    )
    assert fam.gloo_entry_point("gloo::barrier(gloo::BarrierOptions&)") == "GLOO_BARRIER"
    assert fam.gloo_entry_point("gloo::allreduce(gloo::BarrierOptions&)") is None
    assert fam.gloo_entry_point("gloo::Context::getPair(int)") is None


def test_demangle() -> None:
    assert demangle("_ZN4gloo9allreduceERKNS_16AllreduceOptionsE") == (
        "gloo::allreduce(gloo::AllreduceOptions const&)"
    )
    assert demangle("cudaMalloc") == "cudaMalloc"


def test_a_stripped_stub_is_named_by_the_loaded_runtime(tmp_path: Path) -> None:
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("needs a C compiler (make setup installs gcc)")
    src = Path(__file__).parent / "fixtures" / "fake_cudart.c"
    lib = tmp_path / "libcudart.so.99"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-s", "-o", str(lib), str(src)], check=True)
    unloaded = tmp_path / "libcudart.so.98"
    shutil.copy(lib, unloaded)
    runtime = ctypes.CDLL(str(lib))
    runtime.probing_hidden_stub.restype = ctypes.c_void_p
    stub = runtime.probing_hidden_stub()
    assert Symbolizer().name(stub) is None  # no symbol: the ELF file cannot name it
    names = RuntimeNames()
    # a runtime this process never loaded is not loaded to ask it
    assert names.name(stub, [str(unloaded)]) is None
    assert RuntimeNames().name(stub, [str(unloaded), str(lib)]) == "hidden_stub(float*, int)"
    assert RuntimeNames().name(stub + 1, [str(lib)]) is None  # not a registered stub


def test_gloo_symbols_in_the_installed_torch() -> None:
    torch_cpu = [p for p in installed_libraries() if p.endswith("libtorch_cpu.so")]
    assert torch_cpu, "make setup installs torch (CPU)"
    gloo = fam.FAMILIES["gloo"]
    assert gloo.demangled is not None
    found = exported_matching(torch_cpu[0], gloo.mangled_prefix, gloo.demangled)
    assert sorted(found) == sorted(f.enum for f in fam.GLOO_FUNCS)


def test_a_library_is_read_once_for_every_rank_that_maps_it(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The ranks of a job map the same libraries: the engine that traces
    them reads each one's symbols once; a library replaced on disk is read again."""
    from probing.node.bpf import attach

    cudart = [p for p in installed_libraries() if "libcudart" in p][0]
    lib = tmp_path / "libcudart.so.12"
    shutil.copyfile(cudart, lib)
    reads = []
    real = attach._symbols
    monkeypatch.setattr(attach, "_symbols", lambda f, path: reads.append(path) or real(f, path))
    monkeypatch.setattr(attach, "_found", type(attach._found)())
    monkeypatch.setattr(attach, "_kept", {"dir": "", "salt": ""})  # in memory only
    cuda = fam.FAMILIES["cuda"]
    first = attach.symbols(cuda, str(lib))
    assert {"cudaLaunchKernel", "cudaMemcpy"} <= {sym for sym, _ in first.values()}
    assert attach.symbols(cuda, str(lib)) == first
    assert reads == [str(lib)]
    with open(lib, "ab") as f:  # another build of the library, same path
        f.write(b"\0")
    assert attach.symbols(cuda, str(lib)) == first
    assert reads == [str(lib)] * 2


def test_symbols_kept_for_the_next_engine_and_read_once(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An engine keeps what it found beside its sockets: the engine after a
    killed one reads no library again; ranks asking at once read it once;
    another install reads it itself."""
    import threading

    from probing.node.bpf import attach

    cudart = [p for p in installed_libraries() if "libcudart" in p][0]
    lib = tmp_path / "libcudart.so.12"
    shutil.copyfile(cudart, lib)
    reads = []
    real = attach._symbols
    gate = threading.Event()

    def slow(f, path):  # type: ignore[no-untyped-def]
        reads.append(path)
        gate.wait(5)  # the other ranks ask while this one reads
        return real(f, path)

    monkeypatch.setattr(attach, "_symbols", slow)
    monkeypatch.setattr(attach, "_found", type(attach._found)())
    monkeypatch.setattr(attach, "_kept", dict(attach._kept))
    attach.keep_symbols_in(str(tmp_path / "symbols"), "1.0@/venv-a")
    cuda = fam.FAMILIES["cuda"]
    got: list = []
    ranks = [threading.Thread(target=lambda: got.append(attach.symbols(cuda, str(lib))))
             for _ in range(4)]  # fmt: skip
    for t in ranks:
        t.start()
    gate.set()
    for t in ranks:
        t.join(10)
    assert len(got) == 4 and all(g == got[0] for g in got) and reads == [str(lib)]
    assert {"cudaLaunchKernel", "cudaMemcpy"} <= {sym for sym, _ in got[0].values()}
    [kept] = os.listdir(tmp_path / "symbols")
    assert oct(os.stat(tmp_path / "symbols" / kept).st_mode & 0o777) == "0o600"

    monkeypatch.setattr(attach, "_found", type(attach._found)())  # the next engine
    assert attach.symbols(cuda, str(lib)) == got[0]
    assert reads == [str(lib)]
    monkeypatch.setattr(attach, "_found", type(attach._found)())  # another install's
    attach.keep_symbols_in(str(tmp_path / "symbols"), "2.0@/venv-b")
    assert attach.symbols(cuda, str(lib)) == got[0]
    assert reads == [str(lib)] * 2
    (tmp_path / "symbols" / kept).write_text("{not json")  # torn: read the library again
    monkeypatch.setattr(attach, "_found", type(attach._found)())
    attach.keep_symbols_in(str(tmp_path / "symbols"), "1.0@/venv-a")
    assert attach.symbols(cuda, str(lib)) == got[0]
    assert reads == [str(lib)] * 3


def test_exported_names_in_the_nvidia_wheels() -> None:
    libs = {p.rsplit("/", 1)[-1].split(".so")[0]: p for p in installed_libraries()}
    nccl = exported(libs["libnccl"], [f.api for f in fam.NCCL_FUNCS])
    assert {"ncclAllReduce", "ncclCommInitRank", "ncclSend", "ncclGroupEnd"} <= set(nccl)
    cudart = exported(libs["libcudart"], [f.api for f in fam.CUDA_FUNCS])
    assert {"cudaLaunchKernel", "cudaMemcpy", "cudaStreamSynchronize"} <= set(cudart)
    assert "cuLaunchKernel" not in cudart  # a driver function: libcuda's


def test_output_schema_is_the_union_of_the_tables(tmp_path) -> None:  # type: ignore[no-untyped-def]
    w = OutputWriter(str(tmp_path / "t.parquet"))
    names = set(w.schema.names)
    for f in fam.FAMILIES.values():
        assert set(f.schema.names) <= names
    w.close()
    assert pa.parquet.read_table(tmp_path / "t.parquet").num_rows == 0  # type: ignore[attr-defined]


def test_collectives_view_reads_both_backends() -> None:
    for table in ("nccl.calls", "nccl.inflight", "gloo.calls", "gloo.inflight"):
        assert f"FROM {table}" in COLLECTIVES_SQL


def test_a_kernel_that_cannot_run_the_stage_flush_keeps_tracing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Before Linux 5.10 (no BPF_PROG_TEST_RUN on a CPU) or without the
    sched_switch tracepoint, the staged family still traces: it says why
    once, and its stages go out when full or with another event."""
    import errno

    from probing.errors import BPFUnavailable
    from probing.node.bpf import kernel
    from probing.node.bpf.drain import Live

    tried: list[int] = []

    def refuse(fd: int, *rest: object) -> int:
        tried.append(fd)
        raise kernel.BPFError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(kernel, "run_on_cpu", refuse)
    monkeypatch.setattr(kernel, "raw_tracepoint", refuse)

    class Prog:
        def prog_fd(self, name: str, prog_type: int) -> int:
            assert (name, prog_type) == ("probing_flush", kernel.PROG_TYPE_RAW_TRACEPOINT)
            return 7

    cuda = Live(fam.FAMILIES["cuda"], Prog(), None)  # type: ignore[arg-type]
    with pytest.raises(BPFUnavailable, match="not sent at a CPU switch"):
        cuda.flush_on_switch()
    with pytest.raises(BPFUnavailable, match="not sent before a drain"):
        cuda.flush_stages()
    cuda.flush_stages()  # not asked again
    assert tried == [7, 7]
    gloo = Live(fam.FAMILIES["gloo"], Prog(), None)  # type: ignore[arg-type]
    gloo.flush_on_switch()  # gloo stages nothing: nothing to send
    gloo.flush_stages()
    assert tried == [7, 7]


def test_a_look_reads_the_maps_again_for_new_code_not_for_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain's look for libraries mapped since (``Uprobes.look``): a
    process's large allocations leave its maps unread (torch's take
    milliseconds); a library it loads is found."""
    import sys

    from probing import proc
    from probing.node.bpf.attach import Uprobes

    read, maps_read = proc.read, []

    def counted(pid: int, name: str) -> str:
        maps_read.extend([name] if name == "maps" else [])
        return read(pid, name)

    monkeypatch.setattr(proc, "read", counted)

    lib = tmp_path / "libprobinglater.so"
    shutil.copy(_lib_path("z"), lib)
    child = subprocess.Popen(
        [sys.executable, "-c", (
            "import ctypes, mmap, sys\n"
            "kept = []\n"
            "for line in sys.stdin:\n"
            "    if line.startswith('alloc'):\n"
            "        kept.append(mmap.mmap(-1, 64 << 20))\n"
            "    else:\n"
            "        ctypes.CDLL(line.strip())\n"
            "    print('ok', flush=True)\n"
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None

    def tell(line: str) -> None:
        child.stdin.write(line + "\n")
        child.stdin.flush()
        assert child.stdout.readline() == "ok\n"

    try:
        tell("alloc")  # its interpreter is up
        looks = Uprobes(child.pid)
        first = looks.look(child.pid, always=False)
        assert first is not None and not any(m.path == str(lib) for m in first)
        vsize = open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[20]
        tell("alloc")
        assert open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[20] != vsize
        assert looks.look(child.pid, always=False) is None
        assert len(maps_read) == 1  # its size changed, its code did not
        tell(str(lib))
        later = looks.look(child.pid, always=False)
        assert later is not None and any(m.path == str(lib) for m in later)
        assert looks.look(child.pid, always=False) is None and len(maps_read) == 2
    finally:
        child.kill()
        child.wait()


def _lib_path(name: str) -> str:
    """Where the loader finds ``lib<name>``, as this process maps it."""
    import ctypes.util

    ctypes.CDLL(ctypes.util.find_library(name))
    with open("/proc/self/maps") as f:
        return next(line.split()[-1] for line in f if f"/lib{name}.so" in line)


def test_the_drain_waits_its_interval_unless_a_ring_fills_fast() -> None:
    """``DrainPace``: a drain every ``interval_s``; at once where a ring
    would be ``REFILL_TO`` full by the next tick; sooner after a drain
    that found a ring filling fast."""
    from probing.node.bpf.tracer import REFILL_TO, RESCAN_EVERY_S, DrainPace

    pace = DrainPace(2.0)
    pace.start(100.0)
    assert not pace.due(0.0, 101.0) and pace.due(0.0, 102.0)
    # 1 s after the last drain, a tenth full: a fifth full by the next tick
    assert not pace.due(0.1, 101.0)
    assert pace.due(REFILL_TO / (1 + RESCAN_EVERY_S), 101.0)
    pace.drained(0.5, 101.0)  # half full in 1 s: a quarter again in half a second
    assert pace.at == 101.0 + 1.0 * REFILL_TO / 0.5
    pace.drained(0.0, 102.0)
    assert pace.at == 104.0
