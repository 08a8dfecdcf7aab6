"""Turn a pan-private state into a release: noise layer, estimate, properties, files.

The release is post-processing of a view of the counters, so everything in it is covered by the
state's epsilon (see docs/privacy.md):
* model ``"joint"`` (default): the release is computed from the counters plus a fresh DLap(p)
  layer W, so the release and any single intrusion into the state are jointly epsilon-DP;
* model ``"state-only"``: the release is computed from the counters themselves (one layer less,
  better accuracy); an intrusion plus the release then reveal the exact increments between them.
"""

from __future__ import annotations

import datetime as _dt
import errno
import io
import json
import os
import threading
import time
from pathlib import Path
from typing import BinaryIO

import numpy as np

from state_store.atomic import atomic_write

from . import anonymize as _anonymize
from . import intervals, properties
from .anonymize import anonymized_histogram
from .counters import noisy_value_counts
from .estimators import default_method
from .intervals import simulate_counts
from .bucket_likelihood import forget_pmfs
from .memo import ReleaseMemo
from .noise import discrete_laplace
from .state import PanPrivateHistogram

__all__ = [
    "MODELS",
    "ReleaseExists",
    "make_release",
    "release_from_view",
    "estimate_with_accuracy",
    "package_release",
    "write_release",
    "plot_release",
    "plot_rank_frequency",
    "release_figure",
    "headline_lines",
    "ERROR_BAR_REPS",
    "PHI_BANDS",
    "planned_accuracy",
    "PLAN_SHAPES",
    "headline",
    "PRIVACY_UNIT",
    "PRIVACY_UNIT_CONSEQUENCE",
    "privacy_unit_clause",
]

ERROR_BAR_REPS = 10  # bootstrap repetitions per release (release.error_bar_reps); 0: none
PUBLIC_MODE = 0o644  # release files are published: readable by all, whatever the umask
PHI_BANDS = 10  # phi_r and phi_{>=r} intervals are released for r = 1..PHI_BANDS

MODELS = ("joint", "state-only")
STATE_ONLY_CAVEAT = (
    "state-only model: this release and a snapshot of the state taken during the window are not "
    "jointly epsilon-DP (together they reveal the exact increments between them)"
)


