"""The probe families: what each BPF program probes and how its events decode.

Each family mirrors its ``bpf/<family>.h``: the function ids (the C enum),
the event struct (as a numpy dtype, checked against the compiled program's
own struct size when it loads), and a vectorised decoder from an array of
events to the columns of its table. Nothing here runs per event in Python.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

HEADER = [
    ("ts", "<u8"),
    ("dur_ns", "<u8"),
    ("tid", "<u4"),
    ("ret", "<i4"),
    ("fn", "<u2"),
    ("flags", "<u2"),
    ("stack_id", "<u4"),
]
HAS_RET = 1


def event_dtype(fields: list[tuple[Any, ...]]) -> np.dtype:
    return np.dtype(HEADER + fields, align=True)


@dataclasses.dataclass(frozen=True)
class Func:
    """One probed function: its C enum name, symbol(s), and BPF handlers."""

    enum: str
    symbols: tuple[str, ...]  # exported names to try, first found wins
    entry: str  # BPF function for the entry probe
    ret: str | None = None  # BPF function for the return probe
    op: str | None = None  # collective name in comm.collectives, if one

    @property
    def api(self) -> str:
        return self.symbols[0]


@dataclasses.dataclass
class Decoded:
    """What ``Family.decode`` needs besides the events."""

    clock_offset_ns: int  # wall clock - CLOCK_MONOTONIC
    pid: int
    kernel_names: Callable[[np.ndarray, np.ndarray], pa.Array] | None = None


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    table: str  # schema of the table: <name>.calls
    libraries: re.Pattern[str]  # basename of a mapped file that holds the symbols
    funcs: tuple[Func, ...]
    dtype: np.dtype
    schema: pa.Schema
    decode: Callable[[np.ndarray, Decoded], dict[str, Any]]
    # 1 MiB: ~8,000 events, seconds of a busy rank's collectives between two
    # drains (a ring filling fast is drained sooner); the engine maps each
    # rank's twice (its RSS), so no larger than that needs
    ringbuf_pages: int = 256
    # events per ring record: >1 stages the hot calls' events per CPU and
    # sends them together (bpf/preamble.c: STAGE_EVENTS)
    stage: int = 1
    cflags: tuple[str, ...] = ()
    # exported symbols found by pattern rather than by exact name (C++):
    # the mangled prefixes to scan for, and demangled name -> Func.enum
    mangled_prefix: tuple[bytes, ...] = ()
    demangled: Callable[[str], str | None] | None = None

    @property
    def source(self) -> str:
        return f"{self.name}.bpf.c"

    @property
    def record(self) -> np.dtype:
        """One ring-buffer sample: the event, or a stage of ``stage`` events
        of which the first ``n`` are valid (bpf/preamble.c: struct stage)."""
        if self.stage <= 1:
            return self.dtype
        return np.dtype([("n", "<u4"), ("busy", "<u4"), ("ev", self.dtype, (self.stage,))])


# -- shared column builders ------------------------------------------------------


def _masked(values: np.ndarray, valid: np.ndarray, type_: pa.DataType) -> pa.Array:
    """``values`` where ``valid``, else NULL: the validity bitmap packed by
    numpy and both buffers handed to Arrow as they are (a tenth of the cost
    of ``pa.array(values, mask=...)``)."""
    values = np.ascontiguousarray(values, dtype=type_.to_pandas_dtype())
    bitmap = np.packbits(valid, bitorder="little")
    return pa.Array.from_buffers(type_, len(values), [pa.py_buffer(bitmap), pa.py_buffer(values)])


@functools.lru_cache(maxsize=64)
def _name_table(names: tuple[str | None, ...]) -> pa.Array:
    return pa.array(names, type=pa.string())


def _names(names: list[str | None], idx: np.ndarray) -> pa.Array:
    idx = idx if idx.dtype == np.int32 and idx.flags.c_contiguous else idx.astype(np.int32)
    table = _name_table(tuple(names))
    if len(idx) and (idx == idx[0]).all():  # one name (a burst of launches): repeated
        return pa.repeat(table[int(idx[0])], len(idx))
    return table.take(pa.array(idx))


def header_columns(ev: np.ndarray, d: Decoded, funcs: tuple[Func, ...]) -> dict[str, Any]:
    has_ret = (ev["flags"] & HAS_RET) != 0
    ts = ev["ts"].astype(np.int64)
    ts += d.clock_offset_ns
    fn = ev["fn"].astype(np.int32)  # once, contiguous: every name column takes by it
    return {
        "ts": ts,
        "dur_ns": _masked(ev["dur_ns"].astype(np.int64), has_ret, pa.int64()),
        "pid": np.full(len(ev), d.pid, dtype=np.int32),
        "tid": ev["tid"].astype(np.int32),
        "api": _names([f.api for f in funcs], fn),
        # cuda's functions have no op (and its table no such column)
        "op": _names([f.op for f in funcs], fn) if any(f.op for f in funcs) else None,
        "stack_id": _masked(ev["stack_id"].astype(np.int64), ev["stack_id"] != 0, pa.int64()),
        "_has_ret": has_ret,
        "_fn": fn,
    }


HEADER_SCHEMA = [
    ("event_id", pa.int64()),
    ("ts", pa.int64()),
    ("dur_ns", pa.int64()),
    ("pid", pa.int32()),
    ("tid", pa.int32()),
    ("api", pa.string()),
    ("stack_id", pa.int64()),  # python.stacks: the Python stack that made the call
]

# -- nccl -------------------------------------------------------------------------

NCCL_DTYPES = [
    ("int8", 1),
    ("uint8", 1),
    ("int32", 4),
    ("uint32", 4),
    ("int64", 8),
    ("uint64", 8),
    ("float16", 2),
    ("float32", 4),
    ("float64", 8),
    ("bfloat16", 2),
    ("float8e4m3", 1),
    ("float8e5m2", 1),
]
NCCL_REDOPS = ["sum", "prod", "max", "min", "avg"]
NO_OP = 255


def _nccl(enum: str, symbol: str, entry: str, op: str | None, ret: str | None = None) -> Func:
    return Func(enum, (symbol,), entry, ret or f"nccl_ret_{enum}", op)


NCCL_FUNCS = (
    _nccl("NCCL_ALLREDUCE", "ncclAllReduce", "nccl_allreduce", "allreduce"),
    _nccl("NCCL_ALLGATHER", "ncclAllGather", "nccl_allgather", "allgather"),
    _nccl("NCCL_REDUCESCATTER", "ncclReduceScatter", "nccl_reducescatter", "reducescatter"),
    _nccl("NCCL_BROADCAST", "ncclBroadcast", "nccl_broadcast", "broadcast"),
    _nccl("NCCL_BCAST", "ncclBcast", "nccl_bcast", "broadcast"),
    _nccl("NCCL_REDUCE", "ncclReduce", "nccl_reduce", "reduce"),
    _nccl("NCCL_SEND", "ncclSend", "nccl_send", "send"),
    _nccl("NCCL_RECV", "ncclRecv", "nccl_recv", "recv"),
    _nccl("NCCL_ALLTOALL", "ncclAlltoAll", "nccl_alltoall", "alltoall"),
    _nccl("NCCL_GROUPSTART", "ncclGroupStart", "nccl_groupstart", None),
    _nccl("NCCL_GROUPEND", "ncclGroupEnd", "nccl_groupend", None),
    _nccl("NCCL_COMMINITRANK", "ncclCommInitRank", "nccl_comminitrank", None, "nccl_ret_init"),
    _nccl(
        "NCCL_COMMINITRANKCONFIG",
        "ncclCommInitRankConfig",
        "nccl_comminitrankconfig",
        None,
        "nccl_ret_initconfig",
    ),
    _nccl(
        "NCCL_COMMINITRANKSCALABLE",
        "ncclCommInitRankScalable",
        "nccl_comminitrankscalable",
        None,
        "nccl_ret_initscalable",
    ),
    _nccl("NCCL_COMMDESTROY", "ncclCommDestroy", "nccl_commdestroy", None),
    _nccl("NCCL_COMMABORT", "ncclCommAbort", "nccl_commabort", None),
)

NCCL_EVENT = event_dtype(
    [
        ("comm", "<u8"),
        ("stream", "<u8"),
        ("count", "<u8"),
        ("seq", "<u8"),
        ("uid", "<u8"),
        ("rank", "<i4"),
        ("nranks", "<i4"),
        ("peer", "<i4"),
        ("dtype", "u1"),
        ("op", "u1"),
        ("pad", "<u2"),
    ]
)

NCCL_SCHEMA = pa.schema(
    HEADER_SCHEMA
    + [
        ("op", pa.string()),
        ("comm", pa.uint64()),
        ("comm_id", pa.uint64()),
        ("seq", pa.int64()),
        ("rank", pa.int32()),
        ("nranks", pa.int32()),
        ("count", pa.int64()),
        ("dtype", pa.string()),
        ("bytes", pa.int64()),
        ("redop", pa.string()),
        ("peer", pa.int32()),
        ("stream", pa.uint64()),
        ("ret", pa.int32()),
    ]
)


def decode_nccl(ev: np.ndarray, d: Decoded) -> dict[str, Any]:
    cols = header_columns(ev, d, NCCL_FUNCS)
    collective = np.array([f.op is not None for f in NCCL_FUNCS])[ev["fn"]]
    known_dtype = ev["dtype"] < len(NCCL_DTYPES)
    sizes = np.array([s for _, s in NCCL_DTYPES] + [0], dtype=np.int64)
    dt = np.minimum(ev["dtype"], len(NCCL_DTYPES))
    has_count = collective & known_dtype
    cols.update(
        comm=_masked(ev["comm"], ev["comm"] != 0, pa.uint64()),
        comm_id=_masked(ev["uid"], ev["uid"] != 0, pa.uint64()),
        seq=_masked(ev["seq"].astype(np.int64), collective, pa.int64()),
        rank=_masked(ev["rank"], ev["rank"] >= 0, pa.int32()),
        nranks=_masked(ev["nranks"], ev["nranks"] > 0, pa.int32()),
        count=_masked(ev["count"].astype(np.int64), has_count, pa.int64()),
        dtype=_masked_names([n for n, _ in NCCL_DTYPES], dt, has_count),
        bytes=_masked(ev["count"].astype(np.int64) * sizes[dt], has_count, pa.int64()),
        redop=_masked_names(NCCL_REDOPS, np.minimum(ev["op"], len(NCCL_REDOPS)), ev["op"] < 5),
        peer=_masked(ev["peer"], ev["peer"] >= 0, pa.int32()),
        stream=_masked(ev["stream"], collective, pa.uint64()),
        ret=_masked(ev["ret"], cols["_has_ret"], pa.int32()),
    )
    return cols


def _masked_names(names: list[str], idx: np.ndarray, valid: np.ndarray) -> pa.Array:
    arr = _names([*names, None], np.where(valid, idx, len(names)))
    return arr


# -- cuda ---------------------------------------------------------------------------

CUDA_FUNCS = (
    Func("CUDA_LAUNCHKERNEL", ("cudaLaunchKernel",), "cuda_launchkernel"),
    Func("CUDA_LAUNCHKERNEL_PTSZ", ("cudaLaunchKernel_ptsz",), "cuda_launchkernel_ptsz"),
    Func("CUDA_LAUNCHKERNELEXC", ("cudaLaunchKernelExC",), "cuda_launchkernelexc"),
    Func("CUDA_MEMCPY", ("cudaMemcpy",), "cuda_memcpy", "cuda_ret_CUDA_MEMCPY"),
    Func("CUDA_MEMCPYASYNC", ("cudaMemcpyAsync",), "cuda_memcpyasync"),
    Func("CUDA_MALLOC", ("cudaMalloc",), "cuda_malloc", "cuda_ret_CUDA_MALLOC"),
    Func("CUDA_FREE", ("cudaFree",), "cuda_free", "cuda_ret_CUDA_FREE"),
    Func(
        "CUDA_STREAMSYNCHRONIZE",
        ("cudaStreamSynchronize",),
        "cuda_streamsynchronize",
        "cuda_ret_CUDA_STREAMSYNCHRONIZE",
    ),
    Func(
        "CUDA_DEVICESYNCHRONIZE",
        ("cudaDeviceSynchronize",),
        "cuda_devicesynchronize",
        "cuda_ret_CUDA_DEVICESYNCHRONIZE",
    ),
    Func(
        "CUDA_EVENTSYNCHRONIZE",
        ("cudaEventSynchronize",),
        "cuda_eventsynchronize",
        "cuda_ret_CUDA_EVENTSYNCHRONIZE",
    ),
    Func("CUDA_GRAPHLAUNCH", ("cudaGraphLaunch",), "cuda_graphlaunch"),
    Func("CU_LAUNCHKERNEL", ("cuLaunchKernel",), "cu_launchkernel"),
    Func(
        "CU_MODULEGETFUNCTION",
        ("cuModuleGetFunction",),
        "cu_modulegetfunction",
        "cuda_ret_CU_MODULEGETFUNCTION",
    ),
)
CUDA_LAUNCHES = ("CUDA_LAUNCHKERNEL", "CUDA_LAUNCHKERNEL_PTSZ", "CUDA_LAUNCHKERNELEXC")
CU_LAUNCH = "CU_LAUNCHKERNEL"
CU_GETFUNCTION = "CU_MODULEGETFUNCTION"
MEMCPY_KINDS = ["HostToHost", "HostToDevice", "DeviceToHost", "DeviceToDevice", "Default"]

CUDA_EVENT = event_dtype(
    [
        ("func", "<u8"),
        ("bytes", "<u8"),
        ("stream", "<u8"),
        ("ptr", "<u8"),
        ("grid", "<u4", (3,)),
        ("block", "<u4", (3,)),
        ("kind", "u1"),
        ("pad", "u1", (7,)),
    ]
)

DIM3 = pa.list_(pa.uint32(), 3)
CUDA_SCHEMA = pa.schema(
    HEADER_SCHEMA
    + [
        ("kernel", pa.string()),
        ("func", pa.uint64()),
        ("grid", DIM3),
        ("block", DIM3),
        ("bytes", pa.int64()),
        ("kind", pa.string()),
        ("stream", pa.uint64()),
        ("ptr", pa.uint64()),
        ("ret", pa.int32()),
    ]
)


_FN_TABLES: dict[tuple[int, tuple[str, ...]], tuple[tuple[Func, ...], np.ndarray]] = {}


def _fn_table(funcs: tuple[Func, ...], enums: tuple[str, ...]) -> np.ndarray:
    """True at the ids of ``enums``; one more entry, False, for any id past them.
    Kept by the tuple's identity: hashing its Funcs cost more than the lookup."""
    key = (id(funcs), enums)
    hit = _FN_TABLES.get(key)
    if hit is not None and hit[0] is funcs:
        return hit[1]
    table = np.zeros(len(funcs) + 1, dtype=bool)
    table[[i for i, f in enumerate(funcs) if f.enum in enums]] = True
    _FN_TABLES[key] = (funcs, table)  # funcs kept alive: its id stays its own
    return table


