"""Deconvolution: the EM for the prevalences, stopped early (``"deconvolution"``) or run to
convergence (``"mle"``).

The estimate is D P_pi[h >= r] for the EM's pmf pi (:mod:`aggregator.em`), r = 1..R. Where the EM
stops is the estimator:

* ``"mle"``: to convergence (:data:`MLE_TOL` on the mean log-likelihood gain per step, at most
  :data:`MLE_MAX_ITER` SQUAREM steps): the NPMLE, a fixed function of the counters. It overfits
  into spikes on dense counters.
* ``"deconvolution"``: stopped when the gain per informative counter and step falls below
  tol_k = :data:`DECONV_TOL` chi2_k / chi2_1 (:func:`deconv_tol`), with

      chi2_k = sum_v (q(v - 1) - q(v))^2 / q(v)

  the Fisher information one counter holds about a one-event shift under k layers
  (:func:`chi2_shift`): k layers carry less information per counter, so every step gains less.
  On hash-bucket counters (``hashed=True``) the tolerance stays at :data:`DECONV_TOL`.

The l1 error first falls, then rises along the EM's path, which is why stopping early is part of
the estimator (docs/estimators.md has the measurements). :func:`em_prevalences` gives both from
one run (the NPMLE continues the early-stopped path); :func:`deconvolved_batch` fits many counter
sets in one loop (equal to rounding, for the bootstrap and ``auto``'s simulated states).

Parameters (of the estimators here): ``noisy_counts`` the counters or their value counts, ``p``,
``layers``; ``n`` the public number of events (every M-step then under sum_h h pi_h = n / D);
``hashed``: the counters are hash buckets.

>>> import numpy as np
>>> y = deconvolved_prevalence(np.array([3, 0, 1, 0, 0, 2, 0, 0]), 0.3)
>>> bool(np.all(np.diff(y) <= 1e-9) and 0 < y[0] <= 8)
True
>>> round(deconv_tol(0.6065306597126334, 2) / DECONV_TOL, 3)   # 2 layers at eps = 1
0.308

References: Laird (1978) and Varadhan and Roland (2008) (see :mod:`aggregator.em`); the choice of
tolerance: docs/accuracy_grid.md ("Layer cost") and docs/estimators.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .counters import check_layers, noise_pmf, noisy_value_counts
from .em import em_problem, squarem

__all__ = [
    "DECONV_MAX_ITER",
    "DECONV_TOL",
    "MLE_MAX_ITER",
    "MLE_TOL",
    "chi2_shift",
    "deconv_tol",
    "deconvolved_prevalence",
    "em_prevalences",
    "em_prevalences_many",
    "deconvolved_batch",
]


DECONV_MAX_ITER = 200  # the early-stopped EM ("deconvolution"): see deconvolved_prevalence
DECONV_TOL = 1e-5  # for one layer; k layers: deconv_tol(p, k)


# "mle" is the EM of deconvolved_prevalence run to convergence: MLE_TOL on the normalized
# log-likelihood gain, at most MLE_MAX_ITER SQUAREM steps (a bound on the time; reached at
# eps = 0.5 with millions of counters).
MLE_MAX_ITER = 1000
MLE_TOL = 1e-9


def chi2_shift(p: float, layers: int = 1) -> float:
    """chi2_k = sum_v (q(v-1) - q(v))^2 / q(v) for q the pmf of ``layers`` DLap(p) draws.

    >>> p = 0.5
    >>> round(chi2_shift(p), 6) == round((1 - p) ** 2 / p, 6)
    True
    """
    _, q = noise_pmf(p, layers)
    shifted = np.concatenate([[0.0], q[:-1]])  # q(v - 1)
    return float(np.sum((shifted - q) ** 2 / q))


def deconv_tol(p: float, layers: int = 1, *, hashed: bool = False) -> float:
    """The early-stopped EM's tolerance for counters carrying ``layers`` DLap(p) layers:
    :data:`DECONV_TOL` times chi2_k / chi2_1, the Fisher information a counter holds about a
    one-event shift under k layers relative to one (chi2_k = sum_v (q(v-1) - q(v))^2 / q(v),
    q the k-layer noise pmf; :func:`chi2_shift`).

    Why: the tolerance is on the mean log-likelihood gain per counter and step, and with k
    layers each counter carries chi2_k / chi2_1 of the information, so every step gains that
    much less: a fixed tolerance stopped the 2-layer EM at a point the 1-layer EM passes early,
    at a large cost in error on the held-out real profile.

    Direct mode only: on hash-bucket counters (``hashed=True``, which hashed mode's estimators
    pass) the scaled tolerance made the 2-layer default worse, so it stays at
    :data:`DECONV_TOL`. The figures: docs/core_figures.md, "The early stop".

    >>> deconv_tol(0.5, 1) == DECONV_TOL
    True
    >>> round(deconv_tol(0.6065306597126334, 2) / DECONV_TOL, 3)
    0.308
    """
    k = check_layers(layers)
    if k == 1 or hashed:
        return DECONV_TOL
    return DECONV_TOL * chi2_shift(p, k) / chi2_shift(p, 1)


def deconvolved_prevalence(
    noisy_counts,
    p,
    *,
    layers=1,
    max_iter=DECONV_MAX_ITER,
    tol=None,
    R=None,
    n=None,
    shrunk_start=False,
    smooth_share=None,
    hashed=False,
) -> np.ndarray:
    """phi_{>=r}, r = 1..R, from the NPMLE of the prevalences (EM deconvolution).

    Model: each counter's noisy value is h + Z with Z the sum of ``layers`` DLap(p) draws
    (pmf q, exact up to a 1e-17 tail) and h drawn from the unknown prevalence pmf pi over
    {0, 1, ...}; D = number of counters. The estimate is D * P_pi[h >= r].

    Early stopping is part of the estimator: the NPMLE overfits (it turns spiky) when EM runs to
    convergence, and the l1 error first falls, then rises with the iterations. ``tol`` (on the
    mean log-likelihood gain per SQUAREM step) = 1e-5 was never worse than running to
    convergence in the measurements (docs/core_figures.md, "The early stop");
    :func:`aggregator.crossfit.crossfit_prevalence` chooses the stopping point from the data
    instead.

    The likelihood separates over clusters of noisy values more than 2K apart (q vanishes
    beyond K): a cluster holding a single distinct value v is solved exactly by a point mass at
    max(v, 0); the remaining clusters run EM (SQUAREM-accelerated) on one compressed axis where
    each cluster keeps its own span and spans are separated by zeros that the kernel cannot cross.

    ``shrunk_start``: start from the shrunk pmf (:meth:`EMProblem.start`), not the smoothed one,
    with ``smooth_share`` of the smoothed one in it (default :data:`START_SMOOTH_SHARE`).
    """
    vc = noisy_value_counts(noisy_counts)
    k = check_layers(layers)
    tol = deconv_tol(p, k, hashed=hashed) if tol is None else tol
    prob = em_problem(vc, p, k)
    if not prob.spans:
        return prob.cumulative(None, R)
    w = prob.w / prob.w.sum()
    pi = squarem(
        prob.start(w, shrunk_start, smooth_share),
        w,
        w > 0,
        prob.q,
        prob.allowed,
        max_iter,
        tol,
        prob.zero_idx,
        mean=prob.mean_constraint(n),
    )
    return prob.cumulative(pi, R)


def em_prevalences(
    noisy_counts, p, *, layers=1, R=None, hashed=False
) -> tuple[np.ndarray, np.ndarray]:
    """(``"deconvolution"``'s phi_{>=r}, ``"mle"``'s phi_{>=r}) from one EM run.

    Both estimators run the same deterministic SQUAREM path from the same start and differ only
    in where they stop (DECONV_TOL / DECONV_MAX_ITER, then MLE_TOL / MLE_MAX_ITER), so the
    converged NPMLE continues the early-stopped run: the pair is exactly what the two separate
    calls return, for the cost of the longer one (``method="auto"`` needs both, many times).
    """
    vc = noisy_value_counts(noisy_counts)
    prob = em_problem(vc, p, check_layers(layers))
    if not prob.spans:
        est = prob.cumulative(None, R)
        return est, est.copy()
    w = prob.w / prob.w.sum()
    early, pi = squarem(
        prob.start(w),
        w,
        w > 0,
        prob.q,
        prob.allowed,
        MLE_MAX_ITER,
        MLE_TOL,
        prob.zero_idx,
        early=(DECONV_MAX_ITER, deconv_tol(p, layers, hashed=hashed)),
    )
    return prob.cumulative(early, R), prob.cumulative(pi, R)


def em_prevalences_many(many, p, *, layers=1, hashed=False) -> list:
    """[:func:`em_prevalences` of each counter set], all sets on one batched path
    (:func:`deconvolved_batch`: equal to rounding, not bit for bit): for ``auto``'s simulated
    states, whose fits only rank its candidates."""
    return deconvolved_batch(
        many,
        p,
        layers=layers,
        max_iter=MLE_MAX_ITER,
        tol=MLE_TOL,
        early=(DECONV_MAX_ITER, deconv_tol(p, layers, hashed=hashed)),
    )


def deconvolved_batch(
    many,
    p,
    *,
    layers=1,
    max_iter=DECONV_MAX_ITER,
    tol=None,
    shrunk_start=False,
    smooth_share=None,
    early=None,
    hashed=False,
) -> list:
    """:func:`deconvolved_prevalence` (without n) of several counter sets at once: one SQUAREM
    loop over a matrix with one row per counter set (each row stops at its own step, by the
    same rule), so the ~25 numpy calls of an EM step are made once per step for all of them.
    For the bootstrap's re-estimates (10-20 small EM problems per release) and ``auto``'s
    simulated states.

    ``early`` = (max_iter, tol) of a looser stop on the same path, as in :func:`squarem`: each
    item of the result is then the pair (phi at the early stop, phi at this run's stop);
    :func:`em_prevalences_many` asks for :func:`em_prevalences`'s pair this way.

    The rows share one FFT length (the longest axis'), so a row's convolutions round
    differently from a run of its own: the results equal :func:`deconvolved_prevalence`'s to
    rounding (1e-12 relative on phi_{>=r}), not bit for bit; use that function where the
    result must be reproducible exactly (the release itself). ``shrunk_start`` and
    ``smooth_share`` as there.
    """
    k = check_layers(layers)
    tol = deconv_tol(p, k, hashed=hashed) if tol is None else tol
    vcs = [noisy_value_counts(x) for x in many]
    probs = [em_problem(vc, p, k) for vc in vcs]
    # each item phi_{>=r}, or with ``early`` the pair (early phi, final phi)
    out: list[Any] = [None if prob.spans else prob.cumulative(None) for prob in probs]
    if early is not None:  # a set with nothing to fit: its early and final estimate are one
        out = [None if y is None else (y, y.copy()) for y in out]
    todo = [i for i, prob in enumerate(probs) if prob.spans]
    if not todo:
        return out
    from scipy import fft  # noqa: PLC0415 (imported on first use: the CLI starts without it)

    q = probs[todo[0]].q
    L = max(len(probs[i].w) for i in todo)
    size = fft.next_fast_len(L + len(q) - 1, real=True)
    half = (len(q) - 1) // 2
    spec = fft.rfft(q, size)

    def conv(X):
        buf = np.zeros((len(X), size))
        buf[:, :L] = X
        Y = fft.irfft(fft.rfft(buf, axis=1) * spec, size, axis=1)[:, half : half + L]
        return np.maximum(Y, 1e-15 * np.maximum(Y.max(axis=1), 0.0)[:, None])

    B = len(todo)
    W, A, P = np.zeros((B, L)), np.zeros((B, L)), np.zeros((B, L))
    zero = np.full(B, -1)
    for j, i in enumerate(todo):
        prob = probs[i]
        w = prob.w / prob.w.sum()
        W[j, : len(w)], A[j, : len(w)] = w, prob.allowed
        P[j, : len(w)] = prob.start(w, shrunk_start, smooth_share)
        if prob.zero_idx is not None:
            zero[j] = prob.zero_idx
    # W is 0 where no counter is: W / max(M, 1e-300) is the EM's ratio there too (0), so the
    # steps need no masks; Wr, Ar, zr: the rows still running

    def em_step(Pi, M, Wr):
        return Pi * conv(Wr / np.maximum(M, 1e-300))

    def loglik(Pi, Wr):
        M = conv(Pi)
        return (Wr * np.log(np.maximum(M, 1e-300))).sum(axis=1), M

    rows = np.arange(B)  # the rows still running (indices into W, A, zero)
    Wr, Ar, zr = W, A, zero
    ll, M = loglik(P, Wr)
    result: list[np.ndarray | None] = [None] * B
    # (with early) each row's pi where the looser stop first held
    early_result: list[np.ndarray | None] = [None] * B
    for step in range(1, max_iter + 1):
        P1 = em_step(P, M, Wr)
        P2 = em_step(P1, conv(P1), Wr)
        R = P1 - P
        V = P2 - P1 - R
        vv, rr = (V * V).sum(axis=1), (R * R).sum(axis=1)
        ok = vv > 0
        alpha = np.minimum(-np.sqrt(rr / np.where(ok, vv, 1.0)), -1.0)[:, None]
        with np.errstate(over="ignore", invalid="ignore"):
            cand = np.maximum(P - 2 * alpha * R + alpha * alpha * V, 0.0) * Ar
            cs = cand.sum(axis=1)
            ok &= np.isfinite(cand).all(axis=1) & (cs > 0)  # else the step overflowed: plain EM
        ll_c = np.full(len(rows), -np.inf)
        if ok.all():
            C = cand / cs[:, None]
            C = em_step(C, conv(C), Wr)
            ll_c, M_c = loglik(C, Wr)
        elif ok.any():
            Ws = Wr[ok]
            C = cand[ok] / cs[ok][:, None]
            C = em_step(C, conv(C), Ws)
            ll_c[ok], M_c = loglik(C, Ws)
        ll2, M2 = loglik(P2, Wr)
        use = ll_c >= ll2
        new, M_new = P2, M2
        if use.any():
            at = np.flatnonzero(ok)
            pick = use[at]
            new[at[pick]], M_new[at[pick]] = C[pick], M_c[pick]
        ll_new = np.where(use, ll_c, ll2)
        s = new.sum(axis=1)[:, None]
        new, M_new = new / s, M_new / s
        denom = np.where(
            zr >= 0, np.maximum(1.0 - new[np.arange(len(rows)), np.maximum(zr, 0)], 1e-6), 1.0
        )
        gain = (ll_new - ll) / denom
        P, ll, M = new, np.maximum(ll_new, ll), M_new
        if early is not None:
            for ri in np.flatnonzero((gain < early[1]) | (step >= early[0])):
                if early_result[rows[ri]] is None:
                    early_result[rows[ri]] = P[ri].copy()
        done = (gain < tol) | (step >= max_iter)
        if done.any():
            for ri in np.flatnonzero(done):
                result[rows[ri]] = P[ri]
            keep = ~done
            rows, P, ll, M = rows[keep], P[keep], ll[keep], M[keep]
            if not len(rows):
                break
            Wr, Ar, zr = W[rows], A[rows], zero[rows]
    for j, i in enumerate(todo):
        prob = probs[i]
        last = result[j]
        assert last is not None  # every row stops by max_iter at the latest
        out[i] = prob.cumulative(last[: len(prob.w)])
        if early is not None:
            first = early_result[j]
            first = last if first is None else first
            out[i] = (prob.cumulative(first[: len(prob.w)]), out[i])
    return out
