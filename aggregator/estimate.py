"""From noisy counters to an anonymized histogram (seed 001 Algorithms 1, 3, 5; Appendix E).

Notation: h'_j are the noisy counters, h_j the true ones, phi_{>=r} = #{j : h_j >= r} the
cumulative prevalence. The l1 distance between two anonymized histograms equals the l1 distance
between their cumulative prevalences (seed 001 Observation 6), so every estimator here produces a
cumulative prevalence and a projection turns it into a valid (integer, non-increasing, >= 0) one.

Estimators of phi_{>=r}
-----------------------
* ``"threshold"`` (Lemma 10, App. E): phi_hat_{>=r} = sum_j F(h'_j - r) with F = f * g^{*(k-1)}
  for k noise layers: f is the one-layer unbiased step, g the inverse filter of DLap(p). Unbiased
  for any k; its variance grows roughly 100x per extra layer at p = exp(-1/2).
* ``"deconvolution"``: nonparametric maximum likelihood (EM) for the prevalences given the
  noisy-value counts c_v and the exactly known k-layer noise pmf, stopped early (a tolerance on
  the log-likelihood gain per non-zero counter). Biased but far less variable when k >= 2.
* ``"mle"``: the same EM run to convergence (:data:`MLE_TOL`, :data:`MLE_MAX_ITER`).
* ``"wupagh"``: Wu and Pagh (ICML 2024): the noisy profile through the circulant inverse of the
  noise (the (2k+1)-tap filter g^{*k}), projected onto the simplex (:mod:`aggregator.wupagh`).
* ``"xfit"``: the EM stopped where the held-out likelihood of a random half of the counters
  peaks (cross-fitting; :func:`crossfit_prevalence`), with n: every M-step under
  sum_h h pi_h = n / D.
* ``"auto"``: the estimator and cap rule chosen from the counters by minimax bootstrap regret over
  a smooth and a spiky stand-in truth (:mod:`aggregator.selection`).

This module is the core: it imports no other module of the package. The estimators by name, and
which one a release uses when none is named, are :mod:`aggregator.estimators`
(:func:`aggregator.estimators.default_method` per mode and layers: the candidate with the lowest
worst-case regret over the accuracy grid, bench/accuracy/grid.py, docs/accuracy_grid.md); the
release's histogram, direct or hashed, is :mod:`aggregator.anonymize`.

Projections
-----------
* l1 (Algorithm 1/5): integer isotonic l1 regression, solved exactly by the slope trick on runs
  of equal phi_hat (O(K log K) for K runs; K is at most a few times the number of distinct noisy
  values, not n).
* The public n (:func:`cap_total`): sum_r phi_{>=r} is the number of events, so a release with n
  known never holds more than n events.
* l2 (Algorithm 3): the same objective with sum phi = n and the rank box
  |n_hat_(j) - h'_(j)| <= gamma, solved exactly as a small MILP (HiGHS) on the runs.
"""

from __future__ import annotations

import contextlib
import contextvars

import heapq
import math
import threading
from dataclasses import dataclass

import numpy as np

__all__ = [
    "NoisyValueCounts",
    "noisy_value_counts",
    "threshold_kernel",
    "cumulative_prevalence",
    "deconvolved_prevalence",
    "crossfit_prevalence",
    "project_l1",
    "cap_total",
    "CAP_RULES",
    "project_l2",
    "counts_from_cumulative",
    "cumulative_from_counts",
    "prevalences_from_cumulative",
    "cumulative_l1",
    "l1_distance",
    "MLE_MAX_ITER",
    "BASIC_METHODS",
    "basic_prevalence",
    "checked_cumulative",
    "MLE_TOL",
    "DECONV_MAX_ITER",
    "DECONV_TOL",
    "deconv_tol",
    "chi2_shift",
    "em_prevalences",
    "em_prevalences_many",
    "deconvolved_batch",
    "pass_through_bound",
    "sparse_top",
    "SPARSE_DENSITY",
    "rank_box",
    "aligned_histograms",
    "noise_pmf",
]


# --------------------------------------------------------------------------------------------
# noisy-value counts c_v: the sufficient statistic of the counters for every estimator here
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NoisyValueCounts:
    """c_v = #{j : h'_j = v} for v in [lo, lo + len(c)); additive across disjoint states."""

    lo: int
    c: np.ndarray

    @property
    def total(self) -> int:
        return int(self.c.sum())

    @property
    def hi(self) -> int:
        return self.lo + len(self.c) - 1

    def merge(self, other: "NoisyValueCounts") -> "NoisyValueCounts":
        lo = min(self.lo, other.lo)
        hi = max(self.hi, other.hi)
        c = np.zeros(hi - lo + 1, dtype=np.int64)
        c[self.lo - lo: self.lo - lo + len(self.c)] += self.c
        c[other.lo - lo: other.lo - lo + len(other.c)] += other.c
        return NoisyValueCounts(lo, c)


def noisy_value_counts(noisy_counts) -> NoisyValueCounts:
    """Histogram of the noisy counter values (one bincount pass)."""
    if isinstance(noisy_counts, NoisyValueCounts):
        return noisy_counts
    x = np.asarray(noisy_counts)
    if x.ndim != 1 or x.size == 0:
        raise ValueError("noisy_counts must be a non-empty 1-d integer array")
    if x.dtype.kind not in "iu":
        raise TypeError(f"noisy_counts must be integers, got {x.dtype}")
    lo, hi = int(x.min()), int(x.max())
    if hi - lo > 50_000_000:
        raise ValueError("noisy counter values span more than 5e7; "
                         "is this really a noisy histogram?")
    shifted = x - lo if lo != 0 else x
    return NoisyValueCounts(lo, np.bincount(shifted, minlength=hi - lo + 1).astype(np.int64))


def _check_p(p: float) -> float:
    p = float(p)
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    return p


def _check_layers(layers: int) -> int:
    if isinstance(layers, bool) or int(layers) != layers or layers < 1:
        raise ValueError(f"layers must be a positive integer, got {layers!r}")
    return int(layers)


# --------------------------------------------------------------------------------------------
# threshold (inverse-filter) estimator
# --------------------------------------------------------------------------------------------
def threshold_kernel(p: float, layers: int = 1) -> tuple[int, np.ndarray]:
    """The estimator kernel F on its non-trivial support.

    Returns ``(m0, F)`` with F[i] = F(m0 + i) for m in [m0, layers - 1]; F(m) = 1 above that
    and 0 below. For one layer this is f of seed 001 eq. (1): (-x, 1 + x) at m = -1, 0 with
    x = p / (1-p)^2; each further layer convolves with g = (-x, (1+p^2)/(1-p)^2, -x).
    """
    p = _check_p(p)
    k = _check_layers(layers)
    x = p / (1.0 - p) ** 2
    g = np.array([-x, (1.0 + p * p) / (1.0 - p) ** 2, -x])
    # f on [-1, k]: the trailing 1s give convolution the step that continues to +inf.
    m0 = -1
    F = np.concatenate([[-x, 1.0 + x], np.ones(2 * k)])
    for _ in range(k - 1):
        F = np.convolve(F, g)
        m0 -= 1
    # Keep m in [-k, k-1]; F(m) for m >= k is exactly 1 (g sums to 1).
    return m0, F[: 2 * k]


#: beyond the layer counts the accuracy grid measured (THRESHOLD_GRID_LAYERS), the threshold
#: (and wupagh) inverse filter is used only while sum_m |F(m)| stays below this: its
#: coefficients grow like |g|_1^(k-1) (|g|_1 = (1+p)^2/(1-p)^2, 16.5 at eps 1), so with the
#: layers a rollup brings (48 and more) every phi_hat is noise times 1e50 and overflows the
#: projection; "auto" leaves it out there, naming it is refused with one line
THRESHOLD_MAX_GAIN = 1e6
THRESHOLD_GRID_LAYERS = 6  # up to here nothing changes (docs/accuracy_grid.md chose with it)


def threshold_usable(p: float, layers: int) -> bool:
    """Whether the threshold (inverse-filter) estimator is worth running at ``layers`` layers
    (its kernel's l1 norm at most :data:`THRESHOLD_MAX_GAIN`).

    >>> threshold_usable(0.6065, 2), threshold_usable(0.6065, 6), threshold_usable(0.6065, 48)
    (True, True, False)
    """
    p = _check_p(p)
    x = p / (1.0 - p) ** 2
    gain = 1.0 + 2.0 * x  # |f|_1
    step = (1.0 + p * p) / (1.0 - p) ** 2 + 2.0 * x  # |g|_1
    k = _check_layers(layers)
    if k <= THRESHOLD_GRID_LAYERS:
        return True
    return math.log(gain) + (k - 1) * math.log(step) <= math.log(THRESHOLD_MAX_GAIN)


