"""Large domains: hashed counters and the inversion of Gamma^B (seed 001 section 4, App. B.2, D.2).

Items from a huge or unknown domain are hashed into B buckets (``PanPrivateHistogram(buckets=B)``);
the counters then hold the *reduced* histogram h^red (bucket totals) plus DLap noise. Colliding
items add up, so the anonymized histogram of the buckets is biased towards fewer, larger counts.
This module undoes that statistically.

The map Gamma^B
---------------
For an anonymized histogram n with prevalences phi_v = #{j : h_j = v}, Gamma^B(n)_l is the
expected number of buckets whose total is >= l when every item picks a bucket uniformly at random
(seed 001 section 4). By linearity, Gamma^B(n)_l = B P[T >= l], where T, the total of one fixed
bucket, has the probability generating function

    G(z) = prod_v (1 - q + q z^v)^phi_v,        q = 1/B.

Items with h_j >= l reach l on their own, so the coefficients of z^0..z^(l-1) of G depend only on
phi_{>=1..l} (Observation 19), and ONE truncated series gives Gamma^B_l for every l at once:
Gamma^B_l = B (1 - sum_{t<l} [z^t] G). With a = q / (1 - q),

    log G(z) = phi_{>=1} log(1 - q) + sum_v phi_v sum_k (-1)^(k+1) a^k z^(vk) / k,

a sparse series (at most ~sqrt(2n) distinct values v, and a^k n is negligible after k ~ 4), so G is
its power-series exponential: :func:`gamma_b` evaluates it with a few FFT products (or exactly,
term by term, on short series). :func:`gamma_b_alg6` is seed 001 Algorithm 6 verbatim (O(n l)),
kept as the reference the tests check against.

Inverting it
------------
The same identity read backwards inverts Gamma^B exactly: if psi_l = phi^red_{>=l} is the (estimated)
reduced cumulative prevalence, g_t = (psi_t - psi_{t+1}) / B (g_0 = 1 - psi_1 / B) is the
distribution of a bucket total, and log g must equal the sparse series above. So

    phi_t a = [z^t] log g - sum_{k >= 2, k | t} (-1)^(k+1) a^k phi_{t/k} / k,

a triangular solve after one power-series logarithm (Newton inverse + one product, O(L log L) for
L = the largest reduced value). :func:`invert_gamma` does that; the result is the real-valued
phi with Gamma^B(phi) = psi (Lemma 14: the inverse is 4-Lipschitz in l1 for B > 4n), and the l1
isotonic projection turns it into a valid anonymized histogram. This is the ``"exact"`` variant.

The paper's Algorithm 7 instead fixes phi_{>=r} greedily for r <= m = ceil(10 log D / log(1/p)) by
binary search (Gamma^B_r is increasing in phi_{>=r} with the lower ones fixed, Lemma 20; in fact it
is affine in it for r >= 2, see :func:`greedy_prefix`) and takes r > m from a second, unhashed
histogram (:func:`two_histogram_estimate`). An unhashed histogram does not exist for an unbounded
domain, so ``"alg7-single"`` takes r > m from the same hashed histogram, where collisions only
shift large counts by about n/B. ``bench/largedomain.py`` measures all of them at equal total
epsilon and memory; docs/large_domains.md has the numbers and the reason for the default.

Privacy: the hash key is drawn before any data and stored with the state, the map is
data-independent, so a hashed state is epsilon-DP exactly like a direct one; everything here is
post-processing of the noisy counters.
"""

from __future__ import annotations

import math

import numpy as np

from .estimate import (
    CAP_RULES, METHODS, MLE_MAX_ITER, MLE_TOL, cap_total, counts_from_cumulative, default_cap,
    default_method, noisy_value_counts, phi_estimate, project_l1, project_l2, rank_box,
)

__all__ = [
    "VARIANTS",
    "DEFAULT_VARIANT",
    "BUCKET_RULES",
    "DEFAULT_BUCKET_RULE",
    "FLAT_RATIO",
    "gamma_b",
    "gamma_b_alg6",
    "invert_gamma",
    "greedy_prefix",
    "reduced_cumulative",
    "HASHED_METHODS",
    "hashed_phi_estimate",
    "sparse_top",
    "alg7_m",
    "hashed_histogram",
    "two_histogram_estimate",
    "l2_histogram",
    "choose_buckets",
    "collision_free_buckets",
]

VARIANTS = ("exact", "alg7-single", "reduced")
DEFAULT_VARIANT = "exact"
# Above this degree the inversion takes phi_{>=r} straight from the reduced histogram: at most
# n / INVERT_CAP items can be that large, and each is shifted by collisions by ~n/B on average.
INVERT_CAP = 1 << 21
_FFT_MIN = 64  # products with a factor shorter than this use np.convolve


# --------------------------------------------------------------------------------------------
# input checks
# --------------------------------------------------------------------------------------------
def _check_buckets(buckets) -> int:
    if isinstance(buckets, bool) or not isinstance(buckets, (int, np.integer)) or buckets < 2:
        raise ValueError(f"buckets must be an integer >= 2, got {buckets!r}")
    return int(buckets)


