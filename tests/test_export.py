"""``probing export`` over a scripted 4-rank job: each rank is a real probing
``Database`` (DataFusion, the real ``comm.collectives`` and ``python.callsites``
views) holding known rows, asked through ``Source`` as local probes. The
Perfetto file is parsed back with Perfetto's protos; Parquet with pyarrow.
"""

from __future__ import annotations

import itertools
import json
import socket
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from probing.cli.export import Source, export
from probing.cli.export.perfetto import read_trace
from probing.node.bpf import families
from probing.node.bpf.pystacks import CALLSITES_SQL, STACKS_SCHEMA
from probing.node.bpf.sampler import SCHEMA as SAMPLES_SCHEMA
from probing.node.sql import Database
from probing.node.store import Store
from probing.node.tables.nvml import GPU_SCHEMA
from probing.node.tables.trace import COLLECTIVES_SQL, INTERVALS_SCHEMA
from tests.conftest import cli

WORLD = 4
SLOW = 2  # the rank that arrives late
STEPS = 30
STEP_NS = 100_000_000
KERNELS = 3  # launches per step per rank
SAMPLES = 20  # NVML samples per rank
READ_NS = 500_000_000  # the sampler's reads: every 0.5 s over the steps
READS = STEPS * STEP_NS // READ_NS
LOAD_MS = {SLOW: 300}  # the training thread's time in load_batch per read (others: 60)
METRICS = 6  # counters per NVML sample (every metric set)
GROUPS_SCHEMA = pa.schema(
    [("backend", pa.string()), ("comm", pa.uint64()), ("pg", pa.string()),
     ("ranks", pa.list_(pa.int64())), ("group_rank", pa.int64()), ("nranks", pa.int64())]
)  # fmt: skip
INFO_SCHEMA = pa.schema([("pid", pa.int64()), ("hostname", pa.string())])
THREADS_SCHEMA = pa.schema([("tid", pa.int64()), ("name", pa.string())])


def _table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=schema)


