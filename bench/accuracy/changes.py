"""Changes between windows, expected errors and the 2x flag, measured against known truth.

For each cell, a run of windows is drawn from one distribution (stationary: fresh events and fresh
noise every window, the same distribution), each released as the service does
(:func:`aggregator.release.estimate_with_accuracy`, 10 bootstrap draws, level 0.9). Measured:

* false alarms: the fraction of consecutive window pairs that :func:`aggregator.changes.compare`
  calls a significant change (distinct items, entropy) at level 0.9;
* power: pairs whose second window holds 20% more distinct items (same n), the fraction called
  significant (and in the right direction);
* expected error: the root-mean-square of the releases' actual errors against truth over the
  root-mean-square of their stated ``expected_error`` (1 = calibrated), and how often the actual
  error exceeded twice the stated one;
* the 2x flag: releases with distinct items off by more than 2x, and how many of them were not
  flagged ``signal_below_noise``;
* interval coverage of distinct items and entropy.

Benchmark only: seeded numpy noise (not private). Usage::

    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python -m bench.accuracy.changes [--quick] [--windows 40]
"""

from __future__ import annotations

import json
import math
import sys
import time

import numpy as np

from aggregator import changes, intervals
from aggregator.properties import entropy
from aggregator.release import estimate_with_accuracy, package_release
from bench._data import true_counts
from bench.harness import parser
from bench.accuracy.largedomain import hash_items, items_counts, noisy_vc

# name, mode, counters (D or B), n, item model, eps, layers
CELLS = [
    ("issue: hashed users", "hashed", 200_000, 100_000, "distinct", 1.0, 2),
    ("hashed zipf", "hashed", 200_000, 100_000, "zipf", 1.0, 2),
    ("direct zipf dense", "direct", 100_000, 100_000, "zipf", 1.0, 2),
    ("direct zipf sparse", "direct", 1_000_000, 100_000, "zipf", 1.0, 2),
    ("direct zipf 1 layer", "direct", 100_000, 100_000, "zipf", 1.0, 1),
    ("direct users", "direct", 1_000_000, 100_000, "users", 1.0, 2),
    # the silent 2x errors: real profiles at n = D / 10 with 2 layers
    ("jieba n=D/10", "direct", 349_046, 34_904, "jb-zh", 1.0, 2),
    ("autocorrect n=D/10", "direct", 91_246, 9_124, "ac-en", 1.0, 2),
    ("wordfreq-en n=D/10", "direct", 100_000, 10_000, "wf-en", 0.5, 2),
    ("spellchecker-ru n=D/10", "direct", 19_880, 1_988, "sc-ru", 1.0, 2),
]
SMOKE_CELL = ("smoke: direct zipf", "direct", 300, 300, "zipf", 1.0, 2)  # --smoke
USERS_PER_EVENT = 0.3  # "users": d = 0.3 n items, counts 1 + Poisson(n / d - 1)


def users_counts(rng, n: int, d: int) -> np.ndarray:
    """d items with counts 1 + Poisson(n / d - 1), rescaled to sum to n exactly."""
    c = 1 + rng.poisson(max(n / d - 1.0, 0.0), d)
    extra = int(c.sum()) - n
    while extra > 0:  # take events back from items above 1, at random
        idx = rng.choice(np.flatnonzero(c > 1), size=min(extra, int((c > 1).sum())), replace=False)
        c[idx] -= 1
        extra = int(c.sum()) - n
    if extra < 0:
        np.add.at(c, rng.integers(0, d, -extra), 1)
    return c.astype(np.int64)


