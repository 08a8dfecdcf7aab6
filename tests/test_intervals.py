"""Noise floor and bootstrap error bars (aggregator.intervals): the math, the shapes, the
release."""

import math

import numpy as np
import pytest

from aggregator import intervals as iv
from aggregator.estimate import noise_pmf
from aggregator.anonymize import anonymized_histogram
from aggregator.noise import discrete_laplace, p_from_epsilon


@pytest.mark.parametrize("p", [0.2, 0.5, 0.78])
def test_chi2_one_layer_is_one_over_lemma10_x(p):
    assert iv.chi2_shift(p) == pytest.approx((1 - p) ** 2 / p, rel=1e-9)


def test_more_layers_less_information():
    p = p_from_epsilon(1.0)
    chi = [iv.chi2_shift(p, k) for k in (1, 2, 3, 4)]
    assert all(a > b for a, b in zip(chi, chi[1:]))


def test_noise_floor_scales_with_the_square_root_of_the_counters():
    p = p_from_epsilon(1.0)
    assert iv.noise_floor(4 * 10**6, p, 2) == pytest.approx(2 * iv.noise_floor(10**6, p, 2))
    with pytest.raises(ValueError):
        iv.noise_floor(0, p)


def test_signal_below_noise_flags_small_n_only():
    p = p_from_epsilon(1.0)
    C = 10**6
    n_cut = iv.SNR_MIN * iv.noise_floor(C, p, 2)
    assert iv.signal_below_noise(int(n_cut) - 1, C, p, 2)
    assert not iv.signal_below_noise(int(n_cut) + 1, C, p, 2)
    assert iv.signal_to_noise(2 * 10**4, C, p, 2) == pytest.approx(
        2 * iv.signal_to_noise(10**4, C, p, 2)
    )


def test_simulate_counts_has_every_counter_and_the_noise_law():
    rng = np.random.default_rng(3)
    p, C = 0.5, 200_000
    vc = iv.simulate_counts(rng, np.array([40, 7]), C, p, 1)
    assert vc.total == C
    K, q = noise_pmf(p, 1)
    # the zero counters' noisy values follow the exact pmf (chi-square on the central values)
    v = np.arange(-5, 6)
    got = vc.c[v - vc.lo].astype(float)
    want = C * q[v + K]
    assert np.sum((got - want) ** 2 / want) < 40  # 11 cells: a 1e-4 tail bound
    with pytest.raises(ValueError):
        iv.simulate_counts(rng, np.arange(1, 5), 3, p, 1)


def _direct_case(seed=5):
    rng = np.random.default_rng(seed)
    h = np.concatenate([rng.integers(1, 80, 300), np.zeros(3_000, np.int64)])
    p = p_from_epsilon(1.0)
    return h, p, h + discrete_laplace(p, len(h), rng=rng) + discrete_laplace(p, len(h), rng=rng)


def test_error_bars_carry_the_release_itself():
    h, p, noisy = _direct_case()
    n = int(h.sum())
    eb = iv.error_bars(noisy, p, layers=2, n=n, reps=5, rng=0)
    np.testing.assert_array_equal(eb["histogram"], anonymized_histogram(noisy, p, layers=2, n=n))
    lo, hi = eb["phi_lower"], eb["phi_upper"]
    assert np.all(lo <= hi) and lo.min() >= 0 and hi.max() <= n
    assert eb["distinct"] == (lo[0], hi[0])
    assert eb["entropy_nats"][0] <= eb["entropy_nats"][1]
    assert eb["relative_l1_bound"] == pytest.approx(eb["l1_bound"] / n)
    assert eb["signal_to_noise"] == pytest.approx(iv.signal_to_noise(n, len(h), p, 2))


def test_error_bars_are_reproducible_with_a_seed():
    h, p, noisy = _direct_case()
    a = iv.error_bars(noisy, p, layers=2, n=int(h.sum()), reps=4, rng=7)
    b = iv.error_bars(noisy, p, layers=2, n=int(h.sum()), reps=4, rng=7)
    assert a["l1_bound"] == b["l1_bound"]
    np.testing.assert_array_equal(a["phi_upper"], b["phi_upper"])


