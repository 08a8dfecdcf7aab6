"""The privacy unit is said wherever a person reads about the service (issue 50): the plan, the
start line, `panagg status`, the README, in the words of every release's headline."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from aggregator.release import PRIVACY_UNIT, PRIVACY_UNIT_CONSEQUENCE, privacy_unit_clause
from aggregator.service.accuracy_plan import StartPlan, accuracy_plan
from aggregator.service.config import ConfigError, load_config
from aggregator.service.status import format_status

ROOT = Path(__file__).resolve().parents[1]


def test_the_clause_is_the_headlines_words():
    clause = privacy_unit_clause()
    assert f"the {PRIVACY_UNIT}" in clause and PRIVACY_UNIT_CONSEQUENCE in clause
    assert "docs/privacy_unit.md" in clause


def test_plan_and_start_line_say_the_unit(caplog):
    cfg = load_config(
        None, ["state.domain_size=1000", "window.size=20000", "release.plan_errors=false"]
    )
    line, _ = accuracy_plan(cfg, simulate=False)
    assert line.endswith(privacy_unit_clause())
    plan = StartPlan(cfg)
    with caplog.at_level(logging.INFO, logger="panagg.service"):
        plan.start()
    plan.close()
    (rec,) = [r for r in caplog.records if "accuracy plan" in r.getMessage()]
    assert privacy_unit_clause() in rec.getMessage()


def test_status_says_the_unit():
    status = {
        "state_dir": "s",
        "service": "not running",
        "identity": {
            "stream": "file:x",
            "group": None,
            "mode": "direct",
            "domain": 10,
            "epsilon": 1.0,
            "window": "count:10",
            "model": "joint",
        },
        "privacy_unit": {"unit": "event", "consequence": PRIVACY_UNIT_CONSEQUENCE},
        "budget": {"spent": 0.0, "total": None, "remaining": None, "per_window": 1.0},
    }
    lines = format_status(status)
    assert lines[3] == privacy_unit_clause()


def test_readme_says_the_unit():
    text = (ROOT / "README.md").read_text()
    assert "The privacy unit is the event" in text and PRIVACY_UNIT_CONSEQUENCE in text


def test_user_level_needs_its_expected_users_in_one_line():
    assert load_config(None, ["state.privacy_unit=event"]).state.privacy_unit == "event"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["state.privacy_unit=user"])
    msg = str(err.value)
    assert "\n" not in msg and "docs/privacy_unit.md" in msg and "state.expected_users" in msg
    cfg = load_config(
        None, ["state.privacy_unit=user", "state.expected_users=5000", "ledger.budget_per_user=30"]
    )
    assert cfg.state.privacy_unit == "user"
