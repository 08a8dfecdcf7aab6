"""The typed configuration (aggregator/service/settings.py): what load_config returns is read by
attribute, cannot be changed in place, serializes to the same JSON the service has always saved,
and holds exactly the keys the loader lets a user set."""

import dataclasses
import json
import typing

import pytest

from aggregator.service.config import DEFAULTS, ConfigError, aggregation_configs, load_config
from aggregator.service.settings import SECTIONS, Config, Section, defaults
from consumers.kafka_security import redacted


def test_load_config_returns_a_typed_config_read_by_attribute():
    cfg = load_config(
        overrides=[
            "state.epsilon=0.25",
            "window.rollups=2x,4x",
            "window.rollup_design=sum",
            "source.kind=generator",
        ],
        env={},
    )
    assert isinstance(cfg, Config) and isinstance(cfg.state, SECTIONS["state"])
    assert cfg.state.epsilon == 0.25 and isinstance(cfg.state.epsilon, float)
    assert cfg.window.rollups == ("2x", "4x")  # read-only: a tuple
    assert cfg.source.kind == "generator" and cfg.aggregations == {}
    # the mapping view is the same values (tools that iterate keys, client options)
    assert cfg["state"]["epsilon"] == cfg.state.epsilon
    assert dict(cfg.metrics) == {"host": "127.0.0.1", "port": 9464}


def test_a_config_cannot_be_changed_in_place_only_replaced():
    cfg = load_config(env={}, overrides=["source.kind=generator"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.state.epsilon = 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.state = cfg.state
    with pytest.raises(TypeError):
        cfg["state"]["epsilon"] = 2.0  # the mapping view is read-only too
    other = cfg.updated({"state": {"epsilon": 0.5}, "window": {"size": 10}})
    assert (other.state.epsilon, other.window.size) == (0.5, 10)
    assert (cfg.state.epsilon, cfg.window.size) == (1.0, 1000000)  # the original is untouched
    with pytest.raises(TypeError):
        cfg.updated({"state": {"epsilom": 0.5}})  # no such key: no silent new field


def test_every_setting_is_a_typed_field_and_nothing_else_is_settable():
    assert defaults() == DEFAULTS
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("derived"):
                assert f.name not in DEFAULTS[name]
                continue
            kind = typing.get_origin(hints[f.name]) or hints[f.name]
            assert isinstance(f.default, kind), (name, f.name, hints[f.name], f.default)
            assert not isinstance(f.default, bool) or kind is bool, (name, f.name)
    # a derived field is the validator's, not the user's
    with pytest.raises(ConfigError, match="window.auto_event_time"):
        load_config(env={}, overrides=["window.auto_event_time=true"])


def test_the_saved_form_is_plain_json_and_loads_back_to_the_same_config(tmp_path):
    secret = [
        "security.protocol=SASL_PLAINTEXT",
        "security.sasl_mechanism=PLAIN",
        "security.username=u",
        "security.allow_inline_password=true",
        "security.password=hunter2",
    ]
    cfg = load_config(env={}, overrides=["source.kind=generator", "window.rollups=2x", *secret])
    saved = json.loads(json.dumps(redacted(cfg)))
    # what a start compares with the saved file is that file's form exactly (a tuple against
    # the saved list would log a changed setting at every start)
    assert redacted(cfg) == saved
    assert saved["window"]["rollups"] == ["2x"] and "rollup_levels" in saved
    assert saved["security"]["password"] == ""  # no secret is written
    assert "hunter2" not in json.dumps(redacted(cfg))
    again = load_config(env={}, base=saved, overrides=["security.password=hunter2"])
    assert again.to_dict() == cfg.to_dict()
    assert Config.from_mapping(cfg.to_dict()).to_dict() == cfg.to_dict()
    # the plain form is a copy: changing it changes nothing in the config
    plain = cfg.to_dict()
    plain["state"]["epsilon"] = 9.0
    assert cfg.state.epsilon == 1.0


def test_aggregations_are_configs_of_their_own_with_their_composition():
    cfg = load_config(
        env={},
        overrides=[
            "source.kind=generator",
            "ledger.budget_per_event=1.5",
            "aggregations.ip.state.epsilon=0.5",
            "aggregations.user.state.epsilon=1",
        ],
    )
    assert cfg.aggregation is None and sorted(cfg.aggregations) == ["ip", "user"]
    named = dict(aggregation_configs(cfg))
    ip = named["ip"]
    assert isinstance(ip, Config) and ip.state.epsilon == 0.5
    assert ip.checkpoint.dir.endswith("/ip") and ip.metrics.port == -1
    assert (ip.aggregation.name, ip.aggregation.of) == ("ip", ("ip", "user"))
    assert ip.aggregation.epsilon_per_event == 1.5 and ip.aggregation.budget_per_event == 1.5
    # the service's own config is not changed by deriving its aggregations'
    assert cfg.state.epsilon == 1.0 and cfg.checkpoint.dir == "var/panagg"


def test_a_section_hides_a_derived_field_only_while_it_holds_its_default():
    window = SECTIONS["window"]()
    assert "auto_event_time" not in window and "kind" in window
    marked = dataclasses.replace(window, kind="event_time", auto_event_time=True)
    assert marked["auto_event_time"] is True and marked.auto_event_time
    assert isinstance(marked, Section) and len(marked) == len(window) + 1


def test_the_ledger_budgets_are_resolved_in_one_place():
    # every ledger (the directory's, the group's topic, the shuffle analyzer's) takes these
    one = load_config(env={}, overrides=["source.kind=generator", "state.epsilon=0.25"])
    assert (one.budget_per_window, one.budget_per_event) == (0.25, 0.25)
    wider = one.updated({"ledger": {"budget_per_window": 0.5, "budget_per_event": 0}})
    assert (wider.budget_per_window, wider.budget_per_event) == (0.5, 0.5)
    cfg = load_config(
        env={},
        overrides=[
            "source.kind=generator",
            "ledger.budget_per_event=1.5",
            "aggregations.ip.state.epsilon=0.5",
            "aggregations.user.state.epsilon=1",
        ],
    )
    ip = dict(aggregation_configs(cfg))["ip"]
    assert (ip.budget_per_window, ip.budget_per_event) == (0.5, 1.5)
    # an aggregation's own cap comes before the service's
    own = dataclasses.replace(
        ip, aggregation=dataclasses.replace(ip.aggregation, budget_per_event=2.0)
    )
    assert own.budget_per_event == 2.0 and isinstance(own.budget_per_event, float)
