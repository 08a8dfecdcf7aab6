"""Anonymized histograms and their cumulative prevalences: conversions and distances.

An anonymized histogram is the multiset of counts {h_j > 0} without the items' names, written
in decreasing order. Its prevalences are phi_r = #{j : h_j = r} and its cumulative prevalence is

    phi_{>=r} = sum_{s >= r} phi_s,   r = 1, 2, ...,

a non-increasing integer sequence; sum_r phi_{>=r} = sum_j h_j is the number of events. The l1
distance of two anonymized histograms (rank by rank, zero-padded) equals the l1 distance of their
cumulative prevalences (seed 001 Observation 6): :func:`l1_distance`, :func:`cumulative_l1`.

>>> cumulative_from_counts([3, 1, 1]).tolist()
[3, 1, 1]
>>> counts_from_cumulative([3, 1, 1]).tolist()
[3, 1, 1]
>>> prevalences_from_cumulative([5, 3, 3, 1]).tolist()
[2, 0, 2, 1]
>>> l1_distance([3, 1], [2, 2, 1]), cumulative_l1([2, 1, 1], [3, 2])
(3, 3.0)

References: seed 001 section 2 (anonymized histograms) and Observation 6.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "prevalences_from_cumulative",
    "cumulative_l1",
    "counts_from_cumulative",
    "cumulative_from_counts",
    "aligned_histograms",
    "l1_distance",
    "checked_cumulative",
]


def prevalences_from_cumulative(y) -> np.ndarray:
    """phi_r = phi_{>=r} - phi_{>=r+1}, r = 1..len(y), from a cumulative prevalence y.

    >>> prevalences_from_cumulative([5, 3, 3, 1]).tolist()
    [2, 0, 2, 1]
    """
    y = np.asarray(y)
    return y - np.concatenate([y[1:], np.zeros(1, y.dtype)])


def cumulative_l1(a, b) -> float:
    """l1 distance of two cumulative prevalences (zero beyond their ends) = the l1 distance of
    their histograms, without padding copies (they are ~1e6 long at D = 1e7).

    >>> cumulative_l1([3, 1], [2, 2, 1])
    3.0
    """
    a, b = np.asarray(a), np.asarray(b)
    m = min(len(a), len(b))
    return float(np.abs(a[:m] - b[:m]).sum() + np.abs(a[m:]).sum() + np.abs(b[m:]).sum())


def counts_from_cumulative(y) -> np.ndarray:
    """Anonymized histogram (decreasing counts, zeros dropped) from phi_{>=1..R}."""
    y = np.asarray(y, dtype=np.int64)
    if len(y) == 0:
        return np.zeros(0, dtype=np.int64)
    if np.any(np.diff(y) > 0) or y[-1] < 0:
        raise ValueError("cumulative prevalence must be non-increasing and >= 0")
    exact = prevalences_from_cumulative(y)
    r = np.arange(1, len(y) + 1, dtype=np.int64)
    return np.repeat(r[::-1], exact[::-1])


def cumulative_from_counts(counts, R=None) -> np.ndarray:
    """phi_{>=r} for r = 1..R from a list of counts (any order; zeros ignored)."""
    h = np.asarray(counts, dtype=np.int64)
    h = h[h > 0]
    top = int(h.max()) if len(h) else 0
    R = top if R is None else int(R)
    phi = np.bincount(h, minlength=max(top, R) + 1)[1:]
    ge = np.cumsum(phi[::-1])[::-1]
    return ge[:R] if R <= len(ge) else np.concatenate([ge, np.zeros(R - len(ge), np.int64)])


def aligned_histograms(counts_a, counts_b) -> tuple[np.ndarray, np.ndarray]:
    """Both histograms sorted decreasing and zero-padded to one length (rank by rank)."""
    a = np.sort(np.asarray(counts_a, dtype=np.int64))[::-1]
    b = np.sort(np.asarray(counts_b, dtype=np.int64))[::-1]
    m = max(len(a), len(b))
    return (
        np.concatenate([a, np.zeros(m - len(a), np.int64)]),
        np.concatenate([b, np.zeros(m - len(b), np.int64)]),
    )


def l1_distance(counts_a, counts_b) -> int:
    """l1 distance between two anonymized histograms (= between cumulative prevalences)."""
    a, b = aligned_histograms(counts_a, counts_b)
    return int(np.abs(a - b).sum())


def checked_cumulative(y) -> np.ndarray:
    """y as int64 with its trailing zeros dropped (a valid phi_{>=r} has them at the end only);
    the check of :func:`counts_from_cumulative`."""
    y = np.asarray(y, dtype=np.int64)
    if len(y) and (np.any(y[1:] > y[:-1]) or y[-1] < 0):
        raise ValueError("cumulative prevalence must be non-increasing and >= 0")
    return y[: int(np.count_nonzero(y))]