def fn_mask(
    ev: np.ndarray, funcs: tuple[Func, ...], enums: tuple[str, ...], fn: np.ndarray | None = None
) -> np.ndarray:
    """Events of the functions ``enums``. ``fn``: ``ev["fn"]`` as int32, where
    the caller has it (``header_columns``' ``_fn``)."""
    ids = ev["fn"].astype(np.int32) if fn is None else fn
    return np.take(_fn_table(funcs, enums), ids, mode="clip")


def _dim3(values: np.ndarray, valid: np.ndarray) -> pa.Array:
    flat = pa.array(np.ascontiguousarray(values, dtype=np.uint32).reshape(-1), type=pa.uint32())
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(DIM3, len(values), [bitmap], children=[flat])


def decode_cuda(ev: np.ndarray, d: Decoded) -> dict[str, Any]:
    cols = header_columns(ev, d, CUDA_FUNCS)
    fn = cols["_fn"]
    launch = fn_mask(ev, CUDA_FUNCS, (*CUDA_LAUNCHES, CU_LAUNCH), fn)
    sized = fn_mask(ev, CUDA_FUNCS, ("CUDA_MEMCPY", "CUDA_MEMCPYASYNC", "CUDA_MALLOC"), fn)
    has_kind = ev["kind"] < len(MEMCPY_KINDS)
    if d.kernel_names is not None:
        kernel = d.kernel_names(ev, launch)
    else:
        kernel = pa.nulls(len(ev), pa.string())
    cols.update(
        kernel=kernel,
        func=_masked(
            ev["func"], launch | fn_mask(ev, CUDA_FUNCS, ("CUDA_GRAPHLAUNCH",), fn), pa.uint64()
        ),
        grid=_dim3(ev["grid"], launch),
        block=_dim3(ev["block"], launch),
        bytes=_masked(ev["bytes"].astype(np.int64), sized | launch, pa.int64()),
        kind=_masked_names(MEMCPY_KINDS, np.minimum(ev["kind"], 4), has_kind),
        stream=_masked(ev["stream"], ev["stream"] != 0, pa.uint64()),
        ptr=_masked(ev["ptr"], ev["ptr"] != 0, pa.uint64()),
        ret=_masked(ev["ret"], cols["_has_ret"], pa.int32()),
    )
    return cols


