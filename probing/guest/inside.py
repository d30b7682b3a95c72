"""What only the process itself knows, as plain data (stdlib only).

Each function returns lists, dicts, strings and numbers, the same whether
the engine asks through the guest's socket (``probing.guest.life``) or a
probe in the same process calls it directly (``probing.target``):
its threads, their stacks, ``python.`expr```, ``eval``, and which torch
process group each traced Gloo context belongs to. torch is only read
when the host has fully imported it (``sys.modules``), never imported here.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import struct
import sys
import threading
import time
import traceback

from .wire import GuestError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any, TextIO

STARTED_NS = time.time_ns()
WINDOW_S = 0.02  # CPU use over this window tells a busy thread from a sleeping one
MAX_AUTO_IMPORTS = 8
EVAL_FILENAME = "<probing eval>"
# what a probe reads of the host's environment (who it is in the job, and
# probing's settings), as the host's os.environ holds it now
ENV_PREFIXES = (
    "PROBING", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "NODE_RANK", "MASTER_", "TORCHELASTIC_", "CUDA_VISIBLE_DEVICES", "SLURM_", "OMPI_",
    "PMI_", "PMIX_", "MPI_LOCALRANKID", "PET_",
)  # fmt: skip


# -- the process ---------------------------------------------------------------------


_LIBRARY_DIRS: list[str] = []


def library_dirs() -> list[str]:
    """Where this Python's standard library is (asked of sysconfig once)."""
    if not _LIBRARY_DIRS:
        import sysconfig

        paths = sysconfig.get_paths()
        _LIBRARY_DIRS.extend(sorted({p for k in ("stdlib", "platstdlib") if (p := paths.get(k))}))
    return list(_LIBRARY_DIRS)


def info() -> dict[str, Any]:
    """Who the process is: its Python, its arguments, where its libraries are."""
    return {
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "version": list(sys.version_info[:2]),
        "executable": sys.executable,
        "argv": list(getattr(sys, "argv", [])),
        "library_dirs": library_dirs(),
        "probe_started_ns": STARTED_NS,
        "distributed": distributed(),
        "environ": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)},
    }


STORE_LAYERS = 4  # prefix stores wrapped around the job's TCPStore, at most


def distributed() -> dict[str, Any] | None:
    """The job's default process group once torch has it: rank, size, and the
    host and port of its TCPStore (none for a file or hash store). Lightning,
    ``mp.spawn`` and accelerate pass rank and size to ``init_process_group``
    themselves: this is where a probe learns them."""
    dist = _torch_distributed()
    if dist is None:
        return None
    try:
        if not dist.is_initialized():
            return None
        out: dict[str, Any] = {"rank": int(dist.get_rank()), "world": int(dist.get_world_size())}
        store = getattr(dist.distributed_c10d, "_get_default_store", lambda: None)()
        for _ in range(STORE_LAYERS):  # PrefixStore("default_pg", ...) around the TCPStore
            host, port = getattr(store, "host", None), getattr(store, "port", None)
            if host and port:
                out["store"] = [str(host), int(port)]
                break
            store = getattr(store, "underlying_store", None)
        return out
    except Exception:  # torch internals moved, or not initialised yet
        return None


def _torch_distributed() -> Any:
    dist = sys.modules.get("torch.distributed")
    spec = getattr(dist, "__spec__", None)
    if dist is None or "torch" not in sys.modules or getattr(spec, "_initializing", False):
        return None
    return dist


