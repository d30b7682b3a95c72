"""A probe's store: every table, one byte budget, one age limit."""

from __future__ import annotations

import atexit
import os
import queue
import re
import shutil
import tempfile
import threading
import time

import pyarrow as pa

from probing import config, proc
from probing.guest.place import ensure_private_dir
from probing.node.store.codec import DEFAULT_CODEC, get_codec
from probing.node.store.table import EventTable, TableStats
from probing.worker import named

DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_CHUNK_ROWS = 1 << 16
SEAL_QUEUE = 4  # a store's chunks waiting for the sealer thread; past that, the writer seals
# rows pending this long are sealed at the next append or read: a chunk costs
# a file and a writer's set-up whatever its rows (a traced rank seals each
# table every few seconds, not every second)
SEAL_AFTER_S = 10.0
SEALER_IDLE_S = 2.0  # the sealer thread ends once no chunk came for this long


# chunks-<engine pid>-[p<process pid>s<its start, clock ticks>-]<random>: a store
# of the engine for one process names that process, whose next engine adopts it
_ROOT_NAME = re.compile(r"^chunks-(\d+)-(?:p(\d+)s(\d+)-)?")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (another user's too); a zombie (killed,
    not reaped yet) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat(pid)
    return fields is None or fields[0] not in ("Z", "X")  # no /proc to ask: it exists


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after its name (state first); None
    when it cannot be read."""
    try:
        return proc.stat(pid)
    except (OSError, ValueError):
        return None


def chunk_base(need_bytes: int) -> str:
    """Where chunk files go: ``$PROBING_CHUNK_DIR``, else /dev/shm (memory,
    like the rest of the process's data) when it has room for the whole
    budget, else the temp directory."""
    explicit = config.load().chunk_dir
    if explicit:
        return explicit
    try:
        st = os.statvfs("/dev/shm")
        if os.access("/dev/shm", os.W_OK) and st.f_bavail * st.f_frsize >= need_bytes:
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


def started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, exactly as the
    kernel says): with the pid, what tells it from a later process given
    the same pid."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields else None  # field 22, starttime
    except (ValueError, IndexError):
        return None


def remove_stale_roots(user_dir: str) -> None:
    """Remove chunk directories left by processes that died without cleaning
    up; an engine's store for a process that still runs is kept for the
    process's next engine (``Store.adopt``)."""
    try:
        names = os.listdir(user_dir)
    except OSError:
        return
    for name in names:
        m = _ROOT_NAME.match(name)
        if not m or pid_alive(int(m.group(1))):
            continue
        if m.group(2) and started(int(m.group(2))) == int(m.group(3)):
            continue  # its process runs on: its next engine takes it over
        shutil.rmtree(os.path.join(user_dir, name), ignore_errors=True)


class Sealer:
    """The process's one sealer thread (``probing-seal``), for every store:
    it compresses the chunks handed over, oldest first, and ends once none
    came for ``SEALER_IDLE_S`` (the next chunk starts it again): an engine
    serving many ranks has one, and none once they are done."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Store, EventTable, int, list[pa.RecordBatch]]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def put(
        self, store: Store, table: EventTable, chunk_id: int, batches: list[pa.RecordBatch]
    ) -> None:
        self._queue.put((store, table, chunk_id, batches))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=named("probing-seal", self._run), name="probing-seal", daemon=True
                )
                self._thread.start()

    @property
    def running(self) -> bool:
        with self._lock:
            return self._thread is not None

    def _run(self) -> None:
        while True:
            try:
                store, table, chunk_id, batches = self._queue.get(timeout=SEALER_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():  # a put after this starts a new thread
                        self._thread = None
                        return
                continue
            store._sealed_one(table, chunk_id, batches)
            del store, table, batches  # nothing of a store kept while idle


SEALER = Sealer()


class Store:
    """Append-only compressed column tables with retention by bytes and age.

    Sealed chunks are files under one directory per process (on tmpfs when it
    has room), removed when the process exits, or by the next probe of this
    user if the process was killed. Retention retires whole sealed chunks,
    oldest first across all tables, and counts what it retired per table
    (``retired_rows``/``retired_bytes``); nothing disappears without a count
    in ``probing.tables``.
    """

    def __init__(
        self,
        *,
        max_bytes: int | None = None,
        max_age_s: float | None = None,
        chunk_rows: int | None = None,
        codec: str | None = None,
        seal_after_s: float = SEAL_AFTER_S,
        owner: int | None = None,
    ) -> None:
        env = config.load()
        self.max_bytes = int(max_bytes or env.store_bytes)
        self.max_age_s = max_age_s if max_age_s is not None else (env.store_age_s or None)
        self.chunk_rows = int(chunk_rows or DEFAULT_CHUNK_ROWS)
        self.codec = get_codec(codec or env.store_codec or DEFAULT_CODEC)
        self.seal_after_s = seal_after_s
        self._root: str | None = None
        # the process whose data this is, when not this one's (an engine's)
        self.owner = owner
        self._owner_start = started(owner) if owner else None
        self._tables: dict[tuple[str, str], EventTable] = {}
        self._lock = threading.RLock()
        self._queued = 0  # chunks handed to the sealer, not sealed yet
        self._closed = False  # its files removed: a chunk still queued is let go

    def seal_later(self, table: EventTable, chunk_id: int, batches: list[pa.RecordBatch]) -> bool:
        """Hand a chunk to the process's sealer thread, which compresses it
        (the Parquet and IPC writers let go of the GIL meanwhile). False
        when SEAL_QUEUE chunks of this store already wait: the caller seals
        this one itself, which bounds the rows held in memory and slows a
        writer that outruns the sealer."""
        with self._lock:
            if self._queued >= SEAL_QUEUE or self._closed:
                return False
            self._queued += 1
        SEALER.put(self, table, chunk_id, batches)
        return True

    def _sealed_one(self, table: EventTable, chunk_id: int, batches: list[pa.RecordBatch]) -> None:
        """On the sealer thread: seal one chunk this store handed over."""
        try:
            if self._closed:  # its files are gone: the rows with them
                table._let_go(chunk_id)
            else:
                table._seal(chunk_id, batches)  # never raises: a failure is counted there
        finally:
            with self._lock:
                self._queued -= 1

    def settle(self) -> None:
        """Seal what is pending: the process whose data this is has exited
        and writes no more; its rows stay queryable until ``close`` (an
        engine keeps what a dead process left a while)."""
        for t in self.tables():
            t.flush()

    def chunk_root(self) -> str:
        """This process's chunk directory, created on first use."""
        with self._lock:
            if self._root is None:
                user_dir = os.path.join(chunk_base(self.max_bytes), f"probing-{os.getuid()}")
                ensure_private_dir(user_dir)  # never through another user's symlink
                remove_stale_roots(user_dir)
                self._root = tempfile.mkdtemp(prefix=self._prefix(), dir=user_dir)
                atexit.register(self.close)
            return self._root

    def _prefix(self) -> str:
        if self.owner and self._owner_start is not None:
            return f"chunks-{os.getpid()}-p{self.owner}s{self._owner_start}-"
        return f"chunks-{os.getpid()}-"

    def keep(self) -> None:
        """Seal what is pending and leave the chunk files to the owner's next
        engine (``adopt``): an engine that stops, its process running on."""
        self.settle()
        with self._lock:
            root, self._root = self._root, None
        if root is not None:
            atexit.unregister(self.close)

    def adopt(self) -> int:
        """Take over the chunks an engine before this one sealed for the
        owner (killed, or stopped with ``keep``): each table gets them back,
        oldest first, before any row of its own. Returns the rows taken."""
        if not self.owner or self._owner_start is None:
            return 0
        user_dir = os.path.join(chunk_base(self.max_bytes), f"probing-{os.getuid()}")
        try:
            names = sorted(os.listdir(user_dir))
        except OSError:
            return 0
        rows = 0
        for name in names:
            m = _ROOT_NAME.match(name)
            if not m or m.group(2) != str(self.owner) or m.group(3) != str(self._owner_start):
                continue
            if pid_alive(int(m.group(1))):
                continue  # an engine that still runs keeps its own
            old = os.path.join(user_dir, name)
            rows += self._take_root(old)
            shutil.rmtree(old, ignore_errors=True)
        return rows

    def _take_root(self, old: str) -> int:
        rows = 0
        for schema in sorted(os.listdir(old)):
            for name in sorted(os.listdir(os.path.join(old, schema))):
                found = os.path.join(old, schema, name)
                rows += self.table(schema, name).take_chunks(found, self.codec)
        return rows

    def close(self) -> None:
        """Remove this process's chunk files (at exit; safe to call twice).
        Closed before the exit (an engine retiring a process's store), it
        lets go of its exit hook, which would keep the store alive (an
        engine serves hundreds of jobs); a chunk still queued is let go."""
        with self._lock:
            self._closed = True
            root, self._root = self._root, None
        if root is not None:
            atexit.unregister(self.close)
            shutil.rmtree(root, ignore_errors=True)

    def table(self, schema: str, name: str, arrow_schema: pa.Schema | None = None) -> EventTable:
        """The table ``schema.name``, created on first use."""
        key = (schema, name)
        with self._lock:
            tbl = self._tables.get(key)
            if tbl is None:
                tbl = self._tables[key] = EventTable(self, schema, name, arrow_schema)
            return tbl

    def get(self, schema: str, name: str) -> EventTable | None:
        with self._lock:
            return self._tables.get((schema, name))

    def tables(self, schema: str | None = None) -> list[EventTable]:
        with self._lock:
            return [t for (s, _), t in self._tables.items() if schema in (None, s)]

    def stats(self) -> list[TableStats]:
        return [t.stats() for t in self.tables()]

    def enforce_retention(self) -> None:
        """Retire the oldest chunks until the store fits its byte and age limits."""
        with self._lock:
            tables = list(self._tables.values())
            if self.max_age_s is not None:
                horizon = time.monotonic() - self.max_age_s
                for t in tables:
                    while (c := t.oldest_chunk()) is not None and c.sealed_at < horizon:
                        t.retire_oldest()
            total = sum(t.stored_bytes() for t in tables)
            while total > self.max_bytes:
                candidates = [(c.sealed_at, t) for t in tables if (c := t.oldest_chunk())]
                if not candidates:
                    break  # only pending rows left; they are bounded by chunk_rows
                _, victim = min(candidates, key=lambda pair: pair[0])
                chunk = victim.retire_oldest()
                total -= chunk.stored_bytes if chunk else 0