def cumulative_prevalence(noisy_counts, p, *, layers=1, R=None) -> np.ndarray:
    """Unbiased estimate of phi_{>=r} for r = 1..R (index i holds r = i + 1).

    ``noisy_counts`` are counters carrying ``layers`` independent DLap(p) layers (or their
    :class:`NoisyValueCounts`). Negative noisy values contribute only through the kernel's
    support (they are never clipped to 0: seed 001 Algorithm 5's clip biases phi_hat_{>=1} by
    -x #{h' < 0}). ``R`` defaults to max(h') + layers, the largest r with a non-zero term.

    >>> import numpy as np
    >>> est = cumulative_prevalence(np.array([3, 0, -2, 1]), 0.3)
    >>> est.shape
    (4,)
    """
    vc = noisy_value_counts(noisy_counts)
    k = _check_layers(layers)
    m0, F = threshold_kernel(p, k)  # F(m) for m = m0..k-1, m0 = -k
    if R is None:
        R = max(vc.hi + k, 1)
    R = int(R)
    if R < 1:
        raise ValueError("R must be >= 1")
    # c over v in [1 - k, R + k - 1] (what r = 1..R can touch); above: tail counts.
    vlo, vhi = 1 - k, R + k - 1
    c = np.zeros(vhi - vlo + 1, dtype=np.float64)
    a, b = max(vc.lo, vlo), min(vc.hi, vhi)
    if a <= b:
        c[a - vlo: b - vlo + 1] = vc.c[a - vc.lo: b - vc.lo + 1]
    above = np.concatenate([np.cumsum(vc.c[::-1])[::-1], [0]])  # above[i] = #{v >= lo + i}
    # ge[r - 1] = #{h' >= r + k} = above[r + k - lo], r = 1..R: a slice of `above` (all counters
    # before its start, none past its end); slices, not index arrays: R is ~1e6 at D = 1e7
    ge = np.zeros(R)
    first = 1 + k - vc.lo  # index into `above` of r = 1
    a0, b0 = max(first, 0), min(first + R, len(above))
    if a0 < b0:
        ge[a0 - first: b0 - first] = above[a0:b0]
    ge[: max(0, min(-first, R))] = vc.total  # r + k <= lo
    # sum_{m=-k}^{k-1} F(m) c_{r+m}: a correlation of c with F
    corr = np.correlate(c, F, mode="valid")  # corr[i] = sum_m F[m-m0] c[i + m - m0]
    # c index of v = r + m0 is r + m0 - vlo = r - 1 for m0 = -k, vlo = 1 - k
    ge += corr[:R]
    return ge


def noise_pmf(p: float, layers: int = 1, tail: float = 1e-17) -> tuple[int, np.ndarray]:
    """pmf of the sum of ``layers`` DLap(p) draws on [-K, K] (tail mass below ``tail`` cut)."""
    p = _check_p(p)
    k = _check_layers(layers)
    K1 = int(math.ceil(math.log(tail / (2 * k)) / math.log(p))) + 1
    base = (1 - p) / (1 + p) * p ** np.abs(np.arange(-K1, K1 + 1))
    q = base
    for _ in range(k - 1):
        q = np.convolve(q, base)
    K = (len(q) - 1) // 2
    keep = np.flatnonzero(q > tail * 1e-3)
    lo = min(keep[0], len(q) - 1 - keep[-1])
    q = q[lo: len(q) - lo]
    return K - lo, q / q.sum()


_FFT_TAPS = 96  # kernels at least this long convolve by FFT on long axes
_SPECTRA: dict = {}  # (id(q), FFT length) -> (q, its spectrum): the EM convolves with one q


def _kernel_spectrum(q: np.ndarray, size: int) -> np.ndarray:
    from scipy import fft
    key = (id(q), size)
    hit = _SPECTRA.get(key)
    if hit is not None and hit[0] is q:  # the entry holds q, so its id cannot be reused
        return hit[1]
    if len(_SPECTRA) > 16:
        _SPECTRA.clear()
    spec = fft.rfft(q, size)
    _SPECTRA[key] = (q, spec)
    return spec


