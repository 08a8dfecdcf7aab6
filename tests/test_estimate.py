"""Estimators and projections: unbiasedness, exact optimality against an integer LP, conversions."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from aggregator.estimate import (
    cap_total,
    counts_from_cumulative,
    cumulative_from_counts,
    cumulative_prevalence,
    deconvolved_prevalence,
    l1_distance,
    noise_pmf,
    noisy_value_counts,
    project_l1,
    project_l2,
    threshold_kernel,
)
from aggregator.estimators import default_cap
from aggregator.anonymize import anonymized_histogram
from aggregator.noise import discrete_laplace


def _phi_hat_clipped(noisy, p, R):
    """Seed 001 Algorithm 5 as printed: clips noisy values into [0, n] (the pitfall)."""
    x = p / (1 - p) ** 2
    v = np.clip(noisy, 0, None)
    c = np.bincount(v, minlength=R + 2)
    ge = np.cumsum(c[::-1])[::-1]
    r = np.arange(1, R + 1)
    return ge[r + 1] + (1 + x) * c[r] - x * c[r - 1]


def test_kernel_one_layer_is_f():
    p = 0.3
    x = p / (1 - p) ** 2
    m0, F = threshold_kernel(p, 1)
    assert m0 == -1
    np.testing.assert_allclose(F, [-x, 1 + x])


@pytest.mark.parametrize("layers", [1, 2])
def test_kernel_is_unbiased_exactly(layers):
    """E[F(h' - r)] = 1[h >= r] computed against the exact noise pmf (no sampling)."""
    p = 0.45
    m0, F = threshold_kernel(p, layers)
    K, q = noise_pmf(p, layers)
    for tau in range(-6, 7):  # tau = h - r
        # F(m) = 0 below m0, F[m - m0] on [m0, layers - 1], 1 above
        z = np.arange(-K, K + 1)
        m = tau + z
        vals = np.where(
            m < m0, 0.0, np.where(m > layers - 1, 1.0, F[np.clip(m - m0, 0, len(F) - 1)])
        )
        assert math.isclose(float(np.dot(q, vals)), float(tau >= 0), abs_tol=1e-9)


@pytest.mark.parametrize("layers", [1, 2])
def test_phi_hat_unbiased_with_mostly_negative_values(layers):
    rng = np.random.default_rng(7)
    D, p, R, reps = 20_000, 0.5, 6, 300
    h = np.zeros(D, dtype=np.int64)
    h[:200] = rng.integers(1, 5, 200)  # 1% of counters non-zero, small counts
    truth = cumulative_from_counts(h, R=R)
    est = np.empty((reps, R))
    neg = 0
    for i in range(reps):
        noisy = h.copy()
        for _ in range(layers):
            noisy += discrete_laplace(p, D, rng=rng)
        neg += int((noisy < 0).sum())
        est[i] = cumulative_prevalence(noisy, p, layers=layers, R=R)
    assert neg / (reps * D) > 0.25  # the regime where clipping to 0 hurts
    se = est.std(axis=0, ddof=1) / math.sqrt(reps)
    z = (est.mean(axis=0) - truth) / se
    assert np.all(np.abs(z) < 4.5), z


def test_literal_algorithm5_clip_is_biased():
    """The negative control for the unbiasedness test: the printed clip fails it."""
    rng = np.random.default_rng(8)
    D, p, R = 20_000, 0.5, 4
    h = np.zeros(D, dtype=np.int64)
    h[:200] = 2
    truth = cumulative_from_counts(h, R=R)
    clipped = np.mean(
        [_phi_hat_clipped(h + discrete_laplace(p, D, rng=rng), p, R) for _ in range(20)], axis=0
    )
    x = p / (1 - p) ** 2
    # the bias of phi_hat_{>=1} is about -x * #{h' < 0}: thousands here
    assert clipped[0] - truth[0] < -0.5 * x * 0.2 * D


def test_default_R_covers_every_nonzero_term():
    noisy = np.array([5, 0, -3, 2])
    est = cumulative_prevalence(noisy, 0.3)
    longer = cumulative_prevalence(noisy, 0.3, R=20)
    np.testing.assert_allclose(longer[: len(est)], est)
    np.testing.assert_allclose(longer[len(est) :], 0.0, atol=1e-12)


def _integer_lp(a, bounds, A_eq=None, b_eq=None):
    """min sum |y_r - a_r| over integer non-increasing y (variables y, then t >= |y - a|), by
    scipy's linprog (HiGHS with integrality); None if infeasible."""
    R = len(a)
    A, b = [], []
    for r in range(R):
        row = np.zeros(2 * R)
        row[r], row[R + r] = 1, -1
        A.append(row)
        b.append(a[r])  # noqa: E702
        row = np.zeros(2 * R)
        row[r], row[R + r] = -1, -1
        A.append(row)
        b.append(-a[r])  # noqa: E702
        if r + 1 < R:
            row = np.zeros(2 * R)
            row[r + 1], row[r] = 1, -1
            A.append(row)
            b.append(0)  # noqa: E702
    res = linprog(
        np.r_[np.zeros(R), np.ones(R)],
        A_ub=np.array(A),
        b_ub=b,
        A_eq=A_eq,
        b_eq=b_eq,
        bounds=list(bounds) + [(None, None)] * R,
        integrality=np.r_[np.ones(R), np.zeros(R)],
    )
    return None if res.status != 0 else res.fun


def _lp_l1(a):
    """Integer l1 isotonic regression (y >= 0)."""
    got = _integer_lp(a, [(0, None)] * len(a))
    assert got is not None
    return got


def test_project_l1_matches_integer_lp():
    rng = np.random.default_rng(11)
    for _ in range(150):
        R = int(rng.integers(1, 14))
        a = rng.normal(rng.uniform(-2, 8), 4, R).round(int(rng.integers(0, 3)))
        if rng.random() < 0.4:  # runs of equal values exercise the compression
            a = np.repeat(a, 3)[:R]
        y = project_l1(a)
        assert y.dtype == np.int64 and len(y) == len(a)
        assert np.all(np.diff(y) <= 0) and y.min() >= 0
        ours = float(np.abs(y - a).sum())
        assert ours == pytest.approx(_lp_l1(a), abs=1e-5)


def _lp_l2(a, n, lower, upper):
    """The l2 variant's problem: the box lower <= y <= upper and sum y = n."""
    R = len(a)
    return _integer_lp(a, zip(lower, upper), A_eq=np.r_[np.ones(R), np.zeros(R)][None, :], b_eq=[n])


def test_project_l2_matches_integer_lp():
    rng = np.random.default_rng(12)
    checked = infeasible = 0
    for _ in range(120):
        R = int(rng.integers(1, 12))
        truth = np.sort(rng.integers(0, 8, R))[::-1]
        a = truth + rng.normal(0, 2, R).round(1)
        if rng.random() < 0.5:
            a = np.repeat(a[::3], 3)[:R] if R >= 3 else a
        gamma = int(rng.integers(0, 4))
        lower = np.sort(np.maximum(truth - gamma - rng.integers(0, 2, R), 0))[::-1]
        upper = np.sort(truth + gamma + rng.integers(0, 2, R))[::-1]
        n = int(truth.sum() + rng.integers(-2, 3))
        want = _lp_l2(a, n, lower, upper)
        got = project_l2(a, n, lower, upper)
        if want is None:
            assert got is None
            infeasible += 1
            continue
        assert got is not None
        assert got.sum() == n and np.all(np.diff(got) <= 0)
        assert np.all(got >= lower) and np.all(got <= upper)
        assert float(np.abs(got - a).sum()) == pytest.approx(want, abs=1e-5)
        checked += 1
    assert checked > 60


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=30))
def test_cumulative_round_trip(counts):
    y = cumulative_from_counts(counts)
    back = counts_from_cumulative(y)
    assert list(back) == sorted([c for c in counts if c > 0], reverse=True)
    assert l1_distance(back, counts) == 0


