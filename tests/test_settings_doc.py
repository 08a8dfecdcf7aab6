"""Each setting is declared once (aggregator/service/settings.py): the reference tables of
docs/configuration.md, deploy/panagg.example.toml, the loader's checks, a state directory's
identity and a scale-out group's agreement check all come from that declaration, and moving
them there changed no identity an existing state directory recorded."""

import dataclasses
import json
import shutil

import pytest

from aggregator.service import settings_doc
from aggregator.service.config import ConfigError, aggregation_configs, load_config
from aggregator.service.group.pipeline import _NAMES, MUST_AGREE
from aggregator.service.group.service import GroupService
from aggregator.service.identity import IDENTITY_KEYS, directory_identity, identity_of
from aggregator.service.metrics import Metrics
from aggregator.service.settings import SECTIONS, SETTINGS, settings_by


def test_the_docs_and_the_example_config_are_what_the_declaration_writes():
    stale = settings_doc.check()
    assert not stale, (
        f"{stale} differ from aggregator/service/settings.py: run "
        f"{settings_doc.COMMAND} (edit the declaration, not the tables)"
    )


def test_the_drift_check_sees_an_edited_table_and_an_edited_example(tmp_path):
    for rel in (settings_doc.DOCS, settings_doc.EXAMPLE):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(settings_doc.ROOT / rel, tmp_path / rel)
    assert settings_doc.check(tmp_path) == []
    docs = tmp_path / settings_doc.DOCS
    docs.write_text(
        docs.read_text().replace("| `state.epsilon` | 1.0 |", "| `state.epsilon` | 2 |")
    )
    example = tmp_path / settings_doc.EXAMPLE
    example.write_text(example.read_text().replace("epsilon = 1.0", "epsilon = 0.5"))
    assert settings_doc.check(tmp_path) == [str(settings_doc.DOCS), str(settings_doc.EXAMPLE)]
    assert settings_doc.main(["--root", str(tmp_path)]) == 1
    assert settings_doc.main(["--root", str(tmp_path), "--write"]) == 0
    assert settings_doc.check(tmp_path) == []
    # the prose around the tables is the page's own: a hand edit there is kept
    docs.write_text(docs.read_text().replace("# Configuration reference", "# Configuration"))
    assert settings_doc.check(tmp_path) == []


def test_every_settable_key_is_declared_with_its_meaning():
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("derived") or "setting" in f.metadata, (name, f.name)
    for one in SETTINGS.values():
        assert one.doc.strip(), one.name
        assert not one.choices or one.default in one.choices, one.name
        assert one.problem(one.default) is None, one.name
        assert not (one.test_only and one.identity), one.name
    # the loader's checks are the declared ones, with the message users have always seen
    with pytest.raises(
        ConfigError,
        match=r"^window.late must be one of next, dead_letter, got "
        r"'drop'; set it in the config file \[window\]",
    ):
        load_config(None, ["window.late=drop"], env={})
    with pytest.raises(ConfigError, match="shuffle.delta must be in \\(0, 1\\), e.g. 1e-6"):
        load_config(None, ["shuffle.delta=2"], env={})


def test_a_test_only_setting_is_refused_outside_tests(monkeypatch):
    monkeypatch.delenv("PANAGG_TESTING", raising=False)
    hooks = [one for one in SETTINGS.values() if one.test_only]
    assert [one.name for one in hooks] == ["testing.noise_seed"]
    with pytest.raises(
        ConfigError, match="testing.noise_seed is a test hook .* refused outside tests; remove it"
    ):
        load_config(None, ["source.kind=generator", "testing.noise_seed=3"], env={})
    monkeypatch.setenv("PANAGG_TESTING", "1")
    assert (
        load_config(
            None, ["source.kind=generator", "testing.noise_seed=3"], env={}
        ).testing.noise_seed
        == 3
    )


def test_the_group_agreement_keys_are_the_declared_ones():
    agreed = settings_by("agree")
    assert MUST_AGREE == (*agreed, "neighbor")
    assert _NAMES["size"] == "state.domain_size / state.buckets / state.expected_n"
    pipe = GroupService(
        load_config(None, ["scale.partitioned=true", "window.kind=time"], env={}), Metrics()
    ).pipelines[0]
    assert set(pipe.identity_of_config(6)) == set(MUST_AGREE)


# -- the identity of existing state directories ----------------------------------------------
# Recorded with main at 9dab119, before the settings were declared once (identity_of was then
# written out by hand): a state directory such a start wrote must still start, so each config
# must give the same identity, key for key and type for type (1 is not 1.0 in the ledger's JSON).

