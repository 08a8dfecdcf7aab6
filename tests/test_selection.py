"""The estimator chosen from the counters (aggregator.selection, method="auto") and the
cross-fitted EM (estimate.crossfit_prevalence, method="xfit")."""

import numpy as np
import pytest

from aggregator import anonymize as A
from aggregator import counter_model
from aggregator import estimate as E
from aggregator import selection as S
from aggregator.memo import ReleaseMemo
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
    rel = A.anonymized_histogram(noisy, p, layers=layers, n=n, method="auto")
    np.testing.assert_array_equal(
        E.cumulative_from_counts(rel), y1[: len(E.cumulative_from_counts(rel))]
    )


def test_auto_release_is_the_chosen_candidates_release():
    noisy, p, h = _state(11, 2)
    n = int(h.sum())
    y, (m, cap) = S.select(noisy, p, layers=2, n=n)
    named = A.anonymized_histogram(noisy, p, layers=2, n=n, method=m, cap=cap)
    np.testing.assert_array_equal(E.counts_from_cumulative(y), named)


def test_auto_without_n_and_empty_window():
    noisy, p, h = _state(5, 1)
    y, (m, cap) = S.select(noisy, p, layers=1)
    assert cap == "none"
    empty = discrete_laplace(p, 4_000, rng=np.random.default_rng(1))
    y0, _ = S.select(empty, p, layers=2, n=0)
    assert y0.sum() == 0
    assert len(A.anonymized_histogram(empty, p, layers=2, n=0, method="auto")) == 0


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


def test_loglik_is_the_likelihood_of_the_noisy_values():
    """counter_model.loglik against the definition: every counter's noisy value is its stand-in
    value plus the k-layer noise, so the log-likelihood is sum_j log sum_r P(r) q(v_j - r)."""
    noisy, p, h = _state(4, 2, items=40, zeros=200, top=12)
    vc = E.noisy_value_counts(noisy)
    y = E.cumulative_from_counts(np.sort(h[h > 0])[::-1][:30])  # a stand-in, not the truth
    K, q = E.noise_pmf(p, 2)
    share = np.bincount(E.counts_from_cumulative(y), minlength=1).astype(float)
    share[0] += len(noisy) - int(y[0])
    share /= len(noisy)
    want = 0.0
    for v in noisy:
        r = np.arange(len(share))
        d = v - r
        ok = np.abs(d) <= K
        want += np.log((share[ok] * q[d[ok] + K]).sum())
    assert counter_model.loglik(vc, y, len(noisy), p, 2) == pytest.approx(want, rel=1e-9)


def test_stand_ins_keep_heavy_hitters_when_the_counters_show_them():
    """A few large items over mostly empty counters, wide noise: thinning every level (scale)
    shrinks the heavy hitters the counters plainly show, the likelihood says so, and the stand-ins
    are capped by keeping the largest items; a near-empty window (nothing to tell apart) keeps
    the scale rule."""
    g = np.random.default_rng(7)
    p = p_from_epsilon(0.25)
    h = np.zeros(200_000, np.int64)
    h[:3000] = np.maximum(1, (3e4 / np.arange(1, 3001) ** 2 / 1.64).astype(np.int64))
    noisy = h + discrete_laplace(p, len(h), rng=g) + discrete_laplace(p, len(h), rng=g)
    vc = E.noisy_value_counts(noisy)
    fits = S._estimates(vc, p, 2, S.PILOTS)
    assert S._standin_cap(vc, fits, S.PILOTS, int(h.sum()), p, 2) == "items"
    empty = np.zeros(200_000, np.int64)
    empty[:5] = [2, 1, 1, 1, 1]
    noisy0 = empty + discrete_laplace(p_from_epsilon(1.0), len(empty), rng=g)
    vc0 = E.noisy_value_counts(noisy0)
    fits0 = S._estimates(vc0, p_from_epsilon(1.0), 1, S.PILOTS)
    assert S._standin_cap(vc0, fits0, S.PILOTS, 6, p_from_epsilon(1.0), 1) == "scale"


def _heavy_window(seed, layers=1, heavy=40, once=2_000):
    """``heavy`` items seen 60 times and ``once`` seen once among 20,000 counters (n <= D)."""
    g = np.random.default_rng(seed)
    h = np.zeros(20_000, np.int64)
    h[:heavy], h[heavy : heavy + once] = 60, 1
    p = p_from_epsilon(0.5)
    noisy = h.copy()
    for _ in range(layers):
        noisy += discrete_laplace(p, len(h), rng=g)
    return noisy, p, int(h.sum())


