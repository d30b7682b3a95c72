"""PyTorch's Flight Recorder, read in the process (stdlib only).

torch keeps a ring of its last collectives per process (``FlightRecorder``:
one record per collective or point-to-point op, Gloo's and NCCL's, with its
process group, sequence number, op, tensor sizes and state). Its size is
``TORCH_FR_BUFFER_SIZE`` (``TORCH_NCCL_TRACE_BUFFER_SIZE`` before it), read
once by torch when the ring is first used; 0 turns it off (torch 2.13 keeps
2000 records by default). torch dumps it as JSON
(``torch._C._distributed_c10d._dump_fr_trace_json``: the CPU backends'
ring; ``_dump_nccl_trace_json`` in CUDA builds: NCCL's). ``flight()`` hands
those records over as flat rows, or says why there are none. torch is only
read when the host has fully imported ``torch.distributed``, never imported
here.
"""

from __future__ import annotations

import json
import os
import sys

from .inside import _torch_distributed

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

# the variables torch reads for the ring's size, the first one set wins
SIZE_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
# the rings torch dumps: the CPU backends' (Gloo) and, in CUDA builds, NCCL's
DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
TURN_ON = "TORCH_FR_BUFFER_SIZE=2000 in the job's environment turns it on"
# bytes per element of torch's dtype names as the dump spells them
ITEM_BYTES = {
    "Bool": 1, "Byte": 1, "Char": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1,
    "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1, "Short": 2, "Half": 2, "BFloat16": 2,
    "UInt16": 2, "Int": 4, "Float": 4, "UInt32": 4, "ComplexHalf": 4, "Long": 8,
    "Double": 8, "UInt64": 8, "ComplexFloat": 8, "ComplexDouble": 16,
}  # fmt: skip


def flight() -> dict[str, Any]:
    """The process's Flight Recorder: ``state`` (``on``: records; ``empty``: none
    yet; ``off``: the job turned it off, or there is none to read; ``error``),
    ``reason`` (for all but ``on``), the dump's format ``version``, the ring's
    ``buffer_size`` where the job set one (None: torch's default), ``rows``."""
    size, var = buffer_size(os.environ)
    if size is not None and size <= 0:
        return _status("off", f"the job set {var}={size}; {TURN_ON}", size)
    if _torch_distributed() is None:
        return _status("off", "torch.distributed is not imported in this process", size)
    c10d = getattr(getattr(sys.modules.get("torch"), "_C", None), "_distributed_c10d", None)
    dumps = [(name, getattr(c10d, name)) for name in DUMPS if hasattr(c10d, name)]
    if not dumps:
        version = getattr(sys.modules.get("torch"), "__version__", "?")
        return _status("off", f"torch {version} has no Flight Recorder dump ({DUMPS[0]})", size)
    rows: list[dict[str, Any]] = []
    version = None
    for name, dump in dumps:
        try:
            answer = json.loads(dump(includeCollectives=True, onlyActive=False))
        except Exception as err:  # torch's own failure, answered as such
            return _status("error", f"{name}: {type(err).__name__}: {err}", size)
        version = version or answer.get("version")
        rows += records(answer)
    if not rows:
        why = "no collective yet (Gloo's send and recv are not recorded)"
        if size is None:  # torch's default: 2000 in 2.13, older releases may keep none
            why += f", or off by default in this torch ({TURN_ON})"
        return {**_status("empty", why, size), "version": version}
    return {**_status("on", "", size), "version": version, "rows": rows}


def buffer_size(environ: Mapping[str, str]) -> tuple[int | None, str]:
    """The ring's size the job set, and the variable that set it ((None, "") when
    unset: torch's default). An unreadable value is torch's refusal, so None."""
    for var in SIZE_VARS:
        if var in environ:
            try:
                return int(environ[var].strip()), var
            except ValueError:
                return None, var
    return None, ""


def _status(state: str, reason: str, size: int | None) -> dict[str, Any]:
    return {"state": state, "reason": reason, "version": None, "buffer_size": size, "rows": []}


def records(dump: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat row per record of a JSON dump (``entries``; absent when none)."""
    return [record(e) for e in dump.get("entries") or [] if isinstance(e, dict)]


def record(e: dict[str, Any]) -> dict[str, Any]:
    """A dump's record as the columns of ``comm.flight``."""
    name = str(e.get("profiling_name") or "")
    backend, _, op = name.rpartition(":")  # "gloo:all_reduce", "nccl:send 0->1"
    group = list(e.get("process_group") or ["", ""]) + ["", ""]
    sizes = [list(s) for s in e.get("input_sizes") or []]
    dtypes = [str(t) for t in e.get("input_dtypes") or []]
    duration = e.get("duration_ms")
    return {
        "record_id": e.get("record_id"),
        "pg_id": e.get("pg_id"),
        "pg": str(group[0]),
        "pg_desc": str(group[1]),
        "backend": backend,
        "op": op,
        "seq": e.get("collective_seq_id"),
        "p2p_seq": e.get("p2p_seq_id"),
        "op_id": e.get("op_id"),
        "is_p2p": bool(e.get("is_p2p")),
        "state": e.get("state"),
        "retired": bool(e.get("retired")),
        "input_sizes": sizes,
        "input_dtypes": dtypes,
        "output_sizes": [list(s) for s in e.get("output_sizes") or []],
        "output_dtypes": [str(t) for t in e.get("output_dtypes") or []],
        "bytes": tensor_bytes(sizes, dtypes),
        "ts": e.get("time_created_ns"),
        "started_ns": e.get("time_discovered_started_ns") or None,  # 0: never seen
        "completed_ns": e.get("time_discovered_completed_ns") or None,
        "dur_ns": round(float(duration) * 1e6) if duration is not None else None,
        "timeout_ms": e.get("timeout_ms"),
        "thread": e.get("thread_name"),
    }


def tensor_bytes(sizes: list[list[int]], dtypes: list[str]) -> int | None:
    """The bytes of tensors of these shapes and dtypes (None: a dtype not known)."""
    if len(sizes) != len(dtypes) or any(t not in ITEM_BYTES for t in dtypes):
        return None
    total = 0
    for shape, dtype in zip(sizes, dtypes, strict=True):
        n = 1
        for d in shape:
            n *= int(d)
        total += n * ITEM_BYTES[dtype]
    return total
