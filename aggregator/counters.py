"""Noisy counters: their value counts, and the law of the noise they carry.

A pan-private state is D counters h'_j = h_j + Z_j, with h_j >= 0 the true count of counter j and
Z_j the sum of k independent discrete Laplace draws (k "layers", each DLap(p):
P[Z = z] = (1 - p) / (1 + p) p^|z|). Every estimator of the cumulative prevalence
phi_{>=r} = #{j : h_j >= r} sees the counters through their value counts

    c_v = #{j : h'_j = v},

which are sufficient: the counters are exchangeable given their true counts, so which counter holds
which value says nothing more (seed 001 section 3). The value counts are also additive across
disjoint parts of a state (:meth:`NoisyValueCounts.merge`), which is how a partitioned state is
released.

* :class:`NoisyValueCounts`, :func:`noisy_value_counts`: c_v on [lo, hi];
* :func:`noise_pmf`: the pmf q of Z (k layers), exact up to a tail;
* :func:`check_p`, :func:`check_layers`: the two public noise parameters, checked;
* :func:`counters_key`, :func:`data_seed`: a digest and a seed that are functions of the counters
  (a memo's key; the seed of randomness that is post-processing, so a release is reproducible).

Parameters (of the functions here): ``p`` in (0, 1), the DLap parameter of one layer
(p = exp(-eps / sensitivity)); ``layers`` = k >= 1.

>>> import numpy as np
>>> vc = noisy_value_counts(np.array([3, 0, -2, 0, 1]))
>>> vc.lo, vc.c.tolist(), vc.total
(-2, [1, 0, 2, 1, 0, 1], 5)
>>> K, q = noise_pmf(0.5)          # one layer: q(0) = (1 - p) / (1 + p)
>>> round(float(q[K]), 6), round(float(q.sum()), 12)
(0.333333, 1.0)

References: seed 001 (the pan-private histogram paper this package implements), section 3 and
Algorithm 1; docs/privacy.md for why a function of the counters is post-processing.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = [
    "NoisyValueCounts",
    "noisy_value_counts",
    "noise_pmf",
    "check_p",
    "check_layers",
    "counters_key",
    "data_seed",
]


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
        c[self.lo - lo : self.lo - lo + len(self.c)] += self.c
        c[other.lo - lo : other.lo - lo + len(other.c)] += other.c
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
        raise ValueError(
            "noisy counter values span more than 5e7; is this really a noisy histogram?"
        )
    shifted = x - lo if lo != 0 else x
    return NoisyValueCounts(lo, np.bincount(shifted, minlength=hi - lo + 1).astype(np.int64))


def check_p(p: float) -> float:
    p = float(p)
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    return p


def check_layers(layers: int) -> int:
    if isinstance(layers, bool) or int(layers) != layers or layers < 1:
        raise ValueError(f"layers must be a positive integer, got {layers!r}")
    return int(layers)


def noise_pmf(p: float, layers: int = 1, tail: float = 1e-17) -> tuple[int, np.ndarray]:
    """pmf of the sum of ``layers`` DLap(p) draws on [-K, K] (tail mass below ``tail`` cut)."""
    p = check_p(p)
    k = check_layers(layers)
    K1 = int(math.ceil(math.log(tail / (2 * k)) / math.log(p))) + 1
    base = (1 - p) / (1 + p) * p ** np.abs(np.arange(-K1, K1 + 1))
    q = base
    for _ in range(k - 1):
        q = np.convolve(q, base)
    K = (len(q) - 1) // 2
    keep = np.flatnonzero(q > tail * 1e-3)
    lo = min(keep[0], len(q) - 1 - keep[-1])
    q = q[lo : len(q) - lo]
    return K - lo, q / q.sum()


def data_seed(vc: NoisyValueCounts) -> list[int]:
    """A seed that is a function of the counters' value counts: the release is deterministic."""
    return [vc.lo & 0xFFFFFFFF, zlib.crc32(np.ascontiguousarray(vc.c).tobytes())]


def counters_key(vc: NoisyValueCounts) -> tuple:
    """(lo, BLAKE2b-128 of the value counts): the key of a memo of one set of counters."""
    return vc.lo, hashlib.blake2b(np.ascontiguousarray(vc.c).tobytes(), digest_size=16).digest()
