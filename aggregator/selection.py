"""Choosing the estimator from the counters: minimax bootstrap regret (``method="auto"``).

Why a rule and not one estimator
--------------------------------
No estimator of phi_{>=r} is best on every data shape (docs/accuracy_grid.md): the early-stopped EM
(``"deconvolution"``) wins on dense, near-uniform counters, where the converged NPMLE (``"mle"``)
overfits into spikes, and loses by a wide margin when most counters are empty and the noise has
two or three layers, where the EM needs hundreds of steps; very sparse windows favour the NPMLE
thinned to n (cap ``"scale"``), heavy tails the largest items (cap ``"items"``). The counters
themselves say which regime they are in, and a release may use them for that: any function of the
noisy counters and the public quantities (n, D or B, p, layers) is post-processing.

The rule
--------
1. Pilots. Run each pilot estimator (:data:`PILOTS`: the early-stopped EM and the converged
   NPMLE) on the counters, project (Algorithm 1) and cap at n: two plausible truths, one smooth
   and one spiky. Each is a valid anonymized histogram. The cap is thinning every level
   (``scale``) unless keeping the largest items (``items``) makes the pilots fit the counters
   better by a log-likelihood margin (:func:`_standin_cap`): the stand-ins' cap decides which cap
   family the bootstrap favours, and the counters can tell a heavy tail from noise.
2. Parametric bootstrap. For each pilot, simulate the state it implies (same counters, p,
   layers; fresh seeded noise, :func:`aggregator.counter_model.simulate_counts`) :data:`SIMS` times,
   run every candidate (estimator x cap rule, :data:`CANDIDATES`) on each simulated state, and
   measure its l1 error against the pilot: an estimate of each candidate's error if the pilot were
   the truth.
3. Minimax regret. regret(candidate, pilot) = error / the smallest error under that pilot. The
   choice is the candidate with the smallest worst regret over the pilots (ties: the lower mean
   regret): the grid's own selection rule (bench/accuracy/grid.py), applied to the plausible truths
   of
   these counters instead of to a benchmark grid. A candidate that is good only if the truth is
   smooth, or only if it is spiky, loses to one that is good under both.
4. The winner's estimate on the real counters (the pilots' runs are reused) is the release.

The early-stopped EM's start (direct mode, one noise layer)
-------------------------------------------------------------
An early-stopped EM ends near its start. Its default start, the noisy values smoothed by the
noise once more, is over-dispersed: in a mostly empty window it leaves a tail at r = 2-15 that a
heavy-hitter window (a few items holding most events, every other item seen once) does not have,
and the early stop keeps it. So where a window's counters
are mostly empty (n <= D: the cluster holding 0 is their bulk) the EM also runs from the shrunk
start (the zero cluster's noisy values pulled to their true mean and variance,
``em.EMProblem.start``), and keeps that fit only when the counters' likelihood prefers it
by more than :data:`START_MARGIN` nats (both fits capped at n by ``"items"``); on the counters and
on every simulated state alike, as the pilot and as the candidate. :func:`chosen_start` tells the
error bars which start the release took, so their bootstrap re-runs it. Measured held out
(bench/accuracy/lofo.py; the figures: docs/core_figures.md, "auto"), it lowered the worst regret at
one
layer and lost at two, so it is not applied there, nor in hashed mode, whose bucket counters
run their own choice of start (``largedomain._likelier_start``).

Each pilot alone biases the choice toward itself (an estimator does well on data shaped like its
own output); the minimax over a smooth and a spiky pilot is what removes most of that bias
(measured in docs/accuracy_grid.md). The bootstrap's randomness is seeded from the counters
(:func:`aggregator.counters.data_seed`), so the release is a deterministic function of them, and
it never touches the state or its noise: post-processing.

Cost: one EM run on the counters plus pilots x SIMS EM runs on simulated value counts (the
early-stopped EM and the converged NPMLE share each run:
:func:`aggregator.deconvolution.em_prevalences`; the threshold candidate is a single pass). The
simulated states are fitted together, one batched loop
(:func:`aggregator.deconvolution.deconvolved_batch`), so their cost is about that of the slowest
one's converged NPMLE, not the sum. Where the early-stopped EM chooses its start (one layer,
n <= D), its second start adds one early-stopped run on the counters and one batch on the
states. The EM itself is cheap at large domains: counters in the sparse tail are passed through
(:func:`aggregator.em._sparse_counters`), so its axis spans the dense counts only.
docs/accuracy_grid.md ("Release time") measures it.

>>> import numpy as np
>>> from aggregator.noise import discrete_laplace
>>> g = np.random.default_rng()
>>> h = np.concatenate([g.integers(1, 20, 400), np.zeros(3_600, np.int64)])
>>> noisy = h + discrete_laplace(0.5, len(h), rng=g) + discrete_laplace(0.5, len(h), rng=g)
>>> y, choice = select(noisy, 0.5, layers=2, n=int(h.sum()))
>>> choice in CANDIDATES, int(y.sum()) <= int(h.sum())
(True, True)
"""

