"""Wu and Pagh's profile reconstruction from a DLap-noised histogram (``method="wupagh"``).

Reference: Hao Wu and Rasmus Pagh, "Profile Reconstruction from Private Sketches", ICML 2024,
arXiv 2406.01158. It is the closest published peer of this project's estimators: the same sketch
(every counter of a histogram over d items carries DLap noise), the same target (the profile, i.e.
the prevalences), and a reconstruction that reverses the noise, after the LP of Dwork et al.
(ITCS 2010, pan-private streaming), sped up from polynomial time to O(d + n log n).

The math
--------
Profile. Let f_t = #{j : h_j = t} / d for t = 0, 1, ..., n (t = 0 included: the empty counters),
and let g_v = #{j : h'_j = v} / d be the *noisy profile* of the noisy counters h' = h + Z. Each
counter's noise is independent of its count, so in expectation the noisy profile is the profile
convolved with the noise pmf q:  E[g] = q * f, i.e. E[g] = A f with A_{v,t} = q(v - t), a
Toeplitz matrix. Read modulo a period m larger than the span of the values, A is a *circulant*
matrix (the paper's Definition 3.1); circulant matrices are diagonalised by the discrete Fourier
transform, so A is inverted by dividing by the DFT of q, and f_hat = A^{-1} g is an unbiased
estimate of f.

For DLap(p) the DFT (characteristic function) is q_hat(w) = (1-p)^2 / (1 - 2p cos w + p^2), which
never vanishes, and 1 / q_hat(w) = ((1 + p^2) - 2p cos w) / (1-p)^2 is a trigonometric polynomial
of degree 1: the inverse of A is the three-tap filter

    g(0) = (1 + p^2) / (1-p)^2,   g(+-1) = -p / (1-p)^2,

the same inverse filter as seed 001's Appendix E. So the "FFT" of the circulant inverse collapses
to a correlation with three taps, and with the period m above the span of the noisy values plus
the filter's width the wrap-around never aliases: f_hat_t = sum_u g(u) g_{t+u}, O(span) time.

Reconstruction. f_hat has negative entries and entries beyond n; the reconstruction looks for the
valid profile closest to it. Dwork et al. solve an LP (a probability vector whose noisy image is
closest to g); with A invertible this becomes a projection of f_hat onto the probability simplex
{f >= 0, sum_t f_t = 1}, which for the Euclidean norm is a soft threshold f_t = max(f_hat_t -
tau, 0) with one tau fixed by the sum, found by sorting: the n log n of the paper's running time
(the d is the one pass that forms the noisy profile). We implement that Euclidean projection
(our reading of the paper's fast algorithm; our reference store held its abstract and its
preliminaries, so the parts we could not read are reconstructed from that description and the
circulant-inverse definition, and :func:`wupagh_profile` documents each step).

Adaptations here
----------------
* Counts, not fractions: we keep phi_t = d f_t (prevalences), so the simplex is {phi >= 0,
  sum_t phi_t = d} with d = the number of counters (D in direct mode, B in hashed mode).
* k layers of DLap(p): the noise is the k-fold convolution q^{*k}, whose DFT is q_hat^k, so the
  inverse is g^{*k}, a (2k + 1)-tap filter (exact, no truncation). Its variance grows like
  sum g^{*k}(u)^2 (roughly 100x per layer at p = exp(-1/2)), which is this estimator's weakness
  with several layers, as for the threshold estimator (whose cumulative sums are the same f_hat).
* The release needs phi_{>=r}, r = 1..R: the suffix sums of the projected profile (t >= 1), which
  are non-increasing and >= 0 by construction; ``projection.project_l1`` then only rounds them.

Relation to the other estimators: the cumulative sums of f_hat are exactly the threshold
estimator's phi_hat_{>=r} (``threshold.cumulative_prevalence``); Wu-Pagh differs in the
projection (Euclidean, onto profiles summing to d, sparsifying by the soft threshold) where
Algorithm 1 projects the cumulative sums in l1 with no constraint on the total.

>>> import numpy as np
>>> from aggregator.noise import discrete_laplace
>>> g = np.random.default_rng()
>>> h = np.concatenate([g.integers(1, 30, 300), np.zeros(2_700, np.int64)])   # d = 3000
>>> noisy = h + discrete_laplace(0.3, len(h), rng=g)
>>> phi = wupagh_profile(noisy, 0.3)                  # phi_t, t = 0..T, sums to d
>>> round(float(phi.sum())), bool(phi.min() >= 0)
(3000, True)
>>> ge = wupagh_prevalence(noisy, 0.3)                # phi_{>=r}, r = 1..R
>>> bool(300 / 4 < ge[0] < 300 * 4)        # 300 items: one draw lands within 180-410 (5-95%)
True
"""

