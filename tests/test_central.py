"""Central-model algorithms: Manurangsi's DPAnonHist and Suresh's PRIVHIST (aggregator/central.py).

Privacy audits are statistical *lower bounds* on the privacy loss between two neighbouring
anonymized histograms (l1 distance 1). For a family of output events fixed in advance we estimate
P[M(x) in S] and P[M(x') in S] from independent runs with the default (OS CSPRNG) sampler and
report max log(lower_CP P[M(x) in S] / upper_CP P[M(x') in S]) over events and both directions,
with one-sided Clopper-Pearson intervals Bonferroni-corrected over every interval. For an eps-DP
mechanism that exceeds eps with probability at most ALPHA. The audit is shown to have teeth: it
flags the tempting non-private variant of Algorithm 1 that splits at ceil(sqrt(sum(counts))).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from aggregator import central
from aggregator.central import (
    _dp_anon_hist_known_n,
    _privhist,
    _regime,
    _remove_closest,
    _smoothed_scaled_cumulative,
    _truncate_to_total,
    dp_anon_hist,
    privhist,
    privhist_prevalences,
)
from aggregator.estimate import l1_distance

ALPHA = 1e-6
STAT_MAX = 15  # integer statistics are clipped to [0, STAT_MAX] before building events


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _valid(out) -> bool:
    out = np.asarray(out)
    return (
        out.dtype == np.int64
        and out.ndim == 1
        and bool(np.all(out > 0))
        and bool(np.all(np.diff(out) <= 0))
    )


def _zipf_counts(n: int, seed: int = 0, a: float = 1.1) -> np.ndarray:
    """A fixed synthetic histogram: n events from a Zipf(a) law over n/2 items."""
    g = np.random.default_rng(seed)
    k = max(n // 2, 1)
    w = 1.0 / np.arange(1, k + 1) ** a
    c = g.multinomial(n, w / w.sum())
    return c[c > 0]


def _mean_error(mech, counts, reps: int) -> float:
    return float(np.mean([l1_distance(mech(counts), counts) for _ in range(reps)]))


def _stats(out: np.ndarray, x: tuple, y: tuple) -> tuple:
    k = len(out)
    return (
        int(out.sum()),
        int(out[0]) if k else 0,
        int(out[1]) if k > 1 else 0,
        k,
        int((out >= 3).sum()),
        int(out[-1]) if k else 0,
        int(tuple(out) == x),
        int(tuple(out) == y),
    )


STAT_NAMES = ("total", "top count", "second count", "#items", "#counts>=3", "smallest count")


def _event_counts(samples: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Counts of {f == v}, {f >= v}, {f <= v} for each statistic f and v in [0, STAT_MAX], plus
    {output == x} and {output == x'}. The family depends on nothing but the constants above."""
    counts, names = [], []
    for j, name in enumerate(STAT_NAMES):
        f = np.clip(samples[:, j], 0, STAT_MAX)
        h = np.bincount(f, minlength=STAT_MAX + 1)
        counts += [h, np.cumsum(h[::-1])[::-1], np.cumsum(h)]
        names += [f"{name} == {v}" for v in range(STAT_MAX + 1)]
        names += [f"{name} >= {v}" for v in range(STAT_MAX + 1)]
        names += [f"{name} <= {v}" for v in range(STAT_MAX + 1)]
    counts.append(samples[:, 6:8].sum(axis=0))
    names += ["output == x", "output == x'"]
    return np.concatenate(counts), names


def _cp(k: np.ndarray, n: int, a: float) -> tuple[np.ndarray, np.ndarray]:
    lo = np.where(k > 0, stats.beta.ppf(a, np.maximum(k, 1), n - k + 1), 0.0)
    hi = np.where(k < n, stats.beta.ppf(1 - a, k + 1, np.maximum(n - k, 1)), 1.0)
    return lo, hi


def empirical_epsilon(mech, x, y, draws: int) -> tuple[float, str]:
    """Clopper-Pearson lower bound on the privacy loss of ``mech`` between x and y."""
    tx, ty = tuple(sorted(x, reverse=True)), tuple(sorted(y, reverse=True))
    sx = np.array([_stats(mech(np.array(x)), tx, ty) for _ in range(draws)], dtype=np.int64)
    sy = np.array([_stats(mech(np.array(y)), tx, ty) for _ in range(draws)], dtype=np.int64)
    cx, names = _event_counts(sx)
    cy, _ = _event_counts(sy)
    a = ALPHA / (4 * len(cx))
    lo_x, hi_x = _cp(cx, draws, a)
    lo_y, hi_y = _cp(cy, draws, a)
    with np.errstate(divide="ignore"):
        r = np.concatenate([np.log(lo_x) - np.log(hi_y), np.log(lo_y) - np.log(hi_x)])
    best = int(np.argmax(r))
    where = names[best % len(cx)] + (" (x vs x')" if best < len(cx) else " (x' vs x)")
    return float(r[best]), where


