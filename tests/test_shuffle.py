"""The shuffle-model protocols (aggregator/shuffle.py, docs/shuffle.md).

What is checked: the analyzer's noise law (chi-square on >= 1e6 bucket draws of the real
randomizer), the exactness of the negative-binomial sampler, the privacy accountant against a
brute-force computation of the view's privacy profile, and an empirical audit of the shuffled
view of real randomizer outputs, with negative controls (no flooding; noise for a 25% larger
epsilon than claimed) that the same audit flags.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats
from scipy.special import gammaln

from aggregator.noise import discrete_laplace_pmf
from aggregator.shuffle import (
    BalcerCheuRandomizer,
    GKMPRandomizer,
    ShuffleConfigError,
    _NegBinomial,
    balcer_cheu_analyze,
    balcer_cheu_delta,
    gkmp_analyze,
    gkmp_delta,
)


def _chi2_pvalue(sample: np.ndarray, pmf, lo: int, hi: int) -> float:
    """Chi-square goodness of fit on the integers [lo, hi] plus the two tails."""
    k = np.arange(lo, hi + 1)
    probs = pmf(k)
    expected = np.concatenate(
        [[pmf_tail_low(pmf, lo)], probs, [1 - probs.sum() - pmf_tail_low(pmf, lo)]]
    )
    inside = sample[(sample >= lo) & (sample <= hi)] - lo  # each value in exactly one bin
    observed = np.concatenate(
        [[np.sum(sample < lo)], np.bincount(inside, minlength=hi - lo + 1), [np.sum(sample > hi)]]
    )
    keep = expected * len(sample) >= 5
    e = expected[keep] * len(sample)
    o = observed[keep]
    e = e * o.sum() / e.sum()
    return float(stats.chisquare(o, e).pvalue)


def pmf_tail_low(pmf, lo):
    k = np.arange(lo - 2000, lo)
    return float(pmf(k).sum())


# ---------------------------------------------------------------------------------------------
# samplers and the analyzer's noise law


@pytest.mark.parametrize(
    "k,q", [(Fraction(3, 10), 0.75), (Fraction(1, 50), 0.625), (Fraction(7, 3), 0.9375)]
)
def test_negative_binomial_sampler_law(k, q):
    nb = _NegBinomial(k, q)
    buckets = 400_000
    pos, val = nb.sparse(buckets, nb_source())
    assert np.all(np.diff(pos) > 0) and (len(pos) == 0 or (pos[0] >= 0 and pos[-1] < buckets))
    full = np.zeros(buckets, dtype=np.int64)
    full[pos] = val
    kf = float(k)

    def pmf(x):
        x = np.asarray(x, dtype=np.float64)
        out = np.exp(
            gammaln(x + kf) - gammaln(kf) - gammaln(x + 1) + kf * np.log1p(-q) + x * np.log(q)
        )
        return np.where(x >= 0, out, 0.0)

    assert _chi2_pvalue(full, pmf, 0, 60) > 1e-6


def nb_source():
    from aggregator.noise import OSEntropy

    return OSEntropy()


def test_gap_sampler_exact_path_agrees_with_float_path():
    nb = _NegBinomial(Fraction(1, 1000), 0.5)
    src = nb_source()
    for a in [1 << 40, (1 << 63) + 12345, (1 << 64) - 1, 1 << 33, 987654321987654]:
        u = (a + 0.5) * 2.0**-64
        g_float = math.floor(math.log(u) / nb._ln_p0)
        assert nb._gap_exact(a, src) == g_float


def test_analyzer_noise_is_discrete_laplace_exactly():
    """>= 1e6 bucket counts of real randomizer outputs minus the truth, against DLap(p)."""
    n, buckets, windows = 8, 12_500, 80
    rz = GKMPRandomizer(epsilon=1.0, delta=1e-6, n=n, buckets=buckets, gamma=0.5, max_messages=1e9)
    rng = np.random.default_rng()
    noise = []
    for _ in range(windows):
        items = rng.integers(0, buckets, size=n)
        msgs = np.concatenate([rz.encode(int(x)) for x in items])
        truth = np.bincount(items, minlength=buckets)
        counts = gkmp_analyze(msgs[rng.permutation(len(msgs))], buckets)
        assert counts.dtype == np.int64 and counts.shape == (buckets,)
        noise.append(counts - truth)
    noise = np.concatenate(noise)
    assert len(noise) >= 1_000_000
    assert _chi2_pvalue(noise, lambda k: discrete_laplace_pmf(rz.p, k), -40, 40) > 1e-6
    # the negative control: the same test rejects DLap for a 25% larger epsilon
    p_wrong = math.exp(-1.25 * (1 - rz.gamma) * rz.epsilon / 2)
    assert _chi2_pvalue(noise, lambda k: discrete_laplace_pmf(p_wrong, k), -40, 40) < 1e-6


def test_flooding_cancels_and_hides_the_split():
    rz = GKMPRandomizer(epsilon=1.0, delta=1e-6, n=4, buckets=3)
    rows = np.concatenate([rz.encode(0) for _ in range(4)])
    plus = np.bincount(rows[rows[:, 1] > 0, 0], minlength=3)
    minus = np.bincount(rows[rows[:, 1] < 0, 0], minlength=3)
    # every bucket carries flooding on both sides: the minus count is far above a geometric's
    assert minus.min() > 20 and plus.min() > 20
    assert gkmp_analyze(rows, 3)[0] == plus[0] - minus[0]
    # a window's messages name only buckets and signs: no event identity survives
    assert set(np.unique(rows[:, 1])) <= {-1, 1}


def test_noise_only_adds_no_event():
    rz = GKMPRandomizer(epsilon=2.0, delta=1e-4, n=4, buckets=1, gamma=0.5)
    calls = 20_000
    quiet = np.array([gkmp_analyze(rz.noise_only(), 1)[0] for _ in range(calls)])
    loud = np.array([gkmp_analyze(rz.encode(0), 1)[0] for _ in range(calls)])
    se = math.sqrt(2 * rz.p / (rz.n * (1 - rz.p) ** 2) / calls)  # sd of the mean of one share pair
    assert abs(quiet.mean()) < 6 * se
    assert abs(loud.mean() - 1) < 6 * se


# ---------------------------------------------------------------------------------------------
# the accountant


def _bucket_view_pmf(h: int, p: float, r: float, q: float, size: int) -> np.ndarray:
    """P[(N+, N-) = (a, b)] for one bucket with count h, straight from the definition."""
    g = (1 - p) * p ** np.arange(size)
    f = np.arange(size)
    pf = np.exp(gammaln(f + r) - gammaln(r) - gammaln(f + 1) + r * math.log1p(-q) + f * math.log(q))
    out = np.zeros((size, size))
    for ff in range(size):
        if pf[ff] < 1e-300:
            continue
        a = np.zeros(size)
        a[h + ff :] = g[: size - h - ff]
        b = np.zeros(size)
        b[ff:] = g[: size - ff]
        out += pf[ff] * np.outer(a, b)
    return out


def _bruteforce_delta(eps, p, r, q, size=220):
    lo = _bucket_view_pmf(0, p, r, q, size)  # bucket y in D (count 0) / bucket x in D'
    hi = _bucket_view_pmf(1, p, r, q, size)  # bucket y in D' / bucket x in D
    lost = 2 - lo.sum() - hi.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        ly = np.log(lo) - np.log(hi)  # loss of bucket y's view, weight lo
        lx = np.log(hi) - np.log(lo)  # loss of bucket x's view, weight hi
    # exact E_D[(1 - exp(eps - Lx - Ly))_+] over the product of the two buckets' views
    ly, wy = ly.ravel(), lo.ravel()
    lx, wx = lx.ravel(), hi.ravel()
    keep_y, keep_x = wy > 0, wx > 0
    ly, wy, lx, wx = ly[keep_y], wy[keep_y], lx[keep_x], wx[keep_x]
    inf_y = np.isinf(ly)
    total = wy[inf_y].sum() * wx.sum()
    ly, wy = ly[~inf_y], wy[~inf_y]
    order = np.argsort(lx)
    lx, wx = lx[order], wx[order]
    # sum over y of wy * sum_{x: lx > eps - ly} wx (1 - exp(eps - ly - lx))
    c_w = np.concatenate([np.cumsum(wx[::-1])[::-1], [0.0]])
    c_e = np.concatenate([np.cumsum((wx * np.exp(-lx))[::-1])[::-1], [0.0]])
    k = np.searchsorted(lx, eps - ly, side="right")
    total += float(np.sum(wy * (c_w[k] - np.exp(eps - ly) * c_e[k])))
    return total, lost


@pytest.mark.parametrize("p,r,q", [(0.5, 2.0, 0.5), (0.6, 5.0, 0.75), (0.7, 1.5, 0.8)])
@pytest.mark.parametrize("eps", [0.5, 1.0, 1.5])
def test_accountant_matches_bruteforce(p, r, q, eps):
    fast = gkmp_delta(eps, p, r, q)
    slow, lost = _bruteforce_delta(eps, p, r, q)
    assert lost < 1e-12
    assert fast == pytest.approx(slow, rel=1e-6, abs=1e-12)


def test_accountant_is_tight_enough_to_matter():
    """Halving the flooding must break the guarantee: the calibration is not slack."""
    rz = GKMPRandomizer(epsilon=1.0, delta=1e-6, n=1000, buckets=10)
    assert rz.delta_spent <= 1e-6
    assert gkmp_delta(1.0, rz.p, float(rz.r) / 2, rz.q) > 1e-6
    # and at a 25% smaller epsilon than claimed the same parameters are far from (eps, delta)
    assert gkmp_delta(0.8, rz.p, float(rz.r), rz.q) > 1e-3


# ---------------------------------------------------------------------------------------------
# empirical audit of the shuffled view (real randomizer outputs, real shuffle, real analyzer view)

N_AUDIT = 300_000
ALPHA = 1e-6


def _views(rz: GKMPRandomizer, items: list[int], draws: int, batch: int = 10_000) -> np.ndarray:
    """(N+_0, N-_0, N+_1, N-_1) of ``draws`` windows of the real randomizer's messages.

    The analyzer's view of a window is the multiset of its messages; with two buckets that
    multiset is exactly these four counts (the shuffle's order carries nothing once counted).
    """
    out = []
    k = len(items)
    for start in range(0, draws, batch):
        w = min(batch, draws - start)
        rows, owner = rz.encode_many(np.tile(items, w))
        cell = (owner // k) * 4 + rows[:, 0] * 2 + (rows[:, 1] < 0)
        out.append(np.bincount(cell, minlength=4 * w).reshape(w, 4))
    return np.concatenate(out)


def _audit_epsilon(vx: np.ndarray, vy: np.ndarray, delta: float) -> float:
    """Lower confidence bound on the eps with P[V(x) in S] <= e^eps P[V(y) in S] + delta.

    A small family fixed in advance (so the Bonferroni correction stays mild): quadrants of the
    two buckets' differences around where DLap's likelihood ratio peaks, and events on bucket 1's
    plus count alone (what the flooding must hide). Both directions; Clopper-Pearson intervals.
    """

    def events(v):
        d0, d1 = v[:, 0] - v[:, 1], v[:, 2] - v[:, 3]
        cols = []
        for t in range(1, 5):
            for u in range(-1, 3):
                cols.append((d1 >= t) & (d0 <= u))
                cols.append((d1 <= u) & (d0 >= t))
        for lim in range(0, 3):
            cols.append(v[:, 2] <= lim)
            cols.append(v[:, 0] <= lim)
        return np.array([c.sum() for c in cols])

    cx, cy = events(vx), events(vy)
    a = ALPHA / (4 * len(cx))
    nx, ny = len(vx), len(vy)

    def lower(k, n):
        return np.where(k > 0, stats.beta.ppf(a, np.maximum(k, 1), n - k + 1), 0.0)

    def upper(k, n):
        return np.where(k < n, stats.beta.ppf(1 - a, k + 1, np.maximum(n - k, 1)), 1.0)

    best = -np.inf
    for c1, n1, c2, n2 in ((cx, nx, cy, ny), (cy, ny, cx, nx)):
        num = lower(c1, n1) - delta
        den = upper(c2, n2)
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(num > 0, np.log(num) - np.log(den), -np.inf)
        best = max(best, float(np.max(r)))
    return best


AUDIT_X, AUDIT_Y = [0, 0, 1], [0, 1, 1]  # one event moved from bucket 0 to bucket 1


def test_audit_shuffled_view_within_eps_delta():
    eps, delta = 1.0, 1e-3
    rz = GKMPRandomizer(epsilon=eps, delta=delta, n=3, buckets=2)
    got = _audit_epsilon(_views(rz, AUDIT_X, N_AUDIT), _views(rz, AUDIT_Y, N_AUDIT), delta)
    assert got <= eps
    assert got >= 0.8 * (1 - rz.gamma) * eps  # sensitive: the DLap part's loss shows


def test_audit_flags_noise_for_a_larger_epsilon():
    """Shares and flooding for 1.25 eps, claimed as eps (a 25% rise in privacy loss): flagged."""
    eps, delta = 1.0, 1e-3
    loud = GKMPRandomizer(epsilon=1.25 * eps, delta=delta, n=3, buckets=2)
    assert (
        _audit_epsilon(_views(loud, AUDIT_X, N_AUDIT), _views(loud, AUDIT_Y, N_AUDIT), delta) > eps
    )


def test_audit_flags_missing_flooding():
    """Without flooding the minus counts give away G2, and with it the event: flagged."""
    eps, delta = 1.0, 1e-3
    bare = GKMPRandomizer(epsilon=eps, delta=delta, n=3, buckets=2)
    bare._flood = _NoFlood()
    assert _audit_epsilon(_views(bare, AUDIT_X, 20_000), _views(bare, AUDIT_Y, 20_000), delta) > eps


class _NoFlood:
    def sparse(self, buckets, source):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# configurations


def test_refuses_configurations_that_flood_clients():
    with pytest.raises(ShuffleConfigError) as err:
        GKMPRandomizer(epsilon=1.0, delta=1e-6, n=1000, buckets=1_000_000)
    msg = str(err.value)
    assert "use at most" in msg and "buckets" in msg and "\n" not in msg
    ok = GKMPRandomizer(epsilon=1.0, delta=1e-6, n=1000, buckets=1_000_000 // 1000)
    assert ok.expected_messages < 10_000


@pytest.mark.parametrize(
    "kwargs", [dict(epsilon=0), dict(delta=1.0), dict(n=0), dict(buckets=0), dict(gamma=1.0)]
)
def test_bad_parameters_one_line(kwargs):
    base = dict(epsilon=1.0, delta=1e-6, n=100, buckets=10)
    base.update(kwargs)
    with pytest.raises(ShuffleConfigError) as err:
        GKMPRandomizer(**base)
    assert "\n" not in str(err.value)


def test_encode_rejects_out_of_range_bucket():
    rz = GKMPRandomizer(epsilon=1.0, delta=1e-6, n=100, buckets=10)
    with pytest.raises(ValueError):
        rz.encode(10)
    with pytest.raises(ValueError):
        gkmp_analyze(np.array([[10, 1]]), 10)


# ---------------------------------------------------------------------------------------------
# Balcer-Cheu


def test_balcer_cheu_analyzer_and_noise():
    n, buckets = 40_000, 30
    bc = BalcerCheuRandomizer(epsilon=1.0, delta=1e-6, n=n, buckets=buckets)
    assert 0.5 < bc.s < 1 and bc.delta_spent <= 1e-6
    rng = np.random.default_rng()
    items = rng.zipf(1.5, size=n) % buckets
    items[items == buckets - 1] = 0  # one bucket stays empty
    msgs = np.concatenate([bc.encode(int(x)) for x in items])
    est = balcer_cheu_analyze(msgs, buckets, bc)
    truth = np.bincount(items, minlength=buckets)
    assert est[buckets - 1] == 0  # an empty bucket is released as exactly 0
    sd = math.sqrt(n * bc.s * (1 - bc.s))
    # counts below (1 - s) n are zeroed by design (the blanket alone could reach n there)
    big = truth > n * (1 - bc.s) + 7 * sd
    small = truth < n * (1 - bc.s) - 7 * sd
    assert big.any() and small.any()
    assert np.all(np.abs(est[big] - truth[big]) < 7 * sd)
    assert np.all(est[small] == 0)
    assert np.array_equal(est, balcer_cheu_analyze(msgs, buckets, n=n, s=bc.s))


def test_balcer_cheu_refuses_small_windows():
    with pytest.raises(ShuffleConfigError) as err:
        BalcerCheuRandomizer(epsilon=1.0, delta=1e-6, n=1000, buckets=10)
    assert "needs n >=" in str(err.value)


def test_balcer_cheu_delta_negative_control():
    # variance for the claimed (eps, delta) vs a tenth of it: the accountant tells them apart
    n = 2000
    assert balcer_cheu_delta(1.0, n, 0.9) < 1e-6
    assert balcer_cheu_delta(1.0, n, 0.999) > 1e-3
