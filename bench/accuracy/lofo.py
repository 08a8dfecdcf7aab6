"""The default estimator chosen out of sample: leave-one-family-out (LOFO) selection (issue 28).

The grid (bench/accuracy/grid.py) chose each default by its worst case over the very cells it is
then judged on. Here each *family* of cells is held out in turn: a synthetic item distribution, a
source of real frequency profiles (wordfreq, pyspellchecker, symspellpy, and three sources the
grid never used: jieba, autocorrect, Python identifiers; ``bench._data.NEW_REAL``), or a hashed
item model. A selection *procedure* (the candidate with the lowest worst-case / geometric-mean /
90th-percentile regret) picks a candidate on the other families' cells; the held-out family's
regrets of that pick are its score. The figures are per family and over all held-out cells.

Candidates: every (method, cap) of :data:`METHODS` x (items, scale), all on the same noisy
counters per repetition (bench.accuracy.grid.run_cell: the same pairing as the grid).

Usage (results accumulate in out/lofo_results.<shard>.pkl; shards run in parallel)::

    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python -m bench.accuracy.lofo --run --shard 0/2
    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python -m bench.accuracy.lofo --run --shard 1/2
    .venv/bin/python -m bench.accuracy.lofo --report        # prints the tables (markdown)

``--extra blend,auto_blend,auto_sims8,auto_pilot3,auto_fitted,em_likelier,auto_likelier`` (and
the others of :data:`EXTRA`, e.g. ``auto_item_space``, ``auto_pilot_shrunk``; with ``--run`` and
``--report``) adds candidates that were tried for the worst held-out cells and not adopted.

Issue 51's choice: ``--extra xfit,auto_xfit,auto_flag`` runs the library's ``xfit`` (the EM
stopped by cross-fitting, with n; on the buckets in hashed mode), ``auto`` with ``xfit`` among
its candidates, and the flag-driven fallback (the NPMLE when the default release raises its own
``signal_below_noise``, else ``auto``); ``--choice`` reports them per family in all, flagged and
unflagged windows (docs/estimators.md, "The choice held out"). ``--max-counters N --keep DIST``
leaves the larger direct cells out of a run that must fit the time.

Benchmark only: seeded numpy noise (bench.accuracy.grid.draw).
"""

from __future__ import annotations

import contextlib
import functools
import math
import pickle
import sys
import time
from pathlib import Path

import numpy as np

from . import grid
from .._data import NEW_REAL, real_profile
from ..harness import parse_shard, parser, shard_arg
from .grid import Cell

METHODS = ("threshold", "deconvolution", "mle", "auto")
CAPS = ("items", "scale")
CANDIDATES = tuple((m, c) for m in METHODS for c in CAPS)
LAYERS = (1, 2)
EPS_CYCLE = (0.5, 1.0, 2.0)
REAL_PICK = ("wf-en", "wf-ja", "sc-es", "sc-ru", "ss-en") + NEW_REAL
SYNTH_SIZES = ((10**4, 10**3), (10**5, 10**4), (10**5, 10**5), (10**6, 10**5))
HASHED_N = (10**3, 3 * 10**3, 10**4, 3 * 10**4, 10**5)
REPS = 4  # repetitions per cell (each: one draw of the items, one of the noise per layer count)
OUT = Path("out/lofo_results.pkl")
MODES_RUN = ["direct", "hashed"]  # --mode narrows it


# --------------------------------------------------------------------------------------------
# candidates tried for the worst held-out cells and not adopted (docs/accuracy_grid.md, "Four
# more candidates for the worst cells"); ``--extra`` runs them beside the library's
# --------------------------------------------------------------------------------------------
def _mean_fit(a, b):
    """The projected mean of two cumulative prevalences (zero-padded to one length)."""
    from aggregator.estimate import project_l1

    L = max(len(a), len(b))
    pad = lambda y: np.concatenate([np.asarray(y, np.float64), np.zeros(L - len(y))])  # noqa: E731
    return project_l1((pad(a) + pad(b)) / 2)


def _blend(mode, vc, p, k, n, B):
    """The mean of the early-stopped EM's and the converged NPMLE's fits: under l1, never worse
    than the mean of their two errors."""
    return _mean_fit(
        grid.estimate_y(mode, vc, p, k, "deconvolution", n, B),
        grid.estimate_y(mode, vc, p, k, "mle", n, B),
    )


def _knowing_blend(plain):
    """``selection._estimates`` that also gives the blend (asked for, or whenever both of its
    parts are computed: ``_select`` takes its release from the pilots' fits)."""

    def estimates(vc, p, k, methods, **kw):
        base = [m for m in methods if m != "blend"]
        if "blend" in methods:
            base = list(dict.fromkeys(base + ["deconvolution", "mle"]))
        out = plain(vc, p, k, base, **kw)
        if "deconvolution" in out and "mle" in out:
            out["blend"] = _mean_fit(out["deconvolution"], out["mle"])
        return out

    return estimates


@contextlib.contextmanager
def _auto_estimates(estimates):
    """``auto`` (``selection``) fitting the real counters and its simulated states with
    ``estimates`` (a stand-in for ``selection._estimates``, one counter set at a time; the
    library fits the simulated states in one batch, ``selection._estimates_many``), and without
    the library's choice of the early-stopped EM's start (``selection.START_MARGIN``): these
    variants were measured against ``auto`` before it, and ``_auto_with_em`` brings its own."""
    from aggregator import selection

    plain, plain_many = selection._estimates, selection._estimates_many
    margin = selection.START_MARGIN
    selection._estimates = estimates
    selection._estimates_many = lambda vcs, p, k, methods, n=None, **kw: [
        estimates(v, p, k, methods, **kw) for v in vcs
    ]
    selection.START_MARGIN = math.inf
    try:
        yield
    finally:
        selection._estimates, selection._estimates_many = plain, plain_many
        selection.START_MARGIN = margin


def _auto_smoothed(mode, vc, p, k, n, B):
    """``auto`` as it was before the early-stopped EM chose its start by the likelihood
    (``selection.START_MARGIN``, direct mode at 1 layer): the smoothed start only."""
    from aggregator import selection

    margin, selection.START_MARGIN = selection.START_MARGIN, math.inf
    try:
        return grid.estimate_y(mode, vc, p, k, "auto", n, B)
    finally:
        selection.START_MARGIN = margin


def _auto_blend(mode, vc, p, k, n, B):
    """``auto`` with the blend among its candidates (direct mode): the minimax over the two
    stand-ins favours a compromise, if any candidate is one."""
    from aggregator import selection
    from aggregator.estimate import project_l1

    with _auto_estimates(_knowing_blend(selection._estimates)):
        y, _ = selection.select(
            vc,
            p,
            layers=k,
            n=n,
            candidates=selection.CANDIDATES + (("blend", "items"), ("blend", "scale")),
        )
    return project_l1(y.astype(np.float64))


def _auto_pilot3(mode, vc, p, k, n, B):
    """``auto`` with the blend as a third stand-in truth (both modes): a stand-in between the
    smooth and the spiky one, nearer the truth where the two err in opposite directions."""
    from aggregator import selection

    kw = selection.select.__kwdefaults__
    old = kw["pilots"]
    kw["pilots"] = tuple(old) + ("blend",)
    try:
        with _auto_estimates(_knowing_blend(selection._estimates)):
            return grid.estimate_y(mode, vc, p, k, "auto", n, B)
    finally:
        kw["pilots"] = old


def _auto_sims8(mode, vc, p, k, n, B):
    """``auto`` with 8 bootstrap draws per stand-in instead of :data:`selection.SIMS` (4): is
    the worst case the choice's lottery?"""
    from aggregator import selection

    kw = selection.select.__kwdefaults__
    old, kw["sims"] = kw["sims"], 8
    try:
        return grid.estimate_y(mode, vc, p, k, "auto", n, B)
    finally:
        kw["sims"] = old


