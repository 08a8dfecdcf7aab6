"""Exact discrete Laplace noise from an OS-entropy CSPRNG.

The discrete Laplace distribution DLap(p) on the integers has

    P[X = k] = (1 - p) / (1 + p) * p**|k|,       Var[X] = 2p / (1 - p)**2.

Adding DLap(exp(-eps / Delta)) to each coordinate of an integer vector with l1 sensitivity
Delta is eps-DP (seed 001 Fact 8).

How the sampler is exact
------------------------
The float ``p`` handed in is a dyadic rational ``m / 2**e`` exactly, so every tail probability

    T_k = P[|X| >= k] = 2 p**k / (1 + p)           (k >= 1)

is a rational number that Python integers represent exactly. For each draw we take one 64-bit
word from the operating system's CSPRNG (``os.urandom``, i.e. getrandom(2)): the low bit is the
sign, the other 63 bits are the leading bits of a uniform real U in [0, 1). The magnitude is
``|X| = #{k >= 1 : U < T_k}`` (inverse-CDF sampling on an exact table). With 63 bits known,
U lies in [a / 2**63, (a + 1) / 2**63), so comparing ``a`` with ``t_k = floor(T_k * 2**63)``
decides ``U < T_k`` exactly unless ``a == t_k``. Those ties (probability about 2**-63 per
draw, but never ignored) are resolved by drawing further random words and comparing the
refined U against T_k with exact integer arithmetic. No floating-point number is on the
sampling path; the sign bit is independent of U, and ``-0 == 0`` so zero keeps its mass.
(The table itself is built in 192-bit fixed point and may sit one unit below the exact floors;
draws within one unit of an entry go to the exact path, so that never decides a comparison.)

The result is distributed exactly as DLap(p) for the binary value of ``p`` given, assuming
the OS generator is uniform. Callers that start from an epsilon should compute ``p`` with
:func:`p_from_epsilon`, which rounds ``p`` up so the privacy guarantee holds for the true
exp(-eps / Delta) (more noise, never less).

:func:`bernoulli` draws exact Bernoulli bits from the same source (one word per bit, P[True] a
numerator over 2**64): the bits of the user-level density state, :mod:`aggregator.density`.

References
----------
Canonne, Kamath, Steinke. The Discrete Gaussian for Differential Privacy. NeurIPS 2020
(exact sampling of discrete Laplace from rational parameters; we use an exact inverse-CDF
table instead of their rejection loop because it vectorizes and needs one word per draw).
"""

from __future__ import annotations

import math
import os
from decimal import Decimal, localcontext
from fractions import Fraction
from functools import lru_cache

import numpy as np

__all__ = [
    "OSEntropy",
    "WORD",
    "bernoulli",
    "discrete_laplace",
    "discrete_laplace_pmf",
    "p_from_epsilon",
]

_U_BITS = 63  # bits of U taken from each word; the 64th bit is the sign


class OSEntropy:
    """Random bytes from the operating system's CSPRNG (``os.urandom``).

    This is the default noise source. It holds no state that could be saved, so nothing from
    which noise could be rebuilt ever ends up in a snapshot. Any object with a ``bytes(n)``
    method (for instance a seeded ``numpy.random.Generator``) can replace it in tests.
    """

    def bytes(self, n: int) -> bytes:  # noqa: A003 - mirrors numpy.random.Generator.bytes
        return os.urandom(n)

    def __repr__(self) -> str:
        return "OSEntropy()"


_DEFAULT_SOURCE = OSEntropy()


def _words(source, count: int) -> np.ndarray:
    """``count`` uniform uint64 words from ``source``."""
    raw = source.bytes(8 * count)
    return np.frombuffer(raw, dtype="<u8", count=count).astype(np.uint64, copy=False)


MIN_EPSILON = 1e-3  # below this the noise std exceeds ~2800 per counter: nothing useful survives


