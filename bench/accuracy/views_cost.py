"""What the views exchange costs a group's releases (issue 47): error with m members' views over
one process's error, on the same true counts.

A group of m members that each counted part of a window releases the sum of m views, each its
state's layer plus its view's layer: 2m DLap layers per counter where one process's joint release
has 2 (docs/privacy.md section 20a). The counters of the split add up to the window's counts, so
the sum's law is the true counts plus 2m layers, whatever the split: this bench draws that
directly, for m = 1 (one process), 2, 3 and 6, and runs the default estimator (release.estimator
= default, told the layers) on each. Direct mode. The table gives the mean l1 error of the
anonymized histogram and the mean absolute error of the distinct-items count, each as a ratio to
m = 1 on the same counts, with its standard error over the repetitions (delta method).

Cells (``--cells``):

* ``synth``: synthetic profiles (zipf, uniform, heavy, geometric), D = 10^4;
* ``real``: every real frequency profile of bench/_data.py whose package is installed (the
  grid's families :data:`bench._data.REAL` and the held-out ones :data:`bench._data.NEW_REAL`),
  over its first ``--dcap`` items (renormalized; D = min(size, dcap)), at n = D/10 (sparse),
  n = D and n = 10 D (dense); a second table sums them up per regime over the profiles.

    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python -m bench.accuracy.views_cost --reps 6 \\
        --doc docs/scale-out.md
    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m bench.accuracy.views_cost --cells real \\
        --reps 12 --dcap 20000 --eps 1 --doc docs/scale-out.md   # ~25 min on one core
"""

from __future__ import annotations

import sys

import numpy as np

from aggregator.anonymize import anonymized_histogram
from aggregator.noise import p_from_epsilon

from .._data import NEW_REAL, REAL, noisy, real_profile, true_counts
from ..harness import md_table, mean_se, parser, provenance, ratio_se, write_doc_section

MEMBERS = (1, 2, 3, 6)
SYNTH = (
    ("zipf", 10**4, 10**5),
    ("uniform", 10**4, 10**5),
    ("heavy", 10**4, 10**4),
    ("geometric", 10**4, 10**5),
)
#: n over D of the real cells, and the regime each stands for
REGIMES = ((0.1, "sparse"), (1.0, "n ~ D"), (10.0, "dense"))


def _real_cells(dcap: int, names=REAL + NEW_REAL) -> list[tuple[str, int, int]]:
    out = []
    for name in names:
        try:
            D = min(len(real_profile(name)), dcap)
        except ImportError:  # the profile's package is not installed: left out, and said
            print(f"views_cost: {name} left out (its package is not installed)", file=sys.stderr)
            continue
        out += [(name, D, max(1, int(round(f * D)))) for f, _ in REGIMES]
    return out


def _cells(which: str, smoke: bool, dcap: int) -> list[tuple[str, int, int]]:
    if smoke:  # the regimes' path on a small zipf "profile", sparse and dense
        return [("zipf", 500, max(1, int(f * 500))) for f, _ in REGIMES[::2]]
    return (list(SYNTH) if which in ("synth", "all") else []) + (
        _real_cells(dcap) if which in ("real", "all") else []
    )


def _counts(rng, dist: str, D: int, n: int) -> np.ndarray:
    if dist in ("zipf", "uniform", "heavy", "geometric"):
        return true_counts(rng, dist, D, n)
    w = real_profile(dist)[:D]
    return rng.multinomial(n, w / w.sum()).astype(np.int64)


def _errors(h: np.ndarray, est: np.ndarray) -> tuple[float, float]:
    a = np.sort(h[h > 0])[::-1]
    b = np.sort(np.asarray(est)[np.asarray(est) > 0])[::-1]
    k = max(len(a), len(b))
    a = np.pad(a, (0, k - len(a)))
    b = np.pad(b, (0, k - len(b)))
    return float(np.abs(a - b).sum()), float(
        abs(np.count_nonzero(h) - len(np.asarray(est).nonzero()[0]))
    )


def _regime(D: int, n: int) -> str:
    return min(REGIMES, key=lambda r: abs(np.log(n / D) - np.log(r[0])))[1]