# ---------------------------------------------------------------------------------------------
# output validity and bad inputs
# ---------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(0, 60), max_size=30),
    seed=st.integers(0, 2**32 - 1),
    eps=st.sampled_from([1.0, 1.5, 2.0, 4.0]),
    peps=st.sampled_from([0.05, 0.5, 1.0, 1.5, 5.0]),
)
def test_outputs_are_anonymized_histograms(counts, seed, eps, peps):
    rng = np.random.default_rng(seed)
    assert _valid(dp_anon_hist(counts, eps, rng=rng))
    assert _valid(dp_anon_hist(counts, eps, rng=rng, n=max(1, sum(counts))))
    assert _valid(privhist(counts, peps, rng=rng))
    r, phi, N = privhist_prevalences(counts, peps, rng=rng)
    assert r.dtype == phi.dtype == np.int64 and np.all(np.diff(r) < 0) and np.all(phi > 0)
    assert isinstance(N, int) and N >= 0


def test_edge_inputs_default_sampler():
    for c in ([], [0, 0], [1], [10**6]):
        assert _valid(dp_anon_hist(c, 1.0))
        assert _valid(privhist(c, 0.3))
        assert _valid(privhist(c, 3.0))
    assert _valid(privhist(prevalences=[], epsilon=2.0))
    assert _valid(privhist(prevalences={3: 2, 1: 5}, epsilon=2.0))


@pytest.mark.parametrize(
    "call",
    [
        lambda: dp_anon_hist([3, -1], 2.0),
        lambda: dp_anon_hist([3, 1], 0.0),
        lambda: dp_anon_hist([3, 1], -1.0),
        lambda: dp_anon_hist([3, 1], float("nan")),
        lambda: dp_anon_hist([3, 1], float("inf")),
        lambda: dp_anon_hist([3, 1.5], 2.0),
        lambda: dp_anon_hist([[3, 1]], 2.0),
        lambda: dp_anon_hist([3, 1], 2.0, n=0),
        lambda: privhist([3, -1], 1.0),
        lambda: privhist([3, 1], 0.0),
        lambda: privhist([3, 1], -0.5),
        lambda: privhist([3, 1]),
        lambda: privhist(epsilon=1.0),
        lambda: privhist([3, 1], 1.0, prevalences=[(3, 1)]),
        lambda: privhist(prevalences=[(3, -1)], epsilon=1.0),
        lambda: privhist(prevalences=[(-3, 1)], epsilon=1.0),
        lambda: privhist(prevalences=[3, 1], epsilon=1.0),
        lambda: privhist([3, 1], 2.0, budget=(1.5, 1.0, 0.0)),
        lambda: privhist([3, 1], 0.5, budget=(0.25, 0.25, 0.0)),
    ],
)
def test_bad_inputs_raise(call):
    with pytest.raises(ValueError):
        call()


def test_dp_anon_hist_below_one_points_to_privhist():
    with pytest.raises(ValueError, match="privhist"):
        dp_anon_hist([3, 1], 0.5)


# ---------------------------------------------------------------------------------------------
# pieces of the algorithms
# ---------------------------------------------------------------------------------------------
def test_truncate_to_total_is_the_l1_projection():
    p = np.array([9, 5, 5, 2, 1], dtype=np.int64)
    q = _truncate_to_total(p, 15)
    assert q.tolist() == [9, 5, 1] and l1_distance(q, p) == p.sum() - 15
    assert _truncate_to_total(p, 100) is p


def test_remove_closest_ties_and_shortfall():
    r = np.array([3, 4, 5, 6])
    phi = np.array([2, 1, 2, 1])
    r2, phi2 = _remove_closest(r, phi, 4, 2, prefer_above=True)  # 4 first, then 5 (tie 3 vs 5)
    assert dict(zip(r2.tolist(), phi2.tolist())) == {3: 2, 5: 1, 6: 1}
    r3, phi3 = _remove_closest(r, phi, 4, 2, prefer_above=False)
    assert dict(zip(r3.tolist(), phi3.tolist())) == {3: 1, 5: 2, 6: 1}
    r4, phi4 = _remove_closest(r, phi, 4, 100, prefer_above=True)
    assert len(r4) == 0 and len(phi4) == 0


