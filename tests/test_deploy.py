"""deploy/: the Kubernetes DaemonSet validates against the Kubernetes schema
and asks what the agent needs; the alert rules pass ``promtool check rules``
and name only metrics probing exports; every query of the Grafana dashboard
is PromQL ``promtool`` accepts, over metrics and labels the agent exports;
the systemd unit passes ``systemd-analyze verify``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, require

DEPLOY = REPO / "deploy"
MANIFEST = DEPLOY / "kubernetes" / "probing-agent.yaml"
RULES = DEPLOY / "prometheus" / "probing-rules.yml"
SCRAPE = DEPLOY / "prometheus" / "prometheus.yml"  # a Prometheus that scrapes the agents
UNIT = DEPLOY / "systemd" / "probing-agent.service"
DASHBOARD = DEPLOY / "grafana" / "probing-dashboard.json"
TARGET_LABELS = {"instance", "job"}  # what Prometheus adds to every series it scrapes


def _docs() -> list[dict]:  # type: ignore[type-arg]
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def test_the_daemonset_validates_against_the_kubernetes_schema() -> None:
    import kubernetes_validate

    docs = _docs()
    assert {d["kind"] for d in docs} == {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet"}
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    broken = [d for d in _docs() if d["kind"] == "DaemonSet"][0]
    broken["spec"]["template"]["spec"]["hostPIDD"] = True  # a typo the schema must catch
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.30.0", strict=True)


def test_the_daemonset_asks_what_the_agent_needs_and_no_more() -> None:
    docs = {d["kind"]: d for d in _docs()}
    config = docs["ConfigMap"]["data"]
    pod = docs["DaemonSet"]["spec"]["template"]
    spec, [agent] = pod["spec"], pod["spec"]["containers"]
    port = int(config["PROBING_AGENT_PORT"])
    assert spec["hostPID"] is True and config["PROBING_AGENT_HOST"] == "0.0.0.0"
    assert agent["command"] == ["probing", "agent"]
    assert agent["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    security = agent["securityContext"]
    assert security["privileged"] is False and {"BPF", "PERFMON", "SYS_PTRACE"} <= set(
        security["capabilities"]["add"]
    )
    mounted = {m["mountPath"] for m in agent["volumeMounts"]}
    assert {"/sys/kernel/tracing", "/sys/fs/bpf", "/dev/shm", "/tmp"} <= mounted


def exported(runtime_dir: Path) -> dict[str, set[str]]:
    """Every metric name the agent's /metrics can carry, with its labels: the
    agent's own (a webhook set, a finding active in the node's findings log)
    and a probe's, labelled as the agent labels them."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from probing import proc
    from probing.analyze.findings import openmetrics
    from probing.node.agent import Agent, Policy, ProbeLabels
    from probing.node.openmetrics import Exposition
    from probing.node.webhook import Webhook

    logs = runtime_dir / f"probing-{os.getuid()}"
    logs.mkdir(mode=0o700)
    finding = {"ts": 1, "kind": "straggler", "rank": 2, "node": "n", "comm": "gloo/pg0",
               "text": "late", "cleared_ns": None, "pid": os.getpid(),
               "pid_started": proc.started(os.getpid()), "host": "n"}  # fmt: skip
    (logs / "findings.jsonl").write_text(json.dumps(finding) + "\n")
    hook = Webhook("http://127.0.0.1:9/")
    try:
        agent = Agent(Policy(attach=False), webhook=hook)
        agent.follow()
        text = agent.metrics()
    finally:
        hook.close(0)
    probe = Exposition()
    probe.merge(
        openmetrics(1.0, {(1, "n"): 0.1}, {"straggler": 1}, {"gloo": 1}, 3),
        ProbeLabels(job="master_port=1", rank=0, node="n", created=1.0, final=True).labels(7),
        1.0,
    )
    out: dict[str, set[str]] = {}
    for text_ in (text, probe.text()):
        for family in text_string_to_metric_families(text_):
            if family.type != "counter":  # a counter is read by its samples' names only
                out.setdefault(family.name, set())
            for s in family.samples:
                out.setdefault(s.name, set()).update(s.labels)
    return out


def _by(expr: str) -> set[str]:
    """The labels ``by (...)`` keeps, over every aggregation of ``expr``."""
    return {x.strip() for by in re.findall(r"\bby \(([^)]*)\)", expr) for x in by.split(",")}


def _metrics_in(expr: str) -> set[str]:
    return set(re.findall(r"\b(probing_[a-z_]+)\b", expr))


