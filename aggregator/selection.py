"""Choosing the estimator from the counters: minimax bootstrap regret (``method="auto"``).

Why a rule and not one estimator
--------------------------------
No estimator of phi_{>=r} is best on every data shape (docs/accuracy_grid.md): the early-stopped EM
(``"deconvolution"``) wins on dense, near-uniform counters, where the converged NPMLE (``"mle"``)
overfits into spikes, and loses 3-15x when most counters are empty and the noise has two or three
layers, where the EM needs hundreds of steps; very sparse windows favour the NPMLE thinned to n
(cap ``"scale"``), heavy tails the largest items (cap ``"items"``). The counters themselves say
which regime they are in, and a release may use them for that: any function of the noisy counters
and the public quantities (n, D or B, p, layers) is post-processing.

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
   regret): the grid's own selection rule (bench/accuracy/grid.py), applied to the plausible
   truths of
   these counters instead of to a benchmark grid. A candidate that is good only if the truth is
   smooth, or only if it is spiky, loses to one that is good under both.
4. The winner's estimate on the real counters (the pilots' runs are reused) is the release.

The early-stopped EM's start (direct mode, one noise layer)
-------------------------------------------------------------
An early-stopped EM ends near its start. Its default start, the noisy values smoothed by the
noise once more, is over-dispersed: in a mostly empty window it leaves a tail at r = 2-15 that a
heavy-hitter window (a few items holding most events, every other item seen once) does not have,
and the early stop keeps it (2x the l1 error of the best candidate). So where a window's counters
are mostly empty (n <= D: the cluster holding 0 is their bulk) the EM also runs from the shrunk
start (the zero cluster's noisy values pulled to their true mean and variance,
``estimate._EMProblem.start``), and keeps that fit only when the counters' likelihood prefers it
by more than :data:`START_MARGIN` nats (both fits capped at n by ``"items"``); on the counters and
on every simulated state alike, as the pilot and as the candidate. :func:`chosen_start` tells the
error bars which start the release took, so their bootstrap re-runs it. Measured held out
(bench/accuracy/lofo.py, 52 direct cells; docs/accuracy_grid.md): the worst regret at one layer
1.43 ->
1.37 on 16 repetitions the margin was not chosen on (1.77 -> 1.44 on the 16 it was), the median
and geometric mean unchanged. At two layers the accuracy grid lost with it (n = D windows), so it
is not applied there, nor in hashed mode, whose bucket counters run their own choice of start
(``largedomain._likelier_start``).

Each pilot alone biases the choice toward itself (an estimator does well on data shaped like its
own output); the minimax over a smooth and a spiky pilot is what removes most of that bias
(measured in docs/accuracy_grid.md). The bootstrap's randomness is seeded from the counters
(:func:`aggregator.estimate._data_seed`), so the release is a deterministic function of them, and
it never touches the state or its noise: post-processing.

Cost: one EM run on the counters plus pilots x SIMS EM runs on simulated value counts (the
early-stopped EM and the converged NPMLE share each run: :func:`aggregator.estimate.em_prevalences`;
the threshold candidate is a single pass). The simulated states are fitted together, one batched
loop (:func:`aggregator.estimate.deconvolved_batch`), so their cost is about that of the slowest
one's converged NPMLE, not the sum. Where the early-stopped EM chooses its start (one layer,
n <= D), its second start adds one early-stopped run on the counters and one batch on the
states.
The EM itself is cheap at large domains: counters in the sparse tail are passed through
(:func:`aggregator.estimate._sparse_counters`), so its axis spans the dense counts only (~1e3
values at D = 1e7 Zipf counters instead of ~1e4). docs/accuracy_grid.md ("Release time") measures
it.

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
from .estimate import LastCounters, cap_total, cumulative_l1, remember_fits

__all__ = ["PILOTS", "CANDIDATES", "SIMS", "STANDIN_MARGIN", "START_MARGIN", "select",
           "selected_prevalence", "chosen_start"]

PILOTS = ("deconvolution", "mle")
CANDIDATES = tuple((m, c) for m in ("deconvolution", "mle", "threshold")
                   for c in ("items", "scale"))
SIMS = 4
STANDIN_MARGIN = 20.0  # log-likelihood gap that makes the stand-ins ``items``-capped
# the shrunk start's fit is kept when likelier by more than this: Wilks' chi2_1(0.99) / 2. At
# Wilks' 90% drop (1.35) one Zipf(0.7) window in 16 took it at +2.0 nats with 3x the error; the
# heavy-hitter windows take it at +8.5 nats and more (docs/accuracy_grid.md)
START_MARGIN = 3.3174


_LAST = LastCounters()  # the last (key, result) of select: a release and its error bars both ask


def select(noisy_counts, p, *, layers=1, n=None, pilots=PILOTS, candidates=CANDIDATES,
           sims=SIMS, seed=None) -> tuple[np.ndarray, tuple]:
    """(cumulative prevalence phi_{>=r} of the release, chosen (method, cap)).

    Without ``n`` the cap rules are not applied (every candidate is taken as ``"none"``).

    The result is a deterministic function of the arguments, so the last one is kept: the
    release's estimate and its error bars (:func:`aggregator.intervals.error_bars`) ask for the
    same choice on the same counters, and it is the costliest step of a release.
    """
    from .estimate import noisy_value_counts as _nvc
    vc0 = _nvc(noisy_counts)
    y, choice, _ = _select_held(vc0, p, layers=layers, n=n, pilots=pilots,
                                candidates=candidates, sims=sims, seed=seed)
    return y, choice


def _select_held(vc0, p, *, layers, n, pilots, candidates, sims, seed) -> tuple:
    """:func:`_select`'s (y, choice, start) of these counters, from the memo when it holds them."""
    from .estimate import counters_key
    key = (*counters_key(vc0), float(p), int(layers), None if n is None else int(n),
           tuple(pilots), tuple(candidates), int(sims), seed)
    held = _LAST.entry
    if held is not None and held[0] == key:
        y, choice, start = held[1]
        return y.copy(), choice, start
    y, choice, start = _select(vc0, p, layers=layers, n=n, pilots=pilots, candidates=candidates,
                               sims=sims, seed=seed)
    _LAST.put((key, (y.copy(), choice, start)))
    return y, choice, start


