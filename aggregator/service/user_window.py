"""``state.privacy_unit = "user"``: each window's state is a user-level pan-private density state
(:class:`aggregator.density.PanPrivateDensity`, after Dwork, Naor, Pitassi, Rothblum, Yekhanin,
ICS 2010) instead of the event counters, and each window releases its distinct users (and, with
``state.user_universe``, the active fraction) with an interval and an expected relative error.

What is counted. The record's item (``[item]``: e.g. ``item.field = "user"``) is the user: it is
hashed with a fresh random key per window into ``m`` cells, and each arrival redraws its cell's
bit, so one login and 10,000 logins leave the same state (docs/privacy.md section 23). ``m``
comes from ``state.expected_users`` (:func:`aggregator.density.plan_cells`: the m that minimises
the relative error there, about 2.3 x the expected users).

The rest is the service's own path, unchanged: the window's close consults the ledger before the
release's noise is drawn, the release is ledgered with its document and its source ranges and
charged ``state.epsilon`` per window (a user present in k windows spends k x eps, and any user
may be in every window: ``ledger.budget_per_user`` bounds the sum, :mod:`.user_budget`), the
checkpoint holds the window's start in the source and no state (a crash
replays the window into fresh bits with a fresh key), and the documents are published from the
ledger. Releases run in the loop (one count of bits and one DLap: nothing for a worker to do).

Rollups (``window.rollups``): every span a density state of its own, a level of the rollup
levels' machinery (``config._rollup_levels``: a window of the span's length fed by the same
records, sized by ``state.rollup_expected_users``: :func:`rollup_users`) at ``state.epsilon``;
the per-user budget sums the levels' ledgers (:func:`user_rollup_line` says what a span costs).

What is refused, one line each at start (:func:`user_unit_problem`): no ``ledger.budget_per_user``
(or one below a window's eps, or one under the event unit), what the density state
does not support (several intrusions: snapshots, audit exports; merging: summed rollups,
scale-out) and what is not wired yet (several aggregations or a breakdown, the shuffle and
state-only models, hashed mode's counters). Event-time windows run as the event unit's; a
replay's ``restart`` entry names the window it recounts, and the per-user budget charges it.
With allowed lateness two windows are live at once, and the second's replay gets a restart
entry of its own when it opens (:meth:`.event_time.EventTimeWindows.restored`).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping

from ..density import DensityRelease, PanPrivateDensity, expected_relative_error, plan_cells
from ..hashing import KEY_BYTES
from ..release import PRIVACY_UNIT_DOC, privacy_unit_clause
from .rollup import parse_span
from .user_budget import windows_left

__all__ = [
    "USER",
    "USER_CONSEQUENCE",
    "INTERVAL_LEVEL",
    "NO_EXPORT",
    "is_user",
    "user_cells",
    "user_unit_problem",
    "rollup_users",
    "user_rollup_line",
    "new_user_state",
    "user_release",
    "user_plan_line",
    "unit_clause",
]

USER = "user"
#: what eps means for a person under the user unit (every user-level document and line says it)
USER_CONSEQUENCE = (
    "all events of one user in a window, however many, are hidden at eps; a user "
    "active in k windows spends k x eps, at most ledger.budget_per_user"
)
#: the level of the released intervals
INTERVAL_LEVEL = 0.9
#: why an audit export (of a running or a stopped service) is refused under the user unit
NO_EXPORT = (
    "an audit export of a user-level density state is refused: a second look at its "
    "bits is not covered (docs/privacy_unit.md)"
)


def is_user(cfg) -> bool:
    """Whether ``cfg`` (a Config or its dict) counts users (``state.privacy_unit = "user"``)."""
    state = cfg["state"] if isinstance(cfg, Mapping) else cfg.state
    return state["privacy_unit"] == USER


@functools.lru_cache(maxsize=32)
def _cells(users: int, epsilon: float) -> int:
    return plan_cells(users, epsilon, math.inf).cells


def user_cells(cfg) -> int:
    """m, the cells of every window's density state: the error-minimising m for
    ``state.expected_users`` at ``state.epsilon`` (:func:`aggregator.density.plan_cells`)."""
    state = cfg["state"] if isinstance(cfg, Mapping) else cfg.state
    return _cells(max(int(state["expected_users"]), 1), float(state["epsilon"]))


def user_unit_problem(cfg: dict, aggregations: Mapping | None = None) -> str | None:
    """Why ``cfg`` (the loader's dict, its clock resolved) cannot run with the user unit, in one
    line naming the fix; None when it can (or the unit is the event)."""
    per_user = float(cfg["ledger"]["budget_per_user"])
    if not is_user(cfg):
        if list(cfg["state"]["rollup_expected_users"]):
            return (
                "state.rollup_expected_users applies to state.privacy_unit = user only; remove it"
            )
        if per_user > 0:  # (the operator may believe users are bounded: they are not)
            return (
                "ledger.budget_per_user bounds users under state.privacy_unit = user only; "
                "under the event unit a user with g events is charged g x eps per window: "
                "remove it, or set state.privacy_unit = user (docs/privacy_unit.md)"
            )
        return None
    st, w = cfg["state"], cfg["window"]
    head = "state.privacy_unit = user"
    if int(st["expected_users"]) <= 0:
        return (
            f"{head} needs state.expected_users (the distinct users a window is expected to "
            "hold: it sizes the hashed universe; docs/privacy_unit.md)"
        )
    eps = float(st["epsilon"])
    if per_user <= 0:
        return (
            f"{head} needs ledger.budget_per_user (the eps one user may be charged over all "
            f"windows, restarts included: e.g. {30 * eps:g} for 30 windows at "
            f"state.epsilon {eps:g}; docs/privacy_unit.md)"
        )
    if per_user < eps * (1 - 1e-12):
        return (
            f"{head}: ledger.budget_per_user {per_user:g} is below one window's "
            f"state.epsilon {eps:g}, so no window could be released; set it to at least "
            f"{eps:g} (docs/privacy_unit.md)"
        )
    unsupported = [
        (cfg["scale"]["partitioned"], "scale.partitioned (density states do not merge)"),
        (
            bool(w["rollups"]) and w["rollup_design"] == "sum",
            "window.rollup_design = sum (density states do not sum: every span is a state of its "
            "own; leave rollup_design at its default)",
        ),
        (
            st["model"] != "joint",
            f"state.model = {st['model']} (the density release is the joint model's)",
        ),
        (
            st["mode"] == "hashed",
            "state.mode = hashed (the users are hashed into "
            "state.expected_users' cells; leave state.mode at direct)",
        ),
        (
            int(cfg["checkpoint"]["snapshots_per_window"]) > 0,
            "checkpoint.snapshots_per_window (a second look at the bits is not covered)",
        ),
        (bool(cfg["breakdown"]["field"]), "a breakdown (breakdown.field)"),
        (bool(aggregations), "[aggregations] tables"),
    ]
    for bad, what in unsupported:
        if bad:
            return f"{head} does not support {what} yet; remove one of them (docs/privacy_unit.md)"
    return _rollup_users_problem(cfg)


def rollup_users(cfg) -> dict[str, int]:
    """``window.rollups`` -> the distinct users one window of the span is expected to hold
    (``state.rollup_expected_users``, in the same order); checked by :func:`user_unit_problem`."""
    st, w = (cfg["state"], cfg["window"]) if isinstance(cfg, Mapping) else (cfg.state, cfg.window)
    return {
        str(span).strip().lower(): int(str(users).strip())
        for span, users in zip(w["rollups"], st["rollup_expected_users"])
    }


def _rollup_users_problem(cfg: dict) -> str | None:
    spans, users = list(cfg["window"]["rollups"]), list(cfg["state"]["rollup_expected_users"])
    if not spans:
        return (
            None
            if not users
            else (
                "state.rollup_expected_users applies to window.rollups under state.privacy_unit = "
                "user; remove it"
            )
        )
    if len(users) != len(spans) or not all(
        str(u).strip().isdigit() and int(str(u)) > 0 for u in users
    ):
        example = ", ".join(str(int(cfg["state"]["expected_users"]) * 10) for _ in spans)
        return (
            "state.privacy_unit = user with window.rollups needs "
            "state.rollup_expected_users: the distinct users one window of each span is "
            f"expected to hold, one per span of {spans} in that order (e.g. [{example}]: "
            "a day's users, not the sum of its windows'; docs/privacy_unit.md)"
        )
    return None


def new_user_state(cfg, rng=None) -> PanPrivateDensity:
    """A window's fresh density state (a fresh hash key: from ``rng`` under tests, else the
    OS CSPRNG)."""
    key = rng.bytes(KEY_BYTES) if rng is not None else None
    return PanPrivateDensity(float(cfg.state.epsilon), user_cells(cfg), key=key, rng=rng)


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _stat(value: float, interval: tuple[float, float], rel: float | None) -> dict:
    return {
        "value": value,
        "interval": [_finite(interval[0]), _finite(interval[1])],
        "expected_relative_error": rel,
    }


def user_release(state: PanPrivateDensity, cfg, *, window, n: int, rng=None) -> dict:
    """The window's release document (its one ``release()`` of the bits; everything after it is
    post-processing of the noisy count). ``n``: the window's events (public: offsets)."""
    r: DensityRelease = state.release(rng=rng)
    distinct = max(r.distinct, 0.0)
    lo, hi = r.interval(INTERVAL_LEVEL)
    # the error the estimate's own variance states, at the estimate (the interval's basis)
    rel = r.standard_error / distinct if distinct > 0 else None
    users = _stat(distinct, (lo, hi), rel)
    universe = int(cfg.state.user_universe)
    fraction = _stat(distinct / universe, (lo / universe, hi / universe), rel) if universe else None
    doc = {
        "format": "panagg.release",
        "version": 1,
        "window": window,
        "created_unix": time.time(),
        "n": n,
        "epsilon": state.epsilon,
        "neighbor": state.neighbor,
        "model": "joint",
        "privacy_unit": USER,
        "privacy_unit_consequence": USER_CONSEQUENCE,
        "mechanism": "density",
        "density": {
            "cells": r.cells,
            "noisy_ones": r.noisy_ones,
            "a": r.a,
            "b": r.b,
            "p": state.p,
            "epsilon_state": state.epsilon_state,
            "epsilon_release": state.epsilon_release,
            "calibration": state.calibration,
            "occupied_fraction": r.density,
        },
        "distinct_users": users,
        "active_fraction": fraction,
        "user_universe": universe or None,
        "interval_level": INTERVAL_LEVEL,
        "expected_relative_error": rel,
    }
    head = {
        "distinct_users": users,
        "active_fraction": fraction,
        "interval_level": INTERVAL_LEVEL,
        "privacy_unit": USER,
        "privacy_unit_consequence": USER_CONSEQUENCE,
        "epsilon": state.epsilon,
        "window": window,
        "n": n,
    }
    return {"headline": head, **doc}


