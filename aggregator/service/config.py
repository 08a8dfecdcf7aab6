"""Service configuration: defaults, then a TOML file, then ``PANAGG_<SECTION>_<KEY>`` environment
variables, then command-line ``--set section.key=value`` flags (last one wins).

Every value is checked; a bad one raises :class:`ConfigError` with one line that names the key,
the value, what is expected and where to fix it. docs/configuration.md lists every key.
"""

from __future__ import annotations

import copy
import datetime as dt
import difflib
import hashlib
import json
import math
import os
import tomllib

from consumers.kafka_security import SecurityError, check_security
from state_store.failpoints import under_tests

from .rollup import RollupError, parse_span
from .settings import SETTINGS, Config, defaults
from .user_window import rollup_users, user_rollup_line, user_unit_problem

__all__ = [
    "DEFAULTS",
    "ConfigError",
    "load_config",
    "parse_start",
    "shuffle_n",
    "aggregation_configs",
    "AGGREGATION_SECTIONS",
]


class ConfigError(ValueError):
    """A configuration mistake the user can fix from the message alone."""


#: every settable key and its default, ``{section: {key: value}}``: the sections' dataclasses in
#: :mod:`.settings` say what each key means
DEFAULTS: dict[str, dict] = defaults()

#: the secrets: a bad value is never echoed in an error, nor read from PANAGG_<SECTION>_<KEY>
_SECRET = {(one.section, one.key) for one in SETTINGS.values() if one.secret}


# keys that existed once: a config that still sets one gets the reason and the replacement
_REMOVED = {
    ("checkpoint", "every_events"): "checkpoints now happen at window boundaries and the open "
    "window is replayed after a restart (docs/privacy.md, views of the state); to bound the "
    "replay use checkpoint.snapshots_per_window",
    ("checkpoint", "every_seconds"): "checkpoints now happen at window boundaries and the open "
    "window is replayed after a restart (docs/privacy.md, views of the state); to bound the "
    "replay use checkpoint.snapshots_per_window",
}


def _removed(section: str, key: str, where: str) -> None:
    if (section, key) in _REMOVED:
        raise ConfigError(
            f"{section}.{key} ({where}) is no longer a setting: "
            f"{_REMOVED[(section, key)]}; remove it"
        )


def _where(section: str, key: str) -> str:
    return f"set it in the config file [{section}] or PANAGG_{section.upper()}_{key.upper()}"


def _coerce(section: str, key: str, value, default):
    """Convert ``value`` (from TOML, env or flags) to the type of ``default``."""
    name = f"{section}.{key}"
    try:
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if isinstance(default, int):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
            if not math.isfinite(out):
                raise ValueError
            return out
        if isinstance(default, list):  # window.rollups: a TOML list, or "1d,7d" from env/--set
            if isinstance(value, str):
                text = value.strip().strip("[]")
                value = [v.strip().strip("'\"") for v in text.split(",") if v.strip()]
            if not isinstance(value, (list, tuple)) or any(
                isinstance(v, bool) or not isinstance(v, (str, int)) for v in value
            ):
                raise ValueError
            return [str(v) for v in value]
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError
        return str(value)
    except (TypeError, ValueError):
        kind = {
            bool: "true or false",
            int: "a whole number",
            float: "a number",
            str: "a string",
            list: 'a list of spans such as ["1d", "7d"]',
        }[type(default)]
        got = f"a {type(value).__name__}" if (section, key) in _SECRET else repr(value)
        raise ConfigError(f"{name} must be {kind}, got {got}; {_where(section, key)}") from None


def _check_kafka_group(cfg: dict) -> None:
    """What a Kafka-only scale-out group (scale.store = kafka) cannot do yet: one line each."""
    why = None
    if cfg["source"]["kind"] != "kafka":
        why = "needs source.kind = kafka"
    elif cfg["state"]["model"] == "shuffle":
        why = "does not apply to state.model = shuffle (the analyzer reads one partition)"
    elif cfg["window"]["kind"] == "count" and cfg["checkpoint"]["snapshots_per_window"]:
        why = (
            "does not take snapshots within count windows (where a fraction of the group's "
            "count falls is known only to the leader, after the fact): set "
            "checkpoint.snapshots_per_window = 0, or window.kind = time"
        )
    if why:
        raise ConfigError(f"scale.partitioned with scale.store = kafka {why}; docs/scale-out.md")


def _check_client(cfg: dict) -> None:
    """Where source.client = confluent does not reach yet: one line naming the way."""
    if cfg["source"]["client"] != "confluent":
        return
    if cfg["source"]["kind"] != "kafka":
        raise ConfigError(
            f"source.client = confluent reads Kafka; source.kind is "
            f"{cfg['source']['kind']}: remove source.client or set source.kind = "
            "kafka"
        )
    if cfg["scale"]["partitioned"] or cfg["state"]["model"] == "shuffle":
        what = "scale.partitioned" if cfg["scale"]["partitioned"] else "state.model = shuffle"
        raise ConfigError(
            f"source.client = confluent serves one process; {what} runs on "
            'kafka-python for now: set source.client = "kafka-python"'
        )