def rank_tables(rank: int, base: int) -> dict[str, pa.Table]:
    """One rank's rows: Gloo all-reduces (rank SLOW 30 ms late), NCCL calls,
    CUDA launches and a sync, NVML samples, one Python stack; the sampler's
    reads of the training thread (rank SLOW longer in ``load_batch``) and of a
    Gloo thread, and a trace since before the steps."""
    pid, tid = 1000 + rank, 2000 + rank
    comm = 0xA000 + rank  # a Gloo context is a local pointer: differs per process
    gloo, nccl, cuda = [], [], []
    for i in range(STEPS):
        arrive = base + i * STEP_NS + (30_000_000 if rank == SLOW else rank * 1_000_000)
        end = base + i * STEP_NS + 31_000_000
        gloo.append(
            dict(
                event_id=i,
                ts=arrive,
                dur_ns=end - arrive,
                pid=pid,
                tid=tid,
                api="gloo::allreduce",
                stack_id=77,
                op="allreduce",
                comm=comm,
                seq=100 + i,
                rank=rank,
                nranks=WORLD,
                elements=1024,
                bytes=4096,
            )
        )
        for k in range(KERNELS):
            cuda.append(
                dict(
                    event_id=1000 + i * 10 + k,
                    ts=end + 1000 * (k + 1),
                    dur_ns=500,
                    pid=pid,
                    tid=tid,
                    api="cudaLaunchKernel",
                    stack_id=77,
                    kernel=f"gemm_kernel_{k}",
                    bytes=None,
                )
            )
        cuda.append(
            dict(
                event_id=5000 + i,
                ts=end + 10_000,
                dur_ns=2_000_000,
                pid=pid,
                tid=tid,
                api="cudaStreamSynchronize",
                stack_id=None,
            )
        )
    for i in range(5):  # NCCL on its own thread, comm_id the same in every rank
        nccl.append(
            dict(
                event_id=9000 + i,
                ts=base + i * STEP_NS + 50_000_000 + rank * 100,
                dur_ns=1000,
                pid=pid,
                tid=tid + 1,
                api="ncclAllReduce",
                op="allreduce",
                comm=0xB000 + rank,
                comm_id=0xC0FFEE,
                seq=i,
                rank=rank,
                nranks=WORLD,
                count=256,
                dtype="float32",
                bytes=1024,
                redop="sum",
            )
        )
    nccl.append(
        dict(
            event_id=9999,
            ts=base,
            dur_ns=5000,
            pid=pid,
            tid=tid + 1,
            api="ncclCommInitRank",
            op=None,
            rank=rank,
            nranks=WORLD,
        )
    )
    nvml = [dict(ts=base + i * 150_000_000, gpu=0, uuid="GPU-0", util_gpu=10 + i, util_mem=5,
                 mem_used=(1 << 30) + i, mem_total=80 << 30, power_w=100.0 + i, temp_c=40,
                 sm_clock_mhz=1400 + i) for i in range(SAMPLES)]  # fmt: skip
    stacks = [
        dict(stack_id=77, depth=0, file="/lib/torch/autograd.py", func="backward", line=10,
             user=False),
        dict(stack_id=77, depth=1, file="/job/train.py", func="main", line=42, user=True),
    ]  # fmt: skip
    for sid, inner in ((101, ("load_batch", "/job/train.py", 7)),
                       (102, ("backward", "/lib/torch/autograd.py", 10))):  # fmt: skip
        frames = [inner, ("main", "/job/train.py", 42), ("<module>", "/job/train.py", 50)]
        stacks += [dict(stack_id=sid, depth=d, file=file, func=func, line=line,
                        user=file.startswith("/job")) for d, (func, file, line) in
                   enumerate(frames)]  # fmt: skip
    samples = []
    for k in range(1, READS + 1):  # each read: 0.5 s of the training thread, all told
        load = LOAD_MS.get(rank, 60) * 1_000_000
        read = dict(ts=base + k * READ_NS, count=1)
        samples += [
            dict(read, tid=0, thread=None, stack_id=0, kind="tick", dur_ns=READ_NS),
            dict(read, tid=tid, thread="MainThread", stack_id=101, kind="off", dur_ns=load),
            dict(read, tid=tid, thread="MainThread", stack_id=101, kind="cpu", dur_ns=10_000_000),
            dict(read, tid=tid, thread="MainThread", stack_id=102, kind="off",
                 dur_ns=READ_NS - load - 10_000_000),
            dict(read, tid=tid + 7, thread="pt_gloo_runloop", stack_id=0, kind="off",
                 dur_ns=READ_NS),
        ]  # fmt: skip
    fam = families.FAMILIES
    empty = {f"{n}.inflight": fam[n].schema.empty_table() for n in ("nccl", "gloo", "cuda")}
    return {
        "gloo.calls": _table(gloo, fam["gloo"].schema),
        "nccl.calls": _table(nccl, fam["nccl"].schema),
        "cuda.calls": _table(cuda, fam["cuda"].schema),
        **empty,
        "nvml.gpu": _table(nvml, GPU_SCHEMA),
        "python.stacks": _table(stacks, STACKS_SCHEMA),
        "python.samples": _table(samples, SAMPLES_SCHEMA),
        "trace.intervals": _table(
            [dict(start_ns=base - 1_000_000_000, stop_ns=None, state="tracing", families="gloo")],
            INTERVALS_SCHEMA,
        ),
        "comm.groups": _table(
            [
                dict(
                    backend="gloo",
                    comm=comm,
                    pg="0",
                    ranks=[0, 1, 2, 3],
                    group_rank=rank,
                    nranks=WORLD,
                )
            ],
            GROUPS_SCHEMA,
        ),  # fmt: skip
        "process.info": _table([dict(pid=pid, hostname=socket.gethostname())], INFO_SCHEMA),
        "process.threads": _table([dict(tid=tid, name="MainThread")], THREADS_SCHEMA),
    }


class DatabaseProbe:
    """A rank's probe without the process: a real Database over known tables."""

    def __init__(self, tables: dict[str, pa.Table]) -> None:
        self.database = Database(Store())
        for qualified, t in tables.items():
            schema, name = qualified.split(".")
            self.database.register_table(schema, name, lambda t=t: t)
        self.database.register_view("comm", "collectives", COLLECTIVES_SQL)
        self.database.register_view("python", "callsites", CALLSITES_SQL)

    def query(self, sql: str) -> pa.Table:
        return self.database.sql(sql)


class ScriptedJob(Source):
    """Ranks 0..3 as local probes (pids 1000..1003), answered by ``DatabaseProbe``s."""

    probes: dict[int, DatabaseProbe]
    base: int  # wall-clock ns of the first step

    def client(self, pid: int) -> DatabaseProbe:
        return self.probes[pid]