def p_from_epsilon(epsilon: float, sensitivity: int = 2) -> float:
    """The float ``p >= exp(-epsilon / sensitivity)`` closest to it.

    ``math.exp`` may round down by an ulp, which would be (negligibly) less noise than the
    guarantee needs; this computes exp at 40 digits and rounds up to the next float, so the
    mechanism is eps-DP for the epsilon asked, not just close to it.

    >>> p_from_epsilon(1.0) >= math.exp(-0.5)
    True
    """
    eps = float(epsilon)
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"epsilon must be a positive finite number, got {epsilon!r}")
    if eps < MIN_EPSILON:
        raise ValueError(
            f"epsilon={epsilon!r} is below the supported minimum {MIN_EPSILON} "
            "(the noise would drown every count); use a larger epsilon"
        )
    if isinstance(sensitivity, bool) or not isinstance(sensitivity, int) or sensitivity < 1:
        raise ValueError(f"sensitivity must be a positive integer, got {sensitivity!r}")
    with localcontext() as ctx:
        ctx.prec = 40
        exact = (-(Decimal(eps) / Decimal(sensitivity))).exp()
        p = float(exact)
        if Decimal(p) < exact:
            p = math.nextafter(p, 1.0)
    if not 0.0 < p < 1.0:
        raise ValueError(f"epsilon={epsilon!r} gives a noise parameter p={p!r} outside (0, 1)")
    return p


def _check_p(p: float) -> float:
    p = float(p)
    if not (0.0 < p < 1.0):
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    return p


_FIXED_BITS = 192  # fixed-point precision of p^k while building the table


@lru_cache(maxsize=64)
def _tail_table(p: float) -> tuple[np.ndarray, int, int]:
    """Thresholds ``s_k`` with ``s_k <= floor(T_k * 2**63) <= s_k + 1``, k = 1, 2, ... until 0.

    Returns (ascending uint64 array of the s_k, m, e) where p = m / 2**e and
    ``T_k = 2 p^k / (1 + p)``. p^k is carried in 192-bit fixed point, P_k = floor(P_{k-1} m / 2^e),
    so P_k is below the exact value by less than k units of 2**-192; that moves s_k by at most
    one below the exact floor. Draws within one of a table entry take the exact path, so the
    approximation never decides a comparison; it only keeps the build linear in the table size.
    """
    frac = Fraction(p)
    m, two_e = frac.numerator, frac.denominator
    e = two_e.bit_length() - 1
    scale = (two_e + m) << _FIXED_BITS
    table = []
    pk = 1 << _FIXED_BITS
    while True:
        pk = (pk * m) >> e
        s = (pk << (_U_BITS + 1 + e)) // scale  # floor(2 P_k 2^63 2^e / ((2^e + m) 2^192))
        table.append(s)
        if s == 0:
            break
    desc = np.array(table, dtype=np.uint64)
    return desc[::-1].copy(), m, e


def _exact_less(u_bits: int, w: int, k: int, m: int, e: int, source) -> tuple[bool, int, int]:
    """Decide U < T_k exactly, refining U with fresh random words as needed.

    U is known to lie in [u_bits / 2**w, (u_bits + 1) / 2**w). Returns the answer and the
    refined (u_bits, w) so later comparisons reuse the same U.
    """
    num = 2 * m**k * (1 << e)  # T_k = num / den
    den = (1 << (e * k)) * ((1 << e) + m)
    while True:
        if (u_bits + 1) * den <= num << w:
            return True, u_bits, w
        if u_bits * den >= num << w:
            return False, u_bits, w
        extra = int(_words(source, 1)[0])
        u_bits = (u_bits << 64) | extra
        w += 64


def _resolve_tie(u63: int, first_tied_k: int, m: int, e: int, source) -> int:
    """Magnitude for a draw whose 63-bit prefix equals some threshold (exact, scalar path)."""
    # Every comparison for k < first_tied_k is already decided "U < T_k".
    u_bits, w = u63, _U_BITS
    k = first_tied_k
    while True:
        less, u_bits, w = _exact_less(u_bits, w, k, m, e, source)
        if not less:
            return k - 1
        k += 1


