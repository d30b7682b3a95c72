"""A real Prometheus (Debian's ``prometheus``) scrapes ``probing agent`` every
second while a 4-rank Gloo job nobody probed runs, one rank 60 ms slower a
step: PromQL over its HTTP API names the slowed rank, the straggler alert
of deploy/prometheus/ goes off for that rank, every query of the Grafana
dashboard (deploy/grafana/) has data, the finding reaches the agent's
webhook, and ``promtool check metrics`` passes the agent's /metrics as curl
gets it; then the job is killed: its finding is cleared ("job gone", in
findings.jsonl and to the webhook), /metrics no longer has it, and an agent
started after serves none of it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from probing.cli.demo import free_port
from probing.node.agent import Agent, Policy
from tests.conftest import SLOWDOWN, require, require_bpf
from tests.privileged.test_agent import SLOW, active_findings, wait_traced, watched_job
from tests.test_agent_metrics import PROMETHEUS_ACCEPT
from tests.test_deploy import SCRAPE, as_promql, dashboard_queries
from tests.test_webhook import Receiver

pytestmark = pytest.mark.privileged
PROMETHEUS = "/usr/bin/prometheus"


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


class Prometheus:
    """A Prometheus of this test, configured as deploy/prometheus/prometheus.yml
    says (its scrape job, its alert rules) but every second and scraping
    ``target``; its data in ``tmp``."""

    def __init__(self, tmp: Path, target: str) -> None:
        config = yaml.safe_load(SCRAPE.read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(SCRAPE.parent / f) for f in config["rule_files"]]
        [job] = config["scrape_configs"]
        job["static_configs"] = [{"targets": [target]}]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address={self.url[7:]}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def ready(self) -> bool:
        assert self.proc.poll() is None, Path(self.log.name).read_text()
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's series (``/api/v1/query``)."""
        answer = _get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert answer["status"] == "success", answer
        return list(answer["data"]["result"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[str], Prometheus]]:
    started: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        started.append(Prometheus(tmp_path, target))
        return started[-1]

    yield start
    for p in started:
        p.stop()


def _until(
    what: str, check: Callable[[], Any], deadline: float, said: Callable[[], str] = str
) -> Any:
    """``check()`` until it is truthy (then its value), or fail by ``deadline``
    with what ``said()`` says."""
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"not in time: {what}; {said()}"
        time.sleep(0.5)


def _metrics(url: str, accept: str) -> str:
    """The agent's ``GET /metrics``, asked with ``Accept: accept``."""
    req = urllib.request.Request(f"{url}/metrics", headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=10) as r:
        return str(r.read().decode())


