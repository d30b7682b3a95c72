"""Always-on detection: while a probe traces, its job is watched with no client.

The job's *detector* is its lowest rank whose process is alive and whose
probe answers (rank 0, while it lives); a tracing rank above it asks the
ranks below it whether they live every ``ELECT_S`` (30 s), from the
lowest, and stops at the first that does. It runs two threads:

* every ``FULL_S`` (5 s), a *full detection*: it asks every rank for its
  collectives of the last ``WINDOW_S`` (one cluster query, as ``diagnose
  --cluster`` asks, without the stacks, samples and NVML; after the first,
  only the calls that ended since the last ask: ``Window``), the ranks that
  died and who traced when (torch's groups: ``Groups``), runs the
  same analysis and keeps what it finds as ``analyze.findings``: a
  straggler, a slow link, a hang, a rank gone (one that did not answer two
  full detections running; one never discovered is not gone, it never came);
  after each that found nothing (every rank answered, the window judged, no
  finding active), the next comes twice as long after it, ``QUIET_S`` (30 s)
  at most: a steady healthy job costs its engine little; ``FULL_S`` again at
  once where a look sees the pace drop or a detection finds anything;
* every ``PROBING_DETECT_S`` (1 s), a *look* at the pace of its own
  rank's collectives (a query of its own tables, a few ms: ``Pace``). A
  rank that slows down slows every rank it meets in a collective, the
  detector's too: when the last ``RECENT_S`` ran at under ``SLOWER`` of the
  pace before, every rank is asked for its new collectives at once (again
  every ``ASK_EVERY_S`` while the pace stays low, for ``ALERT_S`` at most),
  their last ``TAIL_S`` screened for a straggler (``collectives.stragglers``,
  a few ms) and, where the screen names one, the window analyzed as a full
  detection does: a straggler it names is added (nothing else, and nothing
  is cleared there). A slowdown the detector's own collectives do not feel
  (a straggler in a group it is not in) waits for the next full detection.

A new straggler is written once its lateness has lasted ``CONFIRM_S`` in
the collectives analyzed (where it has not yet, the ranks are asked again
when it may have): analyzing whenever the pace drops must not name the
bursts of noise of a busy machine (a rank starved of CPU for a moment)
that one detection every 5 s seldom met. One problem is one finding: a
straggler is keyed by its rank alone (its group's name may change as torch's
names are learned; they are asked again as one is written by other
names), written once, when it is new, in the verdict's words and with its
cause (``probing.analyze.verdict``: ``straggler_text``, ``hang_text``,
``slow_link_text``; what explains a straggler asked, ``EXPLAIN``, as it is
written), and cleared only once ``findings.CLEAR_AFTER`` full
detections in a row saw it over: a straggler is over where every rank
answered, the window could be judged, and its rank is neither named nor
still half as late as when it was (``HOLD``); a detection that cannot tell
(a rank missing, too few collectives) counts neither way. Each new or
cleared finding is one ``probing:`` line on the job's stderr.
``metrics()`` is the OpenMetrics text of ``GET /metrics``: the job's step,
each rank's lateness, each straggler's cost, the findings, the events dropped.

The node (``probing.node.cluster.node.ClusterNode``) is handed in: this layer
does not import the cluster's, and asks through the node's ``coordinate``
and ``control``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from probing.analyze.findings import Book, Key, row
from probing.errors import ProbingError
from probing.worker import Worker, error_text

if TYPE_CHECKING:
    import pyarrow as pa

WINDOW_S = 30.0  # the collectives each detection looks at
HANG_AFTER_S = 10.0  # a collective some rank never entered for this long is a hang
GONE_AFTER = 2  # full detections in a row: a peer missing to be gone, a link slow to be slow
ELECT_S = 30.0  # how often a rank above the detector checks that the ranks below live
ALIVE = json.dumps({"sql": "SELECT alive FROM process.info", "format": "json"}).encode()
FULL_S = 5.0  # a full detection (every kind of finding, clearing, /metrics) this often ...
QUIET_S = 30.0  # ... doubled after each that found nothing, up to this (a steady healthy job)
ASK_S = 5.0  # how long a detection waits for the ranks' answers, whatever the period
AUX_S = 15.0  # the ranks' deaths and traced spans asked again this often, or at once
# where who answered changed or a rank's newest collective began STILL_S ago
STILL_S = 2.0
GROUPS_S = 30.0  # torch's groups asked again this often (a job makes them as it goes) ...
GROUPS_RETRY_S = FULL_S  # ... or this soon where they left a Gloo context unnamed (doubling)
GROUPS_KEEP = 65536  # contexts whose group is kept (past it, only the last answer's)
# a call reaches its rank's store within this of its end (drained every 0.2 s):
# the calls that ended this long before the last ask are asked again
LAG_S = 2.0
RESYNC_S = 60.0  # the whole window asked again this often, and after a rank missed an ask
PACE_S = 10.0  # the detector's own arrivals kept: the pace the last RECENT_S is held to
RECENT_S = 0.5  # ... the last span looked at (4 of the usual intervals, if longer)
SLOWER = 0.7  # a pace under this share of the usual: the ranks are asked at once
MIN_PACE = 20  # arrivals before the last RECENT_S needed to tell a pace
ASK_EVERY_S = 0.5  # between full detections the ranks are asked at most this often ...
ALERT_S = 5.0  # ... and for at most this long after the pace dropped
TAIL_S = 3.0  # the span an ask screens for a straggler
DRAINED_S = 0.2  # a collective is in its rank's store this long after it began, as a rule
CONFIRM_S = 1.0  # a new straggler's lateness lasted this long: written (noise is briefer)
# what a straggler written is explained by, asked as diagnose asks it (queries.queries)
EXPLAIN = ("samples", "cuda", "nvml", "cpu")
# a straggler not named at a full detection but still this share as late as when
# it was written (its excess over the others' median) is not over: the test that
# names one is strict, so one window of a rank still slow may miss it
HOLD = 0.5


def ask_cluster(node: Any, sql: str) -> pa.Table:
    """``sql`` over every rank of ``node``'s job (the cluster's coordinator)."""
    table: pa.Table = node.coordinate(sql, timeout=ASK_S)[0]
    return table


def detect_s() -> float:
    """``PROBING_DETECT_S``: seconds between looks (1; 0 turns detection off)."""
    from probing import config

    try:
        return float(config.load().detect_s)
    except ValueError:  # a bad value: the default (its probe said so at start-up)
        return 1.0


def held_by(s: Any) -> tuple[str, float]:
    """How late straggler ``s`` was when written, by the figure of its rank's
    row its end is told by: its median excess; or, late now and then (on time
    at most steps), its p99 lag."""
    if s.late_steps >= 0.5:
        return "excess_ms_median", s.excess_ms_median
    return "lag_ms_p99", s.lag_ms_p99


class Watch:
    """The detector of one probe (``start`` once; it detects only while
    ``tracing()`` and this probe is the job's detector)."""

    def __init__(
        self,
        node: Any,
        tracing: Callable[[], bool],
        dropped: Callable[[], dict[str, int]],
        every_s: float | None = None,
        arrivals: Callable[[int], Any] | None = None,
    ) -> None:
        self.node = node
        self.tracing = tracing
        self.dropped = dropped
        self.every_s = detect_s() if every_s is None else every_s
        self.book = Book()  # the findings; its lock also guards which stragglers were named
        self.last_error: str | None = None
        self._misses: dict[int, int] = {}
        self._seen: set[int] = set()  # the ranks that ever answered a full detection
        self._slow: dict[str, int] = {}  # comm -> full detections in a row that found it slow
        self._named: set[Key] = set()  # stragglers the last analysis named
        self._late_ms: dict[int, tuple[str, float]] = {}  # rank written -> held_by(it)
        self._confirm_ns: int | None = None  # when one named, not written, may have lasted
        self._elected: tuple[float, bool] | None = None  # (when, whether I detect)
        self._window = Window()  # the full detections'
        self._asked = Window()  # the asks' between them
        self._pace = Pace(arrivals)
        self.analyst = Analyst(node)  # a window's analysis, as diagnose's
        self.groups = self.analyst.groups  # torch's names for the job's groups
        self._full_ns: int | None = None  # wall ns of the last full detection
        self._quiet = 0  # full detections in a row that found nothing, the look nothing since
        self._asked_ns = 0  # ... of the last ask between them
        self._alert_ns: int | None = None  # since when the pace is low
        self._stop = threading.Event()
        self._threads: list[Worker] = []  # the looks' and the full detections'

    def start(self) -> None:
        """The looks and the full detections, each on a thread of its own (a
        full detection of a busy node takes seconds: the looks go on)."""
        if self.every_s <= 0 or self._threads:
            return
        full_s = max(FULL_S, self.every_s)
        for name, every, step, caches, sooner in (
            ("probing-watch", self.every_s, self.look, (self._asked, self._pace), self._due),
            ("probing-detect", full_s, self._full, (self._window,), lambda: None),
        ):
            worker = self._run(name, every, step, caches, sooner)
            self._threads.append(worker)
            worker.start()

    def stop(self) -> None:
        self._stop.set()

    def detector(self) -> bool:
        """Whether this probe watches the job: no rank below it lives and
        answers (learned again every ``ELECT_S``)."""
        now = time.monotonic()
        if self._elected is not None and now - self._elected[0] < ELECT_S:
            return self._elected[1]
        mine = True
        for rank in range(self.node.rank):  # from the lowest: rank 0 answers, as a rule
            asked = self.node.control("/query", ALIVE, 3.0, {rank})
            [row] = asked or [{"status": 0, "addr": ""}]
            if row["status"] == 200 and not any(r.get("alive") for r in row.get("reply") or []):
                continue  # died: its probe answers for it
            if row["status"] == 0 and row.get("addr"):
                continue  # gone: refused, unreachable, no answer in time
            mine = False  # it lives, or is not known yet (not discovered): not me
            break
        self._elected = (now, mine)
        return mine

    def _run(
        self,
        name: str,
        every_s: float,
        step: Callable[[], Any],
        caches: tuple[Any, ...],
        sooner: Callable[[], float | None],
    ) -> Worker:
        """The thread ``name``: ``step`` every ``every_s`` while this probe
        traces and detects (else what ``caches`` keep is forgotten: it may
        have a gap when it comes back), or sooner where ``sooner`` says
        something is due then; both threads stop with ``stop()``."""
        began = time.monotonic()

        def detect() -> None:
            nonlocal began
            began = time.monotonic()
            if not self.tracing() or self.node.learning or not self.detector():
                for cache in caches:
                    cache.forget()
                return
            step()

        def due() -> float:
            # at a steady rate; a step longer than the period leaves a quarter of it
            wait = max(every_s - (time.monotonic() - began), every_s / 4)
            at = sooner()  # or sooner, where something is due then
            return wait if at is None else max(min(wait, at), 0.01)

        return Worker(
            name, detect, every_s, sooner=due, what="detection", on_error=self._failed,
            event=self._stop,
        )  # fmt: skip

    def _failed(self, err: Exception) -> None:
        """A look or a detection raised (peers, queries: tried again at the
        next; a bug is logged too): said in ``last_error``."""
        self.last_error = error_text(err)

    def tick(self, now_ns: int | None = None) -> list[dict[str, Any]]:
        """A look and, when one is due, a full detection, one after the other
        (what the two threads do): the findings new in them."""
        now = now_ns or time.time_ns()
        new = self.look(now)
        return new + self._full(now)

    def full_s(self) -> float:
        """The full detections' period now: ``FULL_S`` (or the looks' period,
        if longer), doubled after each full detection that found nothing, up
        to ``QUIET_S``: a steady healthy job is asked for its window twice a
        minute, not twelve times. Back to ``FULL_S`` at once where one finds
        anything or a look sees the pace drop (a straggler, a hang, a death
        and a slow link all slow the detector's collectives: the looks see
        them within a second, the next full detection in ``FULL_S``)."""
        base = max(FULL_S, self.every_s)
        return max(base, min(base * float(2**self._quiet), QUIET_S))

    def _full(self, now_ns: int | None = None) -> list[dict[str, Any]]:
        """A full detection where one is due (``full_s`` after the last; half
        a look's period early counts as due): the findings new in it."""
        now = now_ns or time.time_ns()
        if (
            self._full_ns is not None
            and now - self._full_ns < (self.full_s() - self.every_s / 2) * 1e9
        ):
            return []
        return self.once(now)

    def look(self, now_ns: int | None = None) -> list[dict[str, Any]]:
        """One look: the pace of this rank's collectives; an ask of every rank
        where it dropped, or a straggler awaits its confirmation; the
        findings new in it."""
        now = now_ns or time.time_ns()
        slowed = self._pace.look(self.node, now)
        with self.book.lock:
            waiting = self._named - self.book.active.keys()  # named, not yet confirmed
            known = {k[1] for k in self.book.active if k[0] == "straggler"}
            due = bool(waiting) and self._confirm_ns is not None and now >= self._confirm_ns
            if due:  # asked now: the analysis says when next, if ever (not again and again)
                self._confirm_ns = None
        if slowed:
            self._quiet = 0  # the next full detection within FULL_S
        if not due and not self._alert(slowed and not known, now):
            return []
        return self._ask(now, due, known)

    def _due(self) -> float | None:
        """Seconds until a straggler named and not written may have lasted
        ``CONFIRM_S`` (the look then asks), if one awaits."""
        at = self._confirm_ns
        return None if at is None else (at - time.time_ns()) / 1e9

    def _alert(self, slowed: bool, now: int) -> bool:
        """Whether the pace's drop (one no straggler written explains) asks
        the ranks now: at most every ``ASK_EVERY_S``, for ``ALERT_S`` at most."""
        if not slowed:
            self._alert_ns = None
            return False
        if self._alert_ns is None:
            self._alert_ns = now
        return now - self._alert_ns <= ALERT_S * 1e9 and now - self._asked_ns >= ASK_EVERY_S * 1e9

    def _ask(self, now: int, waiting: bool, known: set[int]) -> list[dict[str, Any]]:
        """Every rank asked for its new collectives between full detections;
        where their last ``TAIL_S`` names a straggler not written yet (or one
        awaits its confirmation, ``waiting``), the window's whole analysis:
        its confirmed stragglers are written (nothing is cleared here), with
        the step and each rank's lateness it found (``/metrics`` says them
        together)."""
        table, got = self._asked.fetch(self.node, now)
        self._asked_ns = now
        with self.book.lock:
            self.book.detections += 1
        if not self.analyst.aux:
            self.analyst.ask_aux(now, table, got)
        if not waiting and not _screen(table, now) - known:
            return []
        d, found = self._analyze(table, got, now, runq=False)
        return self.book.record(now, found, d, self.node.pid)

    def once(self, now_ns: int | None = None) -> list[dict[str, Any]]:
        """One full detection: ask, analyze, record, clear; the findings new in it."""
        now = now_ns or time.time_ns()
        table, got = self._window.fetch(self.node, now)
        with self.book.lock:
            self.book.detections += 1
        self.analyst.ask_aux(now, table, got)
        return self._detect(table, got, now)

    def _analyze(
        self, table: pa.Table, got: Any, now: int, runq: bool
    ) -> tuple[Any, dict[Key, dict[str, Any]]]:
        """The whole analysis of the window ``table``, and the stragglers it
        names to write (``_stragglers``): torch's names for the groups
        (``Groups.names``; asked again before a straggler is written by
        other names, which it keeps), only the span in which every rank that
        answered traced; ``runq``: a suspected slow link is told from ranks
        waiting for a CPU."""
        raw = table
        table, d = self.analyst.judged(raw, got, now, runq)
        latest = _latest_ts(table)
        with self.book.lock:
            new = [s for s in d.stragglers if self._writes(s, latest)]
        if new and self.groups.unnamed(raw):  # torch's names may have come since they were asked
            self.analyst.learn_groups(now, raw)
            if not self.groups.unnamed(raw):
                table, d = self.analyst.judged(raw, got, now, runq)
        if new:  # written now: with its cause, as the verdict says it
            self.analyst.explain(d, table, now - int(WINDOW_S * 1e9))
        with self.book.lock:
            return d, self._stragglers(d, latest)

    def _detect(self, table: pa.Table, got: Any, now: int) -> list[dict[str, Any]]:
        """The whole analysis of the window ``table``, recorded: every kind of
        finding, and what is over counted towards its clearing (``_over``)."""
        from probing.analyze.diagnose import death_text
        from probing.analyze.verdict import hang_text, slow_link_text

        d, found = self._analyze(table, got, now, runq=True)
        self._full_ns = now
        seen = {link.comm for link in d.slow_links}
        self._slow = {c: self._slow.get(c, 0) + 1 for c in seen}  # detections in a row
        for link in d.slow_links:
            if self._slow[link.comm] < GONE_AFTER:  # once: a busy CPU slows every rank alike
                continue
            found[("slow_link", link.comm)] = row(
                "slow_link", None, ",".join(link.nodes), link.comm, link.since, link.since_ns,
                slow_link_text(link),
            )  # fmt: skip
        for h in d.hangs:
            found[("hang", h.comm, h.seq)] = row(
                "hang", h.missing_ranks[0] if h.missing_ranks else None, None, h.comm, None,
                None, hang_text(h),
            )  # fmt: skip
        for r, x in d.dead.items():  # killed: its probe answers with what it left
            found[("rank_gone", r)] = row(
                "rank_gone", r, None, None, None, x.died_ns or None, death_text({r: x})
            )
        for m in got.missing:
            if not m.addr and m.rank not in self._seen:  # never discovered: not gone, not come
                continue
            self._misses[m.rank] = self._misses.get(m.rank, 0) + 1
            if self._misses[m.rank] >= GONE_AFTER:
                found[("rank_gone", m.rank)] = row(
                    "rank_gone", m.rank, m.node, None, None, None,
                    f"rank {m.rank} ({m.node or m.addr}) does not answer: {m.reason}",
                )  # fmt: skip
        for r in {t.rank for t in got.peers}:
            self._misses.pop(r, None)
            self._seen.add(r)
        new = self.book.record(now, found, d, self.node.pid, lambda k: self._over(k, d, got))
        from probing.analyze.collectives import MIN_COLLECTIVES

        judged = (d.summary.busiest or 0) >= MIN_COLLECTIVES  # a window too short tells nothing
        with self.book.lock:
            calm = not (found or self.book.active or self._named or d.stragglers or d.slow_links)
        self._quiet = self._quiet + 1 if calm and judged and not got.missing else 0
        return new

    def _over(self, key: Key, d: Any, got: Any) -> bool | None:
        """Whether the full detection ``d`` (who answered: ``got``) saw the
        active finding ``key``, which it did not find, over: a straggler only
        where every rank answered, the window could be judged and its rank is
        no longer ``HOLD`` as late as when it was written (False: still that
        late; None: it cannot tell); any other finding, yes."""
        from probing.analyze.collectives import MIN_COLLECTIVES

        if key[0] != "straggler":
            return True
        rank = key[1]
        judged = not d.hangs and (d.summary.busiest or 0) >= MIN_COLLECTIVES
        if got.missing or rank not in {t.rank for t in got.peers} or not judged:
            return None
        mine = next((r for r in d.ranks if r["rank"] == rank and r["collectives"]), None)
        figure, then = self._late_ms.get(rank, ("excess_ms_median", 0.0))
        return None if mine is None or mine[figure] is None else bool(mine[figure] < HOLD * then)

    def table(self) -> pa.Table:
        """``analyze.findings``."""
        return self.book.table()

    def metrics(self) -> str:
        """OpenMetrics text: what this probe's detections and tracer say."""
        return self.book.metrics(self.dropped())

    def _stragglers(self, d: Any, latest: int) -> dict[Key, dict[str, Any]]:
        """The stragglers the analysis ``d`` named to write, in the verdict's
        words (``straggler_text``): those written already, and new ones whose
        lateness lasted ``CONFIRM_S`` up to ``latest`` (ns), the last arrival
        analyzed. Holding the lock."""
        from probing.analyze.verdict import straggler_text

        found: dict[Key, dict[str, Any]] = {}
        keys = set()
        due = []
        for s in d.stragglers:
            key = ("straggler", s.rank)  # one problem, whatever its group is called now
            keys.add(key)
            if key not in self.book.active and latest - s.since_ns < CONFIRM_S * 1e9:
                # new and short: a burst of noise, maybe; asked again once it may have lasted
                due.append(s.since_ns + int((CONFIRM_S + DRAINED_S) * 1e9))
                continue
            if self._writes(s, latest):  # written now: the lateness its end is told by
                self._late_ms[s.rank] = held_by(s)
            found[key] = row(
                "straggler", s.rank, s.node, s.comm, s.since, s.since_ns,
                straggler_text(s, d.why),
            )  # fmt: skip
        self._named = keys
        self._confirm_ns = min(due, default=None)
        return found

    def _writes(self, s: Any, latest: int) -> bool:
        """Whether the straggler ``s`` is written now: new, and its lateness
        lasted ``CONFIRM_S`` up to ``latest`` (ns). Holding the lock."""
        new = ("straggler", s.rank) not in self.book.active
        return new and latest - s.since_ns >= CONFIRM_S * 1e9


class Analyst:
    """The analysis of a window of the job's collectives, as ``diagnose``
    does it, asked of every rank through ``node``: torch's names for the
    groups (``groups``), the ranks that died and who traced when (``aux``,
    asked at full detections), the span judged, the stragglers' causes."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self.groups = Groups()  # torch's names for the job's groups
        self.aux: dict[str, Any] = {}  # dead, intervals: asked at full detections
        self._aux_ns = 0  # when they were asked, and who answered then
        self._aux_who: set[int] = set()

    def ask_aux(self, now: int, table: pa.Table, got: Any) -> None:
        """The ranks that died and who traced when, and torch's groups where
        due for the window ``table`` (``Groups.due``) that ``got`` answered:
        asked at full detections, used by the analyses the screen starts
        between them. Deaths and spans change seldom: asked again every
        ``AUX_S``, and at once where the ranks that answered changed, one
        stood still (``_still``: it died, hangs, or stopped tracing) or the
        spans said one was not tracing (it may trace again)."""
        from probing.analyze.queries import optional, queries

        sql = queries(remote=True)

        def ask(q: str) -> pa.Table:
            return ask_cluster(self.node, q)

        if self.groups.due(table, now):  # torch's names, as diagnose says them
            self.learn_groups(now, table)
        who = {t.rank for t in got.peers}
        if (
            self.aux
            and now - self._aux_ns < AUX_S * 1e9
            and who == self._aux_who
            and not _still(table, who, now)
            and _all_tracing(self.aux.get("intervals"))
        ):
            return
        self._aux_ns, self._aux_who = now, who
        aux = dict(self.aux)  # the other thread reads them meanwhile: replaced at once
        aux["dead"] = ask(sql["dead"]).to_pylist()
        aux["intervals"] = optional(ask, sql["intervals"])
        self.aux = aux

    def judged(self, table: pa.Table, got: Any, now: int, runq: bool) -> tuple[pa.Table, Any]:
        """``table`` named by torch's groups and cut to the span every rank
        that answered (``got``) traced in, and its analysis."""
        from probing.analyze.diagnose import analyze, judge
        from probing.analyze.queries import optional, queries

        dead = self.aux["dead"]
        table = self.groups.names(table)
        since = now - int(WINDOW_S * 1e9)
        runq_sql = queries(remote=True)["runq"].format(since_ns=since)

        def ask_runq() -> pa.Table | None:
            return optional(lambda q: ask_cluster(self.node, q), runq_sql)

        answered = sorted({t.rank for t in got.peers})
        table, cov = judge(table, self.aux["intervals"], answered, dead, since, now)
        d = analyze(
            table, now_ns=now, window_s=WINDOW_S, hang_after_s=HANG_AFTER_S,
            dead=dead, runq=ask_runq if runq else None, coverage=cov,
        )  # fmt: skip
        return table, d

    def learn_groups(self, now: int, table: pa.Table) -> None:
        """torch's groups asked of every rank, for the window ``table``."""
        from probing.analyze.queries import optional, queries

        sql = queries(remote=True)["groups"]
        self.groups.learn(optional(lambda q: ask_cluster(self.node, q), sql), table, now)

    def explain(self, d: Any, table: pa.Table, since: int) -> None:
        """What makes ``d``'s stragglers slow (``d.why``), asked of every rank
        as ``diagnose`` asks it (``EXPLAIN``: their samples, CUDA calls, GPUs
        and CPUs since ``since``) over the window ``table`` analyzed: a
        finding says its cause as the verdict does. Asked only when a
        straggler is written (a few queries, not at every detection)."""
        from probing.analyze import collectives as coll
        from probing.analyze.diagnose import explain_stragglers, explained
        from probing.analyze.queries import optional, queries

        sql = queries(remote=True)
        got = {
            n: optional(lambda q: ask_cluster(self.node, q), sql[n].format(since_ns=since))
            for n in EXPLAIN
        }
        d.why = explain_stragglers(
            d.stragglers, coll.match(table), got["samples"], got["cuda"], got["nvml"], got["cpu"]
        )
        # a small straggler its samples show nothing of its own for is noise
        # here as in diagnose (``explained``): never written
        d.stragglers, d.why = explained(d.stragglers, d.why)


class Groups:
    """torch's names for the job's Gloo contexts (``comm.groups``, asked of
    every rank), kept between asks: a context belongs to one process group
    for its life, so what an answer said stays true. A window is named by
    them only where they name every Gloo context in it (``names``): a
    context one rank's answer left out (it had traced none yet, it did not
    answer in time) would make that rank's rows a communicator of their own
    (``gloo/n4#0`` beside ``gloo/pg0``) and split the group; such a window
    keeps the names by size and order, the same for every rank. Asked
    again every ``GROUPS_S`` (a job makes groups as it goes), and sooner,
    from ``GROUPS_RETRY_S`` on and twice as long after each answer that
    named none of them, while a window holds a context they do not name."""

    KEYS = ("node", "rank", "backend", "comm")

    def __init__(self) -> None:
        self.rows: dict[tuple[Any, ...], dict[str, Any]] = {}  # a context -> its comm.groups row
        self.asked_ns = 0
        self.retry_s = GROUPS_RETRY_S
        self.lock = threading.Lock()  # the look's and the full detection's threads name windows

    def due(self, table: pa.Table, now: int) -> bool:
        """Whether to ask for them again, for the window ``table`` at ``now``."""
        with self.lock:
            since = now - self.asked_ns
            if not self.asked_ns or since >= GROUPS_S * 1e9:
                return True
            return since >= self.retry_s * 1e9 and bool(self._unnamed(table))

    def learn(self, got: pa.Table | None, table: pa.Table, now: int) -> None:
        """What an ask answered (``got``; None: a probe without the table),
        asked for the window ``table``."""
        rows = got.to_pylist() if got is not None else []
        with self.lock:
            before = len(self._unnamed(table))
            if len(self.rows) + len(rows) > GROUPS_KEEP:
                self.rows = {}
            for g in rows:
                self.rows[tuple(g.get(c) for c in self.KEYS)] = g
            named = len(self._unnamed(table)) < before
            self.retry_s = GROUPS_RETRY_S if named else min(2 * self.retry_s, GROUPS_S)
            self.asked_ns = now

    def unnamed(self, table: pa.Table) -> bool:
        """Whether ``table`` holds a Gloo context no group known names."""
        with self.lock:
            return bool(self._unnamed(table))

    def names(self, table: pa.Table) -> pa.Table:
        """``table`` with its Gloo contexts named by torch's groups (``pg``,
        ``diagnose.with_groups``) where the groups known name every one."""
        import pyarrow as pa

        from probing.analyze.diagnose import with_groups

        with self.lock:
            if not self.rows or self._unnamed(table):
                return table
            groups = pa.Table.from_pylist(list(self.rows.values()))
        return with_groups(table, groups)

    def _unnamed(self, table: pa.Table) -> set[tuple[Any, ...]]:
        """The Gloo contexts of ``table`` (by node, rank, backend, comm) no
        group known names. Holding the lock."""
        import pyarrow.compute as pc

        from probing.analyze import columns

        if not table.num_rows or "backend" not in table.column_names:
            return set()
        gloo = table.filter(pc.equal(table.column("backend"), "gloo"))
        if not gloo.num_rows:
            return set()
        keys = [c for c in self.KEYS if c in gloo.column_names]
        _, firsts = columns.distinct(gloo, keys)
        picked = gloo.take(firsts)
        cols = [picked.column(c).to_pylist() for c in keys]
        return {k for k in zip(*cols, strict=True) if k not in self.rows}


def _all_tracing(intervals: pa.Table | None) -> bool:
    """Whether every rank's last span (``trace.intervals``) traces; True where unknown."""
    if intervals is None or "state" not in intervals.column_names:
        return True
    return all(s == "tracing" for s in intervals.column("state").to_pylist())


def _still(table: pa.Table, ranks: set[int], now: int) -> bool:
    """Whether one of ``ranks`` began no collective of ``table`` in the last ``STILL_S``."""
    import pyarrow.compute as pc

    if not table.num_rows:
        return True
    newest = table.group_by("rank").aggregate([("ts", "max")])
    fresh = pc.greater_equal(newest.column("ts_max"), now - int(STILL_S * 1e9))
    moving = set(newest.filter(fresh).column("rank").to_pylist())
    return bool(ranks - moving)


def _screen(table: pa.Table, now: int) -> set[int]:
    """The ranks the collectives of the last ``TAIL_S`` of ``table`` name
    stragglers (a few ms: the window's analysis follows where they name one)."""
    import pyarrow.compute as pc

    from probing.analyze import collectives as coll

    if not table.num_rows:
        return set()
    tail = table.filter(pc.greater_equal(table.column("ts"), now - int(TAIL_S * 1e9)))
    if not tail.num_rows:
        return set()
    return {s.rank for s in coll.stragglers(coll.match(tail), {})}


class Pace:
    """The arrivals of the detector's own rank at its collectives, kept
    ``PACE_S``: whether the last ``RECENT_S`` ran slower than the time before
    (each look reads the arrivals since the last, less ``LAG_S``: from
    ``arrivals(since_ns)``, its tracer's drained calls, where it has them;
    else from its own tables, a query of 25 ms a second)."""

    def __init__(self, arrivals: Callable[[int], Any] | None = None) -> None:
        self.ts: list[int] = []  # arrivals, in order
        self.looked_ns = 0
        self.arrivals = arrivals

    def forget(self) -> None:
        self.ts = []
        self.looked_ns = 0

    def look(self, node: Any, now: int) -> bool:
        """This rank's arrivals asked again; whether their pace dropped."""
        lo = now - int(PACE_S * 1e9)
        if self.looked_ns:
            lo = max(lo, self.looked_ns - int(LAG_S * 1e9))
        got = self.arrivals(lo) if self.arrivals is not None else None
        if got is not None:
            fresh = sorted(got.tolist())
        else:
            sql = f"SELECT ts FROM comm.collectives WHERE ts >= {lo}"
            try:
                fresh = sorted(node.engine().sql(sql, allow_code=False)["ts"].to_pylist())
            except ProbingError:  # no such table yet: nothing traced
                fresh = []
        keep = now - int(PACE_S * 1e9)
        self.ts = [t for t in self.ts if keep <= t < lo] + fresh
        self.looked_ns = now
        return slowed(self.ts)


def slowed(ts: list[int]) -> bool:
    """Whether arrivals ``ts`` (ns, in order) came at under ``SLOWER`` of
    their earlier pace over their last ``RECENT_S`` (or 4 usual intervals),
    with ``MIN_PACE`` arrivals before it to tell that pace."""
    import numpy as np

    if len(ts) < MIN_PACE:
        return False
    t = np.asarray(ts, dtype=np.int64)
    usual = float(np.median(np.diff(t)))
    recent = max(RECENT_S * 1e9, 4 * usual)
    split = t[-1] - recent
    before = t[t <= split]
    if len(before) < MIN_PACE or before[-1] <= before[0]:
        return False
    pace = (len(before) - 1) / (before[-1] - before[0])  # arrivals per ns, before
    now_pace = int(np.count_nonzero(t > split)) / recent
    return bool(now_pace < SLOWER * pace)


class Window:
    """The last ``WINDOW_S`` of the job's finished collectives, kept between
    asks: each fetch asks only for the calls that ended since the last one
    (less ``LAG_S``, for those drained since) and those in flight."""

    def __init__(self) -> None:
        self.rows: pa.Table | None = None  # finished calls, each ended before ``asked_ns``
        self.asked_ns = 0  # the wall ns of the last fetch
        self.whole_ns = 0  # ... and of the last that asked the whole window

    def forget(self) -> None:
        self.rows = None

    def fetch(self, node: Any, now: int) -> tuple[pa.Table, Any]:
        """The window's collectives at ``now`` (finished and in flight) and who
        answered; the whole window where nothing is kept, every ``RESYNC_S``,
        and after a rank missed a fetch."""
        import pyarrow as pa
        import pyarrow.compute as pc

        from probing.analyze.queries import queries

        since = now - int(WINDOW_S * 1e9)
        sql = queries(remote=True)["collectives"].format(since_ns=since)
        kept = self.rows
        if now - self.whole_ns >= RESYNC_S * 1e9 or now < self.asked_ns:
            kept = None
        cursor = self.asked_ns - int(LAG_S * 1e9)
        if kept is not None:
            sql = (
                f"SELECT * FROM ({sql}) AS c WHERE c.dur_ns IS NULL OR c.ts + c.dur_ns >= {cursor}"
            )
        table, got, _ = node.coordinate(sql, timeout=ASK_S)
        if kept is not None and kept.num_rows:
            ts, dur = kept.column("ts"), kept.column("dur_ns")
            old = kept.filter(
                pc.and_(pc.greater_equal(ts, since), pc.less(pc.add(ts, dur), cursor))
            )
            if table.num_columns:
                old = old.select([c for c in table.column_names if c in old.column_names])
                table = pa.concat_tables([old, table], promote_options="permissive")
            else:
                table = old
        self.asked_ns = now
        if kept is None:
            self.whole_ns = now
        finished = table.filter(pc.is_valid(table.column("dur_ns"))) if table.num_rows else table
        self.rows = None if got.missing else finished  # a rank's rows missed: all again next
        return table, got


def _latest_ts(table: pa.Table) -> int:
    """The latest arrival in ``table`` (0 where it has none)."""
    import pyarrow.compute as pc

    if not table.num_rows:
        return 0
    return int(pc.max(table.column("ts")).as_py() or 0)