def chosen_start(noisy_counts, p, *, layers=1, n=None) -> tuple[bool, np.ndarray] | None:
    """(whether the release took the shrunk start, phi_{>=r} of the other start's fit capped as
    the release) when :func:`select`'s choice on these counters is the early-stopped EM and it
    chose between the two starts (direct mode, one layer, n <= D: see the module's docstring);
    else None. The error bars' bootstrap re-runs that start (conditional on the choice, as it
    re-runs the chosen candidate), and the gap to the other start's fit counts as the gap
    between two candidates does."""
    from .estimate import noisy_value_counts as _nvc
    return _select_held(_nvc(noisy_counts), p, layers=layers, n=n, pilots=PILOTS,
                        candidates=CANDIDATES, sims=SIMS, seed=None)[2]


def _estimates(vc, p, k: int, methods) -> dict:
    """{method: projected phi_{>=r}}; the early-stopped EM and the converged NPMLE share one EM
    run (:func:`aggregator.estimate.em_prevalences`: the NPMLE continues the early stop)."""
    from .estimate import basic_prevalence, em_prevalences, project_l1

    out = {}
    if "deconvolution" in methods and "mle" in methods:
        early, full = em_prevalences(vc, p, layers=k)
        out = {"deconvolution": project_l1(early), "mle": project_l1(full)}
    for m in methods:
        if m not in out:
            out[m] = project_l1(basic_prevalence(vc, p, layers=k, method=m))
    return {m: out[m] for m in methods}


