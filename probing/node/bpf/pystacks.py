"""The tracer's side of Python stacks: thread states in, stacks out.

``PyStacks`` keeps each BPF program's ``py_threads`` map (native tid ->
PyThreadState*) current: a ``threading.Thread`` registers itself as it
starts, before its target runs (``hook_threads``: a thread that issues a
collective at once has its stack), and every drain tick re-reads the
interpreter's thread list (``sync``: threads C code created, and threads
that exited, within one tick). It also turns the stack ids
the events carry into ``python.stacks`` rows, resolving each distinct stack
once: code objects are read with ``process_vm_readv`` from this process and
cached, so a freed code object is a read error, not a crash.
"""

from __future__ import annotations

import ctypes
import sysconfig
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa

from probing.errors import ProbingError
from probing.pyframes import remote, walker

STACKS_SCHEMA = pa.schema(
    [
        ("stack_id", pa.int64()),
        ("depth", pa.int32()),  # 0 = innermost frame
        ("file", pa.string()),
        ("func", pa.string()),
        ("line", pa.int32()),
        ("user", pa.bool_()),  # neither the standard library nor an installed package
    ]
)
PY_STACKS_MAX = 8192  # entries of each program's py_stacks map (bpf/pyframes.h)
STORED_BATCH = 256  # stacks a bpf() call of ``collect_stored`` (~400 bytes each)

# python.callsites: the one-line "file:line func" of each stack's innermost
# user frame (the innermost frame where the stack has no user frame), and the
# library frame that called it, if one did (a framework calling the user's
# code: transformers' Trainer, torch's DataLoader)
CALLSITES_SQL = """
SELECT u.stack_id AS stack_id,
       CAST(u.file || ':' || CAST(u.line AS VARCHAR) || ' ' || u.func AS VARCHAR) AS callsite,
       u.file AS file, u.line AS line, u.func AS func, v.file AS via_file, v.func AS via_func
FROM (
  SELECT *, row_number() OVER (PARTITION BY stack_id ORDER BY user DESC, depth) AS rn
  FROM python.stacks
) u
LEFT JOIN python.stacks v
  ON v.stack_id = u.stack_id AND v.depth = u.depth + 1 AND u.user AND NOT v.user
WHERE u.rn = 1
"""

_LIBRARY_DIRS = tuple({p for k in ("stdlib", "platstdlib") if (p := sysconfig.get_paths().get(k))})


def is_user_file(path: str, library_dirs: tuple[str, ...] = _LIBRARY_DIRS) -> bool:
    """A file of the user's own code: not the standard library (of the
    traced process's Python: ``library_dirs``), not a package."""
    if path.startswith("<") or path == "?":
        return False
    if "/site-packages/" in path or "/dist-packages/" in path:
        return False
    return not path.startswith(library_dirs)