def _conv(a: np.ndarray, q: np.ndarray) -> np.ndarray:
    """a * q, "same" length (q symmetric, odd length). Direct for short kernels (numpy's loop is
    faster there); one real FFT with the kernel's spectrum cached for the wide kernels of small
    eps or many layers: the EM convolves thousands of times with the same q, and scipy's
    oaconvolve spent 5x the transform's time in argument handling on axes of ~1e3 values."""
    if len(q) < _FFT_TAPS or len(a) < 4 * len(q):
        return np.convolve(a, q, mode="same")
    key = (id(q), len(a))
    plan = _PLANS.get(key)
    if plan is None or plan[0] is not q:  # the entry holds q, so its id cannot be reused
        from scipy import fft
        size = fft.next_fast_len(len(a) + len(q) - 1, real=True)
        if len(_PLANS) > 64:
            _PLANS.clear()
        plan = _PLANS[key] = (q, size, (len(q) - 1) // 2, _kernel_spectrum(q, size))
    _, size, half, spec = plan
    buf = np.zeros(size)  # the zero padding scipy.fft.rfft(a, size) makes
    buf[: len(a)] = a
    out = _irfft(_rfft(buf) * spec, size)[half: half + len(a)]
    # FFT rounding is ~1e-16 of the largest value: below that level a value is noise, and a zero
    # there would make the EM's ratio w / m explode
    return np.maximum(out, 1e-15 * max(float(out.max()), 0.0))


_PLANS: dict = {}  # (id(q), len(a)) -> (q, FFT length, kernel half-width, kernel spectrum)


def _fft_pair():
    """(rfft(x), irfft(X, n)) on 1-d float64 / complex128 arrays of the FFT length: scipy's
    pocketfft kernels called directly (the EM makes ~1e4 transforms of ~1e3 values per release,
    and scipy.fft's argument handling took 60% of their time), checked at first use to give
    bit for bit what scipy.fft.rfft / irfft give; scipy.fft itself otherwise."""
    from scipy import fft
    try:
        from scipy.fft._pocketfft import pypocketfft as pfft

        def rfft(x):
            return pfft.r2c(x, (0,), True, 0, None, 1)

        def irfft(X, n):
            return pfft.c2r(X, (0,), n, False, 2, None, 1)

        x = np.random.default_rng().random(1350)  # any values: an equality probe
        X = fft.rfft(x)
        if np.array_equal(rfft(x), X) and np.array_equal(irfft(X, 1350), fft.irfft(X, 1350)):
            return rfft, irfft
    except Exception:  # another scipy: its public functions
        pass
    return fft.rfft, (lambda X, n: fft.irfft(X, n))


def _rfft(x):
    global _rfft, _irfft
    _rfft, _irfft = _fft_pair()
    return _rfft(x)


def _irfft(X, n):
    global _rfft, _irfft
    _rfft, _irfft = _fft_pair()
    return _irfft(X, n)


def _convolver(q: np.ndarray, length: int):
    """a -> :func:`_conv` (a, q) for arrays of ``length`` values, with the choice of method and
    numpy's argument handling made once (the EM convolves thousands of times per run)."""
    if len(q) >= _FFT_TAPS and length >= 4 * len(q):
        return lambda a: _conv(a, q)
    if _CORRELATE is None or len(q) > length:
        return lambda a: np.convolve(a, q, mode="same")
    q_rev = q[::-1]
    return lambda a: _CORRELATE(a, q_rev, "same")  # what np.convolve(a, q, "same") calls


try:  # numpy's kernel behind np.convolve (np.convolve(a, v) = correlate(a, v[::-1]))
    from numpy._core.multiarray import correlate as _CORRELATE
    _probe = np.random.default_rng().random((2, 40))  # any values: an equality probe
    if not np.array_equal(_CORRELATE(_probe[0], _probe[1][:9][::-1], "same"),
                          np.convolve(_probe[0], _probe[1][:9], mode="same")):
        _CORRELATE = None
except Exception:  # another numpy: np.convolve itself
    _CORRELATE = None


def _em_step(pi: np.ndarray, w: np.ndarray, nz: np.ndarray, q: np.ndarray,
             mean=None, m=None) -> np.ndarray:
    """One EM update of the mixing pmf (q symmetric, so convolution = correlation).

    ``mean`` = (h, mu): the M-step under the linear constraint sum_h h pi_h = mu (the public n
    fixes the mean count per counter); see :func:`_mean_m_step`. ``m``: pi * q when the caller
    already has it (the log-likelihood of pi computed it).
    """
    if m is None:
        m = _conv(pi, q)
    ratio = np.zeros_like(m)
    ratio[nz] = w[nz] / np.maximum(m[nz], 1e-300)
    out = pi * _conv(ratio, q)
    if mean is not None:
        out = _mean_m_step(out, *mean)
    return out


def _mean_m_step(u: np.ndarray, h: np.ndarray, mu: float) -> np.ndarray:
    """argmax sum_h u_h log pi_h over pmfs pi with sum_h h pi_h = mu.

    Lagrange: pi_h = u_h / (1 + b (h - mu)) with b the non-zero root of S(b) = sum_h pi_h = 1
    (S is convex with S(0) = 1 and S'(0) = mu - mean_u, so the root lies on the side of
    mean_u - mu and S < 1 strictly between: bisection). Exact M-step of the constrained EM, so
    the likelihood still rises at every step. ``u`` sums to 1; ``mu`` outside the support's
    range leaves u alone.
    """
    s = u.sum()
    if s <= 0:
        return u
    u = u / s
    sup = u > 0
    d = h[sup] - mu
    us = u[sup]
    gap = float((us * d).sum())  # mean_u - mu
    if abs(gap) < 1e-12 * max(1.0, abs(mu)) or d.min() >= 0 or d.max() <= 0:
        return u
    bound = -1.0 / d.min() if gap > 0 else -1.0 / d.max()  # 1 + b d > 0 on the support
    lo, hi = 0.0, bound
    with np.errstate(divide="ignore", over="ignore"):
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if float((us / (1.0 + mid * d)).sum()) < 1.0:
                lo = mid
            else:
                hi = mid
    out = np.zeros_like(u)
    out[sup] = us / (1.0 + lo * d)
    return out / out.sum()


def _loglik(pi: np.ndarray, w: np.ndarray, nz: np.ndarray, q: np.ndarray):
    """(log-likelihood of pi, pi * q): the next EM step from pi reuses the convolution."""
    m = _conv(pi, q)
    # elementwise sums, not BLAS dot: OpenBLAS threads stall when the other core is busy
    return float((w[nz] * np.log(np.maximum(m[nz], 1e-300))).sum()), m


def _squarem(pi, w, nz, q, allowed, max_iter, tol, zero_idx=None, callback=None,
             mean=None, early=None):
    """EM accelerated by SQUAREM (Varadhan and Roland 2008, scheme S3), monotone in likelihood.

    Stops when the mean log-likelihood gain per step, divided by the estimated mass of non-zero
    counters, falls below ``tol``: empty counters dilute the mean gain, and without the division
    a mostly-empty domain (n << D) stopped long before the informative part had converged.
    ``callback(step, pi)`` (steps counted from 1) may stop the run by returning True.

    ``early`` = (max_iter, tol) of a looser stop on the same path: the result is then
    (pi at the early stop, pi at this run's stop). The steps are deterministic, so the early pi is
    exactly what a run with those settings returns: the early-stopped EM and the converged NPMLE
    from one run instead of two.
    """
    # the same steps as _em_step / _loglik with their per-call set-up made once: the positions
    # of the non-zero counts and the convolution (identical arithmetic, identical results)
    idx = np.flatnonzero(nz)
    w_nz = w[idx]
    conv = _convolver(q, len(pi))

    def em_step(x, m=None):
        if m is None:
            m = conv(x)
        ratio = np.zeros_like(m)
        ratio[idx] = w_nz / np.maximum(m[idx], 1e-300)
        out = x * conv(ratio)
        return out if mean is None else _mean_m_step(out, *mean)

    def loglik(x):
        m = conv(x)
        return float((w_nz * np.log(np.maximum(m[idx], 1e-300))).sum()), m

    ll, m = loglik(pi)
    early_pi = None
    for step in range(1, max_iter + 1):
        p1 = em_step(pi, m)
        p2 = em_step(p1)
        r = p1 - pi
        v = p2 - p1 - r
        vv = float((v * v).sum())
        ll_c = -np.inf
        if vv > 0:
            alpha = -math.sqrt(float((r * r).sum()) / vv)
            alpha = min(alpha, -1.0)
            with np.errstate(over="ignore", invalid="ignore"):
                cand = np.maximum(pi - 2 * alpha * r + alpha * alpha * v, 0.0) * allowed
            if np.all(np.isfinite(cand)) and cand.sum() > 0:  # else the step overflowed: plain EM
                cand /= cand.sum()
                cand = em_step(cand)
                ll_c, m_c = loglik(cand)
        ll2, m2 = loglik(p2)
        new, ll_new, m_new = (cand, ll_c, m_c) if ll_c >= ll2 else (p2, ll2, m2)
        s = new.sum()
        new, m_new = new / s, m_new / s  # the convolution is linear: rescale it with pi
        gain = (ll_new - ll) / (1.0 if zero_idx is None else
                                max(1.0 - float(new[zero_idx]), 1e-6))
        pi, ll, m = new, max(ll_new, ll), m_new
        if early is not None and early_pi is None and (gain < early[1] or step >= early[0]):
            early_pi = pi
        if callback is not None and callback(step, pi):
            break
        if gain < tol:
            break
    if early is None:
        return pi
    return (pi if early_pi is None else early_pi), pi


@dataclass
class _EMProblem:
    """The NPMLE's likelihood on one compressed axis (see :func:`deconvolved_prevalence`).

    ``mass`` holds the exactly solved single-value clusters (D * pi_h, h = 0..len - 1); the
    other clusters live on the axis: ``w`` the noisy-value counts at their positions (not
    normalized), ``allowed`` 1 where h >= 0, ``spans`` (offset, lowest value, highest value) per
    cluster, ``zero_idx`` the position of h = 0 (None if no cluster reaches 0)."""

    K: int
    q: np.ndarray
    mass: np.ndarray
    spans: list
    w: np.ndarray
    allowed: np.ndarray
    zero_idx: int | None

    def h_values(self) -> np.ndarray:
        """The count h that each axis position stands for (0 on the separating gaps)."""
        h = np.zeros(len(self.w))
        for off, lo_v, hi_v in self.spans:
            h[off: off + hi_v - lo_v + 1] = np.arange(lo_v, hi_v + 1)
        return np.maximum(h, 0.0) * (self.allowed > 0)

    def mean_constraint(self, n):
        """(h, mu) for :func:`_em_step`: the axis' counters hold the n events minus those of
        the exactly solved clusters, so their mean count is mu. None without n, or when mu is
        outside what the axis can hold (then the constraint cannot be met and is dropped)."""
        if n is None or not self.spans:
            return None
        h = self.h_values()
        fixed = float((np.arange(len(self.mass)) * self.mass).sum())
        mu = (float(n) - fixed) / self.w.sum()
        if not 0.0 <= mu <= h.max():
            return None
        return h, mu

    def counts_on_axis(self, vc: "NoisyValueCounts") -> np.ndarray:
        """Noisy-value counts of ``vc`` (a part of the counters) placed on this axis; values
        outside every cluster are dropped."""
        out = np.zeros(len(self.w))
        for off, lo_v, hi_v in self.spans:
            a, b = max(vc.lo, lo_v + self.K), min(vc.hi, hi_v - self.K)
            if a <= b:
                out[off + a - lo_v: off + b - lo_v + 1] = vc.c[a - vc.lo: b - vc.lo + 1]
        return out

    def start(self, w: np.ndarray, shrunk: bool = False, smooth_share=None) -> np.ndarray:
        """The EM's first pmf: the noisy-value histogram smoothed by the noise once more, or
        (``shrunk``) with the cluster holding 0 shrunk to the true values' first two moments
        (:meth:`_shrunk`), ``smooth_share`` of the smoothed one mixed in (default
        :data:`START_SMOOTH_SHARE`)."""
        pi = (np.convolve(w / w.sum(), self.q, mode="same") + 1e-12) * self.allowed
        pi /= pi.sum()
        if shrunk and self.zero_idx is not None:
            share = START_SMOOTH_SHARE if smooth_share is None else float(smooth_share)
            pi = (1.0 - share) * self._shrunk(w, pi) + share * pi
        return pi

    def _shrunk(self, w: np.ndarray, pi: np.ndarray) -> np.ndarray:
        """``pi`` with the cluster holding 0 replaced (same mass) by its noisy values moved to
        mu + c (x - mu), c = sqrt((s^2 - Var Z) / s^2) (mu, s^2 the cluster's noisy mean and
        variance, Var Z the noise's: the true values' mean and variance, which the noise does
        not bias), each split linearly between the two nearest counts >= 0.

        Why: the smoothed start has variance Var T + 2 Var Z, and where one counter says little
        about its value (hash buckets at B = 2 n, 2 layers at eps 1: Var Z = 15.7 against
        Var T ~ 0.5) the early-stopped EM ends near its start. Over-dispersed bucket totals look
        like fewer, larger items, and the inversion of Gamma^B then under-counted mostly
        distinct users by 7-8% in every window. One linear map is wrong for heavy tails (it
        moves a bucket of 30 events to 27), so the hashed release keeps whichever start's fit
        the counters' likelihood prefers (``aggregator.largedomain._likelier_start``)."""
        off, lo_v, hi_v = next(s for s in self.spans if s[1] <= 0 <= s[2])
        seg = w[off: off + hi_v - lo_v + 1].astype(np.float64)
        x = np.arange(lo_v, hi_v + 1, dtype=np.float64)
        total = seg.sum()
        mu = float((seg * x).sum()) / total
        s2 = float((seg * (x - mu) ** 2).sum()) / total
        if s2 <= 0:
            return pi
        var_z = float((np.arange(-self.K, self.K + 1) ** 2 * self.q).sum())
        c = math.sqrt(max(s2 - var_z, 1e-3 * s2) / s2)
        y = np.clip(mu + c * (x - mu), 0.0, float(hi_v))
        low = np.floor(y).astype(np.int64)
        frac = y - low
        moved = np.zeros(len(seg) + 1)
        np.add.at(moved, low - lo_v, seg * (1.0 - frac))
        np.add.at(moved, low + 1 - lo_v, seg * frac)
        out = pi.copy()
        out[off: off + len(seg)] = (moved[: len(seg)] / moved[: len(seg)].sum()
                                    * out[off: off + len(seg)].sum())
        out = (out + 1e-12) * self.allowed
        return out / out.sum()

    def cumulative(self, pi: np.ndarray | None, R=None) -> np.ndarray:
        """phi_{>=r}, r = 1.., from the fitted axis pmf ``pi`` plus the solved clusters."""
        mass = self.mass.copy()
        if pi is not None:
            total = self.w.sum()
            for off, lo_v, hi_v in self.spans:
                h0 = max(lo_v, 0)
                seg = pi[off + h0 - lo_v: off + hi_v - lo_v + 1] * total
                mass[h0: h0 + len(seg)] += seg
        est = np.cumsum(mass[::-1])[::-1][1:]  # r = 1..len(mass) - 1
        if R is not None:
            R = int(R)
            est = np.concatenate([est, np.zeros(max(0, R - len(est)))])[:R]
        return est


START_SMOOTH_SHARE = 0.05  # of the smoothed start in the shrunk one (every count keeps support)
# ... in direct mode's (``selection``'s likelier start): at D = 1e6 counters 0.05 is 50,000
# counters' worth of the over-dispersed start, the very tail at r = 2-15 the shrunk start is
# there to remove (docs/accuracy_grid.md, "The EM's start chosen by the likelihood")
DIRECT_START_SMOOTH_SHARE = 1e-4
EM_TAIL = 1e-10  # noise pmf tail cut of the EM (D * 1e-10 counters misplaced at most)
# A counter is passed through (released at its noisy value) when fewer than this many counters per
# value lie within the noise reach +-K of it: :func:`_sparse_counters`
SPARSE_DENSITY = 0.5


def _sparse_counters(vals: np.ndarray, cnt: np.ndarray, K: int, density: float) -> np.ndarray:
    """Mask of the distinct noisy values (sorted ``vals``, counts ``cnt``) the EM leaves out.

    The NPMLE gains over a counter's own noisy value by pooling counters whose true values
    coincide, which needs other counters within the noise reach: where the window
    [v - K, v + K] holds fewer than ``density`` counters per value (the counter included), as in
    the tail of large counts, there is next to nothing to pool, and the EM spent most of its time
    there (at D = 1e7 Zipf counters the values above ~300 are 0.02% of the counters and 95% of
    the EM's axis). Such a counter, if above K (its window clear of the empty counters' noise), is
    released as a point mass at its noisy value. Its l1 error is then exactly |Z_j|, its noise;
    over the passed counters at most sum_j |Z_j|, in expectation their number times E|Z|
    (:func:`pass_through_bound`). ``density`` = 0 passes nothing (the exact NPMLE's clusters).
    """
    if density <= 0 or len(vals) == 0:
        return np.zeros(len(vals), dtype=bool)
    cs = np.concatenate([[0.0], np.cumsum(cnt)])
    near = (cs[np.searchsorted(vals, vals + K, "right")]
            - cs[np.searchsorted(vals, vals - K, "left")])
    return (vals > K) & (near < density * (2 * K + 1))


def sparse_top(noisy_counts, p: float, layers: int = 1, sparse: float | None = None) -> int:
    """The largest count the EM can place mass at (the top of its axis, K above the largest
    noisy value it fits); every larger count comes from a counter passed through or solved alone
    (:func:`_sparse_counters`). 0 when the EM fits nothing."""
    prob = _em_problem(noisy_value_counts(noisy_counts), p, _check_layers(layers), sparse=sparse)
    return max((hi for _, _, hi in prob.spans), default=0)


def pass_through_bound(p: float, layers: int = 1) -> float:
    """E|Z| for Z the sum of ``layers`` DLap(p) draws: the expected l1 error of one counter
    released at its noisy value (the EM's sparse counters, :func:`_sparse_counters`).

    >>> round(pass_through_bound(0.5), 4)   # one layer: 2p / (1 - p^2)
    1.3333
    """
    K, q = noise_pmf(p, layers)
    return float((np.abs(np.arange(-K, K + 1)) * q).sum())


def _em_problem(vc: NoisyValueCounts, p: float, k: int, tail: float = EM_TAIL,
                sparse: float | None = None) -> _EMProblem:
    K, q = noise_pmf(p, k, tail)
    sparse = SPARSE_DENSITY if sparse is None else sparse
    vals = np.flatnonzero(vc.c) + vc.lo
    cnt = vc.c[vc.c > 0].astype(np.float64)
    # values below -K cannot come from h >= 0 under the truncated model: fold them to -K
    if vals[0] < -K:
        fold = vals < -K
        folded = cnt[fold].sum()
        vals, cnt = vals[~fold], cnt[~fold]
        if len(vals) and vals[0] == -K:
            cnt[0] += folded
        else:
            vals, cnt = np.concatenate([[-K], vals]), np.concatenate([[folded], cnt])
    top = max(int(vals[-1]), 0)
    mass = np.zeros(top + K + 2)  # D * pi_h for h = 0..top + K + 1
    alone = _sparse_counters(vals, cnt, K, sparse)
    if alone.any():
        mass[vals[alone]] += cnt[alone]  # distinct values: no repeated index
        vals, cnt = vals[~alone], cnt[~alone]
        if len(vals) == 0:
            return _EMProblem(K, q, mass, [], np.zeros(0), np.zeros(0), None)
    cut = np.flatnonzero(np.diff(vals) > 2 * K) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [len(vals)]])
    single = ends - starts == 1
    sv = np.maximum(vals[starts[single]], 0)
    np.add.at(mass, sv, cnt[starts[single]])
    multi = np.flatnonzero(~single)
    # compressed axis: for each cluster the value span [vmin - K, vmax + K], then 2K+1 zeros
    spans, pos = [], 0
    for j in multi:
        vmin, vmax = int(vals[starts[j]]), int(vals[ends[j] - 1])
        lo_v, hi_v = vmin - K, vmax + K
        spans.append((pos, lo_v, hi_v))
        pos += hi_v - lo_v + 1 + 2 * K + 1
    w = np.zeros(pos)
    allowed = np.zeros(pos)
    for (off, lo_v, hi_v), j in zip(spans, multi):
        sl = slice(starts[j], ends[j])
        w[off + vals[sl] - lo_v] = cnt[sl]
        h0 = max(lo_v, 0)
        allowed[off + h0 - lo_v: off + hi_v - lo_v + 1] = 1.0
    zero_idx = None
    for off, lo_v, hi_v in spans:
        if lo_v <= 0 <= hi_v:
            zero_idx = off - lo_v  # position of h = 0 on the compressed axis
            break
    return _EMProblem(K, q, mass, spans, w, allowed, zero_idx)