@pytest.fixture(scope="module")
def job() -> ScriptedJob:
    src = ScriptedJob(pids=[1000 + r for r in range(WORLD)])
    # the job ran 30 s before the module's tests (the export's window ends at its now)
    src.base = time.time_ns() - 30_000_000_000
    src.probes = {1000 + r: DatabaseProbe(rank_tables(r, src.base)) for r in range(WORLD)}
    return src


def parse(path: Path) -> dict[str, Any]:
    """Per rank (from its process track's name): slices, flows, counters, args;
    the slices of a rank's named tracks apart, in ``tracks[(rank, track name)]``."""
    trace = read_trace(path.read_bytes())
    rank_of_track: dict[int, int] = {}
    proc_rank: dict[int, int] = {}  # pid as written -> rank
    names: dict[int, str] = {}
    interned: dict[str, dict[int, str]] = defaultdict(dict)
    out: dict[str, Any] = {"process_names": [], "slices": Counter(), "flows": defaultdict(list),
                           "counters": Counter(), "args": [], "open": Counter(), "notes": [],
                           "slice_ts": defaultdict(list), "tracks": defaultdict(list)}  # fmt: skip
    named: dict[int, str] = {}  # a rank's own tracks (not a thread's): uuid -> name
    begun: dict[int, dict[str, Any]] = {}  # a named track's last slice begun
    for p in trace.packet:
        for kind in ("event_names", "debug_annotation_names", "event_categories"):
            for e in getattr(p.interned_data, kind):
                interned[kind][e.iid] = e.name
        for e in p.interned_data.debug_annotation_string_values:
            interned["strings"][e.iid] = e.str.decode()
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            if d.HasField("process"):
                rank = int(d.process.process_name.split()[1])
                out["process_names"].append(d.process.process_name)
                rank_of_track[d.uuid] = rank
                proc_rank[d.process.pid] = rank
            elif d.HasField("thread"):
                rank_of_track[d.uuid] = proc_rank[d.thread.pid]
            elif d.parent_uuid:
                rank_of_track[d.uuid] = rank_of_track[d.parent_uuid]
                if not d.HasField("counter"):
                    named[d.uuid] = d.name
            else:
                names[d.uuid] = d.name
        if not p.HasField("track_event"):
            continue
        e = p.track_event
        if e.track_uuid in names:
            out["notes"].append(names[e.track_uuid])
            continue
        rank = rank_of_track[e.track_uuid]
        if e.track_uuid in named:  # a begin, then its end right after
            if e.type == e.TYPE_SLICE_BEGIN:
                begun[e.track_uuid] = {
                    "name": interned["event_names"][e.name_iid], "ts": p.timestamp,
                    "args": {interned["debug_annotation_names"][a.name_iid]:
                             interned["strings"][a.string_value_iid] if a.string_value_iid
                             else a.double_value for a in e.debug_annotations}}  # fmt: skip
                out["tracks"][(rank, named[e.track_uuid])].append(begun[e.track_uuid])
            else:
                begun[e.track_uuid]["dur"] = p.timestamp - begun[e.track_uuid]["ts"]
            continue
        if e.type == e.TYPE_SLICE_BEGIN:
            out["slices"][rank] += 1
            out["slice_ts"][rank].append(p.timestamp)
            args = {interned["debug_annotation_names"][a.name_iid]:
                    interned["strings"][a.string_value_iid] if a.string_value_iid
                    else a.int_value for a in e.debug_annotations}  # fmt: skip
            args["name"] = interned["event_names"][e.name_iid]
            args["category"] = interned["event_categories"][e.category_iids[0]]
            args["rank"] = rank
            out["args"].append(args)
            for f in e.flow_ids:
                out["flows"][f].append((rank, args.get("seq"), args["name"]))
        elif e.type == e.TYPE_COUNTER:
            out["counters"][rank] += 1
    return out


