"""The exact discrete Laplace sampler (aggregator/noise.py).

Statistical tests draw from seeded ``numpy.random.Generator`` sources (passed as ``rng``), so they
are deterministic; significance levels are 1e-6 so that a correct sampler with a different seed
would still pass with overwhelming probability. Every statistical test has a negative control
showing it does reject a slightly wrong sampler at that same level.

The exact parts (threshold table, tie resolution past the 63-bit prefix, p rounding) are checked
against independent ``fractions.Fraction`` / ``decimal`` computations.
"""

from __future__ import annotations

import math
import os
import random
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from aggregator import noise as noise_mod
from aggregator.noise import (
    OSEntropy,
    _tail_table,
    discrete_laplace,
    discrete_laplace_pmf,
    p_from_epsilon,
)
from aggregator.state import PanPrivateHistogram

P_VALUES = (0.1, 0.5, math.exp(-0.5), 0.9, 0.99)
N = 1_000_000
LEVEL = 1e-6


def _draw(p, seed, n=N):
    return discrete_laplace(p, n, rng=np.random.default_rng(seed))


def _seed(p, salt=0):
    return int(p * 1e9) + salt


def _wrong(p):
    """A slightly wrong parameter for the negative controls: 2% more (or 2% less 1 - p)."""
    return p * 1.02 if p * 1.02 < 0.95 else 1 - (1 - p) / 1.02


# ---------------------------------------------------------------------------------------------
# distribution
# ---------------------------------------------------------------------------------------------
def chisquare_pvalue(x: np.ndarray, p: float, min_expected: float = 20.0) -> float:
    """Goodness of fit of draws ``x`` to DLap(p): bins k in [-K, K] plus two pooled tails."""
    n = len(x)
    pmf0 = (1 - p) / (1 + p)
    # largest K with n * P[X = K] >= min_expected
    kmax = max(0, int(math.floor(math.log(min_expected / (n * pmf0)) / math.log(p))))
    ks = np.arange(-kmax, kmax + 1)
    expected = (
        np.concatenate(
            [[p ** (kmax + 1) / (1 + p)], discrete_laplace_pmf(p, ks), [p ** (kmax + 1) / (1 + p)]]
        )
        * n
    )
    observed = np.bincount(np.clip(x, -kmax - 1, kmax + 1) + kmax + 1, minlength=2 * kmax + 3)
    assert abs(expected.sum() - n) < 1e-6 * n
    expected *= n / expected.sum()  # absorb float rounding so scipy's sum check passes
    return float(stats.chisquare(observed, expected).pvalue)


@pytest.mark.parametrize("p", P_VALUES)
def test_chisquare_goodness_of_fit(p):
    assert chisquare_pvalue(_draw(p, _seed(p)), p) > LEVEL


@pytest.mark.parametrize("p", P_VALUES)
def test_chisquare_rejects_wrong_parameter(p):
    """Negative control: the same test rejects DLap(p') for p' 2% off (power at N = 10^6)."""
    assert chisquare_pvalue(_draw(_wrong(p), _seed(p, 1)), p) < LEVEL


def _moments(p):
    """Variance and fourth moment of DLap(p), exactly summed in floating point."""
    k = np.arange(1, 200_000, dtype=np.float64)
    w = 2 * (1 - p) / (1 + p) * p**k
    return float((w * k**2).sum()), float((w * k**4).sum())


def moment_zscores(x: np.ndarray, p: float) -> tuple[float, float]:
    """z-scores of the sample mean against 0 and the sample variance against 2p/(1-p)^2."""
    n = len(x)
    var = 2 * p / (1 - p) ** 2
    var_sum, mu4 = _moments(p)
    assert abs(var_sum - var) < 1e-9 * var
    xf = x.astype(np.float64)
    z_mean = xf.mean() / math.sqrt(var / n)
    # E[X] = 0 is known, so use the second moment about 0; its SE is sqrt((mu4 - var^2) / n)
    z_var = ((xf**2).mean() - var) / math.sqrt((mu4 - var**2) / n)
    return z_mean, z_var


@pytest.mark.parametrize("p", P_VALUES)
def test_mean_and_variance(p):
    z_mean, z_var = moment_zscores(_draw(p, _seed(p)), p)
    assert abs(z_mean) < 5 and abs(z_var) < 5, (z_mean, z_var)