def _estimates_many(vcs, p, k: int, methods, n=None) -> list:
    """[:func:`_estimates` of each counter set], the early-stopped EM and the converged NPMLE of
    all sets on one batched path (:func:`aggregator.estimate.em_prevalences_many`, equal to
    rounding): for the simulated states, whose fits only rank the candidates. The real
    counters' fits stay :func:`_estimates` (the release is reproducible bit for bit).
    With ``n`` the early-stopped EM takes its likelier start as the real counters' does
    (:func:`_take_likelier_start`; the shrunk start's fits in one batch too)."""
    from .estimate import (DIRECT_START_SMOOTH_SHARE, basic_prevalence, deconvolved_batch,
                           em_prevalences_many, project_l1)

    if not ("deconvolution" in methods and "mle" in methods):
        out = [_estimates(vc, p, k, methods) for vc in vcs]
    else:
        out = []
        for vc, (early, full) in zip(vcs, em_prevalences_many(vcs, p, layers=k)):
            fits = {"deconvolution": project_l1(early), "mle": project_l1(full)}
            for m in methods:
                if m not in fits:
                    fits[m] = project_l1(basic_prevalence(vc, p, layers=k, method=m))
            out.append({m: fits[m] for m in methods})
    todo = [i for i, vc in enumerate(vcs) if "deconvolution" in methods
            and _two_starts(vc, k, n)]
    if todo:
        shrunk = deconvolved_batch([vcs[i] for i in todo], p, layers=k, shrunk_start=True,
                                   smooth_share=DIRECT_START_SMOOTH_SHARE)
        for i, phi in zip(todo, shrunk):
            _take_likelier_start(vcs[i], p, k, n, out[i], project_l1(phi))
    return out


def _two_starts(vc, k: int, n) -> bool:
    """Whether the early-stopped EM on these counters chooses between its two starts: direct
    mode, one noise layer, n known and at most the number of counters (see the module's
    docstring)."""
    from .estimate import _BUCKET_COUNTERS
    return k == 1 and n is not None and int(n) <= vc.total and not _BUCKET_COUNTERS.get()


def _shrunk_fit(vc, p, k: int) -> np.ndarray:
    """The early-stopped EM's projected fit from the shrunk start (direct mode's share of the
    smoothed one, ``estimate.DIRECT_START_SMOOTH_SHARE``)."""
    from .estimate import DIRECT_START_SMOOTH_SHARE, deconvolved_prevalence, project_l1
    return project_l1(deconvolved_prevalence(vc, p, layers=k, shrunk_start=True,
                                             smooth_share=DIRECT_START_SMOOTH_SHARE))


def _take_likelier_start(vc, p, k: int, n, fits: dict, shrunk: np.ndarray,
                         margin=None) -> tuple:
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


def _standin_cap(vc, fits: dict, pilots, n: int, p: float, k: int, thin: str = "scale") -> str:
    """The cap rule that brings the stand-ins to n: ``"items"`` if, for every pilot whose total
    exceeds n (the two rules differ only there), the stand-in it gives fits the counters better
    than the ``"scale"`` one by more than :data:`STANDIN_MARGIN` in log-likelihood; else
    ``thin``, the candidates' thinning rule (``"scale"``; ``"fitted"`` when bench.accuracy.lofo's
    ``auto_fitted`` asks for it, docs/accuracy_grid.md "A cap that keeps the measured items").

    Each cap rule favours the candidates with the same rule in the bootstrap (a candidate does well
    on data shaped like its own output), so the stand-ins' cap decides between the two families.
    Thinning every level (``scale``) is right for near-empty windows, where the largest noisy
    counters are noise, and wrong for heavy tails, where it thins away heavy hitters the counters
    plainly show; the likelihood tells the two apart when it can (gaps of hundreds to thousands
    where ``items`` is 10-50x better on the accuracy grid), and ``scale`` stays where it cannot.
    bench/accuracy/select_study.py compares this rule with the alternatives on the grid's counters.
    """
    gaps = []
    for pm in pilots:
        y_s, y_i = cap_total(fits[pm], int(n), "scale"), cap_total(fits[pm], int(n), "items")
        if not np.array_equal(y_s, y_i):
            ll = counter_model.loglik
            gaps.append(ll(vc, y_i, vc.total, p, k) - ll(vc, y_s, vc.total, p, k))
    return "items" if gaps and min(gaps) > STANDIN_MARGIN else thin


def _regrets(err: dict) -> dict:
    """{candidate: its error under one stand-in over the smallest error under it} (``err``:
    {candidate: summed l1 error against that stand-in}; every candidate 1 when all are 0)."""
    best = min(err.values())
    return {c: e / best if best > 0 else (1.0 if e == 0 else np.inf) for c, e in err.items()}