def discrete_laplace(p: float, size, rng=None) -> np.ndarray:
    """Draw exact DLap(p) samples as an int64 array of shape ``size``.

    Parameters
    ----------
    p
        Noise parameter in (0, 1); P[k] is proportional to p**|k|. For an eps-DP counter
        vector of l1 sensitivity Delta use ``p_from_epsilon(eps, Delta)``.
    size
        Output shape (int or tuple).
    rng
        Source of randomness with a ``bytes(n)`` method. ``None`` (the default, and the only
        choice in production) reads the OS CSPRNG. Pass a seeded ``numpy.random.Generator``
        only in tests: seeded noise is not private.

    Examples
    --------
    >>> x = discrete_laplace(0.5, 1000)
    >>> x.dtype, x.shape
    (dtype('int64'), (1000,))
    """
    p = _check_p(p)
    source = _DEFAULT_SOURCE if rng is None else rng
    shape = (size,) if np.isscalar(size) else tuple(size)
    count = int(np.prod(shape, dtype=np.int64))
    if count < 0:
        raise ValueError("size must be non-negative")
    if count == 0:
        return np.zeros(shape, dtype=np.int64)
    asc, m, e = _tail_table(p)
    words = _words(source, count)
    sign = (words & np.uint64(1)).astype(bool)
    u = words >> np.uint64(1)
    right = np.searchsorted(asc, u, side="right")
    # Number of thresholds strictly above u; asc has len(asc) entries (k = 1..K).
    mag = (len(asc) - right).astype(np.int64)
    # Undecided: u within one above some s_k (s_k <= t_k <= s_k + 1, see _tail_table). The
    # entry just left of `right` is the largest s_k <= u.
    below = asc[np.maximum(right - 1, 0)]
    ties = np.flatnonzero(u - below <= np.uint64(1))
    for i in ties:  # probability ~2**-63 each; exact scalar resolution
        first_tied_k = int(len(asc) - right[i]) + 1
        mag[i] = _resolve_tie(int(u[i]), first_tied_k, m, e, source)
    out = np.where(sign, -mag, mag)
    return out.reshape(shape)


WORD = 1 << 64  # a Bernoulli threshold is a numerator over 2**64


def bernoulli(threshold: int, size, rng=None) -> np.ndarray:
    """Exact Bernoulli(threshold / 2**64) draws as a bool array of shape ``size``.

    One uniform 64-bit word per draw from the same source as :func:`discrete_laplace`; the draw
    is True iff the word is below ``threshold``, so P[True] is exactly ``threshold / 2**64`` (a
    dyadic rational: callers round a real probability to a threshold in the direction that
    keeps their privacy guarantee, as :func:`p_from_epsilon` does for p). No float is on the
    sampling path.

    >>> bernoulli(0, 3).tolist(), bernoulli(WORD, 2).tolist()
    ([False, False, False], [True, True])
    """
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, np.integer))
        or not 0 <= threshold <= WORD
    ):
        raise ValueError(f"threshold must be an integer in [0, 2**64], got {threshold!r}")
    source = _DEFAULT_SOURCE if rng is None else rng
    shape = (size,) if np.isscalar(size) else tuple(size)
    count = int(np.prod(shape, dtype=np.int64))
    if count < 0:
        raise ValueError("size must be non-negative")
    if threshold == WORD:
        return np.ones(shape, dtype=bool)
    if count == 0 or threshold == 0:
        return np.zeros(shape, dtype=bool)
    return (_words(source, count) < np.uint64(threshold)).reshape(shape)


def discrete_laplace_pmf(p: float, k) -> np.ndarray:
    """P[X = k] for X ~ DLap(p) (float, for tests and likelihood estimators; not for sampling)."""
    p = _check_p(p)
    k = np.abs(np.asarray(k, dtype=np.float64))
    return (1.0 - p) / (1.0 + p) * np.power(p, k)
