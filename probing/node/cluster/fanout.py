"""Asking the peers: one request to many at once, within one deadline.

Two kinds of asking, both over one ``Exchange`` (every socket served by the
asking thread):

* ``gather``: a share of a cluster query from every member, with my own
  share computed meanwhile. The ranks my engine serves too answer
  in-process, with no request (``port.NodePort.sibling``). Flat, every
  other member asked directly; or a tree, one gatherer per other engine
  (ranks that share an address: ``auto``) or per other node (``tree``),
  answering for its ranks in one reply. A gatherer that fails is named
  missing and its others are asked directly (once, while the deadline
  allows); a gatherer that is late makes its members late with it.
* ``control``: the same POST (start or stop a trace) to every peer, one
  row per rank of the job, never discovered ones included.

A peer that gives no usable answer raises ``PeerFailure`` here, caught by
the asker, which names the peer missing with the failure's ``reason``
(``timeout``, ``refused``, ``401``, ``bad answer: ...``): the reason
``probing.peers`` and ``MissingPeer`` show. ``Peer`` is what asking needs
of the cluster node.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from probing.errors import ProbingError
from probing.node.cluster.discovery import ENGINE, PeerInfo, Registry
from probing.node.cluster.exchange import Exchange, PeerFailure, PeerLate, Reply
from probing.node.cluster.identity import Identity, split_addr
from probing.node.cluster.wire import MissingPeer, PeerTiming, clock_offset, unpack
from probing.node.probe.http import request_bytes
from probing.worker import named

if TYPE_CHECKING:  # loaded on the first cluster query, not when the probe starts
    import pyarrow as pa

    from probing.node.cluster import plan as planner
    from probing.node.cluster.share import Share

FANOUTS = ("auto", "flat", "tree")
TREE_MIN_PEERS = 16  # auto: a tree from this many peers on more than one node


class Siblings(Protocol):
    """Where a node finds the nodes its engine serves too
    (``probing.node.cluster.port.NodePort``)."""

    def sibling(self, pid: int) -> Peer | None: ...


class Peer(Protocol):
    """What asking needs of the cluster node (``probing.node.cluster.node.ClusterNode``)."""

    ident: Identity
    rank: int
    addr: str | None
    token: bytes | None
    registry: Registry

    @property
    def port(self) -> Siblings | None: ...  # the engine's port, or None

    def refresh(self, budget: float = 2.0) -> None: ...

    def others(self) -> list[PeerInfo]: ...

    @property
    def share(self) -> Share: ...


@dataclass
class Collected:
    """What one gatherer collected: tables by name, who was missing, who answered."""

    tables: dict[str, list[pa.Table]] = field(default_factory=dict)
    missing: list[MissingPeer] = field(default_factory=list)
    peers: list[PeerTiming] = field(default_factory=list)

    def add_tables(self, tables: dict[str, pa.Table]) -> None:
        for name, t in tables.items():
            self.tables.setdefault(name, []).append(t)

    def extend(self, other: Collected) -> None:
        for name, ts in other.tables.items():
            self.tables.setdefault(name, []).extend(ts)
        self.missing.extend(other.missing)
        self.peers.extend(other.peers)

    def merged(self) -> dict[str, pa.Table]:
        return {n: concat(ts) for n, ts in self.tables.items()}


def concat(tables: list[pa.Table]) -> pa.Table:
    """One table of several peers' (columns a peer lacks are null)."""
    import pyarrow as pa

    tables = [t for t in tables if t.num_columns]
    if len(tables) == 1:
        return tables[0]
    return pa.concat_tables(tables, promote_options="permissive")


def node_key(p: PeerInfo) -> str:
    """What groups peers into nodes: the node name, else the address's host."""
    if p.node and p.node != "?":
        return p.node
    return p.addr.rpartition(":")[0]


def gatherer_key(members: list[PeerInfo], fanout: str) -> Callable[[PeerInfo], str] | None:
    """How ``fanout`` groups ``members`` behind one gatherer each: by node
    (``tree``, and ``auto`` from ``TREE_MIN_PEERS`` on several nodes), by
    address (``auto`` where ranks share one: an engine's port, which answers
    for all its ranks); None: each asked directly."""
    if fanout == "tree":
        return node_key
    if fanout != "auto":
        return None
    addrs = [p.addr for p in members]
    if len(set(addrs)) < len(addrs):
        return _addr
    if len(members) >= TREE_MIN_PEERS and len({node_key(p) for p in members}) > 1:
        return node_key
    return None


def _addr(p: PeerInfo) -> str:
    return p.addr