def task_stat(tid: int, pid: int | str = "self") -> tuple[str, int] | None:
    """(state letter, utime + stime in clock ticks) of one thread, or None."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # comm may hold spaces and ")"
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[11]) + int(fields[12])


def task_syscall(tid: int, pid: int | str = "self") -> int:
    """The syscall a blocked (or ptrace-stopped) thread sits in; -1 for none."""
    try:
        with open(f"/proc/{pid}/task/{tid}/syscall") as f:
            first = f.read().split()[0]
    except (OSError, IndexError):
        return -1
    return -1 if first == "running" else int(first)


def threads() -> list[dict[str, Any]]:
    """The process's ``threading`` threads (probing's own named ``probing-*``)."""
    main = threading.main_thread()
    return [
        {
            "tid": t.native_id,
            "ident": t.ident,
            "name": t.name,
            "daemon": t.daemon,
            "main": t is main,
        }
        for t in threading.enumerate()
    ]


# -- new threads, while traced --------------------------------------------------------


def hook_threads(tell: Any) -> None:
    """Call ``tell(native tid, PyThreadState address)`` from inside each new
    ``threading.Thread`` as it starts, before its target runs
    (``Thread._set_native_id``, which every supported CPython's thread calls
    first and which returns at once: no frame of ours stays on its stack). A
    thread that issues a collective at once then has its Python stack. ``tell``
    failing never reaches the thread: it is picked up at the next sync."""
    import ctypes

    current = threading.Thread._set_native_id  # type: ignore[attr-defined]  # private
    original = getattr(current, "__probing_original__", None) or current
    get = ctypes.pythonapi.PyThreadState_Get
    get.restype = ctypes.c_void_p

    def _set_native_id(thread: threading.Thread) -> None:
        original(thread)
        try:
            tell(threading.get_native_id(), get())
        except Exception:  # in the user's new thread: never raise there
            pass

    _set_native_id.__probing_original__ = original  # type: ignore[attr-defined]
    threading.Thread._set_native_id = _set_native_id  # type: ignore[attr-defined]


def unhook_threads() -> None:
    current = threading.Thread._set_native_id  # type: ignore[attr-defined]
    original = getattr(current, "__probing_original__", None)
    if original is not None:
        threading.Thread._set_native_id = original  # type: ignore[attr-defined]


# -- stacks ---------------------------------------------------------------------------


def stacks(window_s: float = WINDOW_S) -> list[dict[str, Any]]:
    """A row per frame of every Python thread, innermost first (``depth``
    0), with the thread's state letter, CPU share over ``window_s`` and the
    syscall it is blocked in (-1: none). The probe's own threads are left
    out."""
    known = {t.ident: t for t in threading.enumerate()}
    skip = {i for i, t in known.items() if t.name.startswith("probing-")}
    tids = [t.native_id for i, t in known.items() if t.native_id and i not in skip]
    before = {tid: task_stat(tid) for tid in tids}
    time.sleep(window_s)  # lets the GIL go: busy Python threads run meanwhile
    tick = os.sysconf("SC_CLK_TCK")
    states: dict[int, tuple[str, float, int]] = {}
    tid: int | None
    for tid in tids:
        now, then = task_stat(tid), before.get(tid)
        if now is None:
            continue
        cpu = (now[1] - then[1]) / tick / window_s if then else 0.0
        states[tid] = (now[0], min(cpu, 1.0), task_syscall(tid) if now[0] != "R" else -1)
    rows: list[dict[str, Any]] = []
    for ident, frame in sys._current_frames().items():
        if ident in skip:
            continue
        t = known.get(ident)
        tid = t.native_id if t is not None else None
        letter, cpu, nr = states.get(tid or -1, ("?", 0.0, -1))
        head = {
            "tid": tid,
            "thread": t.name if t is not None else f"thread {ident:#x}",
            "letter": letter,
            "cpu": cpu,
            "syscall_nr": nr,
            "daemon": t.daemon if t is not None else None,
        }
        depth = 0
        f: Any = frame
        while f is not None:
            code = f.f_code
            rows.append(
                {
                    **head,
                    "depth": depth,
                    "func": getattr(code, "co_qualname", code.co_name),
                    "file": code.co_filename,
                    "line": f.f_lineno,
                }
            )
            f = f.f_back
            depth += 1
    return rows


# -- python.`expr` and eval -----------------------------------------------------------


def eval_with_imports(expr: str) -> Any:
    """Evaluate ``expr`` in a copy of ``__main__``'s namespace; import modules it names.

    ``time.time()`` works without ``import time`` in the target: a NameError
    for an importable top-level module imports it and tries again.
    """
    main = sys.modules.get("__main__")
    namespace: dict[str, Any] = dict(vars(main)) if main is not None else {}
    namespace.setdefault("__builtins__", __builtins__)
    for _ in range(MAX_AUTO_IMPORTS):
        try:
            return eval(expr, namespace)  # local socket only
        except NameError as err:
            name = getattr(err, "name", None)
            if not name or name in namespace:
                raise
            try:
                namespace[name] = importlib.import_module(name)
            except ImportError:
                raise err from None
    raise NameError("too many names to import")


def expr(text: str) -> dict[str, list[Any]]:
    """``python.`expr```: the value of ``text`` as columns (name -> values).

    A scalar is one row of a ``value`` column; a dict is one row (or columns,
    when every value is a list of one length); a list of dicts is rows; a
    list of scalars is a ``value`` column; pandas DataFrames, Arrow tables and
    numpy arrays of the host's own libraries are read through their own
    ``to_dict``/``to_pydict``/``tolist``. Values JSON cannot carry are their
    ``repr``.
    """
    try:
        value = eval_with_imports(text)
        return {k: [plain(v) for v in col] for k, col in columns(value).items()}
    except Exception as err:  # the user's expression may raise anything
        raise GuestError(f"python.`{text}`: {type(err).__name__}: {err}") from None


def columns(value: Any) -> dict[str, list[Any]]:
    if hasattr(value, "to_pydict") and hasattr(value, "schema"):  # an Arrow table or batch
        return {str(k): list(v) for k, v in value.to_pydict().items()}
    if type(value).__name__ == "DataFrame" and hasattr(value, "to_dict"):
        return {str(k): list(v) for k, v in value.to_dict("list").items()}
    if isinstance(value, dict):
        cols = {str(k): v for k, v in value.items()}
        lists = [v for v in cols.values() if isinstance(v, (list, tuple))]
        if cols and len(lists) == len(cols) and len({len(v) for v in lists}) == 1:
            return {k: list(v) for k, v in cols.items()}
        return {k: [v] for k, v in cols.items()}
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        value = value.tolist()
        if not isinstance(value, list):
            return {"value": [value]}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
        if items and all(isinstance(i, dict) for i in items):
            names: dict[str, None] = {}
            for i in items:
                names.update(dict.fromkeys(str(k) for k in i))
            return {n: [_get(i, n) for i in items] for n in names}
        return {"value": items}
    return {"value": [value]}


def _get(row: dict[Any, Any], name: str) -> Any:
    if name in row:
        return row[name]
    return next((v for k, v in row.items() if str(k) == name), None)


def plain(value: Any) -> Any:
    """``value`` as JSON carries it: numbers, strings, bools, None, lists of
    those; numpy scalars as their Python value; anything else its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    item = getattr(value, "item", None)
    if type(value).__module__ == "numpy" and callable(item):
        try:
            return plain(item())
        except (TypeError, ValueError):
            pass
    return repr(value)


