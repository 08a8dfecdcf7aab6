"""What a state directory counts and under which settings: the ledger's identity of a
configuration (:func:`identity_of`), what else the directory depends on
(:func:`directory_identity`), and the counters hashed mode uses (:func:`choose_buckets_for`)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .settings import Config

__all__ = ["choose_buckets_for", "identity_of", "directory_identity", "item_identity",
           "IDENTITY_DEFAULTS"]


def choose_buckets_for(cfg: Config) -> int:
    """Number of hash buckets for hashed mode: configured, or from expected_n by the default rule
    of :func:`aggregator.largedomain.choose_buckets` (docs/large_domains.md, "Choosing B")."""
    if cfg.state.buckets:
        return int(cfg.state.buckets)
    from ..largedomain import choose_buckets
    return int(choose_buckets(max(int(cfg.state.expected_n), 2), cfg.state.epsilon))


def identity_of(cfg: Config) -> dict:
    """What a state directory counts and under which settings (the ledger's ``identity``)."""
    src, st = cfg.source, cfg.state
    stream = {"kafka": f"kafka:{src.topic}", "file": f"file:{os.path.basename(src.path)}",
              "generator": "generator"}[src.kind]
    direct = st.mode == "direct"
    return {
        "stream": stream, "group": src.group if src.kind == "kafka" else "",
        "partitioned": bool(cfg.scale.partitioned), "mode": st.mode,
        "domain": int(st.domain_size) if direct else choose_buckets_for(cfg),
        "epsilon": float(st.epsilon), "model": st.model,
        "window": f"{cfg.window.kind}:{cfg.window.size:g}",
        "snapshots_per_window": int(cfg.checkpoint.snapshots_per_window),
        "budget_per_window": cfg.budget_per_window,
        "budget_total": float(cfg.ledger.budget_total),
        "item": item_identity(cfg),
    }


#: identity keys added after state directories existed: what a ledger without them recorded
IDENTITY_DEFAULTS = {"item": "value:item"}


def directory_identity(cfg: Mapping) -> dict:
    """Settings a state directory depends on beyond :func:`identity_of` (issue 27): the format
    its records are decoded in (the open window is replayed from the source after a restart) and
    where its releases go (a new directory leaves a gap in the old one). From a config dict, or
    from the config.json a start saved."""
    src, rel = cfg.get("source") or {}, cfg.get("release") or {}
    out = {}
    if "format" in src:
        out["format"] = src["format"]
    if rel.get("dir"):
        out["release_dir"] = os.path.abspath(rel["dir"])
    return out


def item_identity(cfg: Config) -> str:
    """What is counted, as one string for the ledger's identity (``value:item`` by default)."""
    it = cfg.item
    where = {"value": it.field, "key": "", "header": it.header}[it.source]
    out = f"{it.source}:{where}" if where else it.source
    extra = [name for name, on in (("coerce", it.coerce), ("nfc", it.normalize == "nfc"),
                                   ("casefold", it.casefold)) if on]
    if it.filter_field:
        extra.append(f"filter {it.filter_field}={it.filter_value}")
    return out + (f" ({', '.join(extra)})" if extra else "")
