"""What the web UI's pages show, computed from the probes (JSON-ready dicts).

``JobView`` asks the job through a ``probing.cli.export.Source`` (like the CLI,
through ``probing.cli.client`` / ``probing.node.cluster``) and reuses the analysis
``diagnose`` runs: collectives matched across ranks
(``analyze.collectives.match``), stragglers (``stragglers.stragglers``),
traced hangs (``hangs.traced_hangs``).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from probing.cli.export.source import Source
from probing.errors import ProbingError

COLUMNS = 40  # heatmap time buckets
MAX_ROWS = 5000  # SQL rows sent to the page (the CSV download has them all)
GPU_POINTS = 240  # samples per series on a chart
GPU_SQL = (
    "SELECT ts, gpu, util_gpu, util_mem, mem_used, mem_total, power_w, temp_c{tags} "
    "FROM nvml.gpu WHERE ts >= {since}"
)
HANG_AFTER_S = 10.0
SLOW_TTL_S = 10.0  # the ranks: asked again this often
# a diagnosis older than this is shown at once while a new one is made behind it
DIAGNOSIS_AGE_S = 2.0


def _cell(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, int | float | str | bool) or v is None:
        return v
    return str(v)


def heatmap(
    collectives: list[Any],
    ranks: list[int],
    lo: int,
    hi: int,
    hangs: list[HangMark] | None = None,
    columns: int = COLUMNS,
) -> dict[str, Any]:
    """Per rank and time bucket: mean arrival lag (ms), step time (ms: the
    interval between successive collectives of the busiest communicator), and
    ``absent``: from when the others entered a hung collective this rank never
    entered (``HangMark``s with their start, ``since_ns``)."""
    width = max(1, (hi - lo) // columns)
    n = len(ranks)
    idx = {r: i for i, r in enumerate(ranks)}
    lag_sum, lag_n = np.zeros((n, columns)), np.zeros((n, columns))
    step_sum, step_n = np.zeros((n, columns)), np.zeros((n, columns))
    absent = np.zeros((n, columns))
    for h in hangs or []:  # a rank that never entered a hung collective: absent since then
        col = min(columns - 1, max(0, (h.since_ns - lo) // width))
        for r in h.missing_ranks:
            if r in idx:
                absent[idx[r], col:] += 1
    if collectives:
        counts: dict[str, int] = {}
        for c in collectives:
            counts[c.comm] = counts.get(c.comm, 0) + 1
        busiest = max(counts, key=counts.__getitem__)
        last: dict[int, int] = {}
        for c in collectives:
            col = min(columns - 1, max(0, (c.first_ns - lo) // width))
            for r, lag in c.lags_ns().items():
                if r in idx and len(c.ts) > 1:
                    lag_sum[idx[r], col] += lag / 1e6
                    lag_n[idx[r], col] += 1
            if c.comm == busiest:
                for r, ts in c.ts.items():
                    if r in idx and r in last:
                        step_sum[idx[r], col] += (ts - last[r]) / 1e6
                        step_n[idx[r], col] += 1
                    last[r] = ts

    def cells(total: np.ndarray, count: np.ndarray) -> list[list[float | None]]:
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = total / count
        return [[None if count[i, j] == 0 else round(float(mean[i, j]), 2)
                 for j in range(columns)] for i in range(n)]  # fmt: skip

    return {
        "t0_ns": lo,
        "bucket_ns": int(width),
        "lag_ms": cells(lag_sum, lag_n),
        "step_ms": cells(step_sum, step_n),
        "absent": absent.astype(int).tolist(),
    }


@dataclasses.dataclass
class HangMark:
    """A hang as the heatmap marks it: the ranks missing from its collective,
    from when the others entered it (``since_ns``)."""

    missing_ranks: list[int]
    since_ns: int


def hang_at(h: Any, matched: list[Any]) -> HangMark:
    """A traced hang with the time its collective was first entered."""
    c = next((c for c in matched if c.comm == h.comm and c.seq == h.seq), None)
    return HangMark(list(h.missing_ranks), c.first_ns if c else 0)


class Latest:
    """The last value ``make()`` gave, made again behind it once older than
    ``max_age_s`` (stale while it is made anew), on a daemon thread: a
    request waits only when there is no value yet, and a failure is raised
    to the next request (which then makes it itself)."""

    def __init__(self, make: Callable[[], Any], max_age_s: float) -> None:
        self._make = make
        self._max_age_s = max_age_s
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._value: tuple[float, Any] | None = None  # (made at, monotonic; value)
        self._error: BaseException | None = None
        self._making = False

    def get(self) -> Any:
        with self._lock:
            if self._value is None and self._making:  # the first: wait for it
                self._done.wait_for(lambda: not self._making)
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            if self._value is not None:
                made, value = self._value
                if time.monotonic() - made >= self._max_age_s:
                    self._start()
                return value
            self._making = True
        try:
            value = self._make()
        finally:
            with self._lock:
                self._making = False
                self._done.notify_all()
        with self._lock:
            self._value = (time.monotonic(), value)
        return value

    def refresh(self) -> None:
        """Make a new value behind the last, unless one is being made."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self._making:
            return
        self._making = True
        threading.Thread(target=self._remake, name="probing-ui-refresh", daemon=True).start()

    def _remake(self) -> None:
        value: tuple[float, Any] | None = None
        error: BaseException | None = None
        try:
            value = (time.monotonic(), self._make())
        except Exception as err:  # raised to the next request
            error = err
        with self._lock:
            self._making = False
            if value is not None:
                self._value = value
            else:
                self._value, self._error = None, error
            self._done.notify_all()