DECONV_MAX_ITER = 200  # the early-stopped EM ("deconvolution"): see deconvolved_prevalence
DECONV_TOL = 1e-5  # for one layer; k layers: deconv_tol(p, k)


# True while estimating from hash-bucket counters (hashed mode): the early stop stays at
# DECONV_TOL for every layer count there (see deconv_tol)
_BUCKET_COUNTERS = contextvars.ContextVar("panagg_bucket_counters", default=False)


@contextlib.contextmanager
def bucket_counters():
    """Within this block the EM estimates are of hash-bucket counters (hashed mode)."""
    token = _BUCKET_COUNTERS.set(True)
    try:
        yield
    finally:
        _BUCKET_COUNTERS.reset(token)


def chi2_shift(p: float, layers: int = 1) -> float:
    """chi2_k = sum_v (q(v-1) - q(v))^2 / q(v) for q the pmf of ``layers`` DLap(p) draws.

    >>> p = 0.5
    >>> round(chi2_shift(p), 6) == round((1 - p) ** 2 / p, 6)
    True
    """
    _, q = noise_pmf(p, layers)
    shifted = np.concatenate([[0.0], q[:-1]])  # q(v - 1)
    return float(np.sum((shifted - q) ** 2 / q))


def deconv_tol(p: float, layers: int = 1) -> float:
    """The early-stopped EM's tolerance for counters carrying ``layers`` DLap(p) layers:
    :data:`DECONV_TOL` times chi2_k / chi2_1, the Fisher information a counter holds about a
    one-event shift under k layers relative to one (chi2_k = sum_v (q(v-1) - q(v))^2 / q(v),
    q the k-layer noise pmf; :func:`chi2_shift`).

    Why: the tolerance is on the mean log-likelihood gain per counter and step, and with k
    layers each counter carries chi2_k / chi2_1 (0.31 for two layers at eps 1, 0.13 for three)
    of the information, so every step gains that much less: a fixed 1e-5 stopped the 2-layer EM
    at a point the 1-layer EM passes early. On the held-out real profile that cost 2.9x the
    1-layer error (jieba's Chinese word counts, D = 3.5e5, n = 3.5e6, eps 1: 11,333 -> 32,686;
    with the scaled tolerance 17,000-26,800: docs/accuracy_grid.md, "Layer cost").

    Direct mode only: on hash-bucket counters (inside :func:`bucket_counters`, which hashed
    mode's estimators enter) the scaled tolerance made the 2-layer default 3.8% worse on
    geometric mean over 20 hashed cells (up to 3x on one), so it stays at :data:`DECONV_TOL`.

    >>> deconv_tol(0.5, 1) == DECONV_TOL
    True
    >>> round(deconv_tol(0.6065306597126334, 2) / DECONV_TOL, 3)
    0.308
    """
    k = _check_layers(layers)
    if k == 1 or _BUCKET_COUNTERS.get():
        return DECONV_TOL
    return DECONV_TOL * chi2_shift(p, k) / chi2_shift(p, 1)


