"""Render query results for a terminal: aligned columns that fit the width."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from probing.analyze.diagnose import Diagnosis

MIN_COL = 6


def _cell(v: Any, null: str = "NULL") -> str:
    if v is None:
        return null
    if isinstance(v, float):
        return _float(v)
    return str(v).replace("\n", " ")


def _float(v: float) -> str:
    """A float for people: fixed-point, 2 decimals (3 significant digits
    below 1), never an exponent but where fixed-point cannot show it."""
    size = abs(v)
    if not math.isfinite(v) or size >= 1e15 or 0 < size < 1e-6:
        return f"{v:.6g}"
    if size >= 1 or size == 0:
        return f"{v:.2f}"
    return f"{v:.{2 - math.floor(math.log10(size))}f}"


def format_rows(
    names: list[str], rows: list[list[Any]], width: int = 80, null: str = "NULL"
) -> str:
    """Aligned text, numbers right-aligned, shrinking the widest columns to
    fit; a missing value shows as ``null``."""
    cells = [[_cell(v, null) for v in row] for row in rows]
    numeric = [
        all(isinstance(r[i], int | float) or r[i] is None for r in rows) and bool(rows)
        for i in range(len(names))
    ]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
    budget = width - 2 * (len(names) - 1)
    while sum(widths) > budget and max(widths) > MIN_COL:
        widest = widths.index(max(widths))
        widths[widest] -= 1

    def fit(text: str, w: int, right: bool) -> str:
        if len(text) > w:
            text = text[: max(w - 1, 0)] + "…"
        return text.rjust(w) if right else text.ljust(w)

    lines = ["  ".join(fit(n, w, num) for n, w, num in zip(names, widths, numeric, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append(
            "  ".join(fit(c, w, num) for c, w, num in zip(row, widths, numeric, strict=True))
        )
    return "\n".join(line.rstrip() for line in lines)


def format_table(
    names: list[str], rows: list[list[Any]], width: int = 80, null: str = "NULL"
) -> str:
    """A query's answer: its rows aligned (``format_rows``), then the count."""
    text = format_rows(names, rows if names else [], width, null)
    n = len(rows)
    return f"{text}\n({n} row{'s' if n != 1 else ''})"


def format_arrow(table: Any, width: int = 80) -> str:
    """``format_table`` of a ``pyarrow.Table``."""
    names = list(table.column_names)
    cols = [table.column(i).to_pylist() for i in range(table.num_columns)]
    rows = [list(r) for r in zip(*cols, strict=True)] if cols else [[]] * table.num_rows
    return format_table(names, rows, width)


def format_stacks(info: dict[str, Any], frames: list[dict[str, Any]]) -> str:
    """``process.stacks`` rows as ``py-spy dump`` prints them: one block per thread."""
    cmdline = " ".join(str(info.get("cmdline") or "").split())
    out = [
        f"Process {info.get('pid')}: {cmdline[:100]}{'…' if len(cmdline) > 100 else ''}",
        f"Python v{info.get('python', '?')} ({info.get('python_executable', '?')})",
    ]
    threads: dict[Any, list[dict[str, Any]]] = {}
    for f in frames:
        threads.setdefault((f["tid"], f["thread"]), []).append(f)
    for (tid, name), rows in threads.items():
        head = rows[0]
        state = head["state"]
        if head.get("syscall") and state != "active":
            state += f", in {head['syscall']}"
        out.append("")
        out.append(f'Thread {tid if tid is not None else "?"} ({state}): "{name}"')
        for r in sorted(rows, key=lambda r: r["depth"]):
            out.append(f"    {r['func']} ({r['file']}:{r['line']})")
    return "\n".join(out)


def control_rows(
    rows: list[dict[str, Any]], done: str, who: tuple[str, ...] = ("rank", "node", "addr")
) -> str:
    """``trace --cluster`` (``--job``: ``who=("pid",)``)'s answer: how many
    ranks are ``done`` (tracing, stopped), then a row per rank with its state
    or why it is not."""
    ok = sum(1 for r in rows if r["ok"])
    table = format_table(
        [*who, "state", "reason"],
        [[*(r[k] for k in who), r["state"] if r["ok"] else "-", r["reason"] or ""] for r in rows],
    )
    return f"{ok} of {len(rows)} ranks {done}\n{table}"


def refused_lines(family: str, refused: list[dict[str, str]], pid: int) -> list[str]:
    """What ``probing trace`` says of ``family``'s uprobes that were not
    attached: their calls are not traced. One line an error, its symbols."""
    if not refused:
        return []
    by_error: dict[str, list[str]] = {}
    for r in refused:
        what = f"every uprobe on {r['library']}" if r["symbol"] == "*" else r["symbol"]
        names = by_error.setdefault(r["error"], [])
        if what not in names:
            names.append(what)
    n = len(refused)
    lines = [f"  ! {family}: {n} uprobe{'s' * (n != 1)} not attached, their calls not traced:"]
    for error, names in by_error.items():
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        lines.append(f"      {shown}: {error}")
    sql = f"SELECT * FROM probing.uprobes WHERE NOT attached AND family = '{family}'"
    lines.append(f'      each one and its whole error: probing query --pid {pid} "{sql}"')
    return lines