def test_error_bars_in_hashed_mode():
    rng = np.random.default_rng(9)
    h = np.unique(rng.zipf(1.2, 5_000), return_counts=True)[1]
    n, B, p = int(h.sum()), 10_000, p_from_epsilon(1.0)
    red = np.bincount(rng.integers(0, B, len(h)), weights=h, minlength=B).astype(np.int64)
    noisy = red + discrete_laplace(p, B, rng=rng)
    eb = iv.error_bars(noisy, p, n=n, buckets=B, reps=4, rng=1)
    np.testing.assert_array_equal(eb["histogram"], anonymized_histogram(noisy, p, n=n, buckets=B))
    assert eb["l1_bound"] > 0 and math.isfinite(eb["l1_bound"])


def test_hashed_error_bars_rerun_the_candidate_auto_chose(monkeypatch):
    # the default (auto) chooses once, on the real counters; each bootstrap draw re-runs the
    # chosen estimator, as in direct mode, instead of choosing again (9 EM runs a draw)
    from aggregator import selection

    rng = np.random.default_rng(9)
    h = np.unique(rng.zipf(1.2, 5_000), return_counts=True)[1]
    n, B, p = int(h.sum()), 10_000, p_from_epsilon(1.0)
    red = np.bincount(rng.integers(0, B, len(h)), weights=h, minlength=B).astype(np.int64)
    noisy = red + discrete_laplace(p, B, rng=rng)
    calls = []
    real = selection._select
    monkeypatch.setattr(selection, "_select", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    eb = iv.error_bars(noisy, p, n=n, buckets=B, reps=3, rng=1)
    assert len(calls) == 1
    _, (m, _) = selection.select(noisy, p, n=None)
    np.testing.assert_array_equal(  # the chosen candidate is the release
        eb["histogram"], anonymized_histogram(noisy, p, n=n, buckets=B, method=m)
    )


@pytest.mark.parametrize("bad", [dict(level=1.0), dict(level=0.0), dict(reps=1)])
def test_error_bars_reject_bad_arguments(bad):
    h, p, noisy = _direct_case()
    with pytest.raises(ValueError):
        iv.error_bars(noisy, p, layers=2, **bad)


def test_error_bars_every_released_statistic():
    h, p, noisy = _direct_case(6)
    n = int(h.sum())
    eb = iv.error_bars(noisy, p, layers=2, n=n, reps=4, rng=3)
    rl, ru = eb["phi_r_lower"], eb["phi_r_upper"]
    assert len(rl) == len(ru) and np.all(rl <= ru) and rl.min() >= 0
    lo_c, hi_c = eb["support_coverage_2n"]
    assert 0 <= lo_c <= hi_c
    bands = eb["rank_bands"]
    assert [b[:2] for b in bands][:2] == [(1, 1), (2, 10)]
    assert all(b[2] <= b[3] <= n for b in bands)


def test_two_stand_ins_give_the_union_of_their_intervals():
    h, p, noisy = _direct_case(7)
    n = int(h.sum())
    both = iv.error_bars(noisy, p, layers=2, n=n, reps=4, rng=11, model="both")
    mle = iv.error_bars(noisy, p, layers=2, n=n, reps=4, rng=11, model="mle")
    assert both["model"] == "both" and mle["model"] == "mle"
    assert both["distinct"][1] - both["distinct"][0] >= 0
    with pytest.raises(ValueError):
        iv.error_bars(noisy, p, layers=2, n=n, reps=4, model="sideways")


def test_rank_band_sums():
    np.testing.assert_array_equal(
        iv.rank_band_sums([5, 1, 9, 2], bands=(1, 3, 10)), [9.0, 7.0, 1.0]
    )
    assert iv.rank_band_sums([]).sum() == 0


def test_error_bars_with_the_chosen_estimator():
    h, p, noisy = _direct_case(8)
    n = int(h.sum())
    eb = iv.error_bars(noisy, p, layers=2, n=n, reps=3, rng=2, method="auto")
    np.testing.assert_array_equal(
        eb["histogram"], anonymized_histogram(noisy, p, layers=2, n=n, method="auto")
    )


@pytest.mark.parametrize("m", [10, 16, 19, 30])
@pytest.mark.parametrize("dist", ["normal", "exponential"])
def test_prediction_band_covers_one_more_draw_at_the_level(m, dist):
    # the release's deviation from the truth plays "one more draw" of the bootstrap deviations
    g = np.random.default_rng([7, m, len(dist)])
    trials = 20000
    draw = g.standard_normal if dist == "normal" else g.exponential
    x = draw(size=(m + 1, trials))
    lo, hi = iv.prediction_band(x[:m], 0.9)
    coverage = np.mean((x[m] >= lo) & (x[m] <= hi))
    assert coverage >= 0.89  # distribution-free or t-based: at least the level (se 0.002)
    # negative control: the plain empirical quantiles of m draws cover far less than 0.9
    q_lo, q_hi = np.quantile(x[:m], [0.05, 0.95], axis=0)
    assert np.mean((x[m] >= q_lo) & (x[m] <= q_hi)) < 0.86


@pytest.mark.parametrize("m", [10, 16, 30])
def test_prediction_bound_is_a_one_sided_bound_at_the_level(m):
    g = np.random.default_rng([8, m])
    x = g.exponential(size=(m + 1, 4000))
    bounds = np.array([iv.prediction_bound(x[:m, i], 0.9) for i in range(x.shape[1])])
    assert np.mean(x[m] <= bounds) >= 0.885  # se 0.005
    if m <= 16:  # negative control: the plain 0.9 quantile of m draws is a ~0.85 bound
        plain = np.quantile(x[:m], 0.9, axis=0)
        assert np.mean(x[m] <= plain) < 0.87


def test_prediction_band_is_never_narrower_than_the_sample():
    x = np.array([[0.0], [0.0], [0.0], [5.0]])
    lo, hi = iv.prediction_band(x, 0.9)
    assert lo[0] <= 0.0 and hi[0] >= 5.0
    same = np.zeros((10, 3))
    lo, hi = iv.prediction_band(same, 0.9)  # no spread: the interval is the value itself
    assert np.all(lo == 0.0) and np.all(hi == 0.0)


# -- the information floor -----------------------------------------------------------------------
def _floor_by_definition(hist_counts, C, p, k, level=0.9, top=8):
    """information_floor's distinct-items and phi_2 bounds, counter by counter: the pmf of one
    counter's noisy value summed over the counters, each move pair's Fisher information from
    that pmf, the standard error capped by the pair's reach, the largest over the pairs."""
    from scipy.stats import norm

    z = norm.ppf(1 - (1 - level) / 2)
    K, q = noise_pmf(p, k)
    pmf = lambda x: q[x + K] if -K <= x <= K else 0.0  # noqa: E731
    values = list(hist_counts) + [0] * (C - len(hist_counts))
    mult = {}
    for v in values:
        mult[v] = mult.get(v, 0) + 1
    xs = range(-K - 2, top + K + 3)
    fC = {x: max(sum(m * pmf(x - v) for v, m in mult.items()), 1e-12) for x in xs}
    best = {"distinct": 0.0, "phi_2": 0.0}
    for a in range(top + 1):
        for b in range(top + 1):
            reach = mult.get(a, 0) // 2 if a == b + 1 else min(mult.get(a, 0), mult.get(b + 1, 0))
            if a == b or reach < 1:
                continue
            info = sum(
                (pmf(x - a - 1) - pmf(x - a) - pmf(x - b - 1) + pmf(x - b)) ** 2 / fC[x] for x in xs
            )
            se = min(1 / math.sqrt(info), reach / z)
            s1 = (a + 1 == 1) - (b + 1 == 1)
            s2 = (a + 1 == 2) - (a == 2) + (b == 2) - (b + 1 == 2)
            best["distinct"] = max(best["distinct"], abs(s1) * se)
            best["phi_2"] = max(best["phi_2"], abs(s2) * se)
    return best


@pytest.mark.parametrize("k", [1, 2])
def test_information_floor_matches_its_definition(k):
    # items enough at every count that the most informative-per-change move is not limited by
    # them: the half-width is then z times the largest single-move standard error
    h = np.repeat(np.arange(1, 7), 1_000)
    p = p_from_epsilon(2.0)
    y = np.cumsum(np.bincount(h)[::-1])[::-1][1:]
    got = iv.information_floor(y, 30_000, p, k, top=8)
    want = _floor_by_definition(h, 30_000, p, k, top=8)
    z = 1.6448536269514722
    assert got["phi_ge"][0] == pytest.approx(z * want["distinct"], rel=1e-6)
    assert got["phi_r"][1] == pytest.approx(z * want["phi_2"], rel=1e-6)
    assert z * want["distinct"] < 1_000  # (the premise)


def test_information_floor_follows_items_through_several_moves():
    # 65 items of 7 events in 1e5 counters (n = 455 beside the heavy hitters): each can split
    # off six singletons, which the counters cannot see at eps = 1; one move per item would
    # reach only 65
    p = p_from_epsilon(1.0)
    h = np.r_[[200, 120, 80, 60, 40], np.full(65, 7)]
    y = np.cumsum(np.bincount(h)[::-1])[::-1][1:]
    hw = iv.information_floor(y, 10**5, p, 1)
    assert hw["phi_ge"][0] == pytest.approx(65 * 6)
    assert hw["l1"] == pytest.approx(2 * 65 * 6)  # every move: one phi_{>=r} up, one down
    # many more events per counter's noise: the Fisher-Rao budget, not the items, binds
    hw_sharp = iv.information_floor(y, 10**5, p_from_epsilon(8.0), 1)
    assert hw_sharp["phi_ge"][0] < 65


def test_information_floor_of_an_empty_window_is_the_noise_floor():
    p = p_from_epsilon(1.0)
    hw = iv.information_floor([], 10**5, p, 1)["phi_ge"][0]
    assert hw == pytest.approx(1.6448536269514722 * iv.noise_floor(10**5, p, 1), rel=1e-6)


def test_information_floor_is_zero_where_nothing_can_move():
    # every counter holds 5 events: no empty counter, no second count to trade with
    p = p_from_epsilon(1.0)
    y = np.full(5, 1_000)
    fl = iv.information_floor(y, 1_000, p, 2)
    assert fl["phi_ge"][0] == 0 and fl["phi_r"][0] == 0
    assert fl["entropy"] > 0  # two items at 5 can become 4 and 6


def test_support_coverage_at_2n_is_twice_the_odd_prevalences():
    # the S_2n weights information_floor uses
    from aggregator.properties import support_coverage

    h = np.random.default_rng(0).integers(1, 40, 500)
    odd = np.bincount(h)[1::2].sum()
    assert support_coverage(h, 2 * int(h.sum())) == pytest.approx(2 * odd)


def test_error_bars_are_never_shorter_than_the_information_floor(monkeypatch):
    # 2,000 items of geometric counts among 4,000 counters, two layers: the bootstrap's spread
    # alone gives a shorter distinct-items interval than the counters' information allows
    g = np.random.default_rng(1)
    p = p_from_epsilon(1.0)
    h = np.concatenate([g.geometric(0.3, 2000), np.zeros(2000, np.int64)])
    noisy = h + discrete_laplace(p, len(h), rng=g) + discrete_laplace(p, len(h), rng=g)
    n = int(h.sum())
    eb = iv.error_bars(noisy, p, layers=2, n=n, reps=6, rng=1)
    release = len(eb["histogram"])
    lo, hi = eb["distinct"]
    floors = [
        iv.information_floor(
            np.cumsum(np.bincount(anonymized_histogram(noisy, p, layers=2, n=n, method=m))[::-1])[
                ::-1
            ][1:],
            len(h),
            p,
            2,
        )["phi_ge"][0]
        for m in ("deconvolution", "mle")
    ]
    assert max(floors) > 0
    assert lo <= max(release - max(floors), 0) + 1e-6
    assert hi >= min(release + max(floors), len(h)) - 1e-6
    # negative control: without the floor the same bootstrap gives a shorter interval
    monkeypatch.setattr(
        iv,
        "information_floor",
        lambda *a, **kw: {
            "phi_ge": np.zeros(iv.FLOOR_R),
            "phi_r": np.zeros(iv.FLOOR_R),
            "entropy": 0.0,
            "coverage_2n": 0.0,
            "l1": 0.0,
        },
    )
    monkeypatch.setattr(iv, "plausible_extremes", lambda *a, **kw: [])
    bare = iv.error_bars(noisy, p, layers=2, n=n, reps=6, rng=1)["distinct"]
    assert bare[1] - bare[0] < 0.8 * (hi - lo)


def test_plausible_extremes_stay_within_the_likelihood_region():
    from scipy.stats import chi2

    from aggregator.estimate import cumulative_from_counts, noisy_value_counts
    from aggregator.counter_model import loglik as _loglik

    g = np.random.default_rng(4)
    p = p_from_epsilon(1.0)
    C = 50_000
    h = np.r_[[150, 90], np.ones(300, np.int64)]
    vc = noisy_value_counts(
        np.r_[h, np.zeros(C - len(h), np.int64)] + discrete_laplace(p, C, rng=g)
    )
    stand_in = cumulative_from_counts(np.r_[[150, 90], np.full(50, 6)])
    ll0 = _loglik(vc, stand_in, C, p, 1)
    more, fewer = iv.plausible_extremes(vc, stand_in, C, p, 1, level=0.9)
    n = lambda y: int(y.sum())  # noqa: E731  (sum of phi_{>=r} = events)
    assert n(more) == n(fewer) == n(stand_in)  # n is kept
    assert fewer[0] < stand_in[0] < more[0]
    for x in (more, fewer):  # within chi2_1(0.9) / 2 of the best point seen (here >= ll0)
        assert _loglik(vc, x, C, p, 1) >= ll0 - chi2.ppf(0.9, 1) / 2 - 1e-6
    # a stricter level keeps them closer to the stand-in
    more_50, _ = iv.plausible_extremes(vc, stand_in, C, p, 1, level=0.5)
    assert more_50[0] <= more[0]


def test_error_bars_reach_the_plausible_extremes():
    g = np.random.default_rng(2)
    p = p_from_epsilon(1.0)
    h = np.r_[[200, 120, 80], np.ones(400, np.int64), np.zeros(10**5 - 403, np.int64)]
    noisy = h + discrete_laplace(p, len(h), rng=g)
    n = int(h.sum())
    eb = iv.error_bars(noisy, p, n=n, reps=4, rng=0)
    from aggregator.estimate import cumulative_from_counts, noisy_value_counts
    from aggregator.counter_model import loglik as _loglik

    vc = noisy_value_counts(noisy)
    ys = {
        m: cumulative_from_counts(anonymized_histogram(noisy, p, n=n, method=m))
        for m in ("deconvolution", "mle")
    }
    lls = {m: _loglik(vc, y, len(h), p, 1) for m, y in ys.items()}
    reached = []
    for m, y in ys.items():
        for x in iv.plausible_extremes(vc, y, len(h), p, ref=max(lls.values()), loglik=lls[m]):
            assert eb["distinct"][0] <= x[0] <= eb["distinct"][1]
            reached.append(x[0])
    assert max(reached) > max(y[0] for y in ys.values())  # they widen the interval here


def test_the_region_drop_is_calibrated_to_the_fits_gap_over_a_truth(monkeypatch):
    # 5 heavy hitters over 500 singletons among 1e5 counters, one layer: the NPMLE puts the
    # singletons' events into a few items of several events each and out-likes the truth by
    # more than Wilks' chi2_1(0.9) / 2; the drop calibrated on simulated states covers that gap,
    # so the distinct-items interval reaches the truth
    from scipy.stats import chi2

    from aggregator.estimate import cumulative_from_counts, noisy_value_counts
    from aggregator.counter_model import loglik as _loglik

    g = np.random.default_rng(0)
    p = p_from_epsilon(1.0)
    C = 10**5
    h = np.r_[np.full(5, 100), np.ones(500, np.int64)]
    noisy = np.r_[h, np.zeros(C - len(h), np.int64)] + discrete_laplace(p, C, rng=g)
    n = int(h.sum())
    vc = noisy_value_counts(noisy)
    best = max(
        _loglik(vc, cumulative_from_counts(anonymized_histogram(vc, p, n=n, method=m)), C, p, 1)
        for m in ("deconvolution", "mle")
    )
    gap = best - _loglik(vc, cumulative_from_counts(h), C, p, 1)
    wilks = chi2.ppf(0.9, 1) / 2
    assert gap > 2 * wilks  # the truth is outside Wilks' region here
    drops = []
    real = iv.likelihood_drop
    monkeypatch.setattr(
        iv, "likelihood_drop", lambda *a, **kw: drops.append(real(*a, **kw)) or drops[-1]
    )
    lo, hi = iv.error_bars(noisy, p, n=n, reps=6, rng=0)["distinct"]
    assert drops[0] > gap
    assert lo <= len(h) <= hi
    # negative control: Wilks' drop, the same bootstrap, misses the truth
    monkeypatch.setattr(iv, "likelihood_drop", lambda *a, **kw: wilks)
    lo, hi = iv.error_bars(noisy, p, n=n, reps=6, rng=0)["distinct"]
    assert hi < len(h)


def test_the_region_drop_is_a_quantile_of_the_gaps_and_never_below_wilks():
    from scipy.stats import chi2

    g = np.random.default_rng(3)
    p = p_from_epsilon(1.0)
    truth = np.r_[np.full(20, 30), np.full(200, 3)]
    sims = {"mle": [iv.simulate_counts(g, truth, 20_000, p, 1) for _ in range(8)]}
    refits = {
        "mle": [[anonymized_histogram(s, p, n=int(truth.sum()), method="mle")] for s in sims["mle"]]
    }
    at = {lv: iv.likelihood_drop(sims, {"mle": truth}, refits, p, 1, lv) for lv in (0.5, 0.9, 0.99)}
    assert at[0.5] <= at[0.9] <= at[0.99]
    assert min(at.values()) >= chi2.ppf(0.5, 1) / 2
    assert at[0.99] > chi2.ppf(0.99, 1) / 2  # the NPMLE out-likes the truth by more than 1 df


def test_the_calibrated_drop_only_below_the_noise(monkeypatch):
    # above the noise Wilks' drop stands (the whole-histogram region is needlessly wide there);
    # below it, or without n, the calibrated one
    g = np.random.default_rng(5)
    p = p_from_epsilon(1.0)
    calls = []
    monkeypatch.setattr(iv, "likelihood_drop", lambda *a, **kw: calls.append(1) or 1.35)
    h = np.r_[g.geometric(0.1, 3000), np.zeros(1000, np.int64)]
    noisy = h + discrete_laplace(p, len(h), rng=g)
    assert not iv.signal_below_noise(int(h.sum()), len(h), p, 1)
    iv.error_bars(noisy, p, n=int(h.sum()), reps=2, rng=0)
    assert calls == []
    iv.error_bars(noisy, p, reps=2, rng=0)
    assert calls == [1]
    small = np.r_[np.ones(40, np.int64), np.zeros(20_000, np.int64)]
    assert iv.signal_below_noise(40, len(small), p, 1)
    iv.error_bars(small + discrete_laplace(p, len(small), rng=g), p, n=40, reps=2, rng=0)
    assert calls == [1, 1]


def test_histogram_statistics_from_prevalences_equal_the_listed_counts():
    from aggregator.estimate import counts_from_cumulative, cumulative_from_counts
    from aggregator.properties import entropy

    g = np.random.default_rng(4)
    for counts in (np.array([5]), g.integers(1, 40, 300), g.zipf(1.3, 20_000), np.zeros(0)):
        counts = counts[counts < 10**6]
        y = cumulative_from_counts(counts)
        h = counts_from_cumulative(y)
        H, C, bands = iv._hist_stats(y)
        assert H == pytest.approx(entropy(h), rel=1e-12, abs=1e-12)
        assert C == iv._coverage_2n(h)
        assert np.array_equal(bands, iv.rank_band_sums(h))


def test_column_groups_cover_every_change():
    g = np.random.default_rng(5)
    arrays = [np.sort(g.integers(0, 30, m))[::-1] for m in (50, 80, 10)]
    R = 81
    starts = iv._column_groups(arrays, R)
    lens = np.diff(np.append(starts, R))
    for a in arrays:
        full = np.pad(a, (0, R - len(a))).astype(float)
        assert np.array_equal(np.repeat(iv._at(a, starts), lens), full)