def test_perfetto_export_has_every_rank_slice_flow_and_counter(job, tmp_path: Path) -> None:
    path = tmp_path / "job.pftrace"
    report = export(job, str(path), window_s=60)
    got = parse(path)
    node = socket.gethostname()
    assert sorted(got["process_names"]) == [f"rank {r} @ {node}" for r in range(WORLD)]
    # per rank: 30 Gloo + 6 NCCL calls, 30 * (3 launches + 1 sync) CUDA calls
    per_rank = STEPS + 6 + STEPS * (KERNELS + 1)
    assert got["slices"] == dict.fromkeys(range(WORLD), per_rank)
    assert got["counters"] == dict.fromkeys(range(WORLD), SAMPLES * METRICS)
    assert report.slices == dict(got["slices"]) and report.events == WORLD * (per_rank + SAMPLES)
    # one flow per collective (30 Gloo + 5 NCCL), through all four ranks, same seq and op
    assert len(got["flows"]) == STEPS + 5
    for chain in got["flows"].values():
        assert sorted(r for r, _, _ in chain) == list(range(WORLD))
        assert len({(seq, op) for _, seq, op in chain}) == 1
    gloo = [a for a in got["args"] if a["category"] == "gloo"]
    assert {a["comm"] for a in gloo} == {"gloo/pg0"}  # the cross-rank name, via comm.groups
    assert all(a["bytes"] == 4096 and a["op"] == "allreduce" for a in gloo)
    assert all(a["callsite"] == "/job/train.py:42 main" for a in gloo)
    assert all(a["stack"].splitlines() == ["backward (/lib/torch/autograd.py:10)",
                                           "main (/job/train.py:42)"] for a in gloo)  # fmt: skip
    kinds = Counter((a["category"], a["name"]) for a in got["args"] if a["rank"] == 0)
    assert kinds[("cuda.kernel", "gemm_kernel_0")] == STEPS
    assert kinds[("cuda.sync", "cudaStreamSynchronize")] == STEPS
    assert kinds[("nccl", "ncclCommInitRank")] == 1


def test_clock_offsets_move_a_nodes_rows_and_keep_the_flows(job, tmp_path: Path) -> None:
    plain, moved = tmp_path / "a.pftrace", tmp_path / "b.pftrace"
    export(job, str(plain), window_s=60)
    job.offsets = {socket.gethostname(): 7_000_000}  # that node's clock runs 7 ms ahead
    try:
        export(job, str(moved), window_s=60)
    finally:
        job.offsets = {}
    a, b = parse(plain), parse(moved)
    for r in range(WORLD):
        assert [t - 7_000_000 for t in a["slice_ts"][r]] == b["slice_ts"][r]
    assert len(b["flows"]) == len(a["flows"]) == STEPS + 5


def test_max_events_keeps_the_newest_and_says_what_it_dropped(job, tmp_path: Path) -> None:
    path = tmp_path / "cut.pftrace"
    report = export(job, str(path), window_s=60, max_events=100)
    got = parse(path)
    written = sum(got["slices"].values()) + sum(got["counters"].values()) // METRICS
    assert written == report.events == 100
    total = WORLD * (STEPS + 6 + STEPS * (KERNELS + 1) + SAMPLES)
    assert sum(report.cap.dropped.values()) == total - 100
    assert got["notes"] == [f"probing export: {total - 100} events dropped"]  # in the file
    said = f"--max-events 100 cut the export: dropped {total - 100}"
    assert report.cap.message().startswith(said)
    # the newest were kept: nothing kept is older than anything of its table dropped
    newest = max(t for ts in got["slice_ts"].values() for t in ts)
    assert newest >= job.base + (STEPS - 1) * STEP_NS


def test_parquet_export_writes_one_tagged_file_per_table(job, tmp_path: Path) -> None:
    out = tmp_path / "pq"
    report = export(job, str(out), fmt="parquet", window_s=60, max_events=500)
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(f"{t}.parquet" for t in (
        "nccl.calls", "gloo.calls", "cuda.calls", "nvml.gpu", "python.stacks", "comm.groups",
        "process.info"))  # fmt: skip
    rows = {t: pq.read_table(out / f"{t}.parquet") for t in ("gloo.calls", "cuda.calls",
                                                            "nvml.gpu", "nccl.calls")}  # fmt: skip
    assert sum(t.num_rows for t in rows.values()) == report.events == 500
    for t in rows.values():
        assert set(t.column("rank").to_pylist()) <= set(range(WORLD))
        assert set(t.column("node").to_pylist()) <= {socket.gethostname()}
    gloo = rows["gloo.calls"]
    assert "table_rank" in gloo.column_names  # the call's own rank in its communicator
    meta = json.loads(pq.read_metadata(out / "gloo.calls.parquet").metadata[b"probing.export"])
    assert sum(meta["dropped"].values()) == sum(report.cap.dropped.values()) > 0
    stacks = pq.read_table(out / "python.stacks.parquet")
    assert stacks.num_rows == (2 + 2 * 3) * WORLD  # 3 frames of 2 stacks more: those sampled
    assert sorted(set(stacks.column("rank").to_pylist())) == [0, 1, 2, 3]


