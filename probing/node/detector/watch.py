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
  their last ``TAIL_S`` screened for a straggler (``stragglers.stragglers``,
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

The node (``probing.node.cluster.node.ClusterNode``) is handed in: this
package does not import the cluster's, and asks through the parts the node
names (``coordinate``, ``control``). What it holds the
job to and the verdicts it draws over tables are ``probing.analyze``'s
(``detection``, ``findings``, ``diagnose``); it asks (``window``,
``analyst``), keeps (``book``, ``groups``) and runs the threads (here).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from probing.analyze.detection import (
    ALERT_S,
    ASK_EVERY_S,
    CONFIRM_S,
    DRAINED_S,
    FULL_S,
    GONE_AFTER,
    WINDOW_S,
    calm,
    full_period_s,
    gone,
    held_by,
    latest_ts,
    over,
    screen,
)
from probing.analyze.findings import Key, row
from probing.node.detector.analyst import Analyst
from probing.node.detector.book import Book
from probing.node.detector.window import Pace, Window
from probing.worker import Worker, error_text

if TYPE_CHECKING:
    import pyarrow as pa

    from probing.node.detector import Answers, Job

ELECT_S = 30.0  # how often a rank above the detector checks that the ranks below live
ALIVE = json.dumps({"sql": "SELECT alive FROM process.info", "format": "json"}).encode()


def detect_s() -> float:
    """``PROBING_DETECT_S``: seconds between looks (1; 0 turns detection off)."""
    from probing import config

    try:
        return float(config.load().detect_s)
    except ValueError:  # a bad value: the default (its probe said so at start-up)
        return 1.0


class Watch:
    """The detector of one probe (``start`` once; it detects only while
    ``tracing()`` and this probe is the job's detector)."""

    def __init__(
        self,
        node: Job,
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
        """The looks and the full detections, each on its name's beat (one
        thread for every rank's of the engine, and for the looks apart from
        the full detections: a full detection of a busy node takes seconds,
        the looks go on)."""
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
            if asked and gone(asked[0]):  # died (its probe answers for it), or gone
                continue
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
            event=self._stop, shared=True,
        )  # fmt: skip

    def _failed(self, err: Exception) -> None:
        """A look or a detection raised (peers, queries: tried again at the
        next; a bug is logged too): said in ``last_error``."""
        self.last_error = error_text(err)

    def tick(self, now_ns: int | None = None) -> list[dict[str, Any]]:
        """A look and, when one is due, a full detection, one after the other
        (what the two threads do): the findings new in them."""
        now = now_ns or time.time_ns()
        return self.look(now) + self._full(now)

    def full_s(self) -> float:
        """The full detections' period now (``detection.full_period_s``):
        ``FULL_S`` again once a look sees the pace drop or one finds anything."""
        return full_period_s(max(FULL_S, self.every_s), self._quiet)

    def _full(self, now_ns: int | None = None) -> list[dict[str, Any]]:
        """A full detection if one is due (half a look early counts)."""
        now, last = now_ns or time.time_ns(), self._full_ns
        due = last is None or now - last >= (self.full_s() - self.every_s / 2) * 1e9
        return self.once(now) if due else []

    def look(self, now_ns: int | None = None) -> list[dict[str, Any]]:
        """One look: the pace of this rank's collectives; an ask of every rank
        where it dropped, or a straggler awaits its confirmation; the
        findings new in it."""
        now = now_ns or time.time_ns()
        slowed = self._pace.look(self.node, now)
        if slowed:
            self._quiet = 0  # the next full detection within FULL_S
        with self.book.lock:
            waiting = self._named - self.book.active.keys()  # named, not yet confirmed
            known = {k[1] for k in self.book.active if k[0] == "straggler"}
            due = bool(waiting) and self._confirm_ns is not None and now >= self._confirm_ns
            if due:  # asked now: the analysis says when next, if ever (not again and again)
                self._confirm_ns = None
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
        if not waiting and not screen(table, now) - known:
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
        self, table: pa.Table, got: Answers, now: int, runq: bool
    ) -> tuple[Any, dict[Key, dict[str, Any]]]:
        """The whole analysis of the window ``table``, and the stragglers it
        names to write (``_stragglers``): torch's names for the groups
        (``Groups.names``; asked again before a straggler is written by
        other names, which it keeps), only the span in which every rank that
        answered traced; ``runq``: a suspected slow link is told from ranks
        waiting for a CPU."""
        raw = table
        table, d = self.analyst.judged(raw, got, now, runq)
        latest = latest_ts(table)
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

    def _detect(self, table: pa.Table, got: Answers, now: int) -> list[dict[str, Any]]:
        """The whole analysis of the window ``table``, recorded: every kind of
        finding, and what is over counted towards its clearing (``over``)."""
        from probing.analyze.deaths import death_text
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
        new = self.book.record(
            now, found, d, self.node.pid, lambda k: over(k, d, got, self._late_ms.get(k[1]))
        )
        with self.book.lock:
            active = bool(self.book.active or self._named)
        self._quiet = self._quiet + 1 if calm(d, got, found, active) else 0
        return new

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