def _check_views(cfg: dict) -> None:
    """What a group with scale.exchange = views cannot do yet: one line naming the way.
    (In-window snapshots are built for its time windows; count and event-time windows refuse
    them for every group: _check_kafka_group, _event_time_problem.)"""
    if (
        cfg["scale"]["partitioned"]
        and cfg["scale"]["exchange"] == "views"
        and cfg["window"].get("rollups")
        and cfg["window"].get("rollup_design") != "sum"
    ):
        raise ConfigError(
            "scale.exchange = views (the default) counts time and count windows and sum "
            f"rollups, without window.rollup_design = {cfg['window'].get('rollup_design')} "
            'yet: set window.rollup_design = "sum" (rollups summed from the released views), '
            'or scale.exchange = "items" (its repartition topic holds every event\'s counter '
            "index in plaintext: docs/privacy.md section 20), or use one process; "
            "docs/scale-out.md"
        )


def _event_time_problem(cfg: dict) -> str | None:
    """Why windows by record timestamps cannot apply to ``cfg`` (None: they can)."""
    if cfg["source"]["kind"] != "kafka":
        return (
            f"needs source.kind = kafka (record timestamps are Kafka's; a "
            f"{cfg['source']['kind']} source has none)"
        )
    if cfg["state"]["model"] == "shuffle":
        return "does not apply to state.model = shuffle (the shuffler makes the windows)"
    if cfg["checkpoint"]["snapshots_per_window"]:
        return (
            "does not support checkpoint.snapshots_per_window yet (progress through an "
            "event-time window is not known in advance); set it to 0"
        )
    return None


def _resolve_clock(cfg: dict) -> None:
    """``window.kind = time``: by the records' Kafka timestamps (``event_time``) unless
    ``window.clock = process`` or they cannot apply (``auto`` then keeps this process's clock;
    ``record`` refuses). An automatic choice is marked ``window.auto_event_time`` (a state
    directory started with processing-time windows keeps them: Aggregator)."""
    w = cfg["window"]
    if w["kind"] != "time":
        if w["clock"] != "auto":
            raise ConfigError(
                f"window.clock = {w['clock']} applies to window.kind = time only; remove it"
            )
        if w["kind"] != "event_time":
            w.pop("auto_event_time", None)
        return
    w.pop("auto_event_time", None)
    if w["clock"] == "process" or (w["clock"] == "auto" and cfg["scale"]["partitioned"]):
        # a group keeps intake time unless asked: its windows then close without waiting
        # for every source partition's watermark (window.kind = event_time asks)
        return
    problem = _event_time_problem(cfg)
    if problem and w["clock"] == "record":
        raise ConfigError(f"window.clock = record {problem}")
    if not problem:
        w["kind"] = "event_time"
        w["auto_event_time"] = w["clock"] == "auto"
        if not w["idle_partition_timeout_s"]:
            # time windows close even where a partition gets no records: one that is read to
            # its end stops holding the watermark after one window length
            w["idle_partition_timeout_s"] = float(w["size"])


def _validate_event_time(cfg: dict) -> None:
    """``window.kind = event_time``: windows by Kafka record timestamps (aggregator/service/
    event_time.py); the combinations not built refuse in one line."""
    lateness = cfg["window"]["allowed_lateness_s"]
    if cfg["window"]["kind"] != "event_time":
        if lateness:
            raise ConfigError(
                f"window.allowed_lateness_s = {lateness:g} applies to window.kind "
                "= event_time only; remove it or set window.kind = event_time"
            )
        return
    why = _event_time_problem(cfg)
    if why is None and lateness >= cfg["window"]["size"]:
        why = (
            f"needs window.allowed_lateness_s < window.size (got {lateness:g} >= "
            f"{cfg['window']['size']:g}: at most two windows are live); lower it"
        )
    if why:
        raise ConfigError(f"window.kind = event_time {why}")