def make_release(
    state: PanPrivateHistogram,
    *,
    model: str = "joint",
    loss: str = "l1",
    window: str | int | None = None,
    rng=None,
    error_bar_reps: int = ERROR_BAR_REPS,
    method: str | None = None,
    view: list | None = None,
) -> dict:
    """Estimate the anonymized histogram of ``state`` and package it as a JSON-ready dict.

    The event count is public only for a replace-one state: it goes into the release (``"n"``)
    and to the estimators. An add-remove state has no n (neighbors differ by one event), so its
    release says ``"n": null`` and the estimators run without n; ``loss="l2"``, which needs n
    for its sum constraint, is refused for it.

    ``rng`` is a test-only noise source for the release layer; the state is not modified.
    ``error_bar_reps`` bootstrap repetitions give the release's ``accuracy`` block
    (:func:`estimate_with_accuracy`); 0 leaves the intervals out (the signal-to-noise fields stay).
    ``method`` names the estimator (:data:`aggregator.estimators.METHODS`; None: the default for
    the mode and layer count, docs/accuracy_grid.md).
    ``view``: a list that receives ``(counts, layers)``, the exact counters this release was
    computed from (with its release layer): what a rollup adds up (never a redraw: a second
    layer on the same counters would be a second view, docs/privacy.md section 20).
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    n = state.n if state.neighbor == "replace-one" else None
    if n is None and loss == "l2":
        raise ValueError(
            "loss='l2' needs the public event count n, and an add-remove state has "
            "none (neighbors differ by one event); use loss='l1'"
        )
    started = time.perf_counter()
    counts, layers = state.counts, state.layers
    if model == "joint":
        counts = counts + discrete_laplace(state.p, state.size, rng=rng)
        layers += 1
    if view is not None:
        view.append((counts, layers))
    hist, accuracy = estimate_with_accuracy(
        counts,
        state.p,
        layers=layers,
        loss=loss,
        n=n,
        buckets=state.size if state.mode == "hashed" else None,
        reps=error_bar_reps,
        method=method,
    )
    release = package_release(
        hist,
        window=window,
        n=n,
        epsilon=state.epsilon,
        neighbor=state.neighbor,
        model=model,
        extra={
            "p": state.p,
            "layers": layers,
            "loss": loss,
            "domain": {"mode": state.mode, "size": state.size},
        },
        accuracy=accuracy,
    )
    release["release_seconds"] = time.perf_counter() - started
    if model == "state-only":
        release["caveat"] = STATE_ONLY_CAVEAT
    return release


def release_from_view(
    counts,
    *,
    p: float,
    layers: int,
    n,
    epsilon: float,
    neighbor: str,
    mode: str,
    size: int,
    window,
    loss: str = "l1",
    error_bar_reps: int = ERROR_BAR_REPS,
    method: str | None = None,
) -> dict:
    """The release of counters that already are a released view (a rollup: the sum of base
    windows' release-layered counters, ``layers`` DLap(p) layers each): the estimate and its
    accuracy block as :func:`make_release` computes them, with no further noise (post-processing
    of the views, docs/privacy.md section 20). ``n`` is the sum of the base windows' public n
    (None under add-remove)."""
    if n is None and loss == "l2":
        raise ValueError("loss='l2' needs the public event count n; use loss='l1'")
    started = time.perf_counter()
    hist, accuracy = estimate_with_accuracy(
        np.asarray(counts),
        p,
        layers=int(layers),
        loss=loss,
        n=n,
        buckets=size if mode == "hashed" else None,
        reps=error_bar_reps,
        method=method,
    )
    release = package_release(
        hist,
        window=window,
        n=n,
        epsilon=epsilon,
        neighbor=neighbor,
        model="joint",
        extra={
            "p": p,
            "layers": int(layers),
            "loss": loss,
            "domain": {"mode": mode, "size": int(size)},
        },
        accuracy=accuracy,
    )
    release["release_seconds"] = time.perf_counter() - started
    return release


TAIL_RATIO = {"direct": 2.0, "hashed": 3.0}  # internal_level's, per mode (chosen held out)


def internal_level(level: float, mode: str = "direct") -> float:
    """The level :func:`aggregator.intervals.error_bars` is run at for intervals stated at
    ``level``: 1 - r (1 - level) with r = :data:`TAIL_RATIO` of the ``mode``, i.e. 0.8 (direct)
    and 0.7 (hashed) for the release's 0.9.

    Why: the release's intervals are unions of several widenings (two stand-in truths, the
    information floor, the likelihood region's extremes), each at ``level``, and so cover more
    than ``level``: at 0.9 they covered 0.95 / 0.96 / 0.97 (distinct items, entropy, l1 bound)
    over 312 direct-mode releases of 13 families, and 0.92 / 0.96 / 0.96 over 96 hashed ones.
    Run at 0.8 they covered 0.91 / 0.93 / 0.91 and 0.92 / 0.92 / 0.89. Chosen out of sample:
    leaving each family out, the lowest internal level at which every statistic covered at
    least 0.90 on the other families was 0.8 in every direct fold, and the held-out families'
    coverage at the level chosen without them was 0.91 / 0.93 / 0.91 (direct) and 0.90 / 0.94 /
    0.92 (hashed, before the change below) (bench/accuracy/coverage28.py; docs/accuracy_changes.md,
    "Intervals at their level").
    Hashed mode's intervals reach the bucket likelihood's plausible extremes since issue 28's
    new-user window (:mod:`aggregator.bucket_likelihood`: every fit under-counted mostly
    distinct users by 7%, and the intervals covered 19 of 40 windows), and its early-stopped EM
    takes the likelier of two starts. Over 120 hashed releases of 4 families (the issue's cell
    among them) the coverage was then 0.97 / 0.94 / 0.96 at 0.8 and 0.94 / 0.925 / 0.92 at 0.7.
    Leaving each family out, the lowest level covering 0.90 on the other three was 0.75, 0.7,
    0.7, 0.7 (held out 0.95 / 0.93 / 0.92), the level closest to 0.90 0.7, 0.7, 0.5, 0.6 (held
    out 0.88 / 0.87 / 0.85): 0.7 in 5 of the 8 folds (docs/accuracy_changes.md).
    Measured at 0.9 only; other levels take the same tail ratio.

    >>> internal_level(0.9), internal_level(0.9, "hashed")
    (0.8, 0.7)
    """
    ratio = TAIL_RATIO[mode]
    return round(max(1.0 - ratio * (1.0 - float(level)), 0.5), 6)


def estimate_with_accuracy(
    noisy_counts,
    p: float,
    *,
    layers: int,
    loss: str = "l1",
    n=None,
    buckets=None,
    reps: int = ERROR_BAR_REPS,
    level: float = 0.9,
    method: str | None = None,
    rng=None,
    _estimator=None,
):
    """The released histogram and its ``accuracy`` block, from the noisy counters only.

    Everything here is post-processing of the (already noised) counters and public quantities
    (n when public, the number of counters, p, layers): no privacy cost. The block holds

    * ``events_over_noise_floor``: n over the Cramer-Rao floor of the error on the number of
      items (:func:`aggregator.intervals.signal_to_noise`; n_in_histogram stands in when n is
      not public); without a bootstrap, ``signal_below_noise`` is that figure below
      :data:`aggregator.intervals.SNR_MIN` (the release is mostly noise, whatever it looks
      like) and ``signal_to_noise`` is the same figure;
    * with ``reps`` > 0 and loss ``"l1"``: parametric-bootstrap intervals at ``level``
      (:func:`aggregator.intervals.error_bars`): the l1 error bound of the histogram, the number
      of distinct items, the entropy, phi_r and phi_{>=r} for r = 1..:data:`PHI_BANDS`; and
      from the same bootstrap the expected and standard errors of distinct items and entropy,
      ``signal_to_noise`` as the distinct-items estimate over its expected error, and the 2x
      flag ``signal_below_noise``, true exactly when the distinct-items interval admits a 2x
      error (:func:`_add_expected_errors`). The bootstrap's randomness only touches released
      values; it is drawn fresh (OS entropy), not seeded. ``rng``: the bootstrap's generator
      instead, for :func:`planned_accuracy`'s synthetic windows only (a release passes none).
    """
    kw = dict(layers=layers, n=n, buckets=buckets, method=method)
    # what the release derives from these counters (auto's choice and pilot fits, the start
    # taken), handed to its error bars; it goes with this call
    memo = ReleaseMemo()
    try:
        # the release itself: exactly what the estimator gives on these counters (the one call
        # the privacy audits watch: tests/test_privacy_service.py)
        estimator = anonymized_histogram if _estimator is None else _estimator
        hist = np.asarray(estimator(noisy_counts, p, loss=loss, memo=memo, **kw), dtype=np.int64)
        vc = noisy_value_counts(noisy_counts)
        counters = int(vc.total)
        bars = None
        if reps and loss == "l1":  # (its stand-ins are the pilot fits auto kept: no refit)
            inner = internal_level(level, "hashed" if buckets is not None else "direct")
            bars = intervals.error_bars(
                vc, p, reps=int(reps), level=inner, release=hist, rng=rng, memo=memo, **kw
            )
    finally:
        # the big items' pmfs are kept across calls (keyed by their arguments): not past this
        # release either
        forget_pmfs()
    signal = n if n is not None else int(np.asarray(hist).sum())
    snr = intervals.signal_to_noise(signal, counters, p, layers) if counters else 0.0
    resolved = method or default_method("hashed" if buckets is not None else "direct", layers)
    accuracy = {
        "estimator": resolved if method else f"{resolved} (default)",
        "signal_to_noise": round(float(snr), 4),  # (replaced below when the bootstrap runs)
        "events_over_noise_floor": round(float(snr), 4),
        "signal_below_noise": bool(snr < intervals.SNR_MIN),
        "signal_basis": "n" if n is not None else "n_in_histogram",
        "noise_floor_items": round(intervals.noise_floor(counters, p, layers), 2)
        if counters
        else None,
    }
    if bars is None:
        accuracy["intervals"] = None
        accuracy["intervals_note"] = (
            "off (release.error_bar_reps = 0)"
            if not reps
            else "bootstrap intervals are computed for loss l1 only"
        )
        return hist, accuracy
    lo_c, hi_c = np.asarray(bars["phi_lower"]), np.asarray(bars["phi_upper"])
    r_max = min(PHI_BANDS, len(lo_c))
    if "phi_r_lower" in bars:  # bootstrapped phi_r itself
        lo_r = np.asarray(bars["phi_r_lower"])[:r_max]
        hi_r = np.asarray(bars["phi_r_upper"])[:r_max]
    else:  # phi_r = phi_{>=r} - phi_{>=r+1}: from the two cumulative bounds (conservative)
        nxt_lo = np.append(lo_c[1 : r_max + 1], 0.0)[:r_max]
        nxt_hi = np.append(hi_c[1 : r_max + 1], 0.0)[:r_max]
        lo_r = np.maximum(lo_c[:r_max] - nxt_hi, 0.0)
        hi_r = np.maximum(hi_c[:r_max] - nxt_lo, 0.0)
    iv = {
        "level": float(level),
        "internal_level": float(bars["level"]),
        "method": "parametric bootstrap (aggregator.intervals.error_bars)",
        "reps": int(bars["reps"]),
        "l1_error_bound": round(float(bars["l1_bound"]), 2),
        "relative_l1_error_bound": (
            round(float(bars["l1_bound"]) / max(int(n), 1), 6) if n is not None else None
        ),
        "distinct_items": [round(float(x), 2) for x in bars["distinct"]],
        "entropy_nats": [round(float(x), 6) for x in bars["entropy_nats"]],
        "phi_at_least": [
            [r + 1, round(float(lo_c[r]), 2), round(float(hi_c[r]), 2)] for r in range(r_max)
        ],
        "phi": [
            [r + 1, round(float(lo_r[r]), 2), round(float(hi_r[r]), 2)] for r in range(len(lo_r))
        ],
    }
    if "support_coverage_2n" in bars:
        iv["support_coverage_2n"] = [round(float(x), 4) for x in bars["support_coverage_2n"]]
    if "rank_bands" in bars:  # events held by the items of ranks first..last
        iv["rank_bands"] = [
            [int(a), int(b), round(float(lo), 2), round(float(hi), 2)]
            for a, b, lo, hi in bars["rank_bands"]
        ]
    accuracy["intervals"] = iv
    _add_expected_errors(accuracy, hist, bars, mode="hashed" if buckets is not None else "direct")
    return hist, accuracy


def _add_expected_errors(accuracy: dict, hist, bars: dict, mode: str = "direct") -> None:
    """The bootstrap's error figures for distinct items and entropy, and the flag.

    * ``standard_error``: :func:`aggregator.intervals.standard_errors` (how much another window
      of the same truth would move the release): the basis of the change test between windows
      (:mod:`aggregator.changes`).
    * ``expected_error`` / ``expected_relative_error``: :func:`aggregator.intervals.expected_errors`
      (the root-mean-square error to expect against the truth: the interval's half-width read
      as a normal's, with a factor per ``mode`` and statistic chosen held out by family),
      absolute and over the released value.
    * ``signal_to_noise``: the distinct-items estimate over its expected error (10: expect
      about +-10%), ``signal_to_noise_basis`` "bootstrap"; the earlier figure (events over the
      Cramer-Rao floor) stays as ``events_over_noise_floor``.
    * ``signal_below_noise``: true exactly when the distinct-items interval reaches below half
      or above twice the estimate (``distinct_could_be_off_2x``): at the interval's level the
      estimate could be off by 2x. Not also when the public events over the noise floor are
      below :data:`aggregator.intervals.SNR_MIN` (that figure stays as
      ``events_over_noise_floor``, and decides the flag only where no bootstrap runs): issue 51
      asked for one meaning, "the interval says a 2x error is plausible", where the two rules
      under one name had flagged windows 5 % off and not one 34 % off. An empty release whose
      interval reaches one item is flagged too.
    """
    iv = accuracy["intervals"]
    distinct = int(len(hist))
    ent = properties.entropy(hist)
    exp_err = intervals.expected_errors(bars, mode, level=iv.get("level", 0.9))
    se = intervals.standard_errors(bars)
    accuracy["standard_error"] = {
        "distinct_items": round(se["distinct"], 3),
        "entropy_nats": round(se["entropy"], 6),
    }
    accuracy["expected_error"] = {
        "distinct_items": round(exp_err["distinct"], 3),
        "entropy_nats": round(exp_err["entropy"], 6),
    }
    accuracy["expected_relative_error"] = {
        "distinct_items": round(exp_err["distinct"] / distinct, 4) if distinct else None,
        "entropy_nats": round(exp_err["entropy"] / ent, 4) if ent > 0 else None,
    }
    accuracy["signal_to_noise"] = (
        round(distinct / exp_err["distinct"], 4) if exp_err["distinct"] > 0 else None
    )
    accuracy["signal_to_noise_basis"] = "bootstrap"
    lo, hi = iv["distinct_items"]
    off_2x = distinct == 0 and hi >= 1 or lo < distinct / 2 or hi > 2 * distinct
    accuracy["distinct_could_be_off_2x"] = bool(off_2x)
    accuracy["signal_below_noise"] = bool(off_2x)


PLAN_SHAPES = {"zipf": "a Zipf(1.1) window", "distinct": "mostly distinct items"}


class PlanCancelled(Exception):
    """:func:`planned_accuracy` was asked to stop (its ``cancel`` returned True)."""


def planned_accuracy(
    counters: int,
    p: float,
    layers: int,
    n: int,
    *,
    hashed: bool,
    reps: int = ERROR_BAR_REPS,
    rng=None,
    cancel=None,
) -> dict:
    """The expected errors a release will state, before any data: the release's own code
    (:func:`estimate_with_accuracy`) on :data:`PLAN_WINDOWS` simulated windows of ``n`` events
    of each of two reference shapes (:data:`PLAN_SHAPES`): items Zipf(1.1) (direct mode: over
    the domain's ``counters`` items), and items drawn uniformly from 20 n ids (~98% seen once:
    users, sessions). Returns {shape: {"distinct_items", "entropy_nats" (the median expected
    relative errors of the simulated releases), "signal_below_noise" (in most of them)}}.
    One window's figure varies by up to 3x from window to window (a bootstrap of 10 draws, and
    ``auto`` choosing differently), hence the median.

    Public inputs only (counters, p, layers, n); the simulated events are synthetic, so their
    generator may be anything (``rng``: a numpy Generator or seed). None: a generator seeded by
    the configuration itself (:func:`_plan_seed`), so one configuration states the same figures
    in every process: the service's start line, a second aggregation and `panagg plan` in
    another shell agree (with fresh draws they differed by up to 3x, the spread of a median of
    3 simulated windows: `python -m bench.accuracy.changes --plan-spread`), and the result is kept
    for the configuration in this process. ``cancel``: a function asked before each simulated
    window; when it returns True, :class:`PlanCancelled` is raised (a service that stops
    before its plan is done does not wait for it). A real window
    of a similar shape states about the same figures (docs/accuracy_changes.md, "Expected errors").
    """
    key = (int(counters), float(p), int(layers), int(n), bool(hashed), int(reps))
    if rng is None and key in _PLANS:  # the same configuration again (a restart, a second
        return {k: dict(v) for k, v in _PLANS[key].items()}  # aggregation, `panagg plan`)
    out = _planned(
        counters,
        p,
        layers,
        n,
        hashed=hashed,
        reps=reps,
        rng=_plan_seed(key) if rng is None else rng,
        cancel=cancel,
    )
    if rng is None:
        _PLANS[key] = {k: dict(v) for k, v in out.items()}
    return out


_PLANS: dict = {}  # planned_accuracy's results per configuration (this process)


def _plan_seed(key: tuple) -> list[int]:
    """The plan's generator seed: the public configuration it simulates (counters, p, layers,
    n, hashed, reps), as integers. Synthetic windows only: no state and no privacy noise is
    drawn from it (those come from the OS CSPRNG)."""
    counters, p, layers, n, hashed, reps = key
    return [counters, round(p * 2**52), layers, n, int(hashed), reps]


PLAN_WINDOWS = 3  # simulated windows per shape; the plan states the median of their figures
#: the plan simulates windows of at most this many events: its cost (time and memory, drawn
#: beside the consume loop at every start) must not grow with window.size (10^8 events drew
#: 11 GB for 200 s, and a stop waited for it)
PLAN_MAX_EVENTS = 2_000_000


def _zipf_ids(rng, n: int, top: int | None) -> np.ndarray:
    """n draws of Zipf(1.1) ids; with ``top``, truncated to 1..top by rejection (the shape of a
    Zipf(1.1) window over a domain of ``top`` items, as in bench._data)."""
    ids = rng.zipf(1.1, n)
    if top is None:
        return ids
    ids = ids[ids <= top]
    while len(ids) < n:  # (at most about half rejected, for top >= 500)
        more = rng.zipf(1.1, 2 * (n - len(ids)) + 16)
        ids = np.concatenate([ids, more[more <= top]])
    return ids[:n]


def _planned(counters, p, layers, n, *, hashed, reps, rng, cancel=None) -> dict:
    rng = np.random.default_rng(rng)
    n = min(int(n), PLAN_MAX_EVENTS)
    out = {}
    for shape in PLAN_SHAPES:
        if n <= 0:
            out[shape] = {"distinct_items": None, "entropy_nats": None, "signal_below_noise": True}
            continue
        figures = []
        for _ in range(PLAN_WINDOWS):
            if cancel is not None and cancel():
                raise PlanCancelled("the plan was cancelled")
            if shape == "zipf":
                ids = _zipf_ids(rng, n, None if hashed else counters)
            else:  # 20 n ids (direct mode: at most the domain)
                ids = rng.integers(0, 20 * n if hashed else min(20 * n, counters), n)
            counts = np.unique(ids, return_counts=True)[1].astype(np.int64)
            if hashed:  # each id in a uniformly random bucket
                counts = np.bincount(
                    rng.integers(0, counters, len(counts)), weights=counts, minlength=counters
                ).astype(np.int64)
                counts = counts[counts > 0]
            vc = simulate_counts(rng, np.sort(counts), counters, p, layers)
            # (synthetic counters, not a view of any state: not through this module's
            # anonymized_histogram, the one call the privacy audits watch)
            _, acc = estimate_with_accuracy(
                vc,
                p,
                layers=layers,
                n=n,
                buckets=counters if hashed else None,
                reps=reps,
                rng=rng,
                _estimator=_anonymize.anonymized_histogram,
            )
            rel = acc.get("expected_relative_error") or {}
            figures.append(
                (rel.get("distinct_items"), rel.get("entropy_nats"), acc["signal_below_noise"])
            )

        def median(i):
            v = [f[i] for f in figures if f[i] is not None]
            return float(np.median(v)) if v else None

        out[shape] = {
            "distinct_items": median(0),
            "entropy_nats": median(1),
            # below the noise in most of the simulated windows
            "signal_below_noise": sum(f[2] for f in figures) * 2 > len(figures),
        }
    return out


def package_release(
    hist,
    *,
    window,
    n,
    epsilon: float,
    neighbor: str,
    model: str,
    extra: dict | None = None,
    accuracy: dict | None = None,
) -> dict:
    """The release document for an anonymized histogram (prevalence form plus properties).

    ``n`` is the public event count, or None where it is not public (add-remove states, the
    central model); it is only copied into the document. Nothing here is computed from it: the
    properties use n_hat, the total of the released histogram (post-processing).
    """
    hist = np.asarray(hist, dtype=np.int64)
    vals, phis = properties.prevalences(hist)
    n_hat = int(hist.sum())
    props = {
        "entropy_nats": properties.entropy(hist),
        "entropy_miller_madow_nats": properties.entropy(hist, correction="miller-madow"),
        "distinct_items": int(len(hist)),
        "support_coverage_2n": properties.support_coverage(hist, 2 * n_hat) if n_hat else 0.0,
    }
    release = {
        "format": "panagg.release",
        "version": 1,
        "window": window,
        "created_unix": time.time(),
        "n": n,
        "n_in_histogram": n_hat,
        "epsilon": epsilon,
        "neighbor": neighbor,
        "model": model,
    }
    release.update(extra or {})
    release["histogram"] = {
        "form": "prevalence",
        "pairs": [[int(r), int(c)] for r, c in zip(vals[::-1], phis[::-1])],
    }
    release["properties"] = props
    if accuracy is not None:
        # one field a consumer can test before trusting anything else in the document
        release["signal_below_noise"] = accuracy["signal_below_noise"]
        release["accuracy"] = accuracy
    if model == "central":  # a trusted curator's release: no pan-private window, no headline
        return release
    return {"headline": headline(release), **release}


def _utc(unix) -> str | None:
    if unix is None:
        return None
    when = _dt.datetime.fromtimestamp(float(unix), _dt.timezone.utc)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def stamp_window(release: dict) -> dict:
    """Set ``window_start`` and ``window_end`` (ISO 8601 UTC) from ``release["window_info"]``.

    Window ids are numbered per mode (one process counts 0, 1, 2 from its first window; a
    scale-out group numbers time windows by the epoch, ``start // window.size``), so ids alone
    do not order releases from different deployments. These two fields do, in every mode: the
    records' time for event-time windows, else the clock that opened and closed the window (a
    group's epoch-aligned bounds). Post-processing of public fields only (no privacy cost).
    Returns ``release``; a document without ``window_info`` (the central CLI) is left as is."""
    info = release.get("window_info")
    if not info:
        return release
    if info.get("event_start_unix") is not None:
        start, end = info.get("event_start_unix"), info.get("event_end_unix")
    else:
        start, end = info.get("started_unix"), info.get("ended_unix")
    release["window_start"] = _utc(start)
    release["window_end"] = _utc(end)
    return release


PRIVACY_UNIT = "event"
PRIVACY_UNIT_CONSEQUENCE = "a source that contributes g events is protected at g x eps"
#: where the privacy unit of each output is explained (event level here, user level for density)
PRIVACY_UNIT_DOC = "docs/privacy_unit.md"


def privacy_unit_clause() -> str:
    """The privacy unit in one clause, as ``panagg plan``, the start line and ``panagg status``
    say it: the same words as every release's ``headline`` (:data:`PRIVACY_UNIT`,
    :data:`PRIVACY_UNIT_CONSEQUENCE`).

    >>> privacy_unit_clause()[:60]
    'privacy unit: the event (a source that contributes g events '
    """
    return f"privacy unit: the {PRIVACY_UNIT} ({PRIVACY_UNIT_CONSEQUENCE}; {PRIVACY_UNIT_DOC})"


def headline(release: dict) -> dict:
    """The block a release document opens with: what a person reads first, copied from the
    detail below it (nothing new is computed, so it costs no privacy).

    Distinct items and entropy, each with its released value, its interval
    (``accuracy.intervals``, at ``interval_level``) and its expected relative error
    (``accuracy.expected_relative_error``); the release's ``signal_below_noise`` flag and
    ``signal_to_noise`` (the one figure the log names so); the privacy unit, eps, the window and
    n. A figure the release does not have (no intervals: ``release.error_bar_reps = 0``, loss
    l2, the Balcer-Cheu analyzer) is null.

    The privacy unit is one event: a window is eps-DP for neighbours that differ in one event
    (the service counts under replace-one, docs/privacy.md), so a source (user, device) that
    contributes g events to a window is protected at g x eps by group privacy, not at eps.
    """
    props = release.get("properties") or {}
    acc = release.get("accuracy") or {}
    iv = acc.get("intervals") or {}
    rel_err = acc.get("expected_relative_error") or {}

    def stat(key: str) -> dict:
        return {
            "value": props.get(key),
            "interval": iv.get(key),
            "expected_relative_error": rel_err.get(key),
        }

    out = {
        "distinct_items": stat("distinct_items"),
        "entropy_nats": stat("entropy_nats"),
        "interval_level": iv.get("level"),
        "signal_below_noise": release.get("signal_below_noise"),
        "signal_to_noise": acc.get("signal_to_noise"),
        "privacy_unit": PRIVACY_UNIT,
        "privacy_unit_consequence": PRIVACY_UNIT_CONSEQUENCE,
        "epsilon": release.get("epsilon"),
    }
    if release.get("delta") is not None:  # the shuffle model: (eps, delta)-DP
        out["delta"] = release["delta"]
    out.update(window=release.get("window"), n=release.get("n"))
    return out


def plot_rank_frequency(release: dict, path: Path | BinaryIO) -> None:
    """The release's PNG (:func:`release_figure`): the headline figures with their intervals in
    a box, the released histogram as a log-log rank-frequency curve with its interval band, and a
    legend.

    Uses matplotlib's object API (no pyplot global state) and draws under one process-wide lock:
    separate figures still share matplotlib's font objects and layout caches, so two threads
    drawing at once (one plot thread per aggregation) raise at random or corrupt the heap (seen
    as a SIGABRT in CI with two aggregations).
    """
    with _DRAWING:
        release_figure(release).savefig(path, format="png")


# matplotlib is not thread-safe even across separate Figure objects (its FreeType fonts are shared)
_DRAWING = threading.Lock()


def headline_lines(release: dict) -> list[str]:
    """The headline as text lines (the PNG's box; ``panagg demo`` prints the same figures):
    distinct items and entropy with their intervals and expected errors, the flag, then n, eps,
    the privacy unit and the signal-to-noise."""
    head = release.get("headline") or headline(release)
    level = head.get("interval_level")
    lvl = f"{100 * level:g}% " if level else ""

    def one(label: str, key: str, fmt: str, unit: str = "") -> str:
        s = head[key]
        if s["value"] is None:
            return f"{label}: ?"
        text = f"{label} {format(s['value'], fmt)}{unit}"
        if s["interval"]:
            lo, hi = s["interval"]
            text += f" ({lvl}interval {format(lo, fmt)}-{format(hi, fmt)})"
        if s["expected_relative_error"] is not None:
            text += f", expect +-{100 * s['expected_relative_error']:.1f}%"
        return text

    lines = [
        one("distinct items", "distinct_items", ",.0f"),
        one("entropy", "entropy_nats", ".3f", " nats"),
    ]
    if head.get("signal_below_noise"):
        lines.append("BELOW THE NOISE: distinct items could be off by 2x")
    n = release.get("n")
    n_text = f"n={n:,}" if n is not None else f"n_in_histogram={release.get('n_in_histogram'):,}"
    snr = head.get("signal_to_noise")
    eps = head.get("epsilon")
    lines.append(f"{n_text}, eps={eps:g} per {head['privacy_unit']}" if eps is not None else n_text)
    if snr is not None:
        lines[-1] += f", signal-to-noise {snr:.1f}"
    return lines


def release_figure(release: dict):
    """The release's figure (a matplotlib Figure, not yet saved; the caller holds
    :data:`_DRAWING`): in the style of ``panagg history --plot`` (:func:`aggregator.service.
    status.plot_history`: its size, grid, bands at alpha 0.25, small legend).

    * the released histogram as its rank-frequency curve (rank r item's released count, log-log);
    * its interval band where the release states one: over ranks first..last the curve scaled
      to both ends of the interval for the events those ranks hold (``accuracy.intervals.
      rank_bands``: 1, 2-10, 11-100, ...), and for counts 1..10 the interval of phi_{>=c}
      (``phi_at_least``: the rank at which the count falls to c);
    * a box with the headline (:func:`headline_lines`), and a legend.

    A release without an accuracy block (central, Balcer-Cheu) gets the curve and what it has.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 (imported on first use: the CLI starts without it)
    from matplotlib.figure import Figure  # noqa: PLC0415 (imported on first use: the CLI starts without it)

    pairs = release["histogram"]["pairs"]
    # (pairs run from the largest count down: the curve's ranks in order)
    counts = np.repeat([r for r, _ in pairs], [c for _, c in pairs]) if pairs else np.zeros(0)
    fig = Figure(figsize=(9, 5.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if len(counts):
        ax.loglog(
            np.arange(1, len(counts) + 1),
            counts,
            drawstyle="steps-post",
            label="released histogram (rank-frequency)",
        )
    iv = (release.get("accuracy") or {}).get("intervals") or {}
    level = iv.get("level")
    band = f"{100 * level:g}% interval" if level else "interval"
    labels = iter([band, None])
    for first, last, lo, hi in iv.get("rank_bands") or []:
        # the events of ranks first..last lie in [lo, hi]: the curve there, scaled to both ends
        seg = counts[first - 1 : min(last, len(counts))].astype(float)
        if len(seg) and seg.sum() > 0:
            x = np.arange(first, first + len(seg) + 1)
            scale = np.array([lo, hi]) / seg.sum()
            ax.fill_between(
                x,
                np.append(seg, seg[-1]) * scale[0],
                np.append(seg, seg[-1]) * scale[1],
                step="post",
                color="C0",
                alpha=0.25,
                lw=0,
                label=next(labels, None),
            )
    tail = iv.get("phi_at_least") or []
    if tail:  # the rank at which the count falls to c lies in phi_{>=c}'s interval
        ax.fill_betweenx(
            [row[0] for row in tail],
            [max(row[1], 1.0) for row in tail],
            [max(row[2], 1.0) for row in tail],
            step="post",
            color="C0",
            alpha=0.25,
            lw=0,
            label=next(labels, None),
        )
    ax.set_xlabel("rank")
    ax.set_ylabel("count")
    ax.set_title(f"window {release['window']}: {release['model']} release", fontsize="medium")
    ax.grid(True, which="both", alpha=0.3)
    ax.text(
        0.02,
        0.03,
        "\n".join(headline_lines(release)),
        transform=ax.transAxes,
        ha="left",
        va="bottom",
        fontsize="small",
        bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.9, "edgecolor": "0.6"},
    )
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    return fig


class ReleaseExists(FileExistsError):
    """A different release document already has this file name (another run wrote it)."""


def write_release(release: dict, outdir: str | os.PathLike, *, plot: bool = True) -> Path:
    """Write ``release-<window>.json`` and, unless ``plot=False``, its PNG plot
    (:func:`plot_release`) into ``outdir``.

    Never overwrites another release: the same document again (a re-publish after a crash) is a
    no-op; a different one under the same name raises :class:`ReleaseExists`.
    """
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / f"release-{release['window']}.json"
    data = json.dumps(release, indent=1, allow_nan=False).encode() + b"\n"
    if not _create_once(path, data):
        if path.read_bytes() != data:
            raise ReleaseExists(
                errno.EEXIST,
                "a different release is already in this file "
                "(another run or state directory wrote it); publish to a new "
                "release directory or release name",
                str(path),
            )
        if path.with_suffix(".png").exists():
            return path
    if plot:
        plot_release(release, outdir)
    return path


def _create_once(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` atomically and durably unless ``path`` exists (False then):
    the temp file is hard-linked to the final name, which fails rather than replaces."""
    return atomic_write(path, data, mode=PUBLIC_MODE, exclusive=True)


def plot_release(release: dict, outdir: str | os.PathLike) -> Path:
    """The PNG rank-frequency plot ``release-<window>.png`` next to the release JSON."""
    path = Path(outdir) / f"release-{release['window']}.png"
    png = io.BytesIO()
    plot_rank_frequency(release, png)
    atomic_write(path, png.getvalue(), mode=PUBLIC_MODE)  # public, like the JSON
    return path
