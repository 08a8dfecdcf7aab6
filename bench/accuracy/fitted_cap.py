"""The cap rule ``"fitted"``: measured on the accuracy grid and held out, not adopted.

Like ``"scale"`` it thins levels to bring a direct-mode release to the public n, but only the
items the EM fitted: a count above ``fitted_top`` (:func:`aggregator.em.sparse_top` of the
counters the estimate came from) belongs to a counter the EM passed through at its noisy value,
measured to within the noise rather than inferred, so those items stay whole and the items at
counts <= ``fitted_top`` are thinned alike. Where the passed-through items alone hold more than
the total, every level is thinned as ``"scale"`` does. It is ``"scale"`` where nothing is passed
through. docs/accuracy_grid.md ("A cap that keeps the measured items") has the measurements;
bench.accuracy.grid measures it on every direct cell, bench.accuracy.lofo's ``auto_fitted`` gives
it to ``auto``.

It lived in the library (aggregator.estimate.cap_total) until the library kept only the rules a
release uses; :func:`capped` is the library's cap_total with this rule beside its own, and
:func:`auto_fitted` makes ``auto`` (:mod:`aggregator.selection`) understand it.

>>> import numpy as np
>>> y = np.array([5, 1, 1, 1, 1])   # (5, 1, 1, 1, 1); the EM's axis ends at 1: the 5 stays
>>> cap_fitted(y, 7, fitted_top=1).tolist(), capped(y, 7, "scale").tolist()
([3, 1, 1, 1, 1], [4, 1, 1, 1, 0])
"""

from __future__ import annotations

import contextlib

import numpy as np

from aggregator import selection
from aggregator.cap import CAP_RULES, cap_total, thinned, with_remainder
from aggregator.em import sparse_top

#: the library's rules and this one, in the order the grid's results list them
MEASURED_CAPS = ("items", "scale", "fitted", "none")
assert set(MEASURED_CAPS) == set(CAP_RULES) | {"fitted"}


def cap_fitted(y, total: int, fitted_top: int | None) -> np.ndarray:
    """y with at most ``total`` events, the items above ``fitted_top`` kept whole (see the
    module's docstring)."""
    if fitted_top is None or int(fitted_top) < 0:
        raise ValueError("rule 'fitted' needs fitted_top >= 0 (em.sparse_top of the counters)")
    y = cap_total(y, total, "none")  # (checked: a valid cumulative prevalence, total >= 0)
    total = int(total)
    if int(y.sum()) <= total:
        return y
    top = min(int(fitted_top), len(y))
    base = int(y[top]) if top < len(y) else 0  # items above the EM's axis: kept whole
    room = total - int(y[top:].sum()) - base * top  # events left for the fitted items
    if room > 0:  # (room < the fitted items' events, since y does not fit)
        out = np.concatenate([thinned(y[:top] - base, room) + base, y[top:]])
    else:
        out = thinned(y, total)
    return with_remainder(out, total)


def capped(y, total: int, rule: str, *, fitted_top: int | None = None) -> np.ndarray:
    """:func:`aggregator.cap.cap_total` with ``"fitted"`` among the rules."""
    if rule == "fitted":
        return cap_fitted(y, total, fitted_top)
    return cap_total(y, total, rule)


@contextlib.contextmanager
def auto_fitted():
    """Within this block ``auto`` takes candidates whose cap is ``"fitted"``, and when any
    candidate's is, its stand-ins are thinned by ``"fitted"`` instead of ``"scale"`` (the
    library's :func:`aggregator.selection._capped` and ``_standin_cap``, patched)."""
    plain_capped, plain_standin = selection._capped, selection._standin_cap
    tops: dict = {}  # id(counters) -> (counters, their EM axis top): one sparse_top per state

    def axis_top(counters, p, k):
        hit = tops.get(id(counters))
        if hit is None or hit[0] is not counters:
            hit = tops[id(counters)] = (counters, sparse_top(counters, p, k))
        return hit[1]

    def capped_(y, total, rule, counters, p, k):
        if rule != "fitted" or total is None:
            return plain_capped(y, total, rule, counters, p, k)
        return cap_fitted(y, int(total), axis_top(counters, p, k))

    def standin_(vc, fits, pilots, n, p, k):
        rule = plain_standin(vc, fits, pilots, n, p, k)
        return "fitted" if rule == "scale" else rule

    selection._capped = capped_
    selection._standin_cap = standin_
    try:
        yield
    finally:
        selection._capped, selection._standin_cap = plain_capped, plain_standin