class _ThreadTee(io.TextIOBase):
    """A stream that keeps one thread's writes and passes the rest on."""

    def __init__(self, orig: TextIO, buf: io.StringIO) -> None:
        self._orig = orig
        self._buf = buf
        self._owner = threading.get_ident()

    def write(self, s: str) -> int:
        if threading.get_ident() == self._owner:
            return self._buf.write(s)
        return self._orig.write(s)

    def flush(self) -> None:
        if threading.get_ident() != self._owner:
            self._orig.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._orig, name)


@contextlib.contextmanager
def _captured() -> Iterator[io.StringIO]:
    buf = io.StringIO()
    saved = sys.stdout, sys.stderr
    tees = _ThreadTee(saved[0], buf), _ThreadTee(saved[1], buf)
    sys.stdout, sys.stderr = tees
    try:
        yield buf
    finally:
        if sys.stdout is tees[0]:  # the target may have replaced it meanwhile
            sys.stdout = saved[0]
        if sys.stderr is tees[1]:
            sys.stderr = saved[1]


def run(code: str) -> dict[str, Any]:
    """``probing eval``: an expression is evaluated in a copy of ``__main__``'s
    namespace (modules it names imported) and its ``repr`` returned;
    statements run in ``__main__`` itself, so ``x = 1`` stays, as in a shell.
    What the code prints is captured; what the target's other threads print
    meanwhile still goes where it went. ``{"result", "output"}``; GuestError
    (kind ``EvalError``) when the code fails."""
    try:
        compile(code, EVAL_FILENAME, "eval")
        is_expr = True
    except SyntaxError:
        is_expr = False
        try:
            compiled = compile(code, EVAL_FILENAME, "exec")
        except SyntaxError as err:
            raise GuestError(f"SyntaxError: {err.msg} (line {err.lineno})", "EvalError") from None
    with _captured() as out:
        try:
            if is_expr:
                result: str | None = repr(eval_with_imports(code))
            else:
                main = sys.modules["__main__"]
                exec(compiled, vars(main))  # local socket only
                result = None
        except Exception as err:  # the user's code may raise anything: the answer
            detail = out.getvalue() + _user_traceback(err)
            raise GuestError(f"{type(err).__name__}: {err}", "EvalError", detail) from None
    return {"result": result, "output": out.getvalue()}


def _user_traceback(err: BaseException) -> str:
    """The traceback from the user's code down, without probing's own frames."""
    frames = traceback.extract_tb(err.__traceback__)
    first = next((i for i, f in enumerate(frames) if f.filename == EVAL_FILENAME), 0)
    lines = ["Traceback (most recent call last):\n"]
    lines += traceback.format_list(frames[first:])
    lines += traceback.format_exception_only(type(err), err)
    return "".join(lines)


# -- comm.groups ----------------------------------------------------------------------

