"""Build a family's BPF program once per node, then load and attach it fast.

BCC compiles (clang, seconds of CPU); the kernel only needs the bytecode.
``obtain()`` compiles ``bpf/preamble.c`` + ``bpf/<family>.bpf.c`` with BCC
once per (sources, -D flags, kernel, BCC) and keeps what came out in a
cache file: each program's instructions with its map references turned
back into map numbers, and each map's spec and C types (as BCC describes
them). Eight ranks that start tracing together take a file lock: one
compiles, the others read its result. ``Program`` then creates the maps and
loads the programs with plain bpf() calls (``kernel``), in milliseconds.

Attaching: where the kernel has multi-uprobe links (Linux >= 6.6), one link
per library and direction runs ``probing_dispatch`` at every probed function
and the attach cookie names the handler it tail-calls: a few links, each
paying one RCU grace period when it goes (at stop, or when the process
exits), instead of one per uprobe. Functions probed at entry only (kernel
launches, asynchronous copies: the hot ones) get a link per handler that
runs it directly, without the tail call (``link_groups``). Elsewhere each handler gets a perf-event
uprobe, whose release takes one grace period after another (under the
kernel's event_mutex, so threads do not help). Either way a small helper
process (``Holder``) keeps the only reference to each link or perf event and
lets go of them when the tracer stops or the traced process is gone: neither
a stop nor the process's exit waits for a grace period.

Every event dtype in ``families`` is checked, field by field (name, offset,
size), against BCC's description of the C struct when the program loads.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import functools
import hashlib
import importlib.resources
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from probing.errors import BPFUnavailable, ProbingError
from probing.node.bpf import kernel

FORMAT = 1  # of the cache files: bump when what they hold changes
DISPATCH = "probing_dispatch"
HANDLERS = 64  # slots of the dispatch program array (bpf/preamble.c)
CLOSE_THREADS = 16
ENV_CACHE = "PROBING_BPF_CACHE"  # where compiled programs are kept
ENV_MULTI = "PROBING_UPROBE_MULTI"  # "0": single uprobes even where links exist
# one BCC compile at a time in a process (the tracer's families, the sampler):
# two at once in two threads crashed the process (LLVM, BCC's virtual files)
BCC_LOCK = threading.Lock()


@contextlib.contextmanager
def program_dir() -> Iterator[str]:
    """The directory of the installed bpf/*.bpf.c and headers."""
    ref = importlib.resources.files("probing.node.bpf") / "programs"
    with importlib.resources.as_file(ref) as path:
        yield str(path)


def cache_dir() -> str:
    from probing import config

    explicit = config.load().bpf_cache.strip()
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "probing", "bpf")


# -- C types as BCC describes them (JSON), to ctypes --------------------------------

_CTYPES = {
    "_Bool": ctypes.c_bool, "char": ctypes.c_char, "signed char": ctypes.c_byte,
    "unsigned char": ctypes.c_ubyte, "short": ctypes.c_short,
    "unsigned short": ctypes.c_ushort, "int": ctypes.c_int, "unsigned int": ctypes.c_uint,
    "long": ctypes.c_long, "unsigned long": ctypes.c_ulong, "long long": ctypes.c_longlong,
    "unsigned long long": ctypes.c_ulonglong, "float": ctypes.c_float,
    "double": ctypes.c_double, "__int128": ctypes.c_int64 * 2,
    "unsigned __int128": ctypes.c_uint64 * 2,
}  # fmt: skip


def ctype_of(desc: Any) -> Any:
    """A ctypes type from BCC's JSON type description (``bpf_table_leaf_desc``):
    a type name, or ``[name, [[field, type, ([n] | bits | kind)]...], kind]``."""
    if isinstance(desc, str):
        try:
            return _CTYPES[desc]
        except KeyError:
            raise ProbingError(f"unknown C type {desc!r} in a BPF map description") from None
    fields: list[tuple[Any, ...]] = []
    for i, member in enumerate(desc[1]):
        name, sub = member[0] or f"_anon{i}", member[1]
        if len(member) == 3 and isinstance(member[2], list):
            fields.append((name, ctype_of(sub) * member[2][0]))
        elif len(member) == 3 and isinstance(member[2], int):
            fields.append((name, ctype_of(sub), member[2]))
        elif len(member) == 3:  # a nested struct or union, described in place
            fields.append((name, ctype_of(member)))
        else:
            fields.append((name, ctype_of(sub)))
    kind = desc[2] if len(desc) > 2 else "struct"
    base = ctypes.Union if kind == "union" else ctypes.Structure
    attrs: dict[str, Any] = {"_fields_": fields}
    if kind == "struct_packed":
        attrs["_pack_"] = 1
    return type(str(desc[0]) or "anon", (base,), attrs)


def c_fields(ctype: Any, base: int = 0, prefix: str = "") -> list[tuple[str, int, int]]:
    """(name, offset, size) of every leaf field, nested structs flattened
    (a nested struct's fields keep their own names)."""
    out = []
    for f in ctype._fields_:
        name, sub = f[0], f[1]
        off = getattr(ctype, name).offset + base
        if isinstance(sub, type) and issubclass(sub, ctypes.Structure | ctypes.Union):
            out += c_fields(sub, off)
        else:
            out.append((prefix + name, off, ctypes.sizeof(sub)))
    return out


def dtype_fields(dtype: np.dtype) -> list[tuple[str, int, int]]:
    assert dtype.fields is not None
    return sorted(
        ((name, off, dt.itemsize) for name, (dt, off, *_) in dtype.fields.items()),
        key=lambda f: f[1],
    )


def check_dtype(what: str, dtype: np.dtype, ctype: Any) -> None:
    """``dtype`` must mirror ``ctype`` field by field: name, offset, size."""
    c, py = c_fields(ctype), dtype_fields(dtype)
    if c != py or ctypes.sizeof(ctype) != dtype.itemsize:
        diff = [f"C {a} / numpy {b}" for a, b in zip(c, py, strict=False) if a != b]
        if len(c) != len(py):
            diff.append(f"{len(c)} fields in C, {len(py)} in numpy")
        raise ProbingError(
            f"{what}: the numpy dtype in probing/node/bpf/families.py does not mirror the C "
            f"struct ({ctypes.sizeof(ctype)} bytes in C, {dtype.itemsize} in numpy): "
            + "; ".join(diff[:4])
            + "\nfix the dtype (name, offset and size of each field) to match the header\n"
        )


# -- what the compiler made ------------------------------------------------------------


@dataclasses.dataclass
class MapDef:
    spec: kernel.MapSpec
    key: Any  # BCC's JSON description of the key type, or None
    leaf: Any


@dataclasses.dataclass
class Compiled:
    """One family's program as compiled, ready to load anywhere on this node."""

    key: str
    license: str
    kern_version: int
    maps: list[MapDef]
    # name -> (instructions, [(insn index, map number)]) with each map fd zeroed
    programs: dict[str, tuple[bytes, list[tuple[int, int]]]]

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "key": self.key,
                "license": self.license,
                "kern_version": self.kern_version,
                "maps": [
                    {"spec": dataclasses.asdict(m.spec), "key": m.key, "leaf": m.leaf}
                    for m in self.maps
                ],
                "programs": {
                    n: [base64.b64encode(insns).decode(), relocs]
                    for n, (insns, relocs) in self.programs.items()
                },
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Compiled:
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"cache format {d.get('format')}, not {FORMAT}")
        return cls(
            d["key"],
            d["license"],
            d["kern_version"],
            [MapDef(kernel.MapSpec(**m["spec"]), m["key"], m["leaf"]) for m in d["maps"]],
            {
                n: (base64.b64decode(b), [(int(i), int(m)) for i, m in r])
                for n, (b, r) in d["programs"].items()
            },
        )

    def map(self, name: str) -> MapDef:
        return next(m for m in self.maps if m.spec.name == name)


def _bcc_identity() -> str:
    spec = importlib.util.find_spec("bcc")
    if spec is None or spec.origin is None:
        raise BPFUnavailable(
            "BCC's Python module (bcc) is not installed",
            hint="install python3-bpfcc (Debian/Ubuntu) or run `probing doctor`",
        )
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            return f.read()
    except OSError:
        return spec.origin


def cache_key(source: str, family_h: str | None, cflags: Iterable[str]) -> str:
    """Everything the bytecode depends on: the sources (every header too),
    the flags, the kernel, BCC."""
    h = hashlib.sha256(f"probing-bpf {FORMAT}\0".encode())
    with program_dir() as src:
        for name in sorted(os.listdir(src)):
            if name.endswith((".h", ".c")):
                with open(os.path.join(src, name), "rb") as f:
                    h.update(name.encode() + b"\0" + f.read() + b"\0")
    for part in (source, family_h or "-", *cflags, os.uname().release, os.uname().machine):
        h.update(part.encode() + b"\0")
    h.update(_bcc_identity().encode())
    return h.hexdigest()[:32]


def _compile(source: str, family_h: str | None, cflags: list[str], key: str) -> Compiled:
    """BCC compiles; we keep the bytecode with map numbers for map fds.
    ``family_h`` None: ``source`` alone, without the families' preamble."""
    from bcc import BPF
    from bcc.libbcc import lib

    with program_dir() as src:
        flags = [f"-I{src}"]
        text = ""
        if family_h is not None:
            with open(os.path.join(src, "preamble.c")) as f:
                text = f.read()
            flags += [f'-DPROBING_FAMILY_H="{family_h}"', f"-DPROBING_HANDLERS={HANDLERS}"]
        with open(os.path.join(src, source)) as f:
            text += f'\n#line 1 "{source}"\n' + f.read()
        try:
            with BCC_LOCK:
                bpf = BPF(text=text.encode(), cflags=[*flags, *cflags])
        except Exception as err:  # BCC raises plain Exception
            raise BPFUnavailable(
                f"BCC could not compile {source}: {err}",
                hint="run `probing doctor` to see what is missing",
            ) from err
    try:
        lib.bpf_num_tables.restype = ctypes.c_size_t
        lib.bpf_num_tables.argtypes = [ctypes.c_void_p]
        lib.bpf_table_name.restype = ctypes.c_char_p
        lib.bpf_table_name.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        maps: list[MapDef] = []
        by_fd: dict[int, int] = {}
        for i in range(lib.bpf_num_tables(bpf.module)):
            name = lib.bpf_table_name(bpf.module, i)
            fd = lib.bpf_table_fd(bpf.module, name)
            spec = dataclasses.replace(kernel.map_info(fd), name=name.decode())
            key_desc = lib.bpf_table_key_desc(bpf.module, name).decode() or "null"
            leaf_desc = lib.bpf_table_leaf_desc(bpf.module, name).decode() or "null"
            by_fd[fd] = len(maps)
            maps.append(MapDef(spec, json.loads(key_desc), json.loads(leaf_desc)))
        programs = {}
        for i in range(lib.bpf_num_functions(bpf.module)):
            name = lib.bpf_function_name(bpf.module, i).decode()
            insns = bytearray(bpf.dump_func(name.encode()))
            relocs = []
            for idx, op, src_reg, imm in kernel.iter_insns(bytes(insns)):
                if op != 0x18 or src_reg == 0:  # not a ld_imm64 of a map
                    continue
                if src_reg != kernel.PSEUDO_MAP_FD or imm not in by_fd:
                    raise ProbingError(
                        f"{source}: {name}: a map reference BCC made that the loader "
                        f"does not know (src_reg {src_reg})"
                    )
                relocs.append((idx, by_fd[imm]))
                insns[8 * idx + 4 : 8 * idx + 8] = bytes(4)
            programs[name] = (bytes(insns), relocs)
        license = (lib.bpf_module_license(bpf.module) or b"GPL").decode()
        return Compiled(key, license, lib.bpf_module_kern_version(bpf.module), maps, programs)
    finally:
        bpf.cleanup()


def obtain(source: str, family_h: str | None, cflags: list[str]) -> tuple[Compiled, bool]:
    """The compiled program, from the node's cache or compiled now (once:
    concurrent callers wait on a lock, then read). Also: whether it was cached.
    ``family_h``: the family's header, with the families' preamble in front;
    None for a program that stands alone (the sampler)."""
    key = cache_key(source, family_h, cflags)
    directory = cache_dir()
    path = os.path.join(directory, f"{source.removesuffix('.bpf.c')}-{key}.json")
    try:
        from probing.guest.place import ensure_private_dir

        ensure_private_dir(directory)
    except (OSError, ProbingError):
        return _compile(source, family_h, cflags, key), False  # no cache: compile each time
    cached = _read(path, key)
    if cached is not None:
        return cached, True
    lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(lock_fd) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            cached = _read(path, key)  # another process compiled it while we waited
            if cached is not None:
                return cached, True
            compiled = _compile(source, family_h, cflags, key)
            tmp = f"{path}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(compiled.to_json())
            os.replace(tmp, path)
            return compiled, False
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read(path: str, key: str) -> Compiled | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:  # bytecode we load as root
            return None
        with os.fdopen(fd) as f:
            fd = -1
            compiled = Compiled.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        if fd >= 0:
            os.close(fd)
    return compiled if compiled.key == key else None


# -- maps and programs in the kernel ----------------------------------------------------


class Map:
    """A BPF map by fd, with its C key and value types (BCC's ``Table`` subset
    the tracer uses: ``m[k]``, ``m[k] = v``, ``del m[k]``, ``items()``, ``clear()``)."""

    def __init__(self, fd: int, d: MapDef) -> None:
        self.map_fd = fd
        self.name = d.spec.name
        self.spec = d.spec
        # the ctypes types (None: BCC described none)
        self.Key: Any = ctype_of(d.key) if d.key is not None else None
        self.Leaf: Any = ctype_of(d.leaf) if d.leaf is not None else None
        self.batched = True  # BPF_MAP_LOOKUP_BATCH, until the kernel says it has none

    def __getitem__(self, key: Any) -> Any:
        leaf = self.Leaf()
        if not kernel.map_lookup(self.map_fd, key, leaf):
            raise KeyError(key)
        return leaf

    def __setitem__(self, key: Any, leaf: Any) -> None:
        kernel.map_update(self.map_fd, key, leaf)

    def __delitem__(self, key: Any) -> None:
        if not kernel.map_delete(self.map_fd, key):
            raise KeyError(key)

    def keys(self) -> list[Any]:
        out: list[Any] = []
        key = None
        while True:
            nxt = self.Key()
            if not kernel.map_next_key(self.map_fd, key, nxt):
                return out
            out.append(nxt)
            key = nxt

    def items(self) -> list[tuple[Any, Any]]:
        out = []
        for k in self.keys():
            try:
                out.append((k, self[k]))
            except KeyError:  # deleted meanwhile
                continue
        return out

    def arrays(
        self, *, delete: bool = False, count: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every entry as two numpy record arrays (keys, values: the C types'
        fields), read in a few bpf() calls (``kernel.map_lookup_batch``,
        ``count`` entries a call: the map's size by default), or key by key on
        a kernel without batch operations; ``delete``: each entry deleted as
        it is read (key by key: after it was)."""
        kd, vd = np.dtype(self.Key), np.dtype(self.Leaf)
        if self.batched:
            try:
                keys, values = kernel.map_lookup_batch(
                    self.map_fd, kd.itemsize, vd.itemsize, count or self.spec.max_entries,
                    delete=delete,
                )  # fmt: skip
                return np.frombuffer(keys, dtype=kd), np.frombuffer(values, dtype=vd)
            except kernel.BPFError as err:
                if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                self.batched = False  # this kernel has none: key by key from now on
        pairs = self.items()
        for k, _ in pairs if delete else ():
            with contextlib.suppress(KeyError):
                del self[k]
        keys = b"".join(bytes(k) for k, _ in pairs)
        values = b"".join(bytes(v) for _, v in pairs)
        return np.frombuffer(keys, dtype=kd), np.frombuffer(values, dtype=vd)

    def clear(self) -> None:
        for k in self.keys():
            with contextlib.suppress(KeyError):
                del self[k]


def has_uprobe_multi() -> bool:
    """Whether multi-uprobe links are used: the kernel has them, and
    ``PROBING_UPROBE_MULTI`` does not turn them off."""
    from probing import config

    if config.load().uprobe_multi.strip().lower() in config.FALSY:
        return False
    return kernel_has_uprobe_multi()


@functools.cache
def kernel_has_uprobe_multi() -> bool:
    """Whether this kernel has multi-uprobe links (libbpf's probe: a link on
    "/" fails with EBADF where the attach type exists). A fact about the
    running kernel, the same for the life of the process: cached, not state."""
    exit_now = bytes([0xB7, 0, 0, 0, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0])
    try:
        fd = kernel.prog_load(
            "probing_probe", exit_now, expected_attach_type=kernel.TRACE_UPROBE_MULTI
        )
    except kernel.BPFError:
        return False
    try:
        os.close(kernel.uprobe_multi_link(fd, "/", [0], [0], 0, False))
    except kernel.BPFError as err:
        return err.errno == errno.EBADF
    finally:
        os.close(fd)
    return True


@dataclasses.dataclass
class Attachment:
    """What one attach holds: its fds (links or perf events) and the handler,
    symbol and kind of each probe. A library's uprobes (``path``: the
    library), or the sampler's and the drain's tracepoints (``path`` names
    them, no probes)."""

    path: str
    fds: list[int]
    probes: list[tuple[str, str, str]]  # (handler, symbol, "entry" | "return")


class Uprobe(NamedTuple):
    """One probe to attach: the handler program, at ``symbol`` (its file
    ``offset``), on entry or on return (``ret``)."""

    handler: str
    symbol: str
    offset: int
    ret: bool


class Link(NamedTuple):
    """Probes that share one multi-uprobe link: ``handler`` (None: the
    dispatcher, told the handler by each probe's cookie), on return or not."""

    handler: str | None
    probes: list[Uprobe]
    ret: bool


def link_groups(probes: list[Uprobe]) -> list[Link]:
    """How one library's probes share multi-uprobe links. A function probed at
    entry only (a kernel launch, an asynchronous copy: the calls that come
    by the tens of thousands a second) runs its handler directly, one link
    per handler, which saves the dispatcher's tail call on every call; the
    others share one link per direction through the dispatcher."""
    paired = {p.symbol for p in probes if p.ret}
    direct: dict[str, list[Uprobe]] = {}
    shared: dict[bool, list[Uprobe]] = {False: [], True: []}
    for p in probes:
        if not p.ret and p.symbol not in paired:
            direct.setdefault(p.handler, []).append(p)
        else:
            shared[p.ret].append(p)
    out = [Link(h, group, False) for h, group in direct.items()]
    return out + [Link(None, group, ret) for ret, group in shared.items() if group]


class Program:
    """A compiled family in the kernel: its maps, its programs (loaded when
    first attached) and what is attached."""

    def __init__(self, compiled: Compiled, *, multi: bool, holder: Holder | None = None) -> None:
        self.compiled = compiled
        self.multi = multi
        self.holder = holder  # takes what attaches (None: this process keeps it)
        self.maps: dict[str, Map] = {}
        self._progs: dict[str, int] = {}
        self._slots: dict[str, int] = {}
        self._refused: dict[str, kernel.BPFError] = {}  # programs the kernel would not load
        self.attached: list[Attachment] = []
        self.held = 0  # perf-event uprobes the holder process keeps for us
        self._lock = threading.Lock()
        try:
            for d in compiled.maps:
                self.maps[d.spec.name] = Map(kernel.map_create(d.spec), d)
        except (OSError, ProbingError):
            self.close()
            raise

    def __getitem__(self, name: str) -> Map:
        return self.maps[name]

    def prog_fd(self, name: str, prog_type: int = kernel.PROG_TYPE_KPROBE) -> int:
        """The loaded program ``name`` (loaded now the first time), as a uprobe
        program unless ``prog_type`` says otherwise."""
        fd = self._progs.get(name)
        if name in self._refused:  # the verifier's answer does not change: not asked again
            raise self._refused[name]
        if fd is None:
            try:
                insns, relocs = self.compiled.programs[name]
            except KeyError:
                raise ProbingError(f"no BPF program {name} in the compiled family") from None
            code = bytearray(insns)
            for idx, m in relocs:
                fd_m = self.maps[self.compiled.maps[m].spec.name].map_fd
                code[8 * idx + 1] = (code[8 * idx + 1] & 0x0F) | (kernel.PSEUDO_MAP_FD << 4)
                code[8 * idx + 4 : 8 * idx + 8] = fd_m.to_bytes(4, "little")
            uprobe = prog_type == kernel.PROG_TYPE_KPROBE
            try:
                fd = kernel.prog_load(
                    name,
                    bytes(code),
                    prog_type=prog_type,
                    license=self.compiled.license.encode(),
                    kern_version=self.compiled.kern_version,
                    expected_attach_type=kernel.TRACE_UPROBE_MULTI if self.multi and uprobe else 0,
                )
            except kernel.BPFError as err:
                if err.errno in (errno.EACCES, errno.EINVAL, errno.E2BIG):  # the verifier's no
                    self._refused[name] = err
                raise
            self._progs[name] = fd
        return fd

    def _slotted(self, probes: list[Uprobe]) -> tuple[list[Uprobe], list[tuple[Uprobe, str]]]:
        """``probes`` whose handler has a slot (``_slot``), and the others
        with why not (the kernel refused their handler)."""
        ok, refused = [], []
        for p in probes:
            try:
                self._slot(p.handler)
            except (kernel.BPFError, ProbingError) as err:
                refused.append((p, str(err)))
            else:
                ok.append(p)
        return ok, refused

    def _slot(self, handler: str) -> int:
        """The handler's slot in the dispatch program array (its cookie)."""
        slot = self._slots.get(handler)
        if slot is None:
            slot = len(self._slots)
            if slot >= HANDLERS:
                raise ProbingError(f"more than {HANDLERS} handlers in one family")
            key, value = ctypes.c_uint32(slot), ctypes.c_uint32(self.prog_fd(handler))
            kernel.map_update(self.maps["handlers"].map_fd, key, value)
            self._slots[handler] = slot
        return slot

    def attach(
        self, path: str, probes: list[Uprobe], pid: int
    ) -> list[tuple[str, str, bool, str | None]]:
        """Attach ``probes`` in ``path`` for ``pid``; returns ``(symbol, kind,
        attached, error)`` each."""
        results: list[tuple[str, str, bool, str | None]] = []
        done = Attachment(path, [], [])
        with self._lock:
            if self.multi:
                for handler, group, ret in link_groups(probes):
                    kind = "return" if ret else "entry"
                    if handler is None:  # a handler refused leaves the link to the others
                        group, refused = self._slotted(group)
                        results += [(p.symbol, kind, False, why) for p, why in refused]
                        if not group:
                            continue
                    try:
                        if handler is None:  # the dispatcher, told the handler by the cookie
                            cookies = [self._slots[p.handler] for p in group]
                            prog = self.prog_fd(DISPATCH)
                        else:
                            cookies, prog = [0] * len(group), self.prog_fd(handler)
                        fd = kernel.uprobe_multi_link(
                            prog, path, [p.offset for p in group], cookies, pid, ret
                        )
                    except (kernel.BPFError, ProbingError) as err:
                        results += [(p.symbol, kind, False, str(err)) for p in group]
                        continue
                    done.fds.append(fd)
                    done.probes += [(p.handler, p.symbol, kind) for p in group]
                    results += [(p.symbol, kind, True, None) for p in group]
            else:
                for handler, sym, off, ret in probes:
                    kind = "return" if ret else "entry"
                    try:
                        fd = kernel.perf_uprobe(self.prog_fd(handler), path, off, pid, ret)
                    except (kernel.BPFError, ProbingError) as err:
                        results.append((sym, kind, False, str(err)))
                        continue
                    done.fds.append(fd)
                    done.probes.append((handler, sym, kind))
                    results.append((sym, kind, True, None))
            if done.fds:
                self.keep(done)
        return results

    def keep(self, done: Attachment) -> None:
        """What attached stays attached: its fds go to the holder process,
        or stay with us (``attached``) without one."""
        if self.holder is not None and done.fds:
            try:
                self.holder.give(done.fds)
            except OSError:  # the holder is gone or closed: we keep them
                pass
            else:
                self.held += len(done.fds)
                done.fds = []
        self.attached.append(done)

    def detach(self) -> None:
        """Every uprobe off, released from several threads at once: each
        release waits for an RCU grace period, and concurrent ones share it."""
        with self._lock:
            fds = [fd for a in self.attached for fd in a.fds]
            self.attached = []
            held, self.held = self.held, 0
        close_all(fds)
        if held and self.holder is not None:
            self.holder.drop()

    def close(self) -> None:
        """Detach, then free the programs and maps. Safe twice."""
        self.detach()
        progs, self._progs, self._slots = list(self._progs.values()), {}, {}
        maps, self.maps = [m.map_fd for m in self.maps.values()], {}
        for fd in progs + maps:
            os.close(fd)


HOLDER_CODE = """
import os, select, socket, sys, threading
s = socket.socket(fileno=int(sys.argv[1]))
poll = select.poll()
poll.register(s, select.POLLIN)
try:  # the traced process and the probe's: once either is gone, however it died, let go
    for pid in {int(sys.argv[2]), int(sys.argv[3])}:
        poll.register(os.pidfd_open(pid), select.POLLIN)
    alive = os.getppid() == int(sys.argv[3])
except OSError:
    alive = False
held = []
while alive:
    msg, fds = b"", []
    if s.fileno() in {fd for fd, _ in poll.poll()}:
        try:
            msg, fds, _, _ = socket.recv_fds(s, 64, 1024)
        except OSError:
            pass
    held += fds
    if msg == b"sync":  # everything sent before is ours now
        s.send(b"ok")
    elif msg in (b"", b"drop"):  # a stop, closed by the tracer, or its process is gone
        # released at once: concurrent releases of links share a grace period
        closing = [threading.Thread(target=os.close, args=(fd,)) for fd in held[:16]]
        for t in closing:
            t.start()
        for fd in held[16:]:
            os.close(fd)
        for t in closing:
            t.join()
        held = []
        alive = alive and msg == b"drop"
"""


class Holder:
    """A helper process holding the links and perf events a tracer attached,
    so that neither a stop nor the process's exit waits for their release
    (each pays an RCU grace period). Told to let go (``drop``), closed
    (``close``), or seeing its traced process gone (a pidfd: however it
    died, and whatever forked children still hold this end of the socket),
    it closes them from several threads at once; closed or orphaned, it
    exits. Started at the first ``give``; one per tracer."""

    def __init__(self, traced: int | None = None) -> None:
        self.traced = os.getpid() if traced is None else traced  # the traced process
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _start_locked(self) -> socket.socket:
        if self._closed:
            raise OSError(errno.EPIPE, "the holder process was closed")
        if self.sock is not None and self.proc is not None and self.proc.poll() is None:
            return self.sock
        if self.sock is not None:
            self.sock.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", HOLDER_CODE, str(theirs.fileno()),
                 str(self.traced), str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        return ours

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Start the helper now (it starts at the first ``give`` otherwise):
        its interpreter starts while the programs load."""
        with self._lock:
            self._start_locked()

    def sync(self, timeout: float = 5.0) -> bool:
        """Wait until the helper has taken every fd given so far (they are in
        no process's table while in the socket). False if it did not say so."""
        with self._lock:
            if self.sock is None:
                return True
            try:
                self.sock.send(b"sync")
                self.sock.settimeout(timeout)
                try:
                    return self.sock.recv(16) == b"ok"
                finally:
                    self.sock.settimeout(None)
            except OSError:  # gone, or too slow: it takes them when it can
                return False

    def give(self, fds: list[int]) -> None:
        """The holder takes ``fds`` (closed here: its copies are the only ones).
        ``OSError`` when it cannot: the fds stay ours."""
        with self._lock:
            sock = self._start_locked()
            for i in range(0, len(fds), 64):
                socket.send_fds(sock, [b"fds"], fds[i : i + 64])
        for fd in fds:
            os.close(fd)

    def drop(self) -> None:
        """Let go of everything given so far (in the background)."""
        with self._lock:
            if self.sock is not None:
                with contextlib.suppress(OSError):  # gone: what it held went with it
                    self.sock.send(b"drop")

    def close(self) -> None:
        """Let go of everything and exit (in the background). Safe twice."""
        with self._lock:
            self._closed = True
            sock, self.sock = self.sock, None
            if sock is not None:
                sock.close()
            if self.proc is not None and self.proc.poll() is None:
                # reaped by a thread of ours, or it would stay a zombie
                threading.Thread(target=self.proc.wait, name="probing-holder", daemon=True).start()


def close_all(fds: list[int]) -> None:
    """Close ``fds`` from up to CLOSE_THREADS threads at once."""
    if len(fds) <= 1:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        return
    pending = list(fds)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                fd = pending.pop()
            with contextlib.suppress(OSError):
                os.close(fd)

    threads = [
        threading.Thread(target=worker, name="probing-detach", daemon=True)
        for _ in range(min(CLOSE_THREADS, len(fds)))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