def _auto_fitted(mode, vc, p, k, n, B):
    """``auto`` whose thinning cap keeps the items the EM passed through (cap ``"fitted"``,
    bench/accuracy/fitted_cap.py) instead of thinning every level (``"scale"``), for its candidates
    and
    its stand-ins (direct mode): in the heavy-hitter family the EM stand-in thinned to n by
    ``scale`` also thins the heavy hitters, and the EM's own error there halves with ``fitted``."""
    from aggregator import selection
    from aggregator.estimate import project_l1

    from .fitted_cap import auto_fitted

    cands = tuple((m, "fitted" if c == "scale" else c) for m, c in selection.CANDIDATES)
    with auto_fitted():
        y, _ = selection.select(vc, p, layers=k, n=n, candidates=cands)
    return project_l1(y.astype(np.float64))


def _auto_item_space(mode, vc, p, k, n, B):
    """``auto`` in hashed mode judging its candidates where the release is made (hashed mode
    only): the library's ``auto`` ranks the candidates by their l1 error on the *bucket*
    histogram, and the release is the *item* histogram inverted from it (``largedomain._invert``)
    and capped at n by ``items``. Here each stand-in and each candidate's fit of each simulated
    state are inverted and capped as the release is, and the minimax regret is taken on those
    item histograms; the stand-ins (the pilots' bucket fits), the number of states and the seed
    are the library's."""
    from aggregator import counter_model, largedomain as ld, selection
    from aggregator.estimate import _data_seed, cap_total, cumulative_l1

    def released(psi, counters):  # a bucket fit as the release makes it: inverted, capped at n
        y = ld._invert(
            psi, B, n, p, ld.DEFAULT_VARIANT, None, sparse_above=ld.sparse_top(counters, p, k)
        )
        return cap_total(y, int(n), "items")

    from aggregator.estimate import threshold_usable

    methods = tuple(
        m
        for m in dict.fromkeys(m for m, _ in selection.CANDIDATES)
        if m != "threshold" or threshold_usable(p, k)
    )
    fits = selection._estimates(vc, p, k, list(methods), hashed=True)
    rng = np.random.default_rng(_data_seed(vc))
    regret = {m: [] for m in methods}
    for pm in selection.PILOTS:
        y_p = fits[pm]
        truth = released(y_p, vc)
        states = [
            counter_model.simulate_from_cumulative(rng, y_p, B, p, k) for _ in range(selection.SIMS)
        ]
        err = {m: 0.0 for m in methods}
        for sim, ests in zip(states, selection._estimates_many(states, p, k, methods, hashed=True)):
            for m in methods:
                err[m] += cumulative_l1(released(ests[m], sim), truth)
        for m, r in selection._regrets(err).items():
            regret[m].append(r)
    return grid.estimate_y(mode, vc, p, k, selection._minimax(regret), n, B)


def _auto_pilot_shrunk(mode, vc, p, k, n, B):
    """``auto`` with the early-stopped EM's fit from the shrunk start as a third stand-in truth
    (direct mode, n <= D, any layer count), when the counters' likelihood does not rule it out:
    within ``selection.START_MARGIN`` of the smoothed start's fit, both capped at n by
    ``items``. In the heavy family at 2 layers the two starts are within a nat or two, the
    shrunk one is shaped like the truth (heavy hitters and singletons, no tail at r = 2-15),
    and ``auto`` took the smoothed start's EM in half the windows at 2-3x the NPMLE's error:
    a stand-in shaped like the truth should make that candidate's worst regret show it."""
    from aggregator import selection
    from aggregator.estimate import project_l1

    if n is None or int(n) > vc.total:
        return grid.estimate_y(mode, vc, p, k, "auto", n, B)
    plain = selection._estimates
    shrunk = selection._shrunk_fit(vc, p, k)
    smooth = plain(vc, p, k, ["deconvolution", "mle"])["deconvolution"]

    # ruled out unless likelier than the smoothed start's fit by more than -START_MARGIN
    plausible, _ = selection._take_likelier_start(
        vc, p, k, n, {"deconvolution": smooth}, shrunk, margin=-selection.START_MARGIN
    )
    if not plausible:
        return grid.estimate_y(mode, vc, p, k, "auto", n, B)

    def estimates(vc_, p_, k_, methods, **kw):
        base = [m for m in methods if m != "shrunk"]
        out = plain(vc_, p_, k_, base, **kw)
        if "shrunk" in methods:
            out["shrunk"] = shrunk
        return out

    selection._estimates = estimates
    try:
        y, _ = selection.select(vc, p, layers=k, n=n, pilots=selection.PILOTS + ("shrunk",))
        return project_l1(y.astype(np.float64))
    finally:
        selection._estimates = plain


def _held_to_n(vc, p, k, n, early):
    """The early-stopped EM's fit ``early``, or, when its total exceeds n, the early-stopped EM
    refit with its axis' mean count held to what n leaves (``deconvolved_prevalence(n=...)``:
    the M-step under sum_h h pi_h = mu). The truth's total is exactly n, so a surplus is a misfit
    the fit itself can avoid, where a cap can only remove items or thin levels afterwards; a
    deficit is left alone (held to n, a deficit moves mass into the heaviest counts)."""
    from aggregator.estimate import deconvolved_prevalence, project_l1

    if n is None or float(np.sum(early)) <= n:
        return early
    return project_l1(deconvolved_prevalence(vc, p, layers=k, n=n))


def _em_held(mode, vc, p, k, n, B):
    """The early-stopped EM, refit under the mean constraint when its total exceeds n (direct
    mode)."""
    return _held_to_n(vc, p, k, n, grid.estimate_y(mode, vc, p, k, "deconvolution", n, B))


def _auto_em_held(mode, vc, p, k, n, B):
    """``auto`` whose early-stopped EM (candidate and stand-in) is :func:`_em_held`'s."""
    return _auto_with_em(mode, vc, p, k, n, B, _held_to_n)


def _auto_with_em(mode, vc, p, k, n, B, em):
    """``auto`` whose early-stopped EM (candidate and stand-in, on the counters and on every
    simulated state) is ``em(vc, p, k, n, the library's early-stopped EM fit)``."""
    from aggregator import selection

    plain = selection._estimates

    def estimates(vc_, p_, k_, methods, **kw):
        out = plain(vc_, p_, k_, methods, **kw)
        if "deconvolution" in out:
            out["deconvolution"] = em(vc_, p_, k_, n, out["deconvolution"])
        return out

    with _auto_estimates(estimates):
        return grid.estimate_y(mode, vc, p, k, "auto", n, B)


def _shrunk_em(vc, p, k):
    """The early-stopped EM from the shrunk start (the zero cluster's noisy values pulled to
    their true mean and variance), ``estimate.DIRECT_START_SMOOTH_SHARE`` (1e-4) of the
    smoothed start mixed in: the library's second start (``selection._shrunk_fit``). Measured
    here first, with the share set apart from hashed mode's ``estimate.START_SMOOTH_SHARE`` =
    0.05, which at D = 1e6 counters is 50,000 counters' worth of the over-dispersed start: the
    very tail the heavy family's error sits in."""
    from aggregator import selection
    from aggregator.estimate import noisy_value_counts

    return selection._shrunk_fit(noisy_value_counts(vc), p, k)


def _likelier_em(vc, p, k, n, early, margin=0.0):
    """The early-stopped EM's fit ``early`` (smoothed start) or the one from the shrunk start
    (:func:`_shrunk_em`), whichever the counters' likelihood prefers by more than ``margin``,
    both capped at n by ``items`` (``selection._take_likelier_start``, the rule the library
    applies with its own margin; hashed mode compares its two starts on its bucket counters,
    ``largedomain._likelier_start``). The early stop keeps the fit near its start: the smoothed
    start leaves a tail at r = 2-15 where the heavy family has none, the shrunk one keeps too
    little spread for Zipf(0.7) and Zipf(1.5) (docs/accuracy_grid.md, "The EM's start chosen by
    the likelihood")."""
    from aggregator import selection
    from aggregator.estimate import noisy_value_counts

    vc = noisy_value_counts(vc)
    fits = {"deconvolution": early}
    selection._take_likelier_start(vc, p, k, n, fits, _shrunk_em(vc, p, k), margin=margin)
    return fits["deconvolution"]