@pytest.mark.parametrize("p", P_VALUES)
def test_variance_rejects_wrong_parameter(p):
    """Negative control: a 2% error in p moves the variance by > 5 standard errors."""
    z_mean, z_var = moment_zscores(_draw(_wrong(p), _seed(p, 2)), p)
    assert abs(z_var) > 5, z_var


class BiasedSign:
    """A source whose words have the low (sign) bit set with probability 0.51."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def bytes(self, n):  # noqa: A003
        count = n // 8
        words = self.rng.integers(0, 2**64, size=count, dtype=np.uint64, endpoint=False)
        bit = (self.rng.random(count) < 0.51).astype(np.uint64)
        return ((words & ~np.uint64(1)) | bit).astype("<u8").tobytes()


def symmetry_pvalues(x: np.ndarray) -> tuple[float, float]:
    """Exact binomial test of #(X > 0) vs #(X < 0), and a chi-square of n_k vs n_-k over k."""
    pos, neg = int((x > 0).sum()), int((x < 0).sum())
    p_sign = stats.binomtest(pos, pos + neg, 0.5).pvalue
    kmax = int(np.abs(x).max())
    counts = np.bincount(x + kmax, minlength=2 * kmax + 1)
    n_pos, n_neg = counts[kmax + 1 :], counts[:kmax][::-1]
    keep = (n_pos + n_neg) >= 20
    chi = float((((n_pos - n_neg)[keep]) ** 2 / (n_pos + n_neg)[keep]).sum())
    p_pairs = float(stats.chi2.sf(chi, int(keep.sum())))
    return float(p_sign), p_pairs


@pytest.mark.parametrize("p", P_VALUES)
def test_symmetry(p):
    p_sign, p_pairs = symmetry_pvalues(_draw(p, _seed(p, 3)))
    assert p_sign > LEVEL and p_pairs > LEVEL, (p_sign, p_pairs)


def test_symmetry_rejects_biased_sign():
    """Negative control: a 51/49 sign bit is rejected by both symmetry tests."""
    x = discrete_laplace(0.5, N, rng=BiasedSign(7))
    p_sign, p_pairs = symmetry_pvalues(x)
    assert p_sign < LEVEL and p_pairs < LEVEL, (p_sign, p_pairs)


def _tail_k(p, target=2e-4):
    """Smallest k with P[|X| >= k] = 2 p^k / (1 + p) <= target (about 200 expected per 10^6)."""
    return int(math.ceil(math.log(target * (1 + p) / 2) / math.log(p)))


@pytest.mark.parametrize("p", P_VALUES)
def test_tail_probability(p):
    k = _tail_k(p)
    x = _draw(p, _seed(p, 4))
    hits = int((np.abs(x) >= k).sum())
    tail = 2 * p**k / (1 + p)
    assert stats.binomtest(hits, len(x), tail).pvalue > LEVEL, (k, hits, tail * len(x))
    # negative control: a sampler whose table stops one short (|X| capped at k - 1) is rejected
    capped = np.clip(x, -(k - 1), k - 1)
    assert stats.binomtest(int((np.abs(capped) >= k).sum()), len(x), tail).pvalue < LEVEL


_EXACT = {}


def exact_desc(p):
    """Exact t_k = floor(T_k 2^63), k = 1.. until the first 0, in plain integer arithmetic."""
    if p not in _EXACT:
        pf = Fraction(p)
        m, two_e = pf.numerator, pf.denominator
        e = two_e.bit_length() - 1
        out, mk, k = [], 1, 0
        while True:
            k += 1
            mk *= m
            t = (((2 * mk) << (63 + e)) >> (e * k)) // (two_e + m)
            out.append(t)
            if t == 0:
                break
        _EXACT[p] = out
    return _EXACT[p]


