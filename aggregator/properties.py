"""Symmetric distribution properties from an anonymized histogram.

All functions take an anonymized histogram (counts in any order; zeros ignored) and are pure
post-processing: applied to a DP release they cost no privacy (seed 001 section 5, App. C).

* :func:`entropy`: Shannon entropy of the empirical distribution, optionally with the
  Miller-Madow bias correction (S - 1) / (2n).
* :func:`support_coverage`: S_m = expected number of distinct items in m draws.
  For m <= n the exact rarefaction (subsample) estimator; for n < m <= 2n Good-Toulmin; beyond,
  the smoothed Good-Toulmin estimator of Orlitsky, Suresh and Wu with binomial or Poisson
  smoothing (the Poisson form with r = log(3/alpha) is the one seed 001 App. C.2 cites).
* :func:`support_size`: for distributions whose atoms all have mass >= 1/K, S_m with
  m = ceil(K log(3/alpha)) is within alpha K / 3 of the support size (Orlitsky et al.).
* :func:`batched_item` / :func:`support_coverage_batched`: the dense-case construction of
  seed 001 App. C.2: split the stream into batches of m events, count (item, batch) pairs in the
  (hashed) state; phi_{>=1} of that histogram divided by the number of batches estimates S_m.

Example
-------
>>> round(entropy([2, 1, 1]), 4)
1.0397
>>> support_coverage([1, 1, 1, 1], m=4)
4.0

References
----------
Orlitsky, Suresh, Wu. Optimal prediction of the number of unseen species. PNAS 2016.
Acharya, Das, Orlitsky, Suresh. A unified maximum likelihood approach for estimating symmetric
properties of discrete distributions. ICML 2017.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special
from scipy.special import bdtrc, pdtrc

__all__ = [
    "entropy",
    "entropy_prevalences",
    "support_coverage",
    "support_coverage_prevalences",
    "support_size",
    "batched_item",
    "support_coverage_batched",
    "prevalences",
]


def _counts(hist) -> np.ndarray:
    h = np.asarray(hist, dtype=np.int64).ravel()
    if np.any(h < 0):
        raise ValueError("an anonymized histogram has non-negative counts")
    return h[h > 0]


def prevalences(hist) -> tuple[np.ndarray, np.ndarray]:
    """(i, Phi_i) for every count value i present: Phi_i = number of items seen exactly i times."""
    h = _counts(hist)
    vals, phis = np.unique(h, return_counts=True)
    return vals, phis


def entropy(hist, *, correction: str | None = None, base: float = math.e) -> float:
    """Shannon entropy of the empirical distribution n_j / n.

    ``correction="miller-madow"`` adds (S - 1) / (2n), S = number of items seen, which removes
    the first-order downward bias of the plug-in estimate.
    """
    h = _counts(hist).astype(np.float64)
    n = h.sum()
    if n == 0:
        return 0.0
    H = math.log(n) - float(np.dot(h, np.log(h))) / float(n)
    if correction == "miller-madow":
        H += (len(h) - 1) / (2.0 * float(n))
    elif correction is not None:
        raise ValueError(f"correction must be None or 'miller-madow', got {correction!r}")
    return float(H / math.log(base))


def entropy_prevalences(vals, phis) -> float:
    """:func:`entropy` (nats, plug-in) of the histogram with Phi_i = ``phis`` items at each count
    i in ``vals``: the same sum grouped by count (equal up to rounding)."""
    v = np.asarray(vals, dtype=np.float64)
    f = np.asarray(phis, dtype=np.float64)
    n = float(np.dot(v, f))
    if n == 0:
        return 0.0
    return float(math.log(n) - float(np.dot(f, v * np.log(np.maximum(v, 1.0)))) / n)


def support_coverage(hist, m: int, *, smoothing: str = "binomial", r: float | None = None) -> float:
    """Estimate S_m, the expected number of distinct items in m draws from the distribution.

    Parameters
    ----------
    hist
        Anonymized histogram of n draws.
    m
        Number of draws to predict for (m >= 1).
    smoothing
        For m > 2n: ``"binomial"`` (OSW's recommended L ~ Bin(k, 2/(t+2)),
        k = ceil(log_3(n t^2 / (t-1)) / 2)) or ``"poisson"`` (L ~ Poisson(r), default
        r = ln(n (t+1)^2 / (t-1)) / (2t)); t = m/n - 1.
    r
        Poisson smoothing parameter override (seed 001 App. C.2 uses r = log(3 / alpha)).
    """
    vals, phis = prevalences(hist)
    return support_coverage_prevalences(vals, phis, m, smoothing=smoothing, r=r)


def support_coverage_prevalences(
    vals, phis, m: int, *, smoothing: str = "binomial", r: float | None = None
) -> float:
    """:func:`support_coverage` of the histogram with Phi_i = ``phis`` items at each count
    i in ``vals`` (increasing, as :func:`prevalences` gives them): the same number, without
    listing the counts."""
    m = int(m)
    if m < 1:
        raise ValueError("m must be >= 1")
    vals, phis = np.asarray(vals), np.asarray(phis)
    n = int(np.dot(vals, phis))
    if n == 0:
        return 0.0
    seen = float(phis.sum())
    if m <= n:
        # E[#distinct in a uniform subsample of size m] = sum_i Phi_i (1 - C(n-i, m) / C(n, m))
        with np.errstate(divide="ignore"):
            log_ratio = (
                special.gammaln(n - vals + 1)
                - special.gammaln(n - vals - m + 1)
                - special.gammaln(n + 1)
                + special.gammaln(n - m + 1)
            )
        miss = np.where(n - vals >= m, np.exp(log_ratio), 0.0)
        return float(np.dot(phis, 1.0 - miss))
    t = m / n - 1.0
    signs = np.where(vals % 2 == 1, 1.0, -1.0)  # -(-1)^i
    if t <= 1.0:
        weights = np.ones(len(vals))
    elif smoothing == "binomial":
        k = max(1, math.ceil(0.5 * math.log(n * t * t / (t - 1.0), 3)))
        below = vals - 1  # P(L >= i) = P(L > i - 1), 0 past k (where bdtrc is undefined)
        weights = np.where(below >= k, 0.0, bdtrc(np.minimum(below, k), k, 2.0 / (t + 2.0)))
    elif smoothing == "poisson":
        rr = r if r is not None else math.log(n * (t + 1.0) ** 2 / (t - 1.0)) / (2.0 * t)
        weights = pdtrc(vals - 1, rr)
    else:
        raise ValueError(f"smoothing must be 'binomial' or 'poisson', got {smoothing!r}")
    # U = -sum_i (-t)^i P(L >= i) Phi_i, computed in logs for large i
    log_terms = vals * math.log(t) + np.log(np.maximum(weights, 1e-300)) + np.log(phis)
    unseen = float(np.sum(signs * np.exp(log_terms) * (weights > 0)))
    return seen + unseen


def support_size(hist, K: float, alpha: float = 0.1, **kwargs) -> float:
    """Support size of a distribution whose atoms have mass >= 1/K, via S_m at
    m = K log(3/alpha)."""
    if K <= 0 or not 0 < alpha < 1:
        raise ValueError("need K > 0 and 0 < alpha < 1")
    return support_coverage(hist, math.ceil(K * math.log(3.0 / alpha)), **kwargs)


def batched_item(item, event_index: int, m: int) -> str:
    """The (item, batch) key the dense coverage construction counts: batch = event_index // m."""
    return f"{event_index // int(m)}\x1f{item}"


def support_coverage_batched(hist, n: int, m: int) -> float:
    """S_m from a histogram of (item, batch) keys: phi_{>=1} / (number of full batches n/m)."""
    batches = int(n) // int(m)
    if batches < 1:
        raise ValueError("need n >= m: at least one full batch")
    return float(len(_counts(hist))) / batches
