"""This probe as a cluster peer: who it is in the job, and the parts that ask and answer.

``ClusterNode`` owns this peer's membership: its identity (learned from the
job's default process group when the environment does not name the rank),
its token, its TCP port and its publication, and the peers it discovered.
In a node's engine the TCP port is the engine's, shared by every process
it serves (``probing.node.cluster.port``); elsewhere the probe binds one.
``ClusterNode.start`` returns at once; a short-lived background thread
reads the token, takes the TCP port and publishes the address, then ends.
Nothing runs between queries: no heartbeat, no polling. The peers' state
in ``probing.peers`` is what discovery published and what the last
cluster query measured.

The rest has one owner each, functions that take the node; the node holds
none of them. The probe's HTTP app, which does not import the cluster,
gets the cluster's routes when its node registers them (``register``:
``endpoints.register`` puts ``/cluster/*`` into the app's ``Routes``) and
sees the node through its ``Member`` Protocol
(``probing.node.probe.api``); the detector asks the job through the
node's ``coordinate`` and ``control``:

* ``share``: this peer's share of a query, its tables tagged (SQL text: ``plan``);
* ``fanout``: asking peers at once, retries, deadlines (``PeerFailure``);
  ``control``, the same request to every peer;
* ``coordinator``: one query end to end, and a gatherer's answer;
* ``endpoints``: the ``/cluster/*`` requests and answers over HTTP;
* the always-on detector (``probing.node.detector``), made at the first
  trace by the factory the node's assembler gives (``detector``).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from probing import config
from probing.errors import ProbingError
from probing.node.cluster import coordinator, endpoints, fanout, join
from probing.node.cluster.discovery import (
    ENGINE,
    STORE_TIMEOUT_S,
    PeerInfo,
    Registry,
    StoreDirectory,
    static_peers,
)
from probing.node.cluster.identity import (
    Identity,
    job_address,
    known,
    learned,
    split_addr,
    token_from_env,
)
from probing.node.cluster.share import Share
from probing.worker import named

if TYPE_CHECKING:
    import pyarrow as pa

    from probing.node.cluster import plan as planner
    from probing.node.cluster.fanout import Collected
    from probing.node.cluster.port import NodePort
    from probing.node.probe.api import Detector, Routes
    from probing.node.probe.server import UnixHTTPServer
    from probing.node.sql import Database


class ClusterNode:
    """One peer: its identity, its peers, its token, its share, its detector."""

    def __init__(
        self,
        ident: Identity,
        database: Callable[[], Database],
        *,
        token: bytes | None = None,
        pid: int | None = None,
        learn: Callable[[], Mapping[str, Any] | None] | None = None,
    ) -> None:
        self.ident = ident
        # where rank, size and store come from when the environment does not
        # say (``Target.distributed``): None once known
        self.learn = None if known(ident) else learn
        self.database = database
        self.token = token
        self.pid = pid if pid is not None else os.getpid()
        self.rank = ident.rank
        self.addr: str | None = None
        self.registry = Registry()
        self.directory = StoreDirectory(ident) if ident.master and not ident.peers else None
        self.ready = threading.Event()  # set once the first attempt to join is over
        self.error: str | None = None
        self.published = False
        self._server: UnixHTTPServer | None = None
        # the engine's one peer port (``probing.node.cluster.port``), shared by
        # every process it serves; None: this probe listens on a port of its own
        self.port: NodePort | None = None
        self._join_lock = threading.Lock()
        self.share = Share(self)  # my share of a query, and what it caches
        self.watch: Detector | None = None  # the always-on detector, once made
        # makes it (``probing.node.detector.watch.Watch``: given by the node's assembler)
        self.detector: Callable[[], Detector] | None = None
        # my tracer's collectives ended since a cursor, as the detector asks
        # them of a peer, with no SQL: (since_ns, cursor_ns) -> rows, or None
        # where it cannot say (``probing.node.assemble``)
        self.recent: Callable[[int, int], pa.Table | None] | None = None
        # ... and my sampler's RUNQ_SQL rows from since_ns, the same way
        self.waits: Callable[[int], pa.Table | None] | None = None
        if self.learn is not None:
            self.error = join.WAITING

    def describe(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.ident.world_size,
            "node": self.ident.node,
            "addr": self.addr,
            "published": self.published,  # the address is where the others read it
            "source": self.ident.source,
            # the job's rendezvous (its process group's store), "host:port"; None: not known
            "store": "{}:{}".format(*self.ident.master) if self.ident.master else None,
            "peers": len(self.registry.peers()),
            "error": self.error,
        }

    # -- start-up: joining the job, however late its store comes ---------------
    def register(self, routes: Routes) -> None:
        """This node's endpoints (``/cluster/*``), routed in its probe's app."""
        endpoints.register(self, routes)

    def start(self, server: UnixHTTPServer) -> None:
        """Join in the background; the host never waits on the network."""
        self._server = server
        threading.Thread(target=named("probing-cluster", join.run), args=(self,),
                         name="probing-cluster", daemon=True).start()  # fmt: skip

    @property
    def learning(self) -> bool:
        """Still waiting for the job to say who this process is."""
        return self.learn is not None

    def take_rank(self, dist: Mapping[str, Any]) -> None:
        """The job's default process group (``dist``: its rank, world size and
        store) says who this process is: from now on, that rank of the job."""
        self.ident = learned(self.ident, dist)
        self.rank = self.ident.rank
        if self.ident.master is not None:
            self.directory = StoreDirectory(self.ident)
        self.learn = None

    def setup(self, server: UnixHTTPServer) -> None:
        """Join now (blocking; tests and the benchmark call it directly)."""
        self._server = server
        try:
            if not self.try_join(STORE_TIMEOUT_S):
                raise ProbingError(self.error or "cannot join the job")
        finally:
            self.ready.set()

    def try_join(self, budget: float) -> bool:
        """One attempt at each step not done yet: token, TCP port, publication.

        Returns whether this probe is in the job now; False (and ``error``
        says why) while the store does not answer. Raises ``ProbingError``
        when it never will (no token, no listed address to bind).
        """
        with self._join_lock:
            if self.published:
                return True
            try:
                self._join_steps(budget)
            except OSError as err:  # the store is not there (yet): try again later
                self.error = f"rendezvous store: {err}"
                return False
            self.error = None
            return True

    def _join_steps(self, budget: float) -> None:
        ident = self.ident
        if self.token is None:
            self.token = token_from_env()
        if self.token is None and self.directory is not None:
            self.token = self.directory.token(budget)
        if not self.token:
            raise ProbingError(
                "no token for the peer port", hint="set PROBING_TOKEN (the same for every peer)"
            )
        assert self._server is not None  # given by start or setup
        if ident.peers:
            self._listen_listed(self._server)
            for info in static_peers(ident, self.rank, self.pid):
                self.registry.upsert(info)
            self.published = True
            return
        if self.addr is None:
            host = config.load().host or job_address(ident.master)
            if self.port is not None:
                self.addr = self.port.serve(self, self._server.app, host)
            else:
                bound = self._server.listen_tcp(host, ident.port, self.token)
                self.addr = f"{bound[0]}:{bound[1]}"
            me = PeerInfo(
                self.rank, ident.node, self.addr, self.pid, "torchrun", time.time_ns(), "self"
            )
            self.registry.upsert(me)
        if self.directory is not None:
            me = next(p for p in self.registry.peers() if p.rank == self.rank)
            self.directory.publish(me, budget)
        self.published = True
        self._read_store(budget)  # whoever published before me

    def _listen_listed(self, server: UnixHTTPServer) -> None:
        """Bind my entry of PROBING_PEERS: ``RANK``'s, else the first I can bind."""
        ident = self.ident
        order = [self.rank] if 0 <= self.rank < len(ident.peers) else range(len(ident.peers))
        last: OSError | None = None
        assert self.token is not None  # read before the port is taken
        for i in order:
            host, port = split_addr(ident.peers[i])
            try:
                server.listen_tcp(host, port, self.token)
            except OSError as err:
                last = err
                continue
            self.rank, self.addr = i, ident.peers[i]
            return
        raise ProbingError(f"cannot listen on any PROBING_PEERS address: {last}")

    # -- discovery ------------------------------------------------------------
    def refresh(self, budget: float = 2.0) -> None:
        """Join if not yet, and re-read the store (within ``budget`` s); when it
        is gone, what was known stays."""
        if self.directory is None:
            return
        if not self.published:
            try:
                if not self.try_join(budget):
                    return
            except ProbingError:
                return
        self._read_store(budget)

    def _read_store(self, budget: float) -> None:
        if self.directory is None:
            return
        try:
            for info in self.directory.read(budget):
                if info.rank != self.rank:
                    self.registry.upsert(info)
        except OSError as err:
            self.error = f"rendezvous store: {err}"

    def others(self) -> list[PeerInfo]:
        """The job's other ranks: those the store listed, and those of its
        ranks this engine serves that it did not (``NodePort.kin``)."""
        known = [p for p in self.registry.peers() if p.rank != self.rank]
        if self.port is not None:
            have = {p.rank for p in known} | {self.rank}
            known += [PeerInfo(k.rank, k.ident.node, k.addr or "", k.pid, ENGINE)
                      for k in self.port.kin(self) if k.rank not in have]  # fmt: skip
        return known

    def peers_table(self) -> pa.Table:
        """``probing.peers``: the peers known, as the last query measured them."""
        return self.registry.table()

    # -- what the detector asks of the job ------------------------------------------
    def coordinate(self, sql: str, *, timeout: float) -> tuple[pa.Table, Collected, planner.Plan]:
        """``sql`` over every rank of the job (``coordinator.coordinate``)."""
        return coordinator.coordinate(self, sql, timeout=timeout)

    def collectives_since(
        self, sql: str, since_ns: int, cursor_ns: int, *, timeout: float
    ) -> tuple[pa.Table, Collected] | None:
        """The detector's ask of the job's collectives (``sql``: those from
        ``since_ns`` ended from ``cursor_ns`` on, or in flight): the ranks
        this engine serves, me among them, from what their tracers keep
        (``recent``: no SQL, no HTTP), the others by ``sql``
        (``coordinate``); None where no rank here can say."""

        def kept(node: ClusterNode) -> pa.Table | None:
            recent = getattr(node, "recent", None)
            return recent(since_ns, cursor_ns) if recent is not None else None

        return _here_first(self, kept, sql, timeout)

    def runq_since(
        self, sql: str, since_ns: int, *, timeout: float
    ) -> tuple[pa.Table, Collected] | None:
        """RUNQ_SQL (``sql``) from ``since_ns`` over every rank: those this
        engine serves from what their samplers keep (``waits``: no SQL), the
        others by ``sql``; None where no rank here can say."""

        def kept(node: ClusterNode) -> pa.Table | None:
            return node.waits(since_ns) if node.waits is not None else None

        return _here_first(self, kept, sql, timeout)

    def scan(self, sql: str, *, timeout: float) -> tuple[pa.Table, Collected] | None:
        """``sql``, a plain scan of a table a function makes (``SELECT a, b,
        node, rank FROM s.t``: the detector's asks of deaths, spans and
        groups) over every rank: those this engine serves by that function
        (no SQL), the others by ``sql``; None where ``sql`` is no such scan."""
        from probing.node.cluster.share import tagged_rows

        m = _SCAN.match(sql)
        if m is None:
            return None
        columns = [c.strip() for c in m["columns"].split(",")]
        if columns[-2:] != ["node", "rank"]:
            return None

        def made(node: ClusterNode) -> pa.Table | None:
            schema = node.database().catalog.schema(m["schema"])
            rows = schema.produced(m["table"]) if schema is not None else None
            if rows is None or not set(columns[:-2]) <= set(rows.column_names):
                return None  # asked by SQL, which says what is wrong
            return tagged_rows([(node, rows.select(columns[:-2]))])

        return _here_first(self, made, sql, timeout)

    def control(
        self, path: str, body: bytes, timeout: float, ranks: set[int] | None = None
    ) -> list[dict[str, Any]]:
        """``body`` POSTed to ``path`` on every other rank (``fanout.control``)."""
        return fanout.control(self, path, body, timeout, ranks)

    # -- the always-on detector -----------------------------------------------------
    def ensure_watch(self, start: bool = True) -> Detector | None:
        """The always-on detector (made once), started unless ``start`` is
        False (``GET /metrics`` before any trace); None where none is given."""
        with self._join_lock:
            if self.watch is None and self.detector is not None:
                self.watch = self.detector()
            if self.watch is not None and start:
                self.watch.start()
            return self.watch

    def stop(self) -> None:
        """The probe stops: so do its detector and its connection to the
        job's store (kept open while it lives: an engine that serves hundreds
        of jobs would hold one per process it ever served)."""
        if self.watch is not None:
            self.watch.stop()
        if self.directory is not None:
            self.directory.close()
        if self.port is not None:  # nothing of this process is reached any more
            self.port.forget(self.pid)