def _frames(depth: int, code: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A stored stack's frames (code, offset), innermost first, without the
    frames C owns (code 0: 3.12+'s shims)."""
    depth = min(depth, len(code))
    code = code[:depth].view(np.int64)
    mine = code != 0
    return code[mine], offset[:depth][mine].astype(np.int64)


class PyStacks:
    """``known``: the stack ids already in the store's python.stacks, shared
    by the collectors that write there together (a tracer and its sampler);
    by default read from the table, so a stack is stored once per store
    across tracers, and again once its rows were retired."""

    def __init__(self, store: Any, known: set[int] | None = None, target: Any = None) -> None:
        # the traced process (probing.target); None: this one
        self.target = target
        local = target is None or target.local
        self.interp = remote.this_interpreter() if local else remote.locate(target.pid)
        self.library_dirs = _LIBRARY_DIRS
        if not local:
            self.library_dirs = tuple(target.info().get("library_dirs", ())) or _LIBRARY_DIRS
        self.offsets = self.interp.offsets
        self.resolver = walker.Resolver(self.interp.mem, self.offsets)
        self.table = store.table("python", "stacks", STACKS_SCHEMA)
        self.table.referenced = True  # by every table's stack_id
        if known is None:
            ids = self.table.to_arrow(["stack_id"]).column(0).unique()
            known = {int(i) for i in ids.to_pylist() if i is not None}
        self.known = known
        self.threads: dict[int, int] = {}  # native tid -> PyThreadState* in the maps
        self._stored: dict[int, int] = {}  # id(bpf) -> lookups since its map was cleared
        self.resolved = 0
        self._users: dict[str, bool] = {}  # a file -> whether it is the user's (``_user``)
        self.hook_errors = 0  # threads the start hook could not register (see hook_threads)
        self.last_hook_error: str | None = None

    def _append(self, sids: list[int], codes: list[np.ndarray], offsets: list[np.ndarray]) -> bool:
        """The python.stacks rows of the stacks ``sids``, each of its frames'
        ``codes`` and ``offsets`` (innermost first): each distinct frame
        resolved once (a new stack shares most of its frames with others);
        False where the process exited (its code objects went with it)."""
        counts = np.array([len(c) for c in codes], dtype=np.int64)
        code, offset = np.concatenate(codes), np.concatenate(offsets)
        if not len(code):
            return True
        # a frame's key: its code's number, then its offset (one sort of int64s)
        code_of, code_no = np.unique(code, return_inverse=True)
        keys, which = np.unique((code_no << 32) + (offset & 0xFFFFFFFF), return_inverse=True)
        first = np.zeros(len(keys), dtype=np.int64)
        first[which] = np.arange(len(code))  # a row of each distinct frame, any
        raws = zip(code_of[code_no[first]].tolist(), offset[first].tolist(), strict=True)
        try:
            resolved = self.resolver.frames(walker.RawFrame(c, o) for c, o in raws)
        except ProbingError:
            return False
        rows = which.reshape(-1)  # each row's distinct frame
        picked = rows.tolist()
        files, funcs = [f.file for f in resolved], [f.func for f in resolved]
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        columns = [  # the strings picked in Python: a few hundred, cheaper than a take
            pa.array(np.repeat(np.array(sids, dtype=np.int64), counts)),
            pa.array((np.arange(len(code)) - starts).astype(np.int32)),
            pa.array([files[i] for i in picked], pa.string()),
            pa.array([funcs[i] for i in picked], pa.string()),
            pa.array(np.array([f.line for f in resolved], dtype=np.int32)[rows]),
            pa.array(np.array([self._user(f) for f in files], dtype=bool)[rows]),
        ]
        self.table.append_batch(pa.RecordBatch.from_arrays(columns, schema=STACKS_SCHEMA))
        return True

    def _user(self, path: str) -> bool:
        """``is_user_file(path)`` for this process, asked once a file."""
        got = self._users.get(path)
        if got is None:
            if len(self._users) > 1 << 14:
                self._users.clear()
            got = self._users[path] = is_user_file(path, self.library_dirs)
        return got

    def cflags(self, hot: bool = False) -> list[str]:
        """The -D flags; ``hot``: kernel launches and async copies walk too."""
        flags = [*self.offsets.cflags(), "-DPY_STACKS", f"-DPY_STACKS_MAX={PY_STACKS_MAX}"]
        return [*flags, "-DPY_STACKS_HOT"] if hot else flags

    # -- threads -------------------------------------------------------------------
    def current_threads(self) -> dict[int, int]:
        """native tid -> PyThreadState* of every thread of every interpreter."""
        mem, off = self.interp.mem, self.offsets
        natives = self._natives()  # 3.10's thread states have no native id
        out = {}
        for interp in walker.interpreters(mem, off, self.interp.runtime):
            for ts in walker.thread_states(mem, off, interp):
                tid = ts.native_id if ts.native_id > 0 else natives.get(ts.thread_id)
                if tid:
                    out[tid] = ts.addr
        return out

    def _natives(self) -> dict[int, int | None]:
        """``threading`` ident -> native tid of the traced process's threads."""
        if self.target is None or self.target.local:
            return {t.ident: t.native_id for t in threading.enumerate() if t.ident}
        if self.offsets.tstate_native_thread_id >= 0:  # the thread states say it
            return {}
        try:
            return {t["ident"]: t["tid"] for t in self.target.threads()}
        except Exception:  # a process gone or not answering: no names this tick
            return {}

    def hook_threads(self, bpfs: Any) -> None:
        """Register each new ``threading.Thread`` from inside it as it starts
        (``Thread._set_native_id``, which every supported CPython's thread calls
        first and which returns at once: no frame of ours stays on its stack);
        ``bpfs()`` gives the programs loaded at that moment."""
        original = threading.Thread._set_native_id  # type: ignore[attr-defined]
        collector = self

        def _set_native_id(thread: threading.Thread) -> None:
            original(thread)
            try:
                collector.register_current(bpfs())
            except Exception as err:
                # this runs in the user's new thread, before its target: a
                # failure of ours (a map closed by a stop meanwhile, or a bug)
                # must not kill it; counted, and the thread is picked up by
                # the next sync instead
                collector.hook_errors += 1
                collector.last_hook_error = f"{type(err).__name__}: {err}"

        _set_native_id.__probing_original__ = original  # type: ignore[attr-defined]
        threading.Thread._set_native_id = _set_native_id  # type: ignore[attr-defined]

    @staticmethod
    def unhook_threads() -> None:
        current = threading.Thread._set_native_id  # type: ignore[attr-defined]
        original = getattr(current, "__probing_original__", None)
        if original is not None:
            threading.Thread._set_native_id = original  # type: ignore[attr-defined]

    def register_current(self, bpfs: Iterable[Any]) -> None:
        """Put the calling thread (which holds the GIL) into the maps."""
        get = ctypes.pythonapi.PyThreadState_Get
        get.restype = ctypes.c_void_p
        self.register(threading.get_native_id(), get(), bpfs)

    def register(self, tid: int, tstate: int, bpfs: Iterable[Any]) -> None:
        """Thread ``tid``'s state is at ``tstate``: into every program's map."""
        for bpf in bpfs:
            m = bpf["py_threads"]
            m[m.Key(tid)] = m.Leaf(tstate)

    def fill(self, bpf: Any) -> None:
        """A program loaded after the threads were synced: every one known into its map."""
        for tid, addr in self.threads.items():
            self.register(tid, addr, [bpf])

    def sync(self, bpfs: Iterable[Any]) -> None:
        try:
            now = self.current_threads()
        except (OSError, ProbingError):  # the list changed under us (next tick), or it exited
            return
        if now == self.threads:
            return
        gone = self.threads.keys() - now.keys()
        changed = {t: a for t, a in now.items() if self.threads.get(t) != a}
        for bpf in bpfs:
            m = bpf["py_threads"]
            for tid in gone:
                try:
                    del m[m.Key(tid)]
                except KeyError:
                    pass
            for tid, addr in changed.items():
                m[m.Key(tid)] = m.Leaf(addr)
        self.threads = now

    # -- stacks --------------------------------------------------------------------
    def collect(self, bpf: Any, ids: np.ndarray) -> int:
        """Resolve the stacks ``ids`` not seen yet into python.stacks rows."""
        new = [int(i) for i in np.unique(ids) if i and int(i) not in self.known]
        if not new:
            return 0
        m = bpf["py_stacks"]
        read: list[tuple[int, np.ndarray, np.ndarray]] = []  # each stack's frames (code, offset)
        for sid in new:
            try:
                st = m[ctypes.c_uint32(sid)]
            except KeyError:  # the map was full when the stack was new: lost
                continue
            as_array = np.ctypeslib.as_array
            read.append((sid, *_frames(int(st.depth), as_array(st.code), as_array(st.offset))))
        self._store(read)
        # resolved stacks stay in the map (the BPF side skips known stacks);
        # a map half full is cleared, and stacks still in use come back once
        n = self._stored.get(id(bpf), 0) + len(new)
        if n > PY_STACKS_MAX // 2:
            m.clear()
            n = 0
        self._stored[id(bpf)] = n
        return len(new)

    def collect_stored(self, bpf: Any) -> int:
        """Resolve every stack ``bpf`` stored since the last call and not
        seen yet into python.stacks rows; each is taken out of its map as it
        is read, all in a few bpf() calls, where ``collect`` makes one a
        stack (a sampler meets many: each FSDP2 rank ~30 new ones a second).
        The program stores a stack again when it recurs, known by then. For
        a map only this reads (the sampler's), after the rows that use them:
        a stack is stored before a sample of it is counted."""
        keys, stored = bpf["py_stacks"].arrays(delete=True, count=STORED_BATCH)
        read = [
            (sid, *_frames(int(stored[i]["depth"]), stored[i]["code"], stored[i]["offset"]))
            for i, sid in enumerate(keys.tolist())
            if sid and sid not in self.known
        ]
        self._store(read)
        return len(read)

    def _store(self, read: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        """The python.stacks rows of the stacks ``read`` (id, codes, offsets), known from now on."""
        got = [sid for sid, _, _ in read]
        if got and self._append(got, [c for _, c, _ in read], [o for _, _, o in read]):
            self.known.update(got)
            self.resolved += len(got)