def test_l1_distance_is_cumulative_prevalence_distance():
    a, b = [5, 3, 1], [4, 4]
    ya, yb = cumulative_from_counts(a, R=6), cumulative_from_counts(b, R=6)
    assert l1_distance(a, b) == int(np.abs(ya - yb).sum()) == 3


@pytest.mark.parametrize("method", ["threshold", "deconvolution"])
@pytest.mark.parametrize("loss", ["l1", "l2"])
def test_tiny_noise_recovers_the_histogram(method, loss):
    rng = np.random.default_rng(3)
    h = np.concatenate([rng.integers(1, 30, 40), np.zeros(60, np.int64)])
    p = 1e-9  # noise is zero with overwhelming probability
    noisy = h + discrete_laplace(p, len(h), rng=rng)
    est = anonymized_histogram(noisy, p, method=method, loss=loss, n=int(h.sum()))
    assert list(est) == sorted(h[h > 0].tolist(), reverse=True)
    assert est.dtype == np.int64


def test_release_shape_and_l2_sum():
    rng = np.random.default_rng(4)
    h = rng.multinomial(5000, np.ones(300) / 300)
    p = 0.6
    noisy = h + discrete_laplace(p, len(h), rng=rng)
    est = anonymized_histogram(noisy, p, loss="l2", n=5000)
    assert est.sum() == 5000
    assert np.all(np.diff(est) <= 0) and est.min() > 0
    est1 = anonymized_histogram(noisy, p)
    naive = np.sort(noisy[noisy > 0])[::-1]
    assert l1_distance(est1, h) < l1_distance(naive, h)