def window(rng, cell, change: float = 1.0):
    """(true item counts, noisy value counts) of one window; ``change`` scales the number of
    distinct items of the "users" model (the other models: distinct items via n)."""
    _, mode, C, n, model, eps, layers = cell
    p = math.exp(-eps / 2)
    if model == "users":
        items = users_counts(rng, n, int(round(USERS_PER_EVENT * n * change)))
    elif mode == "direct":
        items = true_counts(rng, model, C, n)
        items = items[items > 0]
    else:
        _, items = items_counts(rng, n, model)
    if model == "distinct" and change != 1.0:
        # the users: one event each mostly; 20% more users = 20% more events
        _, items = items_counts(rng, int(round(n * change)), model)
    if mode == "direct":
        vc = noisy_vc(rng, items, C - len(items), p, layers)
    else:
        buckets = hash_items(rng, np.char.add(b"u", np.arange(len(items)).astype(np.bytes_)), C)
        red = np.bincount(buckets, weights=items, minlength=C).astype(np.int64)
        window.last_reduced = red  # the true bucket totals, for hashed_diagnostic
        occ = red[red > 0]
        vc = noisy_vc(rng, occ, C - len(occ), p, layers)
    return items, vc, p


_LAST_BARS: list = []
_error_bars = intervals.error_bars


def _keep_bars(*a, **k):
    """intervals.error_bars, keeping its raw figures for the variants this bench compares."""
    out = _error_bars(*a, **k)
    _LAST_BARS.append(out)
    return out


intervals.error_bars = _keep_bars


def release(vc, p, cell, n):
    _, mode, C, _, _, eps, layers = cell
    _LAST_BARS.clear()
    hist, acc = estimate_with_accuracy(
        vc, p, layers=layers, n=n, buckets=C if mode == "hashed" else None, reps=10
    )
    rel = package_release(
        hist, window=None, n=n, epsilon=eps, neighbor="replace-one", model="joint", accuracy=acc
    )
    b = _LAST_BARS[-1]
    rel["_raw"] = {
        k: {"rms": b["rms_error"][k], "gap": b["stand_in_gap"][k], "spread": b["spread"][k]}
        for k in ("distinct", "entropy")
    }
    return rel


