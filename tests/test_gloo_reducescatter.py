"""Gloo's reduce-scatter in gloo.calls, decoded from canned events: torch
runs it as all-reduces, and the probe (bpf/gloo.bpf.c) sends one event per
call, its elements the sum of theirs. No privileges needed; the real job is
tests/privileged/test_trace.py."""

from __future__ import annotations

import numpy as np
import pytest

from probing.node.bpf import families as fam

ENTRY_POINTS = {
    "GLOO_REDUCESCATTER": "c10d::ProcessGroupGloo::reduce_scatter",
    "GLOO_REDUCESCATTER_TENSOR": "c10d::ProcessGroupGloo::_reduce_scatter_base",
    "GLOO_REDUCESCATTER_COALESCED": "c10d::ProcessGroupGloo::reduce_scatter_tensor_coalesced",
}


def _fn(enum: str) -> int:
    return [f.enum for f in fam.GLOO_FUNCS].index(enum)


def _context_head(rank: int, size: int) -> list[int]:
    """A gloo::Context's first 16 bytes: rank and size (no vtable)."""
    return [size << 32 | rank, 0]


def _rows(**cols: list) -> list[dict]:  # type: ignore[type-arg]
    ev = np.zeros(len(next(iter(cols.values()))), fam.GLOO_EVENT)
    for name, values in cols.items():
        ev[name] = values
    return fam.to_batch(fam.FAMILIES["gloo"], ev, fam.Decoded(0, 1), 0).to_pylist()


@pytest.mark.parametrize("enum", sorted(ENTRY_POINTS))
def test_each_entry_point_is_a_reducescatter(enum: str) -> None:
    [row] = _rows(fn=[_fn(enum)], flags=[1], context=[0xC0], ctx_head=[_context_head(1, 4)])
    assert (row["op"], row["api"], row["comm"]) == ("reducescatter", ENTRY_POINTS[enum], 0xC0)


def test_its_size_is_what_each_rank_receives() -> None:
    """A reduce-scatter of 4 ranks whose all-reduces summed 4000 float32 is
    1000 received by each rank (as NCCL's recvcount); an all-reduce keeps
    its own size."""
    rs, ar = _fn("GLOO_REDUCESCATTER_TENSOR"), _fn("GLOO_ALLREDUCE")
    head = _context_head(2, 4)
    rows = _rows(fn=[rs, ar], flags=[1, 1], context=[0xC0, 0xC0], ctx_head=[head, head],
                 elements=[4000, 4000], elem_size=[4, 4])  # fmt: skip
    assert [(r["op"], r["elements"], r["bytes"]) for r in rows] == [
        ("reducescatter", 1000, 4000), ("allreduce", 4000, 16000)]  # fmt: skip


def test_no_size_without_the_group_size_or_in_flight() -> None:
    """Unknown where the context's rank and size do not decode, and while in
    flight (its parts carry none: the call's is known at its end)."""
    rs = _fn("GLOO_REDUCESCATTER")
    rows = _rows(fn=[rs, rs], flags=[1, 0], context=[0xC0, 0xC0],
                 ctx_head=[[0, 0], _context_head(0, 2)], elements=[64, 0],
                 elem_size=[4, 0])  # fmt: skip
    assert [(r["elements"], r["bytes"]) for r in rows] == [(None, None), (None, None)]


def test_entry_points_by_demangled_name() -> None:
    vector = "std::vector<at::Tensor, std::allocator<at::Tensor> >&"
    opts = "c10d::ReduceScatterOptions const&"
    names = {
        f"c10d::ProcessGroupGloo::reduce_scatter({vector}, std::vector<"
        f"std::vector<at::Tensor, std::allocator<at::Tensor> > >&, {opts})": "GLOO_REDUCESCATTER",
        f"c10d::ProcessGroupGloo::_reduce_scatter_base(at::Tensor&, at::Tensor&, {opts})": (
            "GLOO_REDUCESCATTER_TENSOR"
        ),
        f"c10d::ProcessGroupGloo::reduce_scatter_tensor_coalesced({vector}, {vector}, {opts})": (
            "GLOO_REDUCESCATTER_COALESCED"
        ),
        f"c10d::ProcessGroupWrapper::_reduce_scatter_base(at::Tensor&, at::Tensor&, {opts})": None,
    }
    assert {name: fam.gloo_entry_point(name) for name in names} == names