def is_tree(members: list[PeerInfo], fanout: str) -> bool:
    """Whether ``fanout`` asks ``members`` through gatherers (``gatherer_key``)."""
    return gatherer_key(members, fanout) is not None


def http_reason(status: int, data: bytes) -> str:
    """A peer's error answer as a missing peer's reason: the status, and its message."""
    try:
        msg = json.loads(data).get("error", "")
    except (ValueError, AttributeError):
        msg = ""
    return str(status) if status == 401 or not msg else f"{status}: {msg}"


def reply_of(replies: list[Reply | PeerFailure | None], index: int) -> Reply:
    """The exchange's ``index``-th answer; ``PeerLate`` when the deadline
    came first, ``PeerFailure`` when the connection failed."""
    got = replies[index]
    if got is None:
        raise PeerLate()
    if isinstance(got, PeerFailure):
        raise got
    return got


def answer_of(peer: PeerInfo, reply: Reply) -> Collected:
    """One gatherer's answer (with its members'); ``PeerFailure`` when it is none."""
    if reply.status != 200:
        raise PeerFailure(http_reason(reply.status, reply.body))
    try:
        head, tables = unpack(reply.body)
    except ValueError as err:
        raise PeerFailure(f"bad answer: {err}") from err
    t0, t3 = reply.t_send_ns, reply.t_done_ns
    offset = clock_offset(t0, head["t_recv_ns"], head["t_send_ns"], t3)
    peer.node = head.get("node", peer.node)
    out = Collected()
    out.add_tables(tables)
    out.peers.append(PeerTiming(peer.rank, peer.node, peer.addr, (t3 - t0) / 1e6, offset))
    for m in head.get("missing", []):
        out.missing.append(MissingPeer(**m))
    for t in head.get("peers", []):  # measured by that gatherer: my clock = its + offset
        t = PeerTiming(**t)
        if t.rank != peer.rank:
            t.clock_offset_ns += offset
            out.peers.append(t)
    return out


# -- gathering: me and the peers I am asked to ask ---------------------------------


@dataclass
class _Ask:
    """One gatherer asked: where its answer will be, or why it was never asked."""

    peer: PeerInfo
    members: list[PeerInfo]
    index: int = -1
    failure: PeerFailure | None = None

    def reply(self, replies: list[Reply | PeerFailure | None]) -> Reply:
        """Its HTTP answer; ``PeerFailure`` (``PeerLate``) when none came."""
        if self.failure is not None:
            raise self.failure
        return reply_of(replies, self.index)

    def answer(self, replies: list[Reply | PeerFailure | None]) -> Collected:
        return answer_of(self.peer, self.reply(replies))


def _ask(
    exchange: Exchange,
    peer: PeerInfo,
    path: str,
    body: bytes,
    token: bytes | None,
    members: list[PeerInfo] | None = None,
) -> _Ask:
    """Start one POST to ``peer`` (gathering for ``members``); a bad address
    is its failure."""
    ask = _Ask(peer, members or [])
    try:
        host, port = split_addr(peer.addr)
    except ProbingError:
        ask.failure = PeerFailure("bad address")
        return ask
    ask.index = exchange.add(host, port, request_bytes(path, body, token, pid=peer.pid or 0))
    return ask