class TraceMonitor:
    """What ``probing trace`` prints: the attach report, one line a second
    (events/s by table, drops; a live table on a terminal), the summary."""

    def __init__(self, pid: int, status: dict[str, Any]) -> None:
        self.pid = pid
        self.status = status

    def started(self) -> str:
        lines = [f"tracing pid {self.pid}:"]
        for name, fam in self.status.get("families", {}).items():
            libs = ", ".join(lib.rsplit("/", 1)[-1] for lib in fam["libraries"])
            where = f"{fam['uprobes']} uprobes on {libs}" if libs else "no library mapped yet"
            lines.append(f"  {name + '.calls':<11} {where}")
        for name, fam in self.status.get("families", {}).items():
            lines += refused_lines(name, fam.get("refused", []), self.pid)
        if "stacks" in self.status:
            on = "on" if self.status["stacks"] else "off"
            launches = " (launches too)" if self.status.get("launch_stacks") else ""
            lines.append(f"  {'stacks':<11} {on}{launches}, in python.stacks")
        if self.status.get("output"):
            lines.append(f"  output      {self.status['output']}")
        return "\n".join(lines)

    @staticmethod
    def _line(elapsed: float, rates: dict[str, float], status: dict[str, Any]) -> str:
        fams = status.get("families", {})
        parts = [f"{n} {rates.get(n, 0):>7.0f}/s ({f['events']})" for n, f in fams.items()]
        drops = sum(f["dropped"] for f in fams.values())
        return f"{elapsed:6.1f}s  " + "  ".join(parts) + f"  dropped {drops}"

    def follow(self, poll: Any, duration: float | None, interval: float = 1.0) -> None:
        """Poll ``poll()`` (the probe's /trace/status) until ``duration``
        passes (or forever); raises KeyboardInterrupt on Ctrl-C."""
        import sys
        import time

        start = last_t = time.monotonic()
        last = {n: f["events"] for n, f in self.status.get("families", {}).items()}
        live = None
        if sys.stdout.isatty():
            from rich.console import Console
            from rich.live import Live

            live = Live(console=Console(), auto_refresh=False)
            live.start()
        try:
            while duration is None or time.monotonic() - start < duration:
                remaining = None if duration is None else duration - (time.monotonic() - start)
                time.sleep(interval if remaining is None else max(0.0, min(interval, remaining)))
                status = poll()
                now = time.monotonic()
                fams = status.get("families", {})
                rates = {
                    n: (f["events"] - last.get(n, 0)) / max(now - last_t, 1e-9)
                    for n, f in fams.items()
                }
                last, last_t = {n: f["events"] for n, f in fams.items()}, now
                self.status = status
                line = self._line(now - start, rates, status)
                if live is not None:
                    live.update(line, refresh=True)
                else:
                    print(line, flush=True)
                if status.get("state") != "tracing":
                    break
        finally:
            if live is not None:
                live.stop()

    @staticmethod
    def summary(status: dict[str, Any]) -> str:
        fams = status.get("families", {})
        counts = ", ".join(
            f"{n}.calls {f['events']} events ({f['dropped']} dropped)" for n, f in fams.items()
        )
        out = f"trace stopped: {counts or 'no events'}; every uprobe detached"
        if status.get("output"):
            out += f"\nwritten: {status['output']}"
        if status.get("last_error"):
            out += f"\nlast error: {status['last_error']}"
        return out

    def wait_stopped(self, poll: Any, timeout: float = 10.0) -> None:
        """Until the probe says the trace stopped (its output file closed):
        the engine beside an exited process stops it right after the exit."""
        import time

        from probing.errors import ProbingError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if poll().get("state") == "stopped":
                    return
            except ProbingError:  # no probe left to ask: nothing more will be written
                return
            time.sleep(0.05)

    def wait_exit(self, timeout: float = 10.0) -> None:
        import time

        from probing import proc

        def alive() -> bool:
            try:
                return proc.stat(self.pid)[0] != "Z"
            except OSError:
                return False

        deadline = time.monotonic() + timeout
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    def target_exited(self, output: str | None) -> str:
        msg = f"pid {self.pid} exited: the trace ended with it"
        if output:
            try:
                import pyarrow.parquet as pq

                rows = pq.read_metadata(output).num_rows
                msg += f"; {output} is complete ({rows} events)"
            except (OSError, ValueError) as err:  # gone; ArrowInvalid: killed before it was closed
                msg += f"; {output} is not readable: {err}"
        return msg


# -- a diagnosis (probing diagnose) ------------------------------------------------------