def deconvolved_prevalence(noisy_counts, p, *, layers=1, max_iter=DECONV_MAX_ITER,
                           tol=None, R=None, n=None, shrunk_start=False,
                           smooth_share=None) -> np.ndarray:
    """phi_{>=r}, r = 1..R, from the NPMLE of the prevalences (EM deconvolution).

    Model: each counter's noisy value is h + Z with Z the sum of ``layers`` DLap(p) draws
    (pmf q, exact up to a 1e-17 tail) and h drawn from the unknown prevalence pmf pi over
    {0, 1, ...}; D = number of counters. The estimate is D * P_pi[h >= r].

    Early stopping is part of the estimator: the NPMLE overfits (it turns spiky) when EM runs to
    convergence, and the l1 error first falls, then rises with the iterations. ``tol`` (on the
    mean log-likelihood gain per SQUAREM step) = 1e-5 was never worse than running to 1e-11 over
    36 measured configurations and 1.25-1.7x better on geometric mean (docs/estimators.md);
    :func:`crossfit_prevalence` chooses the stopping point from the data instead.

    The likelihood separates over clusters of noisy values more than 2K apart (q vanishes
    beyond K): a cluster holding a single distinct value v is solved exactly by a point mass at
    max(v, 0); the remaining clusters run EM (SQUAREM-accelerated) on one compressed axis where
    each cluster keeps its own span and spans are separated by zeros that the kernel cannot cross.

    ``shrunk_start``: start from the shrunk pmf (:meth:`_EMProblem.start`), not the smoothed one,
    with ``smooth_share`` of the smoothed one in it (default :data:`START_SMOOTH_SHARE`).
    """
    vc = noisy_value_counts(noisy_counts)
    k = _check_layers(layers)
    tol = deconv_tol(p, k) if tol is None else tol
    prob = _em_problem(vc, p, k)
    if not prob.spans:
        return prob.cumulative(None, R)
    w = prob.w / prob.w.sum()
    pi = _squarem(prob.start(w, shrunk_start, smooth_share), w, w > 0, prob.q, prob.allowed,
                  max_iter, tol, prob.zero_idx, mean=prob.mean_constraint(n))
    return prob.cumulative(pi, R)


def em_prevalences(noisy_counts, p, *, layers=1, R=None) -> tuple[np.ndarray, np.ndarray]:
    """(``"deconvolution"``'s phi_{>=r}, ``"mle"``'s phi_{>=r}) from one EM run.

    Both estimators run the same deterministic SQUAREM path from the same start and differ only
    in where they stop (DECONV_TOL / DECONV_MAX_ITER, then MLE_TOL / MLE_MAX_ITER), so the
    converged NPMLE continues the early-stopped run: the pair is exactly what the two separate
    calls return, for the cost of the longer one (``method="auto"`` needs both, many times).
    """
    vc = noisy_value_counts(noisy_counts)
    prob = _em_problem(vc, p, _check_layers(layers))
    if not prob.spans:
        est = prob.cumulative(None, R)
        return est, est.copy()
    w = prob.w / prob.w.sum()
    early, pi = _squarem(prob.start(w), w, w > 0, prob.q, prob.allowed, MLE_MAX_ITER, MLE_TOL,
                         prob.zero_idx, early=(DECONV_MAX_ITER, deconv_tol(p, layers)))
    return prob.cumulative(early, R), prob.cumulative(pi, R)


def em_prevalences_many(many, p, *, layers=1) -> list:
    """[:func:`em_prevalences` of each counter set], all sets on one batched path
    (:func:`deconvolved_batch`: equal to rounding, not bit for bit): for ``auto``'s simulated
    states, whose fits only rank its candidates."""
    return deconvolved_batch(many, p, layers=layers, max_iter=MLE_MAX_ITER, tol=MLE_TOL,
                             early=(DECONV_MAX_ITER, deconv_tol(p, layers)))


def deconvolved_batch(many, p, *, layers=1, max_iter=DECONV_MAX_ITER,
                      tol=None, shrunk_start=False, smooth_share=None, early=None) -> list:
    """:func:`deconvolved_prevalence` (without n) of several counter sets at once: one SQUAREM
    loop over a matrix with one row per counter set (each row stops at its own step, by the
    same rule), so the ~25 numpy calls of an EM step are made once per step for all of them.
    For the bootstrap's re-estimates (10-20 small EM problems per release) and ``auto``'s
    simulated states.

    ``early`` = (max_iter, tol) of a looser stop on the same path, as in :func:`_squarem`: each
    item of the result is then the pair (phi at the early stop, phi at this run's stop);
    :func:`em_prevalences_many` asks for :func:`em_prevalences`'s pair this way.

    The rows share one FFT length (the longest axis'), so a row's convolutions round
    differently from a run of its own: the results equal :func:`deconvolved_prevalence`'s to
    rounding (1e-12 relative on phi_{>=r}), not bit for bit; use that function where the
    result must be reproducible exactly (the release itself). ``shrunk_start`` and
    ``smooth_share`` as there.
    """
    k = _check_layers(layers)
    tol = deconv_tol(p, k) if tol is None else tol
    vcs = [noisy_value_counts(x) for x in many]
    probs = [_em_problem(vc, p, k) for vc in vcs]
    out = [None if prob.spans else prob.cumulative(None) for prob in probs]
    if early is not None:  # a set with nothing to fit: its early and final estimate are one
        out = [None if y is None else (y, y.copy()) for y in out]
    todo = [i for i, prob in enumerate(probs) if prob.spans]
    if not todo:
        return out
    from scipy import fft
    q = probs[todo[0]].q
    L = max(len(probs[i].w) for i in todo)
    size = fft.next_fast_len(L + len(q) - 1, real=True)
    half = (len(q) - 1) // 2
    spec = fft.rfft(q, size)

    def conv(X):
        buf = np.zeros((len(X), size))
        buf[:, :L] = X
        Y = fft.irfft(fft.rfft(buf, axis=1) * spec, size, axis=1)[:, half: half + L]
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
    result = [None] * B
    early_result = [None] * B  # (with early) each row's pi where the looser stop first held
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
        denom = np.where(zr >= 0, np.maximum(1.0 - new[np.arange(len(rows)), np.maximum(zr, 0)],
                                             1e-6), 1.0)
        gain = (ll_new - ll) / denom
        P, ll, M = new, np.maximum(ll_new, ll), M_new
        if early is not None:
            for j in np.flatnonzero((gain < early[1]) | (step >= early[0])):
                if early_result[rows[j]] is None:
                    early_result[rows[j]] = P[j].copy()
        done = (gain < tol) | (step >= max_iter)
        if done.any():
            for j in np.flatnonzero(done):
                result[rows[j]] = P[j]
            keep = ~done
            rows, P, ll, M = rows[keep], P[keep], ll[keep], M[keep]
            if not len(rows):
                break
            Wr, Ar, zr = W[rows], A[rows], zero[rows]
    for j, i in enumerate(todo):
        prob = probs[i]
        out[i] = prob.cumulative(result[j][: len(prob.w)])
        if early is not None:
            first = result[j] if early_result[j] is None else early_result[j]
            out[i] = (prob.cumulative(first[: len(prob.w)]), out[i])
    return out


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