from __future__ import annotations

import numpy as np

from . import counter_model
from .cap import cap_total
from .counters import check_layers, counters_key, data_seed, noisy_value_counts
from .deconvolution import (
    deconvolved_batch,
    deconvolved_prevalence,
    em_prevalences,
    em_prevalences_many,
)
from .em import DIRECT_START_SMOOTH_SHARE
from .estimator import BASIC, DECONVOLUTION, MLE, THRESHOLD, basic_prevalence
from .histograms import counts_from_cumulative, cumulative_l1
from .memo import ReleaseMemo
from .projection import project_l1

__all__ = [
    "PILOTS",
    "CANDIDATES",
    "SIMS",
    "STANDIN_MARGIN",
    "START_MARGIN",
    "select",
    "selected_prevalence",
    "chosen_start",
]

# the estimators that need only the counters (aggregator.estimator), the EMs first (the order
# breaks ties between equal regrets)
PILOTS = (DECONVOLUTION.name, MLE.name)
CANDIDATES = tuple((e.name, c) for e in (DECONVOLUTION, MLE, THRESHOLD) for c in ("items", "scale"))
SIMS = 4
STANDIN_MARGIN = 20.0  # log-likelihood gap that makes the stand-ins ``items``-capped
# the shrunk start's fit is kept when likelier by more than this: Wilks' chi2_1(0.99) / 2 (why
# not 90%: docs/core_figures.md, "auto")
START_MARGIN = 3.3174


def select(
    noisy_counts,
    p,
    *,
    layers=1,
    n=None,
    pilots=PILOTS,
    candidates=CANDIDATES,
    sims=SIMS,
    seed=None,
    hashed=False,
    memo: ReleaseMemo | None = None,
) -> tuple[np.ndarray, tuple]:
    """(cumulative prevalence phi_{>=r} of the release, chosen (method, cap)).

    Without ``n`` the cap rules are not applied (every candidate is taken as ``"none"``).
    ``hashed``: the counters are hash buckets (the EM's early stop does not scale with the
    layers there, :func:`aggregator.deconvolution.deconv_tol`; the early-stopped EM keeps its
    smoothed start, hashed mode choosing its start after the inversion).

    The result is a deterministic function of the arguments, so a release's ``memo``
    (:class:`aggregator.memo.ReleaseMemo`) keeps it, and the pilot fits: the release's estimate
    and its error bars (:func:`aggregator.intervals.error_bars`) ask for the same choice on the
    same counters, and it is the costliest step of a release. Without a memo it is made afresh.
    """
    vc0 = noisy_value_counts(noisy_counts)
    y, choice, _ = _select_held(
        vc0,
        p,
        layers=layers,
        n=n,
        pilots=pilots,
        candidates=candidates,
        sims=sims,
        seed=seed,
        hashed=hashed,
        memo=memo,
    )
    return y, choice


