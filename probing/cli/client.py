"""Talk to a probe: a transport (HTTP over a unix socket, or TCP to a peer;
the codec is ``probing.node.probe.http``) under a facade.

with ProbeClient.for_pid(1234) as probe:
    table = probe.query("SELECT count(*) FROM process.threads")
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from probing import config, paths, proc
from probing.errors import (
    AccessDenied,
    AttachError,
    NoProbe,
    NoSuchProcess,
    PeerUnreachable,
    ProbingError,
    QueryError,
    from_wire,
    no_such_pid,
)
from probing.guest import place
from probing.node.probe import http

# how long a client waits for the engine a live process's guest starts after
# the one that served it died (a guest notices at once; an engine starts in ~1 s)
ENGINE_RESTART_S = 5.0


def answer_timeout(timeout: float | None = None) -> float:
    """``timeout``, or how long to wait for a probe's answer by default
    (``PROBING_ANSWER_TIMEOUT_S``, 30 s)."""
    return config.load().answer_timeout_s if timeout is None else timeout


def check_peer(sock: socket.socket, path: str, pid: int | None, uid: int | None) -> None:
    """AccessDenied unless the server on ``sock`` is process ``pid`` run by ``uid``
    (``SO_PEERCRED``), checked before a byte is sent."""
    if pid is None and uid is None:
        return
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    got_pid, got_uid, _ = struct.unpack("3i", raw)
    # the process itself, or the node's engine that serves its probe (its user's)
    pid_ok = pid is None or got_pid == pid or place.is_engine(got_pid)
    if pid_ok and (uid is None or got_uid == uid):
        return
    want = f"process {pid}" if pid is not None else "the probe"
    raise AccessDenied(
        f"{path} is answered by pid {got_pid} (uid {got_uid}), not by {want}"
        + (f" (uid {uid})" if uid is not None else "")
        + ": refusing to send it anything",
        pid=pid,
        hint=f"another process may be impersonating the probe; remove {path} "
        f"if you trust its directory, then start the probe again with: probing inject --pid {pid}",
    )


class UnixTransport:
    """One HTTP request per call over the probe's unix socket."""

    def __init__(
        self,
        path: str,
        *,
        pid: int | None = None,
        uid: int | None = None,
        timeout: float | None = None,
    ) -> None:
        self.path = path
        self.pid = pid  # with uid: what SO_PEERCRED must say before anything is sent
        self.uid = uid
        self.timeout = answer_timeout(timeout)

    def request(self, method: str, url: str, body: bytes | None = None) -> tuple[int, str, bytes]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            self._connect(sock)
            check_peer(sock, self.path, self.pid, self.uid)  # before a byte is sent
            answer = http.exchange(sock, http.request_bytes(url, body or b"", None, method))
            return answer.status, answer.content_type, answer.body
        except PermissionError as err:
            raise AccessDenied(
                f"not allowed to open {self.path}",
                pid=self.pid,
                hint="run probing as the process's user or as root",
            ) from err
        except (FileNotFoundError, ConnectionRefusedError) as err:
            if self._guest_lives():
                raise NoProbe(
                    f"the node's engine that served pid {self.pid} stopped, and no new one "
                    f"answered in {ENGINE_RESTART_S:g} s",
                    pid=self.pid,
                    hint="its guest starts a new one: try again; if it was stopped on purpose "
                    f"(probing engine stop), start it with: probing inject --pid {self.pid}",
                ) from err
            raise NoProbe(
                f"no probe answers at {self.path}",
                pid=self.pid,
                hint="the process exited, or its probe was stopped",
            ) from err
        except TimeoutError as err:
            raise NoProbe(
                f"the probe of pid {self.pid} did not answer in {self.timeout:g} s", pid=self.pid
            ) from err
        except OSError as err:
            raise NoProbe(f"cannot talk to the probe at {self.path}: {err}", pid=self.pid) from err
        finally:
            sock.close()

    def _connect(self, sock: socket.socket) -> None:
        """Connect; where the engine that served a live process died, wait up to
        ``ENGINE_RESTART_S`` for the one its guest starts."""
        deadline = time.monotonic() + ENGINE_RESTART_S
        while True:
            try:
                sock.connect(self.path)
                return
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline or not self._guest_lives():
                    raise
                time.sleep(0.05)

    def _guest_lives(self) -> bool:
        """Whether the process lives and its guest answers: a probe socket
        that refuses is then an engine that died, not a process."""
        if self.pid is None or not proc.exists(self.pid):
            return False
        guest = os.path.join(os.path.dirname(self.path), f"{self.pid}.guest")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(0.3)
        try:
            probe.connect(guest)
            return True
        except OSError:
            return False
        finally:
            probe.close()

    def answers(self, timeout: float = 0.3) -> bool:
        """Whether something accepts a connection on the socket (a socket
        left by an earlier process with this pid accepts none)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(self.path)
            return True
        except OSError:
            return False
        finally:
            sock.close()

    def close(self) -> None:
        pass


class TcpTransport:
    """One HTTP request per call to a peer's TCP port, with the job's token."""

    pid = None

    def __init__(self, addr: str, token: str, *, timeout: float | None = None) -> None:
        from probing.node.cluster.identity import split_addr

        self.addr = addr
        self.host, self.port = split_addr(addr)
        self.token = token
        self.timeout = answer_timeout(timeout)

    def request(self, method: str, url: str, body: bytes | None = None) -> tuple[int, str, bytes]:
        from probing.node.probe import tls

        request = http.request_bytes(url, body or b"", self.token, method)
        secure = tls.client_context()  # PROBING_TLS_CERT: the peer port speaks TLS only
        try:
            with socket.create_connection((self.host, self.port), timeout=self.timeout) as raw:
                sock = raw if secure is None else secure.wrap_socket(raw)
                answer = http.exchange(sock, request)
            return answer.status, answer.content_type, answer.body
        except TimeoutError as err:
            raise PeerUnreachable(f"{self.addr} did not answer in {self.timeout:g} s") from err
        except OSError as err:
            raise PeerUnreachable(f"cannot reach the probe at {self.addr}: {err}") from err

    def close(self) -> None:
        pass


class ProbeClient:
    """One method per endpoint: ``health``, ``query``, ``tables``, ``cluster_query``..."""

    def __init__(self, transport: UnixTransport | TcpTransport) -> None:
        self.transport = transport

    @classmethod
    def for_addr(
        cls, addr: str, *, token: str | None = None, timeout: float | None = None
    ) -> ProbeClient:
        """The client of a peer probe's TCP port (``host:port``), with the job's
        token (``token``, else ``$PROBING_TOKEN``)."""
        token = token or config.load().token
        if not token:
            raise ProbingError(
                f"asking {addr} needs the job's token", hint="pass token= or set PROBING_TOKEN"
            )
        return cls(TcpTransport(addr, token, timeout=timeout))

    @classmethod
    def for_pid(cls, pid: int, *, timeout: float | None = None) -> ProbeClient:
        """The client of ``pid``'s probe; raises a clear error when there is none."""
        if pid <= 0:
            raise no_such_pid(pid, "{pid} is not a valid pid")
        try:
            path = paths.find_socket(pid)
        except paths.OtherUser as err:
            raise AccessDenied(
                str(err),
                pid=pid,
                hint="only its user or root can query, trace or list it: run probing as that user",
            ) from err
        except paths.UnsafePath as err:
            raise AccessDenied(
                f"refusing the probe socket of pid {pid}: {err}",
                pid=pid,
                hint="another user may have planted it: remove it if it is not yours, "
                "then start the probe again",
            ) from err
        if path is None:
            if not proc.exists(pid):
                raise no_such_pid(pid)
            from probing.procs import no_probe

            raise no_probe(pid)
        uid = paths.pid_owner(pid)
        if uid is None:  # exited: only its engine may answer for it, with what it left
            if not UnixTransport(path).answers():
                raise NoSuchProcess(f"process {pid} has exited (stale socket {path})", pid=pid)
            uid = os.getuid()
        return cls(UnixTransport(path, pid=pid, uid=uid, timeout=timeout))

    def _call(
        self, method: str, url: str, payload: dict[str, Any] | None = None
    ) -> tuple[str, bytes]:
        body = json.dumps(payload).encode() if payload is not None else None
        status, ctype, data = self.transport.request(method, url, body)
        if status == 200:
            return ctype, data
        try:
            err = json.loads(data)
            msg, kind = err.get("error", ""), err.get("type", "")
        except ValueError:
            err, msg, kind = {}, data.decode("utf-8", "replace"), ""
        detail = err.get("detail", "") if isinstance(err, dict) else ""
        raise from_wire(status, msg, kind, pid=self.transport.pid, detail=detail)

    def health(self) -> dict[str, Any]:
        return json.loads(self._call("GET", "/health")[1])

    def tables(self) -> list[dict[str, Any]]:
        return json.loads(self._call("GET", "/tables")[1])

    def query(self, sql: str) -> Any:
        """Run SQL in the probe; returns a ``pyarrow.Table``."""
        import pyarrow.ipc as ipc

        _, data = self._call("POST", "/query", {"sql": sql, "format": "arrow"})
        return ipc.open_stream(data).read_all()

    def query_raw(self, sql: str, fmt: str) -> bytes:
        """Run SQL; the probe's own rendering (``json`` or ``csv``) as bytes."""
        return self._call("POST", "/query", {"sql": sql, "format": fmt})[1]

    def query_rows(self, sql: str) -> tuple[list[str], list[list[Any]]]:
        """Run SQL; (column names, rows) without pyarrow here: values JSON
        has as they are, any other as its ``str()`` (a timestamp, a list), so
        ``render.format_table`` prints what it prints of ``query()``'s table.
        A probe older than the ``rows`` format is asked for Arrow instead."""
        try:
            data = self.query_raw(sql, "rows")
        except QueryError as err:
            if not str(err).startswith("unknown format 'rows'"):
                raise
            table = self.query(sql)
            cols = [table.column(i).to_pylist() for i in range(table.num_columns)]
            rows = [list(r) for r in zip(*cols, strict=True)] if cols else [[]] * table.num_rows
            return list(table.column_names), rows
        answer = json.loads(data)
        return answer["columns"], answer["rows"]

    def eval(self, code: str) -> dict[str, Any]:
        """Run Python in the target: ``{"result": repr or None, "output": str}``."""
        return json.loads(self._call("POST", "/eval", {"code": code})[1])

    def nvml(self, interval: str | None = None, *, stop: bool = False) -> dict[str, Any]:
        """Start (or re-time) GPU sampling, or stop it; returns ``nvml.status``."""
        payload: dict[str, Any] = {"stop": True} if stop else {"interval": interval or "100ms"}
        return json.loads(self._call("POST", "/nvml", payload)[1])

    def trace_start(
        self,
        families: list[str],
        *,
        output: str | None = None,
        stacks: bool = True,
        launch_stacks: bool = False,
    ) -> dict[str, Any]:
        """Start tracing in the probe; returns the tracer's status."""
        payload = {
            "families": families,
            "output": output,
            "stacks": stacks,
            "launch_stacks": launch_stacks,
        }
        return json.loads(self._call("POST", "/trace/start", payload)[1])

    def trace_stop(self) -> dict[str, Any]:
        return json.loads(self._call("POST", "/trace/stop", {})[1])

    def cluster_trace(
        self, action: str, *, timeout: float = 60.0, **options: Any
    ) -> list[dict[str, Any]]:
        """Start (``action="start"``, with ``families``, ``stacks``,
        ``launch_stacks``) or stop tracing on this probe and every peer (or
        ``ranks=[...]``); one row per rank: ``rank, node, addr, ok, done,
        state, reason``."""
        payload = {"action": action, "timeout": timeout, **options}
        wait = self.transport.timeout
        self.transport.timeout = max(wait, timeout + 10)  # the peers' answers come first
        try:
            return json.loads(self._call("POST", "/cluster/trace", payload)[1])
        finally:
            self.transport.timeout = wait

    def peers(self) -> list[dict[str, Any]]:
        """``probing.peers`` of this probe: every peer it knows, as it last saw it."""
        return json.loads(self._call("GET", "/peers")[1])

    def cluster_query(
        self, sql: str, *, timeout: float = 5.0, strict: bool = False, fanout: str = "auto"
    ) -> Any:
        """Have this probe run ``sql`` across every peer; returns a ``ClusterResult``."""
        from probing.node.cluster.query import ClusterResult
        from probing.node.cluster.wire import missing_from, timings_from, unpack

        payload = {"sql": sql, "timeout": timeout, "strict": strict, "fanout": fanout}
        _, data = self._call("POST", "/cluster/query", payload)
        try:
            head, tables = unpack(data)
        except (ValueError, KeyError) as err:
            raise ProbingError(f"the probe sent a malformed cluster answer: {err}") from err
        return ClusterResult(
            tables["result"],
            missing_from(head.get("missing", [])),
            timings_from(head.get("peers", [])),
            head.get("plan", {}),
        )

    def trace_status(self) -> dict[str, Any]:
        return json.loads(self._call("GET", "/trace/status")[1])

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> ProbeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cluster_query(
    sql: str,
    *,
    pid: int | None = None,
    addr: str | None = None,
    timeout: float = 5.0,
    strict: bool = False,
    token: str | None = None,
    fanout: str = "auto",
) -> Any:
    """Ask a probe to run ``sql`` across the job: the local probe of ``pid``
    (unix socket, no token) or a remote one at ``addr`` ("host:port", with
    ``token`` or ``$PROBING_TOKEN``). Peers that do not answer within
    ``timeout`` are listed in ``missing``; ``strict`` raises PeerUnreachable.
    Returns a ``probing.node.cluster.ClusterResult``.
    """
    if (pid is None) == (addr is None):
        raise ProbingError("cluster_query needs exactly one of pid= or addr=")
    if pid is not None:
        client = ProbeClient.for_pid(pid, timeout=timeout + 30)
    else:
        client = ProbeClient.for_addr(addr or "", token=token, timeout=timeout + 30)
    with client:
        return client.cluster_query(sql, timeout=timeout, strict=strict, fanout=fanout)


