"""deploy/prometheus/alerts.yml (issue 54): the shipped alerting rules.

``promtool check rules`` and ``promtool test rules`` run on the files exactly as docs/operations.md
says to run them (promtool: Debian package ``prometheus``, installed by .ci/run; a missing
promtool fails here rather than skipping, since these two commands are the rules' only test).
Without promtool the file is still checked against the code: every metric a rule reads is in a
real ``Metrics`` registry's exposition, every alert has a ``for``, a severity and a runbook that
names a section of docs/operations.md, and the unit tests have a firing and a quiet case for each.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.test_deploy import TARGET_LABELS, _label_names, _metric_names
from tests.test_deploy import exposition  # noqa: F401  (the real registry's names, a fixture)

ROOT = Path(__file__).resolve().parent.parent
PROM = ROOT / "deploy" / "prometheus"
ALERTS = PROM / "alerts.yml"
ALERTS_TEST = PROM / "alerts_test.yml"
OPERATIONS = ROOT / "docs" / "operations.md"
SEVERITIES = {"critical", "warning", "info"}


@pytest.fixture(scope="module")
def rules():
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for group in doc["groups"] for r in group["rules"]]


def _documented_commands() -> list[str]:
    """The promtool commands of docs/operations.md's sh blocks, as written."""
    text = OPERATIONS.read_text()
    blocks = re.findall(r"^```sh\n(.*?)^```", text, flags=re.M | re.S)
    return [
        line.split("#")[0].strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip().startswith("promtool ")
    ]


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, (
        "promtool is not installed: apt-get install prometheus (.ci/run does), then "
        "run this test again"
    )
    return path


def test_the_docs_give_both_promtool_commands():
    assert _documented_commands() == [
        "promtool check rules deploy/prometheus/alerts.yml",
        "promtool test rules deploy/prometheus/alerts_test.yml",
    ]


@pytest.mark.parametrize("command", _documented_commands())
def test_documented_promtool_command_passes(command):
    argv = shlex.split(command)
    res = subprocess.run(
        [_promtool(), *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout + res.stderr


def test_promtool_check_config_loads_the_rules():
    res = subprocess.run(
        [_promtool(), "check", "config", str(PROM / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 rule files found" in res.stdout + res.stderr


def test_every_alert_has_for_severity_and_a_runbook_section(rules):
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", OPERATIONS.read_text(), flags=re.M)
    }
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), names
    for rule in rules:
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), f"{name}: no `for:`"
        assert rule["labels"]["severity"] in SEVERITIES, name
        ann = rule["annotations"]
        assert ann["summary"] and ann["description"], name
        page, _, anchor = ann["runbook"].partition("#")
        assert page == "docs/operations.md" and anchor in anchors, (
            f"{name}: runbook {ann['runbook']} is not a section of docs/operations.md"
        )


def test_alerts_read_metrics_the_service_exports(rules, exposition):  # noqa: F811
    """A renamed metric would leave its alert silent forever: every name is checked against a
    real registry (``up`` is Prometheus's own)."""
    for rule in rules:
        names = _metric_names(rule["expr"])
        assert names, rule["alert"]
        unknown = names - set(exposition) - {"up"}
        assert not unknown, f"{rule['alert']}: {sorted(unknown)} not exported by Metrics"
        labels = _label_names(rule["expr"])
        available = TARGET_LABELS | {"aggregation"}
        available = available.union(*(exposition.get(n, set()) for n in names))
        assert labels <= available, f"{rule['alert']}: unknown label in {rule['expr']!r}"


def test_the_issue_asks_these_alerts(rules):
    """Issue 54: readiness, release lag (one process and the group leader's queue), budget near
    its cap, dead letters, significant changes; intake stalls too."""
    reads = {r["alert"]: _metric_names(r["expr"]) for r in rules}
    for metric in (
        "up",
        "panagg_ready",
        "panagg_release_queue",
        "panagg_summaries_overdue",
        "panagg_budget_remaining_epsilon",
        "panagg_dead_letters_total",
        "panagg_release_change",
        "panagg_intake_stall_seconds",
        "panagg_write_failing",
        "panagg_last_release_timestamp_seconds",
        "panagg_user_budget_remaining_epsilon",
    ):
        assert any(metric in names for names in reads.values()), metric


def test_each_alert_has_a_firing_and_a_quiet_case(rules):
    doc = yaml.safe_load(ALERTS_TEST.read_text())
    assert doc["rule_files"] == [ALERTS.name]
    firing, quiet = set(), set()
    for group in doc["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {r["alert"] for r in rules}
    assert names - firing == set(), f"no firing case: {sorted(names - firing)}"
    assert names - quiet == set(), f"no quiet case: {sorted(names - quiet)}"


def test_the_ready_gauge_follows_ready():
    """``panagg_ready`` (what PanaggNotReady reads) is /ready as a series."""
    from aggregator.service.metrics import Metrics

    m = Metrics()
    assert m.registry.get_sample_value("panagg_ready") == 0.0  # starting
    m.set_ready(True)
    assert m.registry.get_sample_value("panagg_ready") == 1.0
    m.set_ready(False, "Kafka broker unreachable")
    assert m.registry.get_sample_value("panagg_ready") == 0.0
    assert m.readiness()[0] == 503


def test_prometheus_yml_and_compose_load_the_rules():
    """prometheus.yml names the rule file beside it; the compose Prometheus mounts it there."""
    prom = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert prom["rule_files"] == [ALERTS.name]
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    mounts = {}
    for vol in compose["services"]["prometheus"]["volumes"]:
        source, target = vol.split(":")[:2]
        mounts[target] = (ROOT / "deploy" / source).resolve()
    config_dir = Path("/etc/prometheus/prometheus.yml").parent
    assert mounts[str(config_dir / "prometheus.yml")] == PROM / "prometheus.yml"
    assert mounts[str(config_dir / ALERTS.name)] == ALERTS