def _data_seed(vc: NoisyValueCounts) -> list[int]:
    """A seed that is a function of the counters' value counts: the release is deterministic."""
    import zlib
    return [vc.lo & 0xFFFFFFFF, zlib.crc32(np.ascontiguousarray(vc.c).tobytes())]


def _bins(prob: "_EMProblem", bin_min: int) -> np.ndarray:
    """Start positions of bins on the EM axis holding >= ``bin_min`` counters each (all data).

    Where counters are dense (small counts) a bin is one value; in a sparse tail a bin spans
    many values, so the held-out score does not reward a fit for guessing where the other
    half's isolated items sit (it cannot, and that is not what the l1 error measures)."""
    cs = np.cumsum(prob.w)
    # greedy: a new bin starts once the current one holds bin_min counters
    edges = np.searchsorted(cs, np.arange(bin_min, cs[-1] + bin_min, bin_min), side="left") + 1
    starts = np.unique(np.concatenate([[0], edges[edges < len(cs)]]))
    return starts


def crossfit_prevalence(noisy_counts, p, *, layers=1, n=None, max_iter=XFIT_MAX_ITER, R=None,
                        seed=None, return_steps=False, bin_min=XFIT_BIN):
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
    of the counters, seeded from them (:func:`_data_seed`), so a release is reproducible.
    With ``n`` (the number of events, public under replace-one) every EM step is the exact
    M-step under sum_h h pi_h = n / D (:func:`_mean_m_step`): the fit never holds more or fewer
    events than the stream had, the constraint the cap rules (:func:`cap_total`) apply only
    after the fact. The halves use the same mean (their counters are a random half of the same
    prevalences; clusters solved exactly are left out of both). ``return_steps=True`` also
    returns the chosen step count.
    """
    vc = noisy_value_counts(noisy_counts)
    k = _check_layers(layers)
    prob = _em_problem(vc, p, k)
    if not prob.spans:
        est = prob.cumulative(None, R)
        return (est, 0) if return_steps else est
    halves = _split(vc, _data_seed(vc) if seed is None else seed)
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
        score: dict = {}

        def read(step, pi, hb=hb, nz_h=nz_h, score=score):
            if step not in cps_set:
                return False
            m = np.add.reduceat(np.convolve(pi, q, mode="same"), starts)
            score[step] = float((hb[nz_h] * np.log(np.maximum(m[nz_h], 1e-300))).sum())
            top = max(score, key=score.get)
            return cps.index(step) - cps.index(top) >= XFIT_PATIENCE

        pi0 = prob.start(w)
        if not read(0, pi0):
            _squarem(pi0, w, w > 0, q, prob.allowed, max_iter, XFIT_TOL, prob.zero_idx,
                     callback=read, mean=mean)
        scores.append(score)
    # the steps both halves reached (a half stops once it is well past its held-out maximum)
    steps = sorted(set.intersection(*(set(s) for s in scores))) if scores else []
    star = max(steps, key=lambda s: sum(sc[s] for sc in scores)) if steps else max_iter
    w = prob.w / prob.w.sum()
    pi = prob.start(w)
    if star > 0:
        pi = _squarem(pi, w, w > 0, q, prob.allowed, star, XFIT_TOL, prob.zero_idx, mean=mean)
    est = prob.cumulative(pi, R)
    return (est, star) if return_steps else est


# --------------------------------------------------------------------------------------------
# projections
# --------------------------------------------------------------------------------------------
def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Compress a 1-d array into (run values, run lengths)."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return values, np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], np.flatnonzero(values[1:] != values[:-1]) + 1])
    lengths = np.diff(np.concatenate([starts, [len(values)]]))
    return values[starts], lengths


def project_l1(phi_hat) -> np.ndarray:
    """Integer y_1 >= y_2 >= ... >= 0 minimizing sum_r |y_r - phi_hat_r| (exact).

    Slope trick: process r from R down to 1 (so y must be non-decreasing), keeping the
    breakpoints of the convex cost-to-go as a max-heap of (position, mass). Each point adds the
    integer-restricted cost w|y - a| (breakpoints at floor(a), floor(a) + 1), and the prefix
    minimum that enforces monotonicity removes the top w of mass. A run of equal values acts as
    one point of weight w: an optimal solution is constant on it.

    >>> project_l1([5.2, 3.9, 4.1, 1.1]).tolist()
    [5, 4, 4, 1]
    """
    a_vals, lengths = _runs(phi_hat)
    K = len(a_vals)
    if K == 0:
        return np.zeros(0, dtype=np.int64)
    heap: list[tuple[float, float]] = [(-0.0, math.inf)]  # y >= 0: a wall of infinite mass at 0
    opt = np.empty(K, dtype=np.int64)
    push, pop = heapq.heappush, heapq.heappop
    for i in range(K - 1, -1, -1):
        a, w = float(a_vals[i]), float(lengths[i])
        fl = math.floor(a)
        phi = a - fl
        if phi == 0.0:
            push(heap, (-fl, 2.0 * w))
        else:
            push(heap, (-fl, w * (2.0 - 2.0 * phi)))
            push(heap, (-(fl + 1), w * 2.0 * phi))
        remove = w
        while remove > 0.0:
            pos, mass = pop(heap)
            if mass > remove:
                push(heap, (pos, mass - remove))
                remove = 0.0
            else:
                remove -= mass
        opt[i] = int(-heap[0][0])
    # back out the solution: y_i = min(y_{i+1 in processing order}, opt_i)
    y_runs = np.minimum.accumulate(opt)  # runs in r order; processing went from the end
    return np.repeat(y_runs, lengths).astype(np.int64, copy=False)


# --------------------------------------------------------------------------------------------
# the public n: a histogram never holds more events than the stream had
# --------------------------------------------------------------------------------------------
CAP_RULES = ("items", "scale", "fitted", "none")


def cap_total(y, total: int, rule: str = "items", *, fitted_top: int | None = None) -> np.ndarray:
    """A cumulative prevalence with at most ``total`` events (sum_r y_r <= total), from y.

    sum_r phi_{>=r} is the number of events, so with total = n (public under replace-one
    neighbours) the released histogram never holds more events than the stream had. Noise shows
    up as surplus mass when most counters are empty (n << D); under the l1 objective the cut is
    degenerate there (every unit removed below the estimate costs exactly 1, so a whole face of
    histograms is l1-optimal under the cap) and the rule is what decides. The two cutting rules
    leave y alone when it already fits, keep it non-increasing, and reach sum = total exactly:

    * ``"items"``: keep the largest items. y_r -> min(y_r, c) caps the number of items at c
      (phi_{>=r} <= phi_{>=1} <= c); clipped to c, an l1 isotonic projection stays an l1
      projection among the histograms with at most c items (tests/test_estimate.py checks it
      against an integer LP). c is the largest cap that fits, and the events left over go to one
      more item of the largest count that fits (y_r = c + 1 for the first r).
    * ``"scale"``: thin every level alike, y_r -> floor(y_r total / sum y), and the units lost to
      rounding go to the first positions.
    * ``"fitted"`` (direct counters; ``fitted_top`` is :func:`sparse_top` of the counters y was
      estimated from): thin only the items the EM fitted. A count above ``fitted_top`` comes from
      a counter the EM passed through at its noisy value (:func:`_sparse_counters`): measured
      to within the noise, not inferred, so those items stay as they are and the items at counts
      <= ``fitted_top`` are thinned alike (``"scale"`` on them). Where the passed-through items
      alone hold more than ``total`` events, it thins every level as ``"scale"`` does. It is
      ``"scale"`` where nothing is passed through, and better where heavy hitters are: thinning
      them removes real events from the items the counters show best (docs/accuracy_grid.md,
      "A cap that keeps the measured items").
    * ``"none"``: y as it is (no cap; for measurements).

    The default per mode and layer count is :func:`aggregator.estimators.default_cap` (measured in
    docs/accuracy_grid.md).

    >>> y = np.array([6, 3, 1])          # the histogram (3, 2, 2, 1, 1, 1): 10 events
    >>> cap_total(y, 7).tolist()         # at most 7: keep the largest items, (3, 2, 2)
    [3, 3, 1]
    >>> cap_total(y, 7, rule="scale").tolist()   # every level thinned: (2, 2, 1, 1, 1)
    [5, 2, 0]
    >>> y = np.array([5, 1, 1, 1, 1])   # (5, 1, 1, 1, 1); the EM's axis ends at 1: the 5 stays
    >>> cap_total(y, 7, "fitted", fitted_top=1).tolist(), cap_total(y, 7, "scale").tolist()
    ([3, 1, 1, 1, 1], [4, 1, 1, 1, 0])
    """
    y = np.asarray(y, dtype=np.int64)
    total = int(total)
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if rule not in CAP_RULES:
        raise ValueError(f"rule must be one of {CAP_RULES}, got {rule!r}")
    if rule == "fitted" and (fitted_top is None or int(fitted_top) < 0):
        raise ValueError("rule 'fitted' needs fitted_top >= 0 "
                         "(estimate.sparse_top of the counters)")
    if len(y) and (np.any(y[1:] > y[:-1]) or y[-1] < 0):
        raise ValueError("y must be a non-increasing, non-negative cumulative prevalence")
    have = int(y.sum())
    if have <= total or rule == "none":
        return y
    if rule == "items":
        # sum_r min(y_r, c) = c #{y_r >= c} + (the sum of the y_r < c, a suffix of y): O(log R)
        # per trial instead of a pass over y (y is ~1e6 long at D = 1e7)
        suffix = np.concatenate([np.cumsum(y[::-1])[::-1], [0]])
        neg = -y

        def capped_sum(c: int) -> int:
            i = int(np.searchsorted(neg, -c, side="right"))  # #{y_r >= c}
            return c * i + int(suffix[i])

        lo, hi = 0, int(y[0])  # sum min(y, lo) <= total < sum min(y, hi)
        while hi - lo > 1:
            c = (lo + hi) // 2
            if capped_sum(c) <= total:
                lo = c
            else:
                hi = c
        out = np.minimum(y, lo)
    else:
        top = len(y) if rule == "scale" else min(int(fitted_top), len(y))
        base = int(y[top]) if top < len(y) else 0  # items above the EM's axis: kept whole
        room = total - int(y[top:].sum()) - base * top  # events left for the fitted items
        if room > 0:  # (room < the fitted items' events, since y does not fit)
            out = np.concatenate([_thinned(y[:top] - base, room) + base, y[top:]])
        else:
            out = _thinned(y, total)
    # the remainder is below the number of positions that can take one more unit; adding it at
    # the first positions keeps y non-increasing
    out[: total - int(out.sum())] += 1
    return out


def _thinned(y: np.ndarray, total: int) -> np.ndarray:
    """floor(y_r total / sum y), exactly: Python ints when the product could overflow int64."""
    have = int(y.sum())
    if len(y) and int(y[0]) * total < 2**62:
        return (y * total) // have
    return np.array([v * total // have for v in y.tolist()], dtype=np.int64)


def _run_boundaries(*arrays: np.ndarray) -> np.ndarray:
    """Start indices of maximal runs where every given array is constant."""
    n = len(arrays[0])
    change = np.zeros(n, dtype=bool)
    change[0] = True
    for arr in arrays:
        change[1:] |= arr[1:] != arr[:-1]
    return np.flatnonzero(change)


def project_l2(phi_hat, n: int, lower, upper):
    """Exact integer solution of the l2 variant's projection (seed 001 Algorithm 3).

    minimize sum_r |y_r - phi_hat_r|  s.t.  y non-increasing, lower_r <= y_r <= upper_r,
    sum_r y_r = n, y integer. Returns None when infeasible.

    On a run where phi_hat, lower and upper are constant an optimal y takes at most two adjacent
    values (balancing a convex cost at a fixed sum never hurts), so each run becomes an integer
    level c_i and an integer run sum S_i in [len c_i, len c_i + len - 1]; consecutive runs
    need S_{i+1} <= len_{i+1} c_i; the run's cost is len * (|x - a| interpolated at integers)
    at x = S / len, a max of three lines. That small MILP goes to HiGHS.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    a = np.asarray(phi_hat, dtype=np.float64)
    lower = np.asarray(lower, dtype=np.float64)
    upper = np.asarray(upper, dtype=np.float64)
    R = len(a)
    if R == 0:
        return np.zeros(0, dtype=np.int64) if n == 0 else None
    if np.any(lower > upper) or lower.sum() > n or upper.sum() < n:
        return None
    starts = _run_boundaries(a, lower, upper)
    lens = np.diff(np.concatenate([starts, [R]])).astype(np.float64)
    av, lv, uv = a[starts], lower[starts], upper[starts]
    K = len(starts)
    # variables: c (K), S (K), t (K)
    nv = 3 * K
    ic, iS, it = 0, K, 2 * K
    cost = np.zeros(nv)
    cost[it:] = 1.0
    rows = 6 * K + 1
    A = lil_matrix((rows, nv))
    lb = np.full(rows, -np.inf)
    ub = np.full(rows, np.inf)
    row = 0
    for i in range(K):
        L = lens[i]
        # L c_i <= S_i <= L c_i + L - 1
        A[row, iS + i] = 1; A[row, ic + i] = -L; lb[row] = 0; ub[row] = L - 1; row += 1  # noqa: E702
        # monotone: S_{i+1} <= len_{i+1} c_i
        if i + 1 < K:
            A[row, iS + i + 1] = 1; A[row, ic + i] = -lens[i + 1]; ub[row] = 0; row += 1  # noqa: E702
        # max value <= upper: S_i <= L u_i
        A[row, iS + i] = 1; ub[row] = L * uv[i]; row += 1  # noqa: E702
        # t_i >= L a - S_i ; t_i >= S_i - L a ; t_i >= middle line
        fl = math.floor(av[i])
        A[row, it + i] = 1; A[row, iS + i] = 1; lb[row] = L * av[i]; row += 1  # noqa: E702
        A[row, it + i] = 1; A[row, iS + i] = -1; lb[row] = -L * av[i]; row += 1  # noqa: E702
        f0, f1 = abs(fl - av[i]), abs(fl + 1 - av[i])
        # t >= L f0 + (S - L fl)(f1 - f0)
        A[row, it + i] = 1; A[row, iS + i] = -(f1 - f0)  # noqa: E702
        lb[row] = L * f0 - L * fl * (f1 - f0); row += 1  # noqa: E702
    A[row, iS: iS + K] = 1
    lb[row] = ub[row] = n
    row += 1
    A = A[:row].tocsr()
    bounds = Bounds(np.concatenate([lv, np.full(K, -np.inf), np.zeros(K)]),
                    np.concatenate([uv, np.full(K, np.inf), np.full(K, np.inf)]))
    integrality = np.concatenate([np.ones(2 * K), np.zeros(K)])
    constraints = LinearConstraint(A, lb[:row], ub[:row])
    res = milp(cost, constraints=constraints, bounds=bounds, integrality=integrality,
               options={"disp": False})
    if res.status != 0 or res.x is None:
        return None
    # Tie-break among the l1-optimal solutions: the sum constraint can force mass that costs the
    # same anywhere, and an arbitrary optimum may pile it into a few huge top counts (a large l2
    # error). Second stage: keep the l1 cost optimal, prefer deviations at small r (spread over
    # many items) by weighting each run's cost with its position.
    opt = float(res.fun)
    mid_r = starts + lens / 2.0
    cost2 = np.zeros(nv)
    cost2[it:] = mid_r / R
    keep_opt = LinearConstraint(cost[None, :], -np.inf, opt + 1e-7 * max(1.0, opt))
    res2 = milp(cost2, constraints=[constraints, keep_opt], bounds=bounds,
                integrality=integrality, options={"disp": False})
    if res2.status == 0 and res2.x is not None:
        res = res2
    c = np.round(res.x[ic: ic + K]).astype(np.int64)
    S = np.round(res.x[iS: iS + K]).astype(np.int64)
    out = np.empty(R, dtype=np.int64)
    for i in range(K):
        L = int(lens[i])
        k_up = int(S[i] - L * c[i])
        s = starts[i]
        out[s: s + k_up] = c[i] + 1
        out[s + k_up: s + L] = c[i]
    return out