class JobClient:
    """The ranks of a job, asked together: local ``pids`` over their unix
    sockets (in parallel; each row tagged with the process's own rank), or
    with ``cluster`` (one local pid) or ``addr`` the cross-node query, where
    one probe asks every peer. What ``probing diagnose`` asks through."""

    def __init__(
        self,
        *,
        pids: Sequence[int] | None = None,
        addr: str | None = None,
        cluster: bool = False,
        timeout: float = 5.0,
    ) -> None:
        self.pids = list(pids or [])
        self.addr = addr
        self.cluster = cluster
        self.timeout = timeout

    @property
    def remote(self) -> bool:
        return self.cluster or self.addr is not None

    def ask(self, sql: str) -> Any:
        """``sql`` run in every rank; one table, each row tagged ``node`` and ``rank``."""
        import socket
        from concurrent.futures import ThreadPoolExecutor

        import pyarrow as pa

        from probing.analyze.gather import process_rank, tag

        if self.remote:
            return self._cluster(sql)
        if not self.pids:
            raise ProbingError("nothing to ask: give --pid (repeatable), --addr or --cluster")
        from probing.analyze.gather import launched_rank, with_missing

        node = socket.gethostname()
        pids = self.pids

        def one(i: int) -> pa.Table | ProbingError:  # the ranks answer in parallel
            try:  # local probes: the CLI's wait for an answer (the timeout is the peers')
                client = ProbeClient.for_pid(pids[i])
                rank = process_rank(client, pids[i])
                return tag(client.query(sql), node, rank if rank >= 0 else i)
            except ProbingError as err:  # one rank gone, stopped or refusing: asked with
                return err  # others, it is said not heard from, their answers kept

        with ThreadPoolExecutor(max_workers=min(16, len(pids))) as pool:
            parts = list(pool.map(one, range(len(pids))))
        tables = [p for p in parts if not isinstance(p, ProbingError)]
        if not tables:
            raise next(p for p in parts if isinstance(p, ProbingError))
        failed = [pid for pid, p in zip(pids, parts, strict=True) if isinstance(p, ProbingError)]
        gone = [f"pid {pid}: {p}" for pid, p in zip(pids, parts, strict=True) if pid in failed]
        ranks = [r for r in map(launched_rank, failed) if r is not None]
        table = pa.concat_tables(tables, promote_options="default")
        return with_missing(table, gone, ranks if len(ranks) == len(failed) else ())

    def _cluster(self, sql: str) -> Any:
        from probing.analyze.gather import with_missing

        if self.addr:
            res = cluster_query(sql, addr=self.addr, timeout=self.timeout)
        elif self.pids:
            res = cluster_query(sql, pid=self.pids[0], timeout=self.timeout)
        else:
            raise ProbingError("--cluster needs one local rank (--pid P) or a peer (--addr H:PORT)")
        # ranks that did not answer: the diagnosis says it works without them
        gone = [f"rank {m.rank} ({m.node or m.addr}): {m.reason}" for m in res.missing]
        return with_missing(res.table, gone, [m.rank for m in res.missing])

    def trace_starts_ns(self) -> list[int]:
        """When each local probe that traces started tracing."""
        starts = []
        for pid in self.pids:
            try:
                st = ProbeClient.for_pid(pid).trace_status()
            except ProbingError:
                continue
            if st.get("state") == "tracing" and st.get("started_ns"):
                starts.append(int(st["started_ns"]))
        return starts


