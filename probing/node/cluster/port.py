"""The engine's one peer port: every rank it serves, reached through one TCP port.

A node's engine serves the probes of all its processes; their peers reach
them through one listening port per engine (``PROBING_PORT``, else one of
``peer_ports``: outside the ephemeral range, away from torchrun's 29500),
not one per process. A request names the process it is for
(``Probing-Pid``, which every peer's request carries) and is checked
against that process's job token, then answered by that process's probe.
A request that names none (``probing query --addr``) goes to a live
process of the job whose token it carries.

An exited process holds no port: what it left stays reachable through the
engine's port until the engine retires it (``forget``). An engine takes the
first free port of ``PROBING_PORT_RANGE`` (``DEFAULT_RANGE``), else any
free one (another engine of the node holds each: another user, install or
set of settings); the address peers use is the one published, never
guessed. The agent's port (``PROBING_AGENT_PORT``, 9978) is outside that
range and never taken even where a range is set to hold it: with a second
engine on the node, "the next free" of 9977 was 9978, and the agent could
not start. An explicit ``PROBING_PORT`` is bound as given.

A port a daemon of ours cannot bind (the agent's, the UI's, MCP's, an
explicit ``PROBING_PORT``) is one ``PortHeld`` line naming who holds it
(``holder``: its pid and command, from ``/proc/net/tcp{,6}`` and the
processes' descriptors), never a traceback.

Ranks of one engine answer each other in-process (``sibling``): the
fan-out asks each other node once (``probing.node.cluster.fanout``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import socket
import threading
from _operator import _compare_digest
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from probing import config, proc
from probing.errors import ProbingError
from probing.node.probe.access import bearer
from probing.node.probe.http import App, Request, Response

# 32 ports below the ephemeral range (32768-60999), away from torchrun's 29500 and
# above the agent's 9978: an engine of each user, install and set of settings
DEFAULT_RANGE = (9979, 10010)
PID_HEADER = "probing-pid"
LISTEN = "0A"  # a TCP socket's state in /proc/net/tcp: listening
COMMAND_CHARS = 120  # of a holder's command line in the one line that names it


class PortHeld(ProbingError):
    """A port one of our daemons must serve on is another process's."""


def peer_ports(settings: config.Config | None = None) -> list[int]:
    """The ports an engine tries for its peers, in order: ``PROBING_PORT_RANGE``
    (``DEFAULT_RANGE`` where it is not ``first-last``), less the agent's port."""
    s = config.load() if settings is None else settings
    first, last = port_range(s.port_range)
    return [p for p in range(first, last + 1) if p != s.agent_port]


def port_range(text: str) -> tuple[int, int]:
    """``"first-last"`` as two ports (a bad value: ``DEFAULT_RANGE``: a
    setting read in an engine is never a reason to stop it)."""
    lo, sep, hi = text.strip().partition("-")
    if not (sep and lo.strip().isdigit() and hi.strip().isdigit()):
        return DEFAULT_RANGE
    first, last = int(lo), int(hi)
    return (first, last) if 0 < first <= last < 65536 else DEFAULT_RANGE


def holder(port: int) -> str:
    """Who holds TCP ``port`` on this node, in words: ``pid N (command)``
    where its descriptors can be read (ours, or any as root), else its
    user; "" where no socket of the node is bound to it (any more)."""
    sockets = _bound(port)
    if not sockets:
        return ""
    inodes = {inode for inode, _ in sockets}
    for pid in _pids():
        if _holds(pid, inodes):
            return f"pid {pid} ({_command(pid)})"
    uid = sockets[0][1]
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = f"uid {uid}"
    return f"a process of user {name} (uid {uid}), whose descriptors we cannot read"


def _bound(port: int) -> list[tuple[str, int]]:
    """(inode, uid) of each socket bound to ``port``, listening ones first."""
    listening: list[tuple[str, int]] = []
    other: list[tuple[str, int]] = []
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = proc.node(table).splitlines()[1:]
        except OSError:  # no IPv6 on this node
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or not f[1].rpartition(":")[2]:
                continue
            if int(f[1].rpartition(":")[2], 16) != port or f[9] == "0":
                continue
            (listening if f[3] == LISTEN else other).append((f[9], int(f[7])))
    return listening + other


def _pids() -> list[int]:
    return sorted(int(p) for p in os.listdir(proc.ROOT) if p.isdigit())


def _holds(pid: int, inodes: set[str]) -> bool:
    try:
        fds = os.listdir(proc.path(pid, "fd"))
    except OSError:  # gone, or another user's
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            link = proc.readlink(pid, f"fd/{fd}")
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
    return False


def _command(pid: int) -> str:
    try:
        argv = proc.read_bytes(pid, "cmdline").split(b"\0")
        text = " ".join(a.decode(errors="replace") for a in argv if a)
    except OSError:
        return "?"
    return text if len(text) <= COMMAND_CHARS else text[: COMMAND_CHARS - 3] + "..."


