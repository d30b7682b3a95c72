"""The engine's one peer port: every rank it serves, reached through one TCP port.

A node's engine serves the probes of all its processes; their peers reach
them through one listening port per engine (``PROBING_PORT``, default
``DEFAULT_PORT``: outside the ephemeral range, away from torchrun's 29500),
not one per process. A request names the process it is for
(``Probing-Pid``, which every peer's request carries) and is checked
against that process's job token, then answered by that process's probe.
A request that names none (``probing query --addr``) goes to a live
process of the job whose token it carries.

An exited process holds no port: what it left stays reachable through the
engine's port until the engine retires it (``forget``). A busy default
port moves the engine to the next free one of ``SPAN`` (another engine of
the node holds it: another user, install or set of settings); the address
peers use is the one published, never guessed. An explicit ``PROBING_PORT``
is bound as given.

Ranks of one engine answer each other in-process (``sibling``): the
fan-out asks each other node once (``probing.node.cluster.fanout``).
"""

from __future__ import annotations

import threading
from _operator import _compare_digest
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from probing.errors import ProbingError
from probing.node.probe.access import bearer
from probing.node.probe.http import App, Request, Response

DEFAULT_PORT = 9977  # below the ephemeral range (32768-60999), away from 29500
SPAN = 32  # default ports tried, from DEFAULT_PORT on, before any free one
PID_HEADER = "probing-pid"


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

    def __init__(self, server: Any = None, port: int = 0, first: int = DEFAULT_PORT) -> None:
        self.server = server
        self.port = port  # 0: ``first``, else the next free one (first=0: any free one)
        self.first = first
        self._bound: dict[str, tuple[str, int]] = {}  # host -> where it listens
        self._served: dict[int, Served] = {}
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
        ports = [self.port] if self.port else [*range(self.first, self.first + SPAN), 0]
        last: OSError | None = None
        for port in ports:
            try:
                bound: tuple[str, int] = self.server.listen_tcp(host, port, self.token_for)
                return bound
            except OSError as err:  # another engine of this node holds it
                last = err
        raise ProbingError(f"cannot listen on {host} for the peers: {last}")

    def forget(self, pid: int) -> None:
        """``pid``'s probe is retired: nothing of it is reached any more."""
        with self._lock:
            self._served.pop(pid, None)

    def sibling(self, pid: int) -> Any:
        """The cluster node of ``pid`` when this engine serves it, else None."""
        with self._lock:
            served = self._served.get(pid)
        return None if served is None else served.node

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