# -- gloo -----------------------------------------------------------------------------

GLOO_OPS = (
    "allreduce",
    "allgather",
    "allgatherv",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "alltoall",
    "alltoallv",
    "barrier",
)
GLOO_FUNCS = tuple(
    Func(f"GLOO_{op.upper()}", (f"gloo::{op}",), f"gloo_{op}", f"gloo_ret_GLOO_{op.upper()}", op)
    for op in GLOO_OPS
) + (
    # entry-only helpers that emit no event: they hand the Python stack of
    # the thread that enqueued a collective to the worker thread that runs it
    Func("GLOO_ENQUEUE", ("c10d::ProcessGroupGloo::enqueue",), "gloo_enqueue"),
    Func("GLOO_EXECUTE", ("c10d::ProcessGroupGloo::AsyncWork::execute",), "gloo_execute"),
    # point-to-point: the post (one event each, emitted when its work's
    # wait returns), the waits that complete it, and the unbound buffer
    # transfers that give its size (bpf/gloo.bpf.c)
    Func("GLOO_SEND", ("c10d::ProcessGroupGloo::send",), "gloo_send", "gloo_ret_GLOO_SEND", "send"),
    Func("GLOO_RECV", ("c10d::ProcessGroupGloo::recv",), "gloo_recv", "gloo_ret_GLOO_RECV", "recv"),
    Func(
        "GLOO_SENDWAIT",
        ("c10d::ProcessGroupGloo::SendWork::wait",),
        "gloo_sendwait",
        "gloo_ret_GLOO_SENDWAIT",
    ),
    Func(
        "GLOO_RECVWAIT",
        ("c10d::ProcessGroupGloo::RecvWork::wait",),
        "gloo_recvwait",
        "gloo_ret_GLOO_RECVWAIT",
    ),
    Func("GLOO_UBSEND", ("gloo::transport::tcp::UnboundBuffer::send",), "gloo_ubsend"),
    Func("GLOO_UBRECV", ("gloo::transport::tcp::UnboundBuffer::recv",), "gloo_ubrecv"),
    # reduce-scatter: torch runs it as all-reduces, one per tensor (per rank
    # for the list form); each call is one event, named by the outermost of
    # these (_reduce_scatter_base calls reduce_scatter_tensor_coalesced), its
    # all-reduces none (bpf/gloo.bpf.c)
    *(
        Func(enum, (f"c10d::ProcessGroupGloo::{name}",), entry, f"gloo_ret_{enum}", "reducescatter")
        for enum, name, entry in (
            ("GLOO_REDUCESCATTER", "reduce_scatter", "gloo_reducescatter"),
            ("GLOO_REDUCESCATTER_TENSOR", "_reduce_scatter_base", "gloo_reducescatter_tensor"),
            (
                "GLOO_REDUCESCATTER_COALESCED",
                "reduce_scatter_tensor_coalesced",
                "gloo_reducescatter_coalesced",
            ),
        )
    ),
)
GLOO_P2P = ("GLOO_SEND", "GLOO_RECV")
GLOO_REDUCESCATTERS = (
    "GLOO_REDUCESCATTER",
    "GLOO_REDUCESCATTER_TENSOR",
    "GLOO_REDUCESCATTER_COALESCED",
)
_GLOO_ENTRY = re.compile(r"^gloo::(\w+)\(gloo::(\w+)Options( const)?&\)$")
_GLOO_HELPERS = {
    "c10d::ProcessGroupGloo::enqueue(c10::intrusive_ptr<": "GLOO_ENQUEUE",
    "c10d::ProcessGroupGloo::AsyncWork::execute(c10::intrusive_ptr<": "GLOO_EXECUTE",
    "c10d::ProcessGroupGloo::send(std::vector<at::Tensor": "GLOO_SEND",
    "c10d::ProcessGroupGloo::recv(std::vector<at::Tensor": "GLOO_RECV",
    "c10d::ProcessGroupGloo::SendWork::wait(": "GLOO_SENDWAIT",
    "c10d::ProcessGroupGloo::RecvWork::wait(": "GLOO_RECVWAIT",
    "gloo::transport::tcp::UnboundBuffer::send(int,": "GLOO_UBSEND",
    "gloo::transport::tcp::UnboundBuffer::recv(int,": "GLOO_UBRECV",
    "c10d::ProcessGroupGloo::reduce_scatter(std::vector<at::Tensor": "GLOO_REDUCESCATTER",
    "c10d::ProcessGroupGloo::_reduce_scatter_base(at::Tensor": "GLOO_REDUCESCATTER_TENSOR",
    "c10d::ProcessGroupGloo::reduce_scatter_tensor_coalesced(std::vector<at::Tensor": (
        "GLOO_REDUCESCATTER_COALESCED"
    ),
}