OBJECT_BYTES = 1024  # how much of a ProcessGroupGloo is searched for its context vector
MAX_CONTEXTS = 64
PYOBJECT_HEAD = 16  # ob_refcnt, ob_type: where pybind11 keeps the C++ object's address


class OwnMemory:
    """This process's memory, read through ``/proc/self/mem``: an unmapped
    address is an error, never a crash."""

    def __init__(self) -> None:
        self._fd = os.open("/proc/self/mem", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        os.close(self._fd)

    def read(self, addr: int, size: int) -> bytes | None:
        if addr <= 0 or size <= 0:
            return None
        try:
            data = os.pread(self._fd, size, addr)
        except (OSError, OverflowError, ValueError):
            return None
        return data if len(data) == size else None

    def words(self, addr: int, count: int) -> tuple[int, ...]:
        data = self.read(addr, 8 * count)
        return struct.unpack(f"<{count}Q", data) if data else ()


def contexts_of(mem: Any, obj: int, wanted: set[int]) -> dict[int, int]:
    """The ``wanted`` context pointers held by the C++ object at ``obj``, each a
    ``shared_ptr`` element of a vector (begin, end words) inside it, with the
    offset of those words from ``obj`` (the first where one is held twice)."""
    found: dict[int, int] = {}
    words = mem.words(obj, OBJECT_BYTES // 8)
    for i, (begin, end) in enumerate(zip(words, words[1:], strict=False)):
        span = end - begin
        if begin <= 0 or span <= 0 or span % 16 or span > 16 * MAX_CONTEXTS:
            continue
        for ptr in mem.words(begin, span // 8)[0::2]:
            if ptr in wanted:
                found.setdefault(ptr, 8 * i)
    return found


PLAIN = ("", "default_pg", "undefined")  # group descriptions that say nothing


def torch_groups() -> list[tuple[str, list[int], int, Any]]:
    """(name, global ranks, my group rank, Gloo backend object) of each group
    in this process; none unless the host has torch.distributed up. The name
    is torch's, the same in every rank, with the group's description where
    it has one (``1 (mesh_dp)``: a device mesh's dimension)."""
    dist = _torch_distributed()
    torch = sys.modules.get("torch")
    if dist is None or torch is None:
        return []
    try:
        if not dist.is_initialized():
            return []
        world = dist.distributed_c10d._world
        out = []
        for pg, name in list(world.pg_names.items()):
            ranks = sorted(world.pg_group_ranks.get(pg, {}))
            try:
                backend = pg._get_backend(torch.device("cpu"))
            except (RuntimeError, ValueError):  # a group with no CPU (Gloo) backend
                continue
            if type(backend).__name__ != "ProcessGroupGloo":
                continue
            desc = getattr(pg, "group_desc", "")  # a device mesh's dimension: "mesh_dp"
            said = f"{name} ({desc})" if isinstance(desc, str) and desc not in PLAIN else name
            out.append((str(said), ranks, int(pg.rank()), backend))
        return out
    except (AttributeError, KeyError, TypeError, RuntimeError):  # torch internals moved: none
        return []


def groups(traced: list[int], find: Any = None) -> list[dict[str, Any]]:
    """``comm.groups`` rows: the group of each traced Gloo context pointer.
    torch names its groups the same in every rank of an SPMD job, so a
    context is named across the job by its group."""
    wanted = {int(c) for c in traced if c}
    rows: list[dict[str, Any]] = []
    if not wanted:
        return rows
    # the search reads OBJECT_BYTES past each object's start, its size being
    # torch's business: a neighbouring group's vector may be read too. Every
    # group keeps its contexts at the same offset in its object, so a context
    # is the group's that holds it nearest its start (its own send/recv: -1)
    owner: dict[int, tuple[int, str, list[int], int]] = {}
    mem = OwnMemory()
    try:
        for name, ranks, my_rank, backend in (find or torch_groups)():
            head = mem.words(id(backend) + PYOBJECT_HEAD, 1)
            if not head:
                continue
            held = contexts_of(mem, head[0], wanted)
            if head[0] in wanted:
                held[head[0]] = -1
            for ctx, at in held.items():
                if ctx not in owner or at < owner[ctx][0]:
                    owner[ctx] = (at, name, ranks, my_rank)
        for ctx in sorted(owner):
            _, name, ranks, my_rank = owner[ctx]
            rows.append(
                {
                    "backend": "gloo",
                    "comm": ctx,
                    "pg": name,
                    "ranks": ranks,
                    "group_rank": my_rank,
                    "nranks": len(ranks),
                }
            )
    finally:
        mem.close()
    return rows