class JobView:
    """The UI's data source: one per ``probing ui``, shared by its request threads."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self._cache: dict[str, tuple[float, Any]] = {}
        self._lock = threading.RLock()
        self._latest: dict[str, Latest] = {}
        self.trace_path: str | None = None
        self._tmp: str | None = None  # made by the first timeline export
        self._groups: Any = None  # torch's names for the job's groups (node.detector.groups.Groups)

    def _cached(self, key: str, ttl: float, make: Any) -> Any:
        """One computation per ``ttl`` seconds, however many pages ask at once."""
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and time.monotonic() - hit[0] < ttl:
                return hit[1]
            value = make()
            self._cache[key] = (time.monotonic(), value)
            return value

    # -- Job ------------------------------------------------------------------------
    def job(self, window_s: float = 60.0) -> dict[str, Any]:
        return self._cached(f"job{window_s}", 0.5, lambda: self._job(window_s))

    def _job(self, window_s: float) -> dict[str, Any]:
        from probing.analyze import collectives as coll
        from probing.analyze import hangs as hg
        from probing.analyze import stragglers as sg
        from probing.analyze.queries import queries
        from probing.analyze.verdict import straggler_text

        now = time.time_ns()
        since = now - int(window_s * 1e9)
        sql = queries(self.source.remote)
        table = self._named(self.source.ask(sql["collectives"].format(since_ns=since)), now)
        known = self._cached("ranks", SLOW_TTL_S, self.source.ranks)
        nodes = {r.rank: r.node for r in known}
        if table.num_rows:
            for n, r in zip(table.column("node").to_pylist(), table.column("rank").to_pylist(),
                            strict=True):  # fmt: skip
                nodes.setdefault(r, n)
        ranks = sorted(nodes)
        matched = coll.match(table)
        hangs = hg.traced_hangs(matched, ranks, now, HANG_AFTER_S)
        strag = [] if hangs else sg.stragglers(matched, nodes)
        lo = since
        if table.num_rows:
            lo = max(since, min(table.column("ts").to_pylist()))
        grid = heatmap(matched, ranks, lo, now, [hang_at(h, matched) for h in hangs])
        done = [c for c in matched if c.complete and c.nranks > 1]
        rows = []
        for i, r in enumerate(ranks):
            mine = [c for c in done if r in c.ts]
            lags = [c.lags_ns()[r] / 1e6 for c in mine]
            last = sum(1 for c in mine if max(c.ts, key=c.ts.__getitem__) == r)
            steps = [v for v in grid["step_ms"][i] if v is not None]
            rows.append({
                "rank": r, "node": nodes.get(r, ""), "collectives": len(mine),
                "lag_ms_mean": round(float(np.mean(lags)), 2) if lags else None,
                "last_pct": round(100 * last / len(mine), 1) if mine else None,
                "step_ms": round(float(np.median(steps)), 2) if steps else None,
            })  # fmt: skip
        return {
            "now_ns": now,
            "window_s": window_s,
            "ranks": rows,
            "heatmap": grid,
            # each with the verdict's sentence (late per step of the job, its share)
            "stragglers": [dict(dataclasses.asdict(s), text=straggler_text(s, ())) for s in strag],
            "hangs": [
                {
                    "comm": h.comm,
                    "seq": h.seq,
                    "op": h.op,
                    "missing_ranks": h.missing_ranks,
                    "waiting_ranks": h.waiting_ranks,
                    "age_s": h.age_s,
                }
                for h in hangs
            ],  # fmt: skip
            "missing": list(self.source.missing),
            "collectives": len(matched),
        }

    def _named(self, table: pa.Table, now: int) -> pa.Table:
        """``table`` with its groups named as the detector and ``diagnose`` name
        them (``probing.node.detector.groups.Groups``: torch's names where they name
        every Gloo context of it, asked again while one is left unnamed)."""
        from probing.analyze.queries import optional, queries
        from probing.node.detector.groups import Groups

        with self._lock:
            if self._groups is None:
                self._groups = Groups()
            groups = self._groups
        if groups.due(table, now):
            groups.learn(optional(self.source.ask, queries(self.source.remote)["groups"]), table,
                         now)  # fmt: skip
        named: pa.Table = groups.names(table)
        return named

    # -- Diagnose -------------------------------------------------------------------
    def diagnose(self, window_s: float = 60.0) -> dict[str, Any]:
        """The latest diagnosis (``as_of_ns``: when it was made): at once when
        there is one, a new one made behind it when it is older than
        ``DIAGNOSIS_AGE_S``. A diagnosis asks every rank a dozen questions
        (seconds, on busy ranks); the page shows the last while the next is made."""
        value: dict[str, Any] = self._diagnosis(window_s).get()
        return value

    def warm(self, window_s: float = 60.0) -> None:
        """Start the first diagnosis (the UI starting: ready when its page is opened)."""
        self._diagnosis(window_s).refresh()

    def _diagnosis(self, window_s: float) -> Latest:
        with self._lock:
            key = f"diag{window_s}"
            if key not in self._latest:
                self._latest[key] = Latest(lambda: self._diagnose(window_s), DIAGNOSIS_AGE_S)
            return self._latest[key]

    def _diagnose(self, window_s: float) -> dict[str, Any]:
        from probing.cli.asking import diagnose
        from probing.cli.client import JobClient

        src = self.source
        job = JobClient(
            pids=src.pids or None, addr=src.addr, cluster=src.cluster, timeout=src.timeout
        )
        d, _ = diagnose(job, window_s=window_s, hang_after_s=HANG_AFTER_S, eager=True)
        out = d.to_json()
        out["stacks_by_rank"] = {str(r): lines for r, lines in d.stacks.items()}
        out["elapsed_s"] = d.elapsed_s
        out["as_of_ns"] = time.time_ns()
        return out

    # -- SQL ------------------------------------------------------------------------
    def sql(self, query: str, all_ranks: bool) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            table = self._run_sql(query, all_ranks)
        except ProbingError as err:
            return {"error": str(err)}
        shown = table.slice(0, MAX_ROWS)
        cols = [shown.column(i).to_pylist() for i in range(shown.num_columns)]
        return {
            "columns": table.column_names,
            "rows": [[_cell(v) for v in row] for row in zip(*cols, strict=True)],
            "total": table.num_rows,
            "truncated": table.num_rows > MAX_ROWS,
            "elapsed_ms": round(1000 * (time.perf_counter() - t0), 1),
        }

    def sql_csv(self, query: str, all_ranks: bool) -> bytes:
        import pyarrow.csv as pacsv

        sink = pa.BufferOutputStream()
        pacsv.write_csv(self._run_sql(query, all_ranks), sink)
        return sink.getvalue().to_pybytes()

    def _run_sql(self, query: str, all_ranks: bool) -> pa.Table:
        if all_ranks:
            return self.source.ask(query)
        from probing.cli.client import ProbeClient

        src = self.source
        if src.addr:
            client = ProbeClient.for_addr(src.addr, timeout=src.timeout + 30)
        else:
            client = ProbeClient.for_pid(src.pids[0], timeout=src.timeout + 30)
        with client:
            return client.query(query)

    # -- GPU ------------------------------------------------------------------------
    def gpu(self, window_s: float = 60.0) -> dict[str, Any]:
        return self._cached(f"gpu{window_s}", 0.5, lambda: self._gpu(window_s))

    def _gpu(self, window_s: float) -> dict[str, Any]:
        since = time.time_ns() - int(window_s * 1e9)
        table = self.source.align(self.source.ask(GPU_SQL.replace("{since}", str(since))))
        series: dict[str, dict[str, Any]] = {}
        metrics = ("util_gpu", "util_mem", "mem_used", "power_w", "temp_c")
        for row in sorted(table.to_pylist(), key=lambda r: r["ts"]):
            key = f"rank {row['rank']} gpu {row['gpu']}"
            s = series.setdefault(key, {"rank": row["rank"], "gpu": row["gpu"], "ts": [],
                                         **{m: [] for m in metrics}})  # fmt: skip
            s["ts"].append(row["ts"])
            for m in metrics:
                s[m].append(row[m])
        for s in series.values():  # at most GPU_POINTS per series
            step = max(1, len(s["ts"]) // GPU_POINTS)
            for k in ("ts", *metrics):
                s[k] = s[k][::step]
        return {"series": list(series.values()), "samples": table.num_rows,
                "missing": list(self.source.missing)}  # fmt: skip

    # -- Timeline -------------------------------------------------------------------
    def timeline(self, window_s: float = 60.0, max_events: int = 1_000_000) -> dict[str, Any]:
        """Export the current window for the packaged Perfetto UI (``/localtrace``)."""
        from probing.cli.export import export

        with self._lock:
            if self._tmp is None:
                self._tmp = tempfile.mkdtemp(prefix="probing-ui-")
        path = os.path.join(self._tmp, f"window-{time.time_ns()}.pftrace")
        report = export(self.source, path, window_s=window_s, max_events=max_events)
        old, self.trace_path = self.trace_path, path
        if old and old != path:
            try:
                os.unlink(old)
            except OSError:
                pass
        return {"events": report.events, "bytes": report.bytes, "ranks": report.ranks,
                "seconds": report.seconds, "note": report.cap.message()}  # fmt: skip

    def close(self) -> None:
        import shutil

        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