def load_config(
    path: str | None = None,
    overrides: list[str] | None = None,
    env: dict | None = None,
    base: dict | None = None,
) -> Config:
    """The merged, validated configuration (:class:`.settings.Config`).

    ``base`` (e.g. the effective config a service saved in its checkpoint directory) replaces
    the built-in defaults; the file, the environment and the overrides still apply on top.
    """
    cfg = copy.deepcopy(DEFAULTS)
    aggregations: dict[str, list] = {}  # name -> [(section, key, value, where)]
    for section, values in (base or {}).items():
        for key, value in values.items():  # a saved config may hold keys since removed
            if section in cfg and key in cfg[section]:
                cfg[section][key] = _coerce(section, key, value, DEFAULTS[section][key])
    env = os.environ if env is None else env
    if path:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(
                f"config file {path} not found; pass an existing file to --config"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        for name, over in (doc.pop("aggregations", None) or {}).items():
            for section, values in over.items() if isinstance(over, dict) else [(None, over)]:
                for key, value in values.items() if isinstance(values, dict) else [(None, 0)]:
                    aggregations.setdefault(name, []).append((section, key, value, path))
        for section, values in doc.items():
            if section not in cfg or not isinstance(values, dict):
                raise ConfigError(
                    f"unknown config section [{section}] in {path}; known: {', '.join(sorted(cfg))}"
                )
            for key, value in values.items():
                _removed(section, key, path)
                if key not in cfg[section]:
                    near = difflib.get_close_matches(str(key), list(cfg[section]), n=1)
                    raise ConfigError(
                        f"unknown key {section}.{key} in {path}; "
                        + (f"did you mean {section}.{near[0]}? " if near else "")
                        + f"known in [{section}]: {', '.join(sorted(cfg[section]))}"
                    )
                cfg[section][key] = _coerce(section, key, value, DEFAULTS[section][key])
    for section, key in _REMOVED:
        if f"PANAGG_{section.upper()}_{key.upper()}" in env:
            _removed(section, key, f"PANAGG_{section.upper()}_{key.upper()}")
    for section, values in cfg.items():
        for key in values:
            var = f"PANAGG_{section.upper()}_{key.upper()}"
            if var in env and (section, key) not in _SECRET:  # secrets: security.password_env
                cfg[section][key] = _coerce(section, key, env[var], DEFAULTS[section][key])
    for item in overrides or []:
        name, sep, value = item.partition("=")
        if name.strip().startswith("aggregations.") and sep:
            parts = name.strip().split(".")
            if len(parts) != 4:
                raise ConfigError(
                    f"--set {item!r}: expected aggregations.NAME.section.key=value, "
                    "e.g. --set aggregations.ip.item.field=ip"
                )
            aggregations.setdefault(parts[1], []).append(
                (parts[2], parts[3], value.strip(), "--set")
            )
            continue
        section, _, key = name.strip().partition(".")
        _removed(section, key, "--set")
        if not sep or section not in cfg or key not in cfg[section]:
            near = difflib.get_close_matches(
                name.strip(), [f"{s}.{k}" for s in DEFAULTS for k in DEFAULTS[s]], n=1
            )
            raise ConfigError(
                f"--set {item!r}: expected section.key=value with a known key, "
                + (f"did you mean {near[0]}?" if near else "e.g. --set window.size=100000")
            )
        cfg[section][key] = _coerce(section, key, value.strip(), DEFAULTS[section][key])
    _check_environment(cfg, env)
    _validate(cfg, env)  # (checks the user unit first, so its refusal is the one said)
    _check_user_unit(cfg, aggregations)  # again, now that the [aggregations] tables are known
    aggregations = _breakdown(cfg, aggregations)
    aggregations = _rollup_levels(cfg, aggregations)
    cfg["aggregations"] = _aggregations(cfg, aggregations)
    return Config.from_mapping(cfg)


#: the most keys a breakdown takes (each is an aggregation: its state, window and releases)
BREAKDOWN_MAX_KEYS = 1000
#: the key a breakdown counts the records outside its keys in (``breakdown.other``)
OTHER_KEY = "other"


def _breakdown(cfg: dict, given: dict[str, list]) -> dict[str, list]:
    """``[breakdown]``: one aggregation per key of ``breakdown.keys`` (and ``other``), each
    filtered to its key; :func:`_aggregations` then charges them as one parallel composition (an
    event is in one key's state only: docs/privacy.md section 24). A setting a breakdown does
    not support yet is refused in one line."""
    bd = cfg["breakdown"]
    if not bd["field"]:
        if bd["keys"]:
            raise ConfigError(
                "breakdown.keys is set without breakdown.field (the field the "
                "keys are values of); " + _where("breakdown", "field")
            )
        return given
    where = _where("breakdown", "field")
    if any(seg == "" for seg in bd["field"].split(".")):
        raise ConfigError(
            f"breakdown.field = {bd['field']!r} has an empty segment; write a "
            "dotted path such as geo.country; " + where
        )
    why = (
        "[aggregations] tables (one breakdown per service for now)"
        if given
        else "window.rollups"
        if cfg["window"]["rollups"]
        else "scale.partitioned (a scale-out group)"
        if cfg["scale"]["partitioned"]
        else "state.model = shuffle"
        if cfg["state"]["model"] == "shuffle"
        else "item.filter_field (the breakdown's filter is its key)"
        if cfg["item"]["filter_field"]
        else None
    )
    if why:
        raise ConfigError(
            f"breakdown.field is not built with {why} yet; remove one of them "
            "(docs/privacy.md section 24)"
        )
    keys = [str(k) for k in bd["keys"]]
    if not keys or len(keys) > BREAKDOWN_MAX_KEYS:
        raise ConfigError(
            f"breakdown.keys must list 1 to {BREAKDOWN_MAX_KEYS:,} keys (the public "
            f"key domain), got {len(keys)}; " + _where("breakdown", "keys")
        )
    for k in keys:
        if not _NAME.fullmatch(k) or (k == OTHER_KEY and bd["other"]):
            raise ConfigError(
                f"breakdown.keys: {k!r} cannot name its aggregation: use a "
                "lowercase letter, then up to 31 of a-z 0-9 _ -"
                + (
                    f" (and not {OTHER_KEY!r}: records outside the keys are counted there)"
                    if k == OTHER_KEY
                    else ""
                )
            )
    if len(set(keys)) != len(keys):
        raise ConfigError("breakdown.keys lists a key twice; list each once")
    src = "breakdown"
    out = {
        k: [("item", "filter_field", bd["field"], src), ("item", "filter_value", k, src)]
        for k in keys
    }
    if bd["other"]:
        out[OTHER_KEY] = [
            ("item", "filter_field", bd["field"], src),
            ("item", "filter_exclude", keys, src),
        ]
    led = cfg["ledger"]
    if not led["budget_per_event"]:  # one parallel group: an event spends one key's window
        led["budget_per_event"] = float(led["budget_per_window"] or cfg["state"]["epsilon"])
    return out


def breakdown_group(cfg: Config | dict) -> str | None:
    """The parallel group's name of a config with a breakdown (None without one):
    ``breakdown:FIELD#DIGEST``, the digest of the key domain (and ``breakdown.other``). A record
    is in one key's state only *within one domain*: after a change of the keys (``--accept-change``)
    a new key may count records an old key (``other``) already released, so the new domain is
    another group, whose charges add to the old one's."""
    bd = cfg["breakdown"]
    if not bd["field"]:
        return None
    domain = json.dumps([str(bd["field"]), sorted(map(str, bd["keys"])), bool(bd["other"])])
    return f"breakdown:{bd['field']}#{hashlib.sha256(domain.encode()).hexdigest()[:8]}"


def _level_name(base: str | None, span: str) -> str:
    tail = "r" + "".join(ch for ch in span if ch.isalnum())
    return f"{base}-{tail}" if base else tail


def rollup_split_line(cfg: Config) -> str | None:
    """The start's one line for ``window.rollup_design = tree | hybrid``: what each level now
    spends of the epsilon that was set (None for plain sums, which spend nothing more)."""
    w = cfg.window
    if not w.rollups or w.rollup_design == "sum" or not cfg.aggregations:
        return None
    if cfg.state.privacy_unit == "user":  # every span its own state at the full eps
        return user_rollup_line(cfg)
    parts = [
        f"{name} at eps {over.get('state', {}).get('epsilon', cfg.state.epsilon):g}"
        for name, over in sorted(cfg.aggregations.items())
    ]
    return (
        f"window.rollup_design = {w.rollup_design}: {', '.join(parts)} (the per-event "
        f"total {cfg.state.epsilon:g} split between the levels: each base window is "
        "released at that share; rollup_design = sum keeps the base windows at the full "
        "epsilon and spends nothing on rollups, less accurate for the longer spans; "
        "docs/rollups.md)"
    )


def _rollup_levels(cfg: dict, given: dict[str, list]) -> dict[str, list]:
    """``window.rollup_design = tree | hybrid``: each rollup level becomes an aggregation of
    its own (its own live state and window of the span's length), the epsilon of the
    aggregation split equally between its levels, so the per-event total stays what was set
    (docs/rollups.md; the composition is section 19 of docs/privacy.md). ``tree``: every span
    a level; ``hybrid``: the first span a level, the longer spans sums of that level's views.
    Single mode becomes aggregations ``base``, ``r1d``, ...; an aggregation NAME becomes
    ``NAME``, ``NAME-r1d``, ..."""
    single = not given
    items = [(None, [])] if single else list(given.items())
    out: dict[str, list] = {}
    for name, entries in items:
        one = {section: dict(values) for section, values in cfg.items() if isinstance(values, dict)}
        for section, key, value, _ in entries:
            if section in one and key in one[section]:
                one[section][key] = _coerce(section, key, value, DEFAULTS[section][key])
        w = one["window"]
        if not w["rollups"] or w["rollup_design"] == "sum":
            out[name or "base"] = entries
            if single:
                return given  # nothing to expand
            continue
        where = f"aggregations.{name}: " if name else ""
        try:
            spans = [
                (str(sp).strip().lower(), parse_span(sp, kind=w["kind"], size=w["size"]))
                for sp in w["rollups"]
            ]
        except RollupError as exc:
            raise ConfigError(where + str(exc)) from None
        spans.sort(key=lambda t: t[1])
        user = one["state"]["privacy_unit"] == "user"
        # the user unit: every span a density state of its own at the full eps, each release
        # charged to every user (ledger.budget_per_user): states of users do not sum
        own = spans if w["rollup_design"] == "tree" or user else spans[:1]
        eps = float(one["state"]["epsilon"])
        share = eps if user else eps / (1 + len(own))
        budget = float(one["ledger"]["budget_per_window"] or eps)
        keep = [
            e
            for e in entries
            if (e[0], e[1])
            not in (
                ("state", "epsilon"),
                ("ledger", "budget_per_window"),
                ("window", "size"),
                ("window", "rollups"),
                ("window", "rollup_design"),
                ("state", "rollup_expected_users"),
                ("state", "expected_users"),
            )
        ]
        src = (
            "window.rollups under state.privacy_unit = user"
            if user
            else f"window.rollup_design = {w['rollup_design']}"
        )
        common = [
            ("state", "epsilon", share, src),
            ("ledger", "budget_per_window", budget if user else budget / (1 + len(own)), src),
            ("window", "rollup_design", "sum", src),
        ]
        if user:
            users = rollup_users(one)
            common.append(("state", "rollup_expected_users", [], src))
            base_users = [("state", "expected_users", one["state"]["expected_users"], src)]
        out[name or "base"] = (
            keep + common + [("window", "rollups", [], src)] + (base_users if user else [])
        )
        for i, (span, k) in enumerate(own):
            rest = []
            if w["rollup_design"] == "hybrid" and not user:
                for longer, kl in spans[1:]:
                    if kl % k:
                        raise ConfigError(
                            f"{where}window.rollups: {longer!r} is not a multiple "
                            f"of {span!r} (hybrid: longer spans are sums of the "
                            f"{span} windows); use multiples of {span!r} or "
                            "window.rollup_design = tree"
                        )
                    rest.append(f"{kl // k}x" if longer.endswith("x") else longer)
            size = w["size"] * k
            # what the level's releases say of themselves (the `rollup_level` block)
            cfg.setdefault("rollup_levels", {})[_level_name(name, span)] = {
                "span": span,
                "design": "user" if user else w["rollup_design"],
                "base": name or "base",
                "base_windows": k,
                "epsilon": share,
                "epsilon_per_event": eps * (1 + len(own)) if user else eps,
                "sums": rest,
            }
            out[_level_name(name, span)] = (
                keep
                + common
                + [
                    ("window", "size", int(size) if float(size).is_integer() else size, src),
                    ("window", "rollups", rest, src),
                ]
                + ([("state", "expected_users", users[span], src)] if user else [])
            )
    if single:
        led = cfg["ledger"]
        if not led["budget_per_event"]:
            led["budget_per_event"] = float(led["budget_per_window"] or cfg["state"]["epsilon"])
            if cfg["state"]["privacy_unit"] == "user":  # (every level at the full eps)
                led["budget_per_event"] *= len(out)
    return out


#: PANAGG_* variables that are not settings: keys read by name (audit, shuffle analyzer), the
#: analyzer's decrypt pool, and the test harness's (PANAGG_TEST*: PANAGG_TESTING, test hooks;
#: PANAGG_KAFKA_*: a broker for the tests and benchmarks)
NON_SETTING_ENV = (
    "PANAGG_AUDIT_KEY",
    "PANAGG_SHUFFLE_PRIVATE_KEY",
    "PANAGG_SHUFFLE_DECRYPT_WORKERS",
    "PANAGG_KAFKA_BOOTSTRAP",
    "PANAGG_KAFKA_SECURE_STATE",
)


def _check_environment(cfg: dict, env) -> None:
    """Refuse a ``PANAGG_*`` variable that sets nothing (a typo would otherwise run with the
    default: ``PANAGG_STATE_EPSILOM=0.25`` ran at epsilon 1). Only names are shown, never values."""
    settings = {
        f"PANAGG_{s.upper()}_{k.upper()}": f"{s}.{k}"
        for s in DEFAULTS
        for k in DEFAULTS[s]
        if (s, k) not in _SECRET
    }
    named = cfg["security"]["password_env"]  # a secret by name may be called PANAGG_anything
    for var in sorted(v for v in env if v.startswith("PANAGG_")):
        if (
            var in settings
            or var in NON_SETTING_ENV
            or var == named
            or var.startswith("PANAGG_TEST")
        ):
            continue
        if var == "PANAGG_SECURITY_PASSWORD":
            raise ConfigError(
                "PANAGG_SECURITY_PASSWORD is not read: secrets come in by name only; "
                "put the password in a file (security.password_file) or name the "
                "variable that holds it (security.password_env), and unset it"
            )
        near = difflib.get_close_matches(
            var, list(settings) + list(NON_SETTING_ENV), n=1, cutoff=0.8
        )
        hint = (
            f" (did you mean {near[0]}"
            + (f", i.e. {settings[near[0]]}" if near[0] in settings else "")
            + "?)"
            if near
            else ""
        )
        raise ConfigError(
            f"unknown environment variable {var}{hint}; rename or unset it "
            "(PANAGG_<SECTION>_<KEY> sets a config key: docs/configuration.md)"
        )


#: what an aggregation may set for itself; the stream (source, security), the process (scale,
#: checkpoint, metrics, audit, testing) and the shared budget are the service's
AGGREGATION_SECTIONS = {
    "item": None,
    "state": None,
    "window": None,
    "release": None,
    "ledger": ("budget_per_window",),
}
_NAME = __import__("re").compile(r"[a-z][a-z0-9_-]{0,31}")


def _aggregations(cfg: dict, given: dict[str, list]) -> dict[str, dict]:
    """``{name: {section: {key: value}}}`` from ``[aggregations.NAME]`` tables and ``--set
    aggregations.NAME.section.key=value``, each checked as a full config and the sum of their
    per-window budgets against ``ledger.budget_per_event`` (docs/privacy.md, section 19)."""
    out: dict[str, dict] = {}
    for name, entries in given.items():
        if not _NAME.fullmatch(str(name)):
            raise ConfigError(
                f"aggregation name {name!r}: use a lowercase letter, then up to 31 "
                "of a-z 0-9 _ - (it names a directory and a metric label)"
            )
        for section, key, value, where in entries:
            allowed = AGGREGATION_SECTIONS.get(section, ())
            if section not in AGGREGATION_SECTIONS or (allowed is not None and key not in allowed):
                what = f"{section}.{key}" if key is not None else str(section)
                raise ConfigError(
                    f"aggregations.{name}.{what} in {where}: an aggregation sets only item.*, "
                    "state.*, window.*, release.* and ledger.budget_per_window; the source, "
                    "security, checkpoint, scale and metrics are the service's"
                )
            if key not in DEFAULTS[section]:
                raise ConfigError(
                    f"unknown key aggregations.{name}.{section}.{key} in {where}; "
                    f"known in [{section}]: {', '.join(sorted(DEFAULTS[section]))}"
                )
            out.setdefault(name, {}).setdefault(section, {})[key] = _coerce(
                section, key, value, DEFAULTS[section][key]
            )
    if not out:
        return {}
    cfg["aggregations"] = out
    total = 0.0
    parts = []
    for name in sorted(out):
        if out[name].get("state", {}).get("model", cfg["state"]["model"]) == "shuffle":
            raise ConfigError(
                f"aggregations.{name}: state.model = shuffle is not built with "
                "several aggregations; run the analyzer as its own service"
            )
        if out[name].get("state", {}).get("privacy_unit") == "user":
            # (a top-level user unit with [aggregations] is refused before: user_unit_problem)
            raise ConfigError(
                f"aggregations.{name}: state.privacy_unit = user is not built with "
                "several aggregations yet; run it as a service of its own "
                "(docs/privacy_unit.md)"
            )
        one = aggregation_config(cfg, name, out[name])
        budget = one.budget_per_window
        total += budget
        parts.append(f"{name} {budget:g}")
    cap = cfg["ledger"]["budget_per_event"]
    if breakdown_group(cfg):
        # parallel composition: an event is in its own key's state only, so it spends the
        # largest of the keys' per-window budgets, not their sum (docs/privacy.md section 24)
        most = max(aggregation_config(cfg, name, out[name]).budget_per_window for name in out)
        if most > cap * (1 + 1e-9):
            raise ConfigError(
                f"breakdown by {cfg['breakdown']['field']}: each event spends "
                f"{most:g} eps (its key's window), over ledger.budget_per_event = "
                f"{cap:g}; lower state.epsilon or raise the budget"
            )
        return out
    if len(out) >= 2 and not cap:
        raise ConfigError(
            f"{len(out)} aggregations spend {' + '.join(parts)} = {total:g} eps on "
            "each event (one window of each); set ledger.budget_per_event to the "
            f"most you accept (>= {total:g}) to state that composition"
        )
    if cap and total > cap * (1 + 1e-9):
        raise ConfigError(
            f"the aggregations spend {' + '.join(parts)} = {total:g} eps per event, "
            f"over ledger.budget_per_event = {cap:g}; lower their state.epsilon "
            "(or ledger.budget_per_window), drop one, or raise the budget"
        )
    return out


def aggregation_config(cfg: Config | dict, name: str, overrides: dict | None = None) -> Config:
    """The full, validated config of aggregation ``name``: the service's settings, its own
    overrides, and its own directories (``checkpoint.dir/NAME``, ``release.dir/NAME``)."""
    if isinstance(cfg, Config):
        cfg = cfg.to_dict()
    one = {
        section: dict(values)
        for section, values in cfg.items()
        if section not in ("aggregations", "rollup_levels")
    }
    for section, values in (
        overrides if overrides is not None else cfg["aggregations"][name]
    ).items():
        one[section].update(values)
        if section == "window" and ("kind" in values or "clock" in values):
            if one["window"].pop("auto_event_time", False) and "kind" not in values:
                one["window"]["kind"] = "time"  # the service's automatic choice, made again
    one["checkpoint"]["dir"] = os.path.join(cfg["checkpoint"]["dir"], name)
    one["release"]["dir"] = os.path.join(cfg["release"]["dir"], name)
    one["metrics"]["port"] = -1  # one exposition for all, served by the service
    try:
        _validate(one, {})
    except ConfigError as exc:
        raise ConfigError(f"aggregations.{name}: {exc}") from None
    one["aggregations"] = {}
    one["aggregation"] = {
        "name": name,
        "of": sorted(cfg["aggregations"] or [name]),
        "budget_per_event": cfg["ledger"]["budget_per_event"] or None,
    }
    group = breakdown_group(cfg)
    if group:  # one key of a breakdown: its releases are one parallel composition with the others
        one["aggregation"]["parallel"] = {
            "group": group,
            "member": name,
            "of": len(cfg["aggregations"]),
        }
        one["breakdown"] = dict(DEFAULTS["breakdown"])  # the key's own config has no breakdown
    level = (cfg.get("rollup_levels") or {}).get(name)
    if level:
        one["aggregation"]["rollup_level"] = dict(level)
    return Config.from_mapping(one)


def aggregation_configs(cfg: Config) -> list[tuple[str, Config]]:
    """(name, config) of every aggregation of ``cfg``, in name order (empty: single mode)."""
    out = [(name, aggregation_config(cfg, name)) for name in sorted(cfg.aggregations)]
    spends = [one.budget_per_window for _, one in out]
    # a breakdown's keys are one parallel composition: an event spends one key's window
    total = max(spends, default=0.0) if breakdown_group(cfg) else sum(spends)
    return [(name, one.updated({"aggregation": {"epsilon_per_event": total}})) for name, one in out]


def _validate(cfg: dict, env=None) -> None:
    for one in SETTINGS.values():  # the choices and bounds each setting declares
        value = cfg[one.section][one.key]
        problem = one.problem(value)
        if problem:
            raise ConfigError(f"{one.name} {problem}; {_where(one.section, one.key)}")
        if one.test_only and value != one.default and not under_tests():
            raise ConfigError(
                f"{one.name} is a test hook ({one.brief}) and is refused outside "
                "tests; remove it (tests also set PANAGG_TESTING=1)"
            )
    _check_user_unit(cfg)
    src = cfg["source"]
    if src["kind"] == "file" and not src["path"]:
        raise ConfigError(
            "source.kind = file needs source.path (a file, or - for stdin); "
            + _where("source", "path")
        )
    if src["kind"] == "kafka" and not src["topic"]:
        raise ConfigError(
            "source.topic must name the Kafka topic to count; " + _where("source", "topic")
        )
    if cfg["scale"]["store"] == "directory":
        raise ConfigError(
            "scale.store = directory (the shared-directory scale-out) was removed: run the group "
            "with scale.store = kafka, the same source.group (its committed offsets carry over, "
            "so no event is counted twice) and an empty scratch checkpoint.dir per member; the "
            "old directory's ledger.jsonl stays the record of what it released; docs/scale-out.md"
        )
    if cfg["scale"]["partitioned"]:
        _check_kafka_group(cfg)
    if cfg["source"]["max_partition_fetch_bytes"] > cfg["source"]["fetch_max_bytes"]:
        raise ConfigError(
            "source.max_partition_fetch_bytes must be <= source.fetch_max_bytes; "
            + _where("source", "max_partition_fetch_bytes")
        )
    _validate_item(cfg)
    _validate_shuffle(cfg)
    _resolve_clock(cfg)
    _check_views(cfg)
    _check_client(cfg)
    _validate_event_time(cfg)
    rollup_spans(cfg)
    start = parse_start(cfg["source"]["start"])
    if start != "earliest" and src["kind"] != "kafka":
        raise ConfigError(
            "source.start applies to Kafka topics (source.kind = kafka); remove it "
            f"for a {src['kind']} source"
        )
    try:
        check_security(cfg["security"], env)
    except SecurityError as exc:
        raise ConfigError(str(exc)) from None


def _check_user_unit(cfg: dict, aggregations=None) -> None:
    """``state.privacy_unit = user``: refused in one line where it is not wired
    (:func:`.user_window.user_unit_problem`)."""
    problem = user_unit_problem(cfg, aggregations)
    if problem:
        raise ConfigError(problem)


def rollup_spans(cfg: dict) -> dict[str, int]:
    """``window.rollups`` as {name: base windows per rollup}; a ConfigError (one line naming
    the fix) for a span that is not a multiple of the window, twice the same, or a setting
    rollups do not support yet (docs/rollups.md)."""
    names = cfg["window"]["rollups"]
    if not names:
        return {}
    if cfg["state"]["model"] != "joint":
        raise ConfigError(
            f"window.rollups needs state.model = joint (got "
            f"{cfg['state']['model']}: a rollup sums the release views, which "
            "only the joint model draws with a fresh layer); set state.model = "
            "joint or remove window.rollups"
        )
    out: dict[str, int] = {}
    for name in names:
        try:
            k = parse_span(name, kind=cfg["window"]["kind"], size=cfg["window"]["size"])
        except RollupError as exc:
            raise ConfigError(str(exc)) from None
        key = str(name).strip().lower()
        if key in out or k in out.values():
            raise ConfigError(
                f"window.rollups names {k} base windows twice ({name!r}); list each span once"
            )
        if "/" in key or key.startswith("."):
            raise ConfigError(f"window.rollups: {name!r} is not a span name")
        out[key] = k
    return out


def shuffle_n(cfg: dict) -> int:
    """The n the shuffle-model randomizers are calibrated for (``shuffle.n``, or window.size)."""
    n = int(cfg["shuffle"]["n"])
    return n if n else int(cfg["window"]["size"])


def _validate_shuffle(cfg: dict) -> None:
    sh = cfg["shuffle"]  # (its bounds: settings.py)
    if cfg["state"]["model"] != "shuffle":
        return
    if cfg["window"]["kind"] == "time" and not sh["n"]:
        raise ConfigError(
            "state.model = shuffle with time windows needs shuffle.n (the randomizer "
            "outputs per window the clients are calibrated for; the shuffler tops "
            "windows up to it); " + _where("shuffle", "n")
        )
    if cfg["window"]["kind"] == "count" and sh["n"] and sh["n"] != cfg["window"]["size"]:
        raise ConfigError(
            f"shuffle.n = {sh['n']} differs from window.size = "
            f"{cfg['window']['size']:g} for count windows; remove shuffle.n (it "
            "defaults to window.size) or make them equal"
        )
    if cfg["source"]["kind"] != "kafka":
        raise ConfigError(
            "state.model = shuffle reads the shuffler's analyzer topic: set "
            "source.kind = kafka and source.topic to that topic"
        )
    if cfg["checkpoint"]["snapshots_per_window"]:
        raise ConfigError(
            "checkpoint.snapshots_per_window does not apply to state.model = "
            "shuffle (the analyzer adds no noise of its own); remove it"
        )


def parse_start(text: str):
    """``source.start`` as ``"earliest"``, ``"latest"`` or a Unix time in milliseconds."""
    text = str(text).strip()
    if text in ("earliest", "latest"):
        return text
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(
            f"source.start must be earliest, latest or an ISO 8601 time with its "
            f"zone (e.g. 2026-11-20T00:00:00Z), got {text!r}; " + _where("source", "start")
        ) from None
    if when.tzinfo is None:
        raise ConfigError(
            f"source.start = {text!r} has no time zone, so it could mean any of "
            "24 hours; add one (Z for UTC, or +01:00)"
        )
    return int(when.timestamp() * 1000)


def _validate_item(cfg: dict) -> None:
    item, mode = cfg["item"], cfg["state"]["mode"]
    for key in ("field", "filter_field"):
        path = item[key]
        if path and any(not seg for seg in path.split(".")):
            raise ConfigError(
                f"item.{key} = {path!r} has an empty segment; write a dotted path "
                "such as user.id; " + _where("item", key)
            )
    if not item["field"]:
        raise ConfigError(
            "item.field must name the item's field (default item); " + _where("item", "field")
        )
    if item["source"] == "header" and not item["header"]:
        raise ConfigError(
            "item.source = header needs item.header (the header's name); "
            + _where("item", "header")
        )
    if item["header"] and item["source"] != "header":
        raise ConfigError(
            "item.header is set but item.source is not header; set item.source = "
            "header, or remove item.header"
        )
    if item["source"] != "value" and cfg["source"]["kind"] != "kafka":
        raise ConfigError(
            f"item.source = {item['source']} needs Kafka records (source.kind = "
            "kafka); file and generator records have no key or headers"
        )
    if item["source"] != "value" and item["field"] != "item":
        raise ConfigError(
            f"item.field is a field of the value, but item.source = "
            f"{item['source']}; remove item.field or set item.source = value"
        )
    if item["filter_exclude"] and (item["filter_value"] or not item["filter_field"]):
        raise ConfigError(
            "item.filter_exclude needs item.filter_field and no item.filter_value "
            "(records whose field is one of them are filtered); " + _where("item", "filter_exclude")
        )
    if item["filter_value"] and not item["filter_field"]:
        raise ConfigError(
            "item.filter_value is set without item.filter_field (the field it is "
            "compared with); " + _where("item", "filter_field")
        )
    if mode == "direct" and (item["normalize"] != "none" or item["casefold"]):
        raise ConfigError(
            "item.normalize and item.casefold apply to text items (state.mode = "
            "hashed); direct mode counts ints: remove them"
        )
    if mode == "hashed" and item["coerce"]:
        raise ConfigError(
            "item.coerce is for direct mode; hashed mode already counts 42 and "
            '"42" as the same item: remove item.coerce'
        )
