"""Cross-fitting: the EM stopped where the held-out likelihood peaks (``"xfit"``).

The NPMLE's l1 error first falls, then rises with the EM steps, and where it turns depends on the
data: no fixed tolerance suits dense and mostly-empty counters alike. Cross-fitting reads the
stopping point from the data. Split the counters at random into halves A and B (from the value
counts alone: a multivariate hypergeometric draw; the counters are exchangeable given their
prevalences, so each half samples the same law). Run the EM on A and read, at checkpoints
t = 0, 1, 2, 3, then every ~1.25x more steps,

    l_B(t) = sum_{bins b} c^B_b log (pi^A_t * q)_b,

the log-likelihood of B's noisy values under A's fit (bins of at least :data:`XFIT_BIN`
counters, so a fit is not rewarded for guessing where the other half's isolated items sit); the
same with the halves swapped. The EM on all the counters stops at t* = argmax_t l_B(t) + l_A(t).
With the public n every M-step keeps sum_h h pi_h = n / D.

The split's randomness is seeded from the counters (:func:`aggregator.counters.data_seed`):
post-processing, and the release is reproducible.

Parameters: ``noisy_counts``, ``p``, ``layers``, ``n`` as in :mod:`aggregator.deconvolution`;
``max_iter`` the last checkpoint; ``seed`` the split's (default: from the counters);
``return_steps`` also return t*; ``bin_min`` the held-out bins' size.

>>> import numpy as np
>>> g = np.random.default_rng(1)
>>> h = np.concatenate([g.integers(1, 6, 300), np.zeros(700, np.int64)])
>>> noisy = h + g.integers(-1, 2, len(h))     # stand-in noise: a doctest, not a release
>>> y, steps = crossfit_prevalence(noisy, 0.3, return_steps=True)
>>> steps >= 0 and len(y) > 0
True

References: the sample-splitting idea of cross-validated early stopping (e.g. Chernozhukov et al.
2018 for cross-fitting); docs/accuracy_grid.md for why ``"xfit"`` is selectable but not a
default.
"""

from __future__ import annotations

import numpy as np

from .counters import NoisyValueCounts, check_layers, data_seed, noisy_value_counts
from .em import EMProblem, em_problem, squarem

__all__ = ["XFIT_MAX_ITER", "XFIT_TOL", "XFIT_BIN", "XFIT_PATIENCE", "crossfit_prevalence"]


# Cross-fitting: the stopping point of the EM from held-out likelihood
XFIT_MAX_ITER = 400
XFIT_TOL = 1e-14  # numerical convergence only
XFIT_BIN = 30  # held-out likelihood on bins of at least this many counters (all the data)
XFIT_PATIENCE = 4  # checkpoints past the held-out maximum before a half's run stops


def _checkpoints(max_iter: int) -> list[int]:
    """SQUAREM step counts at which the held-out likelihood is read: 0, 1, 2, 3, then ~1.25x."""
    out, s = [0, 1, 2, 3], 3.0
    while out[-1] < max_iter:
        s *= 1.25
        out.append(min(max(int(round(s)), out[-1] + 1), max_iter))
    return out


