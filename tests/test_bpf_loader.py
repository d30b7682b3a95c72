"""The BPF loader's pure parts: C types from BCC's descriptions, the numpy
mirrors checked field by field, the cache format, and the kernel UAPI
layouts the ctypes structs copy. No root needed."""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest

from probing.errors import ProbingError
from probing.node.bpf import families as fam
from probing.node.bpf import kernel, loader

HDR = [
    "probing_hdr",
    [
        ["ts", "unsigned long long"],
        ["dur_ns", "unsigned long long"],
        ["tid", "unsigned int"],
        ["ret", "int"],
        ["fn", "unsigned short"],
        ["flags", "unsigned short"],
        ["stack_id", "unsigned int"],
    ],
    "struct_packed",
]
# what BCC 0.26 says of struct gloo_event (bpf_table_leaf_desc of "inflight")
GLOO_DESC = [
    "gloo_event",
    [
        ["hdr", HDR],
        ["context", "unsigned long long"],
        ["seq", "unsigned long long"],
        ["elements", "unsigned long long"],
        ["elem_size", "unsigned long long"],
        ["ctx_head", "unsigned long long", [2]],
        ["peer", "int"],
        ["tag", "int"],
        ["wait_ns", "unsigned long long"],
        ["caller", "unsigned int"],
        ["pad", "unsigned int"],
    ],
    "struct_packed",
]


def test_a_c_struct_from_bccs_description_flattens_to_the_events_fields() -> None:
    ctype = loader.ctype_of(GLOO_DESC)
    assert ctypes.sizeof(ctype) == fam.GLOO_EVENT.itemsize == 104
    fields = loader.c_fields(ctype)
    assert fields[:3] == [("ts", 0, 8), ("dur_ns", 8, 8), ("tid", 16, 4)]
    assert fields[-3:] == [("wait_ns", 88, 8), ("caller", 96, 4), ("pad", 100, 4)]
    assert fields == loader.dtype_fields(fam.GLOO_EVENT)
    loader.check_dtype("gloo event", fam.GLOO_EVENT, ctype)  # the real mirror passes


def test_two_same_size_fields_swapped_are_caught() -> None:
    names = list(fam.GLOO_EVENT.names)
    i, j = names.index("context"), names.index("seq")
    names[i], names[j] = names[j], names[i]
    swapped = np.dtype(
        {
            "names": names,
            "formats": [fam.GLOO_EVENT.fields[n][0] for n in fam.GLOO_EVENT.names],
            "offsets": [fam.GLOO_EVENT.fields[n][1] for n in fam.GLOO_EVENT.names],
            "itemsize": fam.GLOO_EVENT.itemsize,
        }
    )
    assert swapped.itemsize == fam.GLOO_EVENT.itemsize  # the old size check passed this
    with pytest.raises(ProbingError, match=r"C \('context', 32, 8\) / numpy \('seq', 32, 8\)"):
        loader.check_dtype("gloo event", swapped, loader.ctype_of(GLOO_DESC))


def test_a_field_of_another_size_is_caught() -> None:
    desc = json.loads(json.dumps(GLOO_DESC))
    desc[1][1][1] = "unsigned int"  # context: 4 bytes in C
    with pytest.raises(ProbingError, match="does not mirror the C struct") as err:
        loader.check_dtype("gloo event", fam.GLOO_EVENT, loader.ctype_of(desc))
    assert str(err.value).endswith("\n")


def test_unknown_c_types_are_named() -> None:
    with pytest.raises(ProbingError, match="unknown C type 'float128'"):
        loader.ctype_of("float128")


def test_the_cache_format_round_trips() -> None:
    spec = kernel.MapSpec("inflight", 1, 8, 80, 16384, 0)
    insns = bytes(range(32))
    compiled = loader.Compiled(
        "k1", "GPL", 42, [loader.MapDef(spec, "int", GLOO_DESC)], {"p": (insns, [(1, 0)])}
    )
    back = loader.Compiled.from_json(compiled.to_json())
    assert back == compiled
    assert back.map("inflight").leaf == GLOO_DESC
    stale = json.loads(compiled.to_json())
    stale["format"] = loader.FORMAT + 1
    with pytest.raises(ValueError, match="cache format"):
        loader.Compiled.from_json(json.dumps(stale))


def test_map_loads_are_found_among_the_instructions() -> None:
    mov = bytes([0xB7, 0x01, 0, 0, 7, 0, 0, 0])  # r1 = 7
    ld_map = bytes([0x18, 0x11, 0, 0, 9, 0, 0, 0]) + bytes(8)  # r1 = map fd 9 (two slots)
    found = [(i, op, src, imm) for i, op, src, imm in kernel.iter_insns(mov + ld_map)]
    assert found[0] == (0, 0xB7, 0, 7)
    assert found[1] == (1, 0x18, kernel.PSEUDO_MAP_FD, 9)


def _offset(struct: type, field: str) -> int:
    return getattr(struct, field).offset


def test_the_ctypes_structs_follow_the_kernel_uapi() -> None:
    # union bpf_attr (link_create.uprobe_multi), struct bpf_link_info, bpf_map_info,
    # as in include/uapi/linux/bpf.h of Linux 6.6+
    u = kernel.LinkCreateUprobeMultiAttr
    assert [_offset(u, f) for f in ("attach_type", "path", "offsets", "cookies", "cnt", "pid")] == [
        8, 16, 24, 40, 48, 56]  # fmt: skip
    assert _offset(kernel.ProgLoadAttr, "prog_name") == 48
    assert _offset(kernel.ProgLoadAttr, "expected_attach_type") == 68
    assert _offset(kernel.MapCreateAttr, "map_name") == 28
    assert _offset(kernel.LinkInfoUprobeMulti, "path") == 16
    assert _offset(kernel.LinkInfoUprobeMulti, "pid") == 60
    assert _offset(kernel.MapInfo, "name") == 24
    assert _offset(kernel.PerfEventAttr, "config2") == 64
    assert (kernel.TRACE_UPROBE_MULTI, kernel.LINK_TYPE_UPROBE_MULTI) == (48, 12)
    # union bpf_attr's batch: in_batch, out_batch, keys, values, count, map_fd, ...
    b = kernel.MapBatchAttr
    assert [_offset(b, f) for f in ("keys", "values", "count", "map_fd", "elem_flags")] == [
        16, 24, 32, 36, 40]  # fmt: skip


def test_entry_only_functions_get_links_of_their_own() -> None:
    """Launches and async copies (probed at entry only) run their handler
    directly; paired functions share one link per direction via the dispatcher."""
    probes = [
        loader.Uprobe(*p)
        for p in (
            ("cuda_launchkernel", "cudaLaunchKernel", 0x10, False),
            ("cuda_memcpyasync", "cudaMemcpyAsync", 0x20, False),
            ("cuda_memcpy", "cudaMemcpy", 0x30, False),
            ("cuda_ret_CUDA_MEMCPY", "cudaMemcpy", 0x30, True),
            ("cuda_free", "cudaFree", 0x40, False),
            ("cuda_ret_CUDA_FREE", "cudaFree", 0x40, True),
        )
    ]
    groups = [(g.handler, [p.symbol for p in g.probes], g.ret) for g in loader.link_groups(probes)]
    assert groups == [
        ("cuda_launchkernel", ["cudaLaunchKernel"], False),
        ("cuda_memcpyasync", ["cudaMemcpyAsync"], False),
        (None, ["cudaMemcpy", "cudaFree"], False),
        (None, ["cudaMemcpy", "cudaFree"], True),
    ]
    assert loader.link_groups([]) == []