def test_the_alert_rules_pass_promtool_and_name_exported_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    promtool = shutil.which("promtool")
    require(promtool is not None, "needs promtool (Debian's prometheus; make test installs it)")
    assert promtool is not None
    r = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    monkeypatch.setenv("PROBING_RUNTIME_DIR", str(tmp_path))
    metrics = exported(tmp_path)
    names = {n for rule in rules for n in _metrics_in(rule["expr"])}
    assert names and names <= set(metrics), names - set(metrics)
    for rule in rules:  # what they group by, each of their metrics carries
        for metric in _metrics_in(rule["expr"]):
            assert _by(rule["expr"]) <= metrics[metric] | TARGET_LABELS, (rule["alert"], metric)
    r = subprocess.run([promtool, "check", "config", str(SCRAPE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    scrape = yaml.safe_load(SCRAPE.read_text())
    assert scrape["rule_files"] == [RULES.name]
    assert all(job["honor_labels"] for job in scrape["scrape_configs"])  # `job`: the training's
    alerts = {rule["alert"] for rule in rules}
    assert {"ProbingStraggler", "ProbingSlowLink", "ProbingHang", "ProbingRankGone",
            "ProbingEventsDropped", "ProbingWebhookDropped"} <= alerts  # fmt: skip


def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    require(analyze is not None, "needs systemd-analyze (systemd)")
    assert analyze is not None
    probing = Path(sys.executable).parent / "probing"
    unit = tmp_path / UNIT.name  # the same unit, run by this install's probing
    unit.write_text(UNIT.read_text().replace("/opt/probing/bin/probing", str(probing)))
    r = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert r.returncode == 0 and "probing-agent.service" not in r.stderr, r.stderr
    text = UNIT.read_text()
    assert "Restart=always" in text and "KillSignal=SIGTERM" in text
    assert "CAP_BPF" in text and "CAP_SYS_PTRACE" in text


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every query of the Grafana dashboard: its panels',
    its variables' and its annotations'."""
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel["targets"]:
            out.append((f"{panel['title']} [{target['refId']}]", target["expr"]))
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), *(\w+)\)", var["query"]["query"])
            assert m, var["query"]
            out.append((f"variable {var['name']}", m.group(1)))
    for note in board["annotations"]["list"]:
        out.append((f"annotation {note['name']}", note["expr"]))
    return out


def as_promql(expr: str) -> str:
    """A dashboard query as Prometheus gets it: Grafana's variables filled in."""
    for var, value in (("$__rate_interval", "1m"), ("$__range", "1h"), ("$job", ".*")):
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


def test_the_dashboard_queries_are_promql_over_the_exported_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    promtool = shutil.which("promtool")
    require(promtool is not None, "needs promtool (Debian's prometheus; make test installs it)")
    assert promtool is not None
    queries = dashboard_queries()
    board = json.loads(DASHBOARD.read_text())
    kinds = {p["type"] for p in board["panels"]}
    assert {"heatmap", "table", "timeseries"} <= kinds
    wanted = {"probing_rank_lateness_seconds", "probing_finding_active", "probing_step_seconds"}
    assert wanted <= {m for _, q in queries for m in _metrics_in(q)}
    # PromQL that Prometheus parses: each as a recording rule, checked by promtool
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": as_promql(q)} for i, (_, q) in enumerate(queries)
    ]}]}  # fmt: skip
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # over the metrics the agent exports, and the labels they carry
    monkeypatch.setenv("PROBING_RUNTIME_DIR", str(tmp_path))
    metrics = exported(tmp_path)
    alerts = {  # ALERTS{alertname=...}: the labels its rule keeps
        rule["alert"]: _by(rule["expr"]) | {"alertname", "alertstate", *rule.get("labels", {})}
        for rule in yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    }
    for where, q in queries:
        names = _metrics_in(q)
        if q.startswith("ALERTS{"):
            carried = alerts[re.findall(r'alertname="(\w+)"', q)[0]]
        else:
            assert names and names <= set(metrics), (where, names - set(metrics))
            carried = set.intersection(*(metrics[n] for n in names)) | TARGET_LABELS
        named = set(re.findall(r"(\w+)=~?\"", q))
        assert named | _by(q) <= carried, (where, (named | _by(q)) - carried)
    for panel in board["panels"]:  # a legend says labels the query keeps
        for target in panel["targets"]:
            legend = set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]))
            assert legend <= _by(target["expr"]), (panel["title"], legend - _by(target["expr"]))
    for note in board["annotations"]["list"]:
        said = set(re.findall(r"\{\{(\w+)\}\}", note["titleFormat"] + note["textFormat"]))
        assert said <= alerts[re.findall(r'alertname="(\w+)"', note["expr"])[0]], note
