"""This probe as a cluster peer: TCP listener, discovery, answering, asking.

``ClusterNode.start`` returns at once; a short-lived background thread
reads the token, binds the TCP port and publishes the address, then ends.
Nothing runs between queries: no heartbeat, no polling. The peers' state
in ``probing.peers`` is what discovery published and what the last
cluster query measured.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from probing import config
from probing.cluster.discovery import (
    STORE_TIMEOUT_S,
    PeerInfo,
    Registry,
    StoreDirectory,
    static_peers,
)
from probing.cluster.exchange import Exchange, Reply
from probing.cluster.identity import (
    Identity,
    job_address,
    known,
    learned,
    split_addr,
    token_from_env,
)
from probing.cluster.wire import (
    CLUSTER_CONTENT_TYPE,
    MissingPeer,
    PeerTiming,
    clock_offset,
    pack,
    unpack,
)
from probing.errors import PeerUnreachable, ProbingError, QueryError, log_unexpected, tell
from probing.probe.http import Request, Response, request_bytes

if TYPE_CHECKING:  # loaded on the first cluster query, not when the probe starts
    import pyarrow as pa

    from probing.cluster import plan as planner

FANOUTS = ("auto", "flat", "tree")
TREE_MIN_PEERS = 16  # auto: a tree from this many peers on more than one node
# A process runs at most this many peers' shares at once (one probe per
# process in a job; several in the benchmark): more at once only adds
# thread and allocator contention to the same CPU work.
_RUNNING = threading.BoundedSemaphore(max(1, os.cpu_count() or 1))
# waiting for the job's store: first retry after 50 ms, then doubling up to
# 0.5 s, so a probe joins within half a second of the store appearing
JOIN_BACKOFF_S = (0.05, 0.5)
# waiting for the job's default process group (a rank the environment does
# not name): asked after 50 ms, then doubling up to 2 s; one small request
# to the guest each time, nothing while the answer is known
LEARN_BACKOFF_S = (0.05, 2.0)
WAITING = "waiting for the job's default process group (torch's init_process_group)"


MAX_MEMBERS = 65536  # ranks one gather request may name (a job's size bounds them anyway)
MAX_GATHER_S = 300.0  # the longest a gather request may ask me to wait for its members


@dataclass
class Gathered:
    """What one gatherer collected: tables by name, who was missing, who answered."""

    tables: dict[str, list[pa.Table]] = field(default_factory=dict)
    missing: list[MissingPeer] = field(default_factory=list)
    peers: list[PeerTiming] = field(default_factory=list)

    def add_tables(self, tables: dict[str, pa.Table]) -> None:
        for name, t in tables.items():
            self.tables.setdefault(name, []).append(t)

    def extend(self, other: Gathered) -> None:
        for name, ts in other.tables.items():
            self.tables.setdefault(name, []).extend(ts)
        self.missing.extend(other.missing)
        self.peers.extend(other.peers)

    def merged(self) -> dict[str, pa.Table]:
        return {n: _concat(ts) for n, ts in self.tables.items()}


def _concat(tables: list[pa.Table]) -> pa.Table:
    import pyarrow as pa

    tables = [t for t in tables if t.num_columns]
    if len(tables) == 1:
        return tables[0]
    return pa.concat_tables(tables, promote_options="permissive")


class ClusterNode:
    """One peer: its identity, its peers, its token, and its share of a query."""

    def __init__(
        self,
        ident: Identity,
        engine: Callable[[], Any],
        *,
        token: bytes | None = None,
        pid: int | None = None,
        learn: Callable[[], Mapping[str, Any] | None] | None = None,
    ) -> None:
        self.ident = ident
        # where rank, size and store come from when the environment does not
        # say (``Target.distributed``): None once known
        self.learn = None if known(ident) else learn
        self.engine = engine
        self.token = token
        self.pid = pid if pid is not None else os.getpid()
        self.rank = ident.rank
        self.addr: str | None = None
        self.registry = Registry()
        self.directory = StoreDirectory(ident) if ident.master and not ident.peers else None
        self.ready = threading.Event()  # set once the first attempt to join is over
        self.error: str | None = None
        self.published = False
        self._server: Any = None
        self._join_lock = threading.Lock()
        self._columns: dict[str, list[str]] = {}
        self._rewritten: dict[str, str] = {}  # agg SQL -> what I run over my tagged tables
        self.watch: Any = None  # the always-on detector (probing.analyze.watch), once made
        self.detector: Callable[[], Any] | None = None  # makes it (given by probing.enable)
        if self.learn is not None:
            self.error = WAITING

    def describe(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.ident.world_size,
            "node": self.ident.node,
            "addr": self.addr,
            "source": self.ident.source,
            "peers": len(self.registry.peers()),
            "error": self.error,
        }

    # -- start-up: joining the job, however late its store comes ---------------
    def start(self, server: Any) -> None:
        """Join in the background; the host never waits on the network."""
        self._server = server
        threading.Thread(target=self._join_loop, name="probing-cluster", daemon=True).start()

    @property
    def learning(self) -> bool:
        """Still waiting for the job to say who this process is."""
        return self.learn is not None

    def _learn_loop(self) -> bool:
        """Ask the process for its default process group until it has one
        (backoff ``LEARN_BACKOFF_S``); then this node is that rank. False
        when it never will be a peer: a job of one process, or gone."""
        delay = LEARN_BACKOFF_S[0]
        while self.learn is not None:
            try:
                dist = self.learn()
            except ProbingError as err:  # the process exited while we waited
                self.error = f"{WAITING}: {err}"
                return False
            if dist is not None:
                if int(dist["world"]) <= 1:
                    self.error = "the job's default process group has one process: no peers"
                    return False
                self.ident = learned(self.ident, dist)
                self.rank = self.ident.rank
                if self.ident.master is not None:
                    self.directory = StoreDirectory(self.ident)
                self.learn = None
                return True
            self.ready.set()  # queries meanwhile say that this probe is waiting
            time.sleep(delay)
            delay = min(delay * 2, LEARN_BACKOFF_S[1])
        return True

    def _join_loop(self) -> None:
        try:
            rank_known = self._learn_loop()
        except Exception as err:  # noqa: BLE001 - the top of a probe thread: a bug is logged
            self.error = f"{type(err).__name__}: {err}"
            log_unexpected("cluster mode off (local socket only)", err)
            rank_known = False
        if not rank_known:
            self.ready.set()
            return
        self._join_store()

    def _join_store(self) -> None:
        """Try to join until it works, with backoff (``JOIN_BACKOFF_S``), then end.

        In an srun/mpirun-style job the store appears only when rank 0 calls
        ``init_process_group``, seconds or minutes after this probe started:
        cluster mode waits for it instead of turning off. Once joined, nothing
        of this runs any more (an idle probe uses no CPU); each cluster query
        then re-reads the store.
        """
        delay, said = JOIN_BACKOFF_S[0], False
        while True:
            try:
                if self.try_join(STORE_TIMEOUT_S):
                    if said:
                        tell(
                            f"cluster: joined the job as rank {self.rank} at {self.addr}", self.pid
                        )
                    return
            except (ProbingError, ValueError, OSError) as err:  # no token, no address to bind
                self.error = str(err)
                tell(
                    f"cluster mode off: {err}; this probe answers on its local socket only",
                    self.pid,
                )
                return
            except Exception as err:  # noqa: BLE001 - the top of a probe thread: a bug is logged
                self.error = f"{type(err).__name__}: {err}"
                log_unexpected("cluster mode off (local socket only)", err)
                return
            finally:
                self.ready.set()  # the first attempt is over, whatever it gave
            if not said:
                said = True
                tell(
                    f"cluster: {self.error}; this probe keeps trying in the background "
                    "and joins when the job's store answers (local queries work meanwhile)",
                    self.pid,
                )
            time.sleep(delay)
            delay = min(delay * 2, JOIN_BACKOFF_S[1])

    def setup(self, server: Any) -> None:
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
        if ident.peers:
            self._listen_listed(self._server)
            for info in static_peers(ident, self.rank, self.pid):
                self.registry.upsert(info)
            self.published = True
            return
        if self.addr is None:
            host = config.load().host or job_address(ident.master)
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

    def _listen_listed(self, server: Any) -> None:
        """Bind my entry of PROBING_PEERS: ``RANK``'s, else the first I can bind."""
        ident = self.ident
        order = [self.rank] if 0 <= self.rank < len(ident.peers) else range(len(ident.peers))
        last: OSError | None = None
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
        return [p for p in self.registry.peers() if p.rank != self.rank]

    # -- answering: this peer's share ------------------------------------------
    def _own_columns(self, table: str, eng: Any) -> list[str]:
        cols = self._columns.get(table)
        if cols is None:
            cols = eng.sql(f"SELECT * FROM {table} LIMIT 0", allow_code=False).schema.names
            self._columns[table] = cols
        return cols

    def _tagged(self, table: str, eng: Any) -> str:
        """``table`` as this peer serves it: plus node and rank."""
        sch, name = table.split(".", 1)
        cols = self._own_columns(table, eng)
        if "node" in cols or "rank" in cols:
            own = ", ".join(
                f'"{c}" AS "table_{c}"' if c in ("node", "rank") else f'"{c}"' for c in cols
            )
        else:
            own = "*"
        node = self.ident.node.replace("'", "''")
        return (
            f"SELECT {own}, '{node}' AS node, CAST({int(self.rank)} AS BIGINT) AS rank "
            f'FROM "{sch}"."{name}"'
        )

    def run_local(self, work: planner.Work) -> dict[str, pa.Table]:
        """This peer's rows for ``work``: per-table scans, or the whole query."""
        with _RUNNING:
            try:
                return self._run_local(work)
            except QueryError:
                if not self._columns:
                    raise
                self._columns.clear()  # a table's columns changed since I cached them
                self._rewritten.clear()
                return self._run_local(work)

    def _run_local(self, work: planner.Work) -> dict[str, pa.Table]:
        from probing.cluster import plan as planner

        eng = self.engine()
        out: dict[str, pa.Table] = {}
        if work.mode is planner.Mode.AGG:
            sql = self._agg_sql(work.sql, eng)
            if sql is not None:  # else this peer has no such table: it adds no rows
                out[planner.PARTIAL] = eng.sql(sql, allow_code=False)
            return out
        for table, spec in work.scans.items():
            if not self._exists(table, eng):
                continue
            cols = spec.columns
            select = ", ".join(f'"{c}"' for c in cols) if cols else "*"
            bare = table.split(".", 1)[1]
            sql = f'SELECT {select} FROM ({self._tagged(table, eng)}) AS "{bare}"'
            if spec.where:
                sql += f" WHERE {spec.where}"
            out[table] = eng.sql(sql, allow_code=False)
        return out

    def _agg_sql(self, sql: str, eng: Any) -> str | None:
        """``sql`` over my tagged tables (None when I lack one). Kept per query
        text, like the columns it was built from (both dropped when a query fails)."""
        cached = self._rewritten.get(sql)
        if cached is not None:
            return cached
        from probing.cluster import plan as planner

        refs = planner.table_refs(sql, set(eng.catalog.schema_names()))
        text = sql
        for ref in sorted(refs, key=lambda r: -r.start):
            if not self._exists(ref.name, eng):
                return None
            source = f"({self._tagged(ref.name, eng)})"
            if not _has_alias(sql, ref.end):
                source += f' AS "{ref.name.split(".", 1)[1]}"'
            text = text[: ref.start] + source + text[ref.end :]
        if len(self._rewritten) < 64:
            self._rewritten[sql] = text
        return text

    def _exists(self, table: str, eng: Any) -> bool:
        sch, name = table.split(".", 1)
        schema = eng.catalog.schema(sch)
        return schema is not None and name in schema.table_names

    # -- gathering: me and the peers I am asked to ask ---------------------------
    def gather(
        self,
        work: planner.Work,
        members: list[PeerInfo],
        timeout: float,
        fanout: str = "flat",
        *,
        with_self: bool = True,
    ) -> Gathered:
        deadline = time.monotonic() + timeout
        result = Gathered()
        leaders, groups = self._route(members, fanout)
        exchange = Exchange(deadline)
        asked: list[tuple[PeerInfo, list[PeerInfo], int | str]] = []
        for p in leaders:
            sub = groups.get(p.rank, [])
            # a peer of my own node sends me its rows: I aggregate my node
            w = work.for_member() if _node_key(p) == self.ident.node else work
            asked.append((p, sub, self._send(exchange, p, w, sub, deadline)))
        local: list[Any] = []
        runner = None
        if with_self and asked:  # my share while the answers come in
            runner = threading.Thread(
                target=self._run_self, args=(work, local), name="probing-cluster", daemon=True
            )
            runner.start()
        elif with_self:
            self._run_self(work, local)
        replies = exchange.run()
        if runner is not None:
            runner.join()
        if local and isinstance(local[0], BaseException):
            raise local[0]
        for item in local:
            result.extend(item)
        retry: list[PeerInfo] = []
        for peer, sub, sent in asked:
            reply = replies[sent] if isinstance(sent, int) else sent
            if reply is None:  # the deadline passed: its members are late with it
                for p in [peer, *sub]:
                    result.missing.append(MissingPeer(p.rank, p.node, p.addr, "timeout"))
                continue
            answer = self._answer(peer, reply) if isinstance(reply, Reply) else reply
            if isinstance(answer, str):
                result.missing.append(MissingPeer(peer.rank, peer.node, peer.addr, answer))
                retry.extend(sub)  # its node's others, asked directly
                continue
            result.extend(answer)
        if retry and deadline - time.monotonic() > 0.05:
            again = self.gather(
                work.for_member(),
                retry,
                deadline - time.monotonic(),
                "flat",
                with_self=False,
            )
            result.extend(again)
        elif retry:
            result.missing.extend(MissingPeer(p.rank, p.node, p.addr, "timeout") for p in retry)
        for m in result.missing:
            self.registry.mark_missing(m.rank, m.reason)
        for t in result.peers:
            self.registry.mark_up(t.rank, t.response_ms, t.clock_offset_ns)
        return result

    def _route(
        self, members: list[PeerInfo], fanout: str
    ) -> tuple[list[PeerInfo], dict[int, list[PeerInfo]]]:
        """Whom to ask directly, and whom each of them asks for me (tree: its node)."""
        nodes = {_node_key(p) for p in members}
        tree = fanout == "tree" or (
            fanout == "auto" and len(members) >= TREE_MIN_PEERS and len(nodes) > 1
        )
        if not tree:
            return members, {}
        mine = self.ident.node
        by_node: dict[str, list[PeerInfo]] = {}
        for p in members:
            by_node.setdefault(_node_key(p), []).append(p)
        leaders: list[PeerInfo] = []
        groups: dict[int, list[PeerInfo]] = {}
        for key, group in by_node.items():
            group.sort(key=lambda p: p.rank)
            if key == mine:
                leaders.extend(group)  # my own node: I am its gatherer
                continue
            leaders.append(group[0])
            groups[group[0].rank] = group[1:]
        return leaders, groups

    def _run_self(self, work: planner.Work, out: list[Any]) -> None:
        """My own share into ``out`` (a Gathered, or the exception it raised)."""
        try:
            t0 = time.perf_counter()
            mine = Gathered()
            mine.add_tables(self.run_local(work.for_member()))
            ms = (time.perf_counter() - t0) * 1e3
            mine.peers.append(PeerTiming(self.rank, self.ident.node, self.addr or "local", ms, 0))
            out.append(mine)
        except BaseException as err:  # noqa: BLE001 - raised again by the asking thread
            out[:] = [err]

    def _send(
        self,
        exchange: Exchange,
        peer: PeerInfo,
        work: planner.Work,
        members: list[PeerInfo],
        deadline: float,
    ) -> int | str:
        """Start asking ``peer`` (and, through it, ``members``): the exchange's
        index of the request, or the reason it could not start."""
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout"
        body = json.dumps(
            {
                "work": work.to_json(),
                "members": [vars(m) for m in members],
                "timeout": left * 0.8,  # its members must be answered before I give up on it
            }
        ).encode()
        try:
            host, port = split_addr(peer.addr)
        except ProbingError:
            return "bad address"
        return exchange.add(host, port, request_bytes("/cluster/gather", body, self.token))

    def _answer(self, peer: PeerInfo, reply: Reply) -> Gathered | str:
        """One peer's answer (with its members'), or the reason it is none."""
        if reply.status != 200:
            return _http_reason(reply.status, reply.body)
        try:
            head, tables = unpack(reply.body)
        except ValueError as err:
            return f"bad answer: {err}"
        t0, t3 = reply.t_send_ns, reply.t_done_ns
        offset = clock_offset(t0, head["t_recv_ns"], head["t_send_ns"], t3)
        peer.node = head.get("node", peer.node)
        out = Gathered()
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

    # -- asking: the coordinator ---------------------------------------------------
    def coordinate(
        self, sql: str, *, timeout: float = 5.0, strict: bool = False, fanout: str = "auto"
    ) -> tuple[pa.Table, Gathered, planner.Plan]:
        """Run ``sql`` over every peer's tables; returns (result, who answered, plan)."""
        import pyarrow as pa

        from probing.cluster import plan as planner

        if fanout not in FANOUTS:
            raise QueryError(f"unknown fan-out {fanout!r} (use one of {', '.join(FANOUTS)})")
        deadline = time.monotonic() + timeout
        eng = self.engine()
        self.refresh(budget=min(2.0, max(1.0, timeout / 4)))
        known = set(eng.catalog.schema_names())
        schemas: dict[str, pa.Schema | None] = {}
        for ref in planner.table_refs(sql, known):
            try:
                cols = eng.sql(f"SELECT * FROM {ref.name} LIMIT 0", allow_code=False).schema
                schemas[ref.name] = planner.tagged_schema(cols)
            except QueryError:
                schemas[ref.name] = None
        the_plan = planner.plan(sql, schemas, known)
        if the_plan.mode is planner.Mode.AGG_NODE and not self._is_tree(fanout):
            the_plan = planner.plan_scan(sql, schemas, known)  # flat: the asker aggregates
        got = self.gather(
            the_plan.work(), self.others(), max(0.0, deadline - time.monotonic()), fanout
        )
        answered = {t.rank for t in got.peers} | {m.rank for m in got.missing}
        for rank in range(self.ident.world_size):  # torchrun: the ranks never discovered
            if rank not in answered and self.directory is not None:
                got.missing.append(MissingPeer(rank, "?", "", "not discovered"))
        if strict and got.missing:
            names = ", ".join(f"rank {m.rank} ({m.addr}: {m.reason})" for m in got.missing)
            raise PeerUnreachable(f"{len(got.missing)} peer(s) did not answer: {names}")
        merged = got.merged()
        if the_plan.mode is planner.Mode.SCAN:
            tables: dict[str, pa.Table | pa.Schema] = {}
            for name in the_plan.scans:
                data = merged.get(name)
                sch = schemas.get(name)
                if data is None and sch is None:
                    raise QueryError(f"table '{name}' not found here nor on any peer that answered")
                tables[name] = data if data is not None else (sch or pa.schema(list(planner.TAGS)))
            result = planner.run_final(the_plan.final_sql, tables, eng.threads)
        else:
            partial = merged.get(planner.PARTIAL)
            rows = {n: t for n, t in merged.items() if n != planner.PARTIAL}
            if the_plan.mode is planner.Mode.AGG_NODE and rows:  # my node's rows (and any re-asked)
                mine = planner.run_final(sql, rows, eng.threads)  # type: ignore[arg-type]
                partial = mine if partial is None else _concat([partial, mine])
            if partial is None:
                ref = planner.table_refs(sql, known)[0].name
                empty = schemas[ref] or pa.schema(list(planner.TAGS))
                partial = planner.run_final(the_plan.sql, {ref: empty}, eng.threads)
            result = planner.run_final(
                the_plan.final_sql, {f"probing.{planner.PARTIAL}": partial}, eng.threads
            )
        got.peers.sort(key=lambda t: t.rank)
        got.missing.sort(key=lambda m: m.rank)
        return result, got, the_plan

    def _is_tree(self, fanout: str) -> bool:
        others = self.others()
        return fanout == "tree" or (
            fanout == "auto"
            and len(others) >= TREE_MIN_PEERS
            and len({_node_key(p) for p in others}) > 1
        )

    def _known_members(self, refs: list[Any]) -> tuple[list[PeerInfo], list[MissingPeer]]:
        """The members a gather request names, as my own discovery knows them.

        A request names members by rank only: where to connect (and so whom
        to send the job's token) comes from my registry (the TCPStore or
        PROBING_PEERS), never from the request. A rank I do not know, after
        one look at the store, is answered missing; myself and repeats are
        dropped, so the fan-out is at most the job's size.
        """
        ranks: list[int] = []
        for ref in refs[:MAX_MEMBERS]:
            try:
                rank = int(ref["rank"] if isinstance(ref, dict) else ref)
            except (KeyError, TypeError, ValueError):
                continue
            if rank != self.rank and rank not in ranks:
                ranks.append(rank)
        known = {p.rank: p for p in self.registry.peers()}
        if any(r not in known for r in ranks) and self.directory is not None:
            self.refresh(budget=1.0)
            known = {p.rank: p for p in self.registry.peers()}
        members = [known[r] for r in ranks if r in known]
        unknown = [
            MissingPeer(r, "?", "", "not among the peers this probe discovered")
            for r in ranks
            if r not in known
        ]
        return members, unknown

    def answer_gather(self, payload: dict[str, Any], t_recv_ns: int) -> bytes:
        """POST /cluster/gather: my share, plus my members' when I gather for someone."""
        from probing.cluster import plan as planner

        work = planner.Work.from_json(payload["work"])
        members, unknown = self._known_members(payload.get("members") or [])
        timeout = min(max(float(payload.get("timeout", 5.0)), 0.0), MAX_GATHER_S)
        got = self.gather(work, members, timeout, "flat")
        got.missing.extend(unknown)
        tables = got.merged()
        if work.mode is planner.Mode.AGG_NODE:
            refs = list(work.scans)
            inputs: dict[str, pa.Table | pa.Schema] = {n: tables[n] for n in refs if n in tables}
            if inputs:
                threads = self.engine().threads
                tables = {planner.PARTIAL: planner.run_final(work.sql, inputs, threads)}
            else:
                tables = {}
        meta = {
            "rank": self.rank,
            "node": self.ident.node,
            "missing": [vars(m) for m in got.missing],
            "peers": [vars(t) for t in got.peers if t.rank != self.rank],
        }
        return pack(meta, tables, t_recv_ns)

    def ensure_watch(self, start: bool = True) -> Any:
        """The always-on detector (made once), started unless ``start`` is
        False (``GET /metrics`` before any trace); None where none is given."""
        with self._join_lock:
            if self.watch is None and self.detector is not None:
                self.watch = self.detector()
            if self.watch is not None and start:
                self.watch.start()
            return self.watch

    def stop(self) -> None:
        """The probe stops: so does its detector."""
        if self.watch is not None:
            self.watch.stop()

    # -- control: the same request to every peer -----------------------------------
    def fan_out(
        self, path: str, body: bytes, timeout: float, ranks: set[int] | None = None
    ) -> list[dict[str, Any]]:
        """POST ``body`` to ``path`` on every other peer (of ``ranks``) at once,
        with the token (a control action: starting or stopping a trace); one
        row per rank of the job but mine: ``rank, node, addr, status`` (the
        HTTP status, 0 where none came) and ``reply`` (its JSON) or ``reason``."""
        wanted = set(range(self.ident.world_size)) - {self.rank}
        if ranks is not None:
            wanted &= ranks
        deadline = time.monotonic() + min(5.0, max(0.5, timeout / 4))
        while True:  # a job just started: its ranks publish their addresses one by one
            self.refresh(budget=max(0.1, min(2.0, deadline - time.monotonic())))
            known = {p.rank for p in self.others()}
            if wanted <= known or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        others = [p for p in self.others() if ranks is None or p.rank in ranks]
        exchange = Exchange(time.monotonic() + timeout)
        sent: list[tuple[PeerInfo, int | str]] = []
        for p in others:
            try:
                host, port = split_addr(p.addr)
            except ProbingError:
                sent.append((p, "bad address"))
                continue
            sent.append((p, exchange.add(host, port, request_bytes(path, body, self.token))))
        replies = exchange.run()
        rows: list[dict[str, Any]] = []
        for p, i in sent:
            got = replies[i] if isinstance(i, int) else i
            row: dict[str, Any] = {"rank": p.rank, "node": p.node, "addr": p.addr, "status": 0}
            if got is None:
                row["reason"] = "timeout"
            elif isinstance(got, str):
                row["reason"] = got
            else:
                row["status"] = got.status
                try:
                    row["reply"] = json.loads(got.body)
                except ValueError:
                    row["reason"] = _http_reason(got.status, got.body)
                if got.status != 200:
                    row["reason"] = _http_reason(got.status, got.body)
            rows.append(row)
        seen = {self.rank, *(p.rank for p in others)}
        for rank in range(self.ident.world_size):  # never discovered: no probe, no port
            if rank not in seen and (ranks is None or rank in ranks):
                rows.append({"rank": rank, "node": "?", "addr": "", "status": 0,
                             "reason": "not discovered (no probe, or not joined yet)"})  # fmt: skip
        return sorted(rows, key=lambda r: r["rank"])  # a slow control answer marks nobody missing

    # -- HTTP: the probe's /cluster/* endpoints call these ------------------------------
    def serve_query(self, req: Request) -> Response:
        """POST /cluster/query {"sql", "timeout", "strict", "fanout", "format"}."""
        import json

        from probing.probe.api import json_rows, result_limit

        t_recv = time.time_ns()
        try:
            payload = json.loads(req.body or b"{}")
            sql = payload["sql"]
            timeout = float(payload.get("timeout", 5.0))
            strict = bool(payload.get("strict", False))
            fanout = str(payload.get("fanout", "auto"))
            fmt = payload.get("format", "arrow")
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return Response.error(400, f'bad /cluster/query request (want {{"sql": ...}}): {err}')
        result, got, plan = self.coordinate(sql, timeout=timeout, strict=strict, fanout=fanout)
        meta = {
            "missing": [vars(m) for m in got.missing],
            "peers": [vars(t) for t in got.peers],
            "plan": {"mode": plan.mode.value, "pushed": plan.pushed},
        }
        if fmt == "json":
            body = json_rows(result, result_limit(), prefix=b'{"rows": ')
            body += b", " + json.dumps(meta, default=str).encode()[1:]
            return Response(200, "application/json", bytes(body))
        return Response(200, CLUSTER_CONTENT_TYPE, pack(meta, {"result": result}, t_recv))

    def serve_gather(self, req: Request) -> Response:
        """POST /cluster/gather: a peer's share of a cluster query (peers call it)."""
        import json

        t_recv = time.time_ns()
        from probing.cluster import plan as planner

        try:
            payload = json.loads(req.body)
            planner.Work.from_json(payload["work"])
        except (ValueError, KeyError, TypeError) as err:
            return Response.error(400, f"bad /cluster/gather request: {err}")
        return Response(200, CLUSTER_CONTENT_TYPE, self.answer_gather(payload, t_recv))


def _node_key(p: PeerInfo) -> str:
    """What groups peers into nodes: the node name, else the address's host."""
    if p.node and p.node != "?":
        return p.node
    return p.addr.rpartition(":")[0]


_ALIAS_STOP = {
    "WHERE",
    "GROUP",
    "ORDER",
    "LIMIT",
    "HAVING",
    "JOIN",
    "ON",
    "INNER",
    "LEFT",
    "RIGHT",
    "FULL",
    "CROSS",
    "UNION",
    "OFFSET",
    "WINDOW",
}


def _has_alias(sql: str, end: int) -> bool:
    from probing.cluster import plan as planner

    rest = planner.tokens(sql[end:])
    if not rest:
        return False
    first = rest[0]
    return first.word == "AS" or (first.kind in ("word", "qid") and first.word not in _ALIAS_STOP)


def _http_reason(status: int, data: bytes) -> str:
    try:
        msg = json.loads(data).get("error", "")
    except (ValueError, AttributeError):
        msg = ""
    return str(status) if status == 401 or not msg else f"{status}: {msg}"