def _minimax(regret: dict):
    """The candidate with the smallest worst regret over the stand-ins (``regret``: {candidate:
    [its regret under each stand-in]}); ties: the smaller mean regret, then the earlier one."""
    return min(regret, key=lambda c: (max(regret[c]), float(np.mean(regret[c]))))


def _select(noisy_counts, p, *, layers, n, pilots, candidates, sims, seed) -> tuple:
    from .estimate import (
        _check_layers, _data_seed, counts_from_cumulative, noisy_value_counts,
        basic_prevalence, project_l1, sparse_top,
    )

    vc = noisy_value_counts(noisy_counts)
    k = _check_layers(layers)
    D = vc.total
    if n is None:
        candidates = tuple(dict.fromkeys((m, "none") for m, _ in candidates))
    from .estimate import threshold_usable
    if not threshold_usable(p, k):  # many layers (rollups): its kernel amplifies noise 1e6+ fold
        candidates = tuple(c for c in candidates if c[0] != "threshold")

    thin = "fitted" if any(c == "fitted" for _, c in candidates) else "scale"

    def axis_top(counters):  # what cap "fitted" keeps whole (only asked for with that rule)
        return sparse_top(counters, p, k) if thin == "fitted" else None

    def cap(y, total, rule, top):
        if rule == "none" or total is None:
            return y
        return cap_total(y, int(total), rule, fitted_top=top)

    methods = tuple(dict.fromkeys(m for m, _ in candidates))
    fits = _estimates(vc, p, k, [m for m in dict.fromkeys(pilots + methods)
                                 if m in pilots or m == "threshold"])
    start = None  # (shrunk start taken?, the other start's fit) when the EM chose between them
    if "deconvolution" in fits and _two_starts(vc, k, n):
        start = _take_likelier_start(vc, p, k, n, fits, _shrunk_fit(vc, p, k))
    remember_fits(vc, p, k, fits)  # the error bars' stand-ins are two of them
    rng = np.random.default_rng(_data_seed(vc) if seed is None else seed)
    regret: dict = {c: [] for c in candidates}
    standin_cap = _standin_cap(vc, fits, pilots, n, p, k, thin) if n is not None else "none"
    top = axis_top(vc)
    stand_ins, states = [], []  # every stand-in's states drawn first, then fitted in one batch
    for pm in pilots:
        y_p = cap(fits[pm], n, standin_cap, top)
        if len(y_p) and y_p[0] > D:  # more items than counters (only without n): keep the top
            truth = counts_from_cumulative(y_p)[:D]
            y_p = np.asarray(np.cumsum(np.bincount(truth)[::-1])[::-1][1:], dtype=np.int64)
        stand_ins.append(y_p)
        states += [counter_model.simulate_from_cumulative(rng, y_p, D, p, k)
                   for _ in range(int(sims))]
    fitted = iter(zip(states, _estimates_many(states, p, k, methods, n)))
    for y_p in stand_ins:
        total = int(y_p.sum()) if n is not None else None
        err = {c: 0.0 for c in candidates}
        for _ in range(int(sims)):
            sim, ests = next(fitted)
            top_sim = axis_top(sim) if total is not None else None
            for m in methods:
                y = ests[m]
                for c in candidates:
                    if c[0] == m:
                        err[c] += cumulative_l1(cap(y, total, c[1], top_sim), y_p)
        for c, r in _regrets(err).items():
            regret[c].append(r)
    choice = _minimax(regret)
    m, rule = choice
    y = fits[m] if m in fits else project_l1(basic_prevalence(vc, p, layers=k, method=m))
    if m != "deconvolution" or start is None:
        start = None
    else:
        start = (start[0], cap(start[1], n, rule, top))
    return cap(y, n, rule, top), choice, start


def selected_prevalence(noisy_counts, p, *, layers=1, n=None) -> np.ndarray:
    """phi_{>=r} of :func:`select` as floats (``estimators.phi_estimate(method="auto")``)."""
    return select(noisy_counts, p, layers=layers, n=n)[0].astype(np.float64)