def _select_held(vc0, p, *, layers, n, pilots, candidates, sims, seed, hashed, memo) -> tuple:
    """:func:`_select`'s (y, choice, start) of these counters, from the memo when it holds them."""
    key = (
        *counters_key(vc0),
        float(p),
        int(layers),
        None if n is None else int(n),
        tuple(pilots),
        tuple(candidates),
        int(sims),
        seed,
        bool(hashed),
    )
    held = None if memo is None else memo.choice
    if held is not None and held[0] == key:
        y, choice, start = held[1]
        return y.copy(), choice, start
    y, choice, start = _select(
        vc0,
        p,
        layers=layers,
        n=n,
        pilots=pilots,
        candidates=candidates,
        sims=sims,
        seed=seed,
        hashed=hashed,
        memo=memo,
    )
    if memo is not None:
        memo.choice = (key, (y.copy(), choice, start))
    return y, choice, start


def chosen_start(
    noisy_counts, p, *, layers=1, n=None, memo: ReleaseMemo | None = None
) -> tuple[bool, np.ndarray] | None:
    """(whether the release took the shrunk start, phi_{>=r} of the other start's fit capped as
    the release) when :func:`select`'s choice on these counters is the early-stopped EM and it
    chose between the two starts (direct mode, one layer, n <= D: see the module's docstring);
    else None. The error bars' bootstrap re-runs that start (conditional on the choice, as it
    re-runs the chosen candidate), and the gap to the other start's fit counts as the gap
    between two candidates does. With the release's ``memo`` this is the release's own decision;
    without one :func:`select` is run afresh (the same decision, at its cost)."""
    return _select_held(
        noisy_value_counts(noisy_counts),
        p,
        layers=layers,
        n=n,
        pilots=PILOTS,
        candidates=CANDIDATES,
        sims=SIMS,
        seed=None,
        hashed=False,
        memo=memo,
    )[2]


def _estimates(vc, p, k: int, methods, hashed=False) -> dict:
    """{method: projected phi_{>=r}}; the early-stopped EM and the converged NPMLE share one EM
    run (:func:`aggregator.deconvolution.em_prevalences`: the NPMLE continues the early stop).
    """
    out = {}
    if "deconvolution" in methods and "mle" in methods:
        early, full = em_prevalences(vc, p, layers=k, hashed=hashed)
        out = {"deconvolution": project_l1(early), "mle": project_l1(full)}
    for m in methods:
        if m not in out:
            out[m] = project_l1(basic_prevalence(vc, p, layers=k, method=m, hashed=hashed))
    return {m: out[m] for m in methods}


def _estimates_many(vcs, p, k: int, methods, n=None, hashed=False) -> list:
    """[:func:`_estimates` of each counter set], the early-stopped EM and the converged NPMLE of
    all sets on one batched path (:func:`aggregator.deconvolution.em_prevalences_many`, equal to
    rounding): for the simulated states, whose fits only rank the candidates. The real
    counters' fits stay :func:`_estimates` (the release is reproducible bit for bit).
    With ``n`` the early-stopped EM takes its likelier start as the real counters' does
    (:func:`_take_likelier_start`; the shrunk start's fits in one batch too)."""
    if not ("deconvolution" in methods and "mle" in methods):
        out = [_estimates(vc, p, k, methods, hashed=hashed) for vc in vcs]
    else:
        out = []
        for vc, (early, full) in zip(vcs, em_prevalences_many(vcs, p, layers=k, hashed=hashed)):
            fits = {"deconvolution": project_l1(early), "mle": project_l1(full)}
            for m in methods:
                if m not in fits:
                    fits[m] = project_l1(basic_prevalence(vc, p, layers=k, method=m, hashed=hashed))
            out.append({m: fits[m] for m in methods})
    todo = [
        i
        for i, vc in enumerate(vcs)
        if "deconvolution" in methods and _two_starts(vc, k, n, hashed=hashed)
    ]
    if todo:
        shrunk = deconvolved_batch(
            [vcs[i] for i in todo],
            p,
            layers=k,
            shrunk_start=True,
            smooth_share=DIRECT_START_SMOOTH_SHARE,
        )
        for i, phi in zip(todo, shrunk):
            _take_likelier_start(vcs[i], p, k, n, out[i], project_l1(phi))
    return out


