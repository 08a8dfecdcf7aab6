"""The release's shortcuts at large domains against the slow paths they replace (issue 12).

* sparse counters passed through the EM (``estimate._sparse_counters``): the estimate is exactly
  the EM of the other counters plus point masses at the passed noisy values, whose l1 error is
  their noise;
* one EM run for the early-stopped EM and the converged NPMLE (``estimate.em_prevalences``);
* the cached-spectrum FFT convolution, ``cap_total``'s O(log R) search, the grouped bootstrap
  simulation;
* hashed mode: n reaches the estimators that fit under it (auto deliberately runs uncapped), and
  buckets above the EM's dense top are not inverted.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator import anonymize as A
from aggregator import em
from aggregator import estimate as E
from aggregator import estimators as M
from aggregator import intervals as iv
from aggregator import largedomain as ld
from aggregator.noise import discrete_laplace


def _noisy(rng, h, p, layers):
    z = np.zeros(len(h), dtype=np.int64)
    for _ in range(layers):
        z += discrete_laplace(p, len(h), rng=rng)
    return h + z, z


def _dense_and_sparse(rng, dense, sparse, top):
    """Many small counts (and empty counters) plus a few large, spread-out ones."""
    return np.concatenate([rng.integers(0, 6, dense), rng.integers(200, top, sparse)])


def _l1(a, b):
    m = max(len(a), len(b))
    return float(np.abs(np.pad(a, (0, m - len(a))) - np.pad(b, (0, m - len(b)))).sum())


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 10**6),
    st.integers(50, 1500),
    st.integers(0, 40),
    st.sampled_from([0.3, 0.5, 0.7]),
    st.integers(1, 2),
)
def test_pass_through_is_the_em_of_the_rest_plus_the_noisy_values(seed, dense, sparse, p, layers):
    rng = np.random.default_rng(seed)
    h = _dense_and_sparse(rng, dense, sparse, 4000)
    x, z = _noisy(rng, h, p, layers)
    vc = E.noisy_value_counts(x)
    K, _ = E.noise_pmf(p, layers, E.EM_TAIL)
    vals = np.flatnonzero(vc.c) + vc.lo
    alone = E._sparse_counters(vals, vc.c[vc.c > 0].astype(float), K, E.SPARSE_DENSITY)
    passed = np.isin(x, vals[alone])
    early, full = E.em_prevalences(x, p, layers=layers)

    # the same EM without the passed counters and without passing anything through
    rest = E.noisy_value_counts(x[~passed]) if (~passed).any() else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(em, "SPARSE_DENSITY", 0.0)  # read by em.em_problem
        r_early, r_full = (
            E.em_prevalences(rest, p, layers=layers)
            if rest is not None
            else (np.zeros(0), np.zeros(0))
        )
    points = E.cumulative_from_counts(x[passed]).astype(float)
    for got, part in ((early, r_early), (full, r_full)):
        m = max(len(got), len(part), len(points))
        pad = lambda a: np.pad(a, (0, m - len(a)))  # noqa: E731
        np.testing.assert_allclose(pad(got), pad(part) + pad(points), atol=1e-9)

    # the stated bound: the passed counters' l1 error is at most their noise, sum |Z_j|
    truth_passed = E.cumulative_from_counts(h[passed])
    assert _l1(points, truth_passed) <= np.abs(z[passed]).sum() + 1e-9
    # so the whole estimate is off by at most the rest's error plus that noise
    truth, truth_rest = E.cumulative_from_counts(h), E.cumulative_from_counts(h[~passed])
    assert _l1(full, truth) <= _l1(r_full, truth_rest) + np.abs(z[passed]).sum() + 1e-6


def test_nothing_is_passed_where_counters_are_dense_or_within_the_noise_reach():
    rng = np.random.default_rng(1)
    p, K = 0.5, E.noise_pmf(0.5, 1, E.EM_TAIL)[0]
    # 20 counters at each of 100..120: dense; one at 3 K: sparse but near them; one far above
    h = np.concatenate(
        [np.zeros(5000, np.int64), np.repeat(np.arange(100, 121), 20), [120 + K // 2, 5000]]
    )
    x, _ = _noisy(rng, h, p, 1)
    vc = E.noisy_value_counts(x)
    vals = np.flatnonzero(vc.c) + vc.lo
    alone = E._sparse_counters(vals, vc.c[vc.c > 0].astype(float), K, E.SPARSE_DENSITY)
    assert set(vals[alone]) == {x[-1]}
    assert not E._sparse_counters(vals, vc.c[vc.c > 0].astype(float), K, 0.0).any()


def test_pass_through_bound_is_the_mean_absolute_noise():
    p = 0.6
    assert E.pass_through_bound(p) == pytest.approx(2 * p / (1 - p * p))
    _, z = _noisy(np.random.default_rng(2), np.zeros(200_000, np.int64), p, 2)
    assert E.pass_through_bound(p, 2) == pytest.approx(np.abs(z).mean(), rel=0.02)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_one_em_run_gives_both_estimators_exactly(layers):
    rng = np.random.default_rng(layers)
    h = _dense_and_sparse(rng, 3000, 30, 3000)
    x, _ = _noisy(rng, h, 0.6, layers)
    early, full = E.em_prevalences(x, 0.6, layers=layers)
    np.testing.assert_array_equal(
        early, M.phi_estimate(x, 0.6, layers=layers, method="deconvolution")
    )
    np.testing.assert_array_equal(full, M.phi_estimate(x, 0.6, layers=layers, method="mle"))


@pytest.mark.parametrize("n, taps", [(3000, 101), (5000, 301), (1000, 97)])
def test_fft_convolution_with_a_cached_spectrum_is_the_convolution(n, taps):
    rng = np.random.default_rng(taps)
    a, q = rng.random(n), rng.random(taps)
    q = q + q[::-1]
    for _ in range(2):  # the second call reads the cached spectrum
        np.testing.assert_allclose(
            E._conv(a, q), np.convolve(a, q, mode="same"), rtol=1e-9, atol=1e-12
        )


def _cap_items_by_passes(y, total):
    """cap_total's 'items' rule as first written: a full pass over y per bisection step."""
    lo, hi = 0, int(y[0])
    while hi - lo > 1:
        c = (lo + hi) // 2
        if int(np.minimum(y, c).sum()) <= total:
            lo = c
        else:
            hi = c
    out = np.minimum(y, lo)
    out[: total - int(out.sum())] += 1
    return out


