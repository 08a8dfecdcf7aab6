"""Central-model DP anonymized histograms: Manurangsi's DPAnonHist and Suresh's PRIVHIST.

These are the trusted-curator baselines of docs ALGORITHMS.md ("Central-model algorithms"): the
curator holds the exact counts and releases one eps-DP anonymized histogram.

Neighbor relation (both algorithms)
-----------------------------------
Two anonymized histograms are neighbors iff their l1 distance is 1, where the distance is the
l1 distance of the sorted count vectors (seed 003 Lemma 1, Definition 1; seed 004 Section 3.1):
one item's count changes by 1 (including an item appearing with count 1 or disappearing). The
number of events n = sum of counts is *not* public: it changes by one between neighbors, and
both algorithms spend part of the budget on a private estimate of it (seed 004 Appendix B,
seed 003 PRIVHIST step 1). Only :func:`dp_anon_hist` with an explicit ``n=`` treats a bound on
n as public (seed 004 Algorithm 1 takes n as a parameter); the caller vouches for that.

This is the add/remove-style relation of the offline library API (ALGORITHMS.md "Neighbors"), not
the streaming product's replace-one relation: one replaced event moves one unit between two
counts, l1 distance 2, so a replace-one guarantee needs ``epsilon`` halved.

Noise
-----
The papers' "geometric mechanism" G(e^-eps) / Geo(e^-eps) is the two-sided geometric law
P[k] proportional to e^(-eps |k|), i.e. exactly DLap(e^-eps) of :mod:`aggregator.noise`, drawn
exactly from the OS CSPRNG. ``p_from_epsilon(eps, 1)`` rounds p up, so every step is at least as
noisy as the proof asks. PRIVHIST's high-privacy step H4 uses continuous Laplace noise in the
paper; we use the exactly-sampled geometric mechanism on the integer-scaled query instead (see
:func:`_high_privacy`): same sensitivity argument, same eps, no floating-point sampling path.

References
----------
[Man22] P. Manurangsi. Tight Bounds for Differentially Private Anonymized Histograms. SOSA 2022
        (seed 004): Algorithm 1 (eps >= 1, known bound n), Algorithm 2 / Appendix B (unknown n),
        Theorem 6, Lemma 9.
[Sur19] A. T. Suresh. Differentially Private Anonymized Histograms. NeurIPS 2019 (seed 003):
        PRIVHIST, PRIVHIST-LOWPRIVACY, PRIVHIST-HIGHPRIVACY, Theorem 1.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import numpy as np
from scipy.optimize import isotonic_regression

from .histograms import counts_from_cumulative, cumulative_from_counts
from .projection import project_l1
from .noise import discrete_laplace, p_from_epsilon

__all__ = ["dp_anon_hist", "privhist", "privhist_prevalences"]


# ---------------------------------------------------------------------------------------------
# input handling
# ---------------------------------------------------------------------------------------------
def _check_epsilon(epsilon) -> float:
    """A positive finite float, else ValueError."""
    try:
        eps = float(epsilon)
    except (TypeError, ValueError):
        raise ValueError(f"epsilon must be a positive finite number, got {epsilon!r}") from None
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"epsilon must be a positive finite number, got {epsilon!r}")
    return eps


def _as_int_array(values, what: str) -> np.ndarray:
    """1-d int64 array of non-negative integers (integral floats accepted), else ValueError."""
    a = np.asarray(values)
    if a.ndim == 0:
        raise ValueError(f"{what} must be a 1-d sequence of non-negative integers")
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.ndim != 1:
        raise ValueError(f"{what} must be 1-d, got shape {a.shape}")
    if a.dtype.kind == "f":
        if not np.all(np.isfinite(a)) or np.any(a != np.floor(a)):
            raise ValueError(f"{what} must be integers")
    elif a.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {a.dtype}")
    if np.any(a < 0):
        raise ValueError(f"{what} must be non-negative")
    return a.astype(np.int64)


def _as_counts(counts) -> np.ndarray:
    """Counts in decreasing order, zeros dropped (the anonymized histogram)."""
    c = _as_int_array(counts, "counts")
    c = c[c > 0]
    return np.sort(c)[::-1]


def _as_prevalences(prevalences) -> tuple[np.ndarray, np.ndarray]:
    """(r, phi_r) pairs -> sorted distinct r >= 1 with phi_r >= 1 (duplicates of r are summed).

    Accepts a sequence of pairs, a (k, 2) array or a mapping {r: phi_r}. r = 0 and phi_r = 0
    entries carry no item and are dropped.
    """
    if isinstance(prevalences, dict):
        prevalences = list(prevalences.items())
    a = np.asarray(prevalences)
    if a.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z.copy()
    if a.ndim != 2 or a.shape[1] != 2:
        raise ValueError("prevalences must be (r, phi_r) pairs")
    r = _as_int_array(a[:, 0], "prevalence counts r")
    phi = _as_int_array(a[:, 1], "prevalences phi_r")
    keep = (r > 0) & (phi > 0)
    r, phi = r[keep], phi[keep]
    u, inv = np.unique(r, return_inverse=True)
    tot = np.zeros(len(u), dtype=np.int64)
    np.add.at(tot, inv, phi)
    return u, tot


def _prevalences_from_counts(counts) -> tuple[np.ndarray, np.ndarray]:
    c = _as_counts(counts)
    r, phi = np.unique(c, return_counts=True)
    return r.astype(np.int64), phi.astype(np.int64)


@lru_cache(maxsize=256)
def _p(epsilon: float) -> float:
    return p_from_epsilon(epsilon, 1)


def _dlap(epsilon: float, size, rng) -> np.ndarray:
    """DLap(e^-epsilon) = G(e^-epsilon) = Geo(e^-epsilon): the eps-DP geometric mechanism for
    an integer query of l1 sensitivity 1 (p rounded up, so never less noise than asked)."""
    return discrete_laplace(_p(float(epsilon)), size, rng)


def _ceil_sqrt(x: int) -> int:
    """ceil(sqrt(x)) exactly for an integer x >= 0."""
    if x <= 0:
        return 0
    return math.isqrt(x - 1) + 1


# ---------------------------------------------------------------------------------------------
# Manurangsi DPAnonHist
# ---------------------------------------------------------------------------------------------
def _dp_anon_hist_known_n(counts_desc: np.ndarray, epsilon: float, n: int, rng) -> np.ndarray:
    """[Man22] Algorithm 1, DPAnonHist_{eps, n}, for a *public* bound n (any eps > 0 is private).

    Neighbors: anonymized histograms at l1 distance 1; n is a public parameter, not derived from
    the data (footnote 5: the eps-DP guarantee holds even if sum(counts) > n).
    Noise: DLap(e^-eps) on the m = ceil(sqrt(n)) top counts (zeros padded) and on the m
    cumulative prevalences phi_{>=1..m} of the counts ranked m+1, m+2, ...; the map
    p -> (p_high, phi_low) has l1 sensitivity 1 (Theorem 6 proof), so this is eps-DP.
    Projection: each part to its nearest integer partition in l1 (exact integer isotonic
    regression, :func:`project_l1`); see :func:`dp_anon_hist` for why the sum <= n constraint of
    lines 5/6 is dropped. Boundary: none; the split is by rank, the union just merges the parts.
    Error: E l1 <= 2 (m + m) E|DLap(e^-eps)| = 8 m e^-eps / (1 - e^-2eps) = O(sqrt(n)/e^eps)
    when sum(counts) <= n (Theorem 6). Reference: [Man22] Algorithm 1, Theorem 6.
    """
    m = max(_ceil_sqrt(int(n)), 1)
    high = np.zeros(m, dtype=np.int64)
    k = min(m, len(counts_desc))
    high[:k] = counts_desc[:k]
    phi_low = cumulative_from_counts(counts_desc[m:], R=m)  # phi_{>=r}(p_{m+1}, ...), r=1..m
    noise = _dlap(epsilon, 2 * m, rng)
    high_priv = project_l1(high + noise[:m])  # line 5 (over all partitions)
    low_priv = counts_from_cumulative(project_l1(phi_low + noise[m:]))  # line 6
    out = np.concatenate([high_priv[high_priv > 0], low_priv])  # line 7: union
    return np.sort(out)[::-1].astype(np.int64)


def _truncate_to_total(counts_desc: np.ndarray, total: int) -> np.ndarray:
    """argmin over partitions q with sum(q) <= total of ||q - p||_1, for a partition p (exact).

    Any such q costs at least sum(p) - total; cutting p from its smallest counts until the sum is
    ``total`` costs exactly that and stays non-increasing. ([Man22] Algorithm 2, line 6.)
    """
    s = int(counts_desc.sum())
    if s <= total:
        return counts_desc
    cum = np.cumsum(counts_desc)
    keep = int(np.searchsorted(cum, total, side="right"))  # whole counts that fit
    rest = total - (int(cum[keep - 1]) if keep else 0)
    out = counts_desc[:keep]
    if rest > 0:
        out = np.concatenate([out, [rest]])
    return out.astype(np.int64)


def dp_anon_hist(counts, epsilon, rng=None, *, n=None) -> np.ndarray:
    """Manurangsi's DPAnonHist: an eps-DP anonymized histogram for eps >= 1.

    Parameters
    ----------
    counts
        The exact counts (any order; zeros ignored), non-negative integers.
    epsilon
        Privacy parameter, ``epsilon >= 1`` (the paper's low-privacy regime; for eps < 1 use
        :func:`privhist`, whose high-privacy path has the optimal-up-to-sqrt(log) error there).
    rng
        Test-only randomness source (an object with ``bytes(n)``, e.g. a seeded
        ``numpy.random.Generator``) handed to :func:`aggregator.noise.discrete_laplace`.
        ``None`` (production) reads the OS CSPRNG.
    n
        Optional *public* upper bound on sum(counts). Given: [Man22] Algorithm 1 with this n,
        all of ``epsilon`` on the histogram. ``None`` (default): n is private and estimated
        first ([Man22] Algorithm 2 / Appendix B).

    Neighbor relation and privacy
    -----------------------------
    eps-DP for anonymized histograms at l1 distance 1 (one item's count changes by 1); n is not
    public unless passed as ``n=``. Algorithm 1 splits by *rank* at m = ceil(sqrt(n)), so n must
    be public there: splitting at ceil(sqrt(sum(counts))) would not be DP (for n = 4 vs 5 the
    two supports differ: with m = 2 at most two released counts can exceed 2). Without ``n``:

    1. n_hat = n + DLap(e^-eps_n), n' = 2 max(1, n_hat)   (eps_n-DP; n has sensitivity 1)
    2. p* = Algorithm 1 with budget eps - eps_n and the bound n'
    3. return the l1-nearest partition of size <= n' to p*   (post-processing)

    with eps_n = 1 for eps >= 2, exactly Algorithm 2. For 1 <= eps < 2 the paper's Appendix B
    defers to [Sur19]; we instead split eps_n = eps/2 (our choice): Lemma 9's argument is
    unchanged (Algorithm 1 is private for every eps > 0; the n-estimate tail is still
    exp(-Omega(n))), and the error stays O(sqrt(n)) = O(sqrt(n)/e^eps) on [1, 2).

    Noise: DLap(e^-eps') = Geo(e^-eps') (exact, :mod:`aggregator.noise`) on the m top counts and
    on phi_{>=1..m} of the rest (Algorithm 1 lines 3-4), plus one DLap(e^-eps_n) for n.

    Projections (lines 5-6): each noisy part goes to its l1-nearest integer partition with
    :func:`aggregator.projection.project_l1` (exact integer l1 isotonic regression: the high part
    as a count vector, the low part through its cumulative prevalences, which keeps every low
    count <= m). The paper projects onto partitions of size <= n; we drop that constraint: the
    projection is post-processing (privacy unaffected), and Theorem 6's utility argument only
    needs the true part to lie in the set projected onto (it does), giving the same
    ||proj - true|| <= 2 ||noisy - true||. The sum constraint of Algorithm 2's last line is
    applied exactly (cheap; see :func:`_truncate_to_total`).

    Error
    -----
    E l1 = O(sqrt(n)/e^eps) ([Man22] Theorem 6 with n given and sum(counts) <= n;
    Lemma 9 adds exp(-Omega(n)) when n is estimated). Explicitly, with n given:
    E l1 <= 8 m e^-eps / (1 - e^-2eps), m = ceil(sqrt(n)). Matching lower bound
    Omega(sqrt(n)/e^eps) ([Man22] Lemma 10, [Sur19] Theorem 2).

    Returns
    -------
    int64 array of counts in decreasing order, zeros dropped.

    References
    ----------
    [Man22] Manurangsi, Tight Bounds for DP Anonymized Histograms, Algorithms 1-2, Theorem 6,
    Lemma 9 (seed 004). [Sur19] Suresh, DP Anonymized Histograms, NeurIPS 2019 (seed 003).

    Examples
    --------
    >>> out = dp_anon_hist([50, 20, 20, 5, 1, 1], epsilon=3.0)
    >>> out.dtype == np.int64 and bool(np.all(np.diff(out) <= 0)) and bool(np.all(out > 0))
    True
    """
    eps = _check_epsilon(epsilon)
    if eps < 1:
        raise ValueError(
            f"dp_anon_hist needs epsilon >= 1 (Manurangsi's low-privacy regime), got {eps}; "
            "use privhist() for epsilon < 1"
        )
    c = _as_counts(counts)
    if n is not None:
        if isinstance(n, bool) or int(n) != n or int(n) < 1:
            raise ValueError(
                f"n must be a positive integer (a public bound on sum(counts)), got {n!r}"
            )
        return _dp_anon_hist_known_n(c, eps, int(n), rng)
    eps_n = 1.0 if eps >= 2 else eps / 2
    eps_h = eps - eps_n
    if eps_n + eps_h > eps:  # float rounding must never add budget
        eps_h = math.nextafter(eps_h, 0.0)
    total = int(c.sum())
    n_hat = total + int(_dlap(eps_n, 1, rng)[0])
    n_prime = 2 * max(1, n_hat)
    p_star = _dp_anon_hist_known_n(c, eps_h, n_prime, rng)
    return _truncate_to_total(p_star, n_prime)


# ---------------------------------------------------------------------------------------------
# Suresh PRIVHIST
# ---------------------------------------------------------------------------------------------
class _PrivHistOut(NamedTuple):
    """Internal result: released prevalences (r ascending, phi_r >= 1), N, and which path ran."""

    r: np.ndarray
    phi: np.ndarray
    N: int
    regime: str  # "low" (eps > 1, PRIVHIST-LOWPRIVACY), "high" (eps <= 1), or "empty" (N = 0)
    T: int
    M: int


def _regime(epsilon: float) -> str:
    """Which PRIVHIST sub-routine runs: ``"low"`` for eps > 1 (step 5), ``"high"`` for eps <= 1
    (step 6). Decided by the total epsilon, as in the paper."""
    return "low" if epsilon > 1 else "high"


def _round_half_up(x: np.ndarray) -> np.ndarray:
    """The paper's round(.): nearest integer, halves up (monotone, so order is preserved)."""
    return np.floor(x + 0.5).astype(np.int64)


def _merge(r: np.ndarray, phi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum prevalences of equal r; drop empty ones."""
    u, inv = np.unique(r, return_inverse=True)
    tot = np.zeros(len(u), dtype=np.int64)
    np.add.at(tot, inv, phi)
    keep = tot > 0
    return u[keep], tot[keep]


def _remove_closest(r, phi, target: int, k: int, prefer_above: bool):
    """Remove k items whose counts are closest to ``target`` (PRIVHIST-LOWPRIVACY step L4).

    Equal distances (target - d vs target + d) are an ambiguity of the paper; we take the side
    away from the other fake count first: above T+1 when removing the fakes of T+1, below T
    when removing those of T.
    """
    side = (r < target) if prefer_above else (r > target)
    order = np.lexsort((side, np.abs(r - target)))
    phi = phi.copy()
    taken = np.minimum(phi[order], np.maximum(k - (np.cumsum(phi[order]) - phi[order]), 0))
    phi[order] -= taken
    keep = phi > 0
    return r[keep], phi[keep]


def _low_privacy(phi_cs: np.ndarray, n_cl: np.ndarray, T: int, M: int):
    """PRIVHIST-LOWPRIVACY(H^cs, H^cl, T, M) of [Sur19] (eps > 1). Returns prevalences.

    L1 (a) phi^mon = argmin sum_r (phi^mon_{r+} - phi^cs_{r+})^2 s.t. non-increasing: the l2
       isotonic (antitonic) regression, solved by PAVA (``scipy.optimize.isotonic_regression``,
       the algorithm the paper cites). This is *not* the l1 projection :func:`project_l1`, so we
       keep the paper's l2 step.
       (b) phi^ds_{r+} = round(max(phi^mon_{r+}, 0)): non-increasing integers, counts <= T.
    L2 H^dl = {max(N_i, T)}: the noisy large counts floored at T.
    L3 H^d = H^ds + H^dl (multiset union).
    L4 remove the M items closest to T+1, then the M closest to T (the fake counts of step 2).
    Privacy: post-processing of H^cs, H^cl. Error: see :func:`privhist`.
    """
    mon = isotonic_regression(phi_cs.astype(np.float64), increasing=False).x
    cum = _round_half_up(np.maximum(mon, 0.0))
    phi_ds = cum - np.concatenate([cum[1:], [0]])  # prevalences at r = 1..T
    r_ds = np.arange(1, T + 1, dtype=np.int64)
    r_dl, phi_dl = np.unique(np.maximum(n_cl, T), return_counts=True)
    r, phi = _merge(
        np.concatenate([r_ds, r_dl.astype(np.int64)]),
        np.concatenate([phi_ds, phi_dl.astype(np.int64)]),
    )
    r, phi = _remove_closest(r, phi, T + 1, M, prefer_above=True)
    r, phi = _remove_closest(r, phi, T, M, prefer_above=False)
    return r, phi


def _boundaries(T: int, N: int, eps3: float, n_cl: np.ndarray) -> np.ndarray:
    """PRIVHIST-HIGHPRIVACY step H2: the smoothing boundaries S (sorted, distinct, >= 1).

    T' = ceil(10 sqrt(N) / eps3), q = sqrt(log(1/eps3) / (N eps3)),
    S = {1..T} u {floor(T (1+q)^i) : 0 <= i <= log_{1+q}(T'/T)} u {N_x in H^cl : N_x >= T'} u {2N}.
    (The printed T' is garbled in our copy; we read 10 sqrt(N)/eps3, which matches [Man22]'s
    summary of this algorithm, "V within [sqrt(n)/eps]". Any T' = poly(sqrt N / eps) gives the
    same error order: it only moves the point where the geometric grid hands over to the noisy
    counts.)
    """
    t_prime = math.ceil(10.0 * math.sqrt(N) / eps3)
    q = math.sqrt(math.log(1.0 / eps3) / (N * eps3))
    parts = [np.arange(1, T + 1, dtype=np.int64)]
    if t_prime > T:
        lq = math.log1p(q)
        i_max = math.floor(math.log(t_prime / T) / lq) if lq > 0 else math.inf
        if i_max <= t_prime - T:
            i = np.arange(i_max + 1, dtype=np.float64)
            parts.append(np.floor(T * np.exp(i * lq)).astype(np.int64))
        else:  # q tiny (eps3 near 1 via ``budget``): same set, found per integer k in [T, T']
            k = np.arange(T, t_prime + 1, dtype=np.float64)
            lo = np.ceil(np.log(k / T) / lq) if lq > 0 else np.zeros_like(k)
            hit = (lq == 0) | (lo * lq < np.log((k + 1) / T))
            parts.append(k[hit & (lo <= i_max)].astype(np.int64))
    parts.append(n_cl[n_cl >= t_prime].astype(np.int64))
    parts.append(np.array([2 * N], dtype=np.int64))
    return np.unique(np.concatenate(parts))


def _smoothed_scaled_cumulative(r: np.ndarray, phi: np.ndarray, s: np.ndarray):
    """H3 of PRIVHIST-HIGHPRIVACY, scaled to integers: (g, Y) with g_i = s_i - s_{i-1}
    (s_0 = 0) and Y_i = g_i phi^v_{s_i+}, where phi^v is the linear smoothing of the prevalences
    (r, phi) onto the boundaries s (every r must lie in [1, s[-1]], and s[0] = 1):

        Y_i = g_i #{items with count >= s_i} + sum over items with s_{i-1} < count < s_i of
              (count - s_{i-1}).
    """
    g = np.diff(np.concatenate([[0], s]))
    idx = np.searchsorted(s, r, side="left")  # s[idx] >= r
    on_boundary = s[idx] == r
    ge = np.concatenate([np.cumsum(phi[::-1])[::-1], [0]])  # #{items with count >= r[k]}
    first = np.searchsorted(r, s, side="left")  # items with count >= s_i start here
    partial = np.zeros(len(s), dtype=np.int64)
    inner = ~on_boundary
    np.add.at(partial, idx[inner], (r[inner] - s[idx[inner] - 1]) * phi[inner])
    return g, g * ge[first] + partial


def _high_privacy(
    r: np.ndarray, phi: np.ndarray, n_cl: np.ndarray, T: int, N: int, eps3: float, rng
):
    """PRIVHIST-HIGHPRIVACY(h, H^cl, T, N, eps3) of [Sur19] (eps <= 1). Returns prevalences.

    H1 counts >= 2N are moved to 2N (phi^u).
    H2 boundaries S = s_1 < s_2 < ... (:func:`_boundaries`), s_0 = 0, gaps g_i = s_i - s_{i-1}.
    H3 smoothing: an item with count j, s_{i-1} < j < s_i, is split linearly: a fraction
       (j - s_{i-1})/g_i to s_i and the rest to s_{i-1}; items on a boundary stay.
    H4 noise on the smoothed cumulative prevalences phi^v_{s_i+}. A count change j -> j+1
       (within [s_{i-1}, s_i]) moves exactly 1/g_i of an item across s_i and changes no other
       phi^v_{s_k+}, so Y_i = g_i phi^v_{s_i+} has l1 sensitivity 1, and Y_i is an *integer*:
       Y_i = g_i #{j >= s_i} + sum_{s_{i-1} < j < s_i} (j - s_{i-1}).
       The paper adds continuous Laplace L(1/(eps3 g_i)) to phi^v_{s_i+}, i.e. L(1/eps3) to Y_i.
       We add DLap(e^-eps3) to Y_i instead (the geometric mechanism, exact and integer): the
       same eps3-DP argument (sensitivity-1 integer query), and E|Z| = 2p/(1-p^2) <= 1/eps3, so
       every noise moment is at most the paper's and the utility analysis carries over.
       phi^w_{s_i+} = (Y_i + Z_i) / g_i.
    H5 phi^x = argmin sum_i (phi^x_{s_i+} - phi^w_{s_i+})^2 g_i^2 s.t. non-increasing: weighted
       l2 isotonic regression, PAVA with weights g_i^2 (scipy), exactly the printed objective.
    H6 phi^y_{r+} = round(max(phi^x_{r+}, 0)); phi^x_{r+} = phi^x_{s_i+} for s_{i-1} < r <= s_i
       (H^x lives on S), so the release has counts in S only.
    Work: O(|S| + #distinct counts), sub-linear in n.
    """
    # H1
    r = np.minimum(r, 2 * N)
    r, phi = _merge(r, phi)
    # H2
    s = _boundaries(T, N, eps3, n_cl)
    # H3
    g, Y = _smoothed_scaled_cumulative(r, phi, s)
    # H4
    w = (Y + _dlap(eps3, len(s), rng)) / g
    # H5
    x = isotonic_regression(w, weights=g.astype(np.float64) ** 2, increasing=False).x
    # H6
    cum = _round_half_up(np.maximum(x, 0.0))
    prev = cum - np.concatenate([cum[1:], [0]])
    keep = prev > 0
    return s[keep], prev[keep]


def _privhist(
    r: np.ndarray, phi: np.ndarray, epsilon: float, rng=None, budget=None
) -> _PrivHistOut:
    """PRIVHIST of [Sur19] on prevalences (r ascending, phi_r >= 1). See :func:`privhist`.

    Randomness is consumed in a fixed order (Z^a; Z^b; Z^cs if eps > 1; Z^cl; H4 noise if
    eps <= 1), so equal prevalences and an equal seeded ``rng`` give equal releases.
    """
    eps = _check_epsilon(epsilon)
    regime = _regime(eps)
    if budget is None:
        eps1 = eps2 = eps3 = eps / 3.0  # the pseudo-code's choice
    else:
        eps1, eps2, eps3 = (float(b) for b in budget)
        if not (eps1 > 0 and eps2 > 0 and eps3 >= 0 and all(map(math.isfinite, budget))):
            raise ValueError(f"budget must be (eps1 > 0, eps2 > 0, eps3 >= 0), got {budget!r}")
        if regime == "high" and eps3 <= 0:
            raise ValueError("the high-privacy path (eps <= 1) needs eps3 > 0")
        used = eps1 + eps2 + (eps3 if regime == "high" else 0.0)
        if used > eps * (1 + 1e-12):
            raise ValueError(f"budget {budget!r} spends {used} > epsilon = {eps}")
    # 1. N = max(n + Z^a, 0), Z^a ~ G(e^-eps1)
    n = int(sum(int(a) * int(b) for a, b in zip(r, phi)))
    N = max(n + int(_dlap(eps1, 1, rng)[0]), 0)
    empty = np.zeros(0, dtype=np.int64)
    if N == 0:
        return _PrivHistOut(empty, empty.copy(), 0, "empty", 0, 0)
    # 2. T = ceil(sqrt(N min(eps, 1))), M = ceil(max(2 log(N e^eps2) / eps2, 1))
    T = _ceil_sqrt(N) if eps >= 1 else max(1, math.ceil(math.sqrt(N * eps)))
    M = math.ceil(max(2.0 * (math.log(N) + eps2) / eps2, 1.0))
    # (a) M fake items at T and at T+1; (b) move Z^b ~ G(e^-eps2) items from T to T+1
    z_b = int(_dlap(eps2, 1, rng)[0])
    below = r < T
    phi_T = int(phi[r == T].sum()) + M - z_b  # phi^b_T (may be negative)
    phi_T1 = int(phi[r == T + 1].sum()) + M + z_b  # phi^b_{T+1} (may be negative)
    # (c) split: H^bs (counts <= T) via phi^bs_{r+} = max(0, sum_{s=r}^T phi^b_s), r = 1..T;
    # H^bl (counts >= T+1) via cumulative-from-below max(0, sum_{s=T+1}^r phi^b_s): a negative
    # phi^b_T / phi^b_{T+1} is absorbed by the nearest real counts on its own side.
    if regime == "low":
        base = np.zeros(T + 2, dtype=np.int64)
        np.add.at(base, r[below], phi[below])
        base[T] = phi_T
        phi_bs = np.maximum(np.cumsum(base[1 : T + 1][::-1])[::-1], 0)  # r = 1..T
    above = r > T + 1
    r_l = np.concatenate([[T + 1], r[above]])
    phi_l = np.concatenate([[phi_T1], phi[above]]).astype(np.int64)
    cum_l = np.maximum(np.cumsum(phi_l), 0)
    phi_l = np.diff(np.concatenate([[0], cum_l]))
    bl_counts = np.repeat(r_l, phi_l)  # O(n / T) items: sub-linear
    # 3. H^cs: phi^cs_{r+} = phi^bs_{r+} + Z^cs_r, r = 1..T (only the low path uses it)
    if regime == "low":
        phi_cs = phi_bs + _dlap(eps2, T, rng)
    # 4. H^cl: N^cl_i = N^bl_(i) + Z^cl_i
    n_cl = bl_counts[::-1] + _dlap(eps2, len(bl_counts), rng)
    # 5. / 6.
    if regime == "low":
        out_r, out_phi = _low_privacy(phi_cs, n_cl, T, M)
    else:
        out_r, out_phi = _high_privacy(r, phi, n_cl, T, N, eps3, rng)
    return _PrivHistOut(out_r.astype(np.int64), out_phi.astype(np.int64), N, regime, T, M)


def _privhist_input(counts, prevalences):
    if (counts is None) == (prevalences is None):
        raise ValueError("pass exactly one of counts= or prevalences=")
    if counts is not None:
        return _prevalences_from_counts(counts)
    return _as_prevalences(prevalences)


def privhist_prevalences(counts=None, epsilon=None, *, prevalences=None, rng=None, budget=None):
    """Suresh's PRIVHIST, released in prevalence form: ``(r, phi_r, N)``.

    Same mechanism, parameters and guarantees as :func:`privhist` (see there); returns the
    distinct released counts ``r`` (decreasing int64), their multiplicities ``phi_r`` (int64,
    >= 1) and PRIVHIST's private estimate ``N`` of n. With ``prevalences=`` input the whole
    computation, output included, takes time sub-linear in n: O~(sqrt(n)) for eps > 1 and
    O~(sqrt(n/eps) + 1/eps) for eps <= 1 ([Sur19] Theorem 1), never expanding to n counts.

    Neighbors: anonymized histograms at l1 distance 1; n not public. Noise: G(e^-eps_i) =
    DLap(e^-eps_i). Error: as :func:`privhist`. Reference: [Sur19] PRIVHIST.

    >>> r, phi, N = privhist_prevalences(prevalences=[(1, 10**8), (5, 10**6)], epsilon=2.0)
    >>> bool(np.all(np.diff(r) < 0) and np.all(phi > 0)) and isinstance(N, int)
    True
    """
    if epsilon is None:
        raise ValueError("epsilon is required")
    r, phi = _privhist_input(counts, prevalences)
    out = _privhist(r, phi, epsilon, rng, budget)
    return out.r[::-1].copy(), out.phi[::-1].copy(), out.N


def privhist(counts=None, epsilon=None, *, prevalences=None, rng=None, budget=None) -> np.ndarray:
    """Suresh's PRIVHIST: an eps-DP anonymized histogram for every eps > 0.

    Parameters
    ----------
    counts
        The exact counts (any order; zeros ignored). Give this *or* ``prevalences``.
    epsilon
        Privacy parameter, > 0. eps > 1 runs PRIVHIST-LOWPRIVACY, eps <= 1 runs
        PRIVHIST-HIGHPRIVACY (:func:`_regime`).
    prevalences
        The histogram as (r, phi_r) pairs (phi_r items have count r), a (k, 2) array or a dict.
        Time is then sub-linear in n, except for expanding the *output* into counts; use
        :func:`privhist_prevalences` for a fully sub-linear release.
    rng
        Test-only randomness source with ``bytes(n)`` (e.g. a seeded ``numpy.random.Generator``)
        for :func:`aggregator.noise.discrete_laplace`; ``None`` reads the OS CSPRNG.
    budget
        Optional (eps1, eps2, eps3): for N, for steps 2-4 and for HIGHPRIVACY's H4. Default
        eps/3 each, the pseudo-code's choice (LOWPRIVACY then spends only 2 eps/3; the paper
        notes eps1 = o(eps), eps2 = eps(1 - o(1)), eps3 = 0 is allowed there). Must sum to at
        most epsilon (eps3 is not spent when eps > 1).

    Neighbor relation and privacy
    -----------------------------
    eps-DP for anonymized histograms at l1 distance 1 ([Sur19] Definition 1: one item's count
    changes by 1); n is not public: N = max(n + G(e^-eps1), 0) is released privately.

    The mechanism ([Sur19] PRIVHIST, steps as printed):

    1. N = max(n + Z^a, 0), Z^a ~ G(e^-eps1); N = 0 releases the empty histogram.
    2. T = ceil(sqrt(N min(eps, 1))), M = ceil(max(2 log(N e^eps2)/eps2, 1)). Add M fake items
       at T and at T+1, move Z^b ~ G(e^-eps2) items from T to T+1 (this makes the split at T
       private: a count moving T <-> T+1 is absorbed by Z^b), and split into H^bs (counts <= T)
       and H^bl (counts > T), a negative phi^b_T or phi^b_{T+1} being absorbed by the nearest
       counts on its side (the max(0, cumulative) of step 2c).
    3. H^cs: phi^bs_{r+} + G(e^-eps2), r = 1..T.       4. H^cl: each count of H^bl + G(e^-eps2).
    5. eps > 1: LOWPRIVACY (:func:`_low_privacy`): PAVA on H^cs, round, floor H^cl at T, union,
       remove the 2M fake items (M closest to T+1, then M closest to T).
    6. eps <= 1: HIGHPRIVACY (:func:`_high_privacy`): boundaries S = {1..T}, a geometric grid
       of ratio 1+q up to T', the noisy counts >= T' and 2N; linear smoothing of the true
       prevalences onto S; noise of scale 1/(eps3 (s_i - s_{i-1})) on the smoothed cumulative
       prevalences; weighted PAVA; round.

    Noise: G(e^-eps_i) = DLap(e^-eps_i), exact (:mod:`aggregator.noise`). The paper's continuous
    Laplace in H4 is replaced by the geometric mechanism on the integer-scaled query (same
    eps3-DP proof, no more noise); see :func:`_high_privacy`.

    Error ([Sur19] Theorem 1)
    -------------------------
    eps > 1: E l1 = O(sqrt(n) e^(-c eps)) for a constant c > 0 (plus lower-order terms) and
    E|N - n| <= e^(-c eps). Omega(1/n) <= eps <= 1: E l1 = O(sqrt(n log(2/eps) / eps)) and
    E|N - n| = O(1/eps). Lower bounds: Omega(sqrt(n)/e^eps) for eps >= 1 ([Man22] Lemma 10)
    and Omega(sqrt(n log(1/eps)/eps)) for eps < 1 ([Man22] Theorem 7).

    Ambiguities of the printed pseudo-code and our reading: T' = ceil(10 sqrt(N)/eps3) (garbled
    in our copy); step 2c's max(0, .) read as cumulative clipping (both readings coincide since
    only phi^b_T, phi^b_{T+1} can be negative); round = half up; L4's ties at equal distance
    from T+1 (resp. T) are broken toward T+2 (resp. T-1); H5's weight (s_i - s_{i-1})^2.

    Returns
    -------
    int64 array of counts in decreasing order, zeros dropped.

    References
    ----------
    [Sur19] A. T. Suresh, Differentially Private Anonymized Histograms, NeurIPS 2019: PRIVHIST,
    PRIVHIST-LOWPRIVACY, PRIVHIST-HIGHPRIVACY, Theorem 1 (seed 003). [Man22] Manurangsi, Tight
    Bounds for DP Anonymized Histograms (seed 004).

    Examples
    --------
    >>> out = privhist([50, 20, 20, 5, 1, 1], epsilon=0.5)
    >>> out.dtype == np.int64 and bool(np.all(np.diff(out) <= 0)) and bool(np.all(out > 0))
    True
    >>> out = privhist(prevalences=[(1, 1000), (2, 300), (40, 3)], epsilon=2.0)
    >>> out.dtype == np.int64 and bool(np.all(np.diff(out) <= 0))
    True
    """
    if epsilon is None:
        raise ValueError("epsilon is required")
    r, phi = _privhist_input(counts, prevalences)
    out = _privhist(r, phi, epsilon, rng, budget)
    return np.repeat(out.r[::-1], out.phi[::-1]).astype(np.int64)
