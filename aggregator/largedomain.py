"""Large domains: hashed counters and the inversion of Gamma^B (seed 001 section 4, App. B.2, D.2).

Items from a huge or unknown domain are hashed into B buckets (``PanPrivateHistogram(buckets=B)``);
the counters then hold the *reduced* histogram h^red (bucket totals) plus DLap noise. Colliding
items add up, so the anonymized histogram of the buckets is biased towards fewer, larger counts.
This module undoes that statistically.

Gamma^B(n)_l, the expected number of buckets whose total is >= l when every item picks a bucket
uniformly at random, and its exact inverse are in :mod:`aggregator.occupancy` (re-exported here):
the ``"exact"`` variant inverts an estimated bucket histogram with it and projects the result onto
valid histograms. The paper's Algorithm 7 instead fixes phi_{>=r} greedily for r <= m = ceil(10 log
D / log(1/p)) by binary search (Gamma^B_r is increasing in phi_{>=r} with the lower ones fixed,
Lemma 20; in fact it is affine in it for r >= 2, see :func:`greedy_prefix`) and takes r > m from a
second, unhashed histogram (:func:`two_histogram_estimate`). An unhashed histogram does not exist
for an unbounded domain, so ``"alg7-single"`` takes r > m from the same hashed histogram, where
collisions only shift large counts by about n/B. ``bench/accuracy/largedomain.py`` measures all of
them at equal total epsilon and memory; docs/large_domains.md has the numbers and the reason for the
default.

Privacy: the hash key is drawn before any data and stored with the state, the map is
data-independent, so a hashed state is epsilon-DP exactly like a direct one; everything here is
post-processing of the noisy counters.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .bucket_likelihood import bucket_loglik
from .cap import CAP_RULES, cap_total
from .counters import counters_key, noisy_value_counts
from .deconvolution import MLE_MAX_ITER, MLE_TOL, deconvolved_prevalence
from .em import sparse_top as em_top
from .histograms import counts_from_cumulative
from .memo import ReleaseMemo, remembered_fit
from .projection import project_l1, project_l2, rank_box
from .estimators import ESTIMATORS, default_cap, default_method, phi_estimate
from .occupancy import (  # noqa: F401  (re-exported: Gamma^B is part of this module's API)
    INVERT_CAP,
    _check_buckets,
    _check_cumulative,
    gamma_b,
    gamma_b_alg6,
    invert_gamma,
)
from .selection import select

# the bucket inversion takes every cap rule (bench/accuracy/fitted_cap.py's "fitted" needs the
# direct EM's
# axis, and hashed mode has none)
HASHED_CAP_RULES = CAP_RULES

__all__ = [
    "VARIANTS",
    "DEFAULT_VARIANT",
    "BUCKET_RULES",
    "DEFAULT_BUCKET_RULE",
    "FLAT_RATIO",
    "gamma_b",
    "gamma_b_alg6",
    "invert_gamma",
    "greedy_prefix",
    "reduced_cumulative",
    "HASHED_METHODS",
    "hashed_phi_estimate",
    "sparse_top",
    "alg7_m",
    "hashed_histogram",
    "two_histogram_estimate",
    "l2_histogram",
    "choose_buckets",
    "collision_free_buckets",
]

VARIANTS = ("exact", "alg7-single", "reduced")
DEFAULT_VARIANT = "exact"


def alg7_m(domain: int, p: float) -> int:
    """m = ceil(10 log D / log(1/p)) of seed 001 Algorithm 7."""
    return max(1, math.ceil(10.0 * math.log(max(int(domain), 2)) / math.log(1.0 / p)))


def greedy_prefix(psi_ge, buckets: int, n: int, m: int) -> np.ndarray:
    """phi_hat_{>=r}, r = 1..m, by the binary searches of seed 001 Algorithm 7 (integers).

    For each r, phi_hat_{>=r} in [0, phi_hat_{>=r-1}] (phi_hat_{>=0} = n) is the integer whose
    Gamma^B(phi_hat_{>=1}, ..., phi_hat_{>=r-1}, x)_r is closest to psi_r. The binary search is the
    paper's; each evaluation is O(1) because, with the lower values fixed,

        Gamma_r(x) = B [1 - (1-q)^phi_{>=1} (S_r + (phi_{>=r-1} - x) a)]      (r >= 2),

    where S_r = sum_{t<r} [z^t] prod_{v<=r-2} (1 + a z^v)^phi_v is kept up to date as each
    prevalence becomes known (a = q/(1-q)); Gamma_1(x) = B (1 - (1-q)^x). The affine form is
    Lemma 20 made exact: raising phi_{>=r} by one moves Gamma_r by (1-q)^(phi_{>=1} - 1) < 1.
    """
    B = _check_buckets(buckets)
    psi = _check_cumulative(psi_ge, "psi_ge")
    m = int(m)
    if m < 1:
        raise ValueError("m must be >= 1")
    n = int(n)
    target = np.concatenate([psi, np.zeros(max(0, m - len(psi)))])[:m]
    q = 1.0 / B
    a = 1.0 / (B - 1)
    lq = math.log1p(-q)
    E = np.zeros(m + 1)  # normalized generating function of the items fixed so far (degrees <= m)
    E[0] = 1.0
    out = np.zeros(m, dtype=np.int64)
    prev = n  # phi_hat_{>=0}
    total = 0  # phi_hat_{>=1}
    gam: Callable[[int], float]  # Gamma_r(x) with phi_{>=1..r-1} fixed
    for r in range(1, m + 1):
        if r == 1:

            def gam_first(x):
                return -B * math.expm1(x * lq)

            gam = gam_first
        else:
            if r >= 3:  # fold in phi_{r-2} (known since step r-1) before using S_r
                v = r - 2
                cnt = int(out[v - 1] - out[v])  # phi_hat_{>=v} - phi_hat_{>=v+1}
                if cnt:
                    new = E.copy()
                    c, k = 1.0, 1
                    while v * k <= m and k <= cnt:
                        c *= (cnt - k + 1) / k * a
                        if c < 1e-300:
                            break
                        new[v * k :] += c * E[: m + 1 - v * k]
                        k += 1
                    E = new
            S = float(E[:r].sum())
            lead = math.exp(total * lq)
            head = -math.expm1(total * lq)

            def gam_later(x, S=S, lead=lead, head=head, up=prev):
                return B * (head - lead * (S - 1.0 + (up - x) * a))

            gam = gam_later
        lb, ub = 0, prev
        while ub > lb + 1:
            mid = (ub + lb) // 2
            if gam(mid) >= target[r - 1]:
                ub = mid
            else:
                lb = mid
        pick = lb if abs(gam(lb) - target[r - 1]) <= abs(gam(ub) - target[r - 1]) else ub
        out[r - 1] = pick
        if r == 1:
            total = pick
        prev = pick
    return out


def _pad(y: np.ndarray, R: int) -> np.ndarray:
    return np.concatenate([y, np.zeros(max(0, R - len(y)), dtype=y.dtype)])[:R]


# Estimators of the reduced (bucket) cumulative prevalence: those of the registry that run on hash
# buckets ("mle" is the EM NPMLE run to convergence, "deconvolution" the same EM stopped early).
HASHED_METHODS = tuple(name for name, e in ESTIMATORS.items() if e.hashed)
__all__ += ["MLE_MAX_ITER", "MLE_TOL"]  # re-exported: they define "mle"
__all__ += ["hashed_cumulative"]


def hashed_phi_estimate(
    noisy_counts, p, *, layers=1, method=None, n=None, memo: ReleaseMemo | None = None
) -> np.ndarray:
    """phi_hat_{>=r} of the B bucket counters (not projected).

    ``n``: the number of events, public under replace-one; the bucket totals sum to it. ``"xfit"``
    fits under it. ``"auto"`` does not get it: with n its bootstrap also weighs capping the
    *reduced* histogram (pilots thinned to n, the cap rules as candidates), while the release caps
    the *item* histogram after the inversion; measured on the accuracy grid's 17 hashed cells
    (docs/core_figures.md, "Hashed auto runs without n"), handing it n raised the 2-layer
    geometric-mean regret and changed nothing at 1 layer, so the selection runs uncapped as the
    grid chose it.

    Default (``method=None``): ``estimators.default_method("hashed", layers)``, the lowest
    worst-case regret over the accuracy grid's hashed cells (docs/accuracy_grid.md).

    What sets hashed mode apart: most of the B counters are empty (B ~ 2 n, D ~ 0.35 n occupied),
    and the threshold estimator's kernel (-x, 1 + x) turns every empty bucket's DLap noise into
    a +-(1 + x) term at r = 1, 2, ...; the NPMLE uses that counter values are h + DLap with
    h >= 0, so the mass of the negative noisy values pins down the empty buckets. The
    early-stopped EM stops on a log-likelihood gain per counter, i.e. ~1e-5 B nats in total, so
    with millions of mostly-empty counters it stops far from the data; run to convergence
    (``"mle"``) the fit is a fixed function of the data (docs/large_domains.md).
    """
    if method is not None and method not in HASHED_METHODS:
        raise ValueError(f"method must be one of {HASHED_METHODS}, got {method!r}")
    if method is None:
        method = default_method("hashed", int(layers))
    return phi_estimate(
        noisy_counts,
        p,
        layers=int(layers),
        method=method,
        mode="hashed",
        n=None if method == "auto" else n,
        memo=memo,
    )


def reduced_cumulative(
    noisy_counts, p, *, layers=1, method=None, n=None, memo: ReleaseMemo | None = None
) -> np.ndarray:
    """Projected estimate of the reduced (bucket) cumulative prevalence: Algorithm 1 on the buckets
    with the estimator of :func:`hashed_phi_estimate`."""
    vc = noisy_value_counts(noisy_counts)
    return project_l1(hashed_phi_estimate(vc, p, layers=int(layers), method=method, n=n, memo=memo))


def hashed_histogram(
    noisy_counts,
    p,
    *,
    buckets,
    n=None,
    layers=1,
    loss="l1",
    method=None,
    variant=DEFAULT_VARIANT,
    m=None,
    cap=None,
    memo: ReleaseMemo | None = None,
) -> np.ndarray:
    """Anonymized histogram of the items from B hashed counters (the ``buckets=`` path).

    Parameters
    ----------
    noisy_counts
        The B noisy bucket counters (or their :class:`NoisyValueCounts`, e.g. merged across
        partitions); each carries ``layers`` DLap(p) layers.
    buckets
        B, the number of counters (must equal their count).
    n
        Number of events. Needed by ``"alg7-single"`` (phi_hat_{>=0} = n) and ``loss="l2"``;
        with ``loss="l1"`` the item histogram is capped at n events (``cap.cap_total``).
    loss
        ``"l1"`` or ``"l2"`` (seed 001 Algorithm 4 with the box taken from these same counters,
        see :func:`l2_histogram`).
    method
        Estimator of the reduced cumulative prevalence (:data:`HASHED_METHODS`). Default:
        ``estimators.default_method("hashed", layers)`` (see :func:`hashed_phi_estimate`).
    variant
        ``"exact"`` (default): invert Gamma^B at every degree (:func:`invert_gamma`), then project.
        ``"alg7-single"``: Algorithm 7's binary searches for r <= m, the hashed histogram itself
        for r > m. ``"reduced"``: no inversion (the bucket histogram as it is; a baseline).
    m
        Algorithm 7's cut-off; default :func:`alg7_m` (B, p).
    cap
        Rule that caps the total at n (``cap.CAP_RULES``; default
        ``estimators.default_cap("hashed", layers)``).
    memo
        The release's :class:`aggregator.memo.ReleaseMemo`: ``auto``'s choice and the
        early-stopped EM's start decision are kept there for the error bars (None: not kept).
    """
    vc = noisy_value_counts(noisy_counts)
    B = _check_buckets(buckets)
    if vc.total != B:
        raise ValueError(f"buckets={B} but {vc.total} counters were given")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if loss == "l2":
        return l2_histogram(vc, p, buckets=B, n=n, layers=layers, method=method, variant=variant)
    if loss != "l1":
        raise ValueError(f"loss must be 'l1' or 'l2', got {loss!r}")
    cap = default_cap("hashed", layers) if cap is None else cap
    if cap not in HASHED_CAP_RULES:
        raise ValueError(f"cap must be one of {HASHED_CAP_RULES}, got {cap!r}")
    return counts_from_cumulative(
        _hashed_cumulative(vc, p, B, n, layers, method, variant, m, cap, memo=memo)
    )


def _hashed_cumulative(
    vc,
    p,
    B: int,
    n,
    layers,
    method,
    variant,
    m,
    cap,
    phi=None,
    shrunk_start=None,
    memo: ReleaseMemo | None = None,
) -> np.ndarray:
    """The l1 release's cumulative prevalence (before listing its counts): what
    :func:`hashed_histogram` lists, for callers that work on phi_{>=r} (the bootstrap).
    ``phi``: :func:`hashed_phi_estimate` of these counters when the caller has it;
    ``shrunk_start``: for the early-stopped EM, the start ``phi`` came from (the bootstrap
    passes the release's). Otherwise the early-stopped EM takes the start these counters'
    likelihood prefers (:func:`_likelier_start`), and the decision is kept in ``memo`` for the
    same counters' next call (the error bars' stand-in: :func:`chosen_start`)."""
    if shrunk_start is not None and phi is None:
        raise ValueError("shrunk_start names the start phi came from: pass phi with it")
    layers = int(layers)
    early = variant != "reduced" and _early_stopped(vc, p, layers, method, memo)
    key = _start_key(vc, p, B, n, layers, variant, m) if early else None
    held = None if memo is None else memo.starts
    if early and phi is None and held is not None and held[0] == key:
        y = held[2]  # decided on these counters already: that fit, not a second EM
        return y if n is None else cap_total(y, n, cap)
    psi: np.ndarray | None
    if phi is not None:
        psi = project_l1(phi)
    else:  # auto's pilots on these bucket counters are the reduced estimates it would make
        psi = None if method is None else remembered_fit(memo, vc, p, layers, method)
        if psi is None:
            psi = reduced_cumulative(vc, p, layers=layers, method=method, n=n, memo=memo)
    sparse = sparse_top(vc, p, layers)
    y = _invert(psi, B, n, p, variant, m, sparse_above=sparse)
    if early and shrunk_start is None:
        y, shrunk, other = _likelier_start(vc, p, B, n, layers, variant, m, sparse, y)
        if memo is not None:  # (key, shrunk start?, its fit, the other start's fit as released)
            memo.starts = (key, shrunk, y, other if n is None else cap_total(other, n, cap))
    return y if n is None else cap_total(y, n, cap)


def _start_key(vc, p, B, n, layers, variant=DEFAULT_VARIANT, m=None) -> tuple:
    return (
        *counters_key(vc),
        float(p),
        int(B),
        None if n is None else int(n),
        int(layers),
        variant,
        m,
    )


def chosen_start(
    vc, p, B: int, n, layers: int, *, cap=None, memo: ReleaseMemo | None = None
) -> tuple[bool, np.ndarray]:
    """(whether the release took the shrunk start, phi_{>=r} of the other start's fit capped
    as the release, by ``cap``) for the early-stopped EM's release on these counters (the
    default variant). The bootstrap re-runs that start (conditional on the choice, as it re-runs
    the candidate ``auto`` chose), and another window of the same truth may take the other one:
    the change test counts their gap as it counts the gap between ``auto``'s candidates.

    With the release's ``memo`` this is the decision the release made; without one (or one that
    holds no decision on these counters) the early-stopped EM's release is made again to decide
    (the same decision, at its cost)."""
    key = _start_key(vc, p, B, n, layers)
    held = None if memo is None else memo.starts
    if held is None or held[0] != key:
        memo = memo if memo is not None else ReleaseMemo()
        cap = default_cap("hashed", layers) if cap is None else cap
        _hashed_cumulative(
            vc, p, B, n, int(layers), "deconvolution", DEFAULT_VARIANT, None, cap, memo=memo
        )
        held = memo.starts
    assert held is not None and held[0] == key  # (the early-stopped EM always decides)
    return held[1], held[3]


def _early_stopped(vc, p, layers: int, method, memo: ReleaseMemo | None = None) -> bool:
    """Whether ``method`` on these bucket counters is the early-stopped EM (named, or the
    candidate ``auto`` chose: :func:`aggregator.selection.select`, kept in ``memo``)."""
    method = default_method("hashed", layers) if method is None else method
    if method == "auto":
        _, (method, _) = select(vc, p, layers=layers, n=None, hashed=True, memo=memo)
    return method == "deconvolution"


def _likelier_start(vc, p, B: int, n, layers: int, variant, m, sparse, y) -> tuple:
    """The early-stopped EM's item histogram ``y`` (from the smoothed start), or the one from
    the shrunk start (``em.EMProblem.start``), whichever the bucket counters' likelihood
    of the item histogram prefers (:func:`aggregator.bucket_likelihood.bucket_loglik`; with n,
    of both capped at n by ``"items"``). Returns (that histogram, whether it is the shrunk
    start's) and the other one.

    Why: where a counter says little about its bucket's total, the early-stopped EM ends near
    its start, and the smoothed start is over-dispersed: in a window of mostly distinct users
    the release was low in every window. The shrunk start has the totals' mean and variance,
    and fits those users; but one linear map distorts heavy tails. The likelihood of the *item*
    histogram tells them apart (the figures: docs/core_figures.md, "The EM's shrunk start").
    """
    phi = deconvolved_prevalence(vc, p, layers=layers, shrunk_start=True, hashed=True)
    y_shrunk = _invert(project_l1(phi), B, n, p, variant, m, sparse_above=sparse)

    def loglik(y_):  # (both as histograms of the n events, whatever the release's cap rule)
        return bucket_loglik(vc, y_ if n is None else cap_total(y_, n, "items"), B, p, layers)

    shrunk = loglik(y_shrunk) > loglik(y)
    return (y_shrunk, True, y) if shrunk else (y, False, y_shrunk)


def hashed_cumulative(
    noisy_counts,
    p,
    *,
    buckets,
    n=None,
    layers=1,
    method=None,
    variant=DEFAULT_VARIANT,
    m=None,
    cap=None,
    memo: ReleaseMemo | None = None,
) -> np.ndarray:
    """phi_{>=r} of :func:`hashed_histogram` with ``loss="l1"`` (the same histogram, as a
    cumulative prevalence: ``counts_from_cumulative`` of it is exactly that histogram)."""
    vc = noisy_value_counts(noisy_counts)
    B = _check_buckets(buckets)
    if vc.total != B:
        raise ValueError(f"buckets={B} but {vc.total} counters were given")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    cap = default_cap("hashed", layers) if cap is None else cap
    if cap not in HASHED_CAP_RULES:
        raise ValueError(f"cap must be one of {HASHED_CAP_RULES}, got {cap!r}")
    return _hashed_cumulative(vc, p, B, n, layers, method, variant, m, cap, memo=memo)


def sparse_top(noisy_counts, p: float, layers: int = 1) -> int:
    """The count above which the hashed release leaves collisions uncorrected: the top of the
    EM's axis (``em.sparse_top``), above which every bucket is a sparse counter.

    The inverse of Gamma^B is a power series as long as twice the largest count (2e6 terms at
    n = 1e7: 1.5 s), while above the dense range each bucket holds one large item plus the
    other items that hashed into it: (n - v) / B events in expectation for an item of v events
    (each other event lands there with probability 1/B). Leaving those buckets as they are
    costs each such item at most n / B events of l1 error in expectation (0.5 at B = 2n), the
    order of the noise the EM passes through there (E|Z| = 0.85 at eps = 1).
    """
    return em_top(noisy_value_counts(noisy_counts), p, layers)


SPARSE_CUT_RATIO = 8  # the inversion stops at the dense top only if the counts reach 8x beyond it

SNAP = 1e-4


def _snap(phi: np.ndarray, L: int) -> np.ndarray:
    """Prepare the real-valued inverse for the l1 projection without changing its result.

    Above the largest reduced value L only the counterweights remain; if they are all below 1/2
    the projection sets them to 0 whatever the rest is, so they are dropped. Entries within
    :data:`SNAP` of an integer (nearly all large-r entries: collision corrections there are
    ~1e-7) are set to it: on integer y the cost changes by at most SNAP per entry, and the runs of
    equal values collapse (1.3e6 runs -> ~2e4 at n = 1e7, projection 5 s -> 0.05 s; results
    identical in the benchmark's checks).
    """
    if len(phi) > L and phi[L:].max() < 0.5:
        phi = phi[:L]
    near = np.rint(phi)
    close = np.abs(phi - near) < SNAP
    return np.where(close, near, phi)


def _invert(
    psi: np.ndarray, B: int, n, p: float, variant: str, m, sparse_above: int | None = None
) -> np.ndarray:
    """Valid cumulative prevalence of the items from the projected reduced one.

    ``sparse_above``: a count above which every bucket is a sparse counter (:func:`sparse_top`);
    degrees above it are not inverted (``invert_gamma``'s cap at twice it) when the reduced
    histogram reaches far beyond it (:data:`SPARSE_CUT_RATIO`): that is where the series is
    long, and a cut just below the top left a half-inverted tail that the blow-up check below
    does not see (hashed 'distinct' n = 1e3 cells: 52 -> 1936 events of error).
    """
    if len(psi) == 0 or psi[0] == 0:
        return np.zeros(0, dtype=np.int64)
    if variant == "reduced":
        return psi
    if variant == "exact":
        psi_f = np.minimum(psi, B - 1).astype(np.float64)
        cap = INVERT_CAP
        if sparse_above is not None and len(psi) > SPARSE_CUT_RATIO * max(sparse_above, 1):
            cap = min(INVERT_CAP, 2 * max(sparse_above, 1))
        with np.errstate(all="ignore"):
            phi = invert_gamma(psi_f, B, cap=cap)
        # The power-series inverse is well conditioned while psi_1 is well below B (Lemma 14 asks
        # B > 4n); with most buckets occupied, noise can make it blow up. Fall back to Algorithm 7's
        # clipped binary searches then.
        if np.all(np.isfinite(phi)) and np.abs(phi).max() <= 4.0 * psi_f[0] + 16.0:
            return project_l1(_snap(phi, len(psi)))
        variant = "alg7-single"
        if n is None:
            n = int(np.sum(psi))  # the reduced histogram's total is n
    if n is None:
        raise ValueError("variant 'alg7-single' needs n (phi_hat_{>=0} = n)")
    m = alg7_m(B, p) if m is None else int(m)
    mm = min(m, len(psi))
    low = greedy_prefix(psi, B, int(n), mm).astype(np.float64)
    return project_l1(np.concatenate([low, psi[mm:]]))


def two_histogram_estimate(
    noisy_direct,
    p_direct,
    noisy_hashed,
    p_hashed,
    *,
    buckets,
    n,
    layers_direct=1,
    layers_hashed=1,
    method=None,
    m=None,
) -> np.ndarray:
    """Seed 001 Algorithm 7 with its two histograms.

    ``noisy_direct`` are D unhashed noisy counters (one per domain item, or a hash into >= n^2
    buckets so that collisions are unlikely), ``noisy_hashed`` the B hashed ones. phi_{>=r} for
    r <= m = ceil(10 log D / log(1/p_direct)) comes from the binary searches on the hashed
    histogram, r > m from the unhashed one; the l1 isotonic projection joins them. The two
    histograms are two releases, so their epsilons add (the paper uses eps/2 each).
    """
    B = _check_buckets(buckets)
    vh = noisy_value_counts(noisy_hashed)
    if vh.total != B:
        raise ValueError(f"buckets={B} but {vh.total} hashed counters were given")
    vd = noisy_value_counts(noisy_direct)
    psi = reduced_cumulative(vh, p_hashed, layers=layers_hashed, method=method)
    direct = reduced_cumulative(vd, p_direct, layers=layers_direct, method=method)
    m = alg7_m(vd.total, p_direct) if m is None else int(m)
    low = greedy_prefix(psi, B, int(n), m).astype(np.float64)
    high = _pad(direct.astype(np.float64), max(len(direct), m))[m:]
    y = np.concatenate([low, high])
    return counts_from_cumulative(project_l1(y))


def l2_histogram(
    noisy_counts,
    p,
    *,
    buckets,
    n,
    layers=1,
    method=None,
    variant=DEFAULT_VARIANT,
    box_counts=None,
    box_p=None,
    box_layers=None,
) -> np.ndarray:
    """Seed 001 Algorithm 4 (l2^2 loss, large domains).

    Runs the l1 estimator on the B hashed counters, then returns the anonymized histogram closest
    in l1 to it with sum n and every rank within gamma = 10 log(2 n B2) / log(1/p) of the sorted
    noisy counters of a second histogram with B2 buckets (``box_counts``). The paper takes
    B2 >> n^2 so that no two items collide there w.h.p. (then the box holds w.h.p.); that costs
    B2 counters of memory (see :func:`collision_free_buckets`). Without ``box_counts`` the box
    comes from the same B hashed counters: no extra memory, but the box is wrong whenever two
    items larger than about gamma share a bucket (probability ~ N_big^2 / (2B)), and then the
    result can be far off in l2. Returns the all-zero histogram when the box is infeasible.
    """
    if n is None:
        raise ValueError("loss='l2' needs n (the number of events, public under replace-one)")
    n = int(n)
    vc = noisy_value_counts(noisy_counts)
    B = _check_buckets(buckets)
    y1 = _invert(reduced_cumulative(vc, p, layers=layers, method=method), B, n, p, variant, None)
    if box_counts is None:
        vb, pb = vc, p
    else:
        vb = noisy_value_counts(box_counts)
        pb = p if box_p is None else box_p
    gamma = 10.0 * math.log(max(2 * n * vb.total, 2)) / math.log(1.0 / pb)
    R = max(len(y1), int(vb.hi + gamma) + 1, 1)
    lower, upper = rank_box(vb, gamma, R)
    y = project_l2(_pad(y1.astype(np.float64), R), n, lower, upper)
    if y is None:
        return np.zeros(0, dtype=np.int64)
    return counts_from_cumulative(y)


# --------------------------------------------------------------------------------------------
# choosing B
# --------------------------------------------------------------------------------------------
BUCKET_RULES = ("flat", "capped", "corollary13", "footnote7")
DEFAULT_BUCKET_RULE = "flat"
FLAT_RATIO = 2.0  # B / n of the "flat" rule (docs/large_domains.md, "Choosing B")


def choose_buckets(n_expected, epsilon, *, rule=DEFAULT_BUCKET_RULE, min_ratio=1.0) -> int:
    """Number of hash buckets B for an expected number of events n (chosen before any data).

    * ``"flat"`` (default): B = 2 n (:data:`FLAT_RATIO`), whatever eps. Measured in
      docs/large_domains.md ("Choosing B") over B/n in 0.5..4, four item distributions (distinct
      fraction D/n from 0.01 to 0.98), n = 1e4..1e7 and eps in {0.5, 1, 2}: B = 2 n had the lowest
      worst case over the distributions (hashed / oracle-direct l1 error) and the lowest geometric
      mean. The best B grows with D/n (steep Zipf items, few distinct, want B < n: every empty
      bucket adds noise; mostly-distinct items want 2-3 n: collisions), and D/n is not known
      when B is fixed; 2 n is where neither side loses much.
    * ``"capped"`` (the default before): footnote 7 kept between 1.5 n and Corollary 13's
      n sqrt(log n), i.e. 1.5 n at eps = 0.5 and n sqrt(log n) (3-4 n) at eps >= 1.
    * ``"corollary13"``: B = n sqrt(log n) (seed 001 Corollary 13; it balances the empty-bucket
      noise sqrt(C_p B log n) against the collision term n log n / sqrt(B) of Theorem 12
      asymptotically, with constants that do not matter there but do at n <= 1e7).
    * ``"footnote7"``: B = n sqrt(eps^2.5 log n) (its footnote 7: fewer buckets, so less noise
      from empty ones, when eps is small; more when eps is large).

    Every rule is clamped to B >= ``min_ratio`` * n and B >= 16. ``epsilon`` is the per-layer
    epsilon of the state (p = exp(-eps/2)); the default rule does not use it. Memory is B counters.
    When the real n differs from the expected one (measured in docs/large_domains.md): with more
    events there are more collisions, still undone by the inversion, and the error grows slowly
    until most buckets are occupied (the exact inverse then falls back to Algorithm 7's clipped
    search); with fewer events there are more empty buckets, each adding noise, so the error is
    that of a larger B.

    >>> choose_buckets(10**6, 1.0, rule="corollary13")
    3716923
    >>> choose_buckets(10**6, 1.0)
    2000000
    """
    if isinstance(n_expected, bool) or not isinstance(
        n_expected, (int, float, np.integer, np.floating)
    ):
        raise TypeError(f"n_expected must be a number, got {type(n_expected).__name__}")
    n = float(n_expected)
    if not math.isfinite(n) or n < 1:
        raise ValueError(f"n_expected must be >= 1, got {n_expected!r}")
    eps = float(epsilon)
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"epsilon must be a positive finite number, got {epsilon!r}")
    if rule not in BUCKET_RULES:
        raise ValueError(f"rule must be one of {BUCKET_RULES}, got {rule!r}")
    min_ratio = float(min_ratio)
    if not min_ratio > 0:
        raise ValueError("min_ratio must be > 0")
    logn = math.log(max(n, 2.0))
    cor13 = math.sqrt(logn)
    fn7 = math.sqrt(eps**2.5 * logn)
    ratio = {
        "flat": FLAT_RATIO,
        "corollary13": cor13,
        "footnote7": fn7,
        "capped": min(cor13, max(1.5, fn7)),
    }[rule]
    return int(max(math.ceil(n * max(ratio, min_ratio)), 16))


def collision_free_buckets(distinct: float, delta: float = 0.05) -> int:
    """B2 with P[any two of ``distinct`` items collide] <= delta: ceil(d (d - 1) / (2 delta))."""
    d = float(distinct)
    if d < 1 or not 0 < delta < 1:
        raise ValueError("need distinct >= 1 and 0 < delta < 1")
    return int(math.ceil(d * (d - 1) / (2 * delta))) + 1
