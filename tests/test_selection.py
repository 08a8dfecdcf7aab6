"""The estimator chosen from the counters (aggregator.selection, method="auto") and the
cross-fitted EM (estimate.crossfit_prevalence, method="xfit")."""

import numpy as np
import pytest

from aggregator import estimate as E
from aggregator import selection as S
from aggregator.noise import discrete_laplace, p_from_epsilon


def _state(seed, layers=2, items=300, zeros=3_000, top=30):
    g = np.random.default_rng(seed)
    h = np.concatenate([g.integers(1, top, items), np.zeros(zeros, np.int64)])
    p = p_from_epsilon(1.0)
    noisy = h.copy()
    for _ in range(layers):
        noisy += discrete_laplace(p, len(h), rng=g)
    return noisy, p, h


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_auto_is_deterministic_and_capped(layers):
    noisy, p, h = _state(layers, layers)
    n = int(h.sum())
    y1, c1 = S.select(noisy, p, layers=layers, n=n)
    y2, c2 = S.select(noisy, p, layers=layers, n=n)
    np.testing.assert_array_equal(y1, y2)
    assert c1 == c2 and c1 in S.CANDIDATES
    assert y1.sum() <= n and np.all(np.diff(y1) <= 0)
    rel = E.anonymized_histogram(noisy, p, layers=layers, n=n, method="auto")
    np.testing.assert_array_equal(E.cumulative_from_counts(rel), y1[: len(E.cumulative_from_counts(rel))])


def test_auto_release_is_the_chosen_candidates_release():
    noisy, p, h = _state(11, 2)
    n = int(h.sum())
    y, (m, cap) = S.select(noisy, p, layers=2, n=n)
    named = E.anonymized_histogram(noisy, p, layers=2, n=n, method=m, cap=cap)
    np.testing.assert_array_equal(E.counts_from_cumulative(y), named)


def test_auto_without_n_and_empty_window():
    noisy, p, h = _state(5, 1)
    y, (m, cap) = S.select(noisy, p, layers=1)
    assert cap == "none"
    empty = discrete_laplace(p, 4_000, rng=np.random.default_rng(1))
    y0, _ = S.select(empty, p, layers=2, n=0)
    assert y0.sum() == 0
    assert len(E.anonymized_histogram(empty, p, layers=2, n=0, method="auto")) == 0


def test_mean_m_step_meets_the_constraint_and_maximizes():
    g = np.random.default_rng(3)
    u = g.random(12)
    u /= u.sum()
    h = np.arange(12.0)
    for mu in (1.5, 4.0, 9.0):
        pi = E._mean_m_step(u, h, mu)
        assert pi.sum() == pytest.approx(1.0) and (pi * h).sum() == pytest.approx(mu, rel=1e-6)
        obj = float((u * np.log(pi)).sum())
        for _ in range(200):  # feasible perturbations: zero sum, zero mean shift
            d = g.normal(size=12)
            A = np.vstack([np.ones(12), h])
            d -= A.T @ np.linalg.solve(A @ A.T, A @ d)
            z = pi + 1e-4 * d / np.abs(d).max()
            if z.min() > 0:
                assert float((u * np.log(z)).sum()) <= obj + 1e-12


def test_xfit_uses_n_and_is_deterministic():
    noisy, p, h = _state(8, 2)
    n = int(h.sum())
    a, steps = E.crossfit_prevalence(noisy, p, layers=2, n=n, return_steps=True)
    b = E.crossfit_prevalence(noisy, p, layers=2, n=n)
    np.testing.assert_array_equal(a, b)
    assert 0 <= steps <= E.XFIT_MAX_ITER
    assert a.sum() == pytest.approx(n, rel=1e-6)  # sum_r phi_{>=r} = n under the constraint
