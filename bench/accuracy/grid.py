"""The accuracy grid: every candidate estimator on the same noisy counters, and the regret rule.

A *cell* fixes what a deployment does not choose: the mode (direct counters over a known domain
of D items, or B = choose_buckets(n) hash buckets over an unbounded one), the item distribution,
n, eps and the number of DLap layers in the released counters (1 = state-only, 2 = joint model,
3 = joint model after an audit export). A *candidate* is what the code chooses: the estimator of
phi_{>=r} (``estimators.METHODS``) and the rule that caps the total at the public n
(``estimate.CAP_RULES``; ``"none"`` is shown for reference: it can release more than n events).

Pairing: in each repetition of a cell one draw of the items and, per layer count, ONE draw of the
noisy counters is shared by every candidate, so differences between candidates are not noise
draws. Estimators run once per (repetition, layers, method); the cap rules are post-processing of
the same projection.

Regret (the selection rule). For a cell c and candidate m, with E(m, c) the mean l1 error over the
repetitions, regret(m, c) = E(m, c) / min_{m'} E(m', c) >= 1 (the minimum over the admissible
candidates, those that cap the total). The default for a (mode, layers) is the candidate with the
lowest worst-case regret max_c regret(m, c) over that mode's cells. Worst case because a deployment
cannot tell in advance which cell it is in (D/n, the distribution and eps vary); regret rather than
raw error so that cells with large errors do not drown the others. The maximum of noisy ratios is
itself noisy, so candidates whose worst-case regrets are within two standard errors of each other
(:func:`regret_se`, paired delta method) count as tied, and a tie goes to the lower
geometric-mean regret over all cells.

Noise is drawn from a seeded numpy Generator (reproducible; benchmark only, never private); the
empty counters' noisy values are one multinomial draw over the exact noise pmf (the estimators only
see noisy-value counts). Hashing: each distinct item picks a bucket uniformly at random, which is
what a keyed hash with a fresh random key does to distinct items (the model Gamma^B assumes).

>>> cells = grid_cells(quick=True)
>>> sorted({c.mode for c in cells})
['direct', 'hashed']
>>> errors = {("a", 0): 2.0, ("b", 0): 4.0, ("a", 1): 3.0, ("b", 1): 2.5}   # (candidate, cell)
>>> worst = worst_regret(regrets(errors, ["a", "b"]), ["a", "b"])
>>> {m: (round(v, 2), cell) for m, (v, cell) in worst.items()}   # a: 20% off the best at worst
{'a': (1.2, 1), 'b': (2.0, 0)}
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from aggregator import largedomain as ld
import zlib

from aggregator.estimate import (
    CAP_RULES,
    cumulative_from_counts,
    cumulative_l1,
    project_l1,
    sparse_top,
)
from aggregator.estimators import phi_estimate
from aggregator.noise import p_from_epsilon

from .._data import REAL, real_profile, true_counts
from .fitted_cap import MEASURED_CAPS, capped
from .largedomain import items_counts, noisy_vc

SEED = 20261123
LAYERS = (1, 2, 3, 6)
EPS = (0.25, 0.5, 1.0, 2.0, 4.0)
DIRECT_DISTS = ("zipf0.7", "zipf", "zipf1.5", "zipf2", "geometric", "uniform", "heavy")
# HASHED_DISTS: bench.accuracy.largedomain.items_counts
HASHED_DISTS = ("zipf", "zipf1.01", "zipf1.5", "distinct")
# Estimators measured by the grid (estimators.METHODS less "xfit", whose three EM runs per estimate
# did not pay for themselves in the pilot runs: docs/accuracy_grid.md notes)
METHODS = ("threshold", "deconvolution", "mle", "wupagh", "auto")
# "fitted" (bench/accuracy/fitted_cap.py) is measured on direct cells (run_cell) but not a grid
# candidate: tried held out in bench.accuracy.lofo (auto_fitted) and not adopted, so not in the
# library's CAP_RULES
GRID_CAPS = CAP_RULES
ADMISSIBLE_CAPS = tuple(c for c in GRID_CAPS if c != "none")
CANDIDATES = tuple((m, c) for m in METHODS for c in GRID_CAPS)


@dataclass(frozen=True)
class Cell:
    """One point of the grid; ``D`` is the domain size in direct mode, None in hashed mode."""

    mode: str
    dist: str
    n: int
    D: int | None
    eps: float
    reps: int

    @property
    def p(self) -> float:
        return p_from_epsilon(self.eps)

    @property
    def counters(self) -> int:
        """Number of noisy counters: D, or B = choose_buckets(n, eps)."""
        return self.D if self.mode == "direct" else ld.choose_buckets(self.n, self.eps)

    @property
    def key(self) -> tuple:
        return (self.mode, self.dist, self.n, self.D, self.eps)


# (D, n, reps) of the synthetic direct cells: D/n = 0.1 .. 33, n = 1e3 .. 1e6; the dense
# sizes D/n = 0.01 (n = 1e6, 1e7) only for DENSE_DISTS: their value spans (~2e4 values under
# wide noise) make the converged NPMLE, and "auto" which runs it 5 times, cost ~20 s a layer
DIRECT_SIZES = (
    (10**4, 10**5, 2),
    (10**4, 10**3, 3),
    (10**5, 10**5, 2),
    (10**5, 10**4, 2),
    (10**6, 10**6, 2),
    (10**6, 10**5, 2),
    (10**6, 3 * 10**4, 2),
)
DENSE_SIZES = ((10**4, 10**6, 1), (10**5, 10**7, 1))
DENSE_DISTS = ("zipf", "uniform", "geometric")


def grid_cells(quick: bool | str = False) -> list[Cell]:
    """The grid (what a deployment does not choose), a rotating design rather than a full
    factorial so that it runs in well under an hour on one core:

    * direct, synthetic: every distribution of :data:`DIRECT_DISTS` at every (D, n) of
      :data:`DIRECT_SIZES`, eps rotating through :data:`EPS` (each distribution meets every eps
      and every D/n; eps 0.25 becomes 0.5 where n > D: 900-tap noise over value spans of 2e4
      made one such cell cost minutes); plus Zipf(1.1) and uniform at D = 1e5 and 1e6 with
      n = D at eps 0.25 and 4;
    * direct, near-empty windows: n = 0, 10, 100 events over D = 1e5 and 1e6 counters;
    * direct, real profiles (:data:`bench._data.REAL`, D = their vocabulary): n = D / 10
      (eps 0.5 and 1 alternating) and n = 10 D (eps 1 and 2);
    * hashed: :data:`HASHED_DISTS` at n = 1e3 .. 1e6 (B = choose_buckets(n)), eps rotating, plus
      Zipf(1.1) at n = 1e7.

    ``quick``: a few small cells; ``"smoke"``: two tiny ones, one repetition.
    """
    if quick == "smoke":  # tests/test_bench_smoke.py: one repetition of two tiny cells
        return [
            Cell("direct", "zipf", 10**3, 300, 1.0, 1),
            Cell("hashed", "zipf", 100, None, 1.0, 1),
        ]
    if quick:
        return [
            Cell("direct", "zipf", 10**3, 10**4, 1.0, 2),
            Cell("direct", "heavy", 10**3, 10**5, 0.5, 2),
            Cell("direct", "uniform", 10**5, 10**4, 2.0, 2),
            Cell("direct", "zipf", 0, 10**4, 1.0, 2),
            Cell("direct", "sc-ru", 2 * 10**3, 19_880, 1.0, 2),
            Cell("hashed", "zipf", 10**4, None, 1.0, 2),
        ]
    cells = []
    j = 0
    for dist in DIRECT_DISTS:
        for D, n, reps in DIRECT_SIZES + (DENSE_SIZES if dist in DENSE_DISTS else ()):
            eps = EPS[j % len(EPS)]
            if eps == 0.25 and n > D:  # wide noise over a long value span: EM too slow to grid
                eps = 0.5
            cells.append(Cell("direct", dist, n, D, eps, reps))
            j += 1
        j += 2  # the next distribution starts elsewhere in the eps cycle
    for dist in ("zipf", "uniform"):
        for D in (10**5, 10**6):
            for eps in (0.25, 4.0):
                cells.append(Cell("direct", dist, D, D, eps, 2))
    for D in (10**5, 10**6):
        for n in (0, 10, 100):
            cells.append(Cell("direct", "zipf", n, D, 1.0, 3))
    for i, name in enumerate(REAL):
        D = len(real_profile(name))
        for n, eps, reps in ((D // 10, (0.5, 1.0)[i % 2], 2), (10 * D, (1.0, 2.0)[i % 2], 1)):
            cells.append(Cell("direct", name, n, D, eps, reps))
    j = 0
    for dist in HASHED_DISTS:
        for n, reps in ((10**3, 3), (10**4, 3), (10**5, 2), (10**6, 2)):
            cells.append(Cell("hashed", dist, n, None, EPS[j % len(EPS)], reps))
            j += 1
    cells.append(Cell("hashed", "zipf", 10**7, None, 1.0, 1))
    return cells


@dataclass
class CellResult:
    """Per (layers, method, cap): l1 errors over the repetitions; per (layers, method): seconds
    and the uncapped totals; per repetition: the number of distinct items."""

    cell: Cell
    l1: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    total: dict = field(default_factory=dict)
    items: list = field(default_factory=list)

    def add(self, table: dict, key, value) -> None:
        table.setdefault(key, []).append(value)


def estimate_y(mode: str, vc, p: float, layers: int, method: str, n: int, B: int | None):
    """The uncapped projected cumulative prevalence of the items, as the release computes it."""
    if mode == "direct":
        return project_l1(phi_estimate(vc, p, layers=layers, method=method, n=n))
    counts = ld.hashed_histogram(vc, p, buckets=B, n=n, layers=layers, method=method, cap="none")
    return cumulative_from_counts(counts)


def draw(cell: Cell, rep: int):
    """(true counts of the items, bucket totals or None, rng for the noise) of one repetition."""
    rng = np.random.default_rng(
        [
            SEED,
            zlib.crc32(cell.mode.encode()),
            cell.n,
            cell.D or 0,
            int(cell.eps * 100),
            zlib.crc32(cell.dist.encode()),
            rep,
        ]
    )
    if cell.mode == "direct":
        h = true_counts(rng, cell.dist, cell.D, cell.n)
        return h[h > 0], None, rng
    if cell.dist in HASHED_DISTS:
        _, h = items_counts(rng, cell.n, cell.dist)
    else:  # a real profile's vocabulary as the items (bench.accuracy.lofo --hashed-real)
        h = true_counts(rng, cell.dist, len(real_profile(cell.dist)), cell.n)
        h = h[h > 0]
    B = cell.counters
    red = np.bincount(rng.integers(0, B, len(h)), weights=h, minlength=B).astype(np.int64)
    return h, red[red > 0], rng


def _noisy(rng, values, zeros, p, k):
    """bench.accuracy.largedomain.noisy_vc, also for a window with no events (no non-zero
    counter)."""
    if len(values):
        return noisy_vc(rng, values, zeros, p, k)
    from aggregator.estimate import NoisyValueCounts, noise_pmf

    K, q = noise_pmf(p, k)
    return NoisyValueCounts(-K, rng.multinomial(zeros, q).astype(np.int64))


def run_cell(cell: Cell, layers=LAYERS, methods=METHODS, reps=None, estimate=None) -> CellResult:
    """Run repetitions ``reps`` (default: 0 .. cell.reps - 1) of a cell; ``estimate``: a
    stand-in for :func:`estimate_y` (same arguments) that knows more methods."""
    estimate = estimate_y if estimate is None else estimate
    out = CellResult(cell)
    p, C = cell.p, cell.counters
    B = C if cell.mode == "hashed" else None
    for rep in range(cell.reps) if reps is None else reps:
        h, occupied, rng = draw(cell, rep)
        out.items.append(len(h))
        truth = cumulative_from_counts(h)
        values = h if occupied is None else occupied
        for k in layers:
            vc = _noisy(rng, values, C - len(values), p, k)  # shared by every candidate
            # cap "fitted" keeps the items above the direct EM's axis whole (hashed: no axis)
            top = sparse_top(vc, p, k) if cell.mode == "direct" else None
            for m in methods:
                t = time.perf_counter()
                y = estimate(cell.mode, vc, p, k, m, cell.n, B)
                out.add(out.seconds, (k, m), time.perf_counter() - t)
                out.add(out.total, (k, m), int(y.sum()))
                for cap in MEASURED_CAPS:
                    if cap == "fitted" and top is None:
                        continue
                    out.add(
                        out.l1,
                        (k, m, cap),
                        cumulative_l1(capped(y, cell.n, cap, fitted_top=top), truth),
                    )
    return out


def merge(a: CellResult, b: CellResult) -> CellResult:
    """The repetitions of both (same cell; ``b`` ran the repetitions after ``a``'s)."""
    if a.cell.key != b.cell.key:
        raise ValueError("different cells")
    out = CellResult(replace(a.cell, reps=len(a.items) + len(b.items)))
    for name in ("l1", "seconds", "total"):
        for key in set(getattr(a, name)) | set(getattr(b, name)):
            getattr(out, name)[key] = getattr(a, name).get(key, []) + getattr(b, name).get(key, [])
    out.items = a.items + b.items
    return out


# --------------------------------------------------------------------------------------------
# regret
# --------------------------------------------------------------------------------------------
def mean_errors(results: list[CellResult], mode: str, layers: int) -> dict:
    """{(candidate, cell index): mean l1 error} for one mode and layer count."""
    out = {}
    for i, r in enumerate(results):
        if r.cell.mode != mode:
            continue
        for (k, m, cap), errs in r.l1.items():
            if k == layers:
                out[((m, cap), i)] = float(np.mean(errs))
    return out


def regrets(errors: dict, candidates) -> dict:
    """{(candidate, cell): E / min over ``candidates`` of E} for the cells every candidate has."""
    cells = {c for (_, c) in errors}
    out = {}
    for c in cells:
        if not all((m, c) in errors for m in candidates):
            continue
        best = min(errors[(m, c)] for m in candidates)
        for m in candidates:
            out[(m, c)] = (
                errors[(m, c)] / best if best > 0 else (1.0 if errors[(m, c)] == 0 else math.inf)
            )
    return out


def worst_regret(reg: dict, candidates) -> dict:
    """{candidate: (max regret, cell where it is reached)}."""
    out = {}
    for m in candidates:
        items = [(v, c) for (mm, c), v in reg.items() if mm == m]
        out[m] = max(items, key=lambda t: t[0])
    return out


def geo_regret(reg: dict, candidates) -> dict:
    return {
        m: float(np.exp(np.mean([math.log(v) for (mm, _), v in reg.items() if mm == m])))
        for m in candidates
    }


def decisive_cells(reg: dict, candidates, factor: float = 1.5, top: int = 3) -> set:
    """Cells that decide the choice: the ``top`` highest-regret cells of every candidate whose
    worst-case regret is within ``factor`` of the lowest. More repetitions there make the
    worst-case comparison less noisy (the maximum of noisy ratios is biased upwards)."""
    worst = worst_regret(reg, candidates)
    best = min(w for w, _ in worst.values())
    out = set()
    for m in candidates:
        if worst[m][0] <= factor * best:
            mine = sorted(((v, c) for (mm, c), v in reg.items() if mm == m), reverse=True)
            out.update(c for _, c in mine[:top])
    return out


def regret_se(results: list[CellResult], layers: int, reg: dict, candidates) -> dict:
    """{(candidate, cell): standard error of regret(candidate, cell)}.

    regret = mean(a) / mean(b), b the cell's best candidate, over the same repetitions (paired):
    delta method with the covariance, var = (s_a^2 - 2 r s_ab + r^2 s_b^2) / (R mean(b)^2).
    """
    out = {}
    cells = {c for (_, c) in reg}
    for c in cells:
        r = results[c]
        best = min(candidates, key=lambda m: np.mean(r.l1[(layers,) + m]))
        b = np.asarray(r.l1[(layers,) + best], dtype=float)
        for m in candidates:
            a = np.asarray(r.l1[(layers,) + m], dtype=float)
            R = len(a)
            if R < 2 or b.mean() == 0:
                out[(m, c)] = math.nan
                continue
            ratio = a.mean() / b.mean()
            cov = np.cov(a, b, ddof=1)
            var = (cov[0, 0] - 2 * ratio * cov[0, 1] + ratio**2 * cov[1, 1]) / (R * b.mean() ** 2)
            out[(m, c)] = math.sqrt(max(var, 0.0))
    return out


def tied(reg: dict, candidates, se: dict | None = None, z: float = 2.0) -> list:
    """Candidates whose worst-case regret is within z standard errors of the lowest one's."""
    worst = worst_regret(reg, candidates)
    lead = min(candidates, key=lambda m: worst[m][0])

    def s(m):
        v = se.get((m, worst[m][1]), math.nan) if se else math.nan
        return 0.0 if math.isnan(v) else v

    top = worst[lead][0] + z * s(lead)
    return [m for m in candidates if worst[m][0] - z * s(m) <= top]


def choose(reg: dict, candidates, se: dict | None = None) -> tuple:
    """Lowest worst-case regret; among the tied (:func:`tied`), the lowest geometric mean."""
    geo = geo_regret(reg, candidates)
    return min(tied(reg, candidates, se), key=lambda m: geo[m])


# --------------------------------------------------------------------------------------------
# coverage of the bootstrap error bars (aggregator.intervals.error_bars)
# --------------------------------------------------------------------------------------------
COVERAGE_R = (1, 2, 3, 5, 10, 20)  # r at which the phi_{>=r} band's pointwise coverage is read
COVERAGE_PHI_R = (1, 2, 3)  # r at which the phi_r interval's coverage is read


def coverage_cells(quick: bool = False) -> list[Cell]:
    """A cross-section of the grid for the (expensive) coverage study: sparse, balanced and dense
    direct cells of several shapes (and one real profile), two hashed cells; eps 0.5 and 1."""
    if quick:
        return [
            Cell("direct", "zipf", 10**3, 10**4, 1.0, 3),
            Cell("hashed", "zipf", 10**4, None, 1.0, 2),
        ]
    reps = 10
    return [
        Cell("direct", "zipf", 10**4, 10**5, 1.0, reps),
        Cell("direct", "uniform", 10**5, 10**4, 0.5, reps),
        Cell("direct", "geometric", 10**4, 10**4, 1.0, reps),
        Cell("direct", "heavy", 10**3, 10**5, 1.0, reps),
        Cell("direct", "zipf1.5", 10**5, 10**5, 0.5, reps),
        Cell("direct", "sc-ru", 1_988, 19_880, 1.0, reps),
        Cell("hashed", "zipf", 10**4, None, 1.0, reps),
        Cell("hashed", "distinct", 10**4, None, 0.5, reps),
    ]


def run_coverage(
    cell: Cell, layers=(1, 2), boot: int = 16, level: float = 0.9, model="both"
) -> dict:
    """Per layer count: over the cell's repetitions, whether the truth fell inside each interval
    of ``intervals.error_bars`` (release defaults), and the interval sizes."""
    from aggregator.intervals import _coverage_2n, error_bars, rank_band_sums
    from aggregator.properties import entropy

    out = {}
    B = cell.counters if cell.mode == "hashed" else None
    for rep in range(cell.reps):
        h, occupied, rng = draw(cell, rep)
        truth = cumulative_from_counts(h)
        values = h if occupied is None else occupied
        for k in layers:
            vc = _noisy(rng, values, cell.counters - len(values), cell.p, k)
            t = time.perf_counter()
            eb = error_bars(
                vc,
                cell.p,
                layers=k,
                n=cell.n,
                buckets=B,
                reps=boot,
                level=level,
                rng=[SEED, rep, k],
                model=model,
            )
            secs = time.perf_counter() - t
            y = cumulative_from_counts(eb["histogram"])
            R = max(len(truth), len(eb["phi_lower"])) + 1
            tr = np.pad(truth, (0, R - len(truth))).astype(float)
            lo = np.pad(eb["phi_lower"], (0, R - len(eb["phi_lower"])))
            hi = np.pad(eb["phi_upper"], (0, R - len(eb["phi_upper"])))
            tr_r = tr[:-1] - tr[1:]
            rlo = np.pad(eb["phi_r_lower"], (0, R - 1 - len(eb["phi_r_lower"])))
            rhi = np.pad(eb["phi_r_upper"], (0, R - 1 - len(eb["phi_r_upper"])))
            at = [r for r in COVERAGE_R if r <= len(truth)]
            bands_true = rank_band_sums(h)
            cov_true = _coverage_2n(h)
            h_true = entropy(h)
            rec = out.setdefault(
                k,
                {
                    "l1": [],
                    "bound": [],
                    "distinct": [],
                    "entropy": [],
                    "phi": [],
                    "phi_r": [],
                    "bands": [],
                    "coverage": [],
                    "width_distinct": [],
                    "seconds": [],
                },
            )
            rec["l1"].append(cumulative_l1(y, truth))
            rec["bound"].append(eb["l1_bound"])
            rec["distinct"].append(bool(lo[0] <= tr[0] <= hi[0]))
            rec["entropy"].append(bool(eb["entropy_nats"][0] <= h_true <= eb["entropy_nats"][1]))
            rec["phi"].append({r: bool(lo[r - 1] <= tr[r - 1] <= hi[r - 1]) for r in at})
            rec["phi_r"].append(
                {
                    r: bool(rlo[r - 1] <= tr_r[r - 1] <= rhi[r - 1])
                    for r in COVERAGE_PHI_R
                    if r <= len(truth)
                }
            )
            rec["bands"].append(
                {
                    i: bool(b[2] <= bands_true[i] <= b[3])
                    for i, b in enumerate(eb["rank_bands"])
                    if b[0] <= len(h)
                }
            )
            lo_c, hi_c = eb["support_coverage_2n"]
            rec["coverage"].append(bool(lo_c - 1e-9 <= cov_true <= hi_c + 1e-9))
            rec["width_distinct"].append(float(hi[0] - lo[0]) / max(tr[0], 1.0))
            rec["seconds"].append(secs)
    return out