# the detector's plain scans (``ClusterNode.scan``)
_SCAN = re.compile(r"^SELECT (?P<columns>[\w, ]+) FROM (?P<schema>\w+)\.(?P<table>\w+)$")


def _here_first(
    node: ClusterNode, rows: Callable[[ClusterNode], pa.Table | None], sql: str, timeout: float
) -> tuple[pa.Table, Collected] | None:
    """``sql`` over every rank of ``node``'s job: the ranks its engine serves
    (``node`` among them) by ``rows`` (no SQL, no HTTP) where it answers,
    the others by ``sql`` (``coordinate``); None where no rank here answers."""
    from probing.node.cluster.fanout import Collected, concat
    from probing.node.cluster.wire import PeerTiming

    local: dict[int, pa.Table] = {}
    near: Any  # ClusterNode, as every sibling is
    for near in [node, *fanout.siblings_of(node, node.others())[0]]:
        got = rows(near)
        if got is not None:
            local[near.rank] = got
    if not local:
        return None
    world = node.ident.world_size
    if world and all(r in local for r in range(world)):  # every rank here
        table, answers = None, Collected()
    else:
        table, answers, _ = coordinator.coordinate(
            node, sql, timeout=timeout, skip=frozenset(local)
        )
    answers.peers.extend(PeerTiming(r, node.ident.node, "local", 0.0, 0) for r in local)
    tables = [t for t in (table, *local.values()) if t is not None]
    return concat(tables), answers
