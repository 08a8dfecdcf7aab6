"""The EM for the prevalences: nonparametric maximum likelihood on the noisy value counts.

Model: counter j holds h_j drawn from an unknown pmf pi on {0, 1, ...} and shows h'_j = h_j + Z_j,
Z_j with the known k-layer noise pmf q (:func:`aggregator.counters.noise_pmf`). The likelihood of
the value counts c_v is

    log L(pi) = sum_v c_v log m_v,     m = pi * q,

concave in pi; its maximizer over pmfs is the NPMLE (Kiefer and Wolfowitz 1956). EM reaches it by

    pi <- pi . (q * (c / m))                       (w = c / sum c, ratios at non-zero counts)

which raises L at every step (:func:`em_step`; with the public n, the M-step under the mean
constraint sum_h h pi_h = n / D: :func:`mean_m_step`). SQUAREM (:func:`squarem`) extrapolates two
EM steps at a time and keeps the likelihood monotone.

The axis (:class:`EMProblem`, :func:`em_problem`): q vanishes beyond K (a 1e-10 tail,
:data:`EM_TAIL`), so the likelihood separates over clusters of noisy values more than 2K apart. A
cluster holding one distinct value is solved exactly (a point mass at max(v, 0)); a counter with
fewer than :data:`SPARSE_DENSITY` counters per value within +-K of it is passed through at its
noisy value (its l1 error then |Z_j|, :func:`pass_through_bound`); the rest run on one compressed
axis where each cluster keeps its span and spans are separated by zeros the kernel cannot cross.

Where the EM stops is part of the estimator built on it: :mod:`aggregator.deconvolution` (a
tolerance, or run to convergence), :mod:`aggregator.crossfit` (held-out likelihood).

>>> import numpy as np
>>> from aggregator.counters import noisy_value_counts
>>> prob = em_problem(noisy_value_counts(np.array([0, 1, 0, 2, 1, 0, 9])), 0.5, 1)
>>> round(float(prob.w.sum()))   # all 7 within the noise's reach of each other: one cluster
7
>>> pi = prob.start(prob.w / prob.w.sum())
>>> bool(abs(pi.sum() - 1) < 1e-12 and (pi >= 0).all())
True

References: Kiefer and Wolfowitz (1956), consistency of the NPMLE; Laird (1978), its EM; Varadhan
and Roland (2008), SQUAREM (scheme S3); docs/estimators.md and docs/accuracy_grid.md for the
shortcuts' measured effect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .convolution import convolve, convolver
from .counters import NoisyValueCounts, check_layers, noise_pmf, noisy_value_counts

__all__ = [
    "EMProblem",
    "em_problem",
    "em_step",
    "mean_m_step",
    "squarem",
    "sparse_top",
    "pass_through_bound",
    "START_SMOOTH_SHARE",
    "DIRECT_START_SMOOTH_SHARE",
    "EM_TAIL",
    "SPARSE_DENSITY",
]


def em_step(
    pi: np.ndarray, w: np.ndarray, nz: np.ndarray, q: np.ndarray, mean=None, m=None
) -> np.ndarray:
    """One EM update of the mixing pmf (q symmetric, so convolution = correlation).

    ``mean`` = (h, mu): the M-step under the linear constraint sum_h h pi_h = mu (the public n
    fixes the mean count per counter); see :func:`mean_m_step`. ``m``: pi * q when the caller
    already has it (the log-likelihood of pi computed it).
    """
    if m is None:
        m = convolve(pi, q)
    ratio = np.zeros_like(m)
    ratio[nz] = w[nz] / np.maximum(m[nz], 1e-300)
    out = pi * convolve(ratio, q)
    if mean is not None:
        out = mean_m_step(out, *mean)
    return out


def mean_m_step(u: np.ndarray, h: np.ndarray, mu: float) -> np.ndarray:
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
    m = convolve(pi, q)
    # elementwise sums, not BLAS dot: OpenBLAS threads stall when the other core is busy
    return float((w[nz] * np.log(np.maximum(m[nz], 1e-300))).sum()), m


def squarem(
    pi, w, nz, q, allowed, max_iter, tol, zero_idx=None, callback=None, mean=None, early=None
):
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
    # the same steps as em_step / _loglik with their per-call set-up made once: the positions
    # of the non-zero counts and the convolution (identical arithmetic, identical results)
    idx = np.flatnonzero(nz)
    w_nz = w[idx]
    conv = convolver(q, len(pi))

    def em_step(x, m=None):
        if m is None:
            m = conv(x)
        ratio = np.zeros_like(m)
        ratio[idx] = w_nz / np.maximum(m[idx], 1e-300)
        out = x * conv(ratio)
        return out if mean is None else mean_m_step(out, *mean)

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
        gain = (ll_new - ll) / (1.0 if zero_idx is None else max(1.0 - float(new[zero_idx]), 1e-6))
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
class EMProblem:
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
            h[off : off + hi_v - lo_v + 1] = np.arange(lo_v, hi_v + 1)
        return np.maximum(h, 0.0) * (self.allowed > 0)

    def mean_constraint(self, n):
        """(h, mu) for :func:`em_step`: the axis' counters hold the n events minus those of
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
                out[off + a - lo_v : off + b - lo_v + 1] = vc.c[a - vc.lo : b - vc.lo + 1]
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
        about its value (Var Z >> Var T: hash buckets, several layers) the early-stopped EM ends
        near its start. Over-dispersed bucket totals look like fewer, larger items, and the
        inversion of Gamma^B then under-counted mostly distinct users. One linear map is wrong
        for heavy tails, so the hashed release keeps whichever start's fit the counters'
        likelihood prefers (``aggregator.largedomain._likelier_start``). The figures:
        docs/core_figures.md, "The EM's shrunk start"."""
        off, lo_v, hi_v = next(s for s in self.spans if s[1] <= 0 <= s[2])
        seg = w[off : off + hi_v - lo_v + 1].astype(np.float64)
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
        out[off : off + len(seg)] = (
            moved[: len(seg)] / moved[: len(seg)].sum() * out[off : off + len(seg)].sum()
        )
        out = (out + 1e-12) * self.allowed
        return out / out.sum()

    def cumulative(self, pi: np.ndarray | None, R=None) -> np.ndarray:
        """phi_{>=r}, r = 1.., from the fitted axis pmf ``pi`` plus the solved clusters."""
        mass = self.mass.copy()
        if pi is not None:
            total = self.w.sum()
            for off, lo_v, hi_v in self.spans:
                h0 = max(lo_v, 0)
                seg = pi[off + h0 - lo_v : off + hi_v - lo_v + 1] * total
                mass[h0 : h0 + len(seg)] += seg
        est = np.cumsum(mass[::-1])[::-1][1:]  # r = 1..len(mass) - 1
        if R is not None:
            R = int(R)
            est = np.concatenate([est, np.zeros(max(0, R - len(est)))])[:R]
        return est


START_SMOOTH_SHARE = 0.05  # of the smoothed start in the shrunk one (every count keeps support)
# ... in direct mode's (``selection``'s likelier start): with millions of counters 0.05 of the
# over-dispersed start is the very tail the shrunk start is there to remove
# (docs/core_figures.md, "The EM's shrunk start")
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
    there (a tiny share of the counters, most of the EM's axis: docs/core_figures.md, "Sparse
    counters"). Such a counter, if above K (its window clear of the empty counters' noise), is
    released as a point mass at its noisy value. Its l1 error is then exactly |Z_j|, its noise;
    over the passed counters at most sum_j |Z_j|, in expectation their number times E|Z|
    (:func:`pass_through_bound`). ``density`` = 0 passes nothing (the exact NPMLE's clusters).
    """
    if density <= 0 or len(vals) == 0:
        return np.zeros(len(vals), dtype=bool)
    cs = np.concatenate([[0.0], np.cumsum(cnt)])
    near = (
        cs[np.searchsorted(vals, vals + K, "right")] - cs[np.searchsorted(vals, vals - K, "left")]
    )
    return (vals > K) & (near < density * (2 * K + 1))