# --------------------------------------------------------------------------------------------
# conversions and the public entry point
# --------------------------------------------------------------------------------------------
def prevalences_from_cumulative(y) -> np.ndarray:
    """phi_r = phi_{>=r} - phi_{>=r+1}, r = 1..len(y), from a cumulative prevalence y.

    >>> prevalences_from_cumulative([5, 3, 3, 1]).tolist()
    [2, 0, 2, 1]
    """
    y = np.asarray(y)
    return y - np.concatenate([y[1:], np.zeros(1, y.dtype)])


def cumulative_l1(a, b) -> float:
    """l1 distance of two cumulative prevalences (zero beyond their ends) = the l1 distance of
    their histograms, without padding copies (they are ~1e6 long at D = 1e7).

    >>> cumulative_l1([3, 1], [2, 2, 1])
    3.0
    """
    a, b = np.asarray(a), np.asarray(b)
    m = min(len(a), len(b))
    return float(np.abs(a[:m] - b[:m]).sum() + np.abs(a[m:]).sum() + np.abs(b[m:]).sum())


def counts_from_cumulative(y) -> np.ndarray:
    """Anonymized histogram (decreasing counts, zeros dropped) from phi_{>=1..R}."""
    y = np.asarray(y, dtype=np.int64)
    if len(y) == 0:
        return np.zeros(0, dtype=np.int64)
    if np.any(np.diff(y) > 0) or y[-1] < 0:
        raise ValueError("cumulative prevalence must be non-increasing and >= 0")
    exact = prevalences_from_cumulative(y)
    r = np.arange(1, len(y) + 1, dtype=np.int64)
    return np.repeat(r[::-1], exact[::-1])