def test_export_refuses_bad_input_with_the_next_step(tmp_path: Path) -> None:
    r = cli("export", "-o", str(tmp_path / "x.pftrace"))
    assert r.returncode == 1
    assert r.stderr.startswith("probing: error: give exactly one of --pid or --addr")
    assert r.stderr.endswith("\n")
    r = cli("export", "-p", "1", "-p", "2", "--cluster", "-o", str(tmp_path / "x"))
    assert r.returncode == 1 and "give a single --pid" in r.stderr
    r = cli("export", "-p", "1", "--window", "soon", "-o", str(tmp_path / "x"))
    assert r.returncode == 2 and "not a duration" in r.stderr
    r = cli("export", "-p", "1", "--max-events", "0", "-o", str(tmp_path / "x"))
    assert r.returncode == 1 and "--max-events must be at least 1" in r.stderr
    r = cli("export", "-p", "1", "-f", "json", "-o", str(tmp_path / "x"))
    assert r.returncode == 2 and "json" in r.stderr
    gone = 2**22 + 12345  # above pid_max: no such process
    r = cli("export", "-p", str(gone), "-o", str(tmp_path / "x.pftrace"))
    assert r.returncode == 1 and f"no process with pid {gone}" in r.stderr
    r = cli("ui", "-p", str(gone))  # refused before serving anything
    assert r.returncode == 1 and f"no process with pid {gone}" in r.stderr and not r.stdout
    r = cli("ui", "--addr", "127.0.0.1:9", env={"PROBING_TOKEN": ""})
    assert r.returncode == 1 and "needs the job's token" in r.stderr
    r = cli("ui", "-p", "1", "--port", "70000")
    assert r.returncode == 1 and "--port 70000 is not a port" in r.stderr


def test_the_vectorised_writer_reads_back_through_perfetto_protos() -> None:
    """Every arg kind ``TraceWriter.add_slices`` encodes by hand (protowire),
    parsed back with Perfetto's own protos: ints past int64, negatives, floats,
    bools, lists, nulls left out, a call still running (a begin only)."""
    import io

    import numpy as np

    from probing.cli.export.perfetto import SliceChunk, ThreadTrack, TraceWriter

    f = io.BytesIO()
    w = TraceWriter(f)
    w.process(0, "n", 10)
    track = w.thread(0, 11)
    big, neg = (1 << 64) - 5, -(1 << 40)
    w.add_slices(SliceChunk(
        thread=np.zeros(3, np.int64), threads=[ThreadTrack(0, 11, "n", 10)],
        ts=np.array([5, 1 << 60, 300]),
        dur=np.array([7, 0, 0]), ended=np.array([True, True, False]),
        name=pa.array(["a", "b", "a"]), category=pa.array(["x", "x", "y"]),
        args=[("u", pa.array([big, 1, None], pa.uint64())), ("i", pa.array([neg, 0, 127])),
              ("f", pa.array([0.5, None, -2.0])), ("b", pa.array([True, False, None])),
              ("l", pa.array([[4, 1, 1], None, [2]], pa.list_(pa.uint32()))),
              ("s", pa.array(["α" * 300, None, "z"]))],
        flow=np.array([0, (1 << 64) - 1, 3], np.uint64),
    ))  # fmt: skip
    w.flush()
    got = written_events(f.getvalue())
    B, E = 1, 2  # TYPE_SLICE_BEGIN, TYPE_SLICE_END
    assert got == [
        (5, B, track, "a", ["x"], [], {"u": big, "i": neg, "f": 0.5, "b": True, "l": "4x1x1",
                                       "s": "α" * 300}),
        (12, E, track, None, [], [], {}),
        (1 << 60, B, track, "b", ["x"], [(1 << 64) - 1], {"u": 1, "i": 0, "b": False}),
        (1 << 60, E, track, None, [], [], {}),
        (300, B, track, "a", ["y"], [3], {"i": 127, "f": -2.0, "l": "2", "s": "z"}),
    ]  # fmt: skip


