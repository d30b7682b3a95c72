"""deploy/: the Kubernetes DaemonSet validates against the Kubernetes schema
and asks what the agent needs; the alert rules pass ``promtool check rules``
and name only metrics probing exports; the systemd unit passes
``systemd-analyze verify``."""

from __future__ import annotations

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
UNIT = DEPLOY / "systemd" / "probing-agent.service"


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


def _exported() -> set[str]:
    """Every metric name probing's /metrics can carry (a probe's and the agent's)."""
    from probing.analyze.watch import openmetrics
    from probing.node.agent import Agent, Policy

    text = openmetrics(1.0, {(1, "n"): 0.1}, {"straggler": 1}, {"gloo": 1}, 3)
    text += Agent(Policy(attach=False)).metrics()
    return {m.group(1) for m in re.finditer(r"^([a-z_:]+)[{ ]", text, re.M)}


def test_the_alert_rules_pass_promtool_and_name_exported_metrics() -> None:
    promtool = shutil.which("promtool")
    require(promtool is not None, "needs promtool (Debian's prometheus; make test installs it)")
    assert promtool is not None
    r = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    names = {n for rule in rules for n in re.findall(r"\b(probing_[a-z_]+)\b", rule["expr"])}
    assert names and names <= _exported(), names - _exported()
    alerts = {rule["alert"] for rule in rules}
    assert {"ProbingStraggler", "ProbingSlowLink", "ProbingHang", "ProbingRankGone",
            "ProbingEventsDropped"} <= alerts  # fmt: skip


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