def test_smoothing_matches_the_printed_formula():
    """H3(a) as printed (fractions (s_{i+1}-j)/g and (j-s_{i-1})/g), then cumulative, times g."""
    g_ = np.random.default_rng(3)
    for _ in range(50):
        s = np.unique(np.concatenate([[1], g_.integers(2, 60, size=g_.integers(1, 8))]))
        r = np.unique(g_.integers(1, s[-1] + 1, size=g_.integers(1, 10)))
        phi = g_.integers(1, 5, size=len(r))
        v = np.zeros(len(s))
        for j, f in zip(r, phi):
            i = np.searchsorted(s, j)
            if s[i] == j:
                v[i] += f
            else:
                gap = s[i] - s[i - 1]
                v[i] += f * (j - s[i - 1]) / gap
                v[i - 1] += f * (s[i] - j) / gap
        gaps, Y = _smoothed_scaled_cumulative(r, phi, s)
        np.testing.assert_allclose(Y / gaps, np.cumsum(v[::-1])[::-1], rtol=0, atol=1e-9)
        assert Y.dtype == np.int64
        # smoothing keeps the number of items and the number of events
        assert math.isclose(v.sum(), phi.sum()) and math.isclose((v * s).sum(), (r * phi).sum())


@pytest.mark.parametrize("T,N,eps3", [(10, 100, 0.999), (10, 100, 0.3), (3, 20, 0.05)])
def test_boundaries_match_the_printed_definition(T, N, eps3):
    """S = {1..T} u {floor(T (1+q)^i) : i <= log_{1+q}(T'/T)} u {noisy counts >= T'} u {2N}."""
    noisy = np.array([T + 1, 10**4, 3 * 10**4, 5])
    t_prime = math.ceil(10 * math.sqrt(N) / eps3)
    q = math.sqrt(math.log(1 / eps3) / (N * eps3))
    grid = {math.floor(T * (1 + q) ** i) for i in range(int(math.log(t_prime / T, 1 + q)) + 1)}
    want = set(range(1, T + 1)) | grid | {int(v) for v in noisy if v >= t_prime} | {2 * N}
    assert central._boundaries(T, N, eps3, noisy).tolist() == sorted(want)


def test_smoothed_query_has_sensitivity_one():
    s = np.array([1, 2, 3, 7, 12, 30])
    base_r, base_phi = np.array([2, 5, 9, 20]), np.array([3, 1, 2, 1])
    _, y0 = _smoothed_scaled_cumulative(base_r, base_phi, s)
    for k in range(len(base_r)):
        for d in (-1, 1):  # one item of count r[k] moves to r[k] + d
            phi = base_phi.copy()
            phi[k] -= 1
            r, phi = central._merge(np.append(base_r, base_r[k] + d), np.append(phi, 1))
            _, y1 = _smoothed_scaled_cumulative(r, phi, s)
            assert np.abs(y1 - y0).sum() == 1


# ---------------------------------------------------------------------------------------------
# privacy audits (default OS CSPRNG sampler)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "eps,x,y",
    [
        (1.0, [3, 1], [3, 2]),  # eps in [1, 2): our eps/2 split for the private n
        (2.0, [2, 2], [2, 2, 1]),  # Algorithm 2 as printed; ceil(sqrt(n)) changes between 4 and 5
    ],
)
def test_audit_dp_anon_hist(eps, x, y):
    got, where = empirical_epsilon(lambda c: dp_anon_hist(c, eps), x, y, draws=12_000)
    assert got <= eps, f"empirical eps {got:.3f} > {eps} at {where}"


def test_audit_dp_anon_hist_public_n_is_tight():
    eps = 1.0
    got, where = empirical_epsilon(
        lambda c: dp_anon_hist(c, eps, n=4), [3, 1], [3, 2], draws=15_000
    )
    assert got <= eps, f"empirical eps {got:.3f} > {eps} at {where}"
    assert got >= 0.5 * eps, f"audit too weak: {got:.3f} ({where})"


def test_audit_flags_split_at_private_n():
    """The naive Algorithm 1 with m = ceil(sqrt(sum(counts))) is not DP: with n = 4, m = 2 and at
    most two released counts can exceed 2; with n = 5 three can. The same audit must say so."""
    eps = 1.0
    naive = lambda c: _dp_anon_hist_known_n(np.sort(c)[::-1], eps, int(c.sum()), None)  # noqa: E731
    got, where = empirical_epsilon(naive, [2, 2], [2, 2, 1], draws=8_000)
    assert got > eps, f"audit missed the non-private split ({got:.3f} at {where})"


@pytest.mark.parametrize(
    "eps,x,y",
    [
        (2.0, [3, 3, 2], [4, 3, 2]),  # low-privacy path; a count crosses T = ceil(sqrt(N)) ~ 3
        (0.5, [2, 1], [2, 2]),  # high-privacy path
    ],
)
def test_audit_privhist(eps, x, y):
    got, where = empirical_epsilon(lambda c: privhist(c, eps), x, y, draws=10_000)
    assert got <= eps, f"empirical eps {got:.3f} > {eps} at {where}"