def test_prometheus_scrapes_the_agent_and_promql_names_the_slowed_rank(  # type: ignore[no-untyped-def]
    runtime_dir, prometheus
) -> None:
    require_bpf()
    require(shutil.which(PROMETHEUS) is not None, "needs Debian's prometheus (make test)")
    hook = Receiver()
    try:
        with watched_job(runtime_dir, PROBING_AGENT_WEBHOOK=hook.url) as w:
            prom = prometheus(w.url[len("http://") :])
            t0 = time.monotonic()
            deadline = t0 + 60 * SLOWDOWN
            wait_traced(w.ranks)
            _until("Prometheus ready", prom.ready, deadline)

            # PromQL names the slowed rank: the finding, and the lateness
            def named() -> list[tuple[str, str]]:
                found = prom.query('probing_finding_active{kind="straggler"} > 0')
                return [(s["metric"]["rank"], s["metric"]["job"]) for s in found]

            def scrapes() -> str:
                up = prom.query('up{job="probing-agent"}')
                took = prom.query('scrape_duration_seconds{job="probing-agent"}')
                with urllib.request.urlopen(f"{w.url}/metrics", timeout=10) as r:
                    text = r.read().decode()
                found = [x for x in text.splitlines() if x.startswith("probing_finding")]
                return f"up {up}, scrape took {took}, the agent's findings now: {found}"

            _until(
                "the straggler in Prometheus",
                lambda: (str(SLOW), w.job) in named(),
                deadline,
                scrapes,
            )
            print(f"named in Prometheus {time.monotonic() - t0:.1f} s after the job started")
            # (a scrape slower than the second it has, on a loaded machine, leaves every
            # series stale until the next: each query is asked until it answers)
            [late] = _until(
                "the lateness",
                lambda: prom.query("topk(1, max by (rank) (probing_rank_lateness_seconds))"),
                deadline,
            )
            assert late["metric"]["rank"] == str(SLOW) and float(late["value"][1]) > 0.03, late
            # the verdict's figures: the job's step (80 ms of sleep a step, the slow rank's),
            # and the share of it the straggler costs
            [share] = _until(
                "the straggler's share of the step",
                lambda: prom.query("max by (rank) (probing_straggler_step_share)"),
                deadline,
            )
            assert share["metric"]["rank"] == str(SLOW) and float(share["value"][1]) > 0.3, share
            [step] = _until("the step", lambda: prom.query("max(probing_step_seconds)"), deadline)
            assert 0.07 < float(step["value"][1]) < 0.2, step

            def ranks() -> list[str]:
                return sorted(s["metric"]["rank"] for s in prom.query(
                    "count by (rank) (probing_detections_total)"))  # fmt: skip

            _until("every rank's probe", lambda: ranks() == ["0", "1", "2", "3"], deadline)
            # the alert rules run in it: the straggler rule goes off for that rank
            [alert] = _until(
                "ProbingStraggler pending",
                lambda: prom.query(f'ALERTS{{alertname="ProbingStraggler",rank="{SLOW}"}}'),
                deadline,
            )
            assert alert["metric"]["job"] == w.job and alert["metric"]["node"], alert
            assert alert["metric"]["alertstate"] in ("pending", "firing"), alert
            # every query of the Grafana dashboard has data (its alerts' annotation aside:
            # the straggler rule fires 30 s after it goes off)
            for where, q in dashboard_queries():
                if not q.startswith("ALERTS"):
                    _until(where, lambda q=q: prom.query(as_promql(q)), deadline)

            # and the finding went to the webhook (with others, on a loaded machine:
            # a rank too slow to answer twice is said gone, then cleared)
            def posted() -> list[dict[str, Any]]:
                return [r for r in hook.got if (r["kind"], r["rank"]) == ("straggler", SLOW)]

            [sent, *_] = _until("the straggler POSTed", posted, deadline)
            assert sent["state"] == "new" and sent["job"] == w.job and sent["pid"] > 0, sent
            plain = _metrics(w.url, "*/*")  # as curl gets it: Prometheus' text format
            assert "probing_detections_total{" in plain and "probing_finding_active{" in plain
            checked = subprocess.run(
                ["promtool", "check", "metrics"], input=plain, capture_output=True, text=True
            )
            assert (checked.returncode, checked.stdout + checked.stderr) == (0, ""), plain
            # the job killed during its finding: the finding cleared, "job gone", by the agent
            before = len([r for r in posted() if r["state"] == "cleared"])
            for p in w.ranks:
                p.kill()
            for p in w.ranks:
                p.wait()
            t1 = time.monotonic()
            [*_, gone] = _until(
                "the straggler cleared",
                lambda: [r for r in posted() if r["state"] == "cleared"][before:],
                time.monotonic() + 30 * SLOWDOWN,
            )
            print(f"cleared {time.monotonic() - t1:.1f} s after the job was killed")
            assert gone["reason"] == "job gone" and gone["job"] == w.job, gone
            assert active_findings(_metrics(w.url, PROMETHEUS_ACCEPT)) == set()
            log = runtime_dir / f"probing-{os.getuid()}" / "findings.jsonl"
            said = [json.loads(x) for x in log.read_text().splitlines()]
            assert any(x.get("reason") == "job gone" and x["kind"] == "straggler"
                       and x["rank"] == SLOW and x["cleared_ns"] for x in said), said  # fmt: skip
            # an agent started later serves none of it (what the job's engine wrote since,
            # of a process gone, it clears at its first look)
            fresh = Agent(Policy(attach=False))
            late = fresh.follow()
            assert all((r["state"], r["reason"]) == ("cleared", "job gone") for r in late), late
            assert active_findings(fresh.metrics()) == set()
            [took] = prom.query('max_over_time(scrape_duration_seconds{job="probing-agent"}[1m])')
            ms = 1e3 * float(took["value"][1])
            print(
                f"done {time.monotonic() - t0:.1f} s after the job started; scrapes <= {ms:.0f} ms"
            )
    finally:
        hook.close()