def sparse_top(noisy_counts, p: float, layers: int = 1, sparse: float | None = None) -> int:
    """The largest count the EM can place mass at (the top of its axis, K above the largest
    noisy value it fits); every larger count comes from a counter passed through or solved alone
    (:func:`_sparse_counters`). 0 when the EM fits nothing."""
    prob = em_problem(noisy_value_counts(noisy_counts), p, check_layers(layers), sparse=sparse)
    return max((hi for _, _, hi in prob.spans), default=0)


def pass_through_bound(p: float, layers: int = 1) -> float:
    """E|Z| for Z the sum of ``layers`` DLap(p) draws: the expected l1 error of one counter
    released at its noisy value (the EM's sparse counters, :func:`_sparse_counters`).

    >>> round(pass_through_bound(0.5), 4)   # one layer: 2p / (1 - p^2)
    1.3333
    """
    K, q = noise_pmf(p, layers)
    return float((np.abs(np.arange(-K, K + 1)) * q).sum())


def em_problem(
    vc: NoisyValueCounts, p: float, k: int, tail: float = EM_TAIL, sparse: float | None = None
) -> EMProblem:
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
            return EMProblem(K, q, mass, [], np.zeros(0), np.zeros(0), None)
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
        allowed[off + h0 - lo_v : off + hi_v - lo_v + 1] = 1.0
    zero_idx = None
    for off, lo_v, hi_v in spans:
        if lo_v <= 0 <= hi_v:
            zero_idx = off - lo_v  # position of h = 0 on the compressed axis
            break
    return EMProblem(K, q, mass, spans, w, allowed, zero_idx)