def gloo_entry_point(demangled: str) -> str | None:
    """``gloo::allreduce(gloo::AllreduceOptions const&)`` -> ``GLOO_ALLREDUCE``."""
    for prefix, enum in _GLOO_HELPERS.items():
        if demangled.startswith(prefix):
            return enum
    m = _GLOO_ENTRY.match(demangled)
    if m and m.group(1) in GLOO_OPS and m.group(2).lower() == m.group(1):
        return f"GLOO_{m.group(1).upper()}"
    return None


GLOO_EVENT = event_dtype(
    [
        ("context", "<u8"),
        ("seq", "<u8"),
        ("elements", "<u8"),
        ("elem_size", "<u8"),
        ("ctx_head", "<u8", (2,)),
        ("peer", "<i4"),
        ("tag", "<i4"),
        ("wait_ns", "<u8"),
        ("caller", "<u4"),  # a collective a worker thread ran: the thread that enqueued it
        ("pad", "<u4"),
    ]
)
GLOO_SCHEMA = pa.schema(
    HEADER_SCHEMA
    + [
        ("op", pa.string()),
        ("comm", pa.uint64()),
        ("seq", pa.int64()),
        ("rank", pa.int32()),
        ("nranks", pa.int32()),
        ("elements", pa.int64()),
        ("bytes", pa.int64()),
        ("peer", pa.int32()),  # send/recv: the other rank, in the group
        ("tag", pa.int32()),
        ("wait_ns", pa.int64()),  # send/recv: blocked in wait() (dur_ns: since posted)
    ]
)