#: :func:`_likelier_em_sparse`'s margin: Wilks' chi2_1(0.9) / 2, the drop the intervals use
WILKS_90 = 1.3527
WILKS_99 = 3.3174  # chi2_1(0.99) / 2


def _likelier_em_sparse(vc, p, k, n, early, margin=WILKS_90):
    """:func:`_likelier_em` only where the shrunk start was built for, a window whose counters
    are mostly empty (n <= the number of counters, so the cluster holding 0 is the bulk of
    them), and only when the shrunk start's fit is likelier by more than ``margin`` (Wilks'
    90% drop unless given).
    Why both: on the accuracy grid the plain rule lost where the likelihood preferred the
    shrunk start by less than a nat (sc-fa, sc-es) and in dense windows (n = 100 D), where one
    linear map distorts the whole histogram and the likelihood still prefers it (by 4-21
    nats)."""
    from aggregator.estimate import noisy_value_counts

    vc = noisy_value_counts(vc)
    if n is None or n > vc.total:
        return early
    return _likelier_em(vc, p, k, n, early, margin=margin)


def _auto_likelier_m(mode, vc, p, k, n, B):
    """``auto`` whose early-stopped EM is :func:`_likelier_em_sparse`'s."""
    return _auto_with_em(mode, vc, p, k, n, B, _likelier_em_sparse)


def _auto_likelier_m99(mode, vc, p, k, n, B):
    """:func:`_auto_likelier_m` with the margin at Wilks' 99% drop, chi2_1(0.99) / 2 = 3.32
    nats: the 90% one let one Zipf(0.7) window in 16 take the shrunk start at +2.0 nats with 3x
    the error (docs/accuracy_grid.md)."""
    return _auto_with_em(
        mode, vc, p, k, n, B, functools.partial(_likelier_em_sparse, margin=WILKS_99)
    )


def _em_likelier(mode, vc, p, k, n, B):
    """The early-stopped EM from the likelier of its two starts (direct mode)."""
    return _likelier_em(vc, p, k, n, grid.estimate_y(mode, vc, p, k, "deconvolution", n, B))


def _auto_likelier(mode, vc, p, k, n, B):
    """``auto`` whose early-stopped EM is :func:`_em_likelier`'s."""
    return _auto_with_em(mode, vc, p, k, n, B, _likelier_em)


def _auto_simpler_start(mode, vc, p, k, n, B):
    """``auto`` whose early-stopped EM, at 2 layers too, chooses between its two starts in mostly
    empty windows (n <= the number of counters) the other way round: the shrunk start's fit
    unless the smoothed start's is likelier by more than ``selection.START_MARGIN``. At 2 layers
    the counters cannot tell the starts' fits apart in the heavy cell (within -1.6 to +2.5 nats),
    and where they cannot, the fit with less mass in the noise (the shrunk start's) is kept; the
    Zipf(0.7) cell's smoothed fit is 4.8-8.9 nats likelier and stays. 1 layer: the library's
    rule (the shrunk start only when likelier by the margin)."""
    from aggregator import selection

    plain_two, margin = selection._two_starts, selection.START_MARGIN
    if k == 2:  # the library's condition as at 1 layer
        selection._two_starts = lambda vc_, k_, n_, **kw: plain_two(vc_, 1, n_, **kw)
        selection.START_MARGIN = -margin
    try:
        return grid.estimate_y(mode, vc, p, k, "auto", n, B)
    finally:
        selection._two_starts, selection.START_MARGIN = plain_two, margin


def _xfit(mode, vc, p, k, n, B):
    """The library's ``xfit`` (the EM stopped by cross-fitting, fitting under the public n in
    every M-step), both modes: in hashed mode on the bucket counters, whose totals sum to n,
    then inverted as every hashed estimator is (``largedomain.hashed_histogram``)."""
    return grid.estimate_y(mode, vc, p, k, "xfit", n, B)


@contextlib.contextmanager
def _with_xfit(n):
    """``auto`` (``selection.select``) with ``xfit`` among its candidates, with both cap rules
    (issue 51: "put every estimator the library has into the choice"). ``selection`` fits the
    candidates that are not pilots through ``basic_prevalence``, on the real counters and on
    every simulated state: here that name also knows ``xfit``, given ``n`` (the window's public
    n in direct mode, where the stand-ins are capped at n; None in hashed mode, where ``auto``
    runs without n, ``largedomain.hashed_phi_estimate``)."""
    from aggregator import selection
    from aggregator.crossfit import crossfit_prevalence

    plain = selection.basic_prevalence

    def basic(vc_, p_, *, layers=1, method="deconvolution", hashed=False):
        if method == "xfit":
            return crossfit_prevalence(vc_, p_, layers=layers, n=n)
        return plain(vc_, p_, layers=layers, method=method, hashed=hashed)

    kw = selection.select.__kwdefaults__
    old = kw["candidates"]
    kw["candidates"] = tuple(old) + (("xfit", "items"), ("xfit", "scale"))
    selection.basic_prevalence = basic
    try:
        yield
    finally:
        selection.basic_prevalence = plain
        kw["candidates"] = old


def _auto_xfit(mode, vc, p, k, n, B):
    """``auto`` with ``xfit`` (items and scale caps) among its candidates (:func:`_with_xfit`),
    both modes."""
    with _with_xfit(n if mode == "direct" else None):
        return grid.estimate_y(mode, vc, p, k, "auto", n, B)


FLAG_LOG: list = []  # (layers, the release's signal_below_noise) per auto_flag call, in order


def _flagged(mode, vc, p, k, n, B) -> bool:
    """The default release's own ``signal_below_noise`` (the public SNR below
    ``intervals.SNR_MIN`` or the distinct-items interval reaching 2x off), as
    ``release.estimate_with_accuracy`` computes it (its bootstrap seeded here: a benchmark)."""
    from aggregator.release import estimate_with_accuracy

    _, acc = estimate_with_accuracy(
        vc,
        p,
        layers=k,
        n=n,
        buckets=B if mode == "hashed" else None,
        rng=np.random.default_rng([20261129, k]),
    )
    return bool(acc["signal_below_noise"])


def _auto_flag(mode, vc, p, k, n, B):
    """The flag-driven fallback (issue 51): the converged NPMLE (``mle``) when the default
    release's own ``signal_below_noise`` flag is raised, else ``auto``; the flag is a function
    of the counters and public quantities (post-processing, no privacy cost). Logs the flag
    (:data:`FLAG_LOG`) so the report can split flagged from unflagged windows."""
    flag = _flagged(mode, vc, p, k, n, B)
    FLAG_LOG.append((k, flag))
    return grid.estimate_y(mode, vc, p, k, "mle" if flag else "auto", n, B)


#: name: (modes, estimator); each returns the uncapped projected phi_{>=r} as grid.estimate_y
EXTRA = {
    "em_held": (("direct",), _em_held),
    "auto_em_held": (("direct",), _auto_em_held),
    "blend": (("direct", "hashed"), _blend),
    "auto_blend": (("direct",), _auto_blend),
    "auto_sims8": (("direct", "hashed"), _auto_sims8),
    "auto_pilot3": (("direct", "hashed"), _auto_pilot3),
    "auto_fitted": (("direct",), _auto_fitted),
    "em_likelier": (("direct",), _em_likelier),
    "auto_likelier": (("direct",), _auto_likelier),
    "auto_likelier_m": (("direct",), _auto_likelier_m),
    "auto_likelier_m99": (("direct",), _auto_likelier_m99),
    "auto_smoothed": (("direct",), _auto_smoothed),
    "auto_item_space": (("hashed",), _auto_item_space),
    "auto_pilot_shrunk": (("direct",), _auto_pilot_shrunk),
    "auto_simpler_start": (("direct",), _auto_simpler_start),
    "xfit": (("direct", "hashed"), _xfit),
    "auto_xfit": (("direct", "hashed"), _auto_xfit),
    "auto_flag": (("direct", "hashed"), _auto_flag),
}
EXTRA_RUN: list = []  # --extra


