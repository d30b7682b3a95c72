"""The probe's lifecycle inside the host process: enable, disable, fork."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from probing import __version__
from probing.probe import paths
from probing.probe.imports import settle
from probing.probe.server import UnixHTTPServer


class Probe:
    """One per process: a unix-socket HTTP server and a lazily built engine.

    The SQL engine (datafusion, pyarrow) is imported on the first query, so
    an idle probe adds a thread blocked in ``select`` and little memory.
    """

    def __init__(self, *, cluster: bool = True) -> None:
        self.pid = os.getpid()
        self.started_ns = time.time_ns()
        self.socket_path = paths.socket_path(self.pid)
        self.queries = 0
        self.cluster: Any = None  # a ClusterNode in cluster mode (probing.cluster)
        self._want_cluster = cluster
        from probing.probe.api import make_app

        self.server = UnixHTTPServer(self.socket_path, make_app(self))

    @property
    def engine(self) -> Any:
        return engine()

    def note_query(self) -> None:
        self.queries += 1

    def describe(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "version": __version__,
            "python": sys.version.split()[0],
            "executable": sys.executable,
            "argv": list(sys.argv),
            "started_ns": self.started_ns,
            "socket": self.socket_path,
            "engine_loaded": _engine is not None,
            "queries": self.queries,
            "cluster": self.cluster.describe() if self.cluster is not None else None,
        }

    def start(self) -> None:
        node = self._cluster_node() if self._want_cluster else None
        self.cluster = node  # before the socket exists: a caller never sees it unset
        self.server.start()
        if node is not None:
            node.start(self.server)
        interval = os.environ.get("PROBING_NVML_INTERVAL")
        if interval:  # off the caller's thread: NVML and pyarrow load in the background
            threading.Thread(
                target=_start_nvml, args=(interval,), name="probing-nvml-start", daemon=True
            ).start()

    def stop(self) -> None:
        self.server.stop()

    def _cluster_node(self) -> Any:
        """Cluster mode when this is a rank of a multi-process job or PROBING_PEERS
        is set (None otherwise); its TCP port and publication start in the background."""
        try:
            from probing.cluster import identity

            if not identity.cluster_wanted():
                return None
            from probing.cluster.node import ClusterNode

            return ClusterNode(identity.from_env(), engine, pid=self.pid)
        except Exception as err:  # a bad PROBING_PEERS never reaches the host
            try:
                print(f"probing: cluster mode off: {err}", file=sys.stderr)
            except Exception:
                pass
            return None


def _start_nvml(interval: str) -> None:
    try:
        settle()  # NVML and pyarrow load only once the host imports nothing
        from probing.tables import nvml

        nvml.sampler().start(nvml.parse_interval(interval))
    except Exception as err:  # a bad value or a broken NVML never reaches the host
        try:
            print(f"probing: NVML sampling not started: {err}", file=sys.stderr)
        except Exception:
            pass


_probe: Probe | None = None
_lock = threading.Lock()


def current() -> Probe | None:
    return _probe


def enable() -> Probe:
    """Start this process's probe if it is not running; return it."""
    global _probe
    with _lock:
        if _probe is None:
            probe = Probe()
            probe.start()
            _probe = probe
        return _probe


def disable() -> None:
    global _probe
    with _lock:
        probe, _probe = _probe, None
    if probe is not None:
        probe.stop()


_engine: Any = None
_engine_lock = threading.Lock()
LOAD_SWITCH_INTERVAL_S = 0.0005


@contextlib.contextmanager
def quick_gil_handoff() -> Iterator[None]:
    """A shorter GIL switch interval while the probe loads its modules.

    In a host whose thread spins in Python, every file read of an import
    hands the GIL over and waits a whole switch interval (5 ms) to get it
    back: hundreds of reads turn a 0.4 s import into seconds. The host's
    own interval comes back afterwards (unless it changed it meanwhile).
    """
    old = sys.getswitchinterval()
    sys.setswitchinterval(min(old, LOAD_SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        if sys.getswitchinterval() == min(old, LOAD_SWITCH_INTERVAL_S):
            sys.setswitchinterval(old)


def engine() -> Any:
    """This process's SQL engine, built on first use (with or without a probe)."""
    global _engine
    if _engine is None:
        with _engine_lock:
            if _engine is None:
                with quick_gil_handoff():
                    from probing.engine import Engine
                    from probing.tables import install

                    eng = Engine()
                    install(eng)
                _engine = eng
    return _engine


def _after_fork_in_child() -> None:
    """The child never inherits a half-working probe: it gets none, or its own.

    The parent's server thread does not exist here; its socket belongs to the
    parent. Drop both and re-create every lock (a lock held by another thread
    at fork time would stay held forever). A forked child (a DataLoader
    worker, a subprocess before its exec) gets no probe of its own: the
    parent is the process users trace. ``PROBING_FORK=child`` starts a fresh
    probe on the child's pid. The store handles its own fork
    (``probing.store.store``).
    """
    global _probe, _lock, _engine_lock
    _lock = threading.Lock()
    _engine_lock = threading.Lock()
    parent, _probe = _probe, None
    try:
        if parent is None:
            return
        parent.server.abandon_after_fork()
        if os.environ.get("PROBING_FORK", "none").strip().lower() != "child":
            return
        # shares the engine (DataFusion survives fork, tables are copied);
        # no cluster mode: the parent is the job's peer for this rank
        child = Probe(cluster=False)
        child.start()
        _probe = child
    except Exception as err:  # never break the child
        try:
            print(f"probing: no probe in forked child {os.getpid()}: {err}", file=sys.stderr)
        except Exception:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)
