"""The release's anonymized histogram from noisy counters, direct or hashed.

:func:`anonymized_histogram` is the one entry point a release calls: the named (or default)
estimator of :mod:`aggregator.estimators` on the counters, the l1 (or l2) projection, the cap at
the public n; with ``buckets`` the counters are hash buckets and the collisions are undone
(:mod:`aggregator.largedomain`). :func:`anonymized_cumulative` is the same release as its
cumulative prevalence, and :func:`anonymized_cumulative_many` fits many counter sets at once (the
bootstrap's re-estimates in :mod:`aggregator.intervals`).

Everything here is post-processing of the noisy counters and public quantities (n, D or B, p,
layers).
"""

from __future__ import annotations

import math

import numpy as np

# deconv_tol looked up at call time: bench.accuracy.lofo --fixed-tol swaps it
from . import deconvolution
from .cap import CAP_RULES, cap_total
from .counters import check_layers, noisy_value_counts
from .deconvolution import DECONV_MAX_ITER, DECONV_TOL, MLE_MAX_ITER, MLE_TOL, deconvolved_batch
from .em import DIRECT_START_SMOOTH_SHARE
from .histograms import checked_cumulative, counts_from_cumulative
from .memo import ReleaseMemo, remembered_fit
from .projection import project_l1, project_l2, rank_box
from .estimators import default_cap, default_method, phi_estimate
from .largedomain import (
    DEFAULT_VARIANT,
    HASHED_CAP_RULES,
    _check_buckets,
    _hashed_cumulative,
    hashed_cumulative,
    hashed_histogram,
)

__all__ = ["anonymized_histogram", "anonymized_cumulative", "anonymized_cumulative_many"]


def anonymized_cumulative_many(
    many, p, *, layers=1, n=None, method=None, buckets=None, cap=None, shrunk_start=None
) -> list:
    """[:func:`anonymized_cumulative` of each counter set], the EM estimators of direct mode
    fitted together (:func:`deconvolved_batch`: equal to rounding, not bit for bit); for the
    bootstrap's re-estimates. Everything else: one call per counter set. ``shrunk_start``:
    the early-stopped EM from that start for every set (the release's choice: hashed mode's
    ``largedomain.chosen_start``, direct mode's ``selection.chosen_start``); None: hashed, each
    set's likelier one; direct, the smoothed start (the named estimator's)."""
    many = list(many)
    k = check_layers(layers)
    if method not in ("deconvolution", "mle") or not many:
        return [
            anonymized_cumulative(x, p, layers=layers, n=n, method=method, buckets=buckets, cap=cap)
            for x in many
        ]
    if method == "mle":
        iters = (MLE_MAX_ITER, MLE_TOL)
    else:
        iters = (
            DECONV_MAX_ITER,
            DECONV_TOL if buckets is not None else deconvolution.deconv_tol(p, k),
        )
    vcs = [noisy_value_counts(x) for x in many]
    start = bool(shrunk_start) and method == "deconvolution"
    phis = deconvolved_batch(
        vcs,
        p,
        layers=k,
        max_iter=iters[0],
        tol=iters[1],
        shrunk_start=start,
        smooth_share=None if buckets is not None else DIRECT_START_SMOOTH_SHARE,
    )
    if buckets is not None:  # the bucket counters' estimates, then the inversion of each
        B = _check_buckets(buckets)
        out = []
        for vc, phi in zip(vcs, phis):
            if vc.total != B:
                raise ValueError(f"buckets={B} but {vc.total} counters were given")
            rule = cap if cap is not None else default_cap("hashed", k)
            if rule not in HASHED_CAP_RULES:
                raise ValueError(f"cap must be one of {HASHED_CAP_RULES}, got {rule!r}")
            out.append(
                checked_cumulative(
                    _hashed_cumulative(
                        vc,
                        p,
                        B,
                        n,
                        k,
                        method,
                        DEFAULT_VARIANT,
                        None,
                        rule,
                        phi=phi,
                        shrunk_start=shrunk_start,
                    )
                )
            )
        return out
    out = []
    for vc, phi in zip(vcs, phis):
        y = project_l1(phi)
        if n is not None:
            rule = cap if cap is not None else default_cap("direct", k)
            if rule not in CAP_RULES:
                raise ValueError(f"cap must be one of {CAP_RULES}, got {rule!r}")
            y = cap_total(y, n, rule)
        out.append(checked_cumulative(y))
    return out


