"""The bpf() and perf_event_open() system calls, through ctypes.

What BCC 0.26 has no API for: loading a program with an expected attach
type, multi-uprobe links (``BPF_TRACE_UPROBE_MULTI``, Linux >= 6.6: one link
and one RCU grace period at detach for many uprobes), maps created from a
cached spec, and reading links back (``uprobe_links``). The struct layouts
below are ``union bpf_attr``, ``struct bpf_map_info``, ``struct
bpf_link_info`` and ``struct perf_event_attr`` of the kernel's UAPI
(include/uapi/linux/bpf.h, perf_event.h), cut after the last field we use:
the kernel takes a shorter attr and reads the rest as zeros.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import platform
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ctypes import _CData as CData  # typeshed's base of every ctypes value

# system call numbers
_SYSCALLS = {"x86_64": (321, 298), "aarch64": (280, 241)}  # (bpf, perf_event_open)

# enum bpf_cmd
MAP_CREATE = 0
MAP_LOOKUP_ELEM = 1
MAP_UPDATE_ELEM = 2
MAP_DELETE_ELEM = 3
MAP_GET_NEXT_KEY = 4
PROG_LOAD = 5
PROG_TEST_RUN = 10
OBJ_GET_INFO_BY_FD = 15
RAW_TRACEPOINT_OPEN = 17
MAP_LOOKUP_BATCH = 24  # kernels >= 5.6
MAP_LOOKUP_AND_DELETE_BATCH = 25
LINK_CREATE = 28
LINK_GET_FD_BY_ID = 30
LINK_GET_NEXT_ID = 31

PROG_TYPE_KPROBE = 2  # uprobes are kprobe-type programs
PROG_TYPE_TRACEPOINT = 5
PROG_TYPE_PERF_EVENT = 7
PROG_TYPE_RAW_TRACEPOINT = 17
MAP_TYPE_PROG_ARRAY = 3
TRACE_UPROBE_MULTI = 48  # enum bpf_attach_type
LINK_TYPE_UPROBE_MULTI = 12  # enum bpf_link_type
F_UPROBE_MULTI_RETURN = 1
PSEUDO_MAP_FD = 1  # src_reg of a ld_imm64 that loads a map by fd
F_TEST_RUN_ON_CPU = 1

PERF_TYPE_SOFTWARE = 1
PERF_TYPE_TRACEPOINT = 2
PERF_COUNT_SW_CPU_CLOCK = 0
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_SET_BPF = 0x40042408
PERF_FLAG_FD_CLOEXEC = 8

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class BPFError(OSError):
    """A failed bpf() or perf_event_open() call (``errno`` set)."""


class MapCreateAttr(ctypes.Structure):
    _fields_ = [
        ("map_type", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("inner_map_fd", ctypes.c_uint32),
        ("numa_node", ctypes.c_uint32),
        ("map_name", ctypes.c_char * 16),
    ]


class MapBatchAttr(ctypes.Structure):
    _fields_ = [
        ("in_batch", ctypes.c_uint64),
        ("out_batch", ctypes.c_uint64),
        ("keys", ctypes.c_uint64),
        ("values", ctypes.c_uint64),
        ("count", ctypes.c_uint32),
        ("map_fd", ctypes.c_uint32),
        ("elem_flags", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
    ]


class MapElemAttr(ctypes.Structure):
    _fields_ = [
        ("map_fd", ctypes.c_uint32),
        ("key", ctypes.c_uint64),
        ("value", ctypes.c_uint64),  # next_key for MAP_GET_NEXT_KEY
        ("flags", ctypes.c_uint64),
    ]


class ProgLoadAttr(ctypes.Structure):
    _fields_ = [
        ("prog_type", ctypes.c_uint32),
        ("insn_cnt", ctypes.c_uint32),
        ("insns", ctypes.c_uint64),
        ("license", ctypes.c_uint64),
        ("log_level", ctypes.c_uint32),
        ("log_size", ctypes.c_uint32),
        ("log_buf", ctypes.c_uint64),
        ("kern_version", ctypes.c_uint32),
        ("prog_flags", ctypes.c_uint32),
        ("prog_name", ctypes.c_char * 16),
        ("prog_ifindex", ctypes.c_uint32),
        ("expected_attach_type", ctypes.c_uint32),
    ]


class InfoAttr(ctypes.Structure):
    _fields_ = [
        ("bpf_fd", ctypes.c_uint32),
        ("info_len", ctypes.c_uint32),
        ("info", ctypes.c_uint64),
    ]


class RawTracepointAttr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_uint64), ("prog_fd", ctypes.c_uint32)]


class TestRunAttr(ctypes.Structure):
    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("data_in", ctypes.c_uint64),
        ("data_out", ctypes.c_uint64),
        ("repeat", ctypes.c_uint32),
        ("duration", ctypes.c_uint32),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_uint64),
        ("ctx_out", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
    ]


class IdAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("next_id", ctypes.c_uint32)]


class LinkCreateUprobeMultiAttr(ctypes.Structure):
    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("target_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("path", ctypes.c_uint64),
        ("offsets", ctypes.c_uint64),
        ("ref_ctr_offsets", ctypes.c_uint64),
        ("cookies", ctypes.c_uint64),
        ("cnt", ctypes.c_uint32),
        ("uprobe_flags", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
    ]


class MapInfo(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
    ]


class LinkInfoUprobeMulti(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("prog_id", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
        ("path", ctypes.c_uint64),
        ("offsets", ctypes.c_uint64),
        ("ref_ctr_offsets", ctypes.c_uint64),
        ("cookies", ctypes.c_uint64),
        ("path_size", ctypes.c_uint32),
        ("count", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
    ]


class PerfEventAttr(ctypes.Structure):  # PERF_ATTR_SIZE_VER1
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32),
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),  # uprobe_path
        ("config2", ctypes.c_uint64),  # probe_offset
    ]


def _numbers() -> tuple[int, int]:
    try:
        return _SYSCALLS[platform.machine()]
    except KeyError:
        raise BPFError(errno.ENOSYS, f"no bpf() syscall number for {platform.machine()}") from None


def bpf(cmd: int, attr: ctypes.Structure) -> int:
    """One bpf() call; raises ``BPFError`` with the errno."""
    ret = _libc.syscall(
        ctypes.c_long(_numbers()[0]),
        ctypes.c_int(cmd),
        ctypes.byref(attr),
        ctypes.c_uint(ctypes.sizeof(attr)),
    )
    if ret < 0:
        err = ctypes.get_errno()
        raise BPFError(err, f"bpf({cmd}): {os.strerror(err)}")
    return int(ret)


# -- maps ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MapSpec:
    """What it takes to create a map again (from ``map_info``)."""

    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int


def map_info(fd: int) -> MapSpec:
    info = MapInfo()
    attr = InfoAttr(fd, ctypes.sizeof(info), ctypes.addressof(info))
    bpf(OBJ_GET_INFO_BY_FD, attr)
    return MapSpec(
        info.name.decode(), info.type, info.key_size, info.value_size, info.max_entries,
        info.map_flags,
    )  # fmt: skip


def map_create(spec: MapSpec) -> int:
    attr = MapCreateAttr(
        spec.type, spec.key_size, spec.value_size, spec.max_entries, spec.flags, 0, 0,
        spec.name.encode()[:15],
    )  # fmt: skip
    try:
        return bpf(MAP_CREATE, attr)
    except BPFError as err:
        raise BPFError(err.errno, f"cannot create BPF map {spec.name}: {err.strerror}") from None


def map_lookup(fd: int, key: CData, value: CData) -> bool:
    attr = MapElemAttr(fd, ctypes.addressof(key), ctypes.addressof(value), 0)
    try:
        bpf(MAP_LOOKUP_ELEM, attr)
    except BPFError as err:
        if err.errno == errno.ENOENT:
            return False
        raise
    return True


def map_update(fd: int, key: CData, value: CData, flags: int = 0) -> None:
    bpf(MAP_UPDATE_ELEM, MapElemAttr(fd, ctypes.addressof(key), ctypes.addressof(value), flags))


def map_delete(fd: int, key: CData) -> bool:
    try:
        bpf(MAP_DELETE_ELEM, MapElemAttr(fd, ctypes.addressof(key), 0, 0))
    except BPFError as err:
        if err.errno == errno.ENOENT:
            return False
        raise
    return True


def map_lookup_batch(
    fd: int, key_size: int, value_size: int, count: int, *, delete: bool = False
) -> tuple[bytes, bytes]:
    """Every entry of a hash map, ``count`` at a time, in a few bpf() calls
    (BPF_MAP_LOOKUP_BATCH) where reading it key by key takes two per entry:
    the keys and the values, packed; ``delete``: each entry deleted as it is
    read (BPF_MAP_LOOKUP_AND_DELETE_BATCH). ``BPFError`` where the kernel has
    no batch operations (EINVAL before 5.6): the caller reads it key by key."""
    count = max(count, 1)
    token = max(key_size, 8)  # the position between calls: opaque, a key's size at most
    at, after = ctypes.create_string_buffer(token), ctypes.create_string_buffer(token)
    out_keys, out_values = bytearray(), bytearray()
    start = True
    while True:
        keys = ctypes.create_string_buffer(key_size * count)
        values = ctypes.create_string_buffer(value_size * count)
        attr = MapBatchAttr(
            0 if start else ctypes.addressof(at), ctypes.addressof(after),
            ctypes.addressof(keys), ctypes.addressof(values), count, fd, 0, 0,
        )  # fmt: skip
        try:
            bpf(MAP_LOOKUP_AND_DELETE_BATCH if delete else MAP_LOOKUP_BATCH, attr)
            done = False
        except BPFError as err:
            if err.errno == errno.ENOSPC:  # one bucket holds more than count: that
                count *= 2  # bucket again (nothing of it was read), room for it
                continue
            if err.errno != errno.ENOENT:
                raise
            done = True  # the last entries (count of them) came with the end
        out_keys += keys.raw[: attr.count * key_size]
        out_values += values.raw[: attr.count * value_size]
        if done or attr.count == 0:
            return bytes(out_keys), bytes(out_values)
        ctypes.memmove(at, after, token)
        start = False


def map_next_key(fd: int, key: CData | None, next_key: CData) -> bool:
    """``key`` None: the first key. False at the end."""
    attr = MapElemAttr(
        fd, ctypes.addressof(key) if key is not None else 0, ctypes.addressof(next_key), 0
    )
    try:
        bpf(MAP_GET_NEXT_KEY, attr)
    except BPFError as err:
        if err.errno == errno.ENOENT:
            return False
        raise
    return True


# -- programs -----------------------------------------------------------------------


def prog_load(
    name: str,
    insns: bytes,
    *,
    prog_type: int = PROG_TYPE_KPROBE,
    license: bytes = b"GPL",
    kern_version: int = 0,
    expected_attach_type: int = 0,
) -> int:
    """Load a program (a kprobe-type one unless told); the verifier's log is
    in the error."""
    buf = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license)
    attr = ProgLoadAttr(
        prog_type=prog_type,
        insn_cnt=len(insns) // 8,
        insns=ctypes.addressof(buf),
        license=ctypes.addressof(lic),
        kern_version=kern_version,
        prog_name=name.encode()[:15],
        expected_attach_type=expected_attach_type,
    )
    try:
        return bpf(PROG_LOAD, attr)
    except BPFError as first:
        log = ctypes.create_string_buffer(1 << 20)
        attr.log_level, attr.log_size, attr.log_buf = 1, len(log), ctypes.addressof(log)
        try:
            return bpf(PROG_LOAD, attr)  # loads with the log on: a transient failure
        except BPFError:
            tail = log.value.decode(errors="replace")[-2000:]
            raise BPFError(
                first.errno, f"the kernel refused BPF program {name}: {first.strerror}\n{tail}"
            ) from None


def uprobe_multi_link(
    prog_fd: int, path: str, offsets: list[int], cookies: list[int], pid: int, ret: bool
) -> int:
    """One link attaching ``prog_fd`` at every file offset of ``path`` (uretprobes
    when ``ret``), each with its cookie (``bpf_get_attach_cookie``), for ``pid``."""
    n = len(offsets)
    c_path = ctypes.create_string_buffer(path.encode())
    c_offs = (ctypes.c_uint64 * n)(*offsets)
    c_cookies = (ctypes.c_uint64 * n)(*cookies)
    attr = LinkCreateUprobeMultiAttr(
        prog_fd=prog_fd,
        attach_type=TRACE_UPROBE_MULTI,
        path=ctypes.addressof(c_path),
        offsets=ctypes.addressof(c_offs),
        cookies=ctypes.addressof(c_cookies),
        cnt=n,
        uprobe_flags=F_UPROBE_MULTI_RETURN if ret else 0,
        pid=pid,
    )
    return bpf(LINK_CREATE, attr)


@dataclasses.dataclass(frozen=True)
class UprobeLink:
    id: int
    prog_id: int
    pid: int
    path: str
    count: int
    ret: bool


def uprobe_links() -> list[UprobeLink]:
    """Every multi-uprobe link on the system (root), with its pid and file."""
    out: list[UprobeLink] = []
    ids = IdAttr(0, 0)
    while True:
        try:
            bpf(LINK_GET_NEXT_ID, ids)
        except BPFError as err:
            if err.errno == errno.ENOENT:
                return out
            raise
        ids.id = ids.next_id
        try:
            fd = bpf(LINK_GET_FD_BY_ID, IdAttr(ids.id, 0))
        except BPFError:  # gone meanwhile
            continue
        try:
            path = ctypes.create_string_buffer(4096)
            info = LinkInfoUprobeMulti(path=ctypes.addressof(path), path_size=len(path))
            bpf(OBJ_GET_INFO_BY_FD, InfoAttr(fd, ctypes.sizeof(info), ctypes.addressof(info)))
            if info.type == LINK_TYPE_UPROBE_MULTI:
                out.append(
                    UprobeLink(
                        info.id,
                        info.prog_id,
                        info.pid,
                        path.value.decode(errors="replace"),
                        info.count,
                        bool(info.flags & F_UPROBE_MULTI_RETURN),
                    )  # fmt: skip
                )
        except BPFError:
            pass
        finally:
            os.close(fd)


# -- perf-event uprobes (kernels without multi-uprobe links) ----------------------------


def _pmu() -> tuple[int, int]:
    """The uprobe PMU's type and the config bit that makes a uretprobe."""
    base = "/sys/bus/event_source/devices/uprobe"
    with open(f"{base}/type") as f:
        kind = int(f.read())
    with open(f"{base}/format/retprobe") as f:
        bit = int(f.read().strip().split(":")[1])  # "config:0"
    return kind, bit


