"""Read a BPF ring buffer in bulk through its mmap, with no callback per event.

The kernel maps a ring buffer as: one consumer page (ours to write), then
one producer page and the data area mapped twice in a row, so a record that
wraps around the end is still contiguous. Every record is an 8-byte header
(``len`` with a busy and a discard bit, ``pg_off``) and the sample, rounded
up to 8 bytes. All records of one ring have the same size here (one event
struct per family), so everything between the consumer and producer
positions is one numpy array of records, taken in a single copy.
"""

from __future__ import annotations

import mmap
import struct

import numpy as np

BUSY_BIT = 1 << 31
DISCARD_BIT = 1 << 30
HDR_SIZE = 8


def record_size(sample_size: int) -> int:
    return (sample_size + HDR_SIZE + 7) & ~7


def record_dtype(sample: np.dtype) -> np.dtype:
    """One ring-buffer record: header, the sample, padding to 8 bytes."""
    return np.dtype(
        {
            "names": ["rb_len", "rb_pgoff", "sample"],
            "formats": ["<u4", "<u4", sample],
            "offsets": [0, 4, HDR_SIZE],
            "itemsize": record_size(sample.itemsize),
        }
    )


def take_records(
    data: memoryview | bytes, cons: int, prod: int, mask: int, sample: np.dtype
) -> tuple[np.ndarray, int]:
    """The committed records in ``data[cons:prod]`` (positions taken modulo
    ``mask + 1``, over a doubly mapped area) and the new consumer position.

    Stops at the first record still being written (busy bit); discarded
    records are consumed and left out. A record whose length is not the
    sample size means the layout is not what we think: raise, rather than
    decode garbage.
    """
    avail = prod - cons
    if avail <= 0:
        return np.empty(0, sample), cons
    rec = record_dtype(sample)
    n = avail // rec.itemsize
    start = cons & mask
    # a view of the ring: the headers are read in place, and only the samples
    # are copied out, once (the space is handed back to the kernel after)
    recs = np.frombuffer(data, dtype=rec, count=n, offset=start)
    lens = recs["rb_len"]
    busy = np.flatnonzero(lens & BUSY_BIT)
    if busy.size:
        n = int(busy[0])
        recs, lens = recs[:n], lens[:n]
    flags = lens & np.uint32(DISCARD_BIT)
    sizes = lens ^ flags
    if n and not np.all(sizes == sample.itemsize):
        bad = int(sizes[sizes != sample.itemsize][0])
        raise ValueError(f"ring buffer record of {bad} bytes, expected {sample.itemsize}")
    if flags.any():
        return recs["sample"][flags == 0], cons + n * rec.itemsize
    out = np.empty(n, sample)
    out[...] = recs["sample"]
    return out, cons + n * rec.itemsize


class RingReader:
    """The consumer side of one BPF_MAP_TYPE_RINGBUF map, by its fd."""

    def __init__(self, map_fd: int, size: int, sample: np.dtype) -> None:
        if size & (size - 1):
            raise ValueError(f"ring buffer size {size} is not a power of two")
        page = mmap.PAGESIZE
        self.size = size
        self.sample = sample
        self._cons = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._prod = mmap.mmap(
            map_fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page
        )
        self._data = memoryview(self._prod)[page:]
        self.bytes_read = 0

    def positions(self) -> tuple[int, int]:
        (cons,) = struct.unpack_from("<Q", self._cons, 0)
        (prod,) = struct.unpack_from("<Q", self._prod, 0)
        return cons, prod

    def read(self) -> np.ndarray:
        """Every committed event, oldest first; frees their space in the ring."""
        cons, prod = self.positions()
        samples, new_cons = take_records(self._data, cons, prod, self.size - 1, self.sample)
        if new_cons != cons:
            struct.pack_into("<Q", self._cons, 0, new_cons)
            self.bytes_read += new_cons - cons
        return samples

    def close(self) -> None:
        self._data.release()
        self._prod.close()
        self._cons.close()