def attach(
    pid: int,
    *,
    inject: bool,
    timeout: float | None = None,
    note: Callable[[str], None] | None = None,
) -> ProbeClient:
    """The client of ``pid``'s probe; with ``inject``, one is injected first
    when the process has none (or only a socket an earlier process with the
    same pid left behind), and ``note`` is told so."""
    timeout = answer_timeout(timeout)
    try:
        client = ProbeClient.for_pid(pid, timeout=timeout)
    except NoProbe:
        if not inject:
            raise
    else:
        # pids are reused: a socket left by an earlier process with this pid
        # (killed before it could remove it) answers nobody; start a probe here
        transport = client.transport
        if not inject or (isinstance(transport, UnixTransport) and transport.answers()):
            return client
    from probing.inject import inject as do_inject

    res = do_inject(pid, timeout=timeout)
    if not res.already and note is not None:
        note(f"probing: injected a probe into pid {pid} ({res.total_s:.2f} s)")
    return _served(pid, res.socket, res.engine_pid, timeout)


def _served(pid: int, socket_path: str, engine_pid: int, timeout: float) -> ProbeClient:
    """The client of the probe an engine just said it serves for ``pid``. Its
    socket may be gone for a moment (that engine stopped, and the guest hands
    the process to the next one): waited for ``timeout``, then a clear error."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ProbeClient.for_pid(pid, timeout=timeout)
        except NoProbe as err:
            if time.monotonic() > deadline:
                log = os.path.join(os.path.dirname(socket_path) or "?", "engine-*.log")
                raise AttachError(
                    f"the engine (pid {engine_pid}) took process {pid}, but its probe "
                    f"socket {socket_path or '?'} is gone",
                    pid=pid,
                    hint=f"what the engine did is in {log}; try again",
                ) from err
        time.sleep(0.05)


INFO_SQL = "SELECT pid, cmdline, python, python_executable FROM process.info"
STACK_SQL = "SELECT * FROM process.stacks ORDER BY tid, depth"


STACK_TIMEOUT_S = 5.0  # a probe slower than this is stuck: read from outside


def stacks(
    pid: int,
    *,
    inject: bool,
    timeout: float = STACK_TIMEOUT_S,
    note: Callable[[str], None],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(``process.info``, ``process.stacks`` rows) of ``pid``: asked of its
    probe (injected first with ``inject``); where there is none, injection
    fails or the probe does not answer in ``timeout`` (a thread holding the
    GIL in a C call), read from outside (``process_vm_readv``), and ``note``
    is told why. JSON all the way: no pyarrow here."""
    try:
        client = attach(pid, inject=inject, timeout=timeout, note=note)
        import threading

        # both asked at once: in a host whose thread spins in Python each
        # answer waits for the GIL, and the waits overlap (101 -> 80 ms)
        got: list[Any] = []

        def ask_info() -> None:
            try:
                got.append(client.query_raw(INFO_SQL, "json"))
            except Exception as err:  # handed on: raised below, in the caller's thread
                got.append(err)

        asked = threading.Thread(target=ask_info)
        asked.start()
        try:
            frames = json.loads(client.query_raw(STACK_SQL, "json"))
        finally:
            asked.join()
        if isinstance(got[0], Exception):
            raise got[0]
        info = json.loads(got[0])[0]
    except NoSuchProcess:
        raise
    except ProbingError as err:
        from probing.pyframes.outside import stacks_from_outside

        why = f"pid {pid} has no probe" if isinstance(err, NoProbe) and not inject else err
        note(f"probing: {why}; reading the stacks from outside")
        info, frames = stacks_from_outside(pid)
    return info, frames
