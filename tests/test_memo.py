"""A release's memo (aggregator.memo.ReleaseMemo): passed explicitly, the same numbers without it,
nothing shared between two memos, nothing global left by a release."""

import sys
import threading

import numpy as np
import pytest

from aggregator import anonymize as A
from aggregator import intervals as iv
from aggregator import largedomain as ld
from aggregator import selection as S
from aggregator.counters import noisy_value_counts
from aggregator.memo import ReleaseMemo
from aggregator.noise import discrete_laplace, p_from_epsilon
from aggregator.release import estimate_with_accuracy


def _direct(seed=3, layers=1):
    g = np.random.default_rng(seed)
    p = p_from_epsilon(1.0)
    h = np.r_[np.minimum(g.zipf(1.3, 400), 300), np.zeros(2_600, np.int64)]
    noisy = h.copy()
    for _ in range(layers):
        noisy = noisy + discrete_laplace(p, len(h), rng=g)
    return noisy, p, int(h.sum())


def _hashed(seed=4):
    g = np.random.default_rng(seed)
    p = p_from_epsilon(1.0)
    items = np.minimum(g.zipf(1.2, 1_500), 200)
    B = 2 * int(items.sum())
    red = np.bincount(g.integers(0, B, len(items)), weights=items, minlength=B).astype(np.int64)
    return red + discrete_laplace(p, B, rng=g), p, int(items.sum()), B


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _same(a[k], b[k])
        else:
            np.testing.assert_array_equal(
                np.asarray(a[k], dtype=object), np.asarray(b[k], dtype=object)
            )


@pytest.mark.parametrize("case", ["direct", "hashed"])
def test_error_bars_with_the_releases_memo_and_without_agree(case):
    if case == "direct":
        noisy, p, n = _direct()
        kw = dict(layers=1, n=n, method="auto")
    else:
        noisy, p, n, B = _hashed()
        kw = dict(layers=1, n=n, buckets=B, method="auto")
    memo = ReleaseMemo()
    hist = A.anonymized_histogram(noisy, p, memo=memo, **kw)
    assert memo.choice is not None and memo.fits is not None  # what the release kept
    with_memo = iv.error_bars(noisy, p, reps=3, rng=5, release=hist, memo=memo, **kw)
    without = iv.error_bars(noisy, p, reps=3, rng=5, **kw)  # fits and chooses again
    np.testing.assert_array_equal(hist, A.anonymized_histogram(noisy, p, **kw))
    _same(with_memo, without)


def test_chosen_start_without_a_memo_decides_again():
    noisy, p, n, B = _hashed(6)
    memo = ReleaseMemo()
    A.anonymized_histogram(noisy, p, layers=1, n=n, buckets=B, method="deconvolution", memo=memo)
    took, other = ld.chosen_start(noisy_value_counts(noisy), p, B, n, 1, memo=memo)
    again, other_again = ld.chosen_start(noisy_value_counts(noisy), p, B, n, 1)
    assert again == took and np.array_equal(other, other_again)


def test_two_memos_do_not_see_each_others_entries():
    noisy, p, n = _direct(7, layers=2)
    mine, theirs = ReleaseMemo(), ReleaseMemo()
    S.select(noisy, p, layers=2, n=n, memo=mine)
    assert theirs.fits is None and theirs.choice is None and theirs.starts is None
    seen = {}

    def other_thread():  # another aggregation's release, in its own thread, its own memo
        S.select(noisy + 1, p, layers=2, n=n, memo=theirs)
        seen["fit"] = theirs.fit(noisy_value_counts(noisy), p, 2, "deconvolution")

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert seen["fit"] is None  # their counters are not mine
    assert mine.fit(noisy_value_counts(noisy), p, 2, "deconvolution") is not None
    assert mine.choice[0] != theirs.choice[0]


def test_nothing_global_survives_a_release():
    noisy, p, n = _direct(8)
    estimate_with_accuracy(noisy, p, layers=1, n=n, reps=3, method="auto")
    # no module of the package holds a memo or a thread-local: the release's memo went with it
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("aggregator") or mod is None:
            continue
        for value in vars(mod).values():
            assert not isinstance(value, (ReleaseMemo, threading.local)), (mod_name, value)
