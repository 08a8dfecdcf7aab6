"""The noisy-counter model: what a histogram implies for k-layer DLap(p) counters.

Every counter holds its count h plus ``layers`` independent DLap(p) draws (pmf q, exact up to a
1e-17 tail: :func:`aggregator.counters.noise_pmf`), and counters holding the same count are
exchangeable. Three things follow from that model alone, and the estimators, their selection and
their error bars all ask them, so they live below those modules:

* **Information** (:func:`noise_floor`, :func:`signal_to_noise`; :func:`chi2_shift` lives in
  :mod:`aggregator.estimate`, whose early stop scales by it): a counter's Fisher information
  about a one-event shift is chi2_k = sum_v (q(v - 1) - q(v))^2 / q(v), so no unbiased
  estimate of the number of items among C counters has a standard error below sqrt(C / chi2_k)
  (Cramer-Rao); what that means for a release is in :mod:`aggregator.intervals`.
* **Simulation** (:func:`simulate_counts`, :func:`simulate_from_cumulative`): the noisy-value
  counts a histogram gives, drawn for a parametric bootstrap (seeded, never the state's noise).
* **Likelihood** (:func:`loglik`): the log-likelihood of observed noisy-value counts if the
  counters held a given histogram.

>>> import numpy as np
>>> y = np.array([3, 1])                    # three items: counts 2, 1, 1
>>> vc = simulate_from_cumulative(np.random.default_rng(), y, 10, 0.5, 1)
>>> vc.total                                # ten counters, seven of them empty
10
>>> loglik(vc, y, 10, 0.5, 1) > loglik(vc, np.array([10] * 5), 10, 0.5, 1)
True
"""

from __future__ import annotations

import math

import numpy as np

from .convolution import convolve as _conv
from .counters import NoisyValueCounts, noise_pmf, noisy_value_counts
from .deconvolution import chi2_shift  # noqa: F401  (re-exported: information)
from .histograms import prevalences_from_cumulative

__all__ = [
    "chi2_shift",
    "noise_floor",
    "signal_to_noise",
    "simulate_counts",
    "simulate_from_cumulative",
    "simulate_grouped",
    "loglik",
]


def noise_floor(counters: int, p: float, layers: int = 1) -> float:
    """sqrt(counters / chi2_k): the Cramer-Rao standard error for the number of items."""
    if counters < 1:
        raise ValueError(f"counters must be >= 1, got {counters}")
    return math.sqrt(counters / chi2_shift(p, layers))


def signal_to_noise(n: int, counters: int, p: float, layers: int = 1) -> float:
    """n / noise_floor: events against the smallest achievable error on the number of items."""
    return float(n) / noise_floor(counters, p, layers)


def simulate_counts(
    rng: np.random.Generator, values, counters: int, p: float, layers: int
) -> NoisyValueCounts:
    """Noisy-value counts of ``values`` plus counters - len(values) zero counters.

    Each counter gets ``layers`` DLap(p) draws. Counters holding the same value are exchangeable,
    so the noisy values of the m counters at a value h are h plus one multinomial draw of m over
    the exact noise pmf (cut at a 1e-17 tail): one draw per distinct value instead of 2 x layers
    geometric draws per counter (a bootstrap state at D = 1e7 has millions of small counters
    and a few thousand distinct values); values held by one counter draw their noise directly.
    For the bootstrap only (seeded, not private): the state's noise comes from aggregator.noise.
    """
    values = np.asarray(values, dtype=np.int64)
    if len(values) > counters:
        raise ValueError("more non-zero values than counters")
    vals, mult = np.unique(values, return_counts=True)
    return simulate_grouped(rng, vals, mult, counters - len(values), p, layers)