def written_events(data: bytes) -> list[tuple[Any, ...]]:
    """Each TrackEvent of a ``TraceWriter``'s file in file order: (ts, type, track,
    name, categories, flow ids, args), interned ids resolved."""
    names: dict[str, dict[int, Any]] = defaultdict(dict)
    events = []
    for p in read_trace(data).packet:
        for kind in ("event_names", "event_categories", "debug_annotation_names"):
            names[kind].update({e.iid: e.name for e in getattr(p.interned_data, kind)})
        names["s"].update(
            {e.iid: e.str.decode() for e in p.interned_data.debug_annotation_string_values}
        )
        if p.HasField("track_event"):
            assert p.trusted_packet_sequence_id == 7919 and p.sequence_flags == 2
            events.append((p.timestamp, p.track_event))
    got = []
    for ts, e in events:
        args = {}
        for a in e.debug_annotations:
            kind = a.WhichOneof("value")
            v = getattr(a, kind)
            args[names["debug_annotation_names"][a.name_iid]] = (
                names["s"][v] if kind == "string_value_iid" else v
            )
        cats = [names["event_categories"][c] for c in e.category_iids]
        name = names["event_names"].get(e.name_iid)
        got.append((ts, e.type, e.track_uuid, name, cats, list(e.flow_ids), args))
    return got


@pytest.mark.parametrize("args", [1, 6])
def test_rows_with_other_fields_are_written_apart_or_whole_and_read_back_the_same(
    args: int,
) -> None:
    """A chunk whose rows have a few kinds of fields (the syncs without a kernel
    arg) is written a kind at a time, without a mask; one of many kinds whole,
    with a mask. Either way every slice reads back with its own args, its end
    right after its begin."""
    import io
    import random

    import numpy as np

    from probing.cli.export.perfetto import MAX_LAYOUTS, SliceChunk, ThreadTrack, TraceWriter

    rng = random.Random(args)
    n, t0 = 500, 1_795_000_000_000_000_000
    columns = {f"a{j}": [rng.choice([None, f"v{i % 7}"]) for i in range(n)] for j in range(args)}
    kinds = len({tuple(c[i] is None for c in columns.values()) for i in range(n)})
    assert kinds == 2 if args == 1 else kinds > MAX_LAYOUTS
    f = io.BytesIO()
    w = TraceWriter(f)
    w.add_slices(SliceChunk(
        thread=np.arange(n) % 2, threads=[ThreadTrack(0, 5, "n", 1), ThreadTrack(0, 6, "n", 1)],
        ts=np.arange(n) * 100 + t0, dur=np.full(n, 10), ended=np.ones(n, bool),
        name=pa.array(["call"] * n), category=pa.array(["c"] * n),
        args=[(a, pa.array(v, pa.string())) for a, v in columns.items()],
        flow=np.zeros(n, np.uint64),
    ))  # fmt: skip
    w.flush()
    got = written_events(f.getvalue())
    begins = [g for g in got if g[1] == 1]
    order = [(g[0] - t0) // 100 for g in begins]
    assert sorted(order) == list(range(n))
    for ts, _, track, _, _, _, said in begins:
        i = (ts - t0) // 100
        assert said == {a: v[i] for a, v in columns.items() if v[i] is not None}
        assert track == w.thread(0, 5 + i % 2)
    for at, g in enumerate(got):  # each end right after its begin, on its track
        if g[1] == 2:
            assert got[at - 1][1] == 1 and g[0] == got[at - 1][0] + 10 and g[2] == got[at - 1][2]
    # a few kinds: each written together (rows in order within); many: in row order
    runs = sum(1 for a, b in itertools.pairwise(order) if b < a) + 1
    assert runs == (kinds if kinds <= MAX_LAYOUTS else 1)


def test_each_chunk_is_matched_with_the_offsets_its_own_query_measured(job, tmp_path) -> None:
    """A cluster query measures the clock offsets anew each time, and the next
    chunks are read while the collectives are asked and the last chunk is
    written: a call's collective (and flow) is found with the offsets that
    moved that chunk, not whatever was asked last."""
    import itertools

    asked = itertools.count(1)
    node = socket.gethostname()

    class Drifting(ScriptedJob):
        def measured(self, sql: str) -> tuple[pa.Table, dict[str, int]]:
            table, _ = super().measured(sql)
            self.offsets = {node: 1000 * next(asked)}  # the estimate moves, the clocks do not
            return table, dict(self.offsets)

    drifting = Drifting(pids=job.pids)
    drifting.probes = job.probes
    report = export(drifting, str(tmp_path / "d.pftrace"), window_s=60)
    got = parse(tmp_path / "d.pftrace")
    assert len(got["flows"]) == STEPS + 5 and sum(report.flows.values()) == WORLD * (STEPS + 5)