def anonymized_cumulative(
    noisy_counts,
    p,
    *,
    layers=1,
    n=None,
    method=None,
    buckets=None,
    cap=None,
    memo: ReleaseMemo | None = None,
) -> np.ndarray:
    """The l1 release of :func:`anonymized_histogram` as its cumulative prevalence phi_{>=r},
    r = 1..(the largest count) (int64, no trailing zeros): ``counts_from_cumulative`` of it is
    exactly ``anonymized_histogram(..., loss="l1")``, and it is what the bootstrap and the
    properties need, without listing millions of counts and counting them again.
    ``memo``: the release's :class:`aggregator.memo.ReleaseMemo`; a fit it holds of these
    counters is taken instead of fitting again (the same numbers; None: fit afresh).
    """
    vc = noisy_value_counts(noisy_counts)
    k = check_layers(layers)
    mode = "hashed" if buckets is not None else "direct"
    if method is None:
        method = default_method(mode, k)
    cap = default_cap(mode, k) if cap is None else cap
    if buckets is not None:
        y = hashed_cumulative(
            vc, p, buckets=buckets, n=n, layers=layers, method=method, cap=cap, memo=memo
        )
    else:
        if cap not in CAP_RULES:
            raise ValueError(f"cap must be one of {CAP_RULES}, got {cap!r}")
        y = remembered_fit(memo, vc, p, k, method)
        if y is None:
            y = project_l1(phi_estimate(vc, p, layers=k, method=method, n=n, memo=memo))
        if n is not None:
            y = cap_total(y, n, cap)
    return checked_cumulative(y)


def anonymized_histogram(
    noisy_counts,
    p,
    *,
    layers=1,
    loss="l1",
    n=None,
    method=None,
    buckets=None,
    cap=None,
    memo: ReleaseMemo | None = None,
):
    """Estimate the anonymized histogram from counters noised with ``layers`` DLap(p) layers.

    Parameters
    ----------
    noisy_counts
        The noisy counters (int array) or their :class:`NoisyValueCounts`.
    p
        DLap parameter of each layer (``state.p``).
    layers
        Number of independent DLap(p) layers in each counter (``state.layers``).
    loss
        ``"l1"`` (Algorithm 1/5: l1 isotonic projection) or ``"l2"`` (Algorithm 3: adds
        sum = n and the rank box gamma = 10 log(2 n D) / log(1/p); needs ``n``).
    n
        Number of events (public under replace-one). Required for ``"l2"`` (sum = n); with
        ``"l1"`` the histogram is capped at n events (:func:`cap_total`).
    method
        Estimator of phi (:data:`METHODS`). Default: :func:`default_method` (mode, layers), the
        lowest worst-case regret over the accuracy grid (docs/accuracy_grid.md).
    buckets
        Number of hash buckets B when the counters are a hashed-mode state (``state.size``).
        Collisions are then undone by inverting Gamma^B
        (:func:`aggregator.largedomain.hashed_histogram`; docs/large_domains.md).
    cap
        How the total is capped at ``n`` (:data:`CAP_RULES`; default :func:`default_cap`;
        ``"none"`` leaves the l1 projection as it is). Ignored without ``n``.
    memo
        The release's :class:`aggregator.memo.ReleaseMemo`, to hand what the estimate derived
        to its error bars (:func:`aggregator.release.estimate_with_accuracy`); None: kept nowhere.

    Returns
    -------
    int64 array of counts in decreasing order, zeros dropped.

    Examples
    --------
    >>> import numpy as np
    >>> from aggregator.noise import discrete_laplace
    >>> true = np.array([50, 20, 20, 5] + [0] * 96)
    >>> noisy = true + discrete_laplace(0.2, 100)
    >>> est = anonymized_histogram(noisy, 0.2)
    >>> bool(np.all(np.diff(est) <= 0)) and est.dtype == np.int64
    True
    """
    if loss == "l1":
        return counts_from_cumulative(
            anonymized_cumulative(
                noisy_counts,
                p,
                layers=layers,
                n=n,
                method=method,
                buckets=buckets,
                cap=cap,
                memo=memo,
            )
        )
    vc = noisy_value_counts(noisy_counts)
    k = check_layers(layers)
    if buckets is not None:
        if method is None:
            method = default_method("hashed", k)
        if cap is None:
            cap = default_cap("hashed", k)
        return hashed_histogram(
            vc, p, buckets=buckets, n=n, layers=layers, loss=loss, method=method, cap=cap, memo=memo
        )
    if loss != "l2":
        raise ValueError(f"loss must be 'l1' or 'l2', got {loss!r}")
    if method is None:
        method = default_method("direct", k)
    cap = default_cap("direct", k) if cap is None else cap
    if cap not in CAP_RULES:
        raise ValueError(f"cap must be one of {CAP_RULES}, got {cap!r}")
    phi_hat = phi_estimate(vc, p, layers=k, method=method, n=n, memo=memo)
    if n is None:
        raise ValueError("loss='l2' needs n (the number of events, public under replace-one)")
    n = int(n)
    D = vc.total
    gamma = 10.0 * math.log(max(2 * n * D, 2)) / math.log(1.0 / p)
    R = max(len(phi_hat), int(vc.hi + gamma) + 1, 1)
    phi_hat = np.concatenate([phi_hat, np.zeros(R - len(phi_hat))])
    lower, upper = rank_box(vc, gamma, R)
    y = project_l2(phi_hat, n, lower, upper)
    if y is None:  # as the paper: infeasible -> the all-zero histogram
        return np.zeros(0, dtype=np.int64)
    return counts_from_cumulative(y)
