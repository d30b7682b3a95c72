"""The cuda family's side of the tracer: what each launch's kernel is called.

``cuda.calls`` names the kernel of every launch (its ``kernel`` column).
The events carry an address: a host stub for the runtime's launches
(``cudaLaunchKernel``), a ``CUfunction`` for the driver's
(``cuLaunchKernel``, Triton's). ``KernelNames`` turns a whole column of
them into names at once:

* a stub is named by its symbol in this process's maps (``Symbolizer``),
  else by the CUDA runtime the process loaded, for stubs whose symbols
  were stripped (``RuntimeNames``, torch's);
* a ``CUfunction`` is named by the string its ``cuModuleGetFunction``
  was given, read from the traced process's memory when that call's
  event is drained;
* ``KernelSlots`` remembers the names of the addresses seen before, so a
  burst of launches of one kernel costs one numpy lookup.

The cuda program also needs to know where each loaded libcudart lies
(``mark_runtime_text``): the runtime launches through ``cuLaunchKernel``,
and that inner call is not a second launch.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from probing.errors import ProbingError
from probing.node.bpf import families as fam
from probing.node.bpf.symbols import RuntimeNames, Symbolizer
from probing.proc import Mapping

if TYPE_CHECKING:
    from probing.node.bpf.drain import Live

RUNTIME_RANGES = 8  # libcudart copies the cuda program tells apart (bpf/cuda.bpf.c)
KERNEL_SLOTS = 4096  # KernelSlots' table: a power of two


class KernelNames:
    """Names the kernels of the cuda family's launches in process ``pid``,
    for its decoder (``families.Decoded.kernel_names``); ``loaded`` gives
    the families the tracer loaded (the cuda one says which libcudart and
    libcuda files it attached to)."""

    def __init__(self, pid: int, loaded: Callable[[], Iterable[Live]]) -> None:
        self.pid = pid
        self._loaded = loaded
        self._symbolizer = Symbolizer(pid)
        self._runtime_names = RuntimeNames()
        self._runtime_ranges: list[tuple[int, ...]] = []
        self._cu_functions: dict[int, str | None] = {}
        self._kernels = KernelSlots()

    def __call__(self, ev: np.ndarray, launch: np.ndarray) -> pa.Array:
        """The kernel of each event of ``ev`` where ``launch``, else NULL."""
        ids = {fn.enum: i for i, fn in enumerate(fam.CUDA_FUNCS)}
        learnt = self._learn_functions(ev, ids[fam.CU_GETFUNCTION])
        idx = np.flatnonzero(launch)
        if not idx.size:
            return pa.nulls(len(ev), pa.string())
        runtimes = [p for p in self._libraries() if "libcudart" in os.path.basename(p)]
        if learnt or runtimes != self._kernels.runtimes:  # a name may have changed
            self._kernels.clear(runtimes)
        every = idx.size == len(ev)  # a slice of launches only: no gather
        func, fn = (ev["func"], ev["fn"]) if every else (ev["func"][idx], ev["fn"][idx])
        # one key per (address, runtime or driver): addresses fit in 63 bits
        keys = func | ((fn == ids[fam.CU_LAUNCH]).astype(np.uint64) << np.uint64(63))

        def name(k: int) -> str | None:
            if k & (1 << 63):
                return self._cu_functions.get(k ^ (1 << 63))
            return self._symbolizer.name(k) or self._runtime_names.name(k, runtimes)

        found = self._kernels.lookup(keys, name)
        names = self._kernels.dictionary()  # the last entry is NULL
        if every and (found == found[0]).all():  # one kernel, launched again and again
            return pa.repeat(names[int(found[0])], len(found))
        if every:
            return names.take(pa.array(found))
        slot = np.full(len(ev), len(names) - 1, dtype=np.int32)
        slot[idx] = found
        return names.take(pa.array(slot))

    def _libraries(self) -> list[str]:
        """The files the cuda family attached to."""
        cuda = [live for live in self._loaded() if live.family.name == "cuda"]
        return sorted(p for live in cuda for p in live.libraries)

    def _learn_functions(self, ev: np.ndarray, getfunction: int) -> bool:
        """Remember the name of every ``CUfunction`` that ``cuModuleGetFunction``
        returned in ``ev``; whether there was one."""
        got = (ev["fn"] == getfunction) & ((ev["flags"] & fam.HAS_RET) != 0)
        learnt = False
        for func, ptr in zip(ev["func"][got].tolist(), ev["ptr"][got].tolist(), strict=True):
            if func:
                self._cu_functions[func] = read_cstring(ptr, self.pid)
                learnt = True
        return learnt

    def mark_runtime_text(self, maps: list[Mapping], live: Iterable[Live]) -> None:
        """Tell the cuda program (of the ``live`` families) where each libcudart
        in ``maps`` lies: the runtime launches through cuLaunchKernel, and that
        call is not a second launch."""
        spans: dict[str, list[int]] = {}
        for m in maps:
            if os.path.basename(m.path).startswith("libcudart.so"):
                lo_hi = spans.setdefault(m.path, [m.start, m.end])
                lo_hi[0], lo_hi[1] = min(lo_hi[0], m.start), max(lo_hi[1], m.end)
        ranges = sorted(tuple(v) for v in spans.values())[:RUNTIME_RANGES]
        if ranges == self._runtime_ranges:
            return
        for family in live:
            if family.family.name != "cuda":
                continue
            table = family.bpf["runtime_text"]
            for i in range(RUNTIME_RANGES):
                start, end = ranges[i] if i < len(ranges) else (0, 0)
                table[ctypes.c_int(i)] = table.Leaf(start, end)
        self._runtime_ranges = ranges


class KernelSlots:
    """Kernel key -> name id for a whole column of launches at once.

    A direct-mapped table in numpy (slot from the key's address bits)
    answers the keys seen before; the others are named one by one, once
    (``name``), and take their slot. ``clear`` when a name may have changed.
    """

    def __init__(self) -> None:
        self.clear([])

    def clear(self, runtimes: list[str]) -> None:
        self.runtimes = runtimes  # the libcudart copies the names came from
        self.keys = np.zeros(KERNEL_SLOTS, dtype=np.uint64)
        self.ids = np.full(KERNEL_SLOTS, -1, dtype=np.int32)
        self.names: list[str | None] = []
        self._by_key: dict[int, int] = {}
        self._dictionary: pa.Array | None = None

    def lookup(self, keys: np.ndarray, name: Callable[[int], str | None]) -> np.ndarray:
        """The name id of every key (int32), naming new keys with ``name``."""
        slot = ((keys >> np.uint64(4)) ^ (keys >> np.uint64(20))) & np.uint64(KERNEL_SLOTS - 1)
        slot = slot.astype(np.intp)
        found: np.ndarray = self.ids[slot]
        miss = (found < 0) | (self.keys[slot] != keys)
        if miss.any():
            missed = keys[miss]
            distinct = np.unique(missed)
            ids = np.empty(len(distinct), dtype=np.int32)
            for i, k in enumerate(distinct.tolist()):
                got = self._by_key.get(k)
                if got is None:
                    got = self._by_key[k] = len(self.names)
                    self.names.append(name(k))
                    self._dictionary = None
                ids[i] = got
            missed_ids = ids[np.searchsorted(distinct, missed)]
            found[miss] = missed_ids
            where = slot[miss]  # each key takes its slot; the last one wins a collision
            self.keys[where] = missed
            self.ids[where] = missed_ids
        return found

    def dictionary(self) -> pa.Array:
        """The names by id, then one NULL."""
        if self._dictionary is None:
            self._dictionary = pa.array([*self.names, None], type=pa.string())
        return self._dictionary


def read_cstring(addr: int, pid: int | str = "self", limit: int = 512) -> str | None:
    """A NUL-terminated string in process ``pid``'s memory, or None where it
    cannot be read (``process_vm_readv``: a bad address is an error, not a
    crash)."""
    from probing.pyframes.memory import ProcessMemory, cstring

    if not addr:
        return None
    try:
        raw = cstring(ProcessMemory(None if pid == "self" else int(pid)), addr, limit)
    except (OSError, OverflowError, ProbingError):
        return None
    return raw.decode("utf-8", "replace") or None
