"""The threshold estimator: phi_{>=r} unbiased, through the inverse filter of the noise.

For one noise layer the step 1[h >= r] has an unbiased estimate from h' = h + Z alone,

    f(m) = -x at m = -1,   1 + x at m = 0,   1 for m >= 1,   0 below,   x = p / (1 - p)^2,

evaluated at m = h' - r: E f(h + Z - r) = 1[h >= r] (seed 001 eq. (1), Lemma 10). Each further
layer convolves f with g = (-x, (1 + p^2) / (1 - p)^2, -x), the inverse filter of DLap(p), so with
k layers F = f * g^{*(k-1)} and

    phi_hat_{>=r} = sum_j F(h'_j - r) = sum_v c_v F(v - r),

a correlation of the value counts with F (:func:`cumulative_prevalence`). It is unbiased for any
k, but F's l1 norm grows like |g|_1^(k-1) (|g|_1 = (1 + p)^2 / (1 - p)^2, 16.5 at eps = 1): its
variance grows about 100x per layer, and past :data:`THRESHOLD_MAX_GAIN` it is not run
(:func:`threshold_usable`).

Parameters: ``p`` the DLap parameter of one layer, ``layers`` = k, ``R`` the largest r
estimated (default: the largest with a non-zero term).

>>> import numpy as np
>>> m0, F = threshold_kernel(0.5)           # one layer: (-x, 1 + x), x = 2
>>> m0, F.tolist()
(-1, [-2.0, 3.0])
>>> cumulative_prevalence(np.array([3, 0, 1, 0, 0]), 0.1).round(2).tolist()
[1.75, 0.88, 1.12, -0.12]

References: seed 001 Lemma 10 and Appendix E (Algorithms 1 and 5 use this estimate); the
accuracy grid that measured it against the others: docs/accuracy_grid.md.
"""

from __future__ import annotations

import math

import numpy as np

from .counters import check_layers, check_p, noisy_value_counts

__all__ = [
    "threshold_kernel",
    "THRESHOLD_MAX_GAIN",
    "THRESHOLD_GRID_LAYERS",
    "threshold_usable",
    "cumulative_prevalence",
]


def threshold_kernel(p: float, layers: int = 1) -> tuple[int, np.ndarray]:
    """The estimator kernel F on its non-trivial support.

    Returns ``(m0, F)`` with F[i] = F(m0 + i) for m in [m0, layers - 1]; F(m) = 1 above that
    and 0 below. For one layer this is f of seed 001 eq. (1): (-x, 1 + x) at m = -1, 0 with
    x = p / (1-p)^2; each further layer convolves with g = (-x, (1+p^2)/(1-p)^2, -x).
    """
    p = check_p(p)
    k = check_layers(layers)
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
    p = check_p(p)
    x = p / (1.0 - p) ** 2
    gain = 1.0 + 2.0 * x  # |f|_1
    step = (1.0 + p * p) / (1.0 - p) ** 2 + 2.0 * x  # |g|_1
    k = check_layers(layers)
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
    k = check_layers(layers)
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
        c[a - vlo : b - vlo + 1] = vc.c[a - vc.lo : b - vc.lo + 1]
    above = np.concatenate([np.cumsum(vc.c[::-1])[::-1], [0]])  # above[i] = #{v >= lo + i}
    # ge[r - 1] = #{h' >= r + k} = above[r + k - lo], r = 1..R: a slice of `above` (all counters
    # before its start, none past its end); slices, not index arrays: R is ~1e6 at D = 1e7
    ge = np.zeros(R)
    first = 1 + k - vc.lo  # index into `above` of r = 1
    a0, b0 = max(first, 0), min(first + R, len(above))
    if a0 < b0:
        ge[a0 - first : b0 - first] = above[a0:b0]
    ge[: max(0, min(-first, R))] = vc.total  # r + k <= lo
    # sum_{m=-k}^{k-1} F(m) c_{r+m}: a correlation of c with F
    corr = np.correlate(c, F, mode="valid")  # corr[i] = sum_m F[m-m0] c[i + m - m0]
    # c index of v = r + m0 is r + m0 - vlo = r - 1 for m0 = -k, vlo = 1 - k
    ge += corr[:R]
    return ge