def test_noisy_value_counts_are_additive():
    rng = np.random.default_rng(5)
    a = rng.integers(-20, 50, 500)
    b = rng.integers(-5, 90, 700)
    merged = noisy_value_counts(a).merge(noisy_value_counts(b))
    whole = noisy_value_counts(np.concatenate([a, b]))
    assert merged.lo == whole.lo and np.array_equal(merged.c, whole.c)
    np.testing.assert_allclose(
        cumulative_prevalence(merged, 0.4), cumulative_prevalence(whole, 0.4)
    )


def test_deconvolution_conserves_counter_mass():
    rng = np.random.default_rng(6)
    h = np.concatenate([rng.integers(0, 200, 500), [5000, 7000]])
    p = 0.6
    noisy = h + discrete_laplace(p, len(h), rng=rng) + discrete_laplace(p, len(h), rng=rng)
    est = deconvolved_prevalence(noisy, p, layers=2, R=10)
    assert len(est) == 10
    assert np.all(np.diff(est) <= 1e-9)
    # phi_{>=1} can't exceed the number of counters; isolated big values become point masses
    assert est[0] <= len(h) + 1e-6
    full = deconvolved_prevalence(noisy, p, layers=2)
    assert full[4900 - 1] >= 2 - 1e-6 and full[-1] < 1e-6 and len(full) < 7200


@pytest.mark.parametrize(
    "bad", [dict(p=0.0), dict(p=1.0), dict(layers=0), dict(loss="l3"), dict(method="magic")]
)
def test_bad_arguments_raise(bad):
    args = dict(p=0.5, layers=1, loss="l1", method=None) | bad
    with pytest.raises(ValueError):
        anonymized_histogram(
            np.array([1, 2, 3]),
            args["p"],
            layers=args["layers"],
            loss=args["loss"],
            method=args["method"],
        )


def test_l2_needs_n():
    with pytest.raises(ValueError, match="needs n"):
        anonymized_histogram(np.array([1, 2, 3]), 0.5, loss="l2")


def test_rejects_non_integer_counters():
    with pytest.raises(TypeError):
        cumulative_prevalence(np.array([1.5, 2.0]), 0.5)
    with pytest.raises(ValueError):
        cumulative_prevalence(np.array([], dtype=np.int64), 0.5)


# --------------------------------------------------------------------------------------------
# the public n caps the total (n_in_histogram <= n)
# --------------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 30), max_size=25),
    st.integers(0, 400),
    st.sampled_from(["items", "scale"]),
)
def test_cap_total_is_a_valid_histogram_with_the_capped_total(counts, total, rule):
    y = cumulative_from_counts(counts)
    out = cap_total(y, total, rule)
    assert np.all(np.diff(out) <= 0) and (len(out) == 0 or out[-1] >= 0)
    if y.sum() <= total:
        np.testing.assert_array_equal(out, y)
    else:
        assert out.sum() == total


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=25), st.integers(0, 400))
def test_cap_items_keeps_the_largest_items(counts, total):
    """ "items": the largest counts survive unchanged; only the smallest kept one is trimmed."""
    y = cumulative_from_counts(counts)
    kept = counts_from_cumulative(cap_total(y, total, "items"))
    ranked = np.sort(counts)[::-1]
    if len(kept):
        np.testing.assert_array_equal(kept[:-1], ranked[: len(kept) - 1])
        assert 1 <= kept[-1] <= ranked[len(kept) - 1]


