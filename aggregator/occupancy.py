"""Gamma^B: the expected bucket histogram of items hashed uniformly into B buckets, and its
exact inverse (seed 001 section 4, App. B.2, D.2).

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
The same identity read backwards inverts Gamma^B exactly: if psi_l = phi^red_{>=l} is the
(estimated) reduced cumulative prevalence, g_t = (psi_t - psi_{t+1}) / B (g_0 = 1 - psi_1 / B) is
the distribution of a bucket total, and log g must equal the sparse series above. So

    phi_t a = [z^t] log g - sum_{k >= 2, k | t} (-1)^(k+1) a^k phi_{t/k} / k,

a triangular solve after one power-series logarithm (Newton inverse + one product, O(L log L) for
L = the largest reduced value). :func:`invert_gamma` does that; the result is the real-valued
phi with Gamma^B(phi) = psi (Lemma 14: the inverse is 4-Lipschitz in l1 for B > 4n), and the l1
isotonic projection turns it into a valid anonymized histogram. This is the ``"exact"`` variant.

Used by :mod:`aggregator.largedomain` (the hashed release inverts an estimated bucket histogram)
and :mod:`aggregator.bucket_likelihood` (the bucket counters' likelihood of an item histogram).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["INVERT_CAP", "gamma_b", "gamma_b_alg6", "invert_gamma"]

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
        raise ValueError(
            f"{name} must be a finite, non-increasing, non-negative cumulative prevalence"
        )
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
        from scipy import fft  # noqa: PLC0415 (imported on first use: the CLI starts without it)

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
        coef = (-1.0) ** (k + 1) * a**k / k
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
    while k < 64 and mass * a**k / (k + 1) > 1e-18 * max(mass * a, 1e-300):
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
        from scipy import fft  # noqa: PLC0415 (imported on first use: the CLI starts without it)

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
            new[v * k :] += c * E[: N - v * k]
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
        raise ValueError(
            f"psi_1 = {psi[0]:g} >= buckets = {B}: every bucket is occupied, the "
            "collisions cannot be undone (use more buckets)"
        )
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
    out[:K] = np.cumsum(phi[1 : K + 1][::-1])[::-1] + psi[K]
    return out