def cannot_bind(what: str, host: str, port: int, err: OSError, hint: str) -> ProbingError:
    """The one line a daemon says when it cannot bind ``host:port``: who
    holds it (``PortHeld``), else the system's reason."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if err.errno == errno.EADDRINUSE and port:
        who = holder(port)
        if who:
            return PortHeld(f"{what} cannot listen on {where}: held by {who}", hint=hint)
    return ProbingError(f"{what} cannot listen on {where}: {err.strerror or err}", hint=hint)


def check_free(what: str, host: str, port: int, hint: str) -> None:
    """Raise what ``cannot_bind`` says where ``host:port`` cannot be bound now:
    a daemon (``probing ui``, ``probing mcp --http``) says so before the slow
    part of its start, not after it. Port 0 (any free one) always can."""
    if not port:
        return
    bare = host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in bare else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the daemon binds
        try:
            sock.bind((bare, port))
        except OSError as err:
            raise cannot_bind(what, host, port, err, hint) from None


@dataclass
class Served:
    """One process reached through the port: its cluster node and probe's app."""

    node: Any  # probing.node.cluster.node.ClusterNode
    app: App


class NodePort:
    """One TCP listener per host address, shared by every probe of an engine.

    ``server`` is the engine's ``UnixHTTPServer``, whose app hands TCP
    requests to ``route``; ``serve`` adds a process, ``forget`` drops it.
    """

    def __init__(self, server: Any = None, port: int = 0, first: int | None = None) -> None:
        self.server = server
        self.port = port  # 0: the first free one of ``peer_ports()``, else any free one
        self.first = first  # 0: any free one at once (tests)
        self._bound: dict[str, tuple[str, int]] = {}  # host -> where it listens
        self._served: dict[int, Served] = {}
        self._kin: dict[int, Any] = {}  # pid -> the cluster node of each process, joined or not
        self._lock = threading.Lock()

    def serve(self, node: Any, app: App, host: str) -> str:
        """Reach ``node``'s process (its ``pid`` and ``token``) through this
        port on ``host`` (bound on first use); returns the address to publish."""
        with self._lock:
            bound = self._bound.get(host)
            if bound is None:
                bound = self._listen(host)
                self._bound[host] = bound
            self._served[node.pid] = Served(node, app)
        return f"{bound[0]}:{bound[1]}"

    def _listen(self, host: str) -> tuple[str, int]:
        if self.port:
            ports = [self.port]
        else:
            ports = [0] if self.first == 0 else [*peer_ports(), 0]
        failed: tuple[int, OSError] | None = None
        for port in ports:
            try:
                bound: tuple[str, int] = self.server.listen_tcp(host, port, self.token_for)
                return bound
            except OSError as err:  # another engine of this node holds it
                failed = (port, err)
        assert failed is not None  # ports is never empty
        hint = "set PROBING_PORT to a free port, or leave it out for one of PROBING_PORT_RANGE"
        raise cannot_bind("the engine (its peers' port)", host, *failed, hint)

    def keep(self, node: Any) -> None:
        """``node``'s process is served by this engine, joined to its job or not
        (``kin``: its job's other ranks here find it without the job's store);
        its peers reach it through this port."""
        node.port = self
        with self._lock:
            self._kin[node.pid] = node

    def forget(self, pid: int) -> None:
        """``pid``'s probe is retired: nothing of it is reached any more."""
        with self._lock:
            self._served.pop(pid, None)
            self._kin.pop(pid, None)

    def sibling(self, pid: int) -> Any:
        """The cluster node of ``pid`` when this engine serves it, else None."""
        with self._lock:
            served = self._served.get(pid)
            return self._kin.get(pid) if served is None else served.node

    def kin(self, node: Any) -> list[Any]:
        """The cluster nodes of the other live ranks of ``node``'s job this
        engine serves (the same store, run and size; a dead process's may be
        an earlier job's on the same address): found where the job's store is
        not (gone with the rank that held it, or never reached)."""
        ident = node.ident
        if ident.master is None:
            return []
        with self._lock:
            nodes = list(self._kin.values())
        job = (ident.master, ident.run_id, ident.world_size)
        return [k for k in nodes if k is not node and k.rank >= 0 and proc.running(k.pid)
                and (k.ident.master, k.ident.run_id, k.ident.world_size) == job]  # fmt: skip

    def addresses(self) -> list[str]:
        with self._lock:
            return [f"{h}:{p}" for h, p in self._bound.values()]

    # -- a request: whose it is, whether its token is that one's --------------------

    def _target(self, headers: Mapping[str, str]) -> Served | None:
        """The process a request is for: the one it names, else a live one
        (lowest rank first) of the job whose token it carries."""
        named = headers.get(PID_HEADER, "").strip()
        with self._lock:
            if named:
                return self._served.get(int(named)) if named.isdigit() else None
            given = bearer(headers)
            if not given:
                return None
            mine = [s for s in self._served.values() if s.node.token
                    and _compare_digest(given, s.node.token)]  # fmt: skip
        from probing.node.store.store import pid_alive

        mine.sort(key=lambda s: (not pid_alive(s.node.pid), s.node.rank))
        return mine[0] if mine else None

    def token_for(self, headers: Mapping[str, str]) -> bytes | None:
        """The token a TCP request must carry (``Access``): its process's job's."""
        served = self._target(headers)
        return None if served is None else served.node.token

    def route(self, req: Request) -> Response:
        """A TCP request (its token checked already), answered by its process's probe."""
        served = self._target(req.headers or {})
        if served is None:
            msg = "no such process on this node's engine (retired once exited, or never traced)"
            return Response.error(404, msg, "PeerUnreachable")
        return served.app(req)
