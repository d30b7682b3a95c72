"""Read a BPF ring buffer in bulk through its mmap, with no callback per event.

The kernel maps a ring buffer as: one consumer page (ours to write), then
one producer page and the data area mapped twice in a row, so a record that
wraps around the end is still contiguous. Every record is an 8-byte header
(``len`` with a busy and a discard bit, ``pg_off``) and the sample, rounded
up to 8 bytes. All records of one ring have the same size here (one event
struct per family), so the records between the consumer and producer
positions are one numpy array, taken with one ``memcpy``: the sample's
fields are read in that array where they lie (a record dtype whose fields
sit 8 bytes further than the sample's), never copied a second time.
"""

from __future__ import annotations

import functools
import mmap

import numpy as np

BUSY_BIT = 1 << 31
DISCARD_BIT = 1 << 30
HDR_SIZE = 8


def record_size(sample_size: int) -> int:
    return (sample_size + HDR_SIZE + 7) & ~7


@functools.lru_cache(maxsize=16)
def record_dtype(sample: np.dtype) -> np.dtype:
    """One ring-buffer record: ``rb_len`` (the header's length and flags),
    then every field of ``sample`` under its own name, padding to 8 bytes.
    An array of these reads like an array of samples (``ev["ts"]``)."""
    if sample.names is None or sample.fields is None:
        raise ValueError(f"the sample must be a structured dtype, not {sample}")
    fields = [(name, *sample.fields[name][:2]) for name in sample.names]
    return np.dtype(
        {
            "names": ["rb_len", *(n for n, _, _ in fields)],
            "formats": ["<u4", *(t for _, t, _ in fields)],
            "offsets": [0, *(off + HDR_SIZE for _, _, off in fields)],
            "itemsize": record_size(sample.itemsize),
        }
    )


def take_records(
    data: memoryview | bytes,
    cons: int,
    prod: int,
    mask: int,
    sample: np.dtype,
    limit: int | None = None,
) -> tuple[np.ndarray, int]:
    """The committed records in ``data[cons:prod]`` (positions taken modulo
    ``mask + 1``, over a doubly mapped area), at most ``limit`` of them, as
    an array of ``record_dtype(sample)``, and the new consumer position.

    Stops at the first record still being written (busy bit); discarded
    records are consumed and left out. A record whose length is not the
    sample size means the layout is not what we think: raise, rather than
    decode garbage.
    """
    rec = record_dtype(sample)
    n = max(prod - cons, 0) // rec.itemsize
    if limit is not None:
        n = min(n, limit)
    if n == 0:
        return np.empty(0, rec), cons
    # one copy out of the ring (its space goes back to the kernel after);
    # a header is copied before its sample, so a committed header read here
    # means a complete sample
    raw = np.frombuffer(data, dtype=np.uint8, count=n * rec.itemsize, offset=cons & mask)
    recs = raw.copy().view(rec)
    lens = recs["rb_len"]
    busy = np.flatnonzero(lens & np.uint32(BUSY_BIT))
    if busy.size:
        n = int(busy[0])
        recs, lens = recs[:n], lens[:n]
    flags = lens & np.uint32(DISCARD_BIT)
    sizes = lens ^ flags
    if n and not np.all(sizes == sample.itemsize):
        bad = int(sizes[sizes != sample.itemsize][0])
        raise ValueError(f"ring buffer record of {bad} bytes, expected {sample.itemsize}")
    if flags.any():
        recs = recs[flags == 0]
    return recs, cons + n * rec.itemsize


def unstage(records: np.ndarray) -> np.ndarray:
    """The events of staged records (fields ``n`` and ``ev``, an array of
    events of which the first ``n`` are valid; bpf/preamble.c: struct
    stage), in ring order, as one array of events. A CPU's stage may reach
    the ring after another CPU's later events: the result is put in time
    order (``ts``) when it is not already, as it is with one launching
    thread. The events are cut out as bytes, a row per event (numpy copies
    a structured subarray field by field, at a quarter of the speed)."""
    event = records.dtype["ev"].base
    width = records.dtype["ev"].shape[0]
    if not len(records):
        return np.empty(0, event)
    fields = records.dtype.fields
    assert fields is not None  # a structured dtype: it has "ev"
    start = fields["ev"][1]
    rows = np.ascontiguousarray(records).view(np.uint8).reshape(len(records), -1)
    block = rows[:, start : start + width * event.itemsize]
    each = np.ascontiguousarray(block).reshape(len(records) * width, event.itemsize)
    n = records["n"]
    if not np.all(n == width):
        each = each[(np.arange(width) < n[:, None]).reshape(-1)]
    ev = each.view(event).reshape(-1)
    ts = ev["ts"]
    if len(ts) > 1 and not np.all(ts[1:] >= ts[:-1]):
        ev = ev[np.argsort(ts, kind="stable")]
    return ev


class RingReader:
    """The consumer side of one BPF_MAP_TYPE_RINGBUF map, by its fd."""

    def __init__(self, map_fd: int, size: int, sample: np.dtype) -> None:
        if size & (size - 1):
            raise ValueError(f"ring buffer size {size} is not a power of two")
        page = mmap.PAGESIZE
        self.size = size
        self.sample = sample
        self.record_size = record_size(sample.itemsize)
        self._cons = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._prod = mmap.mmap(
            map_fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page
        )
        self._data = memoryview(self._prod)[page:]
        # the two positions, each read and written with one aligned 8-byte
        # access: the kernel reads ours and writes its own at any moment, and
        # struct's "<Q" goes byte by byte. A consumer position torn by a
        # preemption half-way read as "no room" to every reserve until the
        # drain ran again (2,132 events lost in 60 s at 1 M/s); a torn
        # producer position would read stale records past the real one.
        self._cons_pos = np.frombuffer(self._cons, dtype=np.uint64, count=1)
        self._prod_pos = np.frombuffer(self._prod, dtype=np.uint64, count=1)
        self.bytes_read = 0

    def positions(self) -> tuple[int, int]:
        return int(self._cons_pos[0]), int(self._prod_pos[0])

    def pending(self) -> int:
        """Bytes committed or reserved and not read yet."""
        cons, prod = self.positions()
        return prod - cons

    def read(self, limit: int | None = None) -> np.ndarray:
        """Committed events, oldest first, at most ``limit`` of them (all by
        default); frees their space in the ring. Fields by name: ``ev["ts"]``."""
        cons, prod = self.positions()
        records, new_cons = take_records(self._data, cons, prod, self.size - 1, self.sample, limit)
        if new_cons != cons:
            self._cons_pos[0] = new_cons
            self.bytes_read += new_cons - cons
        return records

    def close(self) -> None:
        del self._cons_pos, self._prod_pos
        self._data.release()
        self._prod.close()
        self._cons.close()