_BASE = {
    "budget_per_window": 1.0,
    "budget_total": 0.0,
    "domain": 100000,
    "epsilon": 1.0,
    "group": "panagg",
    "item": "value:item",
    "mode": "direct",
    "model": "joint",
    "partitioned": False,
    "snapshots_per_window": 0,
    "stream": "kafka:events",
    "window": "count:1e+06",
}
_HALF = {"budget_per_window": 0.5, "epsilon": 0.5}
RECORDED = {
    "defaults": ([], {"": {}}),
    "file": (
        ["source.kind=file", "source.path=/tmp/x/in.jsonl", "source.format=json"],
        {"": {"group": "", "stream": "file:in.jsonl"}},
    ),
    "hashed": (
        ["state.mode=hashed", "state.expected_n=50000", "state.epsilon=0.5"],
        {"": dict(_HALF, mode="hashed")},
    ),
    "item": (
        [
            "state.mode=hashed",
            "item.field=user.id",
            "item.filter_field=event",
            "item.filter_value=login",
            "item.normalize=nfc",
            "item.casefold=true",
        ],
        {
            "": {
                "domain": 2000000,
                "mode": "hashed",
                "item": "value:user.id (nfc, casefold, filter event=login)",
            }
        },
    ),
    "time, auto clock: event time": (
        ["window.kind=time", "window.size=3600"],
        {"": {"window": "event_time:3600"}},
    ),
    "event time": (
        [
            "window.kind=event_time",
            "window.size=600",
            "window.allowed_lateness_s=60",
            "window.late=dead_letter",
        ],
        {"": {"window": "event_time:600"}},
    ),
    "rollups, hybrid": (
        ["window.kind=time", "window.size=3600", "window.rollups=1d,7d"],
        {
            "base": dict(_HALF, window="event_time:3600"),
            "r1d": dict(_HALF, window="event_time:86400"),
        },
    ),
    "budgets": (
        [
            "ledger.budget_per_window=2",
            "ledger.budget_total=10",
            "checkpoint.snapshots_per_window=2",
            "state.model=state-only",
        ],
        {
            "": {
                "budget_per_window": 2.0,
                "budget_total": 10.0,
                "model": "state-only",
                "snapshots_per_window": 2,
            }
        },
    ),
    "group, event time": (
        [
            "scale.partitioned=true",
            "scale.exchange=items",
            "window.kind=event_time",
            "window.size=60",
            "window.allowed_lateness_s=5",
            "window.late=dead_letter",
        ],
        {"": {"partitioned": True, "window": "event_time:60"}},
    ),
}


@pytest.mark.parametrize("sets,expected", RECORDED.values(), ids=RECORDED.keys())
def test_the_identity_of_a_state_directory_is_what_main_recorded(sets, expected):
    cfg = load_config(None, sets, env={})
    one = dict(aggregation_configs(cfg)) if cfg.aggregations else {"": cfg}
    got = {name: json.dumps(identity_of(c), sort_keys=True) for name, c in one.items()}
    assert got == {
        name: json.dumps(dict(_BASE, **delta), sort_keys=True) for name, delta in expected.items()
    }
    assert directory_identity(cfg.to_dict())["format"] == cfg.source.format


def test_a_group_members_identity_is_what_main_recorded():
    cfg = load_config(
        None,
        [
            "scale.partitioned=true",
            "scale.exchange=items",
            "window.kind=event_time",
            "window.size=60",
            "window.allowed_lateness_s=5",
            "window.late=dead_letter",
        ],
        env={},
    )
    pipe = GroupService(cfg, Metrics()).pipelines[0]
    # (an identity written before scale.exchange existed means "items": pipeline.py)
    assert json.dumps(pipe.identity_of_config(6), sort_keys=True) == json.dumps(
        {
            "allowed_lateness_s": 5.0,
            "epsilon": 1.0,
            "exchange": "items",
            "late": "dead_letter",
            "mode": "direct",
            "model": "joint",
            "neighbor": "replace-one",
            "partitions": 6,
            "size": 100000,
            "window_kind": "event_time",
            "window_size": 60.0,
        },
        sort_keys=True,
    )


def test_the_identity_keys_are_the_declared_ones():
    cfg = load_config(None, [], env={})
    assert set(identity_of(cfg)) | set(directory_identity(cfg.to_dict())) == set(IDENTITY_KEYS)
    assert [one.name for one in IDENTITY_KEYS["stream"]] == [
        "source.kind",
        "source.topic",
        "source.path",
    ]