def simulate_from_cumulative(
    rng: np.random.Generator, y, counters: int, p: float, layers: int
) -> NoisyValueCounts:
    """:func:`simulate_counts` of the histogram with cumulative prevalence ``y`` (phi_{>=r},
    r = 1..len(y)), without listing its items: the multiplicity of count r is y_r - y_{r+1}.
    Same draws as ``simulate_counts(rng, counts_from_cumulative(y), ...)`` (values in the same
    increasing order), without a sort of millions of counts."""
    y = np.asarray(y, dtype=np.int64)
    phi = prevalences_from_cumulative(y)
    vals = np.flatnonzero(phi) + 1
    items = int(y[0]) if len(y) else 0
    if items > counters:
        raise ValueError("more non-zero values than counters")
    return simulate_grouped(rng, vals, phi[vals - 1], counters - items, p, layers)


def simulate_grouped(rng, vals, mult, zeros: int, p: float, layers: int) -> NoisyValueCounts:
    """Noisy-value counts of mult[i] counters at each value vals[i] (increasing) plus ``zeros``
    empty counters (see :func:`simulate_counts`)."""
    K, q = noise_pmf(p, layers)
    if zeros:  # the empty counters: one more value, 0 (a repeated value is fine below)
        vals, mult = np.concatenate([[0], vals]), np.concatenate([[zeros], mult])
    one = mult == 1
    parts = []
    if one.any():
        h = vals[one]
        noise = np.zeros(len(h), dtype=np.int64)
        for _ in range(layers):
            noise += rng.geometric(1.0 - p, len(h)) - rng.geometric(1.0 - p, len(h))
        parts.append(noisy_value_counts(h + noise))
    if not one.all():
        parts.append(_multinomial_part(rng, vals[~one], mult[~one], K, q))
    out = parts[0]
    for part in parts[1:]:
        out = out.merge(part)
    return out


def _multinomial_part(rng, vals, mult, K: int, q: np.ndarray, rows: int = 2048) -> NoisyValueCounts:
    """Noisy-value counts of mult[i] counters at vals[i]: one multinomial draw per value (in
    blocks of ``rows`` values, so that the draws never hold more than rows x len(q) numbers)."""
    lo = int(vals.min()) - K
    size = int(vals.max()) + K + 1 - lo
    c = np.zeros(size, dtype=np.int64)
    taps = np.arange(len(q))
    for i in range(0, len(vals), rows):
        draws = rng.multinomial(mult[i : i + rows], q)  # one row per value
        idx = (vals[i : i + rows] - K - lo)[:, None] + taps
        c += np.bincount(idx.ravel(), weights=draws.ravel(), minlength=size).astype(np.int64)
    return NoisyValueCounts(lo, c)


def loglik(vc, y, counters: int, p: float, k: int) -> float:
    """log-likelihood of the noisy value counts ``vc`` if the counters held the histogram with
    cumulative prevalence ``y`` (every counter's noisy value = its value + k DLap(p) draws)."""
    K, q = noise_pmf(p, k)
    y = np.asarray(y, dtype=np.int64)
    mult = prevalences_from_cumulative(y)
    hi = max(len(y), vc.hi) + K
    lo = min(0, vc.lo) - K
    w = np.zeros(hi - lo + 1)
    w[-lo] = counters - (int(y[0]) if len(y) else 0)  # the empty counters, at value 0
    w[1 - lo : len(y) + 1 - lo] = mult
    w /= max(counters, 1)
    pred = _conv(w, q)  # pmf of a noisy value on [lo, hi]
    seen = vc.c > 0
    at = np.flatnonzero(seen) + vc.lo - lo
    pa = pred[at]
    # a wide kernel goes through an FFT, whose rounding (~1e-15 of the largest value) swamps the
    # small probabilities of the sparse tail, where one unexplained counter is the evidence:
    # those are summed directly over the stand-in values within reach K
    small = np.flatnonzero(pa < 1e-9)
    if len(small):
        nz = np.flatnonzero(w)
        for i in small:
            v = at[i]
            r = nz[np.searchsorted(nz, v - K) : np.searchsorted(nz, v + K, side="right")]
            pa[i] = float((w[r] * q[v - r + K]).sum())
    return float((vc.c[seen] * np.log(np.maximum(pa, 1e-300))).sum())
