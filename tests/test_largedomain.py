"""Large domains: Gamma^B (exact vs Algorithm 6, all hash functions, Monte Carlo), its inversion,
Algorithm 7 (one and two histograms), Algorithm 4 (l2), choose_buckets, and bad arguments."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator import largedomain as ld
from aggregator.estimate import (
    counts_from_cumulative,
    cumulative_from_counts,
    l1_distance,
    project_l1,
)
from aggregator.anonymize import anonymized_histogram
from aggregator.noise import discrete_laplace, p_from_epsilon
from aggregator.state import PanPrivateHistogram


def _reduced(h, B, rng):
    """Bucket totals of items with counts h under one uniformly random hash into B buckets."""
    return np.bincount(rng.integers(0, B, len(h)), weights=h, minlength=B).astype(np.int64)


def _zipf_counts(rng, D, top):
    return np.minimum(rng.zipf(1.4, D), top).astype(np.int64)


# --------------------------------------------------------------------------------------------
# Gamma^B: exactness
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "h,B",
    [([3, 1, 1, 2, 5], 3), ([1, 1, 1, 1], 2), ([4, 2, 2], 4), ([7], 5), ([2, 2, 2, 2, 1, 1], 2)],
)
def test_gamma_equals_average_over_every_hash_function(h, B):
    """Tiny D, B: enumerate all B^D maps H : [D] -> [B] (the exact definition of Gamma^B)."""
    h = np.array(h)
    L = int(h.sum()) + 1
    acc = np.zeros(L)
    for H in itertools.product(range(B), repeat=len(h)):
        red = np.bincount(H, weights=h, minlength=B).astype(np.int64)
        acc += cumulative_from_counts(red, R=L)
    acc /= B ** len(h)
    phi = cumulative_from_counts(h)
    for method in ("direct", "fft"):
        np.testing.assert_allclose(ld.gamma_b(phi, B, L, method=method), acc, atol=1e-12)
    np.testing.assert_allclose(
        [ld.gamma_b_alg6(phi, B, ell) for ell in range(1, L + 1)], acc, atol=1e-12
    )


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=25), st.integers(2, 60))
def test_gamma_matches_algorithm6(counts, B):
    phi = cumulative_from_counts(counts)
    L = len(phi) + 3
    ref = np.array([ld.gamma_b_alg6(phi, B, ell) for ell in range(1, L + 1)])
    np.testing.assert_allclose(ld.gamma_b(phi, B, L, method="direct"), ref, rtol=1e-10, atol=1e-9)
    np.testing.assert_allclose(ld.gamma_b(phi, B, L, method="fft"), ref, rtol=1e-8, atol=1e-8)


def test_gamma_observation19_ignores_higher_entries():
    """Gamma_l depends on phi_{>=1..l} only: Algorithm 6 truncated at l agrees with the full map."""
    rng = np.random.default_rng(3)
    phi = cumulative_from_counts(_zipf_counts(rng, 300, 80))
    full = ld.gamma_b(phi, 1000)
    for ell in (1, 2, 5, 17, 40):
        assert math.isclose(ld.gamma_b_alg6(phi[:ell], 1000), full[ell - 1], rel_tol=1e-10)


def test_gamma_fft_agrees_with_direct_on_a_long_series():
    rng = np.random.default_rng(4)
    phi = cumulative_from_counts(_zipf_counts(rng, 5000, 3000))
    B = 20_000
    L = len(phi) + 50
    direct = ld.gamma_b(phi, B, L, method="direct")
    fft = ld.gamma_b(phi, B, L, method="fft")
    np.testing.assert_allclose(fft, direct, rtol=1e-9, atol=1e-7)


def test_gamma_matches_monte_carlo_hashing():
    """Medium input: mean of phi^red over many random hash functions within 4 standard errors."""
    rng = np.random.default_rng(5)
    h = _zipf_counts(rng, 3000, 400)
    B, draws = 4000, 600
    L = 60
    samples = np.empty((draws, L))
    for i in range(draws):
        samples[i] = cumulative_from_counts(_reduced(h, B, rng), R=L)
    mean = samples.mean(axis=0)
    se = samples.std(axis=0, ddof=1) / math.sqrt(draws)
    gam = ld.gamma_b(cumulative_from_counts(h), B, L)
    z = (mean - gam) / np.maximum(se, 1e-9)
    assert np.abs(z).max() < 4.5, np.abs(z).max()
    # and the collisions are visible: Gamma differs from the unhashed phi by many SEs
    phi = cumulative_from_counts(h, R=L)
    assert np.abs((gam - phi) / np.maximum(se, 1e-9))[:5].min() > 20


def test_gamma_lemma20_monotonicity():
    """Moving one item from r-1 to r: Gamma_l unchanged below r, Gamma_r up by >= 1 - n/B,
    and the rest moves by less than n/B in total (Lemma 20) - what the binary search relies on."""
    rng = np.random.default_rng(6)
    for _ in range(20):
        h = _zipf_counts(rng, int(rng.integers(5, 60)), 30)
        B = int(rng.integers(2 * h.sum(), 8 * h.sum()))
        j = int(rng.integers(len(h)))
        r = int(h[j]) + 1
        h2 = h.copy()
        h2[j] += 1
        n = int(h.sum())
        L = int(h2.sum()) + 2
        g1 = ld.gamma_b(cumulative_from_counts(h), B, L)
        g2 = ld.gamma_b(cumulative_from_counts(h2), B, L)
        np.testing.assert_allclose(g2[: r - 1], g1[: r - 1], atol=1e-9)
        assert g2[r - 1] - g1[r - 1] >= 1 - n / B - 1e-12
        assert np.abs(g2[r:] - g1[r:]).sum() < n / B + 1e-12


def test_gamma_is_affine_in_the_last_entry():
    """With phi_{>=1..r-1} fixed, Gamma_r is affine in phi_{>=r} (r >= 2), slope
    (1-q)^(phi_1 - 1)."""
    B = 50
    base = [9, 6, 4]  # phi_{>=1}, phi_{>=2}, phi_{>=3}
    vals = [ld.gamma_b(np.array(base + [x]), B)[3] for x in range(0, 5)]
    d = np.diff(vals)
    np.testing.assert_allclose(d, d[0], rtol=1e-10)
    assert math.isclose(d[0], (1 - 1 / B) ** (base[0] - 1), rel_tol=1e-10)


# --------------------------------------------------------------------------------------------
# inversion
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_invert_gamma_round_trip(seed):
    rng = np.random.default_rng(seed)
    phi = cumulative_from_counts(_zipf_counts(rng, 2000, 300)).astype(float)
    B = 3000  # D / B ~ 2/3: heavy collisions
    L = 8 * len(phi)  # far enough that P[bucket total >= L] is negligible
    back = ld.invert_gamma(ld.gamma_b(phi, B, L), B)
    assert len(back) == 2 * L
    np.testing.assert_allclose(back[: len(phi)], phi, atol=1e-6)
    np.testing.assert_allclose(back[len(phi) :], 0, atol=1e-6)


def test_invert_gamma_keeps_the_counterweight_of_expected_collisions():
    """A plausible outcome (probability ~ 1/e): no collision at all. The inverse divides out the
    expected collisions (~1 of the 100 large items should have moved up), so it adds ~1 large
    item; its counterweight lies above the largest reduced value and must be kept, else a
    phantom item of size 2000 survives the projection."""
    B = 20_000
    h = np.array([2000] * 100 + [1] * 100)
    psi = cumulative_from_counts(h).astype(float)
    inv = ld.invert_gamma(psi, B)
    L = len(psi)
    assert len(inv) == 2 * L and inv[L] < -0.5  # the counterweight: phi_{>=L+1} < 0
    est = counts_from_cumulative(project_l1(inv))
    assert l1_distance(h, est) < 100
    # stopping at L (dropping the counterweight) keeps a phantom item of size ~2000
    assert l1_distance(h, counts_from_cumulative(project_l1(inv[:L] - inv[L]))) >= 1900


def test_greedy_prefix_recovers_integers_exactly():
    rng = np.random.default_rng(7)
    h = _zipf_counts(rng, 400, 60)
    phi = cumulative_from_counts(h)
    B = 8 * int(h.sum())
    gam = ld.gamma_b(phi, B, len(phi) + 10)
    got = ld.greedy_prefix(gam, B, int(h.sum()), len(phi))
    np.testing.assert_array_equal(got, phi)


def test_greedy_binary_search_is_closest_integer():
    """Each step picks the integer x minimizing |Gamma_r(..., x) - psi_r| (checked by brute
    force)."""
    rng = np.random.default_rng(8)
    B, n = 40, 30
    psi = np.sort(rng.uniform(0, 12, 6))[::-1]
    out = ld.greedy_prefix(psi, B, n, 6)
    for r in range(1, 7):
        prev = n if r == 1 else out[r - 2]
        cands = np.arange(0, prev + 1)
        vals = [
            abs(
                ld.gamma_b(np.concatenate([out[: r - 1], [x]]).astype(float), B)[r - 1] - psi[r - 1]
            )
            for x in cands
        ]
        assert abs(vals[out[r - 1]] - min(vals)) < 1e-9


def test_inversion_of_noise_free_reduced_histogram_is_accurate():
    """One real random hash, no noise: inverting beats the raw bucket histogram by far."""
    rng = np.random.default_rng(9)
    h = np.minimum(rng.zipf(2.0, 40_000), 2_000).astype(np.int64)  # many small items
    n = int(h.sum())
    B = n
    red = _reduced(h, B, rng)
    red = red[red > 0]
    raw_err = l1_distance(h, red)
    psi = cumulative_from_counts(red).astype(float)
    inv = counts_from_cumulative(project_l1(ld.invert_gamma(psi, B)))
    err = l1_distance(h, inv)
    assert err < 0.15 * raw_err, (err, raw_err)
    assert err < 3 * math.sqrt(n), (err, n)


def test_hashed_state_end_to_end_beats_the_raw_bucket_histogram():
    """Strings into a real hashed state (SipHash), release through anonymized_histogram(buckets=).

    The error depends on the hash key (which items collide), so the claim is checked over five
    fixed keys: the inversion beats the raw bucket histogram for every key and by 2x at the median.
    """
    rng = np.random.default_rng(10)
    ids = np.minimum(rng.zipf(1.3, 40_000), 10**9)
    items = np.char.add("user-", ids.astype("U12"))
    _, h = np.unique(ids, return_counts=True)
    eps = 4.0  # small noise so that the collision bias dominates the raw histogram's error
    B = 30_000
    ratios = []
    for k in range(5):
        state = PanPrivateHistogram(
            eps, buckets=B, key=bytes([k + 1]) * 16, rng=np.random.default_rng(11 + k)
        )
        state.update(items)
        est = anonymized_histogram(state.counts, state.p, n=state.n, buckets=B)
        raw = ld.hashed_histogram(state.counts, state.p, buckets=B, n=state.n, variant="reduced")
        alg7 = ld.hashed_histogram(
            state.counts, state.p, buckets=B, n=state.n, variant="alg7-single"
        )
        e_est, e_raw, e_alg7 = (l1_distance(h, x) for x in (est, raw, alg7))
        assert e_est < e_raw and e_alg7 < e_raw, (k, e_est, e_alg7, e_raw)
        assert np.all(np.diff(est) <= 0) and est.dtype == np.int64 and est.min() > 0
        ratios.append(e_est / e_raw)
    assert np.median(ratios) < 0.5, ratios


def test_hashed_one_layer_default_is_the_grid_choice_and_mle_beats_the_threshold_estimator():
    """Mostly-empty buckets (B = 3 n): the release uses the grid's default for hashed mode, one
    layer (estimators.default_method), and the EM NPMLE run to convergence beats the threshold
    estimator on the same noisy counters. Seeded hashing and noise, six data sets: valid
    histograms every time, lower total error."""
    from aggregator.estimators import default_method

    p = p_from_epsilon(1.0)
    tot = {"mle": 0, "threshold": 0}
    for seed in range(6):
        rng = np.random.default_rng(seed + 100)
        h = np.unique(rng.zipf(1.1, 20_000), return_counts=True)[1]
        B = 60_000
        noisy = _reduced(h, B, rng) + discrete_laplace(p, B, rng=rng)
        est = anonymized_histogram(noisy, p, buckets=B)
        assert est.dtype == np.int64 and np.all(np.diff(est) <= 0) and est.min() > 0
        default = default_method("hashed", 1)
        np.testing.assert_array_equal(est, ld.hashed_histogram(noisy, p, buckets=B, method=default))
        for m in tot:
            tot[m] += l1_distance(h, ld.hashed_histogram(noisy, p, buckets=B, method=m))
    assert tot["mle"] < 0.85 * tot["threshold"], tot


def test_hashed_two_layer_default_is_the_grid_choice_and_mle_beats_early_stopping():
    """Joint model (two DLap layers per counter), mostly-empty buckets (n = 1e5 Zipf(1.1) events
    clipped to 1e4 ids, B = 2 n: ~97% of the buckets empty; ~6,200 items, many events each). The
    release is exactly the default's (``auto``, which takes the NPMLE here), a valid histogram;
    the EM NPMLE run to convergence is closer than the early-stopped EM on every one of three
    seeded data sets (1.7-2.2x: why a fixed early-stopped default was rejected for hashed 2-layer
    releases, docs/accuracy_grid.md)."""
    p = p_from_epsilon(1.0)
    errs = []
    for seed in range(3):
        rng = np.random.default_rng(seed + 300)
        n = 100_000
        h = np.unique(np.minimum(rng.zipf(1.1, n), 10_000), return_counts=True)[1]
        B = 2 * n
        noisy = (
            _reduced(h, B, rng) + discrete_laplace(p, B, rng=rng) + discrete_laplace(p, B, rng=rng)
        )
        from aggregator.estimators import default_cap, default_method

        est = anonymized_histogram(noisy, p, n=n, layers=2, buckets=B)
        assert est.dtype == np.int64 and np.all(np.diff(est) <= 0) and est.min() > 0
        np.testing.assert_array_equal(
            est,
            ld.hashed_histogram(
                noisy,
                p,
                buckets=B,
                n=n,
                layers=2,
                method=default_method("hashed", 2),
                cap=default_cap("hashed", 2),
            ),
        )
        est = ld.hashed_histogram(noisy, p, buckets=B, n=n, layers=2, method="mle")
        early = ld.hashed_histogram(noisy, p, buckets=B, n=n, layers=2, method="deconvolution")
        errs.append((l1_distance(h, est), l1_distance(h, early)))
    assert all(e < d for e, d in errs), errs
    assert sum(e for e, _ in errs) < 0.7 * sum(d for _, d in errs), errs


def test_hashed_phi_estimate_defaults_and_errors():
    rng = np.random.default_rng(5)
    noisy = np.concatenate([np.zeros(300, np.int64), rng.integers(1, 9, 100)])
    p = 0.5
    noisy = noisy + discrete_laplace(p, len(noisy), rng=rng)
    from aggregator.estimators import default_method as dm

    np.testing.assert_allclose(
        ld.hashed_phi_estimate(noisy, p), ld.hashed_phi_estimate(noisy, p, method=dm("hashed", 1))
    )
    np.testing.assert_allclose(
        ld.hashed_phi_estimate(noisy, p, layers=2),
        ld.hashed_phi_estimate(noisy, p, layers=2, method=dm("hashed", 2)),
    )
    with pytest.raises(ValueError):
        ld.hashed_phi_estimate(noisy, p, method="magic")
    # direct mode has its own default (without n, no cap)
    from aggregator.estimators import default_method, phi_estimate

    np.testing.assert_array_equal(
        anonymized_histogram(noisy, p),
        counts_from_cumulative(
            project_l1(phi_estimate(noisy, p, method=default_method("direct", 1)))
        ),
    )


def test_two_histogram_algorithm7():
    rng = np.random.default_rng(12)
    h = np.minimum(rng.zipf(2.0, 4000), 500).astype(np.int64)
    n = int(h.sum())
    p = p_from_epsilon(4.0)
    B = n
    hashed = _reduced(h, B, rng) + discrete_laplace(p, B, rng=rng)
    direct = h + discrete_laplace(p, len(h), rng=rng)
    est = ld.two_histogram_estimate(direct, p, hashed, p, buckets=B, n=n)
    raw = ld.hashed_histogram(hashed, p, buckets=B, n=n, variant="reduced")
    assert l1_distance(h, est) < l1_distance(h, raw)
    assert np.all(np.diff(est) <= 0) and est.min() > 0


def test_unstable_inverse_falls_back_to_the_clipped_search():
    """Almost every bucket occupied (B << n): still a valid histogram, no overflow."""
    rng = np.random.default_rng(13)
    h = np.minimum(rng.zipf(1.5, 3000), 500).astype(np.int64)
    B = 1200
    p = p_from_epsilon(1.0)
    noisy = _reduced(h, B, rng) + discrete_laplace(p, B, rng=rng)
    est = ld.hashed_histogram(noisy, p, buckets=B, n=int(h.sum()))
    assert np.all(np.diff(est) <= 0) and (len(est) == 0 or est.min() > 0)
    assert est.sum() < 3 * h.sum()


def test_l2_two_hash_box():
    """Algorithm 4 with a collision-free second hash: sum n, and l2^2 no worse than l1 alone."""
    rng = np.random.default_rng(14)
    h = np.minimum(rng.zipf(1.5, 300), 300).astype(np.int64)
    n = int(h.sum())
    p = p_from_epsilon(2.0)
    B1 = 3 * n
    B2 = ld.collision_free_buckets(len(h), delta=0.01)
    noisy1 = _reduced(h, B1, rng) + discrete_laplace(p, B1, rng=rng)
    noisy2 = _reduced(h, B2, rng) + discrete_laplace(p, B2, rng=rng)
    est2 = ld.l2_histogram(noisy1, p, buckets=B1, n=n, box_counts=noisy2)
    est_same = anonymized_histogram(noisy1, p, n=n, buckets=B1, loss="l2")
    est1 = anonymized_histogram(noisy1, p, n=n, buckets=B1)

    def l2sq(a, b):
        m = max(len(a), len(b))
        a = np.pad(np.sort(a)[::-1], (0, m - len(a)))
        b = np.pad(np.sort(b)[::-1], (0, m - len(b)))
        return float(((a - b) ** 2).sum())

    assert est2.sum() == n and est_same.sum() == n
    assert l2sq(h, est2) <= l2sq(h, est1) * 1.05 + 50


# --------------------------------------------------------------------------------------------
# choosing B
# --------------------------------------------------------------------------------------------
def test_choose_buckets_values():
    n = 10**6
    assert ld.choose_buckets(n, 1.0, rule="corollary13", min_ratio=1) == math.ceil(
        n * math.sqrt(math.log(n))
    )
    assert ld.choose_buckets(n, 2.0, rule="footnote7", min_ratio=1) == math.ceil(
        n * math.sqrt(2.0**2.5 * math.log(n))
    )
    # footnote 7 uses fewer buckets than Corollary 13 below eps = 1 and more above
    assert ld.choose_buckets(n, 0.5, rule="footnote7", min_ratio=1) < ld.choose_buckets(
        n, 0.5, rule="corollary13", min_ratio=1
    )
    assert ld.choose_buckets(n, 2.0, rule="footnote7", min_ratio=1) > ld.choose_buckets(
        n, 2.0, rule="corollary13", min_ratio=1
    )
    # "capped" (the previous default): footnote 7 between 1.5 n and Corollary 13
    for eps in (0.1, 0.5, 1.0, 2.0, 8.0):
        B = ld.choose_buckets(n, eps, rule="capped")
        assert 1.5 * n <= B <= ld.choose_buckets(n, eps, rule="corollary13")
        assert B == max(
            ld.choose_buckets(n, eps, rule="footnote7"), 1.5 * n
        ) or B == ld.choose_buckets(n, eps, rule="corollary13")
    assert ld.choose_buckets(n, 0.5, rule="capped") == ld.choose_buckets(n, 0.5, rule="footnote7")
    # the clamp to B >= min_ratio * n
    assert ld.choose_buckets(1000, 0.1, rule="footnote7", min_ratio=2) == 2000
    assert ld.choose_buckets(1, 1.0) >= 16
    # monotone in n for every rule and eps
    for rule in ld.BUCKET_RULES:
        for eps in (0.5, 1.0, 2.0):
            vals = [ld.choose_buckets(m, eps, rule=rule) for m in (10, 10**3, 10**5, 10**7)]
            assert vals == sorted(vals)


def test_choose_buckets_default_flat():
    # the default is the measured "flat" rule: B = 2 n for every n and eps (docs/large_domains.md,
    # "Choosing B"); the service sizes hashed states with it
    assert ld.DEFAULT_BUCKET_RULE == "flat"
    assert ld.DEFAULT_BUCKET_RULE in ld.BUCKET_RULES and "capped" in ld.BUCKET_RULES
    assert ld.FLAT_RATIO == 2.0
    for n in (10**3, 10**4, 10**6, 10**7, 12345):
        for eps in (0.1, 0.5, 1.0, 2.0, 8.0):
            B = ld.choose_buckets(n, eps)
            assert B == ld.choose_buckets(n, eps, rule="flat") == math.ceil(2.0 * n)
            # between Theorem 12's regime (B ~ n) and Corollary 13's n sqrt(log n)
            assert n <= B <= ld.choose_buckets(n, eps, rule="corollary13")
    assert ld.choose_buckets(10**6, 1.0, min_ratio=3) == 3 * 10**6
    assert ld.choose_buckets(1, 1.0) == 16


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n_expected=0, epsilon=1.0),
        dict(n_expected=-5, epsilon=1.0),
        dict(n_expected=float("nan"), epsilon=1.0),
        dict(n_expected=100, epsilon=0.0),
        dict(n_expected=100, epsilon=1.0, rule="magic"),
        dict(n_expected=100, epsilon=1.0, min_ratio=0),
    ],
)
def test_choose_buckets_rejects(kwargs):
    with pytest.raises(ValueError):
        ld.choose_buckets(**kwargs)


def test_choose_buckets_type_errors():
    with pytest.raises(TypeError):
        ld.choose_buckets("1e6", 1.0)
    with pytest.raises(TypeError):
        ld.choose_buckets(True, 1.0)


# --------------------------------------------------------------------------------------------
# bad arguments
# --------------------------------------------------------------------------------------------
def test_bad_arguments():
    noisy = np.array([3, 0, -1, 2, 0, 1])
    p = 0.5
    with pytest.raises(ValueError, match="buckets=7"):
        ld.hashed_histogram(noisy, p, buckets=7)
    with pytest.raises(ValueError, match="variant"):
        ld.hashed_histogram(noisy, p, buckets=6, variant="nope")
    with pytest.raises(ValueError, match="loss"):
        ld.hashed_histogram(noisy, p, buckets=6, loss="l3")
    with pytest.raises(ValueError, match="needs n"):
        ld.hashed_histogram(noisy, p, buckets=6, variant="alg7-single")
    with pytest.raises(ValueError, match="needs n"):
        anonymized_histogram(noisy, p, buckets=6, loss="l2")
    with pytest.raises(ValueError, match="buckets"):
        ld.gamma_b([3, 1], 1)
    with pytest.raises(ValueError, match="buckets"):
        ld.gamma_b([3, 1], True)
    with pytest.raises(ValueError, match="non-increasing"):
        ld.gamma_b([1, 3], 10)
    with pytest.raises(ValueError, match="non-increasing"):
        ld.gamma_b([3, -1], 10)
    with pytest.raises(ValueError, match="method"):
        ld.gamma_b([3, 1], 10, method="slow")
    with pytest.raises(TypeError):
        ld.gamma_b_alg6(np.array([3.0, 1.0]), 10)
    with pytest.raises(ValueError, match="occupied"):
        ld.invert_gamma([10, 2], 10)
    with pytest.raises(ValueError, match="m must"):
        ld.greedy_prefix([3, 1], 10, 5, 0)
    with pytest.raises(ValueError):
        ld.collision_free_buckets(0)


def test_empty_and_trivial_inputs():
    assert len(ld.gamma_b([], 10)) == 0
    np.testing.assert_allclose(ld.gamma_b([], 10, L=3), 0)
    assert len(ld.invert_gamma([], 10)) == 0
    # all-zero counters: nothing to release
    est = ld.hashed_histogram(np.zeros(50, dtype=np.int64), 0.01, buckets=50, n=0)
    assert len(est) == 0


def test_snapping_before_the_projection_keeps_its_result():
    """_snap drops sub-1/2 counterweights and rounds near-integers: same projection, fewer runs."""
    rng = np.random.default_rng(16)
    h = np.minimum(rng.zipf(1.5, 5_000), 500).astype(np.int64)
    n = int(h.sum())
    assert n < 300_000  # B = 2n noisy counters
    B = 2 * n
    p = p_from_epsilon(1.0)
    noisy = _reduced(h, B, rng) + discrete_laplace(p, B, rng=rng)
    psi = ld.reduced_cumulative(noisy, p).astype(float)
    inv = ld.invert_gamma(psi, B)
    full = project_l1(inv)
    snapped = project_l1(ld._snap(inv, len(psi)))
    m = max(len(full), len(snapped))
    np.testing.assert_array_equal(
        np.pad(full, (0, m - len(full))), np.pad(snapped, (0, m - len(snapped)))
    )


def test_hashed_release_never_holds_more_events_than_n():
    """Few events in many buckets (n = 2,000 over B = 40,000, eps = 0.5, two layers): the
    uncapped item histogram holds more than n events; with n given, at most n (every cap rule),
    and cap="none" gives back the uncapped one."""
    rng = np.random.default_rng(23)
    h = np.unique(rng.zipf(1.1, 2_000), return_counts=True)[1]
    n, B, p = int(h.sum()), 40_000, p_from_epsilon(0.5)
    noisy = _reduced(h, B, rng) + discrete_laplace(p, B, rng=rng) + discrete_laplace(p, B, rng=rng)
    free = ld.hashed_histogram(noisy, p, buckets=B, layers=2, method="deconvolution")
    assert free.sum() > n
    for cap in (None, "items", "scale"):
        est = anonymized_histogram(
            noisy, p, layers=2, n=n, buckets=B, method="deconvolution", cap=cap
        )
        assert est.sum() <= n and np.all(np.diff(est) <= 0)
    np.testing.assert_array_equal(
        ld.hashed_histogram(noisy, p, buckets=B, n=n, layers=2, method="deconvolution", cap="none"),
        free,
    )