def cumulative_from_counts(counts, R=None) -> np.ndarray:
    """phi_{>=r} for r = 1..R from a list of counts (any order; zeros ignored)."""
    h = np.asarray(counts, dtype=np.int64)
    h = h[h > 0]
    top = int(h.max()) if len(h) else 0
    R = top if R is None else int(R)
    phi = np.bincount(h, minlength=max(top, R) + 1)[1:]
    ge = np.cumsum(phi[::-1])[::-1]
    return ge[:R] if R <= len(ge) else np.concatenate([ge, np.zeros(R - len(ge), np.int64)])


def aligned_histograms(counts_a, counts_b) -> tuple[np.ndarray, np.ndarray]:
    """Both histograms sorted decreasing and zero-padded to one length (rank by rank)."""
    a = np.sort(np.asarray(counts_a, dtype=np.int64))[::-1]
    b = np.sort(np.asarray(counts_b, dtype=np.int64))[::-1]
    m = max(len(a), len(b))
    return (np.concatenate([a, np.zeros(m - len(a), np.int64)]),
            np.concatenate([b, np.zeros(m - len(b), np.int64)]))


def l1_distance(counts_a, counts_b) -> int:
    """l1 distance between two anonymized histograms (= between cumulative prevalences)."""
    a, b = aligned_histograms(counts_a, counts_b)
    return int(np.abs(a - b).sum())


# "mle" is the EM of deconvolved_prevalence run to convergence: MLE_TOL on the normalized
# log-likelihood gain, at most MLE_MAX_ITER SQUAREM steps (a bound on the time; reached at
# eps = 0.5 with millions of counters).
MLE_MAX_ITER = 1000
MLE_TOL = 1e-9
BASIC_METHODS = ("threshold", "deconvolution", "mle")  # need nothing but the counters


def basic_prevalence(noisy_counts, p, *, layers=1, method="deconvolution") -> np.ndarray:
    """phi_hat_{>=r} by one of the estimators that need nothing but the counters
    (:data:`BASIC_METHODS`); :func:`aggregator.estimators.phi_estimate` names every estimator,
    these and the ones built on them."""
    if method == "threshold":
        if not threshold_usable(p, layers):
            raise ValueError(f"the threshold estimator cannot run on {layers} noise layers (its "
                             "kernel amplifies the noise past 1e6); use release.estimator = "
                             "default")
        return cumulative_prevalence(noisy_counts, p, layers=layers)
    if method == "deconvolution":
        return deconvolved_prevalence(noisy_counts, p, layers=layers)
    if method == "mle":
        return deconvolved_prevalence(noisy_counts, p, layers=layers, max_iter=MLE_MAX_ITER,
                                      tol=MLE_TOL)
    raise ValueError(f"method must be one of {BASIC_METHODS}, got {method!r}")


def checked_cumulative(y) -> np.ndarray:
    """y as int64 with its trailing zeros dropped (a valid phi_{>=r} has them at the end only);
    the check of :func:`counts_from_cumulative`."""
    y = np.asarray(y, dtype=np.int64)
    if len(y) and (np.any(y[1:] > y[:-1]) or y[-1] < 0):
        raise ValueError("cumulative prevalence must be non-increasing and >= 0")
    return y[: int(np.count_nonzero(y))]


def rank_box(vc: NoisyValueCounts, gamma: float, R: int) -> tuple[np.ndarray, np.ndarray]:
    """L_r = #{j : h'_(j) - gamma >= r}, U_r = #{j : h'_(j) + gamma >= r} for r = 1..R."""
    above = np.concatenate([np.cumsum(vc.c[::-1])[::-1], [0]])  # #{v >= lo + i}

    def count_ge(t):  # #{j : h'_j >= t} for real thresholds t (vectorized)
        i = np.ceil(t).astype(np.int64) - vc.lo
        return np.where(i <= 0, vc.total, above[np.clip(i, 0, len(above) - 1)])

    r = np.arange(1, R + 1, dtype=np.float64)
    return count_ge(r + gamma), count_ge(r - gamma)


class LastCounters:
    """A one-entry memo of what was derived from the last counters, one per thread.

    A release and its error bars ask for the same fits on the same counters, so the last result
    is kept. Per thread, because threads of one process compute at once (each aggregation's
    accuracy plan): with one shared entry, a thread could find its key and then read the entry
    another thread had just put there (another window's fit), or find it cleared under it.
    :func:`forget_fits` clears the calling thread's entries.
    """

    def __init__(self):
        self._local = threading.local()
        _FORGET.append(self.clear)

    @property
    def entry(self):
        """The calling thread's last entry (None: none)."""
        return getattr(self._local, "entry", None)

    def put(self, entry) -> None:
        self._local.entry = entry

    def clear(self) -> None:
        self._local.entry = None


_FORGET: list = []  # every memo of a window's counters: each one's clear()
_FITS = LastCounters()  # (counters' value counts, p, layers, {method: projected phi_{>=r}})
_N_FREE = BASIC_METHODS  # estimators that do not use n


def remember_fits(vc: NoisyValueCounts, p: float, layers: int, fits: dict) -> None:
    """Keep the l1-projected estimates ``fits`` ({method: phi_{>=r}}, before any cap) of the
    counters ``vc`` (the last counters only): :func:`aggregator.anonymize.anonymized_cumulative`
    on the same counters takes them instead of fitting again. ``method="auto"`` fits the pilots
    on the real counters (:mod:`aggregator.selection`), and the error bars' stand-ins are the
    same fits."""
    _FITS.put((vc, float(p), int(layers), {m: np.array(y, dtype=np.int64) for m, y in
                                           fits.items() if m in _N_FREE}))


def forget_fits() -> None:
    """Drop what :func:`remember_fits` keeps, every :class:`LastCounters` memo (the calling
    thread's entries: each thread's release forgets its own counters) and every memo registered
    with :func:`forget_with` (the release path does once its release is made: nothing derived
    from a window's counters outlives its release)."""
    for clear in _FORGET:  # _FITS among them
        clear()


def counters_key(vc: NoisyValueCounts) -> tuple:
    """(lo, BLAKE2b-128 of the value counts): the key of a memo of one set of counters."""
    import hashlib
    return vc.lo, hashlib.blake2b(np.ascontiguousarray(vc.c).tobytes(), digest_size=16).digest()


def forget_with(clear) -> None:
    """Register ``clear`` (a memo's clear()) to run with :func:`forget_fits`: the memos other
    modules keep of the last counters (``auto``'s choice, hashed mode's start) go with it."""
    _FORGET.append(clear)


def _remembered_fit(vc: NoisyValueCounts, p: float, layers: int, method: str):
    held = _FITS.entry
    if held is None:
        return None
    old, p0, k0, fits = held
    if method not in fits or p0 != float(p) or k0 != int(layers):
        return None
    if old is not vc and (old.lo != vc.lo or len(old.c) != len(vc.c)
                          or not np.array_equal(old.c, vc.c)):
        return None
    return fits[method].copy()