def _two_starts(vc, k: int, n, hashed=False) -> bool:
    """Whether the early-stopped EM on these counters chooses between its two starts: direct
    mode (not ``hashed``), one noise layer, n known and at most the number of counters (see the
    module's docstring)."""
    return k == 1 and n is not None and int(n) <= vc.total and not hashed


def _shrunk_fit(vc, p, k: int) -> np.ndarray:
    """The early-stopped EM's projected fit from the shrunk start (direct mode's share of the
    smoothed one, ``em.DIRECT_START_SMOOTH_SHARE``)."""
    return project_l1(
        deconvolved_prevalence(
            vc, p, layers=k, shrunk_start=True, smooth_share=DIRECT_START_SMOOTH_SHARE
        )
    )


def _take_likelier_start(vc, p, k: int, n, fits: dict, shrunk: np.ndarray, margin=None) -> tuple:
    """Put in ``fits["deconvolution"]`` (the early-stopped EM's fit from the smoothed start) the
    shrunk start's fit ``shrunk`` when the counters' likelihood prefers it by more than
    ``margin`` (default :data:`START_MARGIN`), both capped at n by ``"items"`` (as histograms of
    the n events, whatever the cap the candidates then apply). Returns (whether it did, the
    other fit)."""
    smooth = fits["deconvolution"]
    margin = START_MARGIN if margin is None else margin

    def ll(y):
        return counter_model.loglik(vc, cap_total(y, int(n), "items"), vc.total, p, k)

    if ll(shrunk) > ll(smooth) + margin:
        fits["deconvolution"] = shrunk
        return True, smooth
    return False, shrunk


def _standin_cap(vc, fits: dict, pilots, n: int, p: float, k: int) -> str:
    """The cap rule that brings the stand-ins to n: ``"items"`` if, for every pilot whose total
    exceeds n (the two rules differ only there), the stand-in it gives fits the counters better
    than the ``"scale"`` one by more than :data:`STANDIN_MARGIN` in log-likelihood; else
    ``"scale"``, the candidates' thinning rule.

    Each cap rule favours the candidates with the same rule in the bootstrap (a candidate does well
    on data shaped like its own output), so the stand-ins' cap decides between the two families.
    Thinning every level (``scale``) is right for near-empty windows, where the largest noisy
    counters are noise, and wrong for heavy tails, where it thins away heavy hitters the counters
    plainly show; the likelihood tells the two apart when it can (docs/core_figures.md,
    "auto"), and ``scale`` stays where it cannot.
    bench/accuracy/select_study.py compares this rule with the alternatives on the grid's counters.
    """
    gaps = []
    for pm in pilots:
        y_s, y_i = cap_total(fits[pm], int(n), "scale"), cap_total(fits[pm], int(n), "items")
        if not np.array_equal(y_s, y_i):
            ll = counter_model.loglik
            gaps.append(ll(vc, y_i, vc.total, p, k) - ll(vc, y_s, vc.total, p, k))
    return "items" if gaps and min(gaps) > STANDIN_MARGIN else "scale"


def _capped(y, total, rule: str, counters, p: float, k: int) -> np.ndarray:
    """y capped at ``total`` by ``rule`` (as it is with ``"none"`` or no total); ``counters``
    (with p and k) are what y was estimated from: no library rule reads them, a rule bench
    measures does (bench/accuracy/fitted_cap.py patches this function)."""
    if rule == "none" or total is None:
        return y
    return cap_total(y, int(total), rule)


def _regrets(err: dict) -> dict:
    """{candidate: its error under one stand-in over the smallest error under it} (``err``:
    {candidate: summed l1 error against that stand-in}; every candidate 1 when all are 0)."""
    best = min(err.values())
    return {c: e / best if best > 0 else (1.0 if e == 0 else np.inf) for c, e in err.items()}