from __future__ import annotations

import numpy as np

from .counters import noisy_value_counts

__all__ = [
    "inverse_filter",
    "unbiased_profile",
    "project_simplex",
    "wupagh_profile",
    "wupagh_prevalence",
]


def inverse_filter(p: float, layers: int = 1) -> np.ndarray:
    """Taps of g^{*k} on u = -k..k: the exact inverse of the k-layer DLap(p) convolution.

    >>> import numpy as np
    >>> from aggregator.estimate import noise_pmf
    >>> K, q = noise_pmf(0.4, 2)
    >>> back = np.convolve(q, inverse_filter(0.4, 2))   # q * g^{*2} = delta at 0
    >>> round(float(back[K + 2]), 9), round(float(np.abs(back).sum()), 6)
    (1.0, 1.0)
    """
    p = float(p)
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    k = int(layers)
    if k < 1:
        raise ValueError(f"layers must be >= 1, got {layers!r}")
    g1 = np.array([-p, 1.0 + p * p, -p]) / (1.0 - p) ** 2
    g = np.array([1.0])
    for _ in range(k):
        g = np.convolve(g, g1)
    return g


def unbiased_profile(noisy_counts, p: float, layers: int = 1) -> np.ndarray:
    """f_hat as counts: phi_hat_t = sum_u g^{*k}(u) c_{t+u} for t = 0..T, T = max(h') + k.

    c_v = #{j : h'_j = v}. Unbiased for phi_t = #{j : h_j = t} (t >= 0); the estimates for t < 0
    (expectation 0) are dropped, which is the restriction of the circulant inverse to the
    profile's support.
    """
    vc = noisy_value_counts(noisy_counts)
    k = int(layers)
    g = inverse_filter(p, k)
    T = max(vc.hi + k, 0)
    # c over v = -k .. T + k (what t = 0..T can touch)
    lo, hi = -k, T + k
    c = np.zeros(hi - lo + 1)
    a, b = max(vc.lo, lo), min(vc.hi, hi)
    if a <= b:
        c[a - lo : b - lo + 1] = vc.c[a - vc.lo : b - vc.lo + 1]
    # g is symmetric, so correlation = convolution; "valid" leaves t = 0..T
    return np.convolve(c, g, mode="valid")


def project_simplex(x, total: float) -> np.ndarray:
    """Euclidean projection of x onto {y >= 0, sum y = total} (sort; O(len log len)).

    y = max(x - tau, 0), tau the unique value giving sum y = total.

    >>> project_simplex([3.0, 1.0, -2.0], 2.0).tolist()
    [2.0, 0.0, 0.0]
    >>> project_simplex([0.5, 0.5, 0.0], 4.0).tolist()
    [1.5, 1.5, 1.0]
    """
    x = np.asarray(x, dtype=np.float64)
    total = float(total)
    if total < 0:
        raise ValueError("total must be >= 0")
    if len(x) == 0:
        return x.copy()
    if total == 0:
        return np.zeros_like(x)
    u = np.sort(x)[::-1]
    css = np.cumsum(u) - total
    j = np.arange(1, len(u) + 1)
    rho = np.flatnonzero(u - css / j > 0)[-1]
    tau = css[rho] / (rho + 1)
    return np.maximum(x - tau, 0.0)


def wupagh_profile(noisy_counts, p: float, layers: int = 1) -> np.ndarray:
    """The reconstructed profile phi_t (counts), t = 0..T: the noisy profile c, the circulant
    inverse (:func:`unbiased_profile`), the projection onto the simplex scaled to d counters
    (:func:`project_simplex`)."""
    vc = noisy_value_counts(noisy_counts)
    return project_simplex(unbiased_profile(vc, p, layers), vc.total)


def wupagh_prevalence(noisy_counts, p: float, *, layers: int = 1, R=None) -> np.ndarray:
    """phi_{>=r} for r = 1..R from :func:`wupagh_profile` (suffix sums over t >= 1)."""
    phi = wupagh_profile(noisy_counts, p, layers)
    ge = np.cumsum(phi[::-1])[::-1][1:]  # r = 1..T
    if len(ge) and ge[-1] <= 0:
        last = np.flatnonzero(ge > 0)
        ge = ge[: last[-1] + 1] if len(last) else ge[:0]
    if R is not None:
        R = int(R)
        ge = np.concatenate([ge, np.zeros(max(0, R - len(ge)))])[:R]
    return ge