def test_cap_total_rejects_bad_input():
    with pytest.raises(ValueError):
        cap_total(np.array([1, 2]), 1)
    with pytest.raises(ValueError):
        cap_total(np.array([2, 1]), -1)
    with pytest.raises(ValueError):
        cap_total(np.array([2, 1]), 1, rule="magic")
    with pytest.raises(ValueError, match="cap must be one of"):  # a bench rule, not a release's
        anonymized_histogram(np.array([3, 0, 1, 2]), 0.5, n=4, buckets=4, cap="fitted")
    with pytest.raises(ValueError, match="cap must be one of"):
        anonymized_histogram(np.array([3, 0, 1, 2]), 0.5, n=4, cap="fitted")


@pytest.mark.parametrize("method", ["threshold", "deconvolution", "mle"])
def test_release_never_holds_more_events_than_n(method):
    """Mostly empty counters (n = 1000 Zipf(1.1) events over D = 20,000, eps = 0.5, two layers):
    noise adds phantom mass, and the uncapped threshold estimate holds more than n events; with
    n given every estimate holds at most n, and cap="none" gives back the uncapped projection."""
    rng = np.random.default_rng(21)
    D, n, p = 20_000, 1000, 0.78
    w = 1.0 / np.arange(1, D + 1) ** 1.1
    h = rng.multinomial(n, w / w.sum())
    noisy = h + discrete_laplace(p, D, rng=rng) + discrete_laplace(p, D, rng=rng)
    free = anonymized_histogram(noisy, p, layers=2, method=method)
    if method == "threshold":  # (the EM estimates happen to fall short of n here)
        assert free.sum() > n
    for cap in (None, "items", "scale"):
        est = anonymized_histogram(noisy, p, layers=2, method=method, n=n, cap=cap)
        assert est.sum() <= n and np.all(np.diff(est) <= 0)
    np.testing.assert_array_equal(
        anonymized_histogram(noisy, p, layers=2, method=method, n=n, cap="none"), free
    )
    np.testing.assert_array_equal(
        anonymized_histogram(noisy, p, layers=2, method=method, n=n),
        anonymized_histogram(noisy, p, layers=2, method=method, n=n, cap=default_cap("direct", 2)),
    )


def test_clipping_the_l1_projection_is_the_projection_with_at_most_c_items():
    """What makes the "items" cap an l1 projection: min(project_l1(a), c) is optimal among the
    non-increasing integer y with 0 <= y <= c (integer LP)."""
    rng = np.random.default_rng(31)
    for _ in range(120):
        R = int(rng.integers(1, 12))
        a = rng.normal(rng.uniform(0, 8), 4, R).round(int(rng.integers(0, 3)))
        c = int(rng.integers(0, 10))
        y = np.minimum(project_l1(a), c)
        want = _integer_lp(a, [(0, c)] * R)
        assert float(np.abs(y - a).sum()) == pytest.approx(want, abs=1e-5)


# --------------------------------------------------------------------------------------------
# the release's shortcuts (docs/speed.md, "Release time"): same results, fewer passes
# --------------------------------------------------------------------------------------------
def _zipf_noisy(D, n, p, layers, seed):
    g = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, D + 1) ** 1.1
    h = g.multinomial(n, w / w.sum())
    noisy = h.copy()
    for _ in range(layers):
        noisy += discrete_laplace(p, D, rng=g)
    return h, noisy


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("buckets", [False, True])
@pytest.mark.parametrize("with_n", [False, True])
def test_anonymized_cumulative_is_the_histogram(layers, buckets, with_n):
    from aggregator.anonymize import anonymized_cumulative

    p = 0.6
    h, noisy = _zipf_noisy(3000, 5000, p, layers, 7 + layers)
    kw = dict(layers=layers, n=5000 if with_n else None, buckets=3000 if buckets else None)
    for method in (None, "threshold", "deconvolution", "mle"):
        y = anonymized_cumulative(noisy, p, method=method, **kw)
        hist = anonymized_histogram(noisy, p, method=method, **kw)
        assert np.array_equal(y, cumulative_from_counts(hist))
        assert np.array_equal(counts_from_cumulative(y), hist)
        assert len(y) == 0 or y[-1] > 0