def run_cell(cell, windows: int, changed_pairs: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    rows = []
    for w in range(windows):
        items, vc, p = window(rng, cell)
        rel = release(vc, p, cell, int(items.sum()))
        rows.append((items, rel))
    res = {
        "cell": cell[0],
        "mode": cell[1],
        "counters": cell[2],
        "n": cell[3],
        "model": cell[4],
        "eps": cell[5],
        "layers": cell[6],
        "windows": windows,
    }
    fa = {s: [] for s in changes.STATISTICS}
    for (_, a), (_, b) in zip(rows[:-1], rows[1:]):
        c = changes.compare(a, b)
        for s in changes.STATISTICS:
            fa[s].append(bool(c[s]["significant"]))
    res["false_alarm"] = {s: float(np.mean(v)) for s, v in fa.items()}
    # errors against the truth
    d_err, d_exp, h_err, h_exp, cov_d, cov_h, off2, off2_unflagged, flagged = ([] for _ in range(9))
    for items, rel in rows:
        acc = rel["accuracy"]
        td, th = len(items), entropy(np.sort(items)[::-1])
        ed, eh = rel["properties"]["distinct_items"], rel["properties"]["entropy_nats"]
        d_err.append(ed - td)
        h_err.append(eh - th)
        d_exp.append(acc["expected_error"]["distinct_items"])
        h_exp.append(acc["expected_error"]["entropy_nats"])
        lo, hi = acc["intervals"]["distinct_items"]
        cov_d.append(lo <= td <= hi)
        lo, hi = acc["intervals"]["entropy_nats"]
        cov_h.append(lo <= th <= hi)
        bad = ed > 2 * td or ed < td / 2
        off2.append(bad)
        off2_unflagged.append(bad and not rel["signal_below_noise"])
        flagged.append(bool(rel["signal_below_noise"]))
    d_err, h_err = np.asarray(d_err, float), np.asarray(h_err, float)
    d_exp, h_exp = np.asarray(d_exp, float), np.asarray(h_exp, float)
    res["true_distinct"] = float(np.mean([len(i) for i, _ in rows]))
    res["rms_rel_error_distinct"] = float(np.sqrt(np.mean((d_err / res["true_distinct"]) ** 2)))
    res["expected_calibration"] = {
        "distinct": float(np.sqrt(np.mean(d_err**2)) / np.sqrt(np.mean(d_exp**2))),
        "entropy": float(np.sqrt(np.mean(h_err**2)) / np.sqrt(np.mean(h_exp**2))),
    }
    for variant in ("rms", "gap", "spread"):
        for k, err in (("distinct", d_err), ("entropy", h_err)):
            v = np.asarray([r["_raw"][k][variant] for _, r in rows])
            res.setdefault("calibration_of", {})[f"{k}:{variant}"] = round(
                float(np.sqrt(np.mean(err**2)) / max(np.sqrt(np.mean(v**2)), 1e-12)), 3
            )
    res["beyond_2x_expected"] = {
        "distinct": float(np.mean(np.abs(d_err) > 2 * d_exp)),
        "entropy": float(np.mean(np.abs(h_err) > 2 * h_exp)),
    }
    res["coverage"] = {"distinct": float(np.mean(cov_d)), "entropy": float(np.mean(cov_h))}
    res["off_2x"] = int(sum(off2))
    res["off_2x_unflagged"] = int(sum(off2_unflagged))
    res["flagged"] = int(sum(flagged))
    res["stated_rel_error_distinct"] = float(
        np.median(
            [r["accuracy"]["expected_relative_error"]["distinct_items"] or np.nan for _, r in rows]
        )
    )
    # what `panagg plan` / the start line said before any data, for the matching shape
    shape = {"zipf": "zipf", "distinct": "distinct"}.get(cell[4])
    if shape:
        from aggregator.release import planned_accuracy

        res["planned_rel_error"] = planned_accuracy(
            cell[2], math.exp(-cell[5] / 2), cell[6], cell[3], hashed=cell[1] == "hashed"
        )[shape]
        res["stated_rel_error_entropy"] = float(
            np.median([r["accuracy"]["expected_relative_error"]["entropy_nats"] for _, r in rows])
        )
    # power: a window, then one with 20% more distinct items
    hits = {s: [] for s in changes.STATISTICS}
    true_rel = []
    if changed_pairs and cell[4] in ("users", "distinct"):
        for _ in range(changed_pairs):
            i0, vc0, p = window(rng, cell)
            i1, vc1, _ = window(rng, cell, change=1.2)
            a, b = release(vc0, p, cell, int(i0.sum())), release(vc1, p, cell, int(i1.sum()))
            true_rel.append(len(i1) / len(i0) - 1)
            c = changes.compare(a, b)
            for s in changes.STATISTICS:
                hits[s].append(c[s]["direction"])
        # more distinct items and the same (or 20% more) events: both statistics rise
        res["power_20pct"] = {s: float(np.mean([d == 1 for d in v])) for s, v in hits.items()}
        res["power_pairs"] = changed_pairs
        res["power_true_distinct_change"] = float(np.mean(true_rel))
    return res


def plot_example(path: str) -> None:
    """docs/img/history_example.png: `panagg history --plot` of 16 made-up releases (distinct
    items ~1000 +- 30, +30% from the 11th on; one release flagged below the noise), to show the
    plot's bands and marks; not a measurement."""
    from aggregator.service.status import plot_history, release_history

    class _Ledger:
        entries: list = []

    rng = np.random.default_rng(0)
    docs = []
    for i in range(16):
        up = i >= 10
        d = 1000 * (1.3 if up else 1.0) + rng.normal(0, 30)
        h = 6 + rng.normal(0, 0.01) + (0.2 if up else 0)
        docs.append(
            {
                "window": 59849607 + i,
                "n": 5000,
                "properties": {"distinct_items": int(d), "entropy_nats": h},
                "accuracy": {
                    "standard_error": {"distinct_items": 35.0, "entropy_nats": 0.012},
                    "intervals": {
                        "reps": 10,
                        "level": 0.9,
                        "distinct_items": [d - 80, d + 90],
                        "entropy_nats": [5.95 + 0.2 * up, 6.05 + 0.2 * up],
                    },
                },
                "signal_below_noise": i == 3,
            }
        )
    led = _Ledger()
    led.entries = [
        {"kind": "release", "time_unix": 1795000000 + 30 * i, "document": json.dumps(d)}
        for i, d in enumerate(docs)
    ]
    plot_history(release_history(led), path)


def hashed_diagnostic(windows: int = 4) -> None:
    """The issue's hashed setting (cell 0), window by window: truth, release, its interval at
    the internal level hashed releases use (release.internal_level(0.9, "hashed")), both
    candidate fits, the bootstrap's spread and root-mean-square
    deviation (docs/accuracy_changes.md, "Intervals at their level"). Then where the under-count
    comes from: the inversion of Gamma^B applied to the *true* bucket totals (exact if the
    inversion is not the cause); the second moment of the bucket totals, sum_b T_b^2, true, the
    counters' unbiased estimate (sum x^2 - B Var Z) and the early-stopped EM's fit; and the
    number of SQUAREM steps that EM makes before its stop."""
    from aggregator.estimate import (
        cap_total,
        cumulative_from_counts,
        DECONV_MAX_ITER,
        DECONV_TOL,
        em_prevalences,
        _em_problem,
        noise_pmf,
        _squarem,
        ReleaseMemo,
    )
    from aggregator.anonymize import anonymized_cumulative, anonymized_histogram
    from aggregator.largedomain import _invert
    from aggregator.release import internal_level

    inner = internal_level(0.9, "hashed")
    rng = np.random.default_rng(7)
    cell = CELLS[0]
    K, q = noise_pmf(math.exp(-cell[5] / 2), cell[6])
    var_z = float((np.arange(-K, K + 1) ** 2 * q).sum())
    for _ in range(windows):
        items, vc, p = window(rng, cell)
        n, B = int(items.sum()), cell[2]
        memo = ReleaseMemo()  # the release's choices, handed to its error bars
        h = anonymized_histogram(vc, p, layers=cell[6], n=n, buckets=B, memo=memo)
        eb = intervals.error_bars(
            vc, p, layers=cell[6], n=n, buckets=B, reps=10, level=inner, release=h, memo=memo
        )
        fits = {
            m: int(
                anonymized_cumulative(vc, p, layers=cell[6], n=n, buckets=B, method=m, memo=memo)[0]
            )
            for m in ("deconvolution", "mle")
        }
        red = window.last_reduced
        inv = cap_total(
            _invert(cumulative_from_counts(red[red > 0]).astype(float), B, n, p, "exact", None),
            n,
            "items",
        )
        steps = []
        early = em_prevalences(vc, p, layers=cell[6], hashed=True)[0]
        prob = _em_problem(vc, p, cell[6])
        w = prob.w / prob.w.sum()
        _squarem(
            prob.start(w),
            w,
            w > 0,
            prob.q,
            prob.allowed,
            DECONV_MAX_ITER,
            DECONV_TOL,
            prob.zero_idx,
            callback=lambda step, pi: steps.append(step) and False,
        )
        v = np.arange(vc.lo, vc.hi + 1, dtype=float)
        m2_fit = float(((2 * np.arange(1, len(early) + 1) - 1) * early).sum())
        m2_mom = float((v * v * vc.c).sum()) - B * var_z
        print(
            f"truth {len(items)}, release {len(h)}, interval "
            f"[{eb['distinct'][0]:.0f}, {eb['distinct'][1]:.0f}], fits {fits}, spread "
            f"{eb['spread']['distinct']:.0f}, rms {eb['rms_error']['distinct']:.0f}; "
            f"inversion of the true bucket totals {int(inv[0])}; "
            f"sum T^2: true {int((red.astype(float) ** 2).sum())}, "
            f"unbiased {m2_mom:.0f}, early EM {m2_fit:.0f}; early EM steps {len(steps)}",
            flush=True,
        )


def plan_spread(draws: int = 8) -> None:
    """How much `panagg plan`'s figure (the median over PLAN_WINDOWS simulated windows of the
    expected relative error of distinct items) moves between draws of its synthetic windows:
    what a fresh draw in each process gave before the plan was seeded by its configuration."""
    from aggregator import release

    D, n, layers, p = 10**6, 40_000, 2, math.exp(-0.5)
    default = release.PLAN_WINDOWS
    try:
        for windows in (3, 5):
            release.PLAN_WINDOWS = windows
            figs = {shape: [] for shape in release.PLAN_SHAPES}
            for seed in range(draws):
                plan = release.planned_accuracy(D, p, layers, n, hashed=False, rng=1000 + seed)
                for shape in figs:
                    figs[shape].append(100 * plan[shape]["distinct_items"])
            for shape, v in figs.items():
                print(
                    f"{windows} windows, {shape}: +-{min(v):.1f}% to +-{max(v):.1f}% distinct "
                    f"items (median {np.median(v):.1f}%) over {draws} draws",
                    flush=True,
                )
    finally:
        release.PLAN_WINDOWS = default


def main(argv=None) -> int:
    ap = parser(__doc__, "2 windows, 1 changed pair of one tiny cell (D = n = 300)")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--pairs", type=int, default=20, help="changed pairs per cell (power)")
    ap.add_argument("--cells", default="", help="comma-separated cell numbers (default all)")
    ap.add_argument("--quick", action="store_true", help="12 windows, 6 pairs")
    ap.add_argument("--out", default="out/changes.json")
    ap.add_argument("--plot-example", metavar="PNG", help="only write the history plot example")
    ap.add_argument(
        "--hashed-diagnostic",
        action="store_true",
        help="only the issue's hashed setting, window by window",
    )
    ap.add_argument(
        "--planned-only",
        action="store_true",
        help="only print planned_accuracy for the cells with a reference shape",
    )
    ap.add_argument(
        "--plan-spread",
        action="store_true",
        help="only the spread of the plan's figures over 8 draws of its synthetic "
        "windows (D = 1e6, n = 4e4, 2 layers, eps 1), with 3 and 5 windows",
    )
    args = ap.parse_args(argv)
    if args.plan_spread:
        plan_spread()
        return 0
    if args.plot_example:
        plot_example(args.plot_example)
        return 0
    if args.hashed_diagnostic:
        hashed_diagnostic()
        return 0
    if args.planned_only:  # what `panagg plan` says for the cells with a reference shape
        from aggregator.release import planned_accuracy

        for i in [int(c) for c in args.cells.split(",")] if args.cells else range(len(CELLS)):
            cell = CELLS[i]
            shape = {"zipf": "zipf", "distinct": "distinct"}.get(cell[4])
            if shape:
                print(
                    json.dumps(
                        {
                            "cell": cell[0],
                            "planned": planned_accuracy(
                                cell[2],
                                math.exp(-cell[5] / 2),
                                cell[6],
                                cell[3],
                                hashed=cell[1] == "hashed",
                            )[shape],
                        }
                    ),
                    flush=True,
                )
        return 0
    if args.quick:
        args.windows, args.pairs = 12, 6
    cells = CELLS
    if args.smoke:
        args.windows, args.pairs, cells = 2, 1, [SMOKE_CELL]
    pick = [int(i) for i in args.cells.split(",")] if args.cells else range(len(cells))
    out = []
    for i in pick:
        t0 = time.time()
        r = run_cell(cells[i], args.windows, args.pairs, seed=1000 + i)
        r["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(r), flush=True)
        out.append(r)
    from pathlib import Path

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