def _split(vc: NoisyValueCounts, seed) -> tuple[NoisyValueCounts, NoisyValueCounts]:
    """A uniformly random half of the counters and the rest, from the value counts alone (a
    multivariate hypergeometric draw)."""
    rng = np.random.default_rng(seed)
    a = rng.multivariate_hypergeometric(vc.c, vc.total // 2, method="marginals")
    return NoisyValueCounts(vc.lo, a.astype(np.int64)), NoisyValueCounts(vc.lo, vc.c - a)


def _bins(prob: EMProblem, bin_min: int) -> np.ndarray:
    """Start positions of bins on the EM axis holding >= ``bin_min`` counters each (all data).

    Where counters are dense (small counts) a bin is one value; in a sparse tail a bin spans
    many values, so the held-out score does not reward a fit for guessing where the other
    half's isolated items sit (it cannot, and that is not what the l1 error measures)."""
    cs = np.cumsum(prob.w)
    # greedy: a new bin starts once the current one holds bin_min counters
    edges = np.searchsorted(cs, np.arange(bin_min, cs[-1] + bin_min, bin_min), side="left") + 1
    starts = np.unique(np.concatenate([[0], edges[edges < len(cs)]]))
    return starts


def crossfit_prevalence(
    noisy_counts,
    p,
    *,
    layers=1,
    n=None,
    max_iter=XFIT_MAX_ITER,
    R=None,
    seed=None,
    return_steps=False,
    bin_min=XFIT_BIN,
):
    """phi_{>=r}, r = 1..R, from the EM stopped where held-out likelihood peaks (cross-fitting).

    The NPMLE's l1 error first falls, then rises with the EM steps, and where it turns depends on
    the data (dense, near-uniform counters overfit early; mostly empty counters with several
    layers need hundreds of steps): no fixed tolerance suits both. Here the counters are split at
    random into two halves A and B (from the noisy-value counts alone: a multivariate
    hypergeometric draw; counters are exchangeable given their prevalences, so each half is a
    sample of the same prevalence law). EM runs on A, and at checkpoints (0, 1, 2, 3, then every
    ~1.25x more SQUAREM steps) the log-likelihood of B's noisy values under A's fit is read; the
    same with the halves swapped. The step count with the largest summed held-out
    log-likelihood is where EM stops on all the counters. Nothing here scales with the number of
    empty counters: the criterion is a likelihood of real data, not a tolerance.

    Held-out likelihood is read on the clusters the EM fits (clusters of a single noisy value
    are solved exactly, whatever the stopping point). The split's randomness is post-processing
    of the counters, seeded from them (:func:`data_seed`), so a release is reproducible.
    With ``n`` (the number of events, public under replace-one) every EM step is the exact
    M-step under sum_h h pi_h = n / D (:func:`mean_m_step`): the fit never holds more or fewer
    events than the stream had, the constraint the cap rules (:func:`cap_total`) apply only
    after the fact. The halves use the same mean (their counters are a random half of the same
    prevalences; clusters solved exactly are left out of both). ``return_steps=True`` also
    returns the chosen step count.
    """
    vc = noisy_value_counts(noisy_counts)
    k = check_layers(layers)
    prob = em_problem(vc, p, k)
    if not prob.spans:
        est = prob.cumulative(None, R)
        return (est, 0) if return_steps else est
    halves = _split(vc, data_seed(vc) if seed is None else seed)
    parts = [prob.counts_on_axis(h) for h in halves]
    mean = prob.mean_constraint(n)
    starts = _bins(prob, bin_min)
    cps = _checkpoints(max_iter)
    cps_set = set(cps)
    q = prob.q
    scores = []
    for fit, held in ((parts[0], parts[1]), (parts[1], parts[0])):
        if fit.sum() == 0 or held.sum() == 0:
            continue
        w = fit / fit.sum()
        hb = np.add.reduceat(held, starts)
        nz_h = hb > 0
        score = {}  # SQUAREM step -> held-out log-likelihood

        def read(step, pi, hb=hb, nz_h=nz_h, score=score):
            if step not in cps_set:
                return False
            m = np.add.reduceat(np.convolve(pi, q, mode="same"), starts)
            score[step] = float((hb[nz_h] * np.log(np.maximum(m[nz_h], 1e-300))).sum())
            top = max(score, key=score.get)
            return cps.index(step) - cps.index(top) >= XFIT_PATIENCE

        pi0 = prob.start(w)
        if not read(0, pi0):
            squarem(
                pi0,
                w,
                w > 0,
                q,
                prob.allowed,
                max_iter,
                XFIT_TOL,
                prob.zero_idx,
                callback=read,
                mean=mean,
            )
        scores.append(score)
    # the steps both halves reached (a half stops once it is well past its held-out maximum)
    steps = sorted(set.intersection(*(set(s) for s in scores))) if scores else []
    star = max(steps, key=lambda s: sum(sc[s] for sc in scores)) if steps else max_iter
    w = prob.w / prob.w.sum()
    pi = prob.start(w)
    if star > 0:
        pi = squarem(pi, w, w > 0, q, prob.allowed, star, XFIT_TOL, prob.zero_idx, mean=mean)
    est = prob.cumulative(pi, R)
    return (est, star) if return_steps else est