def _check_cumulative(phi_ge, name="phi_ge", integer=False) -> np.ndarray:
    y = np.asarray(phi_ge)
    if y.ndim != 1:
        raise ValueError(f"{name} must be a 1-d array (phi_{{>=r}} for r = 1, 2, ...)")
    if y.dtype.kind not in "iuf" or (integer and y.dtype.kind == "f"):
        raise TypeError(f"{name} must hold {'integers' if integer else 'numbers'}, got {y.dtype}")
    y = y.astype(np.float64)
    if len(y) and (not np.all(np.isfinite(y)) or y[-1] < 0 or np.any(np.diff(y) > 0)):
        raise ValueError(f"{name} must be a finite, non-increasing, non-negative cumulative "
                         "prevalence")
    return y


def _prevalences(phi_ge: np.ndarray, L: int) -> np.ndarray:
    """phi_v for v = 0..L-1 from phi_{>=r} (index 0 unused); items >= L are left out."""
    y = np.concatenate([phi_ge, [0.0]])
    phi = np.zeros(L)
    top = min(L, len(phi_ge) + 1)
    phi[1:top] = y[: top - 1] - y[1:top]
    return phi


# --------------------------------------------------------------------------------------------
# truncated power series
# --------------------------------------------------------------------------------------------
def _mul(a: np.ndarray, b: np.ndarray, N: int) -> np.ndarray:
    """First N coefficients of the product of two real series."""
    a, b = a[:N], b[:N]
    if min(len(a), len(b)) < _FFT_MIN:
        out = np.convolve(a, b)[:N]
    else:
        from scipy import fft

        size = fft.next_fast_len(len(a) + len(b) - 1, real=True)
        out = fft.irfft(fft.rfft(a, size) * fft.rfft(b, size), size)[:N]
    if len(out) < N:
        out = np.concatenate([out, np.zeros(N - len(out))])
    return out


def _series_inverse(f: np.ndarray, N: int) -> np.ndarray:
    """1/f mod z^N by Newton iteration (f[0] != 0): h <- h (2 - f h), precision doubling."""
    h = np.array([1.0 / f[0]])
    k = 1
    while k < N:
        k2 = min(2 * k, N)
        e = _mul(f, h, k2)
        e[0] -= 1.0  # e = f h - 1 = O(z^k)
        h = np.concatenate([h, np.zeros(k2 - k)]) - _mul(h, e, k2)
        k = k2
    return h


def _series_log1p(u: np.ndarray, N: int) -> np.ndarray:
    """log(1 + u) mod z^N for u with u[0] = 0: integral of u' / (1 + u)."""
    out = np.zeros(N)
    if N <= 1:
        return out
    du = np.arange(1, N) * u[1:N]  # (u')_t for t = 0..N-2
    one_u = u[: N - 1].copy()
    one_u[0] += 1.0
    w = _mul(du, _series_inverse(one_u, N - 1), N - 1)
    out[1:] = w / np.arange(1, N)
    return out


def _log_series(phi: np.ndarray, a: float, N: int, kmax: int) -> np.ndarray:
    """s_t = sum_{vk=t} phi_v (-1)^(k+1) a^k / k for t < N (s_0 = 0)."""
    s = np.zeros(N)
    v = np.arange(N)
    for k in range(1, kmax + 1):
        coef = (-1.0) ** (k + 1) * a ** k / k
        if coef == 0.0:
            break
        top = (N - 1) // k + 1  # v*k < N
        if top <= 1:
            break
        s[v[1:top] * k] += coef * phi[1:top]
    return s


def _kmax(a: float, mass: float) -> int:
    """Number of terms of log(1 + a z^v) to keep: mass * a^(k-1) / k below 1e-18 relative."""
    k = 1
    while k < 64 and mass * a ** k / (k + 1) > 1e-18 * max(mass * a, 1e-300):
        k += 1
    return k


def _series_exp_small(s: np.ndarray, N: int, B: int) -> np.ndarray:
    """exp(s) mod z^N for s with s[0] = 0 and small l1 mass, by Horner's rule on the Taylor series.

    With sigma = sum |s_t|, the Taylor remainder after M terms is at most
    sigma^(M+1) / (M+1)! e^sigma; M is chosen so that B times it is below 1e-9 (Gamma^B is B times a
    probability), and each term is one FFT product with s (s's transform is reused).
    """
    sigma = float(np.abs(s).sum())
    M, term = 0, 1.0
    while term * math.exp(sigma) * B >= 1e-9 and M < 400:
        M += 1
        term *= sigma / M
    if M == 0:
        out = np.zeros(N)
        out[0] = 1.0
        return out
    nz = np.flatnonzero(s)
    short = len(nz) and nz[-1] < _FFT_MIN
    if not short:
        from scipy import fft

        size = fft.next_fast_len(2 * N - 1, real=True)
        S = fft.rfft(s, size)
    R = np.zeros(N)
    R[0] = 1.0
    for j in range(M, 0, -1):
        if short:
            prod = np.convolve(s[: nz[-1] + 1], R)[:N]
        else:
            prod = fft.irfft(S * fft.rfft(R, size), size)[:N]
        R = prod / j
        R[0] += 1.0
    return R