def perf_event_bpf(prog_fd: int, attr: PerfEventAttr, pid: int, cpu: int, what: str) -> int:
    """A perf event opened from ``attr`` for ``pid`` on ``cpu`` (-1: any),
    running ``prog_fd`` at each of its samples or hits."""
    attr.size = ctypes.sizeof(PerfEventAttr)
    fd = _libc.syscall(
        ctypes.c_long(_numbers()[1]), ctypes.byref(attr), ctypes.c_int(pid), ctypes.c_int(cpu),
        ctypes.c_int(-1), ctypes.c_ulong(PERF_FLAG_FD_CLOEXEC),
    )  # fmt: skip
    if fd < 0:
        err = ctypes.get_errno()
        raise BPFError(err, f"perf_event_open({what}): {os.strerror(err)}")
    for request, arg in ((PERF_EVENT_IOC_SET_BPF, prog_fd), (PERF_EVENT_IOC_ENABLE, 0)):
        if _libc.ioctl(ctypes.c_int(fd), ctypes.c_ulong(request), ctypes.c_int(arg)) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise BPFError(err, f"attaching to {what}: {os.strerror(err)}")
    return int(fd)


def perf_uprobe(prog_fd: int, path: str, offset: int, pid: int, ret: bool) -> int:
    """A uprobe perf event at ``path``+``offset`` for ``pid``, running ``prog_fd``."""
    kind, bit = _pmu()
    c_path = ctypes.create_string_buffer(path.encode())
    attr = PerfEventAttr(
        type=kind, config=(1 << bit) if ret else 0, sample_period=1, wakeup_events=1,
        config1=ctypes.addressof(c_path), config2=offset,
    )  # fmt: skip
    return perf_event_bpf(prog_fd, attr, pid, -1, f"uprobe {path}+{offset:#x}")