def run(reps: int, cells, eps: float) -> list[dict]:
    """One dict per cell: its name, D, n, regime, and for each m the two errors' lists."""
    p = p_from_epsilon(eps, 2)
    out = []
    for dist, D, n in cells:
        errs = {m: ([], []) for m in MEMBERS}
        for r in range(reps):
            rng = np.random.default_rng(1000 + r)
            h = _counts(rng, dist, D, n)
            for m in MEMBERS:
                x = noisy(rng, h, p, 2 * m)
                est = anonymized_histogram(x, p, layers=2 * m, n=int(h.sum()))
                hist, distinct = _errors(h, est)
                errs[m][0].append(hist)
                errs[m][1].append(distinct)
        out.append({"dist": dist, "D": D, "n": n, "regime": _regime(D, n), "errs": errs})
        print(
            f"{dist} D={D} n={n}: "
            + ", ".join(f"m={m} {_ratio(errs[m][0], errs[1][0])}" for m in MEMBERS[1:]),
            file=sys.stderr,
        )
    return out


def _ratio(a, b) -> str:
    r, se = ratio_se(a, b)
    return f"{r:.2f} ± {se:.2f}"


def cell_rows(cells: list[dict]) -> list[list[str]]:
    rows = []
    for c in cells:
        held = " (held out)" if c["dist"] in NEW_REAL else ""
        row = [
            f"{c['dist']}{held} D={c['D']} n={c['n']}",
            c["regime"],
            f"{np.mean(c['errs'][1][0]):,.0f}",
        ]
        for m in MEMBERS[1:]:
            for k in (0, 1):
                row.append(_ratio(c["errs"][m][k], c["errs"][1][k]))
        rows.append(row)
    return rows


def regime_rows(cells: list[dict]) -> list[list[str]]:
    """Per regime and m: the mean over the profiles of each cell's ratio (± its s.e. over the
    profiles) and the range of the cells' ratios."""
    rows = []
    for _, regime in REGIMES:
        mine = [c for c in cells if c["regime"] == regime]
        if not mine:
            continue
        row = [regime, str(len(mine))]
        for m in MEMBERS[1:]:
            for k in (0, 1):
                rs = [ratio_se(c["errs"][m][k], c["errs"][1][k])[0] for c in mine]
                mu, se = mean_se(rs)
                row.append(f"{mu:.2f} ± {se:.2f} ({min(rs):.2f}-{max(rs):.2f})")
        rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = parser(__doc__, "two small zipf cells (sparse, dense), 2 repetitions")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--cells", choices=("synth", "real", "all"), default="all")
    ap.add_argument(
        "--dcap",
        type=int,
        default=20_000,
        help="real profiles: their first DCAP items (D = min(size, DCAP))",
    )
    ap.add_argument("--eps", type=float, default=1.0)
    ap.add_argument(
        "--doc",
        help="write the tables into this doc's views-cost block "
        "(views-cost-real or views-cost-synth with --cells, "
        "-eps<EPS> after it at an eps other than 1)",
    )
    args = ap.parse_args(argv)
    reps = 2 if args.smoke else args.reps
    cells = run(reps, _cells(args.cells, args.smoke, args.dcap), args.eps)
    what = ["histogram l1", "distinct items"]
    head = [f"cell (eps {args.eps:g})", "regime", "l1 at m = 1"] + [
        f"{w}, m = {m}" for m in MEMBERS[1:] for w in what
    ]
    cmd = " ".join(
        ["python -m bench.accuracy.views_cost", *(sys.argv[1:] if argv is None else argv)]
    )
    lines = [
        f"Error of a group's release (m members' views: 2m layers) over one process's "
        f"(2 layers), same counts, {reps} repetitions, ratio ± s.e. ({provenance()}):",
        "",
        *md_table(head, cell_rows(cells)),
    ]
    regimes = regime_rows(
        [c for c in cells if c["dist"] not in [s[0] for s in SYNTH]] if not args.smoke else cells
    )
    if regimes:
        lines += [
            "",
            "Per regime, over the real profiles: mean of the cells' ratios ± its s.e. "
            "over the profiles (the cells' range):",
            "",
            *md_table(
                ["regime", "cells"] + [f"{w}, m = {m}" for m in MEMBERS[1:] for w in what], regimes
            ),
        ]
    lines += ["", f"Command: `{cmd}`."]
    print("\n".join(lines))
    if args.doc and not args.smoke:
        name = "views-cost" if args.cells == "all" else f"views-cost-{args.cells}"
        name += "" if args.eps == 1 else f"-eps{args.eps:g}"
        write_doc_section(args.doc, "bench", name, lines)


if __name__ == "__main__":
    main()