def user_plan_line(cfg) -> str:
    """``panagg plan`` and the start line under the user unit: the cells, the expected relative
    error at the expected users (and at half and twice as many), and the unit."""
    st = cfg.state
    users, eps, m = int(st.expected_users), float(st.epsilon), user_cells(cfg)

    def at(u: float) -> str:
        return f"+-{100 * expected_relative_error(max(u, 1.0), m, eps):.1f}%"

    per_user = float(cfg.ledger.budget_per_user)
    windows = windows_left(per_user, 0.0, eps)
    rollups = user_rollup_line(cfg)
    return (
        f"accuracy plan: distinct users per window in {m:,} cells (state.expected_users "
        f"{users:,}), eps {eps:g} per user per window: expected error {at(users)} at "
        f"{users:,} users ({at(users / 2)} at half, {at(2 * users)} at twice as many), "
        f"{100 * INTERVAL_LEVEL:g}% intervals; per-user budget {per_user:g} eps "
        f"(ledger.budget_per_user): {windows:,} released windows in all (one replayed after a "
        f"restart counts twice); " + (f"{rollups}; " if rollups else "") + unit_clause(USER)
    )


def user_rollup_line(cfg) -> str | None:
    """What ``window.rollups`` are under the user unit, and what one span costs a user: each
    span a density state of its own (its cells, its expected error at
    ``state.rollup_expected_users``), each of its windows charged ``state.epsilon`` to every
    user beside the base windows it spans. None without rollups (the start line, and ``panagg
    plan``'s)."""
    w, st = cfg.window, cfg.state
    if not w.rollups:
        return None
    eps, per_user = float(st.epsilon), float(cfg.ledger.budget_per_user)
    parts = []
    for span, users in rollup_users(cfg).items():
        k = parse_span(span, kind=w.kind, size=w.size)
        m = _cells(users, eps)
        cost = (k + 1) * eps
        parts.append(
            f"{span} = {k} base windows in one density state of {m:,} cells "
            f"(state.rollup_expected_users {users:,}; expected error "
            f"+-{100 * expected_relative_error(users, m, eps):.1f}% there), released "
            f"at eps {eps:g}: a user active through one {span} is charged {k} x "
            f"{eps:g} + {eps:g} = {cost:g} eps of ledger.budget_per_user "
            f"({windows_left(per_user, 0.0, cost):,} such spans)"
        )
    return "user-level rollups (not sums of windows: a user in many is one): " + "; ".join(parts)


def unit_clause(unit: str) -> str:
    """The privacy unit in one clause (:func:`aggregator.release.privacy_unit_clause`'s words for
    the event)."""
    if unit != USER:
        return privacy_unit_clause()
    return f"privacy unit: the user ({USER_CONSEQUENCE}; {PRIVACY_UNIT_DOC})"