def cpu_clock(prog_fd: int, cpu: int, period_ns: int) -> int:
    """A CPU-clock sampling event on ``cpu`` (every task), running ``prog_fd``
    every ``period_ns`` of that CPU's time."""
    attr = PerfEventAttr(
        type=PERF_TYPE_SOFTWARE, config=PERF_COUNT_SW_CPU_CLOCK, sample_period=period_ns
    )
    return perf_event_bpf(prog_fd, attr, -1, cpu, f"cpu-clock on CPU {cpu}")


def tracepoint_id(category: str, name: str) -> int:
    """The perf id of a tracepoint (tracefs ``events/<category>/<name>/id``)."""
    from probing import checks

    base = checks.tracefs_dir() or "/sys/kernel/tracing"
    path = os.path.join(base, "events", category, name, "id")
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError) as err:
        raise BPFError(errno.ENOENT, f"no tracepoint {category}:{name} ({path}: {err})") from None


def tracepoint_field(category: str, name: str, field: str) -> int:
    """The offset of ``field`` in a tracepoint's record (its tracefs ``format``)."""
    from probing import checks

    base = checks.tracefs_dir() or "/sys/kernel/tracing"
    path = os.path.join(base, "events", category, name, "format")
    try:
        with open(path) as f:
            text = f.read()
    except OSError as err:
        raise BPFError(errno.ENOENT, f"no tracepoint {category}:{name} ({path}: {err})") from None
    for line in text.splitlines():  # "field:pid_t pid;	offset:24;	size:4;	signed:1;"
        parts = dict(p.strip().split(":", 1) for p in line.split(";") if ":" in p)
        decl = parts.get("field", "").split()
        if decl and decl[-1] == field and "offset" in parts:
            return int(parts["offset"])
    raise BPFError(errno.ENOENT, f"tracepoint {category}:{name} has no field {field}")