def gather(
    node: Peer,
    work: planner.Work,
    members: list[PeerInfo],
    timeout: float,
    fanout: str = "flat",
    *,
    with_self: bool = True,
) -> Collected:
    """My share of ``work`` (``with_self``) and every member's, within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    exchange = Exchange(deadline)
    asked: list[_Ask] = []
    siblings, members = siblings_of(node, members)
    for peer, sub in _route(node, members, fanout):
        # a peer of my own node sends me its rows: I aggregate my node
        w = work.for_member() if node_key(peer) == node.ident.node else work
        asked.append(_send(node, exchange, peer, w, sub, deadline))
    local = [node] if with_self else []
    result, replies = _run(work, exchange, local + siblings, with_self, deadline, bool(asked))
    retry = _collect(asked, replies, result)
    if retry and deadline - time.monotonic() > 0.05:
        left = deadline - time.monotonic()
        result.extend(gather(node, work.for_member(), retry, left, "flat", with_self=False))
    elif retry:
        result.missing.extend(MissingPeer(p.rank, p.node, p.addr, "timeout") for p in retry)
    for m in result.missing:
        node.registry.mark_missing(m.rank, m.reason)
    for t in result.peers:
        node.registry.mark_up(t.rank, t.response_ms, t.clock_offset_ns)
    return result


def siblings_of(node: Peer, members: list[PeerInfo]) -> tuple[list[Peer], list[PeerInfo]]:
    """The members my engine serves too (their cluster nodes: they answer
    in-process), and the others."""
    port = node.port
    if port is None:
        return [], members
    near: list[Peer] = []
    far: list[PeerInfo] = []
    for p in members:
        mine = p.source == ENGINE or (node.addr and p.addr == node.addr)
        sib = port.sibling(p.pid) if mine and p.pid else None
        if sib is not None and sib.rank == p.rank:
            near.append(sib)
        else:
            far.append(p)
    return near, far


def _route(
    node: Peer, members: list[PeerInfo], fanout: str
) -> list[tuple[PeerInfo, list[PeerInfo]]]:
    """Whom to ask directly, each with whom it asks for me (``gatherer_key``)."""
    key_of = gatherer_key(members, fanout)
    if key_of is None:
        return [(p, []) for p in members]
    groups: dict[str, list[PeerInfo]] = {}
    for p in members:
        groups.setdefault(key_of(p), []).append(p)
    mine = node.addr if key_of is _addr else node.ident.node
    out: list[tuple[PeerInfo, list[PeerInfo]]] = []
    for key, group in groups.items():
        group.sort(key=lambda p: p.rank)
        if key == mine:  # my own node: I am its gatherer
            out.extend((p, []) for p in group)
        else:
            out.append((group[0], group[1:]))
    return out


def _send(
    node: Peer,
    exchange: Exchange,
    peer: PeerInfo,
    work: planner.Work,
    members: list[PeerInfo],
    deadline: float,
) -> _Ask:
    """Start asking ``peer`` (and, through it, ``members``)."""
    left = deadline - time.monotonic()
    if left <= 0:
        return _Ask(peer, members, failure=PeerFailure("timeout"))
    body = json.dumps(
        {
            "work": work.to_json(),
            "members": [vars(m) for m in members],
            "timeout": left * 0.8,  # its members must be answered before I give up on it
        }
    ).encode()
    return _ask(exchange, peer, "/cluster/gather", body, node.token, members)


def _run(
    work: planner.Work,
    exchange: Exchange,
    local: list[Peer],
    mine_first: bool,
    deadline: float,
    asking_others: bool = True,
) -> tuple[Collected, list[Reply | PeerFailure | None]]:
    """Serve the exchange while the ``local`` shares run (mine first when
    ``mine_first``, then my engine's other ranks'): as one query where they
    can (``share.Together``; on this thread when nobody else is asked: a
    node's gatherer), else each on a thread of its own. Mine is
    waited for, and raises again here; a sibling not done by ``deadline``
    (its process stopped under a query that reads it) is named missing like
    a late peer, and one that failed with its reason."""
    from probing.node.cluster.share import Together

    slots: list[Any] = [None] * len(local)
    together = None
    if len(local) > 1:
        try:
            together = Together.prepare([n.share.owner for n in local], work.for_member())
        except Exception:  # rank by rank: each says what is wrong with its own
            together = None
    threads: list[threading.Thread | None] = [None] * len(local)  # None: done on this thread
    if together is not None and not asking_others:
        _together(together, local, slots)
    elif together is not None:
        threads = [_start(_together, together, local, slots)] * len(local)
    else:
        threads = [_start(_share, node, work, slots, i) for i, node in enumerate(local)]
    replies = exchange.run()
    if together is not None:
        if threads[0] is not None:
            threads[0].join(max(0.0, deadline - time.monotonic()))
        if isinstance(slots[0], BaseException):  # each on its own: who failed, and why
            slots = [None] * len(local)
            threads = [_start(_share, node, work, slots, i) for i, node in enumerate(local)]
    result = Collected()
    for i, (node, t) in enumerate(zip(local, threads, strict=True)):
        mine = i == 0 and mine_first
        if t is not None:
            t.join(None if mine else max(0.0, deadline - time.monotonic()))
        late = t is not None and t.is_alive()
        got = slots[i]
        if mine and isinstance(got, BaseException):
            raise got
        if late or isinstance(got, BaseException):
            why = "timeout" if late else f"failed: {type(got).__name__}: {got}"
            result.missing.append(MissingPeer(node.rank, node.ident.node, node.addr or "", why))
        else:
            result.extend(got)
    return result, replies


def _start(target: Callable[..., None], *args: Any) -> threading.Thread:
    t = threading.Thread(target=named("probing-cluster", target), args=args,
                         name="probing-cluster", daemon=True)  # fmt: skip
    t.start()
    return t


def _together(together: Any, local: list[Peer], slots: list[Any]) -> None:
    """Every local share at once (``share.Together``): the rows in the first
    slot, each rank's timing in its own; the exception in every slot."""
    t0 = time.perf_counter()
    try:
        tables = together.run()
    except BaseException as err:  # the shares run again one by one
        slots[:] = [err] * len(slots)
        return
    ms = (time.perf_counter() - t0) * 1e3
    for i, node in enumerate(local):
        got = Collected()
        if i == 0:
            got.add_tables(tables)
        got.peers.append(PeerTiming(node.rank, node.ident.node, node.addr or "local", ms, 0))
        slots[i] = got


def _share(node: Peer, work: planner.Work, slots: list[Any], i: int) -> None:
    """``node``'s share into ``slots[i]``: a Collected, or the exception it raised."""
    t0 = time.perf_counter()
    try:
        got = Collected()
        got.add_tables(node.share.run(work.for_member()))
        ms = (time.perf_counter() - t0) * 1e3
        got.peers.append(PeerTiming(node.rank, node.ident.node, node.addr or "local", ms, 0))
        slots[i] = got
    except BaseException as err:  # said again by the asking thread
        slots[i] = err


def _collect(
    asked: list[_Ask], replies: list[Reply | PeerFailure | None], result: Collected
) -> list[PeerInfo]:
    """Every gatherer's answer into ``result``; the members of those that
    failed, to be asked directly."""
    retry: list[PeerInfo] = []
    for ask in asked:
        try:
            result.extend(ask.answer(replies))
        except PeerLate:  # the deadline passed: its members are late with it
            for p in [ask.peer, *ask.members]:
                result.missing.append(MissingPeer(p.rank, p.node, p.addr, "timeout"))
        except PeerFailure as err:
            p = ask.peer
            result.missing.append(MissingPeer(p.rank, p.node, p.addr, err.reason))
            retry.extend(ask.members)  # its node's others, asked directly
    return retry


# -- control: the same request to every peer -----------------------------------------


def control(
    node: Peer, path: str, body: bytes, timeout: float, ranks: set[int] | None = None
) -> list[dict[str, Any]]:
    """POST ``body`` to ``path`` on every other peer (of ``ranks``) at once,
    with the token (a control action: starting or stopping a trace); one
    row per rank of the job but mine: ``rank, node, addr, status`` (the
    HTTP status, 0 where none came) and ``reply`` (its JSON) or ``reason``."""
    _await_ranks(node, ranks, timeout)
    others = [p for p in node.others() if ranks is None or p.rank in ranks]
    exchange = Exchange(time.monotonic() + timeout)
    asked = [_ask(exchange, p, path, body, node.token) for p in others]
    replies = exchange.run()
    rows = [_control_row(ask, replies) for ask in asked]
    seen = {node.rank, *(p.rank for p in others)}
    for rank in range(node.ident.world_size):  # never discovered: no probe, no port
        if rank not in seen and (ranks is None or rank in ranks):
            rows.append({"rank": rank, "node": "?", "addr": "", "status": 0,
                         "reason": "not discovered (no probe, or not joined yet)"})  # fmt: skip
    return sorted(rows, key=lambda r: r["rank"])  # a slow control answer marks nobody missing


def _await_ranks(node: Peer, ranks: set[int] | None, timeout: float) -> None:
    """A job just started: its ranks publish their addresses one by one. Re-read
    discovery until every rank wanted is known, for at most a quarter of
    ``timeout`` (0.5 to 5 s)."""
    wanted = set(range(node.ident.world_size)) - {node.rank}
    if ranks is not None:
        wanted &= ranks
    deadline = time.monotonic() + min(5.0, max(0.5, timeout / 4))
    while True:
        node.refresh(budget=max(0.1, min(2.0, deadline - time.monotonic())))
        known = {p.rank for p in node.others()}
        if wanted <= known or time.monotonic() >= deadline:
            return
        time.sleep(0.1)


def _control_row(ask: _Ask, replies: list[Reply | PeerFailure | None]) -> dict[str, Any]:
    """One peer's row: its status and JSON reply, or the reason it has none."""
    p = ask.peer
    row: dict[str, Any] = {"rank": p.rank, "node": p.node, "addr": p.addr, "status": 0}
    try:
        got = ask.reply(replies)
    except PeerFailure as err:
        row["reason"] = err.reason
        return row
    row["status"] = got.status
    try:
        row["reply"] = json.loads(got.body)
    except ValueError:
        row["reason"] = http_reason(got.status, got.body)
    if got.status != 200:
        row["reason"] = http_reason(got.status, got.body)
    return row