def gloo_rank_size(head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rank and size from a gloo::Context's first 16 bytes.

    ``Context {const int rank; const int size; ...}`` starts with them, or,
    in gloo versions where Context has a virtual destructor, with a vtable
    pointer first. A pointer is never a pair of small ints with rank < size.
    """
    w0, w1 = head[:, 0], head[:, 1]

    def split(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (w & 0xFFFFFFFF).astype(np.int64), (w >> 32).astype(np.int64)

    r0, s0 = split(w0)
    r1, s1 = split(w1)
    plain = (s0 > 0) & (s0 < 1 << 24) & (r0 < s0)
    rank, size = np.where(plain, r0, r1), np.where(plain, s0, s1)
    ok = (size > 0) & (size < 1 << 24) & (rank < size)
    return np.where(ok, rank, -1), np.where(ok, size, -1)


def gloo_elements(
    ev: np.ndarray, rs: np.ndarray, size: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each call's element count, and where it is known.

    A reduce-scatter's is what each rank receives (as NCCL's ``recvcount``):
    its all-reduces' sum (the input) over the group's size, unknown where the
    size is, or while in flight (its parts are summed as they run)."""
    elements = ev["elements"].astype(np.int64)
    per_rank = np.where(rs, elements // np.maximum(size, 1), elements)
    return per_rank, (ev["elem_size"] > 0) & (~rs | (size > 0))


def decode_gloo(ev: np.ndarray, d: Decoded) -> dict[str, Any]:
    cols = header_columns(ev, d, GLOO_FUNCS)
    rank, size = gloo_rank_size(ev["ctx_head"])
    p2p = fn_mask(ev, GLOO_FUNCS, GLOO_P2P, cols["_fn"])
    rs = fn_mask(ev, GLOO_FUNCS, GLOO_REDUCESCATTERS, cols["_fn"])
    elements, sized = gloo_elements(ev, rs, size)
    # a collective's thread is the one that issued it (the one that trains), not
    # ProcessGroupGloo's worker that ran it for that thread
    caller = ev["caller"]
    cols["tid"] = np.where(caller != 0, caller, ev["tid"]).astype(np.int32)
    cols.update(
        comm=_masked(ev["context"], ev["context"] != 0, pa.uint64()),
        seq=_masked(ev["seq"].astype(np.int64), ev["context"] != 0, pa.int64()),
        rank=_masked(rank.astype(np.int32), rank >= 0, pa.int32()),
        nranks=_masked(size.astype(np.int32), size > 0, pa.int32()),
        elements=_masked(elements, sized & ~p2p, pa.int64()),
        bytes=_masked(elements * ev["elem_size"].astype(np.int64), sized, pa.int64()),
        peer=_masked(ev["peer"], p2p, pa.int32()),
        tag=_masked(ev["tag"], p2p, pa.int32()),
        wait_ns=_masked(ev["wait_ns"].astype(np.int64), p2p & cols["_has_ret"], pa.int64()),
    )
    return cols


FAMILIES: dict[str, Family] = {
    "nccl": Family(
        name="nccl",
        table="nccl",
        libraries=re.compile(r"^libnccl\.so"),
        funcs=NCCL_FUNCS,
        dtype=NCCL_EVENT,
        schema=NCCL_SCHEMA,
        decode=decode_nccl,
    ),
    "cuda": Family(
        name="cuda",
        table="cuda",
        libraries=re.compile(r"^(libcudart\.so|libcuda\.so)"),
        funcs=CUDA_FUNCS,
        dtype=CUDA_EVENT,
        schema=CUDA_SCHEMA,
        decode=decode_cuda,
        # 64 MiB: ~680k events, 0.6 s of launches at 1 M/s (trace_bench
        # sustained) while the drain thread waits for a CPU on a busy node
        ringbuf_pages=16384,
        stage=8,
    ),
    "gloo": Family(
        name="gloo",
        table="gloo",
        libraries=re.compile(r"^(libtorch_cpu\.so|libgloo)"),
        funcs=GLOO_FUNCS,
        dtype=GLOO_EVENT,
        schema=GLOO_SCHEMA,
        decode=decode_gloo,
        mangled_prefix=(b"_ZN4gloo", b"_ZN4c10d16ProcessGroupGloo"),
        demangled=gloo_entry_point,
    ),
}


def to_batch(family: Family, ev: np.ndarray, d: Decoded, first_id: int) -> pa.RecordBatch:
    """Events -> one RecordBatch of ``<family>.calls``, ids from ``first_id``."""
    cols = family.decode(ev, d)
    cols["event_id"] = np.arange(first_id, first_id + len(ev), dtype=np.int64)
    arrays = [_as_arrow(cols[f.name], f.type) for f in family.schema]
    return pa.RecordBatch.from_arrays(arrays, schema=family.schema)


def _as_arrow(values: Any, type_: pa.DataType) -> pa.Array:
    if isinstance(values, pa.Array):
        return values if values.type == type_ else values.cast(type_)
    return pa.array(values, type=type_)


def parse_enum(header_text: str) -> dict[str, int]:
    """``NAME = 3,`` lines of a C enum (used to check FAMILIES against bpf/*.h)."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"(\w+)\s*=\s*(\d+),", header_text)}