@pytest.mark.parametrize("margin", [-1e9, 1e9, None])
def test_early_stopped_em_takes_the_shrunk_start_only_when_likelier_by_the_margin(
    monkeypatch, margin
):
    noisy, p, n = _heavy_window(3)
    vc = E.noisy_value_counts(noisy)
    smooth = E.project_l1(E.em_prevalences(vc, p, layers=1)[0])
    shrunk = E.project_l1(
        E.deconvolved_prevalence(
            vc, p, layers=1, shrunk_start=True, smooth_share=E.DIRECT_START_SMOOTH_SHARE
        )
    )
    assert not np.array_equal(smooth, shrunk)

    def ll(y):
        return counter_model.loglik(vc, E.cap_total(y, n, "items"), vc.total, p, 1)

    if margin is not None:
        monkeypatch.setattr(S, "START_MARGIN", margin)
    memo = ReleaseMemo()
    y, (m, cap) = S.select(noisy, p, layers=1, n=n, memo=memo)
    took, other = S.chosen_start(noisy, p, layers=1, n=n, memo=memo)
    again = S.chosen_start(noisy, p, layers=1, n=n)  # no memo: decided again, the same
    assert again[0] == took and np.array_equal(again[1], other)
    assert m == "deconvolution"  # (this window's choice, whichever start)
    assert took == (ll(shrunk) > ll(smooth) + S.START_MARGIN)
    mine, theirs = (shrunk, smooth) if took else (smooth, shrunk)
    np.testing.assert_array_equal(y, E.cap_total(mine, n, cap))
    np.testing.assert_array_equal(other, E.cap_total(theirs, n, cap))
    # the error bars' stand-in "deconvolution" is the fit the release took (the memo's: the
    # named estimator alone fits from the smoothed start)
    np.testing.assert_array_equal(
        A.anonymized_cumulative(noisy, p, layers=1, method="deconvolution", memo=memo),
        np.trim_zeros(mine, "b"),
    )
    np.testing.assert_array_equal(
        A.anonymized_cumulative(noisy, p, layers=1, method="deconvolution"),
        np.trim_zeros(smooth, "b"),
    )


def test_two_starts_only_at_one_layer_with_mostly_empty_counters(monkeypatch):
    monkeypatch.setattr(S, "START_MARGIN", -1e9)  # any fit from the shrunk start would be taken
    noisy, p, n = _heavy_window(4, layers=2)
    S.select(noisy, p, layers=2, n=n)
    assert S.chosen_start(noisy, p, layers=2, n=n) is None
    noisy, p, n = _heavy_window(4)
    assert S.chosen_start(noisy, p, layers=1, n=None) is None
    dense = noisy + 3  # n > D: every counter holds an item
    assert S.chosen_start(dense, p, layers=1, n=3 * len(noisy)) is None
    # hashed mode's bucket counters choose their start elsewhere (largedomain._likelier_start)
    vc = E.noisy_value_counts(noisy)
    assert S._two_starts(vc, 1, n) and not S._two_starts(vc, 1, n, hashed=True)


@pytest.mark.parametrize("margin", [-1e9, 1e9])
@pytest.mark.parametrize("below_noise", [False, True])
def test_error_bars_rerun_the_start_the_release_took_and_count_the_other(
    monkeypatch, margin, below_noise
):
    from aggregator import intervals as iv

    monkeypatch.setattr(S, "START_MARGIN", margin)
    # (windows whose choice is the early-stopped EM, whichever start)
    noisy, p, n = _heavy_window(0, heavy=5, once=200) if below_noise else _heavy_window(5)
    assert iv.signal_below_noise(n, len(noisy), p, 1) == below_noise  # (the two bootstrap paths)
    calls = []  # (shrunk start?, smoothed share) of each batch of re-estimates
    real = A.deconvolved_batch
    monkeypatch.setattr(
        A,
        "deconvolved_batch",
        lambda *a, **kw: (
            calls.append((kw.get("shrunk_start"), kw.get("smooth_share"))) or real(*a, **kw)
        ),
    )
    eb = iv.error_bars(noisy, p, layers=1, n=n, reps=4, rng=0)
    took, other = S.chosen_start(noisy, p, layers=1, n=n)
    assert took == (margin < 0) and S.select(noisy, p, layers=1, n=n)[1][0] == "deconvolution"
    # the release's re-estimates from its start (the stand-ins' own estimators: the smoothed)
    assert (took, E.DIRECT_START_SMOOTH_SHARE) in calls
    assert all(not s for s, _ in calls) or took
    gap = abs(len(eb["histogram"]) - int(other[0]))
    assert gap > 0 and eb["selected"] and eb["stand_in_gap"]["distinct"] >= gap


@pytest.mark.parametrize("margin", [-1e9, 1e9, None])
@pytest.mark.parametrize("below_noise", [False, True])
def test_error_bars_bootstrap_the_other_starts_fit_where_the_counters_allow_it(
    monkeypatch, margin, below_noise
):
    """Above the noise, the early-stopped EM's fit from the start the release left is a third
    stand-in exactly when its log-likelihood is within START_MARGIN of the release's: its
    states are drawn and the intervals reach it. Below the noise (the calibrated region) it
    is not."""
    from aggregator import intervals as iv

    if margin is not None:
        monkeypatch.setattr(S, "START_MARGIN", margin)
    noisy, p, n = _heavy_window(0, heavy=5, once=200) if below_noise else _heavy_window(5)
    assert iv.signal_below_noise(n, len(noisy), p, 1) == below_noise
    drawn = []  # the truths the bootstrap's states were drawn from
    real = iv.simulate_from_cumulative
    monkeypatch.setattr(
        iv,
        "simulate_from_cumulative",
        lambda rng, y, *a: drawn.append(np.asarray(y).copy()) or real(rng, y, *a),
    )
    eb = iv.error_bars(noisy, p, layers=1, n=n, reps=4, rng=0)
    took, other = S.chosen_start(noisy, p, layers=1, n=n)
    vc = E.noisy_value_counts(noisy)
    release = E.cumulative_from_counts(eb["histogram"])

    def ll(y):
        return counter_model.loglik(vc, y, vc.total, p, 1)

    used = not below_noise and ll(other) >= ll(release) - S.START_MARGIN
    assert used == (margin != -1e9 and not below_noise) or margin is None
    from_other = sum(len(y) == len(other) and np.array_equal(y, other) for y in drawn)
    assert from_other == (4 if used else 0)
    if used:
        lo, hi = eb["distinct"]
        assert lo <= int(other[0]) <= hi