def _minimax(regret: dict):
    """The candidate with the smallest worst regret over the stand-ins (``regret``: {candidate:
    [its regret under each stand-in]}); ties: the smaller mean regret, then the earlier one."""
    return min(regret, key=lambda c: (max(regret[c]), float(np.mean(regret[c]))))


def _select(
    noisy_counts, p, *, layers, n, pilots, candidates, sims, seed, hashed, memo=None
) -> tuple:
    vc = noisy_value_counts(noisy_counts)
    k = check_layers(layers)
    D = vc.total
    if n is None:
        candidates = tuple(dict.fromkeys((m, "none") for m, _ in candidates))
    # many layers (rollups): the threshold's kernel amplifies the noise 1e6+ fold
    usable = {e.name: e.usable(p, k) for e in BASIC}
    uses_n = {e.name: e.uses_n for e in BASIC}
    candidates = tuple(c for c in candidates if usable.get(c[0], True))

    methods = tuple(dict.fromkeys(m for m, _ in candidates))
    fits = _estimates(
        vc,
        p,
        k,
        [m for m in dict.fromkeys(pilots + methods) if m in pilots or m == "threshold"],
        hashed=hashed,
    )
    start = None  # (shrunk start taken?, the other start's fit) when the EM chose between them
    if "deconvolution" in fits and _two_starts(vc, k, n, hashed=hashed):
        start = _take_likelier_start(vc, p, k, n, fits, _shrunk_fit(vc, p, k))
    # the error bars' stand-ins are two of them (fits that do not depend on n only: the memo's
    # key holds no n)
    if memo is not None:
        memo.remember_fits(vc, p, k, {m: y for m, y in fits.items() if not uses_n.get(m, True)})
    rng = np.random.default_rng(data_seed(vc) if seed is None else seed)
    regret: dict = {c: [] for c in candidates}
    standin_cap = _standin_cap(vc, fits, pilots, n, p, k) if n is not None else "none"
    stand_ins, states = [], []  # every stand-in's states drawn first, then fitted in one batch
    for pm in pilots:
        y_p = _capped(fits[pm], n, standin_cap, vc, p, k)
        if len(y_p) and y_p[0] > D:  # more items than counters (only without n): keep the top
            truth = counts_from_cumulative(y_p)[:D]
            y_p = np.asarray(np.cumsum(np.bincount(truth)[::-1])[::-1][1:], dtype=np.int64)
        stand_ins.append(y_p)
        states += [
            counter_model.simulate_from_cumulative(rng, y_p, D, p, k) for _ in range(int(sims))
        ]
    fitted = iter(zip(states, _estimates_many(states, p, k, methods, n, hashed=hashed)))
    for y_p in stand_ins:
        total = int(y_p.sum()) if n is not None else None
        err = {c: 0.0 for c in candidates}
        for _ in range(int(sims)):
            sim, ests = next(fitted)
            for m in methods:
                y = ests[m]
                for c in candidates:
                    if c[0] == m:
                        err[c] += cumulative_l1(_capped(y, total, c[1], sim, p, k), y_p)
        for c, r in _regrets(err).items():
            regret[c].append(r)
    choice = _minimax(regret)
    m, rule = choice
    y = (
        fits[m]
        if m in fits
        else project_l1(basic_prevalence(vc, p, layers=k, method=m, hashed=hashed))
    )
    if m != "deconvolution" or start is None:
        start = None
    else:
        start = (start[0], _capped(start[1], n, rule, vc, p, k))
    return _capped(y, n, rule, vc, p, k), choice, start


def selected_prevalence(
    noisy_counts, p, *, layers=1, n=None, hashed=False, memo: ReleaseMemo | None = None
) -> np.ndarray:
    """phi_{>=r} of :func:`select` as floats (``estimators.phi_estimate(method="auto")``)."""
    return select(noisy_counts, p, layers=layers, n=n, hashed=hashed, memo=memo)[0].astype(
        np.float64
    )
