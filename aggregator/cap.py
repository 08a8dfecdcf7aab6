"""The cap at the public n: a released histogram never holds more events than the stream had.

Under replace-one neighbours the number of events n is public, and sum_r phi_{>=r} is the number
of events a histogram holds, so a release may be brought to at most n (:func:`cap_total`). Noise
shows up as surplus mass when most counters are empty (n << D); under the l1 objective the cut is
degenerate there (every unit removed below the estimate costs exactly 1), so the rule that makes
the cut decides (:data:`CAP_RULES`):

* ``"items"``: y_r -> min(y_r, c) with the largest c that fits, the left-over events to one more
  item: keeps the largest items (an l1 projection clipped at c stays an l1 projection among the
  histograms with at most c items);
* ``"scale"``: y_r -> floor(y_r n / sum y), every level thinned alike;
* ``"none"``: as it is (for measurements; not admissible in a release, it can exceed n).

The default per mode and layer count is :func:`aggregator.estimators.default_cap`, chosen on the
accuracy grid (docs/accuracy_grid.md).

>>> import numpy as np
>>> y = np.array([6, 3, 1])          # the histogram (3, 2, 2, 1, 1, 1): 10 events
>>> cap_total(y, 7).tolist()         # at most 7: keep the largest items, (3, 2, 2)
[3, 3, 1]
>>> cap_total(y, 7, rule="scale").tolist()   # every level thinned: (2, 2, 1, 1, 1)
[5, 2, 0]

References: seed 001 section 5 (replace-one neighbours make n public); docs/accuracy_grid.md
("Candidates") for the rules' measured errors.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CAP_RULES", "cap_total", "thinned", "with_remainder"]


CAP_RULES = ("items", "scale", "none")


def cap_total(y, total: int, rule: str = "items") -> np.ndarray:
    """A cumulative prevalence with at most ``total`` events (sum_r y_r <= total), from y.

    sum_r phi_{>=r} is the number of events, so with total = n (public under replace-one
    neighbours) the released histogram never holds more events than the stream had. Noise shows
    up as surplus mass when most counters are empty (n << D); under the l1 objective the cut is
    degenerate there (every unit removed below the estimate costs exactly 1, so a whole face of
    histograms is l1-optimal under the cap) and the rule is what decides. The two cutting rules
    leave y alone when it already fits, keep it non-increasing, and reach sum = total exactly:

    * ``"items"``: keep the largest items. y_r -> min(y_r, c) caps the number of items at c
      (phi_{>=r} <= phi_{>=1} <= c); clipped to c, an l1 isotonic projection stays an l1
      projection among the histograms with at most c items (tests/test_estimate.py checks it
      against an integer LP). c is the largest cap that fits, and the events left over go to one
      more item of the largest count that fits (y_r = c + 1 for the first r).
    * ``"scale"``: thin every level alike, y_r -> floor(y_r total / sum y) (:func:`thinned`),
      and the units lost to rounding go to the first positions.
    * ``"none"``: y as it is (no cap; for measurements).

    (A third cutting rule, ``"fitted"``, which thins only the items the EM fitted, was measured
    and not adopted: it lives in bench/accuracy/fitted_cap.py.) The default per mode and layer
    count is
    :func:`aggregator.estimators.default_cap` (measured in docs/accuracy_grid.md).

    >>> y = np.array([6, 3, 1])          # the histogram (3, 2, 2, 1, 1, 1): 10 events
    >>> cap_total(y, 7).tolist()         # at most 7: keep the largest items, (3, 2, 2)
    [3, 3, 1]
    >>> cap_total(y, 7, rule="scale").tolist()   # every level thinned: (2, 2, 1, 1, 1)
    [5, 2, 0]
    """
    y = np.asarray(y, dtype=np.int64)
    total = int(total)
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if rule not in CAP_RULES:
        raise ValueError(f"rule must be one of {CAP_RULES}, got {rule!r}")
    if len(y) and (np.any(y[1:] > y[:-1]) or y[-1] < 0):
        raise ValueError("y must be a non-increasing, non-negative cumulative prevalence")
    have = int(y.sum())
    if have <= total or rule == "none":
        return y
    if rule == "items":
        # sum_r min(y_r, c) = c #{y_r >= c} + (the sum of the y_r < c, a suffix of y): O(log R)
        # per trial instead of a pass over y (y is ~1e6 long at D = 1e7)
        suffix = np.concatenate([np.cumsum(y[::-1])[::-1], [0]])
        neg = -y

        def capped_sum(c: int) -> int:
            i = int(np.searchsorted(neg, -c, side="right"))  # #{y_r >= c}
            return c * i + int(suffix[i])

        lo, hi = 0, int(y[0])  # sum min(y, lo) <= total < sum min(y, hi)
        while hi - lo > 1:
            c = (lo + hi) // 2
            if capped_sum(c) <= total:
                lo = c
            else:
                hi = c
        out = np.minimum(y, lo)
    else:
        out = thinned(y, total)
    return with_remainder(out, total)


def with_remainder(out: np.ndarray, total: int) -> np.ndarray:
    """``out`` (a non-increasing cut of y holding at most ``total`` events, short of it by less
    than the number of positions that can take one more unit) with the units left to reach
    ``total`` added at its first positions: it stays non-increasing. In place; returns it."""
    out[: total - int(out.sum())] += 1
    return out


def thinned(y: np.ndarray, total: int) -> np.ndarray:
    """floor(y_r total / sum y), exactly: Python ints when the product could overflow int64.

    >>> thinned(np.array([6, 3, 1]), 7).tolist()
    [4, 2, 0]
    """
    have = int(y.sum())
    if len(y) and int(y[0]) * total < 2**62:
        return (y * total) // have
    return np.array([v * total // have for v in y.tolist()], dtype=np.int64)
