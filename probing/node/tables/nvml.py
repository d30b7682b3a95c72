"""``nvml.gpu``, ``nvml.devices``, ``nvml.status``: GPU counters next to the events.

A sampler thread reads NVML (through pynvml) every ``interval`` for each GPU
this process uses (``CUDA_VISIBLE_DEVICES`` when set, else all) and appends
one row per GPU to the store table ``nvml.gpu``. A counter the GPU or driver
does not support is NULL, never an error; any other NVML error leaves that
counter NULL in that row, is counted in ``nvml.status`` and sampling goes on.
XID / critical events are drained at every sample. Without a library, a
driver or a device, the tables are empty and ``nvml.status`` says why.

Started when asked (``probing nvml --pid P --interval 100ms``, the probe's
``POST /nvml``, or ``PROBING_NVML_INTERVAL=100ms`` at start-up); it sleeps
on an Event between samples, so it stops at once.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from probing.errors import ProbingError
from probing.node.store import Store
from probing.worker import Worker

SCHEMA = "nvml"

GPU_SCHEMA = pa.schema(
    [
        ("ts", pa.int64()),  # wall-clock ns
        ("gpu", pa.int32()),  # NVML index
        ("uuid", pa.string()),
        ("util_gpu", pa.int32()),  # %
        ("util_mem", pa.int32()),  # %
        ("mem_used", pa.int64()),  # bytes
        ("mem_total", pa.int64()),
        ("power_w", pa.float64()),
        ("temp_c", pa.int32()),
        ("sm_clock_mhz", pa.int32()),
        ("mem_clock_mhz", pa.int32()),
        ("pcie_tx_kbs", pa.int64()),  # KB/s over NVML's last 20 ms
        ("pcie_rx_kbs", pa.int64()),
        ("nvlink_tx_kib", pa.int64()),  # cumulative KiB over all links
        ("nvlink_rx_kib", pa.int64()),
        ("throttle_reasons", pa.int64()),  # bitmask, nvmlClocksEventReason*
        ("ecc_uncorrected", pa.int64()),  # volatile, since the driver loaded
        ("xid", pa.int64()),  # last XID / critical event since the previous sample
        ("xid_count", pa.int32()),
        ("own", pa.bool_()),  # the GPU the process works on (``GpuSampler._owned``)
    ]
)

DEVICE_SCHEMA = pa.schema(
    [
        ("gpu", pa.int32()),
        ("uuid", pa.string()),
        ("name", pa.string()),
        ("pci_bus_id", pa.string()),
        ("driver", pa.string()),
        ("mem_total", pa.int64()),
        ("nvlink_count", pa.int32()),
        ("sampled", pa.bool_()),  # this process uses it
    ]
)

STATUS_SCHEMA = pa.schema(
    [
        ("state", pa.string()),  # sampling, stopped, unavailable
        ("reason", pa.string()),
        ("driver", pa.string()),
        ("devices", pa.int32()),
        ("sampled", pa.int32()),
        ("interval_s", pa.float64()),
        ("samples", pa.int64()),
        ("errors", pa.int64()),
        ("last_error", pa.string()),
        ("unsupported", pa.string()),  # counters this machine does not have
    ]
)


def visible_indices(count: int, uuids: list[str], env: str | None) -> list[int]:
    """The NVML indices ``CUDA_VISIBLE_DEVICES`` names (all when unset).

    Integers are taken as NVML (PCI-order) indices, ``GPU-…`` as UUID prefixes;
    the list stops at the first entry that names nothing, as CUDA does.
    """
    if env is None:
        return list(range(count))
    out: list[int] = []
    for item in (s.strip() for s in env.split(",")):
        if item.isdigit() and int(item) < count:
            idx = int(item)
        else:
            idx = next((i for i, u in enumerate(uuids) if item and u.startswith(item)), -1)
        if idx < 0:
            break
        if idx not in out:
            out.append(idx)
    return out


OWN_EVERY_S = 2.0  # how often the GPUs a process works on are learned again


def _local_rank(env: Any) -> int | None:
    value = str(env.get("LOCAL_RANK", ""))
    return int(value) if value.isdigit() else None


def unavailable_reason(err: Exception) -> str:
    name = type(err).__name__
    if "LibraryNotFound" in name:
        return "NVML library not found (libnvidia-ml.so.1: no NVIDIA driver installed)"
    if "DriverNotLoaded" in name:
        return "NVIDIA driver not loaded"
    if "NoPermission" in name:
        return "no permission to use NVML"
    return f"NVML failed: {err}"


class Steady:
    """When the next sample is due: at a steady rate from the first (no
    drift); one that fell behind (a slow NVML call) waits a whole interval,
    never a burst to catch up."""

    def __init__(self) -> None:
        self.next_at: float | None = None  # monotonic s

    def begin(self) -> None:
        """A sample begins: the first starts the schedule."""
        if self.next_at is None:
            self.next_at = time.monotonic()

    def after(self, interval: float) -> float:
        """Seconds from now until the sample after the last, ``interval`` on."""
        now = time.monotonic()
        self.next_at = (self.next_at or now) + interval
        if self.next_at < now:
            self.next_at = now + interval
        return self.next_at - now


class GpuSampler:
    """One per probe (``ProbeContext.nvml``); ``start(interval)`` / ``stop()``;
    safe to call repeatedly."""

    def __init__(
        self,
        store: Store,
        environ: Callable[[], Any] = lambda: os.environ,
        pid: int | None = None,
    ) -> None:
        self.store = store
        self.environ = environ  # the sampled process's (its CUDA_VISIBLE_DEVICES)
        self.pid = pid  # the sampled process (None: not one process, every GPU its own)
        self._own: tuple[float, set[int]] = (0.0, set())  # when learned, the indices
        self.table = store.table(SCHEMA, "gpu", GPU_SCHEMA)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._steady = Steady()
        self._nvml: Any = None
        self._handles: list[tuple[int, str, Any]] = []  # (index, uuid, handle) sampled
        self._events: Any = None
        self._throttle: Any = None  # NVML's function, chosen once NVML is loaded (as _nvml)
        self.devices: list[dict[str, Any]] = []
        self.state = "stopped"
        self.reason: str | None = "not started (probing nvml --pid P --interval 100ms)"
        self.driver: str | None = None
        self.interval_s: float | None = None
        self.samples = 0
        self.errors = 0
        self.last_error: str | None = None
        self.unsupported: set[str] = set()
        self._worker = self._sampling()

    # --- lifecycle ------------------------------------------------------------------------
    def start(self, interval_s: float) -> None:
        with self._lock:
            self.interval_s = interval_s
            self._worker.every_s = interval_s or 0.1
            if self._worker.running:
                return  # a running sampler picks the new interval up
            if not self._open():
                return
            self._stop.clear()
            self.state, self.reason = "sampling", None
            self._steady = Steady()
            self._worker.start()

    def _sampling(self) -> Worker:
        """The sampling thread: a sample at once, then every ``interval_s``
        (``Steady``); a bug in a sample is counted, and logged once."""
        return Worker(
            "probing-nvml", self._turn, self.interval_s or 0.1, at_once=True,
            sooner=lambda: self._steady.after(self.interval_s or 0.1),
            what="NVML sampling", event=self._stop,
            on_error=lambda err: self._note(err, "sample"),  # NVML's own: counted in _call
        )  # fmt: skip

    def stop(self) -> None:
        with self._lock:  # after a start() in progress, not lost in it
            self._stop.set()
        self._worker.stop(timeout=5)
        if self.state == "sampling":
            self.state, self.reason = "stopped", "stopped on request"

    def _open(self) -> bool:
        """Load NVML and learn the devices; False (with a reason) when there are none."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except (ImportError, OSError) as err:  # pynvml or libnvidia-ml missing
            self.state, self.reason = "unavailable", unavailable_reason(err)
            return False
        except pynvml.NVMLError as err:  # no driver, no GPU
            self.state, self.reason = "unavailable", unavailable_reason(err)
            return False
        nv = self._nvml = pynvml
        self._throttle = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        self.driver = _text(self._call(nv.nvmlSystemGetDriverVersion, "driver"))
        count = self._call(nv.nvmlDeviceGetCount, "count") or 0
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        uuids = [_text(self._call(nv.nvmlDeviceGetUUID, "uuid", h)) or "" for h in handles]
        chosen = visible_indices(count, uuids, self._visible())
        self.devices = [self._describe(i, uuids[i], h, i in chosen) for i, h in enumerate(handles)]
        self._handles = [(i, uuids[i], handles[i]) for i in chosen]
        if not self._handles:
            why = "no NVIDIA GPU found" if not count else "CUDA_VISIBLE_DEVICES hides every GPU"
            self.state, self.reason = "unavailable", why
            return False
        try:
            self._events = nv.nvmlEventSetCreate()
            for _, _, h in self._handles:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._events)
        except nv.NVMLError as err:
            self._note(err, "xid")
            self._events = None
        return True

    def _describe(self, index: int, uuid: str, h: Any, sampled: bool) -> dict[str, Any]:
        nv = self._nvml
        pci = self._call(nv.nvmlDeviceGetPciInfo, "pci", h)
        mem = self._call(nv.nvmlDeviceGetMemoryInfo, "memory", h)
        links = self._fields(h, [nv.NVML_FI_DEV_NVLINK_LINK_COUNT], "nvlink")[0]
        return {
            "gpu": index,
            "uuid": uuid,
            "name": _text(self._call(nv.nvmlDeviceGetName, "name", h)),
            "pci_bus_id": _text(pci.busId) if pci is not None else None,
            "driver": self.driver,
            "mem_total": mem.total if mem is not None else None,
            "nvlink_count": links,
            "sampled": sampled,
        }

    # --- sampling ---------------------------------------------------------------------------
    def _loop(self) -> None:
        """The sampling loop, on the calling thread (``start`` runs it on
        ``probing-nvml``): until ``_stop`` is set."""
        self._worker.run()

    def _turn(self) -> None:
        self._steady.begin()
        self.sample()

    def sample(self) -> int:
        """Read every sampled GPU once; append the rows; returns how many."""
        nv = self._nvml
        xids = self._drain_xids()
        cols: dict[str, list[Any]] = {f.name: [] for f in GPU_SCHEMA}
        ts = time.time_ns()
        fields = [
            nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
            nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        ]
        own = self._owned()
        for index, uuid, h in self._handles:
            util = self._call(nv.nvmlDeviceGetUtilizationRates, "utilization", h)
            mem = self._call(nv.nvmlDeviceGetMemoryInfo, "memory", h)
            power = self._call(nv.nvmlDeviceGetPowerUsage, "power", h)
            tx, rx = self._fields(h, fields, "nvlink")
            seen = xids.get(index, [])
            row = {
                "ts": ts,
                "gpu": index,
                "uuid": uuid,
                "util_gpu": util.gpu if util is not None else None,
                "util_mem": util.memory if util is not None else None,
                "mem_used": mem.used if mem is not None else None,
                "mem_total": mem.total if mem is not None else None,
                "power_w": power / 1000.0 if power is not None else None,
                "temp_c": self._call(
                    nv.nvmlDeviceGetTemperature, "temp", h, nv.NVML_TEMPERATURE_GPU
                ),
                "sm_clock_mhz": self._call(
                    nv.nvmlDeviceGetClockInfo, "clocks", h, nv.NVML_CLOCK_SM
                ),
                "mem_clock_mhz": self._call(
                    nv.nvmlDeviceGetClockInfo, "clocks", h, nv.NVML_CLOCK_MEM
                ),
                "pcie_tx_kbs": self._call(
                    nv.nvmlDeviceGetPcieThroughput, "pcie", h, nv.NVML_PCIE_UTIL_TX_BYTES
                ),
                "pcie_rx_kbs": self._call(
                    nv.nvmlDeviceGetPcieThroughput, "pcie", h, nv.NVML_PCIE_UTIL_RX_BYTES
                ),
                "nvlink_tx_kib": tx,
                "nvlink_rx_kib": rx,
                "throttle_reasons": self._call(self._throttle, "throttle", h),
                "ecc_uncorrected": self._call(
                    nv.nvmlDeviceGetTotalEccErrors,
                    "ecc",
                    h,
                    nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    nv.NVML_VOLATILE_ECC,
                ),
                "xid": seen[-1] if seen else None,
                "xid_count": len(seen),
                "own": index in own,
            }
            for name, value in row.items():
                cols[name].append(value)
        self.table.append_batch(pa.RecordBatch.from_pydict(cols, schema=GPU_SCHEMA))
        self.samples += 1
        return len(self._handles)

    def _owned(self) -> set[int]:
        """The sampled GPUs the process works on, learned again every
        ``OWN_EVERY_S``: those whose NVML process list has its pid (once it
        made a CUDA context); else the ``LOCAL_RANK``-th (torchrun, Lightning:
        every GPU visible, one per rank); else every one."""
        at, own = self._own
        now = time.monotonic()
        if own and now - at < OWN_EVERY_S:
            return own
        sampled = [i for i, _, _ in self._handles]
        own = set()
        if self.pid is not None:
            for index, _, h in self._handles:
                procs = self._call(self._nvml.nvmlDeviceGetComputeRunningProcesses, "procs", h)
                if any(p.pid == self.pid for p in procs or ()):
                    own.add(index)
            if not own:
                local = _local_rank(self._environ())
                if local is not None and local < len(sampled):
                    own = {sampled[local]}
        self._own = (now, own or set(sampled))
        return self._own[1]

    def _environ(self) -> Any:
        try:
            return self.environ()
        except ProbingError:  # the process is gone
            return {}

    def _drain_xids(self) -> dict[int, list[int]]:
        if self._events is None:
            return {}
        nv = self._nvml
        index_of = {_addr(h): i for i, _, h in self._handles}
        out: dict[int, list[int]] = {}
        for _ in range(64):  # bounded: a storm of events never stalls sampling
            try:
                data = nv.nvmlEventSetWait(self._events, 0)
            except nv.NVMLError_Timeout:
                break
            except nv.NVMLError as err:
                self._note(err, "xid")
                break
            idx = index_of.get(_addr(data.device), -1)
            out.setdefault(idx, []).append(int(data.eventData))
        return out

    def _visible(self) -> str | None:
        visible: str | None = self._environ().get("CUDA_VISIBLE_DEVICES")
        return visible  # gone: every GPU, as CUDA would see

    def _call(self, fn: Callable[..., Any], what: str, *args: Any) -> Any:
        """``fn(*args)``, or None: unsupported counters quietly, errors counted."""
        if what in self.unsupported:
            return None
        try:
            return fn(*args)
        except (self._nvml.NVMLError, OSError) as err:  # what NVML (through ctypes) raises
            name = type(err).__name__
            if "NotSupported" in name or "FunctionNotFound" in name:
                self.unsupported.add(what)
            else:
                self._note(err, what)
            return None

    def _fields(self, h: Any, ids: list[int], what: str) -> list[int | None]:
        values = self._call(self._nvml.nvmlDeviceGetFieldValues, what, h, ids)
        if values is None:
            return [None] * len(ids)
        out: list[int | None] = []
        for v in values:
            if v.nvmlReturn == 0:
                out.append(int(v.value.ullVal))
            else:
                if v.nvmlReturn == self._nvml.NVML_ERROR_NOT_SUPPORTED:
                    self.unsupported.add(what)
                out.append(None)
        return out

    def _note(self, err: Exception, what: str) -> None:
        self.errors += 1
        self.last_error = f"{what}: {err}"

    # --- tables -------------------------------------------------------------------------------
    def status_table(self) -> pa.Table:
        row = {
            "state": self.state,
            "reason": self.reason,
            "driver": self.driver,
            "devices": len(self.devices),
            "sampled": len(self._handles),
            "interval_s": self.interval_s,
            "samples": self.samples,
            "errors": self.errors,
            "last_error": self.last_error,
            "unsupported": ",".join(sorted(self.unsupported)) or None,
        }
        return pa.Table.from_pylist([row], schema=STATUS_SCHEMA)

    def devices_table(self) -> pa.Table:
        return pa.Table.from_pylist(self.devices, schema=DEVICE_SCHEMA)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _addr(handle: Any) -> int | None:
    import ctypes

    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None
