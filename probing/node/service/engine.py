"""The engine process: probes for the processes guests hand it, their deaths."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import select
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from probing import config, log, proc
from probing.errors import ProbingError, log_unexpected
from probing.guest import place, wire
from probing.node.cluster.port import NodePort
from probing.node.probe.context import ProbeContext
from probing.node.probe.http import Request, Response
from probing.target import GuestProcess
from probing.worker import Worker, stop_on_signals

if TYPE_CHECKING:
    from probing.node.cluster.node import ClusterNode

TICK_S = 1.0

_log = logging.getLogger("probing.engine")


@dataclass
class Entry:
    ctx: ProbeContext
    target: GuestProcess
    pidfd: int
    died_at: float | None = None  # monotonic, once the process is gone


class Service:
    """The probes of one node's processes, in one engine process."""

    def __init__(self, directory: str | None = None, key: str | None = None) -> None:
        env = config.load()
        self.directory = directory or place.user_dir(root=env.runtime_dir)
        self.key = place.engine_key(dict(os.environ)) if key is None else key
        self.install = place.install()  # guests and clients of this install only
        self.keep_dead_s = env.keep_dead_s
        self.idle_s = env.engine_idle_s
        self.entries: dict[int, Entry] = {}
        self._lock = threading.Lock()
        self._attaching = threading.Lock()
        self._empty_since = time.monotonic()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        # the watch over the processes' deaths, on the engine's main thread (run):
        # each turn waits in poll(), which a stop wakes through the pipe
        self._watch = Worker("probing-engine", self._turn, 0.0, what="engine", wake=self._wake)
        self.server: Any = None
        self.port = NodePort(port=env.port or 0)  # the peers' one way in, bound on first use

    # -- the engine's own socket -------------------------------------------------------

    def app(self, req: Request) -> Response:
        if req.remote is not None:  # a peer, its token checked: to the process it names
            return self.port.route(req)
        if req.peer_uid not in (0, os.getuid()):
            return Response.error(403, "not this engine's user", "AccessDenied")
        try:
            if (req.method, req.path) == ("POST", "/attach"):
                args = json.loads(req.body)
                theirs = str(args.get("install") or "an older probing")
                if theirs != self.install:  # another version or install: never served here
                    return Response.error(409, _other_install(theirs, self.install), "AttachError")
                return Response.json(self.attach(int(args["pid"]), str(args["guest"])))
            if (req.method, req.path) == ("GET", "/health"):
                return Response.json(self.describe())
        except (ValueError, KeyError, TypeError) as err:
            return Response.error(400, f"bad request: {err}")
        except ProbingError as err:
            return Response.error(500, str(err))
        return Response.error(404, f"no {req.method} {req.path} on the engine")

    def describe(self) -> dict[str, Any]:
        with self._lock:
            arrow = sys.modules.get("pyarrow")
            return {
                "engine_pid": os.getpid(),
                "install": self.install,
                "peer_port": self.port.addresses(),  # one per host address it serves on
                # what Arrow's memory pool holds (a store retired gives it back)
                "arrow_bytes": arrow.total_allocated_bytes() if arrow is not None else 0,
                "processes": {
                    pid: {"alive": e.died_at is None, "socket": e.ctx.socket_path}
                    for pid, e in self.entries.items()
                },
            }

    def attach(self, pid: int, guest: str) -> dict[str, Any]:
        """A probe for ``pid`` (whose guest listens at ``guest``), serving its socket."""
        with self._attaching:  # one at a time: a guest may announce itself twice
            return self._attach(pid, guest)

    def _attach(self, pid: int, guest: str) -> dict[str, Any]:
        from probing.node.assemble import install_tables

        if pid == os.getpid() or place.is_engine(pid):  # never itself, nor another engine
            raise ProbingError(f"pid {pid} is an engine of probing, not a job's process")

        with self._lock:
            old = self.entries.get(pid)
        if old is not None and old.died_at is None and old.target.socket == guest:
            return {"engine_pid": os.getpid(), "socket": old.ctx.socket_path, "already": True}
        if old is not None:  # a pid reused, or a guest started again: the old probe goes
            _log.debug("pid %d: its old probe retired first (%s)", pid, old.target.socket)
            self._retire(pid)
        self._free_ports()
        pidfd = os.pidfd_open(pid)
        _log.info(f"attach pid {pid} ({guest})")
        target = GuestProcess(pid, guest)
        ctx = ProbeContext(installers=(install_tables,), cluster=self._cluster, target=target)
        state = place.trace_path(pid, self.directory)
        ctx.on_trace = lambda traced: _keep(state, traced)
        try:
            ctx.serve()
        except BaseException:
            os.close(pidfd)
            raise
        _log.debug("pid %d: serving %s", pid, ctx.socket_path)
        with self._lock:
            self.entries[pid] = Entry(ctx, target, pidfd)
        self._wake()
        resumed = _traced(state)
        _log.debug("pid %d: watched; %s", pid, f"resuming {state}" if resumed else "no trace kept")
        if resumed is not None:  # an engine before this one traced it: go on tracing
            threading.Thread(
                target=_resume, args=(ctx, resumed), name="probing-resume", daemon=True
            ).start()
        return {"engine_pid": os.getpid(), "socket": ctx.socket_path, "already": False,
                "resumed": resumed is not None}  # fmt: skip

    def _cluster(self, ctx: ProbeContext) -> ClusterNode | None:
        """``ctx``'s cluster node, reached by its peers through this engine's port."""
        from probing.node.assemble import cluster_node

        node = cluster_node(ctx)
        if node is not None:
            self.port.keep(node)
        return node

    def adopt(self) -> None:
        """Attach every live guest of this directory whose process runs with
        our settings: the guests that started this engine without waiting."""
        for name in os.listdir(self.directory):
            if not name.endswith(".guest") or not name[:-6].isdigit():
                continue
            pid = int(name[:-6])
            with self._lock:
                known = pid in self.entries
            if known or not self._ours(pid, os.path.join(self.directory, name)):
                continue
            try:
                self.attach(pid, os.path.join(self.directory, name))
            except (ProbingError, OSError) as err:  # gone meanwhile, or not ours
                _log.warning(f"guest of pid {pid} not adopted: {err}")

    def clean(self) -> None:
        """Remove what an engine of this user that was killed left behind: the
        sockets (``<pid>.sock``, ``<pid>.guest``, and one it was binding,
        ``<its pid>.bind-N``) and the chunk directories of processes that no
        longer exist, and only those."""
        from probing.node.store.store import chunk_base, pid_alive, remove_stale_roots

        gone = 0
        for name in os.listdir(self.directory):
            pid, dot, kind = name.partition(".")
            dead = pid.isdigit() and not pid_alive(int(pid))
            if dot and (kind in ("sock", "guest", "trace") or kind.startswith("bind-")) and dead:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, name))
                    gone += 1
        for base in {chunk_base(0), tempfile.gettempdir()}:
            remove_stale_roots(os.path.join(base, f"probing-{os.getuid()}"))
        if gone:
            _log.info(f"removed {gone} sockets of processes that no longer exist")

    def _ours(self, pid: int, guest: str) -> bool:
        """Whether the guest of ``pid`` is of this engine: the same install of
        probing (it says so), and a process run with this engine's settings."""
        env = proc.environ(pid)
        if not env or place.engine_key(env) != self.key:
            return False
        try:
            said = wire.request(guest, "GET", "/engine", None, timeout=2.0)
        except wire.WireError as err:
            # no answer: a host that holds the GIL (its guest cannot answer now)
            # is adopted on its environment's word; one that answered
            # something else (an older guest) is not
            return not err.status
        return bool(said.get("install") == self.install and said.get("key") == self.key)

    # -- deaths and retirement ------------------------------------------------------

    def watch(self) -> None:
        """Until stopped: a process that dies stops tracing (what it left stays
        queryable); one dead for ``keep_dead_s`` is retired; an engine with no
        process for ``idle_s`` stops."""
        self._watch.run()

    def _turn(self) -> None:
        """Wait ``TICK_S`` at most for a process's death or a wake-up (a new
        process, a stop), then tidy."""
        with self._lock:
            live = {e.pidfd: pid for pid, e in self.entries.items() if e.died_at is None}
        poll = select.poll()
        poll.register(self._wake_r, select.POLLIN)
        for fd in live:
            poll.register(fd, select.POLLIN)
        for fd, _ in poll.poll(TICK_S * 1000):
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            elif fd in live:
                self._died(live[fd])
        self._tidy()

    def _wake(self) -> None:
        """The watch's poll() returns at once (a new process to watch, a stop)."""
        os.write(self._wake_w, b"x")

    def _died(self, pid: int) -> None:
        with self._lock:
            entry = self.entries.get(pid)
        if entry is None or entry.died_at is not None:
            return
        entry.died_at = time.monotonic()
        entry.target.died_ns = time.time_ns()
        _log.info(
            f"pid {pid} exited: its tracing stops, what it left is kept {self.keep_dead_s:g} s"
        )
        # its peers still reach it through the engine's port: a cluster query gets
        # what it did last, marked dead (process.info.died_ns), until it is retired;
        # no thread works for it meanwhile (its detector's, its store's sealer)
        try:
            _quiet(entry)
        except Exception as err:  # one process's death never ends the engine
            log_unexpected(f"tracing of pid {pid} not stopped", err)

    def _free_ports(self) -> None:
        """A new process may be a dead rank started again, on the port the
        job lists for that rank (``PROBING_PEERS``): the dead ones with listed
        ports leave the job's peers (local queries go on). A rank found
        through the job's store publishes its new address instead."""
        with self._lock:
            dead = [e for e in self.entries.values() if e.died_at is not None]
        closing = []
        for e in dead:
            node, server = e.ctx.cluster, e.ctx.server
            if server is not None and _listed(node):
                server.close_tcp()
                closing.append(server)
        deadline = time.monotonic() + 2.0  # the loop closes them: before the new one binds
        while any(s.tcp_address is not None for s in closing) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _tidy(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [p for p, e in self.entries.items()
                   if e.died_at is not None and now - e.died_at > self.keep_dead_s]  # fmt: skip
        for pid in old:
            entry = self._retire(pid)
            if entry is not None:  # the killed process's guest left its socket behind
                with contextlib.suppress(OSError):
                    os.unlink(entry.target.socket)
        with self._lock:
            if self.entries:
                self._empty_since = now
            elif now - self._empty_since > self.idle_s:
                idle = now - self._empty_since
                _log.debug("no process for %.0f s (PROBING_ENGINE_IDLE_S %g): stopping",
                           idle, self.idle_s)  # fmt: skip
                self._watch.stop()  # after this turn (its own thread: no wait)

    def _retire(self, pid: int) -> Entry | None:
        """Its probe closed and its data dropped; the guest's socket is left
        alone (a live process, or a reused pid's new guest, still has it)."""
        with self._lock:
            entry = self.entries.pop(pid, None)
        if entry is None:
            return None
        t0 = time.monotonic()
        _stop_tracing(entry)
        entry.ctx.close()
        with contextlib.suppress(OSError):
            os.close(entry.pidfd)
        _give_back()
        _log.debug("pid %d: retired in %.2f s", pid, time.monotonic() - t0)
        return entry

    def stop(self) -> None:
        self._watch.stop()

    # -- running ---------------------------------------------------------------------

    def run(self) -> None:
        """Serve ``engine-<key>.sock`` until idle (the caller holds its lock)."""
        from probing.node.bpf.attach import keep_symbols_in
        from probing.node.probe.server import UnixHTTPServer
        from probing.node.service import warm  # not at import: `-m ...service.warm` runs it

        keep_symbols_in(os.path.join(self.directory, "symbols"), self.install)
        self.server = UnixHTTPServer(place.engine_path(self.directory, self.key), self.app)
        self.port.server = self.server
        self.server.start()
        self.clean()
        self.adopt()
        threading.Thread(target=_preload, name="probing-engine-load", daemon=True).start()
        warming = warm.warm_up(warm.FAMILIES, _log.info)  # the first trace finds them compiled
        try:
            self.watch()
        finally:
            if warming is not None:
                warming.stop()
            self.server.stop()
            self._shutdown()

    def _shutdown(self) -> None:
        """Every probe closed. A live process's sealed data and what it
        traced are left for its next engine, which takes them over (``adopt``,
        ``_resume``); a dead one's go with it."""
        with self._lock:
            live = {pid for pid, e in self.entries.items() if e.died_at is None}
        for pid in list(self.entries):
            if pid in live:
                try:
                    self.entries[pid].ctx.keep()
                except Exception as err:  # the others are kept still
                    log_unexpected(f"data of pid {pid} not kept", err)
            self._retire(pid)


def _keep(path: str, traced: dict[str, Any] | None) -> None:
    """What a process traces, kept beside its socket (``<pid>.trace``) for the
    engine after this one; removed when it stops tracing."""
    try:
        if traced is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        keep = {k: v for k, v in traced.items() if k != "output"}  # a file is written once
        tmp = f"{path}.{os.getpid()}"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(keep, f)
        os.replace(tmp, path)
    except OSError as err:  # tracing goes on; only a restart would not resume it
        _log.warning(f"trace state not kept at {path}: {err}")


def _traced(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) and got.get("families") else None


def _listed(node: object) -> bool:
    """Whether ``node`` is a cluster node on a port ``PROBING_PEERS`` lists."""
    from probing.node.cluster.node import ClusterNode

    return isinstance(node, ClusterNode) and bool(node.ident.peers)


def _resume(ctx: ProbeContext, traced: dict[str, Any]) -> None:
    """Trace ``ctx``'s process as the engine before this one did, and watch
    its job again (its cluster node joins on its own)."""
    options = {k: v for k, v in traced.items() if k in ("stacks", "launch_stacks")}
    try:
        ctx.start_trace([str(f) for f in traced["families"]], **options)
        if ctx.cluster is not None:
            ctx.cluster.ensure_watch()
        _log.info(f"pid {ctx.pid}: tracing resumed ({', '.join(traced['families'])})")
    except Exception as err:  # one process's resume never ends the engine
        _log.warning(f"pid {ctx.pid}: tracing not resumed: {err}")


def _give_back() -> None:
    """Return the memory a retired process's probe freed to the system: an
    engine runs for weeks, and glibc keeps what was freed in its arenas (its
    RSS would only grow with the jobs it served)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


def _other_install(theirs: str, ours: str) -> str:
    return (
        f"this engine serves probing {ours}, not {theirs}: a guest of another "
        "version or install gets an engine of its own (restart the process, or "
        "inject it with the probing it was started with)"
    )


def _quiet(entry: Entry) -> None:
    """A process exited: no thread works for it any more (its tracing, its
    detector's looks, its store's sealer: an engine serves hundreds of jobs,
    their threads must not add up); its rows stay queryable until retired."""
    ctx = entry.ctx
    ctx.stop_trace()
    watch = ctx.cluster.watch if ctx.cluster is not None else None
    if watch is not None:
        watch.stop()
    ctx.store.settle()


def _stop_tracing(entry: Entry) -> None:
    try:
        entry.ctx.stop_trace()
    except Exception as err:  # one process's stop never ends the engine
        log_unexpected(f"tracing of pid {entry.target.pid} not stopped", err)


def _unpin() -> None:
    """Run on any CPU the node lets us use, not on the core of the rank whose
    guest started us (a job that pins each rank to its cores would otherwise
    have the node's engine share one rank's core)."""
    try:
        with open("/sys/devices/system/cpu/online") as f:
            spans = [part.split("-") for part in f.read().strip().split(",") if part]
        cpus = {c for span in spans for c in range(int(span[0]), int(span[-1]) + 1)}
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError):  # a cpuset narrower than the node: keep what we were given
        pass


def _preload() -> None:
    """The database's libraries, loaded once for every process of the
    node before the first query needs them."""
    try:
        from probing.node.sql import Database
        from probing.node.store import Store

        Database(Store()).sql("SELECT 1")
    except Exception as err:  # the first query says it again
        log_unexpected("database not preloaded", err)


POOL_THREADS = 2  # the engine's native pools' threads: Arrow's CPU and I/O pools, DataFusion's


def _few_threads() -> None:
    """The native pools sized for a tracer, not for the node: Arrow's CPU
    pool and DataFusion's runtime take a thread per core (hundreds on a
    GPU node), Arrow's I/O pool eight, each started by whichever thread of
    ours first needs it. Before pyarrow or datafusion is loaded (tokio
    reads ``TOKIO_WORKER_THREADS`` when the runtime starts)."""
    os.environ.setdefault("TOKIO_WORKER_THREADS", str(POOL_THREADS))
    import pyarrow as pa

    pa.set_cpu_count(min(pa.cpu_count(), POOL_THREADS))
    pa.set_io_thread_count(min(pa.io_thread_count(), POOL_THREADS))


def main(argv: list[str] | None = None) -> None:
    """``python -m probing.node.service [--daemon]``: run the node's engine for this
    environment's settings unless one runs already (``engine-<key>.lock``);
    ``--daemon`` detaches first."""
    args = sys.argv[1:] if argv is None else argv
    settings = config.load()
    log.setup("engine", settings.log)
    directory = place.user_dir(root=settings.runtime_dir)
    place.ensure_private_dir(directory)
    if "--daemon" in args and os.fork() != 0:
        os._exit(0)  # the guest that started us reaps this parent at once
    key = place.engine_key(dict(os.environ))  # the guest gave us the settings it hashed
    _few_threads()
    lock = open(place.engine_path(directory, key, "lock"), "a")  # held for life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # another engine serves this node and user
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")  # who serves: `probing ps`, tests
    lock.flush()
    if "--daemon" in args:
        os.setsid()
        _log_to(place.engine_path(directory, key, "log"))
        _unpin()
    stopped = place.engine_path(directory, key, "stopped")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(stopped)  # guests start this engine again when it dies from now on
    service = Service(directory, key)

    def stop(*_: Any) -> None:  # stopped on purpose: its guests do not start another
        with contextlib.suppress(OSError):
            open(stopped, "w").close()  # a marker, empty
        service.stop()

    stop_on_signals(stop, (signal.SIGTERM,))  # never a lock in the handler itself
    service.run()


def _log_to(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