@pytest.mark.parametrize("p", [0.1, 0.5, math.exp(-0.5), 0.9, 0.99])
def test_threshold_table_is_within_one_of_exact(p):
    """The fixed-point table s_k satisfies s_k <= floor(T_k 2^63) <= s_k + 1 (Fraction check)."""
    asc, m, e = _tail_table(p)
    assert Fraction(m, 2**e) == Fraction(p)
    desc = [int(t) for t in asc[::-1]]
    pf = Fraction(p)
    tk = 2 * pf / (1 + pf)
    for k, s in enumerate(desc, start=1):
        t = math.floor(tk * 2**63)
        assert s <= t <= s + 1, k
        tk *= pf
    assert math.floor(tk * 2**63) <= 1  # the table ends where the exact floors reach 0 or 1
    assert desc[-1] == 0 and all(t > 0 for t in desc[:-1])
    assert all(a >= b for a, b in zip(desc, desc[1:]))
    head = min(60, len(desc))  # the integer reference agrees with Fractions
    assert exact_desc(p)[:head] == [math.floor(_T(pf, k) * 2**63) for k in range(1, head + 1)]


def test_pmf_sums_to_one():
    for p in P_VALUES:
        k = np.arange(-20_000, 20_001)
        assert abs(discrete_laplace_pmf(p, k).sum() - 1) < 1e-9


# ---------------------------------------------------------------------------------------------
# ties: 63-bit prefixes equal to a threshold, resolved with extra words
# ---------------------------------------------------------------------------------------------
class Scripted:
    """A source that returns a fixed sequence of 64-bit words and fails if asked for more."""

    def __init__(self, words):
        self.buf = b"".join(int(w).to_bytes(8, "little") for w in words)
        self.pos = 0

    def bytes(self, n):  # noqa: A003
        if self.pos + n > len(self.buf):
            raise AssertionError("sampler asked for more random words than scripted")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    @property
    def used(self):
        return self.pos // 8


def scan(p: float, a: int, w: int) -> tuple[int | None, bool]:
    """Exact comparison of U in [a / 2^w, (a + 1) / 2^w) with every T_k = 2 p^k / (1 + p).

    Returns (#{k >= 1 : T_k > U}, False) when that count is the same for every U in the
    interval, and (None, True) when some T_k lies strictly inside it (more bits are needed).
    With p = m / d: T_k 2^w > a  <=>  2 m^k d 2^w > a d^k (d + m). Plain integers, no table.
    """
    pf = Fraction(p)
    m, d = pf.numerator, pf.denominator
    k, mk, dk = 0, 1, 1
    while True:
        k += 1
        mk *= m
        dk *= d
        num = (2 * mk * d) << w
        base = dk * (d + m)
        if num <= a * base:
            return k - 1, False
        if num < (a + 1) * base:
            return None, True


def reference(p: float, words: list[int], count: int) -> tuple[list[int], int]:
    """Independent exact reference for ``discrete_laplace(p, count)`` on the words given.

    The first ``count`` words are the draws' first words (sign = low bit, the leading 63 bits of
    U = the rest). A draw whose interval for U strictly contains some T_k is undecided and takes
    the next unused word (64 more bits of U), draws in order, until it is decided; then
    |X| = #{k >= 1 : T_k > U}. Returns (values, number of words used).
    """
    nxt = count
    vals = []
    for i in range(count):
        sign, a, w = words[i] & 1, words[i] >> 1, 63
        while True:
            mag, undecided = scan(p, a, w)
            if not undecided:
                break
            a, w = (a << 64) | words[nxt], w + 64
            nxt += 1
        vals.append(-mag if sign else mag)
    return vals, nxt


def _T(pf: Fraction, k: int) -> Fraction:
    return 2 * pf**k / (1 + pf)


def _run(p, words, count):
    src = Scripted(words)
    got = discrete_laplace(p, count, rng=src).tolist()
    want, used = reference(p, words, count)
    assert got == want
    assert src.used == used, "sampler used a different number of random words"
    return got


def _tie_word(t: int, negative: bool) -> int:
    return (t << 1) | int(negative)


