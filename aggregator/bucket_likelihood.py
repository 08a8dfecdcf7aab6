"""The likelihood of hashed mode's bucket counters under an *item* histogram, and the item
histograms it cannot tell from the best fit.

In hashed mode the D items fall into B buckets by a hash, and a counter holds its bucket's total
plus k layers of DLap(p) noise. If each item lands in a uniformly random bucket, one bucket's total
T has the generating function

    E z^T = prod_v (1 - 1/B + z^v / B) ^ phi_v

(phi_v items of count v), the exact binomial occupancy that :func:`aggregator.largedomain.gamma_b`
expands, and a counter's noisy value has pmf P(T = .) * q. Taking the B counters as independent
draws of that pmf (they share the items, a weak dependence at B >> 1) gives the log-likelihood

    LL(phi) = sum_x c_x log ((P_T * q)(x)),     c_x = counters with noisy value x,

a function of the item histogram itself, not of the bucket totals the estimators deconvolve.

Why it is needed: the estimators fit the buckets' histogram and invert Gamma^B, and an error in
the first (the early-stopped EM ends over-dispersed: docs/accuracy_changes.md) carries through
the exact inversion. In the issue's new-user setting (B = 2e5, ~97,500 users mostly seen once,
2 layers, eps 1) every fit was 7-8% low, and its bootstrap, which re-runs the same estimator at
the fit, did not see it: the 90% intervals missed the truth in half the windows. Under LL the
truth out-liked both fits (by up to 3.3 nats), and so did the histogram with every item seen
once: the counters cannot tell 97,500 users from 100,000, and an interval must say so. LL also
chooses the early-stopped EM's start in hashed mode (``largedomain._likelier_start``), which
took the release to +1% there.

:func:`plausible_extremes` walks from a stand-in to the item histograms with the most and the
fewest items whose LL is within chi2_1(level) / 2 of the best seen (a likelihood-ratio region),
as :func:`aggregator.intervals.plausible_extremes` does for direct mode's counters.

Items above ``top`` events are held fixed along the walks: the generating function factors into
the small items' part (recomputed at each step, a few hundred values) and the big items' part
(computed once).

>>> import numpy as np
>>> from aggregator.estimate import cumulative_from_counts, noise_pmf
>>> ll = BucketLikelihood(cumulative_from_counts(np.r_[5, 2, 1, 1]), buckets=10, p=0.5)
>>> pmf = ll.bucket_pmf(ll.small)       # P(T = t), t = 0, 1, ...
>>> round(float(pmf[0]), 4) == round(0.9 ** 4, 4) and abs(float(pmf.sum()) - 1) < 1e-12
True
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy.special import chdtri

from .counters import noise_pmf, noisy_value_counts
from .histograms import prevalences_from_cumulative
from .occupancy import gamma_b

__all__ = ["BucketLikelihood", "bucket_loglik", "plausible_extremes", "PATH_TOP", "forget_pmfs"]

PATH_TOP = 64  # the walks split and merge items of counts 1..PATH_TOP; bigger ones stay


def _pmf(phi_ge: np.ndarray, buckets: int, length: int) -> np.ndarray:
    """P(T = t), t = 0..length - 1, of one bucket's total (the mass at >= length, negligible
    where the callers choose ``length``, goes to the last value)."""
    if not len(phi_ge) or phi_ge[0] <= 0:
        return np.r_[1.0, np.zeros(length - 1)]
    tails = gamma_b(phi_ge, buckets, L=length) / buckets  # P(T >= l), l = 1..length
    pmf = np.empty(length)
    pmf[0] = 1.0 - tails[0]
    pmf[1:] = tails[:-1] - tails[1:]
    pmf[-1] += tails[-1]
    return np.maximum(pmf, 0.0)


class BucketLikelihood:
    """LL of noisy bucket counters as a function of the item histogram's counts 1..``top``, the
    items above ``top`` held at those of the cumulative prevalence ``y`` (phi_{>=r}, r = 1..).

    Parameters: ``y`` the starting histogram (its big items are kept), ``buckets`` B, ``p`` and
    ``layers`` the noise, ``top`` the largest count that moves, ``reach`` the largest bucket
    total whose probability must be exact (default: two of the largest items; the likelihood
    passes the largest noisy value plus the noise's reach; the mass beyond goes to the last
    value, where no counter is). ``small`` is the start's
    prevalences phi_1..phi_top (float array); ``loglik(noisy, small)`` the log-likelihood of
    the counters with noisy values ``noisy`` under the histogram (``small``, the big items).
    """

    def __init__(
        self,
        y,
        buckets: int,
        p: float,
        layers: int = 1,
        top: int = PATH_TOP,
        reach: int | None = None,
    ):
        y = np.asarray(y, dtype=np.float64)
        self.buckets, self.top = int(buckets), int(top)
        self.K, self.q = noise_pmf(p, layers)
        phi = prevalences_from_cumulative(np.rint(y).astype(np.int64)).astype(np.float64)
        self.small = np.r_[phi[: self.top], np.zeros(max(0, self.top - len(phi)))]
        big = self.big_phi = phi[self.top :]  # phi_v, v = top + 1, ...
        if big.sum() > 0:
            reach = 2 * (self.top + len(big)) if reach is None else max(int(reach), 0)
            self.big = _big_pmf(big.tobytes(), self.top, self.buckets, reach + 2)
        else:
            self.big = np.ones(1)

    def _small_pmf(self, small) -> np.ndarray:
        small = np.asarray(small, dtype=np.float64)
        v = np.arange(1, len(small) + 1)
        mean = float((v * small).sum()) / self.buckets
        sd = math.sqrt(float((v * v * small).sum()) / self.buckets)
        # the small items' total stays far below this (mean + 12 sd, one item of top on top)
        length = int(mean + 12.0 * sd + self.top) + 8
        return _pmf(np.cumsum(small[::-1])[::-1], self.buckets, length)

    def bucket_pmf(self, small) -> np.ndarray:
        """P(T = t) with the small items ``small`` (phi_1..phi_top) and the big ones."""
        part = self._small_pmf(small)
        return part if len(self.big) == 1 else _convolve(self.big, part)

    def loglik(self, noisy, small=None) -> float:
        """log-likelihood of the counters (noisy values, or their NoisyValueCounts)."""
        vc = noisy_value_counts(noisy)
        # (big * small) * q as big * (small * q): one long convolution, not two
        near = np.convolve(self._small_pmf(self.small if small is None else small), self.q)
        pred = near if len(self.big) == 1 else _convolve(self.big, near)  # x at index x + K
        seen = np.flatnonzero(vc.c > 0)
        at = seen + vc.lo + self.K
        inside = (at >= 0) & (at < len(pred))
        pa = np.full(len(seen), 1e-300)
        pa[inside] = np.maximum(pred[at[inside]], 1e-300)
        return float((vc.c[seen] * np.log(pa)).sum())

    def cumulative(self, small) -> np.ndarray:
        """phi_{>=r} (int) of the histogram (``small`` rounded, the big items)."""
        small = np.rint(np.asarray(small, dtype=np.float64)).astype(np.int64)
        phi = np.r_[small, np.rint(self.big_phi).astype(np.int64)]
        out = np.cumsum(phi[::-1])[::-1]
        return out[: len(out) - int(np.argmax(out[::-1] > 0))] if out.any() else out[:0]


@functools.lru_cache(maxsize=8)
def _big_pmf(big: bytes, top: int, buckets: int, length: int) -> np.ndarray:
    """The pmf of a bucket's total over the items above ``top`` alone (``big``: their
    prevalences phi_v, v = top + 1, ..., as float64 bytes). Kept: the stand-ins, their walks and
    the two fits the hashed release compares mostly share their big items (sparse counters are
    taken as they are), and at n = 1e7 one such pmf takes a quarter of a second."""
    phi = np.frombuffer(big, dtype=np.float64)
    y_big = np.cumsum(np.r_[np.zeros(top), phi][::-1])[::-1]  # phi_{>=r} of those items
    out = _pmf(y_big, buckets, length)
    out.flags.writeable = False
    return out


def forget_pmfs() -> None:
    """Drop the kept pmfs of the big items (:func:`_big_pmf`): they are derived from a window's
    counters, and :func:`aggregator.release.estimate_with_accuracy` drops them with its release.
    (A cache keyed by its arguments: it changes the cost of a call, never its numbers.)"""
    _big_pmf.cache_clear()


def _convolve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a * b (full). FFT when both are long; its rounding (~1e-16 of the largest value) is far
    below the smallest probability a counter's likelihood uses here (1 / B times the noise
    pmf's tail, both above 1e-17)."""
    if min(len(a), len(b)) < 64 or len(a) * len(b) < 4_000_000:
        return np.convolve(a, b)
    from scipy.signal import oaconvolve  # noqa: PLC0415 (imported on first use: the CLI starts without it)

    return np.maximum(oaconvolve(a, b), 0.0)