@given(st.lists(st.integers(1, 500), min_size=1, max_size=60), st.integers(0, 3000))
def test_cap_items_search_equals_the_full_passes(counts, total):
    y = E.cumulative_from_counts(counts)
    want = y if int(y.sum()) <= total else _cap_items_by_passes(y, total)
    np.testing.assert_array_equal(E.cap_total(y, total, "items"), want)


def test_grouped_simulation_has_the_noise_law_at_a_repeated_value():
    rng = np.random.default_rng(4)
    p, m = 0.5, 100_000
    vc = iv.simulate_counts(rng, np.concatenate([np.full(m, 30), [7, 900]]), m + 50, p, 2)
    assert vc.total == m + 50
    K, q = E.noise_pmf(p, 2)
    v = np.arange(-6, 7)
    got = vc.c[30 + v - vc.lo].astype(float)
    want = m * q[v + K]
    assert np.sum((got - want) ** 2 / want) < 45  # 13 cells: a 1e-4 tail bound


def test_hashed_release_gives_n_to_xfit_and_runs_auto_uncapped(monkeypatch):
    """n reaches the hashed estimators that fit under it (it did not reach any before); auto's
    selection runs without it on purpose (capping the reduced histogram inside the selection was
    measured worse on the grid: largedomain.hashed_phi_estimate)."""
    import aggregator.selection as sel

    seen = {}
    real_auto, real_xfit = sel.selected_prevalence, E.crossfit_prevalence

    def auto_spy(noisy_counts, p, *, layers=1, n=None, **kw):
        seen["auto"] = n
        return real_auto(noisy_counts, p, layers=layers, n=n, **kw)

    def xfit_spy(noisy_counts, p, *, layers=1, n=None, **kw):
        seen["xfit"] = n
        return real_xfit(noisy_counts, p, layers=layers, n=n, **kw)

    monkeypatch.setattr(M, "selected_prevalence", auto_spy)  # where phi_estimate finds them
    monkeypatch.setattr(M, "crossfit_prevalence", xfit_spy)
    rng = np.random.default_rng(5)
    B, n = 4000, 2000
    red = np.bincount(rng.integers(0, B, n), minlength=B)
    x, _ = _noisy(rng, red, 0.5, 1)
    assert M.default_method("hashed", 1) == "auto"
    A.anonymized_histogram(x, 0.5, buckets=B, n=n)
    A.anonymized_histogram(x, 0.5, buckets=B, n=n, method="xfit")
    assert seen == {"auto": None, "xfit": n}


def test_hashed_buckets_above_the_dense_top_are_released_as_they_are():
    rng = np.random.default_rng(6)
    B, p = 40_000, 0.5
    items = np.concatenate([np.ones(10_000, np.int64), [7_000]])
    red = np.bincount(rng.integers(0, B, len(items)), weights=items, minlength=B).astype(np.int64)
    x, _ = _noisy(rng, red, p, 1)
    top = ld.sparse_top(x, p, 1)
    assert 0 < top < 1000 < x.max()
    est = ld.hashed_histogram(x, p, buckets=B, n=int(items.sum()), method="mle")
    assert est[0] == x.max()  # the big item's bucket: its noisy value, no collision correction


@given(
    st.lists(st.integers(1, 300), max_size=80),
    st.integers(0, 200),
    st.integers(1, 2),
    st.integers(0, 2**32 - 1),
)
@settings(max_examples=40, deadline=None)
def test_simulating_from_the_cumulative_prevalence_draws_the_same_state(
    counts, empty, layers, seed
):
    y = E.cumulative_from_counts(counts)
    C = len([c for c in counts if c > 0]) + empty
    if C == 0:
        return
    a = iv.simulate_from_cumulative(np.random.default_rng(seed), y, C, 0.6, layers)
    b = iv.simulate_counts(np.random.default_rng(seed), E.counts_from_cumulative(y), C, 0.6, layers)
    assert a.lo == b.lo and np.array_equal(a.c, b.c)