@pytest.mark.parametrize("p", [0.5, math.exp(-0.5), 0.9])
def test_tie_resolution_each_side(p):
    desc = exact_desc(p)
    pf = Fraction(p)
    # thresholds with distinct neighbours (t_{k-1} > t_k > t_{k+1}), shallow and deepest
    distinct = [
        k
        for k in range(1, len(desc))
        if (k == 1 or desc[k - 2] > desc[k - 1]) and desc[k - 1] > desc[k]
    ]
    for k in sorted({distinct[0], distinct[1], distinct[len(distinct) // 2], distinct[-1]}):
        t = desc[k - 1]
        frac = _T(pf, k) * 2**63 - t  # T_k = (t + frac) / 2^63, 0 < frac < 1
        assert 0 < frac < 1
        e_star = math.floor(frac * 2**64)  # the extra word at which T_k is still undecided
        for neg in (False, True):
            s = -1 if neg else 1
            # extra word 0: U just above t / 2^63 < T_k, so |X| = k
            assert _run(p, [_tie_word(t, neg), 0], 1) == [s * k]
            # extra word all ones: U just below (t + 1) / 2^63 > T_k, so |X| = k - 1
            assert _run(p, [_tie_word(t, neg), 2**64 - 1], 1) == [s * (k - 1)]
            # extra word e*: still undecided, a second extra word decides it
            assert _run(p, [_tie_word(t, neg), e_star, 0], 1) == [s * k]
            assert _run(p, [_tie_word(t, neg), e_star, 2**64 - 1], 1) == [s * (k - 1)]


@pytest.mark.parametrize("p", [0.9, 0.99])
def test_tie_with_equal_table_entries(p):
    """Deep in the table consecutive thresholds are equal; a tie must walk the whole run."""
    desc = exact_desc(p)
    repeated = sorted({v for v, nxt in zip(desc, desc[1:]) if v == nxt and v > 0})
    # p = 0.9: the three deepest runs; p = 0.99 (4346 thresholds, slow exact arithmetic): the
    # shallowest run only
    for t in repeated[:3] if p < 0.95 else repeated[-1:]:
        run = [j for j in range(1, len(desc) + 1) if desc[j - 1] == t]
        assert len(run) >= 2
        for extra in (0, 2**63, 2**64 - 1):
            got = _run(p, [_tie_word(t, False), extra], 1)[0]
            mag, undecided = scan(p, (t << 64) | extra, 127)
            assert not undecided and got == mag
            assert run[0] - 1 <= mag <= run[-1]
        # the two ends of the run: just above t / 2^63 all of it counts, just below (t+1) none
        assert _run(p, [_tie_word(t, False), 0], 1)[0] == run[-1]
        assert _run(p, [_tie_word(t, False), 2**64 - 1], 1)[0] == run[0] - 1


@pytest.mark.parametrize("p", [0.1, 0.5, math.exp(-0.5)])
def test_zero_prefix_walks_past_the_table(p):
    """u == 0 ties with the sentinel t_K = 0; the exact comparisons continue beyond k = K."""
    K = len(_tail_table(p)[0])  # thresholds t_1..t_K, t_K == 0 the first zero
    for extras, sign in (([0, 0, 12345], 0), ([0, 0, 12345], 1), ([1, 0], 0), ([2**64 - 1], 1)):
        got = _run(p, [sign] + extras, 1)[0]
        a = 0
        for w in extras:
            a = (a << 64) | w
        mag, undecided = scan(p, a, 63 + 64 * len(extras))
        assert not undecided and got == (-mag if sign else mag)
        assert mag >= K - 1
    # U ~ 12345 / 2^255 and ~ 1 / 2^127: far beyond the table
    assert abs(_run(p, [0, 0, 0, 12345], 1)[0]) > 2 * K
    assert _run(p, [0, 1, 0], 1)[0] > K


def test_ties_inside_a_vector_batch():
    """Ties mixed with ordinary draws: the vector path and the scalar path agree with the
    reference."""
    p = math.exp(-0.5)
    desc = exact_desc(p)
    pf = Fraction(p)
    rng = random.Random(5)
    first = [rng.getrandbits(64) for _ in range(8)]
    first[1] = _tie_word(desc[0], True)
    first[4] = _tie_word(desc[3], False)
    first[6] = _tie_word(0, True)
    # boundary neighbours of a threshold are decided on the vector path without extra words
    first[2] = _tie_word(desc[2] - 1, False)  # just below t_3: |X| = 3
    first[3] = _tie_word(desc[2] + 1, True)  # just above t_3: |X| = 2
    frac = _T(pf, 1) * 2**63 - desc[0]
    extras = [
        math.floor(frac * 2**64),
        2**64 - 1,  # draw 1: undecided, then above T_1
        0,  # draw 4: just above t_4 / 2^63 < T_4
        0,
        99,
    ]  # draw 6: U = 99 / 2^191
    got = _run(p, first + extras, 8)
    assert got[1] == 0 and got[2] == 3 and got[3] == -2 and got[4] == 4


# ---------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------
def _exact_exp(eps: float, sensitivity: int) -> Decimal:
    with localcontext() as ctx:
        ctx.prec = 120
        return (-(Decimal(eps) / Decimal(sensitivity))).exp()


EPS_VALUES = [1e-3, 0.01, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, math.log(3), 3.0, 10.0, 50.0, 700.0]
EPS_VALUES += [random.Random(11).uniform(0.01, 8) for _ in range(200)]


@pytest.mark.parametrize("sensitivity", [1, 2])
def test_p_from_epsilon_rounds_up_to_the_next_double(sensitivity):
    for eps in EPS_VALUES:
        p = p_from_epsilon(eps, sensitivity)
        exact = _exact_exp(eps, sensitivity)
        assert Decimal(p) >= exact, (eps, sensitivity)  # never less noise
        assert Decimal(math.nextafter(p, 0.0)) < exact, (eps,)  # and the smallest such double
        assert 0 < p < 1
        # the guarantee it buys: p**-sensitivity <= e^eps, checked in exact arithmetic
        with localcontext() as ctx:
            ctx.prec = 120
            assert Decimal(p) ** -sensitivity <= Decimal(eps).exp()


def test_p_from_epsilon_default_is_replace_one():
    assert p_from_epsilon(1.0) == p_from_epsilon(1.0, 2)
    assert p_from_epsilon(1.0) >= math.exp(-0.5) and p_from_epsilon(1.0, 1) >= math.exp(-1)


@pytest.mark.parametrize(
    "eps", [0.0, -0.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e-300, 1e-4]
)
def test_p_from_epsilon_rejects_bad_epsilon(eps):
    # 1e-300 and 1e-4 are positive but below MIN_EPSILON (noise std in the thousands)
    with pytest.raises(ValueError):
        p_from_epsilon(eps)


def test_p_from_epsilon_rejects_bad_sensitivity():
    for s in (0, -1):
        with pytest.raises(ValueError):
            p_from_epsilon(1.0, s)


@pytest.mark.parametrize("p", [0.0, 1.0, -0.5, 1.5, float("nan"), float("inf"), -float("inf")])
def test_invalid_p_raises(p):
    with pytest.raises(ValueError):
        discrete_laplace(p, 3)
    with pytest.raises(ValueError):
        discrete_laplace_pmf(p, [0, 1])


def test_shapes_and_dtype():
    rng = np.random.default_rng(0)
    assert discrete_laplace(0.5, 0, rng=rng).shape == (0,)
    assert discrete_laplace(0.5, (3, 4), rng=rng).shape == (3, 4)
    assert discrete_laplace(0.5, 5, rng=rng).dtype == np.int64
    with pytest.raises(ValueError):
        discrete_laplace(0.5, -1, rng=rng)


# ---------------------------------------------------------------------------------------------
# the default source is the OS CSPRNG
# ---------------------------------------------------------------------------------------------
def test_default_source_is_os_entropy():
    assert isinstance(noise_mod._DEFAULT_SOURCE, OSEntropy)


def test_monkeypatched_urandom_is_observed(monkeypatch):
    p = 0.5
    desc = exact_desc(p)
    # u halfway between t_2 and t_1: the value -1, decided without ties, for p = 0.5 and for any
    # p within a few ulps of it (the state's p_from_epsilon(2 ln 2) below)
    word = _tie_word((desc[0] + desc[1]) // 2, True)
    calls = []

    def fake_urandom(n):
        calls.append(n)
        return word.to_bytes(8, "little") * (n // 8)

    monkeypatch.setattr(os, "urandom", fake_urandom)
    assert discrete_laplace(p, 4).tolist() == [-1, -1, -1, -1]
    assert calls == [32]
    # the state uses the same default source for its initial layer and for rerandomize()
    s = PanPrivateHistogram(2 * math.log(2), size=3)  # p = exp(-eps/2) = 0.5 (rounded up)
    assert s.counts.tolist() == [-1, -1, -1] and calls[-1] == 24
    s.update([0, 2, 2])
    s.rerandomize()
    assert s.counts.tolist() == [-1, -2, 0] and calls[-1] == 24
    # a seeded Generator passed as rng bypasses os.urandom (tests only)
    n_calls = len(calls)
    discrete_laplace(p, 4, rng=np.random.default_rng(0))
    assert len(calls) == n_calls