def _exp_direct(phi: np.ndarray, a: float, N: int) -> np.ndarray:
    """prod_v (1 + a z^v)^phi_v mod z^N, factor by factor with (generalized) binomial series.

    Exact up to floating-point rounding (no FFT, no truncated Taylor series); O(N * sum_v K_v)
    where K_v <= (N-1)/v is the number of binomial terms kept. Used on short series.
    """
    E = np.zeros(N)
    E[0] = 1.0
    for v in np.flatnonzero(phi[1:N]) + 1:
        x = float(phi[v])
        new = E.copy()
        c = 1.0
        k = 1
        while v * k < N:
            c *= (x - k + 1) / k * a
            if c == 0.0 or abs(c) < 1e-300:
                break
            new[v * k:] += c * E[: N - v * k]
            k += 1
        E = new
    return E


# --------------------------------------------------------------------------------------------
# Gamma^B
# --------------------------------------------------------------------------------------------
def gamma_b(phi_ge, buckets: int, L: int | None = None, *, method: str = "auto") -> np.ndarray:
    """Gamma^B(n)_l for l = 1..L, from the cumulative prevalence phi_{>=r} (index 0 is r = 1).

    ``phi_ge`` may be real-valued (Gamma^B extends analytically: (1 - q + q z^v)^phi_v). ``L``
    defaults to ``len(phi_ge)``; phi_{>=r} = 0 beyond the array. ``method`` is ``"direct"``
    (binomial factors, exact up to rounding, O(L^2) worst case), ``"fft"`` (exponential of the
    sparse log-series by FFT products, O(M L log L) with M ~ 10-20 Taylor terms), or ``"auto"``
    (direct for L <= 2048).

    >>> import numpy as np
    >>> g = gamma_b(np.array([3, 1]), buckets=10)   # items of sizes 2, 1, 1
    >>> round(float(g[0]), 4), round(float(g[1]), 4)   # E #buckets >= 1, >= 2
    (2.71, 1.09)
    """
    B = _check_buckets(buckets)
    phi_ge = _check_cumulative(phi_ge)
    L = len(phi_ge) if L is None else int(L)
    if L < 0:
        raise ValueError("L must be >= 0")
    if L == 0:
        return np.zeros(0)
    if method not in ("auto", "direct", "fft"):
        raise ValueError(f"method must be 'auto', 'direct' or 'fft', got {method!r}")
    if method == "auto":
        method = "direct" if L <= 2048 else "fft"
    total = float(phi_ge[0]) if len(phi_ge) else 0.0  # phi_{>=1}: every item
    q = 1.0 / B
    a = 1.0 / (B - 1)  # q / (1 - q)
    phi = _prevalences(phi_ge, L)  # degrees 0..L-1 matter for Gamma_1..Gamma_L
    if method == "direct":
        E = _exp_direct(phi, a, L)
    else:
        s = _log_series(phi, a, L, _kmax(a, total))
        E = _series_exp_small(s, L, B)
    # P[T >= l] = P[T >= 1] - sum_{t=1}^{l-1} G_t, G = (1-q)^phi_{>=1} E, no cancellation at l = 1
    lead = math.exp(total * math.log1p(-q))
    tail = -math.expm1(total * math.log1p(-q)) - lead * np.concatenate([[0.0], np.cumsum(E[1:L])])
    return B * np.maximum(tail, 0.0)


def gamma_b_alg6(phi_ge, buckets: int, ell: int | None = None) -> float:
    """Gamma^B(phi_{>=1}, ..., phi_{>=ell})_ell by seed 001 Algorithm 6, verbatim (O(n ell)).

    Reference implementation for the tests (integer prevalences; one update per item). ``ell``
    defaults to ``len(phi_ge)``; entries beyond ``ell`` are ignored (Observation 19).
    """
    B = _check_buckets(buckets)
    phi_ge = np.asarray(phi_ge)
    if phi_ge.dtype.kind not in "iu":
        raise TypeError("Algorithm 6 takes integer cumulative prevalences")
    ell = len(phi_ge) if ell is None else int(ell)
    y = [int(x) for x in phi_ge[:ell]] + [0] * max(0, ell - len(phi_ge))
    y.append(0)  # phi_{>=ell+1} <- 0: items >= ell count as ell
    xi = np.zeros(ell + 1)
    xi[0] = 1.0
    k = np.arange(ell + 1)
    for r in range(1, ell + 1):
        src = np.maximum(k - r, 0)
        for _ in range(y[r - 1] - y[r]):  # add a histogram entry of value r
            xi = (B - 1) / B * xi + xi[src] / B  # right side uses the old values, as k descends
    return B * float(xi[ell])