def tracepoint(prog_fd: int, category: str, name: str) -> int:
    """A tracepoint perf event running ``prog_fd`` at every hit, on every CPU
    (the program hangs on the tracepoint, not on the CPU it was opened on)."""
    attr = PerfEventAttr(
        type=PERF_TYPE_TRACEPOINT, config=tracepoint_id(category, name), sample_period=1,
        wakeup_events=1,
    )  # fmt: skip
    return perf_event_bpf(prog_fd, attr, -1, 0, f"tracepoint {category}:{name}")


def raw_tracepoint(prog_fd: int, name: str) -> int:
    """A raw tracepoint link (``BPF_RAW_TRACEPOINT_OPEN``) running ``prog_fd``."""
    c_name = ctypes.create_string_buffer(name.encode())
    try:
        return bpf(RAW_TRACEPOINT_OPEN, RawTracepointAttr(ctypes.addressof(c_name), prog_fd))
    except BPFError as err:
        raise BPFError(err.errno, f"raw tracepoint {name}: {err.strerror}") from None


def run_on_cpu(prog_fd: int, cpu: int) -> int:
    """Run a raw-tracepoint program once on ``cpu`` (``BPF_PROG_TEST_RUN``,
    Linux >= 5.10: an IPI to another CPU); its return value."""
    attr = TestRunAttr(prog_fd=prog_fd, flags=F_TEST_RUN_ON_CPU, cpu=cpu)
    bpf(PROG_TEST_RUN, attr)
    return int(attr.retval)


def online_cpus() -> list[int]:
    """The online CPUs ("0-3,6")."""
    try:
        with open("/sys/devices/system/cpu/online") as f:
            text = f.read().strip()
    except OSError:
        return list(range(os.cpu_count() or 1))
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def iter_insns(insns: bytes) -> Iterator[tuple[int, int, int, int]]:
    """(index, opcode, src_reg, imm) of each 8-byte instruction."""
    for i in range(len(insns) // 8):
        op = insns[8 * i]
        regs = insns[8 * i + 1]
        imm = int.from_bytes(insns[8 * i + 4 : 8 * i + 8], "little", signed=True)
        yield i, op, regs >> 4, imm
