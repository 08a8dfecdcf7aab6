"""bench/accuracy/fitted_cap.py: the cap rule "fitted", measured and not adopted (the library's cap
rules
are aggregator.cap.CAP_RULES), and auto given it as bench.accuracy.lofo's auto_fitted does."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator import selection
from aggregator.histograms import counts_from_cumulative, cumulative_from_counts
from aggregator.noise import discrete_laplace
from bench.accuracy.fitted_cap import auto_fitted, cap_fitted, capped


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 30), max_size=25),
    st.integers(0, 400),
    st.sampled_from(["items", "scale", "fitted"]),
    st.integers(0, 35),
)
def test_every_measured_cap_is_a_valid_histogram_with_the_capped_total(counts, total, rule, top):
    y = cumulative_from_counts(counts)
    out = capped(y, total, rule, fitted_top=top)
    assert np.all(np.diff(out) <= 0) and (len(out) == 0 or out[-1] >= 0)
    if y.sum() <= total:
        np.testing.assert_array_equal(out, y)
    else:
        assert out.sum() == total


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=25), st.integers(0, 400), st.integers(0, 35)
)
def test_cap_fitted_keeps_the_items_above_the_axis_and_thins_the_others(counts, total, top):
    """ "fitted": the items counted above ``fitted_top`` (passed through by the EM) stay whole
    while the others can hold the rest; the items at or below it are thinned, never raised."""
    counts = np.asarray(counts)
    out = counts_from_cumulative(cap_fitted(cumulative_from_counts(counts), total, top))
    above, below = np.sort(counts[counts > top]), counts[counts <= top]
    if counts.sum() <= total:
        np.testing.assert_array_equal(np.sort(out), np.sort(counts))
    elif above.sum() < total:  # else they alone are over: every level is thinned ("scale")
        np.testing.assert_array_equal(np.sort(out[out > top]), above)
        kept = np.sort(out[out <= top])[::-1]
        assert len(kept) <= len(below) and np.all(kept <= np.sort(below)[::-1][: len(kept)])
    assert int(out.sum()) == min(int(counts.sum()), total)


def test_cap_fitted_needs_the_axis_top():
    with pytest.raises(ValueError, match="fitted_top"):
        cap_fitted(np.array([3, 1]), 2, None)


def test_auto_takes_fitted_candidates_inside_the_block_only():
    g = np.random.default_rng(3)
    h = np.concatenate([[400, 250], g.integers(1, 6, 300), np.zeros(1_700, np.int64)])
    p, n = 0.5, int(h.sum())
    noisy = h + discrete_laplace(p, len(h), rng=g)
    cands = tuple((m, "fitted" if c == "scale" else c) for m, c in selection.CANDIDATES)
    with pytest.raises(ValueError, match="rule must be one of"):
        selection.select(noisy, p, n=n, candidates=cands, sims=1)
    with auto_fitted():
        y, choice = selection.select(noisy, p, n=n, candidates=cands, sims=1)
    assert choice in cands and int(y.sum()) <= n
    assert selection._standin_cap.__module__ == "aggregator.selection"