def bucket_loglik(noisy, y, buckets: int, p: float, layers: int = 1) -> float:
    """LL of the noisy bucket counters under the item histogram with cumulative prevalence
    ``y``."""
    vc = noisy_value_counts(noisy)
    return _model(vc, y, buckets, p, layers).loglik(vc)


def _model(vc, y, buckets, p, layers) -> BucketLikelihood:
    K, _ = noise_pmf(p, layers)
    return BucketLikelihood(y, buckets, p, layers, reach=max(vc.hi, 0) + K)


def plausible_extremes(
    noisy,
    y,
    buckets: int,
    p: float,
    layers: int = 1,
    level: float = 0.9,
    ref: float | None = None,
    loglik: float | None = None,
) -> list[np.ndarray]:
    """The item histograms with the most and the fewest items whose LL is within
    chi2_1(level) / 2 of the best seen (``ref``, or the start's), along two walks from ``y``:
    their cumulative prevalences.

    *More items*: the items of count v = 2, 3, ..., ``PATH_TOP`` are split into v singletons,
    all of a count before the next; *fewer items*: pairs of items of count v = 1, 2, ... are
    merged into one item of 2v (2v <= ``PATH_TOP``). n is kept. Each stage goes as far as the
    LL stays within the drop, part way by bisection when it cannot go all the way, which ends
    the walk. ``loglik``: the LL of ``y`` if known.
    """

    vc = noisy_value_counts(noisy)
    model = _model(vc, y, buckets, p, layers)
    if not model.small.any() and len(model.big) == 1:
        return []
    drop = float(chdtri(1, 1.0 - level)) / 2.0
    base = model.loglik(vc) if loglik is None else float(loglik)
    best = max(base, ref if ref is not None else -np.inf)
    top = model.top

    def walk(stages) -> np.ndarray:
        nonlocal best
        small = model.small.copy()
        for most, apply in stages:
            s_max = most(small)
            if s_max <= 0:
                continue
            ll = model.loglik(vc, apply(small, s_max))
            if ll >= best - drop:
                small, best = apply(small, s_max), max(best, ll)
                continue
            lo, hi = 0, s_max  # the most steps that stay plausible
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if model.loglik(vc, apply(small, mid)) >= best - drop:
                    lo = mid
                else:
                    hi = mid
            if lo:
                small = apply(small, lo)
                best = max(best, model.loglik(vc, small))
            break
        return model.cumulative(small)

    def split(v):  # s items of count v -> v singletons each
        def apply(small, s):
            out = small.copy()
            out[v - 1] -= s
            out[0] += s * v
            return out

        return (lambda small: int(small[v - 1])), apply

    def merge(v):  # s pairs of items of count v -> one item of 2v each
        def apply(small, s):
            out = small.copy()
            out[v - 1] -= 2 * s
            out[2 * v - 1] += s
            return out

        return (lambda small: int(small[v - 1] // 2)), apply

    more = walk([split(v) for v in range(2, top + 1)])
    fewer = walk([merge(v) for v in range(1, top // 2 + 1)])
    return [more, fewer]
