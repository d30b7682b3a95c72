"""The drain's pure parts on canned data: ring records taken in slices, read
in place through the record dtype, and kernel names looked up a column at a
time. No privileges needed (tests/privileged/test_drain.py drains for real)."""

from __future__ import annotations

import struct

import numpy as np

from probing.node.bpf import families as fam
from probing.node.bpf.cuda import KERNEL_SLOTS, KernelSlots
from probing.node.bpf.ringbuf import HDR_SIZE, record_dtype, record_size, take_records, unstage

SAMPLE = np.dtype([("a", "<u8"), ("b", "<u4", (2,)), ("c", "<u2")], align=True)  # 24 bytes


def _ring(values: list[int], size: int = 1024, start: int = 0) -> bytes:
    """Committed records of SAMPLE (a = value, b = [value, 2 value], c = 7)
    from position ``start`` of a data area mapped twice in a row."""
    area = bytearray(size)
    rec = record_size(SAMPLE.itemsize)
    for i, v in enumerate(values):
        raw = struct.pack("<IIQIIH", SAMPLE.itemsize, 0, v, v, 2 * v, 7).ljust(rec, b"\0")
        for j, byte in enumerate(raw):
            area[(start + i * rec + j) % size] = byte
    return bytes(area) * 2


def test_the_record_dtype_reads_like_the_sample() -> None:
    rec = record_dtype(SAMPLE)
    assert rec.itemsize == record_size(SAMPLE.itemsize) == 32
    for name in SAMPLE.names:
        assert rec.fields[name][0] == SAMPLE.fields[name][0]
        assert rec.fields[name][1] == SAMPLE.fields[name][1] + HDR_SIZE


def test_records_in_slices_of_at_most_limit() -> None:
    rec = record_size(SAMPLE.itemsize)
    start = 1024 - 2 * rec  # the third record wraps to the beginning
    data = _ring(list(range(1, 8)), start=start)
    cons, prod, got = start, start + 7 * rec, []
    while True:
        out, cons = take_records(data, cons, prod, 1023, SAMPLE, limit=3)
        if not len(out):
            break
        assert len(out) <= 3
        got.append(out)
    assert cons == prod
    ev = np.concatenate(got)
    assert ev["a"].tolist() == list(range(1, 8))
    assert ev["b"].tolist() == [[v, 2 * v] for v in range(1, 8)]
    assert set(ev["c"].tolist()) == {7}
    assert [len(g) for g in got] == [3, 3, 1]


def test_taken_records_do_not_change_with_the_ring() -> None:
    """The records are copied out: the kernel may reuse their space at once."""
    data = bytearray(_ring([5, 6]))
    out, _ = take_records(data, 0, 2 * record_size(SAMPLE.itemsize), 1023, SAMPLE)
    data[:] = bytes(len(data))
    assert out["a"].tolist() == [5, 6]


def test_kernel_slots_name_each_key_once_and_survive_collisions() -> None:
    asked: list[int] = []

    def name(k: int) -> str | None:
        asked.append(k)
        return None if k == 0x3000 else f"k{k:x}"

    slots = KernelSlots()
    # keys 16 * KERNEL_SLOTS apart share a slot; 0x3000 has no name
    keys = np.array([0x1000, 0x1000 + 16 * KERNEL_SLOTS, 0x2000, 0x3000] * 50, dtype=np.uint64)
    for _ in range(3):
        ids = slots.lookup(keys, name)
        names = slots.dictionary().take(ids).to_pylist()
        expect = ["k1000", f"k{0x1000 + 16 * KERNEL_SLOTS:x}", "k2000", None] * 50
        assert names == expect
    assert sorted(asked) == sorted(set(keys.tolist()))  # once each
    assert slots.dictionary()[-1].as_py() is None
    slots.clear([])  # names may have changed: asked again
    slots.lookup(keys[:1], name)
    assert asked[-1] == 0x1000


def test_cuda_decode_by_table_lookups_matches_the_events() -> None:
    """fn_mask and the name columns come from lookup tables: an id past the
    family's functions is no function of any set."""
    ev = np.zeros(4, fam.CUDA_EVENT)
    ids = {f.enum: i for i, f in enumerate(fam.CUDA_FUNCS)}
    ev["fn"] = [ids["CUDA_LAUNCHKERNEL"], ids["CU_LAUNCHKERNEL"], ids["CUDA_MALLOC"], 999]
    mask = fam.fn_mask(ev, fam.CUDA_FUNCS, (*fam.CUDA_LAUNCHES, fam.CU_LAUNCH))
    assert mask.tolist() == [True, True, False, False]
    cols = fam.header_columns(ev[:3], fam.Decoded(0, 1), fam.CUDA_FUNCS)
    assert cols["api"].to_pylist() == ["cudaLaunchKernel", "cuLaunchKernel", "cudaMalloc"]


def test_staged_records_give_their_valid_events_in_time_order() -> None:
    """A stage record holds ``n`` valid events of 8 (the rest is stale):
    only those come out, full stages without a copy per event, and a CPU's
    stage sent after another CPU's later events is put back in time order."""
    cuda = fam.FAMILIES["cuda"]
    rec = np.zeros(3, cuda.record)
    assert cuda.record.itemsize == 8 + cuda.stage * cuda.dtype.itemsize
    ts = iter(range(100, 10_000, 10))
    for r, n in zip(rec, (8, 3, 8), strict=True):
        r["n"] = n
        r["ev"]["ts"] = [next(ts) if k < n else 1 for k in range(cuda.stage)]  # 1: stale
    full = unstage(rec[[0, 2]])
    assert len(full) == 16 and np.all(np.diff(full["ts"].astype(np.int64)) > 0)
    got = unstage(rec)["ts"].astype(np.int64)
    assert len(got) == 19 and 1 not in got and np.all(np.diff(got) > 0)
    late = rec[[1, 0]]  # the second CPU's three events reach the ring first
    late["ev"]["ts"][0, :3] += 1000
    swapped = unstage(late)["ts"].astype(np.int64)
    assert np.all(np.diff(swapped) >= 0) and len(swapped) == 11
    assert len(unstage(rec[:0])) == 0
