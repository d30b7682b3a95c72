"""``ProbeContext``: everything one probe owns, in one object.

The store, the database, the tracer, the NVML sampler, the cluster node
and the HTTP server of a probe live here, not in module globals: the HTTP
app, the table installers and the tracer are handed the context. Two
contexts in one process are two isolated probes (tests build them).

Parts are built on first use: a probe that is never asked builds no SQL
engine. The layers above the probe (``analyze``, ``cluster``) plug in
through ``installers`` and ``cluster`` (given by the node's assembler,
``probing.node.assemble``), so this module never imports them; a cluster
node registers its HTTP routes with the app before the socket opens.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from probing import config, paths
from probing.errors import ProbingError, log_unexpected, tell
from probing.node.probe.history import TraceHistory
from probing.target import Local, Target

if TYPE_CHECKING:
    from probing.node.bpf.tracer import Tracer
    from probing.node.probe.api import Member
    from probing.node.probe.server import UnixHTTPServer
    from probing.node.sql import Database
    from probing.node.store import Store
    from probing.node.tables.nvml import GpuSampler

# registers tables on a new database: (database, context)
Installer = Callable[["Database", "ProbeContext"], None]
# the cluster node of a context in cluster mode, or None (probing.node.cluster)
ClusterFactory = Callable[["ProbeContext"], "Member | None"]


def base_tables(database: Database, ctx: ProbeContext) -> None:
    """The tables of the layers under the probe (``probing.tables``)."""
    from probing.node.tables import install

    install(database, ctx)


class ProbeContext:
    """One probe: its parts and its lifecycle.

    ``serve()`` opens the unix socket (and the cluster node's TCP port);
    ``stop()`` closes them and keeps the data.
    """

    def __init__(
        self,
        *,
        installers: Sequence[Installer] = (base_tables,),
        cluster: ClusterFactory | None = None,
        store: Store | None = None,
        socket_path: str | None = None,
        target: Target | None = None,
    ) -> None:
        self.target: Target = target if target is not None else Local()
        self.pid = self.target.pid
        self.started_ns = time.time_ns()
        self.installers = tuple(installers)
        self.cluster_factory = cluster
        self.socket_path = socket_path or paths.socket_path(self.pid)
        self.queries = 0
        self.tracer: Tracer | None = None  # the last tracer started here
        self.history = TraceHistory()  # the traces before it (trace.intervals)
        # told what is traced after each start (families, options) and stop (None):
        # the engine keeps it, for the next engine to go on where this one was
        self.on_trace: Callable[[dict[str, Any] | None], None] | None = None
        self.cluster: Member | None = None  # a ClusterNode in cluster mode (probing.node.cluster)
        self.server: UnixHTTPServer | None = None
        self._store = store
        self._database: Database | None = None
        self._sampler: GpuSampler | None = None
        self._lock = threading.RLock()
        self._trace_lock = threading.Lock()
        self._stop_at_exit = False

    # -- parts, built on first use ----------------------------------------------------

    @property
    def store(self) -> Store:
        if self._store is None:
            with self._lock:
                if self._store is None:
                    from probing.node.store import Store

                    if self.target.local:
                        self._store = Store()
                    else:  # an engine's: named after its process, and what an
                        # engine before this one sealed for it taken over
                        self._store = Store(owner=self.pid)
                        self._store.adopt()
        return self._store

    @property
    def database(self) -> Database:
        """The database over every table, built on the first query."""
        if self._database is None:
            with self._lock:
                if self._database is None:
                    from probing.node.sql import Database

                    eng = Database(self.store)
                    for install in self.installers:
                        install(eng, self)
                    self._database = eng
        return self._database

    @property
    def database_loaded(self) -> bool:
        return self._database is not None

    @property
    def nvml(self) -> GpuSampler:
        """The NVML sampler writing ``nvml.gpu`` into this context's store."""
        if self._sampler is None:
            with self._lock:
                if self._sampler is None:
                    from probing.node.tables.nvml import GpuSampler

                    self._sampler = GpuSampler(self.store, self.target.environ, self.target.pid)
        return self._sampler

    # -- tracing ----------------------------------------------------------------------

    def start_trace(self, families: Sequence[str], **options: Any) -> Tracer:
        """Trace this process into this context's store (one tracer at a time)."""
        from probing.errors import AlreadyTracing, NoSuchProcess
        from probing.node.bpf.state import TracerState
        from probing.node.bpf.tracer import Tracer

        if not self.target.alive():  # a dead process's probe answers, but nothing runs
            raise NoSuchProcess(
                f"pid {self.pid} has exited: nothing to trace (what it recorded is kept)",
                pid=self.pid,
            )
        with self._trace_lock:
            current = self.tracer
            if current is not None and current.state is TracerState.TRACING:
                raise AlreadyTracing(
                    f"pid {self.pid} is already tracing "
                    f"({', '.join(f.name for f in current.families)}); stop it first",
                    hint=f"probing trace --pid {self.pid} --stop",
                )
            _ = self.database  # the tables exist before the first event arrives
            tracer = Tracer(families, store=self.store, target=self.target, **options)
            tracer.start()
            self.history.replaced(current)
            self.tracer = tracer
            if self.on_trace is not None:
                self.on_trace({"families": list(families), **options})
            if self.target.local and not self._stop_at_exit:  # detach before the interpreter goes
                atexit.register(self.stop_trace)
                self._stop_at_exit = True
            return tracer

    def stop_trace(self) -> Tracer | None:
        tracer = self.tracer
        if tracer is not None:
            tracer.stop()
            if self.on_trace is not None:
                self.on_trace(None)
        return tracer

    def trace_intervals(self) -> list[dict[str, Any]]:
        """When this process was traced (``trace.intervals``): each trace's
        start and stop, the current one open (``stop_ns`` NULL) while it
        traces, closed at the process's death if it died tracing."""
        return self.history.rows(self.tracer, getattr(self.target, "died_ns", None))

    # -- serving ----------------------------------------------------------------------

    def note_query(self) -> None:
        self.queries += 1

    def describe(self) -> dict[str, Any]:
        from probing.guest.place import VERSION, install

        try:
            about = self.target.about()
        except ProbingError:
            about = {}
        return {
            "pid": self.pid,
            "version": VERSION,
            "install": install(),  # the engine's: <version>@<its environment>
            "python": about.get("python"),
            "executable": about.get("executable"),
            "argv": about.get("argv", []),
            "alive": self.target.alive(),
            "engine_pid": os.getpid(),
            "started_ns": self.started_ns,
            "socket": self.socket_path,
            "database_loaded": self.database_loaded,
            "queries": self.queries,
            "cluster": self.cluster.describe() if self.cluster is not None else None,
        }

    @property
    def serving(self) -> bool:
        return self.server is not None

    def serve(self) -> None:
        """Open the unix socket; the cluster node and NVML start in the background."""
        from probing.node.probe.api import make_app
        from probing.node.probe.server import UnixHTTPServer

        app = make_app(self)
        node = self._cluster_node()
        self.cluster = node  # before the socket exists: a caller never sees it unset
        if node is not None:
            node.register(app.routes)  # its /cluster/* routes, before the socket exists
        server = UnixHTTPServer(self.socket_path, app)
        server.start()
        self.server = server
        if node is not None:
            node.start(server)
        interval = config.load().nvml_interval
        if interval:  # off the caller's thread: NVML and pyarrow load in the background
            threading.Thread(
                target=self._start_nvml, args=(interval,), name="probing-nvml-start", daemon=True
            ).start()

    def keep(self) -> None:
        """Seal the data and leave it, and what is traced, for the next engine
        of this process, which takes them over; then ``close``."""
        self.on_trace = None  # the engine's <pid>.trace stays as it is
        self.stop_trace()
        if self._store is not None:
            self._store.keep()
        self.close()

    def close(self) -> None:
        """Stop, and let go of the tables and their data (an engine retiring
        the probe of a process that exited)."""
        self.stop()
        database, self._database = self._database, None
        if database is not None:
            database.close()
        if self._store is not None:
            self._store.close()

    def stop(self) -> None:
        """Close the socket; the data stays (``serve()`` opens it again)."""
        server, self.server = self.server, None
        if server is not None:
            server.stop()
        if self.cluster is not None:  # its detector too (probing.node.detector)
            self.cluster.stop()

    def _cluster_node(self) -> Member | None:
        if self.cluster_factory is None:
            return None
        try:
            return self.cluster_factory(self)
        except (ProbingError, ValueError, OSError) as err:  # a bad PROBING_PEERS, no port
            tell(f"cluster mode off: {err}", self.pid)
            return None
        except Exception as err:  # a bug is logged, not raised: the probe serves without
            log_unexpected("cluster mode off", err)
            return None

    def _start_nvml(self, interval: str) -> None:
        try:
            from probing.config import parse_interval

            self.nvml.start(parse_interval(interval))
        except ValueError as err:  # a bad PROBING_NVML_INTERVAL (NVML's own errors: nvml.status)
            tell(f"NVML sampling not started: {err}", self.pid)
        except Exception as err:  # the top of a probe thread: a bug is logged
            log_unexpected("NVML sampling not started", err)
