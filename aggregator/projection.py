"""Projections: from an estimate phi_hat_{>=r} to a valid cumulative prevalence.

A cumulative prevalence is an integer y_1 >= y_2 >= ... >= 0. The estimators give real, possibly
non-monotone phi_hat; the l1 distance between anonymized histograms equals the l1 distance
between their cumulative prevalences (seed 001 Observation 6), so the release is

* l1 (Algorithms 1 and 5, :func:`project_l1`): argmin_y sum_r |y_r - phi_hat_r| over integer
  non-increasing y >= 0, solved exactly by the slope trick on runs of equal phi_hat
  (O(K log K) for K runs);
* l2 (Algorithm 3, :func:`project_l2`): the same objective with sum_r y_r = n and the rank box
  L_r <= y_r <= U_r of :func:`rank_box` (|n_hat_(j) - h'_(j)| <= gamma), solved exactly as a
  small mixed-integer program (HiGHS) on the runs.

>>> project_l1([5.2, 3.9, 4.1, 1.1]).tolist()
[5, 4, 4, 1]
>>> project_l2([5.2, 3.9, 4.1, 1.1], 13, [0, 0, 0, 0], [9, 9, 9, 9]).tolist()  # sum = 13
[4, 4, 4, 1]

References: seed 001 Algorithms 1, 3 and 5, Observation 6; the slope trick for isotonic l1
regression (e.g. Rote 2019, "Isotonic regression by dynamic programming"); HiGHS via
scipy.optimize.milp.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from .counters import NoisyValueCounts

__all__ = ["project_l1", "project_l2", "rank_box"]


def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Compress a 1-d array into (run values, run lengths)."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return values, np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], np.flatnonzero(values[1:] != values[:-1]) + 1])
    lengths = np.diff(np.concatenate([starts, [len(values)]]))
    return values[starts], lengths


def project_l1(phi_hat) -> np.ndarray:
    """Integer y_1 >= y_2 >= ... >= 0 minimizing sum_r |y_r - phi_hat_r| (exact).

    Slope trick: process r from R down to 1 (so y must be non-decreasing), keeping the
    breakpoints of the convex cost-to-go as a max-heap of (position, mass). Each point adds the
    integer-restricted cost w|y - a| (breakpoints at floor(a), floor(a) + 1), and the prefix
    minimum that enforces monotonicity removes the top w of mass. A run of equal values acts as
    one point of weight w: an optimal solution is constant on it.

    >>> project_l1([5.2, 3.9, 4.1, 1.1]).tolist()
    [5, 4, 4, 1]
    """
    a_vals, lengths = _runs(phi_hat)
    K = len(a_vals)
    if K == 0:
        return np.zeros(0, dtype=np.int64)
    heap: list[tuple[float, float]] = [(-0.0, math.inf)]  # y >= 0: a wall of infinite mass at 0
    opt = np.empty(K, dtype=np.int64)
    push, pop = heapq.heappush, heapq.heappop
    for i in range(K - 1, -1, -1):
        a, w = float(a_vals[i]), float(lengths[i])
        fl = math.floor(a)
        phi = a - fl
        if phi == 0.0:
            push(heap, (-fl, 2.0 * w))
        else:
            push(heap, (-fl, w * (2.0 - 2.0 * phi)))
            push(heap, (-(fl + 1), w * 2.0 * phi))
        remove = w
        while remove > 0.0:
            pos, mass = pop(heap)
            if mass > remove:
                push(heap, (pos, mass - remove))
                remove = 0.0
            else:
                remove -= mass
        opt[i] = int(-heap[0][0])
    # back out the solution: y_i = min(y_{i+1 in processing order}, opt_i)
    y_runs = np.minimum.accumulate(opt)  # runs in r order; processing went from the end
    return np.repeat(y_runs, lengths).astype(np.int64, copy=False)


def _run_boundaries(*arrays: np.ndarray) -> np.ndarray:
    """Start indices of maximal runs where every given array is constant."""
    n = len(arrays[0])
    change = np.zeros(n, dtype=bool)
    change[0] = True
    for arr in arrays:
        change[1:] |= arr[1:] != arr[:-1]
    return np.flatnonzero(change)


def project_l2(phi_hat, n: int, lower, upper):
    """Exact integer solution of the l2 variant's projection (seed 001 Algorithm 3).

    minimize sum_r |y_r - phi_hat_r|  s.t.  y non-increasing, lower_r <= y_r <= upper_r,
    sum_r y_r = n, y integer. Returns None when infeasible.

    On a run where phi_hat, lower and upper are constant an optimal y takes at most two adjacent
    values (balancing a convex cost at a fixed sum never hurts), so each run becomes an integer
    level c_i and an integer run sum S_i in [len c_i, len c_i + len - 1]; consecutive runs
    need S_{i+1} <= len_{i+1} c_i; the run's cost is len * (|x - a| interpolated at integers)
    at x = S / len, a max of three lines. That small MILP goes to HiGHS.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp  # noqa: PLC0415 (imported on first use: the CLI starts without it)
    from scipy.sparse import lil_matrix  # noqa: PLC0415 (imported on first use: the CLI starts without it)

    a = np.asarray(phi_hat, dtype=np.float64)
    lower = np.asarray(lower, dtype=np.float64)
    upper = np.asarray(upper, dtype=np.float64)
    R = len(a)
    if R == 0:
        return np.zeros(0, dtype=np.int64) if n == 0 else None
    if np.any(lower > upper) or lower.sum() > n or upper.sum() < n:
        return None
    starts = _run_boundaries(a, lower, upper)
    lens = np.diff(np.concatenate([starts, [R]])).astype(np.float64)
    av, lv, uv = a[starts], lower[starts], upper[starts]
    K = len(starts)
    # variables: c (K), S (K), t (K)
    nv = 3 * K
    ic, iS, it = 0, K, 2 * K
    cost = np.zeros(nv)
    cost[it:] = 1.0
    rows = 6 * K + 1
    A = lil_matrix((rows, nv))
    lb = np.full(rows, -np.inf)
    ub = np.full(rows, np.inf)
    row = 0
    for i in range(K):
        L = lens[i]
        # L c_i <= S_i <= L c_i + L - 1
        A[row, iS + i] = 1
        A[row, ic + i] = -L
        lb[row] = 0
        ub[row] = L - 1
        row += 1  # noqa: E702
        # monotone: S_{i+1} <= len_{i+1} c_i
        if i + 1 < K:
            A[row, iS + i + 1] = 1
            A[row, ic + i] = -lens[i + 1]
            ub[row] = 0
            row += 1  # noqa: E702
        # max value <= upper: S_i <= L u_i
        A[row, iS + i] = 1
        ub[row] = L * uv[i]
        row += 1  # noqa: E702
        # t_i >= L a - S_i ; t_i >= S_i - L a ; t_i >= middle line
        fl = math.floor(av[i])
        A[row, it + i] = 1
        A[row, iS + i] = 1
        lb[row] = L * av[i]
        row += 1  # noqa: E702
        A[row, it + i] = 1
        A[row, iS + i] = -1
        lb[row] = -L * av[i]
        row += 1  # noqa: E702
        f0, f1 = abs(fl - av[i]), abs(fl + 1 - av[i])
        # t >= L f0 + (S - L fl)(f1 - f0)
        A[row, it + i] = 1
        A[row, iS + i] = -(f1 - f0)  # noqa: E702
        lb[row] = L * f0 - L * fl * (f1 - f0)
        row += 1  # noqa: E702
    A[row, iS : iS + K] = 1
    lb[row] = ub[row] = n
    row += 1
    A = A[:row].tocsr()
    bounds = Bounds(
        np.concatenate([lv, np.full(K, -np.inf), np.zeros(K)]),
        np.concatenate([uv, np.full(K, np.inf), np.full(K, np.inf)]),
    )
    integrality = np.concatenate([np.ones(2 * K), np.zeros(K)])
    constraints = LinearConstraint(A, lb[:row], ub[:row])
    res = milp(
        cost,
        constraints=constraints,
        bounds=bounds,
        integrality=integrality,
        options={"disp": False},
    )
    if res.status != 0 or res.x is None:
        return None
    # Tie-break among the l1-optimal solutions: the sum constraint can force mass that costs the
    # same anywhere, and an arbitrary optimum may pile it into a few huge top counts (a large l2
    # error). Second stage: keep the l1 cost optimal, prefer deviations at small r (spread over
    # many items) by weighting each run's cost with its position.
    opt = float(res.fun)
    mid_r = starts + lens / 2.0
    cost2 = np.zeros(nv)
    cost2[it:] = mid_r / R
    keep_opt = LinearConstraint(cost[None, :], -np.inf, opt + 1e-7 * max(1.0, opt))
    res2 = milp(
        cost2,
        constraints=[constraints, keep_opt],
        bounds=bounds,
        integrality=integrality,
        options={"disp": False},
    )
    if res2.status == 0 and res2.x is not None:
        res = res2
    c = np.round(res.x[ic : ic + K]).astype(np.int64)
    S = np.round(res.x[iS : iS + K]).astype(np.int64)
    out = np.empty(R, dtype=np.int64)
    for i in range(K):
        L = int(lens[i])
        k_up = int(S[i] - L * c[i])
        s = starts[i]
        out[s : s + k_up] = c[i] + 1
        out[s + k_up : s + L] = c[i]
    return out


def rank_box(vc: NoisyValueCounts, gamma: float, R: int) -> tuple[np.ndarray, np.ndarray]:
    """L_r = #{j : h'_(j) - gamma >= r}, U_r = #{j : h'_(j) + gamma >= r} for r = 1..R."""
    above = np.concatenate([np.cumsum(vc.c[::-1])[::-1], [0]])  # #{v >= lo + i}

    def count_ge(t):  # #{j : h'_j >= t} for real thresholds t (vectorized)
        i = np.ceil(t).astype(np.int64) - vc.lo
        return np.where(i <= 0, vc.total, above[np.clip(i, 0, len(above) - 1)])

    r = np.arange(1, R + 1, dtype=np.float64)
    return count_ge(r + gamma), count_ge(r - gamma)
