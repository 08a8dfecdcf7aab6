"""What the views exchange costs a group's releases (issue 47): error with m members' views over
one process's error, on the same true counts.

A group of m members that each counted part of a window releases the sum of m views, each its
state's layer plus its view's layer: 2m DLap layers per counter where one process's joint release
has 2 (docs/privacy.md section 20a). The counters of the split add up to the window's counts, so
the sum's law is the true counts plus 2m layers, whatever the split: this bench draws that
directly, for m = 1 (one process), 2, 3 and 6, and runs the default estimator (release.estimator
= default, told the layers) on each. Cells: synthetic profiles and real frequency profiles (the
held-out families of bench/accuracy/lofo.py), direct mode. The table gives the mean l1 error of the
anonymized histogram and the mean absolute error of the distinct-items count, each as a ratio to
m = 1 on the same counts, with its standard error over the repetitions.

    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python -m bench.accuracy.views_cost --reps 6 \\
        --doc docs/scale-out.md
"""

from __future__ import annotations

import numpy as np

from aggregator.anonymize import anonymized_histogram
from aggregator.noise import p_from_epsilon

from .._data import noisy, real_profile, true_counts
from ..harness import md_table, parser, provenance, ratio_se, write_doc_section

MEMBERS = (1, 2, 3, 6)
SYNTH = (("zipf", 10**4, 10**5), ("uniform", 10**4, 10**5), ("heavy", 10**4, 10**4),
         ("geometric", 10**4, 10**5))
REAL = (("wf-en", 10**5), ("sc-es", 10**5))
EPS = 1.0


def _cells(smoke: bool):
    if smoke:
        return [("zipf", 500, 2000)]
    out = list(SYNTH)
    for name, n in REAL:
        try:
            D = len(real_profile(name))
        except Exception:     # the profile's package is not installed: synthetic cells only
            continue
        out.append((name, min(D, 20000), n))
    return out


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
    return float(np.abs(a - b).sum()), float(abs(np.count_nonzero(h) - len(np.asarray(est)
                                                                               .nonzero()[0])))


def run(reps: int, smoke: bool) -> list[list[str]]:
    p = p_from_epsilon(EPS, 2)
    rows = []
    for dist, D, n in _cells(smoke):
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
        row = [f"{dist} D={D} n={n}"]
        for m in MEMBERS[1:]:
            for k in (0, 1):
                row.append(_ratio(errs[m][k], errs[1][k]))
        rows.append(row)
    return rows


def _ratio(a, b) -> str:
    r, se = ratio_se(a, b)
    return f"{r:.2f} ± {se:.2f}"


def main(argv=None) -> None:
    ap = parser(__doc__, "one small zipf cell, 2 repetitions")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--doc", help="write the table into this doc's views-cost block")
    args = ap.parse_args(argv)
    reps = 2 if args.smoke else args.reps
    rows = run(reps, args.smoke)
    head = ["cell (eps 1)"] + [f"{what}, m = {m}" for m in MEMBERS[1:]
                               for what in ("histogram l1", "distinct items")]
    lines = [f"Error of a group's release over one process's (same counts, {reps} "
             f"repetitions, ratio ± s.e.; {provenance()}):", "", *md_table(head, rows)]
    print("\n".join(lines))
    if args.doc and not args.smoke:
        write_doc_section(args.doc, "bench", "views-cost", lines)


if __name__ == "__main__":
    main()