# --------------------------------------------------------------------------------------------
# inversions
# --------------------------------------------------------------------------------------------
def invert_gamma(psi_ge, buckets: int, *, cap: int = INVERT_CAP) -> np.ndarray:
    """Real-valued phi_{>=r} with Gamma^B(phi) = psi (the exact inverse), r = 1..2 len(psi).

    ``psi_ge`` is a reduced cumulative prevalence (number of buckets with total >= r; zero beyond
    the array), with psi_1 < B. The output is not projected: it can be non-monotone or negative
    when psi is noisy.

    Why twice the length: the inverse divides out the *expected* collisions. If the largest item
    (size L) happened not to collide, the inverse still assumes that a fraction ~D/B of items like
    it moved above L, so it adds that fraction at L; the matching negative mass sits at L + s
    (s = a collider's size <= L). Stopping at L would keep the phantom and drop its counterweight,
    an error of about (D/B) L per large item; going to 2L keeps both, so they cancel in
    phi_{>=r} for r <= L and the projection then removes the negative tail.

    Degrees above ``cap`` (:data:`INVERT_CAP`) are not inverted: when 2L > cap, degrees up to
    cap/2 are inverted (with their counterweights up to cap) and phi_{>=r} = psi_r above cap/2.

    >>> import numpy as np
    >>> phi = np.array([50.0, 20.0, 20.0, 5.0])
    >>> back = invert_gamma(gamma_b(phi, 1000, L=40), 1000)
    >>> bool(np.allclose(back[:4], phi)) and bool(np.allclose(back[4:], 0))
    True
    """
    B = _check_buckets(buckets)
    psi = _check_cumulative(psi_ge, "psi_ge")
    L = len(psi)
    if L == 0:
        return np.zeros(0)
    if psi[0] >= B:
        raise ValueError(f"psi_1 = {psi[0]:g} >= buckets = {B}: every bucket is occupied, the "
                         "collisions cannot be undone (use more buckets)")
    cap = max(int(cap), 2)
    K = min(L, cap // 2)  # highest degree whose phi comes from the inverse
    N = 2 * K + 1  # degrees 0..2K of the bucket-total distribution
    y = np.concatenate([psi, np.zeros(max(0, N - L))])
    g = np.zeros(N)
    g[0] = 1.0 - psi[0] / B
    g[1:N] = (y[: N - 1] - y[1:N]) / B
    u = g / g[0]
    u[0] = 0.0
    ell = _series_log1p(u, N)  # log g - log g_0
    a = 1.0 / (B - 1)
    kmax = _kmax(a, float(psi[0]))
    base = ell / a
    phi = base.copy()
    for _ in range(3):  # fixed point of phi = base - corrections(phi); corrections are O(a phi)
        corr = np.zeros(N)
        for k in range(2, kmax + 1):
            top = (N - 1) // k + 1
            if top <= 1:
                break
            corr[np.arange(1, top) * k] += (-1.0) ** (k + 1) * a ** (k - 1) / k * phi[1:top]
        phi = base - corr
    if K == L:  # everything inverted, counterweights included
        return np.cumsum(phi[1:N][::-1])[::-1]
    out = psi.copy()
    # phi_{>=r} for r <= K: inverted prevalences at r..K plus the raw count above K
    out[:K] = np.cumsum(phi[1:K + 1][::-1])[::-1] + psi[K]
    return out


def alg7_m(domain: int, p: float) -> int:
    """m = ceil(10 log D / log(1/p)) of seed 001 Algorithm 7."""
    return max(1, math.ceil(10.0 * math.log(max(int(domain), 2)) / math.log(1.0 / p)))


def greedy_prefix(psi_ge, buckets: int, n: int, m: int) -> np.ndarray:
    """phi_hat_{>=r}, r = 1..m, by the binary searches of seed 001 Algorithm 7 (integers).

    For each r, phi_hat_{>=r} in [0, phi_hat_{>=r-1}] (phi_hat_{>=0} = n) is the integer whose
    Gamma^B(phi_hat_{>=1}, ..., phi_hat_{>=r-1}, x)_r is closest to psi_r. The binary search is the
    paper's; each evaluation is O(1) because, with the lower values fixed,

        Gamma_r(x) = B [1 - (1-q)^phi_{>=1} (S_r + (phi_{>=r-1} - x) a)]      (r >= 2),

    where S_r = sum_{t<r} [z^t] prod_{v<=r-2} (1 + a z^v)^phi_v is kept up to date as each
    prevalence becomes known (a = q/(1-q)); Gamma_1(x) = B (1 - (1-q)^x). The affine form is
    Lemma 20 made exact: raising phi_{>=r} by one moves Gamma_r by (1-q)^(phi_{>=1} - 1) < 1.
    """
    B = _check_buckets(buckets)
    psi = _check_cumulative(psi_ge, "psi_ge")
    m = int(m)
    if m < 1:
        raise ValueError("m must be >= 1")
    n = int(n)
    target = np.concatenate([psi, np.zeros(max(0, m - len(psi)))])[:m]
    q = 1.0 / B
    a = 1.0 / (B - 1)
    lq = math.log1p(-q)
    E = np.zeros(m + 1)  # normalized generating function of the items fixed so far (degrees <= m)
    E[0] = 1.0
    out = np.zeros(m, dtype=np.int64)
    prev = n  # phi_hat_{>=0}
    total = 0  # phi_hat_{>=1}
    for r in range(1, m + 1):
        if r == 1:
            def gam(x):
                return -B * math.expm1(x * lq)
        else:
            if r >= 3:  # fold in phi_{r-2} (known since step r-1) before using S_r
                v = r - 2
                cnt = int(out[v - 1] - out[v])  # phi_hat_{>=v} - phi_hat_{>=v+1}
                if cnt:
                    new = E.copy()
                    c, k = 1.0, 1
                    while v * k <= m and k <= cnt:
                        c *= (cnt - k + 1) / k * a
                        if c < 1e-300:
                            break
                        new[v * k:] += c * E[: m + 1 - v * k]
                        k += 1
                    E = new
            S = float(E[:r].sum())
            lead = math.exp(total * lq)
            head = -math.expm1(total * lq)

            def gam(x, S=S, lead=lead, head=head, up=prev):
                return B * (head - lead * (S - 1.0 + (up - x) * a))
        lb, ub = 0, prev
        while ub > lb + 1:
            mid = (ub + lb) // 2
            if gam(mid) >= target[r - 1]:
                ub = mid
            else:
                lb = mid
        pick = lb if abs(gam(lb) - target[r - 1]) <= abs(gam(ub) - target[r - 1]) else ub
        out[r - 1] = pick
        if r == 1:
            total = pick
        prev = pick
    return out


def _pad(y: np.ndarray, R: int) -> np.ndarray:
    return np.concatenate([y, np.zeros(max(0, R - len(y)), dtype=y.dtype)])[:R]


# Estimators of the reduced (bucket) cumulative prevalence: those of aggregator.estimate ("mle" is
# the EM NPMLE run to convergence, "deconvolution" the same EM stopped early by its tolerance).
HASHED_METHODS = METHODS
__all__ += ["MLE_MAX_ITER", "MLE_TOL"]  # re-exported: they define "mle"
__all__ += ["hashed_cumulative"]


def hashed_phi_estimate(noisy_counts, p, *, layers=1, method=None, n=None) -> np.ndarray:
    """phi_hat_{>=r} of the B bucket counters (not projected).

    ``n``: the number of events, public under replace-one; the bucket totals sum to it. ``"xfit"``
    fits under it. ``"auto"`` does not get it: with n its bootstrap also weighs capping the
    *reduced* histogram (pilots thinned to n, the cap rules as candidates), while the release caps
    the *item* histogram after the inversion; measured on the accuracy grid's 17 hashed cells
    (docs/accuracy_grid.md, "The EM change, re-measured"), handing it n raised the 2-layer
    geometric-mean regret from 1.13 to 1.22 ('distinct' n = 1e6, eps = 0.25: 2.1x the mean error
    over eight bootstrap draws, the bad pick in six) and changed nothing at 1 layer, so the
    selection runs uncapped as the grid chose it.

    Default (``method=None``): ``estimate.default_method("hashed", layers)``, the lowest
    worst-case regret over the accuracy grid's hashed cells (docs/accuracy_grid.md).

    What sets hashed mode apart: most of the B counters are empty (B ~ 2 n, D ~ 0.35 n occupied),
    and the threshold estimator's kernel (-x, 1 + x) turns every empty bucket's DLap noise into
    a +-(1 + x) term at r = 1, 2, ...; the NPMLE uses that counter values are h + DLap with
    h >= 0, so the mass of the negative noisy values pins down the empty buckets. The
    early-stopped EM stops on a log-likelihood gain per counter, i.e. ~1e-5 B nats in total, so
    with millions of mostly-empty counters it stops far from the data; run to convergence
    (``"mle"``) the fit is a fixed function of the data (docs/large_domains.md).
    """
    if method is not None and method not in HASHED_METHODS:
        raise ValueError(f"method must be one of {HASHED_METHODS}, got {method!r}")
    if method is None:
        method = default_method("hashed", int(layers))
    return phi_estimate(noisy_counts, p, layers=int(layers), method=method, mode="hashed",
                        n=None if method == "auto" else n)


def reduced_cumulative(noisy_counts, p, *, layers=1, method=None, n=None) -> np.ndarray:
    """Projected estimate of the reduced (bucket) cumulative prevalence: Algorithm 1 on the buckets
    with the estimator of :func:`hashed_phi_estimate`."""
    vc = noisy_value_counts(noisy_counts)
    return project_l1(hashed_phi_estimate(vc, p, layers=int(layers), method=method, n=n))


def hashed_histogram(noisy_counts, p, *, buckets, n=None, layers=1, loss="l1", method=None,
                     variant=DEFAULT_VARIANT, m=None, cap=None) -> np.ndarray:
    """Anonymized histogram of the items from B hashed counters (the ``buckets=`` path).

    Parameters
    ----------
    noisy_counts
        The B noisy bucket counters (or their :class:`NoisyValueCounts`, e.g. merged across
        partitions); each carries ``layers`` DLap(p) layers.
    buckets
        B, the number of counters (must equal their count).
    n
        Number of events. Needed by ``"alg7-single"`` (phi_hat_{>=0} = n) and ``loss="l2"``;
        with ``loss="l1"`` the item histogram is capped at n events (``estimate.cap_total``).
    loss
        ``"l1"`` or ``"l2"`` (seed 001 Algorithm 4 with the box taken from these same counters,
        see :func:`l2_histogram`).
    method
        Estimator of the reduced cumulative prevalence (:data:`HASHED_METHODS`). Default:
        ``estimate.default_method("hashed", layers)`` (see :func:`hashed_phi_estimate`).
    variant
        ``"exact"`` (default): invert Gamma^B at every degree (:func:`invert_gamma`), then project.
        ``"alg7-single"``: Algorithm 7's binary searches for r <= m, the hashed histogram itself
        for r > m. ``"reduced"``: no inversion (the bucket histogram as it is; a baseline).
    m
        Algorithm 7's cut-off; default :func:`alg7_m` (B, p).
    cap
        Rule that caps the total at n (``estimate.CAP_RULES``; default
        ``estimate.default_cap("hashed", layers)``).
    """
    vc = noisy_value_counts(noisy_counts)
    B = _check_buckets(buckets)
    if vc.total != B:
        raise ValueError(f"buckets={B} but {vc.total} counters were given")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if loss == "l2":
        return l2_histogram(vc, p, buckets=B, n=n, layers=layers, method=method, variant=variant)
    if loss != "l1":
        raise ValueError(f"loss must be 'l1' or 'l2', got {loss!r}")
    cap = default_cap("hashed", layers) if cap is None else cap
    if cap not in CAP_RULES:
        raise ValueError(f"cap must be one of {CAP_RULES}, got {cap!r}")
    return counts_from_cumulative(_hashed_cumulative(vc, p, B, n, layers, method, variant, m, cap))


def _hashed_cumulative(vc, p, B: int, n, layers, method, variant, m, cap,
                       phi=None) -> np.ndarray:
    """The l1 release's cumulative prevalence (before listing its counts): what
    :func:`hashed_histogram` lists, for callers that work on phi_{>=r} (the bootstrap).
    ``phi``: :func:`hashed_phi_estimate` of these counters when the caller has it."""
    from .estimate import _remembered_fit
    if phi is not None:
        psi = project_l1(phi)
    else:  # auto's pilots on these bucket counters are the reduced estimates it would make
        psi = None if method is None else _remembered_fit(vc, p, int(layers), method)
        if psi is None:
            psi = reduced_cumulative(vc, p, layers=layers, method=method, n=n)
    y = _invert(psi, B, n, p, variant, m, sparse_above=sparse_top(vc, p, int(layers)))
    return y if n is None else cap_total(y, n, cap)


def hashed_cumulative(noisy_counts, p, *, buckets, n=None, layers=1, method=None,
                      variant=DEFAULT_VARIANT, m=None, cap=None) -> np.ndarray:
    """phi_{>=r} of :func:`hashed_histogram` with ``loss="l1"`` (the same histogram, as a
    cumulative prevalence: ``counts_from_cumulative`` of it is exactly that histogram)."""
    vc = noisy_value_counts(noisy_counts)
    B = _check_buckets(buckets)
    if vc.total != B:
        raise ValueError(f"buckets={B} but {vc.total} counters were given")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    cap = default_cap("hashed", layers) if cap is None else cap
    if cap not in CAP_RULES:
        raise ValueError(f"cap must be one of {CAP_RULES}, got {cap!r}")
    return _hashed_cumulative(vc, p, B, n, layers, method, variant, m, cap)


def sparse_top(noisy_counts, p: float, layers: int = 1) -> int:
    """The count above which the hashed release leaves collisions uncorrected: the top of the
    EM's axis (``estimate.sparse_top``), above which every bucket is a sparse counter.

    The inverse of Gamma^B is a power series as long as twice the largest count (2e6 terms at
    n = 1e7: 1.5 s), while above the dense range each bucket holds one large item plus the
    other items that hashed into it: (n - v) / B events in expectation for an item of v events
    (each other event lands there with probability 1/B). Leaving those buckets as they are
    costs each such item at most n / B events of l1 error in expectation (0.5 at B = 2n), the
    order of the noise the EM passes through there (E|Z| = 0.85 at eps = 1).
    """
    from .estimate import sparse_top as em_top
    return em_top(noisy_value_counts(noisy_counts), p, layers)


SPARSE_CUT_RATIO = 8  # the inversion stops at the dense top only if the counts reach 8x beyond it

SNAP = 1e-4


def _snap(phi: np.ndarray, L: int) -> np.ndarray:
    """Prepare the real-valued inverse for the l1 projection without changing its result.

    Above the largest reduced value L only the counterweights remain; if they are all below 1/2
    the projection sets them to 0 whatever the rest is, so they are dropped. Entries within
    :data:`SNAP` of an integer (nearly all large-r entries: collision corrections there are
    ~1e-7) are set to it: on integer y the cost changes by at most SNAP per entry, and the runs of
    equal values collapse (1.3e6 runs -> ~2e4 at n = 1e7, projection 5 s -> 0.05 s; results
    identical in the benchmark's checks).
    """
    if len(phi) > L and phi[L:].max() < 0.5:
        phi = phi[:L]
    near = np.rint(phi)
    close = np.abs(phi - near) < SNAP
    return np.where(close, near, phi)


def _invert(psi: np.ndarray, B: int, n, p: float, variant: str, m,
            sparse_above: int | None = None) -> np.ndarray:
    """Valid cumulative prevalence of the items from the projected reduced one.

    ``sparse_above``: a count above which every bucket is a sparse counter (:func:`sparse_top`);
    degrees above it are not inverted (``invert_gamma``'s cap at twice it) when the reduced
    histogram reaches far beyond it (:data:`SPARSE_CUT_RATIO`): that is where the series is
    long, and a cut just below the top left a half-inverted tail that the blow-up check below
    does not see (hashed 'distinct' n = 1e3 cells: 52 -> 1936 events of error).
    """
    if len(psi) == 0 or psi[0] == 0:
        return np.zeros(0, dtype=np.int64)
    if variant == "reduced":
        return psi
    if variant == "exact":
        psi_f = np.minimum(psi, B - 1).astype(np.float64)
        cap = INVERT_CAP
        if sparse_above is not None and len(psi) > SPARSE_CUT_RATIO * max(sparse_above, 1):
            cap = min(INVERT_CAP, 2 * max(sparse_above, 1))
        with np.errstate(all="ignore"):
            phi = invert_gamma(psi_f, B, cap=cap)
        # The power-series inverse is well conditioned while psi_1 is well below B (Lemma 14 asks
        # B > 4n); with most buckets occupied, noise can make it blow up. Fall back to Algorithm 7's
        # clipped binary searches then.
        if np.all(np.isfinite(phi)) and np.abs(phi).max() <= 4.0 * psi_f[0] + 16.0:
            return project_l1(_snap(phi, len(psi)))
        variant = "alg7-single"
        if n is None:
            n = int(np.sum(psi))  # the reduced histogram's total is n
    if n is None:
        raise ValueError("variant 'alg7-single' needs n (phi_hat_{>=0} = n)")
    m = alg7_m(B, p) if m is None else int(m)
    mm = min(m, len(psi))
    low = greedy_prefix(psi, B, int(n), mm).astype(np.float64)
    return project_l1(np.concatenate([low, psi[mm:]]))


def two_histogram_estimate(noisy_direct, p_direct, noisy_hashed, p_hashed, *, buckets, n,
                           layers_direct=1, layers_hashed=1, method=None, m=None) -> np.ndarray:
    """Seed 001 Algorithm 7 with its two histograms.

    ``noisy_direct`` are D unhashed noisy counters (one per domain item, or a hash into >= n^2
    buckets so that collisions are unlikely), ``noisy_hashed`` the B hashed ones. phi_{>=r} for
    r <= m = ceil(10 log D / log(1/p_direct)) comes from the binary searches on the hashed
    histogram, r > m from the unhashed one; the l1 isotonic projection joins them. The two
    histograms are two releases, so their epsilons add (the paper uses eps/2 each).
    """
    B = _check_buckets(buckets)
    vh = noisy_value_counts(noisy_hashed)
    if vh.total != B:
        raise ValueError(f"buckets={B} but {vh.total} hashed counters were given")
    vd = noisy_value_counts(noisy_direct)
    psi = reduced_cumulative(vh, p_hashed, layers=layers_hashed, method=method)
    direct = reduced_cumulative(vd, p_direct, layers=layers_direct, method=method)
    m = alg7_m(vd.total, p_direct) if m is None else int(m)
    low = greedy_prefix(psi, B, int(n), m).astype(np.float64)
    high = _pad(direct.astype(np.float64), max(len(direct), m))[m:]
    y = np.concatenate([low, high])
    return counts_from_cumulative(project_l1(y))


def l2_histogram(noisy_counts, p, *, buckets, n, layers=1, method=None, variant=DEFAULT_VARIANT,
                 box_counts=None, box_p=None, box_layers=None) -> np.ndarray:
    """Seed 001 Algorithm 4 (l2^2 loss, large domains).

    Runs the l1 estimator on the B hashed counters, then returns the anonymized histogram closest
    in l1 to it with sum n and every rank within gamma = 10 log(2 n B2) / log(1/p) of the sorted
    noisy counters of a second histogram with B2 buckets (``box_counts``). The paper takes
    B2 >> n^2 so that no two items collide there w.h.p. (then the box holds w.h.p.); that costs
    B2 counters of memory (see :func:`collision_free_buckets`). Without ``box_counts`` the box
    comes from the same B hashed counters: no extra memory, but the box is wrong whenever two
    items larger than about gamma share a bucket (probability ~ N_big^2 / (2B)), and then the
    result can be far off in l2. Returns the all-zero histogram when the box is infeasible.
    """
    if n is None:
        raise ValueError("loss='l2' needs n (the number of events, public under replace-one)")
    n = int(n)
    vc = noisy_value_counts(noisy_counts)
    B = _check_buckets(buckets)
    y1 = _invert(reduced_cumulative(vc, p, layers=layers, method=method), B, n, p, variant, None)
    if box_counts is None:
        vb, pb = vc, p
    else:
        vb = noisy_value_counts(box_counts)
        pb = p if box_p is None else box_p
    gamma = 10.0 * math.log(max(2 * n * vb.total, 2)) / math.log(1.0 / pb)
    R = max(len(y1), int(vb.hi + gamma) + 1, 1)
    lower, upper = rank_box(vb, gamma, R)
    y = project_l2(_pad(y1.astype(np.float64), R), n, lower, upper)
    if y is None:
        return np.zeros(0, dtype=np.int64)
    return counts_from_cumulative(y)


# --------------------------------------------------------------------------------------------
# choosing B
# --------------------------------------------------------------------------------------------
BUCKET_RULES = ("flat", "capped", "corollary13", "footnote7")
DEFAULT_BUCKET_RULE = "flat"
FLAT_RATIO = 2.0  # B / n of the "flat" rule (docs/large_domains.md, "Choosing B")


def choose_buckets(n_expected, epsilon, *, rule=DEFAULT_BUCKET_RULE, min_ratio=1.0) -> int:
    """Number of hash buckets B for an expected number of events n (chosen before any data).

    * ``"flat"`` (default): B = 2 n (:data:`FLAT_RATIO`), whatever eps. Measured in
      docs/large_domains.md ("Choosing B") over B/n in 0.5..4, four item distributions (distinct
      fraction D/n from 0.01 to 0.98), n = 1e4..1e7 and eps in {0.5, 1, 2}: B = 2 n had the lowest
      worst case over the distributions (hashed / oracle-direct l1 error) and the lowest geometric
      mean. The best B grows with D/n (steep Zipf items, few distinct, want B < n: every empty
      bucket adds noise; mostly-distinct items want 2-3 n: collisions), and D/n is not known
      when B is fixed; 2 n is where neither side loses much.
    * ``"capped"`` (the default before): footnote 7 kept between 1.5 n and Corollary 13's
      n sqrt(log n), i.e. 1.5 n at eps = 0.5 and n sqrt(log n) (3-4 n) at eps >= 1.
    * ``"corollary13"``: B = n sqrt(log n) (seed 001 Corollary 13; it balances the empty-bucket
      noise sqrt(C_p B log n) against the collision term n log n / sqrt(B) of Theorem 12
      asymptotically, with constants that do not matter there but do at n <= 1e7).
    * ``"footnote7"``: B = n sqrt(eps^2.5 log n) (its footnote 7: fewer buckets, so less noise
      from empty ones, when eps is small; more when eps is large).

    Every rule is clamped to B >= ``min_ratio`` * n and B >= 16. ``epsilon`` is the per-layer
    epsilon of the state (p = exp(-eps/2)); the default rule does not use it. Memory is B counters.
    When the real n differs from the expected one (measured in docs/large_domains.md): with more
    events there are more collisions, still undone by the inversion, and the error grows slowly
    until most buckets are occupied (the exact inverse then falls back to Algorithm 7's clipped
    search); with fewer events there are more empty buckets, each adding noise, so the error is
    that of a larger B.

    >>> choose_buckets(10**6, 1.0, rule="corollary13")
    3716923
    >>> choose_buckets(10**6, 1.0)
    2000000
    """
    if isinstance(n_expected, bool) or not isinstance(n_expected, (int, float, np.integer,
                                                                   np.floating)):
        raise TypeError(f"n_expected must be a number, got {type(n_expected).__name__}")
    n = float(n_expected)
    if not math.isfinite(n) or n < 1:
        raise ValueError(f"n_expected must be >= 1, got {n_expected!r}")
    eps = float(epsilon)
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"epsilon must be a positive finite number, got {epsilon!r}")
    if rule not in BUCKET_RULES:
        raise ValueError(f"rule must be one of {BUCKET_RULES}, got {rule!r}")
    min_ratio = float(min_ratio)
    if not min_ratio > 0:
        raise ValueError("min_ratio must be > 0")
    logn = math.log(max(n, 2.0))
    cor13 = math.sqrt(logn)
    fn7 = math.sqrt(eps ** 2.5 * logn)
    ratio = {"flat": FLAT_RATIO, "corollary13": cor13, "footnote7": fn7,
             "capped": min(cor13, max(1.5, fn7))}[rule]
    return int(max(math.ceil(n * max(ratio, min_ratio)), 16))


def collision_free_buckets(distinct: float, delta: float = 0.05) -> int:
    """B2 with P[any two of ``distinct`` items collide] <= delta: ceil(d (d - 1) / (2 delta))."""
    d = float(distinct)
    if d < 1 or not 0 < delta < 1:
        raise ValueError("need distinct >= 1 and 0 < delta < 1")
    return int(math.ceil(d * (d - 1) / (2 * delta))) + 1
