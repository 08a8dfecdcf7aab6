"""A privacy audit that sees composition: likelihood-ratio thresholds over the joint view.

The event family of :func:`tests.test_privacy.empirical_epsilon` (values, thresholds and
quadrants of one or two counters) certifies single-look claims: on two independent eps-looks of
one event it reads about eps, not 2 eps, because no event in it looks at the evidence of several
looks at once. This module builds events from the *known noise model* instead.

The model. The mechanisms audited publish *views* V_0, ..., V_M (state snapshots, memory reads,
release inputs), each an (N, D) integer array holding N independent runs. Under the claimed
design view j is ``c_j + (sum of k_j independent DLap(p) layers)``, with c_j(x), c_j(y) the true
counters after the events before it under the neighbouring streams x, y (known: the tests choose
the streams) and k_j the announced number of layers. A :class:`Look` holds (c_j(x), c_j(y), k_j).

The statistics, one N-vector each, all exact log-likelihood ratios log P_x / P_y under the model:

* ``L_j``: of view j alone (its marginal law; only the counters where c_j(x) != c_j(y) enter);
* ``B_j``: of the block V_j - V_{j-1}, when the layer counts strictly increase (the claimed
  design nests the views: view j is view j-1 plus k_j - k_{j-1} fresh layers plus the events in
  between; docs/privacy.md Theorem 2, Step 2). B_0 = L_0;
* ``sum L``: the sum of the looks' ratios, which is the exact joint log-ratio when the looks have
  independent noise (two incarnations of a window after a crash; two fresh looks);
* ``sum B``: the sum of the blocks' ratios, which is the exact joint log-ratio of the whole view
  under the nested design (the blocks are independent there).

Several members (independent chains, then a sum). A group of members (docs/privacy.md section
20a) does not nest all its views: member k's memory M_k = c_k(t) + L_k and view
V_k = c_k(T) + L_k + N_k nest (one chain), but the views of two members carry independent noise,
and the release is V_1 + ... + V_P, a function of the views. A :class:`Look` therefore names its
``chain`` (0 unless told: every look of one process is one chain) and whether it is ``derived``
(a deterministic function of the other looks, such as the sum of the views). Then:

* the blocks are taken within each chain (the nesting rule applies per chain), and ``sum B`` adds
  the blocks of every chain. With independent chains the joint density of the non-derived looks
  factorises over the chains, and within a chain over its blocks, so
  log P_x(V) / P_y(V) = sum over chains c, blocks b of c of log P_x(b) / P_y(b) = sum B: still
  the exact joint log-ratio. A chain's first block is its first look (named L_j, not B_j);
* a derived look adds no information: the joint law of (views, f(views)) has the ratio of the
  views alone, so it enters no block and no ``sum B``. Its marginal ratio ``L_j`` is still a
  statistic of the family (for the sum of independent looks its law is c_x + (sum of their layers)
  DLap(p), so ``layers`` is the total), and so is ``sum L`` over every look: fixed functions of
  the views, so valid events whatever the mechanism did, only not the exact joint ratio.

The events are {S >= t} and {S <= t} for each statistic S and every threshold t on a fixed grid
(step ``-log(p) / 8``, eps / 16 for replace-one) across S's range [-R, R] under the model (R is
``||c(x) - c(y)||_1 * -log(p)`` per look or block, summed for the sums). The grid depends only on
the model, never on the sample, so Bonferroni over the family is valid. An event with likelihood
ratio r under the truth reads log r: if the design is as claimed, {sum B >= R} has ratio e^eps
exactly; if the views carry independent noise, {sum L >= 2 eps} has ratio e^(2 eps); if two
views share noise the model says is fresh, a block's ratio is +-R in every run and its events
have probability 1 under one stream and 0 under the other. A wrong model (the real layers are
fewer, more, or not nested) never makes the audit invalid, only less powerful: the statistics are
just fixed functions of the view.

The bound reported is, as in ``empirical_epsilon``, the largest
log(lower Clopper-Pearson bound of P_x(E)) - log(upper bound of P_y(E)) over the events E and both
directions, with one-sided intervals Bonferroni-corrected over all 4 * |family| intervals, so a
mechanism that is eps-DP reads > eps with probability at most ``alpha``.

Noise for the controls comes from the production sampler (OS entropy, never seeded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import stats

ALPHA = 1e-6  # family-wise false-failure probability of one audit
STEPS = 8  # thresholds per -log(p) (one unit of counter shift)
_TOL = 1e-9  # log-ratios that are equal in exact arithmetic compare equal


@dataclass(frozen=True)
class Look:
    """The model of one view: true counters under x and under y, the layers it carries, the
    chain of nested looks it belongs to (one per group member; 0 for one process) and whether
    it is ``derived``: a function of the other looks (the sum of a group's views)."""

    mean_x: tuple
    mean_y: tuple
    layers: int
    chain: int = 0
    derived: bool = False

    @classmethod
    def of(cls, mean_x, mean_y, layers: int, chain: int = 0, derived: bool = False) -> "Look":
        mx = tuple(int(v) for v in np.asarray(mean_x).ravel())
        my = tuple(int(v) for v in np.asarray(mean_y).ravel())
        if len(mx) != len(my):
            raise ValueError("the two means have different lengths")
        if int(layers) < 1:
            raise ValueError("a look carries at least one noise layer")
        return cls(mx, my, int(layers), int(chain), bool(derived))


@dataclass(frozen=True)
class Result:
    eps: float  # the certified lower bound on the privacy loss
    where: str  # the event attaining it
    events: int  # size of the family (Bonferroni over 4 intervals per event)
    p_x: float  # point estimates of the attaining event under the numerator stream
    p_y: float  # ... and under the denominator stream

    def __iter__(self):  # ``eps, where = lr_epsilon(...)``, like empirical_epsilon
        return iter((self.eps, self.where))


# ---------------------------------------------------------------------------------------------
# the noise model
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def log_pmf(p: float, layers: int) -> tuple[int, np.ndarray]:
    """(K, log P[Z = z] for z in [-K, K]) for Z the sum of ``layers`` DLap(p) draws.

    The support is cut where one layer's tail is below 1e-200 (far beyond any sampled value);
    values outside it are clipped to its ends by :func:`log_ratio` (a fixed function still)."""
    k1 = int(math.ceil(200 * math.log(10) / -math.log(p)))
    z = np.arange(-k1, k1 + 1)
    base = (1 - p) / (1 + p) * np.power(p, np.abs(z))
    q = base
    for _ in range(layers - 1):
        q = np.convolve(q, base)
    big = (len(q) - 1) // 2
    with np.errstate(divide="ignore"):
        lq = np.log(q)
    keep = big - k1  # |z| <= k1 keeps every value finite and accurate
    return k1, lq[keep : len(lq) - keep]


def log_ratio(view: np.ndarray, mean_x, mean_y, p: float, layers: int) -> np.ndarray:
    """log P_x(view) / P_y(view) per run, for view = mean + Z (Z: ``layers`` DLap(p) layers on
    every counter, independent across counters); only counters whose means differ enter."""
    mx, my = np.asarray(mean_x, dtype=np.int64), np.asarray(mean_y, dtype=np.int64)
    k, lq = log_pmf(p, layers)
    out = np.zeros(len(view))
    for i in np.flatnonzero(mx != my):
        col = view[:, i].astype(np.int64)
        out += lq[np.clip(col - mx[i], -k, k) + k] - lq[np.clip(col - my[i], -k, k) + k]
    return out


def _bound(mean_x, mean_y, p: float) -> float:
    """The largest |log-ratio| of a look: ||c(x) - c(y)||_1 * -log p (Lemmas 1 and 2)."""
    return float(np.abs(np.subtract(mean_x, mean_y)).sum()) * -math.log(p)


def statistics(views, looks, p: float) -> list[tuple[str, np.ndarray, float]]:
    """(name, per-run log-ratio, its bound R) for every statistic of the family."""
    if len(views) != len(looks):
        raise ValueError(f"{len(views)} views but {len(looks)} looks in the model")
    out, marg, blocks = [], [], []
    for j, (v, look) in enumerate(zip(views, looks)):
        r = _bound(look.mean_x, look.mean_y, p)
        if r > 0:
            marg.append((f"L{j}", log_ratio(v, look.mean_x, look.mean_y, p, look.layers), r))
    chains: dict[int, list[int]] = {}
    for j, look in enumerate(looks):
        if not look.derived:
            chains.setdefault(look.chain, []).append(j)
    nested = all(
        looks[b].layers > looks[a].layers for js in chains.values() for a, b in zip(js, js[1:])
    )
    firsts = {js[0] for js in chains.values()}  # a chain's first block is its first look
    if nested and sum(map(len, chains.values())) > 1:
        for js in chains.values():
            prev_v, prev_k = 0, 0
            prev_x = prev_y = np.zeros(len(looks[js[0]].mean_x), dtype=np.int64)
            for j in js:
                v, look = views[j], looks[j]
                dx = np.subtract(look.mean_x, prev_x)
                dy = np.subtract(look.mean_y, prev_y)
                r = _bound(dx, dy, p)
                if r > 0:
                    blocks.append(
                        (f"B{j}", log_ratio(v - prev_v, dx, dy, p, look.layers - prev_k), r)
                    )
                prev_v, prev_x, prev_y, prev_k = v, look.mean_x, look.mean_y, look.layers
    out += marg
    out += [b for b in blocks if int(b[0][1:]) not in firsts]  # B_first is L_first
    for name, group in (("sum L", marg), ("sum B", blocks)):
        if len(group) > 1:
            out.append((name, np.sum([s for _, s, _ in group], axis=0), sum(r for *_, r in group)))
    return out


def _thresholds(r: float, p: float) -> np.ndarray:
    step = -math.log(p) / STEPS
    m = int(round(r / step))
    return step * np.arange(-m, m + 1)


def event_counts(views, looks, p: float) -> tuple[np.ndarray, list[str]]:
    """Counts over the runs of every event {S >= t}, {S <= t} of the family, and their names."""
    counts, names = [], []
    for name, s, r in statistics(views, looks, p):
        t = _thresholds(r, p)
        srt = np.sort(s)
        ge = len(s) - np.searchsorted(srt, t - _TOL, side="left")
        le = np.searchsorted(srt, t + _TOL, side="right")
        counts += [ge, le]
        names += [f"{{{name} >= {v:+.4f}}}" for v in t] + [f"{{{name} <= {v:+.4f}}}" for v in t]
    return np.concatenate(counts), names


# ---------------------------------------------------------------------------------------------
# Clopper-Pearson bounds, Bonferroni over the family
# ---------------------------------------------------------------------------------------------
def _cp_lower(k: np.ndarray, n: int, a: float) -> np.ndarray:
    u, inv = np.unique(k, return_inverse=True)
    out = np.zeros(len(u))
    pos = u > 0
    out[pos] = stats.beta.ppf(a, u[pos], n - u[pos] + 1)
    return out[inv]


def _cp_upper(k: np.ndarray, n: int, a: float) -> np.ndarray:
    u, inv = np.unique(k, return_inverse=True)
    out = np.ones(len(u))
    below = u < n
    out[below] = stats.beta.ppf(1 - a, u[below] + 1, n - u[below])
    return out[inv]


def _best(c_num, n_num, c_den, n_den, a) -> tuple[float, int]:
    with np.errstate(divide="ignore"):
        r = np.log(_cp_lower(c_num, n_num, a)) - np.log(_cp_upper(c_den, n_den, a))
    i = int(np.argmax(r))
    return float(r[i]), i


def lr_epsilon(views_x, views_y, looks, p: float, alpha: float = ALPHA) -> Result:
    """Certified lower bound on the privacy loss of the joint view, from N_x runs under x and
    N_y runs under y (lists of (N, D) arrays, one per look, in the order of ``looks``).

    ``p`` is the claimed noise parameter (the model's, not necessarily the mechanism's)."""
    cx, names = event_counts(views_x, looks, p)
    cy, _ = event_counts(views_y, looks, p)
    if not len(cx):
        raise ValueError("the model has no look whose law differs between the neighbours")
    nx, ny = len(views_x[0]), len(views_y[0])
    a = alpha / (4 * len(cx))
    r_xy, i_xy = _best(cx, nx, cy, ny, a)
    r_yx, i_yx = _best(cy, ny, cx, nx, a)
    if r_xy >= r_yx:
        best, i, direction, px, py = r_xy, i_xy, "x vs y", cx[i_xy] / nx, cy[i_xy] / ny
    else:
        best, i, direction, px, py = r_yx, i_yx, "y vs x", cy[i_yx] / ny, cx[i_yx] / nx
    return Result(best, f"{names[i]} ({direction})", len(cx), float(px), float(py))


# ---------------------------------------------------------------------------------------------
# models of the schedules of tests/test_privacy.py (``run_schedule``)
# ---------------------------------------------------------------------------------------------
def schedule_looks(schedule, size: int) -> list[tuple[np.ndarray, int]]:
    """(true counters, layers) at each ``"view"`` of a ``run_schedule`` schedule, as designed:
    one initial layer, one more per ``"layer"``."""
    counts, layers, out = np.zeros(size, dtype=np.int64), 1, []
    for op in schedule:
        if isinstance(op, str) and op == "layer":
            layers += 1
        elif isinstance(op, str) and op == "view":
            out.append((counts.copy(), layers))
        else:
            counts = counts + np.bincount(np.asarray(op, dtype=np.int64), minlength=size)
    return out


def schedule_model(schedule_x, schedule_y, size: int, claimed_layers=None) -> list[Look]:
    """The looks of two neighbouring schedules. ``claimed_layers`` overrides the layer counts the
    schedules imply (to audit a broken schedule against the design it claims to follow)."""
    lx, ly = schedule_looks(schedule_x, size), schedule_looks(schedule_y, size)
    if len(lx) != len(ly) or any(a[1] != b[1] for a, b in zip(lx, ly)):
        raise ValueError("the two schedules do not have the same views and layers")
    layers = claimed_layers or [k for _, k in lx]
    return [Look.of(a, b, k) for (a, _), (b, _), k in zip(lx, ly, layers)]
