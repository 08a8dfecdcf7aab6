"""Symmetric properties: exact on known histograms, accurate on synthetic distributions."""

import itertools
import math

import numpy as np
import pytest

from aggregator import properties as P


def test_entropy_matches_direct_formula():
    h = [5, 3, 1, 1]
    n = sum(h)
    want = -sum(c / n * math.log(c / n) for c in h)
    assert P.entropy(h) == pytest.approx(want)
    assert P.entropy(h, base=2) == pytest.approx(want / math.log(2))
    assert P.entropy(h, correction="miller-madow") == pytest.approx(want + 3 / (2 * n))
    assert P.entropy([]) == 0.0
    with pytest.raises(ValueError):
        P.entropy(h, correction="jackknife")


def test_coverage_below_n_is_exact_subsample_expectation():
    sample = ["a", "a", "a", "b", "b", "c", "d"]  # histogram 3, 2, 1, 1
    n = len(sample)
    for m in range(1, n + 1):
        subsets = list(itertools.combinations(range(n), m))
        want = np.mean([len({sample[i] for i in s}) for s in subsets])
        assert P.support_coverage([3, 2, 1, 1], m) == pytest.approx(want)


@pytest.mark.parametrize("smoothing", ["binomial", "poisson"])
def test_smoothed_good_toulmin_on_uniform(smoothing):
    rng = np.random.default_rng(1)
    k, n = 5000, 3000
    sample = rng.integers(0, k, n)
    hist = np.bincount(sample)
    for m in (2 * n, 4 * n, 8 * n):
        truth = k * (1 - (1 - 1 / k) ** m)
        est = P.support_coverage(hist, m, smoothing=smoothing)
        assert abs(est - truth) < 0.05 * m, (m, est, truth)


def test_support_size_on_bounded_mass():
    rng = np.random.default_rng(2)
    k = 2000
    hist = np.bincount(rng.integers(0, k, 20_000))
    est = P.support_size(hist, K=k, alpha=0.1)
    assert abs(est - k) < 0.1 * k


def test_batched_coverage_construction():
    rng = np.random.default_rng(3)
    k, m, batches = 300, 200, 50
    events = rng.integers(0, k, m * batches)
    keys = [P.batched_item(x, i, m) for i, x in enumerate(events.tolist())]
    _, hist = np.unique(keys, return_counts=True)
    est = P.support_coverage_batched(hist, n=len(events), m=m)
    truth = k * (1 - (1 - 1 / k) ** m)
    assert abs(est - truth) < 0.03 * truth
    with pytest.raises(ValueError):
        P.support_coverage_batched(hist, n=10, m=m)


def test_prevalences():
    vals, phis = P.prevalences([3, 1, 1, 0, 3, 3])
    assert vals.tolist() == [1, 3] and phis.tolist() == [2, 3]
    with pytest.raises(ValueError):
        P.prevalences([-1])
