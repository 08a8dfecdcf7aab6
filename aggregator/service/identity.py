"""What a state directory counts and under which settings: the ledger's identity of a
configuration (:func:`identity_of`), what else the directory depends on
(:func:`directory_identity`), and the counters hashed mode uses (:func:`choose_buckets_for`)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..largedomain import choose_buckets
from .settings import Config, Setting, settings_by
from .user_window import user_cells

__all__ = [
    "choose_buckets_for",
    "identity_of",
    "directory_identity",
    "item_identity",
    "IDENTITY_DEFAULTS",
    "IDENTITY_KEYS",
]


def choose_buckets_for(cfg: Config) -> int:
    """Number of hash buckets for hashed mode: configured, or from expected_n by the default rule
    of :func:`aggregator.largedomain.choose_buckets` (docs/large_domains.md, "Choosing B")."""
    if cfg.state.buckets:
        return int(cfg.state.buckets)
    return int(choose_buckets(max(int(cfg.state.expected_n), 2), cfg.state.epsilon))


def _stream(cfg: Config) -> str:
    src = cfg.source
    return {
        "kafka": f"kafka:{src.topic}",
        "file": f"file:{os.path.basename(src.path)}",
        "generator": "generator",
    }[src.kind]


#: identity keys whose value is not one setting's own: how each is made of the settings that
#: declare it (settings.py, ``identity=``); any other key is its one setting's value, of its type
_DERIVED = {
    "stream": _stream,
    "group": lambda cfg: cfg.source.group if cfg.source.kind == "kafka" else "",
    "domain": lambda cfg: (
        user_cells(cfg)
        if cfg.state.privacy_unit == "user"
        else int(cfg.state.domain_size)
        if cfg.state.mode == "direct"
        else choose_buckets_for(cfg)
    ),
    # window.clock enters through the kind it made of time windows (config._resolve_clock)
    "window": lambda cfg: f"{cfg.window.kind}:{cfg.window.size:g}",
    "budget_per_window": lambda cfg: cfg.budget_per_window,
    "item": lambda cfg: item_identity(cfg),
}

#: keys the directory depends on beyond the ledger's first identity (issue 27), read from a
#: config mapping (a saved config.json may lack them: then they are left out)
_DIRECTORY = {
    "format": lambda cfg: (cfg.get("source") or {}).get("format"),
    # (a config saved before the setting: left out, so IDENTITY_DEFAULTS' "event")
    "unit": lambda cfg: (cfg.get("state") or {}).get("privacy_unit"),
    "release_dir": lambda cfg: (
        os.path.abspath((cfg.get("release") or {})["dir"])
        if (cfg.get("release") or {}).get("dir")
        else None
    ),
    # (a later key: a directory recorded without it adopts the current value)
    "budget_per_user": lambda cfg: _float_or_none((cfg.get("ledger") or {}).get("budget_per_user")),
}


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)


#: identity key -> the settings that enter it, in declaration order (settings.py). A key declared
#: later does not refuse an existing directory: a ledger without it is taken to have recorded
#: the current value, or its IDENTITY_DEFAULTS entry (Aggregator.check_identity)
IDENTITY_KEYS: dict[str, tuple[Setting, ...]] = settings_by("identity")

#: why a state directory is tied to each identity key (docs/configuration.md's table)
IDENTITY_WHY = {
    "stream": "which records are counted (`source.path`: its file name)",
    "group": "the group's committed offsets anchor the ledger",
    "format": "the open window is replayed from the source after a restart: its records must "
    "decode the same way",
    "item": "what is counted of each record",
    "mode": "the counters and their noise",
    "domain": "the number of counters (the user unit: the density state's cells)",
    "unit": "what the state protects: one event, or all events of one user",
    "epsilon": "the counters' noise",
    "model": "what the noise protects against",
    "window": "window numbering and boundaries; `window.clock` through the kind it makes of "
    "`time` windows: a directory started with clock-time windows keeps them whatever "
    "`auto` would choose (logged)",
    "snapshots_per_window": "noise layers per window",
    "release_dir": "a new directory leaves a gap in the old one (recorded as an absolute path); "
    "the refusal says where the releases so far are (`... the releases so far "
    "(3, up to window 2) are in /srv/releases: a new release.dir would leave a gap "
    "there`); with `--accept-change` later windows go to the new one",
    "budget_per_window": "the privacy budget",
    "budget_total": "the privacy budget",
    "budget_per_user": "the privacy budget (the user unit: what one user may be charged)",
    "partitioned": "one state per partition or one for all",
}


def _check_rules() -> None:
    """The declaration and the rules above agree (run at import: a mistake here would change
    the identity of every state directory, so it must not wait for a test)."""
    for key, fed in IDENTITY_KEYS.items():
        names = [one.name for one in fed]
        if len(fed) > 1 and key not in _DERIVED and key not in _DIRECTORY:
            raise TypeError(
                f"identity key {key!r} is declared by {names}: say in "
                "identity._DERIVED how they make one value"
            )
        if key not in IDENTITY_WHY:
            raise TypeError(f"identity key {key!r} ({names}) needs its reason in IDENTITY_WHY")
    orphans = (set(_DERIVED) | set(_DIRECTORY) | set(IDENTITY_WHY)) - set(IDENTITY_KEYS)
    if orphans:
        raise TypeError(
            f"identity keys {sorted(orphans)} have a rule but no setting declares "
            "them (settings.py, identity=)"
        )


_check_rules()


def _plain(cfg: Config, one: Setting):
    value = getattr(getattr(cfg, one.section), one.key)
    return type(one.default)(value)


def identity_of(cfg: Config) -> dict:
    """What a state directory counts and under which settings (the ledger's ``identity``): a
    key for each ``identity=`` of settings.py (but those of :func:`directory_identity`)."""
    return {
        key: _DERIVED[key](cfg) if key in _DERIVED else _plain(cfg, fed[0])
        for key, fed in IDENTITY_KEYS.items()
        if key not in _DIRECTORY
    }


#: identity keys added after state directories existed: what a ledger without them recorded
IDENTITY_DEFAULTS = {"item": "value:item", "unit": "event"}


def directory_identity(cfg: Mapping) -> dict:
    """Settings a state directory depends on beyond :func:`identity_of` (issue 27): the format
    its records are decoded in (the open window is replayed from the source after a restart) and
    where its releases go (a new directory leaves a gap in the old one). From a config dict, or
    from the config.json a start saved."""
    out = {}
    for key in IDENTITY_KEYS:
        if key in _DIRECTORY and (value := _DIRECTORY[key](cfg)) is not None:
            out[key] = value
    return out


def item_identity(cfg: Config) -> str:
    """What is counted, as one string for the ledger's identity (``value:item`` by default)."""
    it = cfg.item
    where = {"value": it.field, "key": "", "header": it.header}[it.source]
    out = f"{it.source}:{where}" if where else it.source
    extra = [
        name
        for name, on in (
            ("coerce", it.coerce),
            ("nfc", it.normalize == "nfc"),
            ("casefold", it.casefold),
        )
        if on
    ]
    if it.filter_field and it.filter_exclude:
        extra.append(f"filter {it.filter_field} not in {','.join(sorted(it.filter_exclude))}")
    elif it.filter_field:
        extra.append(f"filter {it.filter_field}={it.filter_value}")
    return out + (f" ({', '.join(extra)})" if extra else "")