def test_remembered_pilot_fits_are_the_fits():
    """auto keeps its pilots' fits of the real counters; a later call on counters with the same
    value counts (another object) takes them, and they equal a fresh fit."""
    from aggregator import anonymize as A
    from aggregator import estimate as E
    from aggregator.selection import select

    p = 0.6
    _, noisy = _zipf_noisy(4000, 8000, p, 2, 3)
    memo = E.ReleaseMemo()
    select(noisy, p, layers=2, n=8000, memo=memo)
    assert memo.fits is not None
    for method in ("deconvolution", "mle", "threshold"):
        cached = A.anonymized_cumulative(
            noisy.copy(), p, layers=2, n=8000, method=method, memo=memo
        )
        fresh = A.anonymized_cumulative(noisy, p, layers=2, n=8000, method=method)
        assert np.array_equal(cached, fresh)
    other = noisy.copy()
    other[0] += 5  # other counters: not served from the memo
    assert E._remembered_fit(memo, noisy_value_counts(other), p, 2, "mle") is None
    assert E._remembered_fit(memo, noisy_value_counts(noisy), p, 2, "mle") is not None


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_deconvolved_batch_equals_one_at_a_time_to_rounding(layers):
    from aggregator.estimate import deconvolved_batch, MLE_MAX_ITER, MLE_TOL
    from aggregator.anonymize import anonymized_cumulative, anonymized_cumulative_many

    p = 0.6
    sets = [_zipf_noisy(2000 * (i + 1), 3000 * (i + 1), p, layers, 11 + i)[1] for i in range(4)]
    sets.append(discrete_laplace(p, 500, rng=np.random.default_rng(1)))  # no events at all
    # the early-stopped EM agrees to rounding; the converged NPMLE sits on a flat likelihood,
    # where the rounding of another FFT length moves it by up to ~1e-3 (a run of its own with
    # np.convolve instead of an FFT moves it as much)
    for it, tol, rtol in ((200, 1e-5, 1e-6), (MLE_MAX_ITER, MLE_TOL, 2e-2)):
        batch = deconvolved_batch(sets, p, layers=layers, max_iter=it, tol=tol)
        for x, b in zip(sets, batch):
            a = deconvolved_prevalence(x, p, layers=layers, max_iter=it, tol=tol)
            assert len(a) == len(b)
            np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol * max(1.0, float(a.max())))
    many = anonymized_cumulative_many(sets[:3], p, layers=layers, n=None, method="mle")
    for x, y in zip(sets[:3], many):
        one = anonymized_cumulative(x, p, layers=layers, method="mle")
        assert abs(int(one.sum()) - int(y.sum())) <= 0.001 * max(int(one.sum()), 1000)


@pytest.mark.parametrize("layers", [1, 2])
def test_deconvolved_batch_gives_em_prevalences_pair_of_each_set(layers):
    # auto's simulated states are fitted in one batch: each pair is the early-stopped EM and the
    # converged NPMLE of one set, as em_prevalences gives them (to the batch's rounding)
    from aggregator.estimate import em_prevalences, em_prevalences_many

    p = 0.6
    sets = [_zipf_noisy(1500 * (i + 1), 4000, p, layers, 31 + i)[1] for i in range(3)]
    sets.append(discrete_laplace(p, 400, rng=np.random.default_rng(2)))  # no events at all
    pairs = em_prevalences_many(sets, p, layers=layers)
    for x, (b_early, b_full) in zip(sets, pairs):
        a_early, a_full = em_prevalences(x, p, layers=layers)
        assert len(b_early) == len(a_early) and len(b_full) == len(a_full)
        np.testing.assert_allclose(
            b_early, a_early, rtol=1e-6, atol=1e-6 * max(1.0, float(a_early.max()))
        )
        np.testing.assert_allclose(
            b_full, a_full, rtol=2e-2, atol=2e-2 * max(1.0, float(a_full.max()))
        )
    # the early stop is a point on the path before the end, not the end itself
    assert any(not np.allclose(e, f) for e, f in pairs[:3])