def diagnosis(d: Diagnosis) -> str:
    """Verdict first, then the evidence table, then the stacks (80 columns)."""
    import textwrap

    out = [textwrap.fill(d.verdict, 80), ""]
    if d.missing:
        out[1:1] = [textwrap.fill("not heard from: " + "; ".join(d.missing), 80), ""]
    cols = ["rank", "node", "collectives", "last_pct", "lag_ms_mean", "lag_ms_p99", "count"]
    head = ["RANK", "NODE", "COLL", "LAST %", "LAG MS", "P99 MS", "COUNT", "IN COLL"]
    rows = [[r[c] for c in cols] + [r["in_collective"]] for r in d.ranks]
    # a column no rank has a value for says nothing (torch's counts over TCP)
    keep = [i for i in range(len(head)) if i == 0 or any(row[i] is not None for row in rows)]
    out.append(
        format_rows(
            [head[i] for i in keep],
            [[_yes(row[i]) if head[i] == "IN COLL" else row[i] for i in keep] for row in rows],
        )
    )
    if d.pipeline is not None:
        out.append("")
        out.append(
            format_rows(
                ["STAGE RANK", "BUSY %", "RECV WAIT %", "SEND WAIT %", "PEERS"],
                [
                    [
                        st.rank,
                        round(100 * st.busy_share),
                        round(100 * st.recv_wait_share),
                        round(100 * st.send_wait_share),
                        ", ".join(map(str, st.peers)),
                    ]
                    for st in d.pipeline.stages
                ],  # fmt: skip
            )
        )
    for s in d.slow_links:
        out.append(
            f"\n{s.comm}: transfer median {s.transfer_ms_median} ms (model "
            f"{s.baseline_ms} ms), skew median {s.skew_ms_median} ms, "
            f"{s.collectives} collectives"
        )
    for rank, lines in d.stacks.items():
        role = _role(d, rank)
        out.append(f"\nrank {rank} ({role}): {lines[0] if lines else ''}")
        out.extend(f"    {line}"[:80] for line in lines[1:])
    named = {s.rank for s in d.stragglers}
    named |= {r for h in d.hangs for r in (*h.missing_ranks, *h.waiting_ranks)}
    for rank in sorted(named & set(d.callsites)):
        out.append(f"rank {rank} issues its collectives at {d.callsites[rank]}"[:80])
    if d.why:
        out.append("\nwhy (time per step, this rank vs the median of the others):")
        out.extend(textwrap.fill(w.text, 80, subsequent_indent="    ") for w in d.why)
    return "\n".join(out)


def _yes(v: bool | None) -> str:
    return "" if v is None else ("yes" if v else "no")


def _role(d: Diagnosis, rank: int) -> str:
    if any(rank in h.missing_ranks for h in d.hangs):
        return "missing"
    if any(rank in h.waiting_ranks for h in d.hangs):
        return "waiting"
    return "straggler"


def write_answer(probe: Any, sql: str, fmt: str, echo: Any) -> None:
    """Print ``sql``'s answer from one probe client as ``fmt`` (table, csv,
    json): the probe's own bytes, or its rows as text through ``echo`` (no
    pyarrow in this process: ``probing query``'s fast path and its command).
    An empty answer about traced tables of a probe that never traced says,
    on stderr, how to trace."""
    import sys

    from probing.errors import LIST_TABLES, QueryError

    pid = getattr(probe.transport, "pid", None)
    try:
        if fmt != "table":
            raw = probe.query_raw(sql, fmt)
            sys.stdout.buffer.write(raw)
            if fmt == "json":
                sys.stdout.buffer.write(b"\n")
            sys.stdout.flush()
            empty = raw.strip() == b"[]" if fmt == "json" else raw.count(b"\n") <= 1
        else:
            names, rows = probe.query_rows(sql)
            echo(format_table(names, rows))
            empty = not rows
    except QueryError as err:
        if pid is None or f"({LIST_TABLES})" not in str(err):
            raise
        msg = str(err).replace(LIST_TABLES, f"probing tables --pid {pid} lists them")
        raise QueryError(msg, pid=pid) from None
    if empty and (hint := untraced(probe, sql)) is not None:
        echo(hint, err=True)


# the tables only a trace fills (probing trace): nccl.calls, comm.collectives...
TRACED = re.compile(
    r"\b(?:(?:nccl|cuda|gloo)\.(?:calls|inflight)|comm\.collectives|"
    r"python\.(?:stacks|samples|callsites)|probing\.uprobes|analyze\.\w+)\b",
    re.IGNORECASE,
)


def untraced(probe: Any, sql: str) -> str | None:
    """The line for an empty answer of ``sql`` when it reads a table only a
    trace fills and the probe never traced (no row in ``trace.intervals``):
    how to start one. None otherwise, or when the probe cannot tell."""
    from probing.errors import ProbingError

    if TRACED.search(sql) is None:
        return None
    try:
        _, rows = probe.query_rows("SELECT count(*) FROM trace.intervals")
    except ProbingError:
        return None
    if not rows or rows[0][0]:
        return None
    pid = getattr(probe.transport, "pid", None)
    return f"probing: nothing traced yet: probing trace --pid {pid if pid else 'PID'}"