def _estimate_y(mode, vc, p, k, method, n, B):
    if method in EXTRA:
        return EXTRA[method][1](mode, vc, p, k, n, B)
    return grid.estimate_y(mode, vc, p, k, method, n, B)


def family(cell: Cell) -> str:
    """The family a cell belongs to: a real profile's source (``wf``, ``sc``, ...), else the
    item distribution (hashed ones prefixed)."""
    if cell.mode == "hashed":
        return f"hashed:{cell.dist.split('-')[0] if '-' in cell.dist else cell.dist}"
    if "-" in cell.dist and cell.dist.split("-")[0] in ("wf", "sc", "ss", "jb", "ac", "py"):
        return cell.dist.split("-")[0]
    return cell.dist


CELL_SET: list = []  # --grid-hashed / --hashed-real: other cells than these


def cells() -> list[Cell]:
    if CELL_SET == ["smoke"]:  # two families per mode, held out in turn
        return [
            Cell("direct", "zipf", 1_000, 300, 1.0, REPS),
            Cell("direct", "uniform", 1_000, 300, 1.0, REPS),
            Cell("hashed", "zipf", 300, None, 1.0, REPS),
            Cell("hashed", "distinct", 300, None, 1.0, REPS),
        ]
    if CELL_SET == ["grid-hashed"]:  # an out-of-sample check of a hashed pick: n to 1e7
        return [c for c in grid.grid_cells() if c.mode == "hashed"]
    if CELL_SET == ["hashed-real"]:  # the real profiles' vocabularies as hashed items
        out = []
        for j, name in enumerate(REAL_PICK):
            D = len(real_profile(name))
            for i, n in enumerate((D // 10, D, 10 * D)):
                out.append(Cell("hashed", name, n, None, EPS_CYCLE[(i + j) % 3], REPS))
        return out
    out, j = [], 0
    for dist in grid.DIRECT_DISTS:
        for D, n in SYNTH_SIZES:
            out.append(Cell("direct", dist, n, D, EPS_CYCLE[j % 3], REPS))
            j += 1
    for name in REAL_PICK:  # the held-out check: n = D / 10, D, 10 D
        D = len(real_profile(name))
        for i, n in enumerate((D // 10, D, 10 * D)):
            out.append(Cell("direct", name, n, D, EPS_CYCLE[(i + j) % 3], REPS))
        j += 1
    for dist in grid.HASHED_DISTS:
        for n in HASHED_N:
            out.append(Cell("hashed", dist, n, None, EPS_CYCLE[j % 3], REPS))
            j += 1
    return out


def load(directory: Path | None = None) -> dict:
    """Every shard's results (one file per shard: no two processes write the same file), in
    ``directory`` (default: --out's)."""
    out = {}
    for path in sorted((directory or OUT.parent).glob(OUT.stem + "*.pkl")):
        out.update(pickle.loads(path.read_bytes()))
    return out


def _save(shard: int, key, res) -> None:
    """Add one cell's result to this shard's file (written whole, then renamed into place)."""
    mine = OUT.with_name(f"{OUT.stem}.{shard}.pkl")
    done = pickle.loads(mine.read_bytes()) if mine.exists() else {}
    done[key] = res
    tmp = mine.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(done))
    tmp.replace(mine)


FIRST_REP = 0  # --first-rep: the index of the first repetition drawn


MAX_COUNTERS: list = []  # --max-counters N [--keep DIST ...]: [N, {DIST, ...}]


def _kept(c: Cell) -> bool:
    """Whether ``--max-counters`` keeps the cell: hashed cells, direct cells of at most N
    counters, and the direct cells of a ``--keep`` distribution whatever their size."""
    if not MAX_COUNTERS or c.mode != "direct":
        return True
    limit, keep = MAX_COUNTERS
    return c.counters <= limit or c.dist in keep


def run(shard: tuple[int, int]) -> None:
    i, k = shard
    todo = [c for idx, c in enumerate(cells()) if idx % k == i and c.mode in MODES_RUN and _kept(c)]
    for c in todo:
        if c.key in load():
            continue
        t = time.time()
        methods = METHODS + tuple(m for m in EXTRA_RUN if c.mode in EXTRA[m][0])
        FLAG_LOG.clear()
        res = grid.run_cell(
            c,
            layers=LAYERS,
            methods=methods,
            estimate=_estimate_y,
            reps=range(FIRST_REP, FIRST_REP + c.reps),
        )
        if FLAG_LOG:  # auto_flag ran: each (layers, repetition)'s signal_below_noise
            res.flags = {k: [f for kk, f in FLAG_LOG if kk == k] for k in LAYERS}
        _save(i, c.key, res)
        print(f"{c.mode} {c.dist} n={c.n} D={c.D} eps={c.eps}: {time.time() - t:.1f} s", flush=True)


def add_extras(base: Path, shard: tuple[int, int]) -> None:
    """Only the ``--extra`` candidates, on the cells and repetitions stored in ``base`` (another
    run's results directory, e.g. out/lofo_reps16), merged into a copy of them under --out: the
    library's candidates are not run again (the same seeds draw the same counters)."""
    i, k = shard
    done = load()
    for idx, (key, res) in enumerate(sorted(load(base).items(), key=lambda kv: str(kv[0]))):
        if idx % k != i or res.cell.mode not in MODES_RUN or key in done:
            continue
        t = time.time()
        extras = tuple(m for m in EXTRA_RUN if res.cell.mode in EXTRA[m][0])
        layers = sorted({key_[0] for key_ in res.l1})
        more = grid.run_cell(
            res.cell,
            layers=layers,
            methods=extras,
            estimate=_estimate_y,
            reps=range(len(res.items)),
        )
        for name in ("l1", "seconds", "total"):
            getattr(res, name).update(getattr(more, name))
        _save(i, key, res)
        print(
            f"{res.cell.mode} {res.cell.dist} n={res.cell.n} D={res.cell.D} eps={res.cell.eps}"
            f" x {len(res.items)}: {time.time() - t:.1f} s",
            flush=True,
        )


def regret_table(results: dict, mode: str, layers: int, at=None):
    """{cell key: {candidate: regret}} and {cell key: family} for one mode and layer count (the
    candidates of :data:`CANDIDATES` that every cell of the mode has: an ``--extra`` one may
    exist in one mode only). ``at``: the repetitions to read (an index or slice, or a callable
    giving each cell's own from its key); None: all of them."""
    reg, fam = {}, {}
    mine = [res for key, res in results.items() if key[0] == mode]
    cands = [c for c in CANDIDATES if all((layers, *c) in res.l1 for res in mine)]
    for key, res in results.items():
        if key[0] != mode:
            continue
        idx = slice(None) if at is None else at(key) if callable(at) else at
        e = {cand: float(np.mean(np.asarray(res.l1[(layers, *cand)])[idx])) for cand in cands}
        best = min(e.values())
        reg[key] = {
            cand: (v / best if best > 0 else (1.0 if v == 0 else math.inf)) for cand, v in e.items()
        }
        fam[key] = family(res.cell)
    return reg, fam


CRITERIA = {
    "worst": lambda r: float(np.max(r)),
    "geo-mean": lambda r: float(np.exp(np.mean(np.log(r)))),
    "p90": lambda r: float(np.quantile(r, 0.9)),
}


def pick(reg: dict, keys, criterion: str):
    cands = list(next(iter(reg.values())))
    score = {c: CRITERIA[criterion]([reg[k][c] for k in keys]) for c in cands}
    return min(cands, key=lambda c: (score[c], cands.index(c)))


def lofo(reg: dict, fam: dict, criterion: str) -> dict:
    """{family: (pick on the others, [held-out regrets])}."""
    out = {}
    for f in sorted(set(fam.values())):
        train = [k for k in reg if fam[k] != f]
        test = [k for k in reg if fam[k] == f]
        c = pick(reg, train, criterion)
        out[f] = (c, [reg[k][c] for k in test])
    return out


def report() -> None:
    results = load()
    print(f"{len(results)} cells in {OUT}\n")
    for mode in ("direct", "hashed"):
        for layers in LAYERS:
            reg, fam = regret_table(results, mode, layers)
            if not reg:
                continue
            print(
                f"### {mode} mode, {layers} layer{'s' if layers > 1 else ''} "
                f"({len(reg)} cells, {len(set(fam.values()))} families)\n"
            )
            print(
                "| procedure | held-out median | held-out geo-mean | held-out worst (family) "
                "| cells > 1.10 | pick on all cells |"
            )
            print("|---|---|---|---|---|---|")
            for crit in CRITERIA:
                lo = lofo(reg, fam, crit)
                allr = [r for _, rs in lo.values() for r in rs]
                worst_f = max(lo, key=lambda f: max(lo[f][1]))
                print(
                    f"| LOFO, lowest {crit} regret | {np.median(allr):.2f} | "
                    f"{np.exp(np.mean(np.log(allr))):.2f} | {max(allr):.2f} ({worst_f}) | "
                    f"{sum(r > 1.1 for r in allr)} of {len(allr)} | "
                    f"{' / '.join(pick(reg, list(reg), crit))} |"
                )
            fixed = [("auto", "items"), ("mle", "items"), ("deconvolution", "items")]
            fixed += [(m, "items") for m in EXTRA if (m, "items") in next(iter(reg.values()))]
            for cand in fixed:
                rs = [reg[k][cand] for k in reg]
                worst_k = max(reg, key=lambda k: reg[k][cand])
                print(
                    f"| fixed {' / '.join(cand)} | {np.median(rs):.2f} | "
                    f"{np.exp(np.mean(np.log(rs))):.2f} | {max(rs):.2f} ({fam[worst_k]}) | "
                    f"{sum(r > 1.1 for r in rs)} of {len(rs)} | - |"
                )
            print()
            lo = lofo(reg, fam, "geo-mean")
            print(
                "Held-out regret per family (procedure: lowest geo-mean regret on the other "
                "families; the fixed current default auto / items alongside):\n"
            )
            print(
                "| family | cells | pick without it | held-out median | held-out worst | "
                "auto / items median | auto / items worst |"
            )
            print("|---|---|---|---|---|---|---|")
            for f, (c, rs) in lo.items():
                a = [reg[k][("auto", "items")] for k in reg if fam[k] == f]
                print(
                    f"| {f} | {len(rs)} | {' / '.join(c)} | {np.median(rs):.2f} | "
                    f"{max(rs):.2f} | {np.median(a):.2f} | {max(a):.2f} |"
                )
            print()


def oracle_report(mode: str) -> None:
    """What a rule that knew more than the counters could reach: per layer count, the worst and
    median regret of the best fixed candidate for each group of cells, chosen on that group's own
    cells (in sample), where the group is the family (the data's source or shape), the regime
    (:func:`_regime`: public before the data) or both. A default that reads only the counters
    cannot beat the regime oracle by choosing among these candidates unless the counters tell the
    cells of a regime apart."""
    results = load()
    groups = {
        "family": lambda k, fam: fam[k],
        "regime": lambda k, fam: _regime(k),
        "family and regime": lambda k, fam: (fam[k], *_regime(k)),
    }
    for layers in LAYERS:
        reg, fam = regret_table(results, mode, layers)
        if not reg:
            continue
        print(f"### {mode} mode, {layers} layer{'s' if layers > 1 else ''} ({len(reg)} cells)\n")
        print("| oracle knows | groups | median | worst (cell) | its pick there |")
        print("|---|---|---|---|---|")
        a = {k: reg[k][("auto", "items")] for k in reg}
        worst_k = max(a, key=a.get)
        print(
            f"| nothing (auto / items) | 1 | {np.median(list(a.values())):.2f} | "
            f"{a[worst_k]:.2f} ({fam[worst_k]} {_cell_name(worst_k)}) | auto / items |"
        )
        for name, of in groups.items():
            members: dict = {}
            for k in reg:
                members.setdefault(of(k, fam), []).append(k)
            got = {}
            for keys in members.values():
                c = pick(reg, keys, "worst")
                got.update({k: (reg[k][c], c) for k in keys})
            worst_k = max(got, key=lambda k: got[k][0])
            print(
                f"| {name} | {len(members)} | {np.median([r for r, _ in got.values()]):.2f} | "
                f"{got[worst_k][0]:.2f} ({fam[worst_k]} {_cell_name(worst_k)}) | "
                f"{' / '.join(got[worst_k][1])} |"
            )
        print()


def _regime(key) -> tuple:
    """What a deployment knows before the data: D / n and eps (direct), n and eps (hashed, where
    the number of buckets follows from them)."""
    _, _, n, D, eps = key
    return (round(D / n, 3) if D else n, eps)


def _cell_name(key) -> str:
    _, _, n, D, eps = key
    return f"n={n:.0e} D={D:.0e} eps={eps}" if D else f"n={n:.0e} eps={eps}"


def _regrets_on(results: dict, mode: str, layers: int, idx) -> dict:
    """{cell key: auto / items' regret} from the repetitions ``idx`` (see :func:`regret_table`)."""
    reg, _ = regret_table(results, mode, layers, at=idx)
    return {key: r[("auto", "items")] for key, r in reg.items()}


def reps_report(block: int = 4, boots: int = 400) -> None:
    """How much of the worst-case regret is the repetitions' lottery: the default's (auto /
    items) regret per cell from all repetitions, against what runs of ``block`` repetitions
    each would read (the repetitions cut into consecutive blocks: the first block is exactly a
    ``block``-repetition run), and a bootstrap over each cell's repetitions of the worst cell's
    regret and of the median over cells (90% intervals: is a median 0.01 above a target a miss
    the repetitions can tell?)."""
    results = load()
    reps = min(len(r.items) for r in results.values())
    print(f"{len(results)} cells in {OUT}, {reps} repetitions each\n")
    print(
        f"| mode | layers | auto / items, all {reps} repetitions: median / geo-mean / worst "
        f"(cell) | cells > 1.5 | worst from each block of {block} | worst, bootstrap 90% "
        "| median, bootstrap 90% |"
    )
    print("|---|---|---|---|---|---|---|")
    g = np.random.default_rng(0)  # the benchmark's own resampling, not a release
    for mode in ("direct", "hashed"):
        for layers in LAYERS:
            allr = _regrets_on(results, mode, layers, slice(0, reps))
            if not allr:
                continue
            rs = np.array(list(allr.values()))
            wk = max(allr, key=allr.get)
            blocks = [
                max(_regrets_on(results, mode, layers, slice(b, b + block)).values())
                for b in range(0, reps - block + 1, block)
            ]
            draws = [
                np.array(
                    list(
                        _regrets_on(
                            results, mode, layers, lambda _k: g.integers(0, reps, reps)
                        ).values()
                    )
                )
                for _ in range(boots)
            ]
            worst = [d.max() for d in draws]
            median = [np.median(d) for d in draws]
            over = sorted((k for k in allr if allr[k] > 1.5), key=allr.get, reverse=True)
            cells = "; ".join(f"{k[1]} n={k[2]} D={k[3]} eps={k[4]}: {allr[k]:.2f}" for k in over)
            print(
                f"| {mode} | {layers} | {np.median(rs):.2f} / "
                f"{np.exp(np.mean(np.log(rs))):.2f} / {allr[wk]:.2f} ({wk[1]} n={wk[2]} "
                f"D={wk[3]} eps={wk[4]}) | {len(over)}{': ' + cells if cells else ''} | "
                f"{', '.join(f'{b:.2f}' for b in blocks)} | "
                f"{np.quantile(worst, 0.05):.2f}-{np.quantile(worst, 0.95):.2f} | "
                f"{np.quantile(median, 0.05):.3f}-{np.quantile(median, 0.95):.3f} |"
            )
    print()


TOTAL_CUTS = (1.02, 1.05, 1.1, 1.15, 1.2, 1.3, 1.5, 2.0, math.inf)
TOTAL_SWITCHES = (("mle", "items"), ("mle", "scale"), ("deconvolution", "scale"), ("auto", "scale"))


def totals_rules_report() -> None:
    """A per-window rule on what the release sees: a pilot's uncapped total T (the early-stopped
    EM's or the NPMLE's) against the public n. Rule (pilot, cut, X): X when T / n > cut, else
    auto / items. Pilot, cut and X chosen on the other families (lowest worst regret, ties:
    geometric mean), scored on the held-out one; each window's error is that of the candidate
    the rule names there (every candidate ran on the same counters: no re-run)."""
    results = load()
    rules = [
        (pm, cut, x)
        for pm in ("deconvolution", "mle")
        for cut in TOTAL_CUTS
        for x in TOTAL_SWITCHES
    ]
    print(
        "| mode | layers | auto / items: median / geo-mean / worst | rule held out: median / "
        "geo-mean / worst | rules picked (folds) | best rule in-sample: worst |"
    )
    print("|---|---|---|---|---|---|")
    for mode in ("direct", "hashed"):
        for layers in LAYERS:
            cells = {k: r for k, r in results.items() if k[0] == mode}
            if not cells:
                continue

            def regret(key, rule):
                r = cells[key]
                E = {
                    c: np.asarray(r.l1[(layers, *c)], float)
                    for c in CANDIDATES
                    if (layers, *c) in r.l1
                }
                best = min(e.mean() for e in E.values())
                e = E[("auto", "items")]
                if rule is not None:
                    pm, cut, x = rule
                    e = np.where(np.asarray(r.total[(layers, pm)]) / max(key[2], 1) > cut, E[x], e)
                return e.mean() / best if best > 0 else 1.0

            reg = {rule: {k: regret(k, rule) for k in cells} for rule in rules}
            base = np.array([regret(k, None) for k in cells])
            fam = {k: family(r.cell) for k, r in cells.items()}

            def score(rule, keys):
                v = np.array([reg[rule][k] for k in keys])
                return v.max(), float(np.exp(np.log(v).mean()))

            held, picks = [], []
            for f in sorted(set(fam.values())):
                train = [k for k in cells if fam[k] != f]
                rule = min(rules, key=lambda ru: score(ru, train))
                picks.append(rule)
                held += [reg[rule][k] for k in cells if fam[k] == f]
            h = np.array(held)
            ins = min(rules, key=lambda ru: score(ru, list(cells)))
            top = max(set(picks), key=picks.count)

            def fmt(v):
                return f"{np.median(v):.2f} / {np.exp(np.mean(np.log(v))):.2f} / {v.max():.2f}"

            def name(ru):
                return f"{ru[0]} T/n > {ru[1]:g}: {' / '.join(ru[2])}"

            print(
                f"| {mode} | {layers} | {fmt(base)} | {fmt(h)} | {name(top)} "
                f"({picks.count(top)} of {len(picks)}) | {name(ins)}: "
                f"{score(ins, list(cells))[0]:.2f} |"
            )
    print()


def _features(cell: Cell, layers: int) -> dict:
    """Public quantities of a release, known before any data: the signal-to-noise figure
    (``intervals.signal_to_noise``: events over the Cramer-Rao floor on the number of items) and
    the density n / counters."""
    from aggregator.intervals import signal_to_noise

    return {
        "snr": math.log(signal_to_noise(cell.n, cell.counters, cell.p, layers)),
        "density": math.log(cell.n / cell.counters),
    }


def _rule_pick(reg: dict, feats: dict, keys) -> tuple:
    """The one-cut rule (feature, cut, candidate below, candidate at or above) with the lowest
    worst-case regret on ``keys`` (ties: the lower geometric mean), cuts at the midpoints
    between the cells' feature values."""
    best, arg = None, None
    for f in ("snr", "density"):
        vals = sorted({feats[k][f] for k in keys})
        cuts = [-math.inf] + [(a + b) / 2 for a, b in zip(vals[:-1], vals[1:])]
        for cut in cuts:
            low = [k for k in keys if feats[k][f] < cut]
            high = [k for k in keys if feats[k][f] >= cut]
            # below and above the cut are independent: the best candidate on each side
            side = []
            for part in (low, high):
                if not part:
                    side.append((CANDIDATES[0], 0.0, 0.0))
                    continue
                sc = {
                    c: (
                        max(reg[k][c] for k in part),
                        float(np.mean([math.log(reg[k][c]) for k in part])),
                    )
                    for c in CANDIDATES
                }
                c = min(CANDIDATES, key=lambda c: (sc[c], CANDIDATES.index(c)))
                side.append((c, *sc[c]))
            score = (
                max(side[0][1], side[1][1]),
                (side[0][2] * len(low) + side[1][2] * len(high)) / len(keys),
            )
            if best is None or score < best:
                best, arg = score, (f, cut, side[0][0], side[1][0])
    return arg


def rules_report() -> None:
    """Held out: the best one-cut rule on a public feature (chosen on the other families), and
    the floor for any procedure that picks one fixed candidate per held-out family: for each
    family the candidate best on that family's own cells (in hindsight), worst over families."""
    results = load()
    for layers in LAYERS:
        reg, fam = regret_table(results, "direct", layers)
        if not reg:
            continue
        feats = {k: _features(results[k].cell, layers) for k in reg}
        held, rows = [], []
        for f in sorted(set(fam.values())):
            train = [k for k in reg if fam[k] != f]
            test = [k for k in reg if fam[k] == f]
            feat, cut, low, high = _rule_pick(reg, feats, train)
            rs = [reg[k][low if feats[k][feat] < cut else high] for k in test]
            held.extend(rs)
            rows.append((f, feat, cut, low, high, float(np.median(rs)), max(rs)))
        floor = {
            f: min(max(reg[k][c] for k in reg if fam[k] == f) for c in CANDIDATES)
            for f in set(fam.values())
        }
        worst_f = max(floor, key=floor.get)
        print(f"### direct mode, {layers} layer{'s' if layers > 1 else ''}\n")
        print("| held-out family | rule chosen on the others | held-out median | worst |")
        print("|---|---|---|---|")
        for f, feat, cut, low, high, med, mx in rows:
            print(
                f"| {f} | {feat} < {math.exp(cut):.3g}: {' / '.join(low)}, else "
                f"{' / '.join(high)} | {med:.2f} | {mx:.2f} |"
            )
        print(
            f"\nOne-cut rule held out: median {np.median(held):.2f}, geometric mean "
            f"{np.exp(np.mean(np.log(held))):.2f}, worst {max(held):.2f}."
        )
        print(
            f"Floor for one fixed candidate per held-out family (best in hindsight on the family"
            f" itself): worst {floor[worst_f]:.2f} ({worst_f}); per family: "
            + ", ".join(f"{f} {v:.2f}" for f, v in sorted(floor.items()))
            + "\n"
        )


FIXED_SIX = tuple((m, c) for m in ("threshold", "deconvolution", "mle") for c in CAPS)


def versus_rows(results, extra: str, layers: int) -> list[tuple]:
    """Per cell result that ran ``extra`` at ``layers``: (family, cell, auto's regret, the
    variant's, the variant's with the fixed ``fitted``-cap candidates in the best). Each regret
    is a mean error over the best of the six fixed candidates and the candidate itself (so it is
    at least 1); a cell whose best is 0 is left out."""
    rows = []
    for res in results:
        if (layers, extra, "items") not in res.l1:
            continue
        b = min(float(np.mean(res.l1[(layers, *c)])) for c in FIXED_SIX)
        a = float(np.mean(res.l1[(layers, "auto", "items")]))
        x = float(np.mean(res.l1[(layers, extra, "items")]))
        fit = [
            float(np.mean(res.l1[(layers, m, "fitted")]))
            for m in ("threshold", "deconvolution", "mle")
            if (layers, m, "fitted") in res.l1
        ]
        if min(b, a) <= 0 or min(b, x) <= 0:
            continue
        rows.append(
            (family(res.cell), res.cell, a / min(b, a), x / min(b, x), x / min([b, x] + fit))
        )
    return rows


def versus_report(extra: str, mode: str = "direct") -> None:
    """One mode's cells (direct by default): ``auto`` and the ``--extra`` auto variant
    ``extra`` each against the best of the six fixed candidates and itself (and, where the
    results hold them, with the three fixed ``fitted``-cap candidates in that best), then leave
    one family out between the two."""
    results = {k: r for k, r in load().items() if k[0] == mode}
    crits = {name: CRITERIA[name] for name in ("geo-mean", "worst", "p90")}  # the rows' order
    for layers in LAYERS:
        rows = versus_rows(results.values(), extra, layers)
        if not rows:
            continue
        print(f"### {mode} mode, {layers} layer{'s' if layers > 1 else ''} ({len(rows)} cells)\n")
        print("| candidate | median | geo-mean | worst (cell) | cells > 1.5 |")
        print("|---|---|---|---|---|")
        for j, name in ((2, "auto"), (3, extra), (4, f"{extra}, fitted caps in the best")):
            v = np.array([r[j] for r in rows])
            c = rows[int(np.argmax(v))][1]
            print(
                f"| {name} | {np.median(v):.2f} | {crits['geo-mean'](v):.2f} | {v.max():.2f} "
                f"({c.dist} n={c.n} D={c.D} eps={c.eps}) | {int((v > 1.5).sum())} |"
            )
        print()
        print(
            f"| LOFO between auto and {extra}, criterion | held-out median | geo-mean | worst "
            f"| {extra} picked |"
        )
        print("|---|---|---|---|---|")
        fams = sorted({r[0] for r in rows})
        for name, fn in crits.items():
            held, picked = [], 0
            for f in fams:
                train = [r for r in rows if r[0] != f]
                j = 3 if fn([r[3] for r in train]) < fn([r[2] for r in train]) else 2
                picked += j == 3
                held += [r[j] for r in rows if r[0] == f]
            v = np.asarray(held)
            print(
                f"| {name} | {np.median(v):.2f} | {crits['geo-mean'](v):.2f} | {v.max():.2f} | "
                f"{picked} of {len(fams)} folds |"
            )
        print()


CHOICE_RULES = (("auto", "items"), ("auto_xfit", "items"), ("auto_flag", "items"))
WINDOWS = ("all", "flagged", "unflagged")


def _choice_regrets(results: dict, mode: str, layers: int) -> dict:
    """{window group: {cell key: {candidate: regret}}}: each candidate's mean error over the
    group's repetitions of the cell (all of them, those whose default release raised its own
    ``signal_below_noise``, those that did not: the flags ``auto_flag`` logged) over the
    smallest such mean of every candidate the cells hold (the fixed ones, ``xfit`` and the
    rules themselves); a cell without repetitions in a group is not in it."""
    mine = {key: res for key, res in results.items() if key[0] == mode}
    cands = [c for c in CANDIDATES if mine and all((layers, *c) in r.l1 for r in mine.values())]
    out: dict = {w: {} for w in WINDOWS}
    for key, res in mine.items():
        flags = np.asarray(getattr(res, "flags", {}).get(layers, []), bool)
        E = {c: np.asarray(res.l1[(layers, *c)], float) for c in cands}
        for w in WINDOWS:
            idx = np.ones(len(flags), bool) if w == "all" else flags if w == "flagged" else ~flags
            if not idx.any():
                continue
            e = {c: float(v[idx].mean()) for c, v in E.items()}
            best = min(e.values())
            out[w][key] = {
                c: (v / best if best > 0 else (1.0 if v == 0 else math.inf)) for c, v in e.items()
            }
    return out


def choice_report() -> None:
    """Issue 51's choice: per family, the median and worst regret of ``auto`` (the default),
    ``auto_xfit`` (``xfit`` among its candidates) and ``auto_flag`` (the NPMLE when the default
    release raises its own flag), each items-capped, in all windows and in flagged and unflagged
    ones, against the best of every candidate run (fixed ones and ``xfit`` with both caps, and
    the rules); then the rule chosen leaving each family out (lowest worst regret on the other
    families' cells, ties: the geometric mean), scored on the held-out family."""
    results = load()
    if not results or not any(hasattr(r, "flags") for r in results.values()):
        print("no auto_flag results: run with --extra xfit,auto_xfit,auto_flag")
        return
    reps = sorted({len(r.items) for r in results.values()})
    print(f"{len(results)} cells in {OUT}, {'/'.join(map(str, reps))} repetitions each\n")
    names = {"auto": "auto", "auto_xfit": "auto+xfit", "auto_flag": "flag fallback"}
    for mode in ("direct", "hashed"):
        for layers in LAYERS:
            reg = _choice_regrets(results, mode, layers)
            if not reg["all"]:
                continue
            fam = {k: family(results[k].cell) for k in reg["all"]}
            rules = [c for c in CHOICE_RULES if c in next(iter(reg["all"].values()))]
            print(
                f"### {mode} mode, {layers} layer{'s' if layers > 1 else ''} "
                f"({len(reg['all'])} cells, {len(reg['flagged'])} with a flagged window)\n"
            )
            print(
                "Regret median / worst per family (cells: all / with a flagged window / "
                "with an unflagged one):\n"
            )
            print(
                "| family | cells | "
                + " | ".join(f"{names[r[0]]}, {w}" for w in WINDOWS for r in rules)
                + " |"
            )
            print("|---|---|" + "---|" * (len(WINDOWS) * len(rules)))

            def cell(w, r, keys):
                v = [reg[w][k][r] for k in keys if k in reg[w]]
                return f"{np.median(v):.2f} / {max(v):.2f}" if v else "-"

            for f in sorted(set(fam.values())) + ["all families"]:
                keys = [k for k in fam if f in (fam[k], "all families")]
                counts = "/".join(str(sum(k in reg[w] for k in keys)) for w in WINDOWS)
                label = f"**{f}**" if f == "all families" else f
                print(
                    f"| {label} | {counts} | "
                    + " | ".join(cell(w, r, keys) for w in WINDOWS for r in rules)
                    + " |"
                )
            print()
            if len(set(fam.values())) < 2:  # nothing to choose on with one family held out
                continue
            held, picks = [], []
            for f in sorted(set(fam.values())):
                train = [k for k in fam if fam[k] != f]
                pick_ = min(
                    rules,
                    key=lambda r: (
                        max(reg["all"][k][r] for k in train),
                        float(np.mean([math.log(reg["all"][k][r]) for k in train])),
                    ),
                )
                picks.append(pick_)
                held += [reg["all"][k][pick_] for k in fam if fam[k] == f]
            h = np.asarray(held)
            print(
                "Rule chosen leaving each family out (lowest worst regret on the others): "
                + ", ".join(f"{names[r[0]]} {picks.count(r)}" for r in rules if r in picks)
                + f" of {len(picks)} folds; held out median {np.median(h):.2f}, geometric "
                f"mean {np.exp(np.mean(np.log(h))):.2f}, worst {h.max():.2f}.\n"
            )


def compare(other: Path) -> None:
    """Per cell, the mean l1 error of auto / deconvolution / mle (items cap) here and in the
    results under ``other`` (the same cells and seeded draws, run at another commit), and the
    geometric mean of the ratios (here / other)."""
    here = load()
    old = {}
    for path in sorted(other.glob(OUT.stem + "*.pkl")):
        old.update(pickle.loads(path.read_bytes()))
    cands = (("auto", "items"), ("deconvolution", "items"), ("mle", "items"))
    keys = sorted((k for k in here if k in old), key=lambda k: (k[0], k[1], k[2]))
    for layers in LAYERS:
        print(f"### {layers} layer{'s' if layers > 1 else ''}: mean l1 error, {other} -> here\n")
        print("| cell | " + " | ".join(" / ".join(c) for c in cands) + " |")
        print("|---|" + "---|" * len(cands))
        ratios = {c: [] for c in cands}
        for k in keys:
            row = []
            for c in cands:
                a = float(np.mean(old[k].l1[(layers, *c)]))
                b = float(np.mean(here[k].l1[(layers, *c)]))
                ratios[c].append(b / a if a > 0 else 1.0)
                row.append(f"{a:.0f} -> {b:.0f}")
            print(f"| {k[0]} {k[1]} n={k[2]} eps={k[4]} | " + " | ".join(row) + " |")
        print()
        for c in cands:
            r = np.asarray(ratios[c])
            print(
                f"{' / '.join(c)}: here / {other}, geometric mean {np.exp(np.log(r).mean()):.2f}"
                f" (range {r.min():.2f} .. {r.max():.2f}) over {len(r)} cells"
            )
        print()


def main(argv=None) -> int:
    ap = parser(__doc__, "--run and --report on four tiny cells, 1 repetition, 1 layer, into out/")
    ap.add_argument("--run", action="store_true")
    ap.add_argument("--shard", type=shard_arg, default="0/1")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--mode", choices=("direct", "hashed"), help="run only this mode's cells")
    ap.add_argument("--out", help="results directory (default out/)")
    ap.add_argument(
        "--rules",
        action="store_true",
        help="direct mode: held-out one-cut rules on public features, and the floor "
        "of any fixed pick per held-out family",
    )
    ap.add_argument(
        "--compare",
        metavar="DIR",
        help="per-cell errors here against the results in DIR (another commit's)",
    )
    ap.add_argument(
        "--fixed-tol",
        action="store_true",
        help="the early-stopped EM at tolerance 1e-5 for every layer count (the code "
        "before deconvolution.deconv_tol), results in out/lofo_fixed_tol/",
    )
    ap.add_argument(
        "--extra",
        default="",
        help=f"comma-separated candidates tried and not adopted, run and reported "
        f"beside the library's: {', '.join(EXTRA)}",
    )
    ap.add_argument(
        "--cap",
        choices=("items",),
        help="report: only the candidates with this cap rule (the release's cap is "
        "chosen apart: estimators.DEFAULTS caps by items)",
    )
    ap.add_argument(
        "--grid-hashed",
        action="store_true",
        help="run: the accuracy grid's hashed cells "
        "(bench.accuracy.grid.grid_cells) instead "
        "of this bench's, e.g. with --out out/lofo_grid_hashed",
    )
    ap.add_argument(
        "--reps",
        type=int,
        default=4,
        help="repetitions per cell (default 4); the first ones draw exactly "
        "what a run with fewer draws (the same seeds), so a cell's regret can "
        "be re-read with more of them, e.g. with --out out/lofo_reps16",
    )
    ap.add_argument(
        "--first-rep",
        type=int,
        default=0,
        metavar="R",
        help="run: draw repetitions R .. R + reps - 1 (other seeds than a run from "
        "0: e.g. a rule's margin chosen on repetitions 0-15, checked on 16-23)",
    )
    ap.add_argument("--layers", default="1,2", help="layer counts run and reported (default 1,2)")
    ap.add_argument(
        "--blocks",
        type=int,
        metavar="B",
        help="report: the default's regret from all repetitions against runs of B "
        "repetitions each (how much of the worst case is the draws' lottery)",
    )
    ap.add_argument(
        "--totals-rule",
        action="store_true",
        help="report: a per-window rule on a pilot's uncapped total against n, "
        "chosen held out (tried for the worst cells, not adopted)",
    )
    ap.add_argument(
        "--oracles",
        action="store_true",
        help="report: the best fixed candidate per family, per regime (D / n or n, "
        "eps) "
        "and per both, chosen in sample: what knowing more than the counters "
        "would reach (--mode, default direct)",
    )
    ap.add_argument(
        "--versus",
        metavar="EXTRA",
        help="report, direct mode (or --mode): auto against the --extra auto "
        "variant EXTRA (e.g. auto_fitted), each against the best fixed "
        "candidate, and leave one family out between the two",
    )
    ap.add_argument(
        "--add-to",
        metavar="DIR",
        help="run only the --extra candidates on the cells and repetitions stored in "
        "DIR (e.g. out/lofo_reps16), writing DIR's results with them to --out",
    )
    ap.add_argument(
        "--hashed-real",
        action="store_true",
        help="run: the real profiles of the direct cells as hashed items (n = D/10, "
        "D, 10 D) instead of this bench's cells, e.g. with --out "
        "out/lofo_hashed_real",
    )
    ap.add_argument(
        "--max-counters",
        type=int,
        metavar="N",
        help="run: leave out the direct cells of more than N counters (a run that "
        "fits the time), except those of the --keep distributions",
    )
    ap.add_argument(
        "--keep",
        action="append",
        default=[],
        metavar="DIST",
        help="with --max-counters: keep this distribution's cells whatever their "
        "size (e.g. heavy: issue 28's blocked cell)",
    )
    ap.add_argument(
        "--choice",
        action="store_true",
        help="report: per family, auto against auto_xfit and auto_flag (run with "
        "--extra xfit,auto_xfit,auto_flag), in all, flagged and unflagged "
        "windows, and the rule picked leaving each family out",
    )
    args = ap.parse_args(argv)
    global OUT, CANDIDATES, REPS, FIRST_REP, LAYERS
    if args.smoke:
        args.reps, args.layers, args.run, args.report = 1, "1", True, True
    extra = [e for e in args.extra.split(",") if e]
    bad = [e for e in extra if e not in EXTRA]
    if bad:
        ap.error(f"unknown --extra {', '.join(bad)}; choose among {', '.join(EXTRA)}")
    EXTRA_RUN[:] = extra
    REPS, FIRST_REP = args.reps, args.first_rep
    LAYERS = tuple(int(x) for x in args.layers.split(","))
    if not LAYERS or any(x < 1 for x in LAYERS):
        ap.error(f"--layers takes layer counts >= 1, got {args.layers!r}")
    CANDIDATES = tuple(
        (m, c) for m in METHODS + tuple(extra) for c in CAPS if args.cap in (None, c)
    )
    if args.grid_hashed and args.hashed_real:
        ap.error("--grid-hashed and --hashed-real are two cell sets: run them apart")
    CELL_SET[:] = (
        ["grid-hashed"]
        if args.grid_hashed
        else ["hashed-real"]
        if args.hashed_real
        else ["smoke"]
        if args.smoke
        else []
    )
    if args.max_counters:
        MAX_COUNTERS[:] = [args.max_counters, set(args.keep)]
    if args.fixed_tol:
        from aggregator import deconvolution

        deconvolution.deconv_tol = lambda p, layers=1, hashed=False: deconvolution.DECONV_TOL
        OUT = Path("out/lofo_fixed_tol/lofo_results.pkl")
    if args.out:
        OUT = Path(args.out) / OUT.name
    if args.mode:
        MODES_RUN[:] = [args.mode]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    if args.add_to:
        if Path(args.add_to).resolve() == OUT.parent.resolve() or not extra:
            ap.error("--add-to needs --extra and an --out other than DIR")
        add_extras(Path(args.add_to), parse_shard(args.shard))
    if args.run:
        i, k = parse_shard(args.shard)
        run((i, k))
    if args.report:
        report()
    if args.blocks:
        reps_report(args.blocks)
    if args.totals_rule:
        totals_rules_report()
    if args.rules:
        rules_report()
    if args.compare:
        compare(Path(args.compare))
    if args.versus:
        versus_report(args.versus, args.mode or "direct")
    if args.oracles:
        oracle_report(args.mode or "direct")
    if args.choice:
        choice_report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
