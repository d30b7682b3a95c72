"""``comm.groups``: which torch process group (``pg``) each traced Gloo context is.

A Gloo collective's ``comm`` is the address of its ``gloo::Context``: local to
the process. Two groups of the same size (data- and tensor-parallel groups
made with ``new_group``) cannot be told apart across ranks by size and order
of use. torch names its groups the same in every rank of an SPMD job (every
rank creates every group, in the same order), so a context is named across
the job by its group: this table maps each traced context to the group's
name and its global ranks, and the group's ``role`` in the job's parallel
layout where its description says one (``probing.analyze.mesh.role_of``:
Megatron-Core's ``TENSOR_MODEL_PARALLEL_GROUP`` is ``tp``, a DeviceMesh's
``mesh_dp`` is ``dp``, ``mesh_dp_shard`` is ``dp_shard``; NULL for none).

The map is read from the process's own memory, with nothing to guess: each
group's ``ProcessGroupGloo`` (the C++ object behind the pybind11 object
torch gives, its address right after the Python object header) holds its
contexts in a ``std::vector<std::shared_ptr<gloo::Context>>``; a context
pointer the trace saw, found as an element of such a vector inside one
group's object, belongs to that group. Memory is read with ``pread`` on
``/proc/self/mem`` (an unmapped address is an error, never a crash). torch
is used only when the host has fully imported it (``sys.modules``), never
imported there (``probing.guest.inside.groups`` does the reading).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa

SCHEMA = pa.schema(
    [
        ("backend", pa.string()),
        ("comm", pa.uint64()),
        ("pg", pa.string()),
        ("role", pa.string()),  # tp, pp, dp, cp, ep or a mesh dimension's name; NULL: none
        ("ranks", pa.list_(pa.int64())),
        ("group_rank", pa.int64()),
        ("nranks", pa.int64()),
    ]
)


def provider(
    groups_of: Callable[[list[int]], list[dict[str, Any]]], store: Any
) -> Callable[[], pa.Table]:
    """``comm.groups`` over a target's ``groups`` (``probing.target``):
    the process reads its own memory (``probing.guest.inside.groups``)."""
    sealed: dict[str, set[int]] = {}  # a chunk's file -> its contexts (read once)

    def table() -> pa.Table:
        traced = traced_gloo_contexts(store, sealed)
        rows = groups_of(traced) if traced else []
        if rows:  # analyze is imported on first use (tests/test_engine.py)
            from probing.analyze.mesh import role_of

            for row in rows:
                row["role"] = role_of(row.get("pg") or "")
        return pa.Table.from_pylist(rows, schema=SCHEMA)

    return table


def traced_gloo_contexts(store: Any, sealed: dict[str, set[int]] | None = None) -> list[int]:
    """The distinct contexts in this process's ``gloo.calls``; ``sealed``
    keeps each chunk's (a chunk's file never changes: its id is new), so
    an ask reads the rows sealed since the last, not the whole trace."""
    import pyarrow.compute as pc

    tbl = store.get("gloo", "calls")
    if tbl is None:
        return []
    snap = tbl.snapshot()
    if not snap.paths and not snap.pending.num_rows:  # nothing traced (no dataset imported)
        return []
    sealed = {} if sealed is None else sealed
    if len(sealed) > 4 * len(snap.paths) + 64:  # merged and retired chunks: forgotten
        sealed.clear()
    found: set[int] = set()
    for path in snap.paths:
        if path not in sealed:
            import pyarrow.dataset as ds

            part = ds.dataset(path, schema=snap.schema, format=snap.container)
            comm = part.to_table(columns=["comm"]).column("comm")
            sealed[path] = set(pc.unique(comm).to_pylist())
        found |= sealed[path]
    if snap.pending.num_rows:
        found |= set(pc.unique(snap.pending.column("comm")).to_pylist())
    return sorted(c for c in found if c)
