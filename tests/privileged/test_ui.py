"""``probing ui`` in a real browser (headless Chromium) against a live 4-rank
torch.distributed job (Gloo), traced with dynamic injection, one rank's data
loader slowed (drawn at random each run and printed), NVML sampled through the
stand-in library (tests/fixtures/fake_nvml.c). The UI runs as a user runs it:
``probing ui --pid P`` in its own process, found by the URL it prints. Each
page's screenshot is kept in tests/artifacts/. Root-only."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from probing.cli.demo import DemoJob, trace_all
from probing.cli.export.perfetto import read_trace
from tests.chromium import Browser, find_chromium
from tests.conftest import cli, require, require_bpf
from tests.test_export_perfetto_ui import ARTIFACTS, PER_PROCESS_SQL, ui_rows
from tests.test_nvml import fake_nvml  # noqa: F401  (the stand-in libnvidia-ml, built once)

pytestmark = pytest.mark.privileged

WORLD = 4
MIN_COLLECTIVES = 40  # traced per rank before the pages are looked at


class Live:
    def __init__(self, job: DemoJob, slow: int, ui: subprocess.Popen[str], url: str) -> None:
        self.job, self.slow, self.ui, self.url = job, slow, ui, url
        self.base = url.split("/?", 1)[0]


def _wait(what: str, check, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def live(fake_nvml: Path) -> Iterator[Live]:  # noqa: F811
    require_bpf()
    require(find_chromium() is not None, "needs chromium (.ci/setup.sh installs it)")
    slow = random.randrange(WORLD)
    print(f"straggler: rank {slow}")
    env = {
        "LD_LIBRARY_PATH": str(fake_nvml),
        "FAKE_NVML_GPUS": "1",
        "PROBING_ENGINE_ENV": "LD_LIBRARY_PATH,FAKE_NVML_GPUS",
    }  # the engine samples NVML
    job = DemoJob(WORLD, job_args=["--slow-rank", str(slow), "--slow-ms", "40"], env=env)
    ui = None
    try:
        job.wait_ready(timeout=120)
        errors = trace_all(job.pids, ["gloo"])
        assert not errors, (errors, job.exits())
        for pid in job.pids:
            r = cli("nvml", "--pid", str(pid), "--interval", "200ms")
            assert r.returncode == 0, r.stderr

        def traced() -> bool:
            r = cli("query", "-p", str(job.pids[0]), "--cluster", "-f", "json",
                    "SELECT rank, count(*) AS n FROM gloo.calls GROUP BY rank")  # fmt: skip
            rows = json.loads(r.stdout or "[]") if r.returncode == 0 else []
            return len(rows) == WORLD and min(x["n"] for x in rows) >= MIN_COLLECTIVES

        _wait("every rank's collectives", traced)
        ui = subprocess.Popen(
            [sys.executable, "-m", "probing", "ui", "--pid", str(job.pids[0])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = ui.stdout.readline() if ui.stdout else ""
        m = re.search(r"open (http://127\.0\.0\.1:\d+/\?token=\S+)", line)
        assert m, (line, ui.stderr.read() if ui.poll() is not None and ui.stderr else "")
        yield Live(job, slow, ui, m.group(1))
    finally:
        if ui is not None:
            ui.terminate()
            ui.wait(10)
            for f in (ui.stdout, ui.stderr):
                if f is not None:
                    f.close()
        job.stop()


@pytest.fixture(scope="module")
def browser(live: Live) -> Iterator[Browser]:
    with Browser() as b:
        yield b


def _open(live: Live, browser: Browser, page: str):  # type: ignore[no-untyped-def]
    p = browser.page(live.url)  # the printed URL: trades the token for the cookie
    p.wait_for("location.pathname == '/job'", timeout=30)
    if page != "job":
        p.goto(f"{live.base}/{page}")
    return p


def test_job_page_marks_the_slowed_rank(live: Live, browser: Browser) -> None:
    page = _open(live, browser, "job")
    page.wait_for("!!document.querySelector('#lag-heatmap')", timeout=120)
    flagged = page.evaluate(
        "[...document.querySelectorAll('#lag-heatmap .hm-row.straggler')].map(e => +e.dataset.rank)"
    )
    assert flagged == [live.slow]
    assert page.evaluate("document.querySelector('#verdict').textContent").startswith(
        f"Straggler: rank {live.slow} on "
    )
    # the slowed rank's cells are the hottest: its mean arrival lag is the largest
    lag = page.evaluate(
        "Object.fromEntries([...document.querySelectorAll('#lag-heatmap .hm-row')].map(r => "
        "[r.dataset.rank, [...r.querySelectorAll('rect.cell')].map(c => c.dataset.value)"
        ".filter(v => v !== '').map(Number)]))"
    )
    means = {int(r): sum(v) / len(v) for r, v in lag.items() if v}
    assert sorted(means) == list(range(WORLD))
    assert max(means, key=means.__getitem__) == live.slow, means
    # live: the page refreshes by itself while the job is traced
    first = int(page.evaluate("document.body.dataset.loaded"))
    page.wait_for(f"Number(document.body.dataset.loaded) >= {first + 2}", timeout=60)
    page.screenshot(ARTIFACTS / "ui-job.png")


def test_sql_console_runs_a_query_and_shows_errors(live: Live, browser: Browser) -> None:
    page = _open(live, browser, "sql")
    page.wait_for("!!document.querySelector('#run')")
    sql = "SELECT rank, count(*) AS calls FROM gloo.calls GROUP BY rank ORDER BY rank"
    page.evaluate(f"document.querySelector('#sql').value = {json.dumps(sql)}")
    page.evaluate("document.querySelector('#run').click()")
    page.wait_for("!!document.querySelector('#sql-table')", timeout=60)
    rows = page.evaluate(
        "[...document.querySelectorAll('#sql-table tbody tr')].map(tr => "
        "[...tr.children].map(td => td.textContent))"
    )
    assert [int(r[0]) for r in rows] == list(range(WORLD))
    assert all(int(r[1]) >= MIN_COLLECTIVES for r in rows)
    csv = page.evaluate("fetch(document.querySelector('#csv').href).then(r => r.text())")
    lines = csv.strip().splitlines()
    assert lines[0].replace('"', "") == "rank,calls" and len(lines) == 1 + WORLD
    page.screenshot(ARTIFACTS / "ui-sql.png")
    bad = "SELECT no_such_column FROM gloo.calls"
    page.evaluate(f"document.querySelector('#sql').value = {json.dumps(bad)}")
    page.evaluate("document.querySelector('#run').click()")
    page.wait_for("!!document.querySelector('#sql-error')", timeout=60)
    shown = page.evaluate("document.querySelector('#sql-error').textContent")
    r = cli("query", "-p", str(live.job.pids[0]), "--cluster", bad)  # what the CLI says
    assert r.returncode == 1 and "no_such_column" in shown
    assert shown in r.stderr, (shown, r.stderr)
    page.screenshot(ARTIFACTS / "ui-sql-error.png")


def test_diagnose_page_names_the_rank(live: Live, browser: Browser) -> None:
    page = _open(live, browser, "diagnose")
    page.wait_for("!!document.querySelector('#evidence, .error')", timeout=120)
    assert page.evaluate("(document.querySelector('.error') || {}).textContent") is None
    verdict = page.evaluate("document.querySelector('#verdict').textContent")
    assert verdict.startswith(f"rank {live.slow} on node "), verdict
    marked = page.evaluate(
        "[...document.querySelectorAll('#evidence tbody tr.straggler')]"
        ".map(tr => +tr.children[0].textContent)"
    )
    assert marked == [live.slow]
    page.screenshot(ARTIFACTS / "ui-diagnose.png")


def test_gpu_page_draws_every_ranks_nvml_counters(live: Live, browser: Browser) -> None:
    page = _open(live, browser, "gpu")
    page.wait_for("!!document.querySelector('#gpu-count')", timeout=60)
    lines = page.evaluate(
        "[...document.querySelectorAll('svg.chart[data-metric=util_gpu] polyline.series')]"
        ".map(p => p.querySelector('title').textContent)"
    )
    assert sorted(lines) == [f"rank {r} gpu 0" for r in range(WORLD)]
    page.screenshot(ARTIFACTS / "ui-gpu.png")


def test_timeline_opens_the_window_in_the_packaged_perfetto(live: Live, browser: Browser) -> None:
    page = _open(live, browser, "timeline")
    page.wait_for("!!document.querySelector('#open-timeline')")
    page.evaluate("document.querySelector('#open-timeline').click()")
    page.wait_for("location.pathname == '/perfetto/index.html'", timeout=120)
    page.wait_for("window.app && app.trace && app.trace.engine ? 1 : 0", timeout=240)
    slices = dict(ui_rows(page, PER_PROCESS_SQL))
    assert sorted(n.split(" @ ")[0] for n in slices) == [f"rank {r}" for r in range(WORLD)]
    # the file the UI loaded, parsed with Perfetto's protos
    trace = page.evaluate("fetch('/localtrace').then(r => r.arrayBuffer())"
                          ".then(b => Array.from(new Uint8Array(b)))")  # fmt: skip
    packets = read_trace(bytes(trace)).packet
    te = packets[0].track_event  # for its enum
    opened = sum(1 for p in packets if p.track_event.type in (te.TYPE_SLICE_BEGIN, te.TYPE_INSTANT))
    # every slice of the file in the UI (collectives on the ranks' threads, Python frames
    # on each rank's own track), and each rank's collectives there
    [[loaded]] = ui_rows(page, "SELECT count(*) FROM slice")
    assert loaded == opened and min(slices.values()) >= MIN_COLLECTIVES
    [[flows]] = ui_rows(page, "SELECT count(*) FROM flow")
    assert flows >= MIN_COLLECTIVES * (WORLD - 1)
    page.screenshot(ARTIFACTS / "ui-timeline.png")
