"""Wu and Pagh's profile reconstruction (aggregator.wupagh): the circulant inverse, the simplex
projection, k layers, and method="wupagh" wherever estimators are chosen."""

import itertools

import numpy as np
import pytest

from aggregator import largedomain as ld
from aggregator.estimate import cumulative_prevalence, noise_pmf
from aggregator.estimators import METHODS, phi_estimate
from aggregator.anonymize import anonymized_histogram
from aggregator.noise import discrete_laplace, p_from_epsilon
from aggregator.wupagh import (
    inverse_filter,
    project_simplex,
    unbiased_profile,
    wupagh_prevalence,
    wupagh_profile,
)


@pytest.mark.parametrize("layers", [1, 2, 3, 6])
def test_inverse_filter_undoes_the_noise(layers):
    p = 0.55
    K, q = noise_pmf(p, layers)
    back = np.convolve(q, inverse_filter(p, layers))
    delta = np.zeros_like(back)
    delta[K + layers] = 1.0
    np.testing.assert_allclose(back, delta, atol=1e-9)


@pytest.mark.parametrize("layers", [1, 2])
def test_unbiased_profile_is_exactly_unbiased(layers):
    """E[phi_hat_t] = phi_t, computed against the exact pmf of the noisy-value counts."""
    p = 0.4
    K, q = noise_pmf(p, layers)
    h = np.array([0, 0, 0, 1, 1, 3, 7])
    lo, hi = -K, 7 + K
    expected_c = np.zeros(hi - lo + 1)
    for v in h:
        expected_c[v - K - lo : v + K - lo + 1] += q
    from aggregator.estimate import NoisyValueCounts

    # unbiased_profile is linear in c: feed the expected counts (reals) through it
    vc = NoisyValueCounts(lo, expected_c)
    est = unbiased_profile(vc, p, layers)
    truth = np.bincount(h, minlength=len(est))[: len(est)]
    np.testing.assert_allclose(est, truth, atol=1e-7)


def test_cumulative_sums_of_the_unbiased_profile_are_the_threshold_estimator():
    g = np.random.default_rng(2)
    p = p_from_epsilon(1.0)
    for layers in (1, 2, 3):
        h = np.concatenate([g.integers(1, 25, 80), np.zeros(400, np.int64)])
        noisy = h.copy()
        for _ in range(layers):
            noisy += discrete_laplace(p, len(h), rng=g)
        f = unbiased_profile(noisy, p, layers)
        ge = np.cumsum(f[::-1])[::-1][1:]
        th = cumulative_prevalence(noisy, p, layers=layers)
        m = min(len(ge), len(th))
        np.testing.assert_allclose(ge[:m], th[:m], atol=1e-6)


def test_project_simplex_is_the_euclidean_projection():
    g = np.random.default_rng(5)
    for _ in range(30):
        x = g.normal(0, 3, 6)
        total = float(g.uniform(0.5, 8))
        y = project_simplex(x, total)
        assert y.min() >= 0 and y.sum() == pytest.approx(total)
        # optimality (KKT): y = max(x - tau, 0) for one tau; no feasible move lowers ||y - x||
        for i, j in itertools.permutations(range(6), 2):
            if y[i] > 1e-9:
                z = y.copy()
                step = min(1e-3, y[i])
                z[i] -= step
                z[j] += step
                assert np.sum((z - x) ** 2) >= np.sum((y - x) ** 2) - 1e-12


def test_profile_sums_to_the_counters_and_release_is_valid():
    g = np.random.default_rng(9)
    p = p_from_epsilon(1.0)
    h = np.concatenate([g.integers(1, 40, 200), np.zeros(1_800, np.int64)])
    noisy = h + discrete_laplace(p, len(h), rng=g)
    phi = wupagh_profile(noisy, p)
    assert phi.sum() == pytest.approx(len(h)) and phi.min() >= 0
    ge = wupagh_prevalence(noisy, p)
    assert np.all(np.diff(ge) <= 1e-9)
    est = anonymized_histogram(noisy, p, n=int(h.sum()), method="wupagh")
    assert est.sum() <= h.sum() and np.all(np.diff(est) <= 0)


def test_wupagh_is_a_method_everywhere():
    assert "wupagh" in METHODS
    g = np.random.default_rng(4)
    p = p_from_epsilon(1.0)
    h = np.unique(g.zipf(1.3, 2_000), return_counts=True)[1]
    B = 4_000
    red = np.bincount(g.integers(0, B, len(h)), weights=h, minlength=B).astype(np.int64)
    noisy = red + discrete_laplace(p, B, rng=g) + discrete_laplace(p, B, rng=g)
    out = anonymized_histogram(noisy, p, layers=2, n=int(h.sum()), buckets=B, method="wupagh")
    assert out.sum() <= h.sum()
    np.testing.assert_array_equal(
        ld.hashed_phi_estimate(noisy, p, layers=2, method="wupagh"),
        phi_estimate(noisy, p, layers=2, method="wupagh"),
    )


def test_empty_window():
    p = p_from_epsilon(1.0)
    noisy = discrete_laplace(p, 5_000, rng=np.random.default_rng(0))
    est = anonymized_histogram(noisy, p, n=0, method="wupagh")
    assert len(est) == 0
