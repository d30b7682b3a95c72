"""``comm.groups``: which torch process group (``pg``) each traced Gloo context is.

A Gloo collective's ``comm`` is the address of its ``gloo::Context``: local to
the process. Two groups of the same size (data- and tensor-parallel groups
made with ``new_group``) cannot be told apart across ranks by size and order
of use. torch names its groups the same in every rank of an SPMD job (every
rank creates every group, in the same order), so a context is named across
the job by its group: this table maps each traced context to the group's
name and its global ranks.

The map is read from the process's own memory, with nothing to guess: each
group's ``ProcessGroupGloo`` (the C++ object behind the pybind11 object
torch gives, its address right after the Python object header) holds its
contexts in a ``std::vector<std::shared_ptr<gloo::Context>>``; a context
pointer the trace saw, found as an element of such a vector inside one
group's object, belongs to that group. Memory is read with ``pread`` on
``/proc/self/mem`` (an unmapped address is an error, never a crash). torch
is used only when the host has fully imported it (``sys.modules``), never
imported here.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa

SCHEMA = pa.schema(
    [
        ("backend", pa.string()),
        ("comm", pa.uint64()),
        ("pg", pa.string()),
        ("ranks", pa.list_(pa.int64())),
        ("group_rank", pa.int64()),
        ("nranks", pa.int64()),
    ]
)
OBJECT_BYTES = 1024  # how much of a ProcessGroupGloo is searched for its context vector
MAX_CONTEXTS = 64
PYOBJECT_HEAD = 16  # ob_refcnt, ob_type: where pybind11 keeps the C++ object's address


class Memory:
    """This process's memory, read without ever faulting."""

    def __init__(self) -> None:
        self._fd = os.open("/proc/self/mem", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        os.close(self._fd)

    def read(self, addr: int, size: int) -> bytes | None:
        if addr <= 0 or size <= 0:
            return None
        try:
            data = os.pread(self._fd, size, addr)
        except (OSError, OverflowError, ValueError):
            return None
        return data if len(data) == size else None

    def words(self, addr: int, count: int) -> tuple[int, ...]:
        data = self.read(addr, 8 * count)
        return struct.unpack(f"<{count}Q", data) if data else ()


def contexts_of(mem: Memory, obj: int, wanted: set[int]) -> set[int]:
    """The ``wanted`` context pointers held by the C++ object at ``obj``: each
    a ``shared_ptr`` element of a vector (begin, end words) inside it."""
    found: set[int] = set()
    words = mem.words(obj, OBJECT_BYTES // 8)
    for begin, end in zip(words, words[1:], strict=False):
        span = end - begin
        if begin <= 0 or span <= 0 or span % 16 or span > 16 * MAX_CONTEXTS:
            continue
        elems = mem.words(begin, span // 8)
        found.update(ptr for ptr in elems[0::2] if ptr in wanted)
    return found


def torch_groups() -> list[tuple[str, list[int], int, Any]]:
    """(name, global ranks, my group rank, Gloo backend object) of each group
    in this process; none unless the host has torch.distributed up."""
    dist = sys.modules.get("torch.distributed")
    torch = sys.modules.get("torch")
    spec = getattr(dist, "__spec__", None)
    if dist is None or torch is None or getattr(spec, "_initializing", False):
        return []
    try:
        if not dist.is_initialized():
            return []
        world = dist.distributed_c10d._world
        out = []
        for pg, name in list(world.pg_names.items()):
            ranks = sorted(world.pg_group_ranks.get(pg, {}))
            try:
                backend = pg._get_backend(torch.device("cpu"))
            except (RuntimeError, ValueError):  # a group with no CPU (Gloo) backend
                continue
            if type(backend).__name__ != "ProcessGroupGloo":
                continue
            out.append((str(name), ranks, int(pg.rank()), backend))
        return out
    except (AttributeError, KeyError, TypeError, RuntimeError):  # torch internals moved: none
        return []


def groups(traced: Iterable[int], find: Callable[[], list] = torch_groups) -> pa.Table:  # type: ignore[type-arg]
    """Rows for the traced context pointers this process's groups hold."""
    wanted = {int(c) for c in traced if c}
    rows: list[dict[str, Any]] = []
    if not wanted:
        return SCHEMA.empty_table()
    mem = Memory()
    try:
        for name, ranks, my_rank, backend in find():
            head = mem.words(id(backend) + PYOBJECT_HEAD, 1)
            if not head:
                continue
            for ctx in sorted(contexts_of(mem, head[0], wanted)):
                rows.append(
                    {
                        "backend": "gloo",
                        "comm": ctx,
                        "pg": name,
                        "ranks": ranks,
                        "group_rank": my_rank,
                        "nranks": len(ranks),
                    }
                )
    finally:
        mem.close()
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def traced_gloo_contexts(store: Any) -> list[int]:
    """The distinct contexts in this process's ``gloo.calls``."""
    import pyarrow.compute as pc

    from probing.engine.providers import snapshot_dataset

    tbl = store.get("gloo", "calls")
    if tbl is None:
        return []
    comm = snapshot_dataset(tbl.snapshot()).to_table(columns=["comm"]).column("comm")
    return [c for c in pc.unique(comm).to_pylist() if c]