# ---------------------------------------------------------------------------------------------
# error: the papers' bounds and their shape
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("eps", [1.0, 2.0])
def test_algorithm1_error_within_theorem6(eps):
    """Public n: E l1 <= 2 * 2m E|DLap(e^-eps)| = 8 m p / (1 - p^2), m = ceil(sqrt(n))."""
    x = _zipf_counts(1000)
    n = int(x.sum())
    m = math.ceil(math.sqrt(n))
    p = math.exp(-eps)
    bound = 8 * m * p / (1 - p * p)
    err = _mean_error(lambda c: dp_anon_hist(c, eps, n=n), x, 30)
    assert err <= bound, (err, bound)


def test_dp_anon_hist_error_scales_like_sqrt_n():
    eps = 2.0
    small, big = _zipf_counts(1000), _zipf_counts(16000, seed=1)
    e_small = _mean_error(lambda c: dp_anon_hist(c, eps), small, 30)
    e_big = _mean_error(lambda c: dp_anon_hist(c, eps), big, 20)
    assert 1.5 < e_big / e_small < 8, (e_small, e_big)


def test_dp_anon_hist_error_decreases_with_eps():
    x = _zipf_counts(4000)
    errs = [_mean_error(lambda c: dp_anon_hist(c, e), x, 25) for e in (1.0, 2.5, 5.0)]
    assert errs[0] > errs[1] > errs[2], errs


def test_privhist_error_shape():
    x = _zipf_counts(4000)
    errs = [_mean_error(lambda c: privhist(c, e), x, 20) for e in (0.2, 1.0, 2.0, 6.0)]
    assert errs[0] > errs[1] > errs[2] > errs[3], errs
    # high-privacy path: O(sqrt(n log(2/eps)/eps)); 16x the data gives well under 16x the error
    big = _zipf_counts(64000, seed=1)
    e_big = _mean_error(lambda c: privhist(c, 0.2), big, 10)
    assert e_big / errs[0] < 8, (errs[0], e_big)


# ---------------------------------------------------------------------------------------------
# PRIVHIST: regimes, prevalence input, sub-linear time
# ---------------------------------------------------------------------------------------------
def test_regime_switch(monkeypatch):
    assert _regime(1.0) == "high" and _regime(0.01) == "high"
    assert _regime(1.0 + 1e-9) == "low" and _regime(5.0) == "low"
    calls = []
    low, high = central._low_privacy, central._high_privacy
    monkeypatch.setattr(central, "_low_privacy", lambda *a: calls.append("low") or low(*a))
    monkeypatch.setattr(central, "_high_privacy", lambda *a: calls.append("high") or high(*a))
    r, phi = np.array([1, 4, 9]), np.array([30, 5, 2])
    for eps, want in ((0.3, "high"), (1.0, "high"), (1.5, "low"), (4.0, "low")):
        calls.clear()
        out = _privhist(r, phi, eps, rng=np.random.default_rng(0))
        assert out.regime == want and calls == [want]
        assert out.T == (math.ceil(math.sqrt(out.N * min(eps, 1.0))))


@pytest.mark.parametrize("eps", [0.4, 1.0, 2.5])
def test_prevalence_input_equals_count_input(eps):
    counts = np.concatenate([np.full(40, 1), np.full(12, 2), np.full(3, 7), [25, 60]])
    g = np.random.default_rng(11)
    prev = [(60, 1), (1, 25), (7, 3), (2, 12), (1, 15), (25, 1), (5, 0)]  # unordered, duplicates
    for seed in range(20):
        a = privhist(g.permutation(counts), eps, rng=np.random.default_rng(seed))
        b = privhist(prevalences=prev, epsilon=eps, rng=np.random.default_rng(seed))
        assert np.array_equal(a, b)


def test_prevalence_input_is_sublinear():
    """n ~ 1.3e10 events: never expanded to counts (the release stays in prevalence form)."""
    prev = [(1, 10**10), (3, 10**9), (1000, 50), (10**6, 2)]
    n = sum(r * f for r, f in prev)
    for eps in (0.5, 2.0):
        t = time.perf_counter()
        r, phi, N = privhist_prevalences(prevalences=prev, epsilon=eps)
        assert time.perf_counter() - t < 10
        assert abs(N - n) < 1000
        released = int((r * phi).sum())
        assert abs(released - n) / n < 1e-3
        assert abs(int(phi.sum()) - (10**10 + 10**9 + 52)) / 1.1e10 < 1e-3
