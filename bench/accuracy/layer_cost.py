"""What the second noise layer costs: E(2 layers) / E(1 layer) of the default, before and after
the layer-scaled EM tolerance (issue 28, "Layer cost").

On the cells of bench/accuracy/lofo.py (every candidate, the same noisy counters per repetition),
the default's (auto / items) l1 error with 2 layers over its error with 1 layer; "before" re-runs
the 2-layer default with the early-stopped EM's tolerance fixed at 1e-5 for every layer count (the
code before ``deconvolution.deconv_tol``), on the same counters. Also the information floor of the
ratio: sqrt(chi2_1 / chi2_2), how much the Cramer-Rao floor on the number of items grows with the
second layer (``intervals.noise_floor``).

Usage (after ``bench.accuracy.lofo --run``)::

    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python -m bench.accuracy.layer_cost
    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python -m bench.accuracy.layer_cost --tol-sweep 2 0
        # --tol-sweep LAYERS REP
    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python -m bench.accuracy.layer_cost --cell jb-zh 10 1.0 3
        # --cell NAME MULT EPS REPS
    .venv/bin/python -m bench.accuracy.layer_cost --best out/lofo_reps16
        # stored errors only, no run
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from aggregator import deconvolution
from aggregator.intervals import noise_floor
from aggregator.noise import p_from_epsilon

from . import grid, lofo
from ..harness import parser
from .lofo import cells, family, load


SWEEP_CELLS = (
    ("jb-zh", 10, 1.0),
    ("jb-zh", 0.1, 0.5),
    ("wf-en", 1, 1.0),
    ("sc-ru", 10, 1.0),
    ("py-ids", 1, 1.0),
    ("ac-en", 0.1, 2.0),
)
SWEEP_SYNTH = (
    ("zipf", 10**5, 10**4, 1.0),
    ("zipf0.7", 10**6, 10**5, 0.5),
    ("uniform", 10**4, 10**5, 2.0),
    ("geometric", 10**5, 10**5, 1.0),
    ("heavy", 10**5, 10**4, 0.5),
    ("zipf2", 10**4, 10**3, 1.0),
)
SWEEP_TOLS = (1e-5, 3e-6, 1.3e-6)


def tol_sweep(layers: int, rep: int) -> None:
    """The early-stopped EM (items cap) at several tolerances on 12 cells, one repetition: the
    measurement behind ``deconvolution.deconv_tol`` (chi2_2 / chi2_1 = 0.31, chi2_3 / chi2_1 = 0.13
    at eps 1, i.e. about 3e-6 and 1.3e-6)."""
    from aggregator.estimate import (
        cap_total,
        cumulative_from_counts,
        cumulative_l1,
        deconvolved_prevalence,
        noisy_value_counts,
        project_l1,
    )
    from .._data import noisy, real_profile
    from .grid import Cell

    cs = [
        Cell("direct", name, int(mult * len(real_profile(name))), len(real_profile(name)), eps, 1)
        for name, mult, eps in SWEEP_CELLS
    ]
    cs += [Cell("direct", dist, n, D, eps, 1) for dist, D, n, eps in SWEEP_SYNTH]
    ratios = {t: [] for t in SWEEP_TOLS}
    for c in cs:
        h, _, rng = grid.draw(c, rep)
        full = np.zeros(c.D, np.int64)
        full[: len(h)] = h
        truth = cumulative_from_counts(h)
        vc = noisy_value_counts(noisy(rng, full, c.p, layers))
        errs = {
            t: cumulative_l1(
                cap_total(
                    project_l1(deconvolved_prevalence(vc, c.p, layers=layers, tol=t)), c.n, "items"
                ),
                truth,
            )
            for t in SWEEP_TOLS
        }
        for t in SWEEP_TOLS:
            ratios[t].append(errs[t] / errs[SWEEP_TOLS[0]])
        print(
            f"{c.dist} n={c.n} D={c.D} eps={c.eps}: "
            + ", ".join(f"tol {t:g}: {e:.0f}" for t, e in errs.items()),
            flush=True,
        )
    print(
        "error / error at 1e-5, geometric mean (max): "
        + ", ".join(
            f"{t:g}: {math.exp(np.mean(np.log(r))):.3f} ({max(r):.2f})" for t, r in ratios.items()
        )
    )


def one_cell(name: str, mult: float, eps: float, reps: int) -> None:
    """The default's 1- and 2-layer errors on one real-profile cell (n = mult x D), with the
    scaled and the fixed early stop, the same counters (the issue's cell: jb-zh 10 1.0)."""
    from .._data import real_profile
    from .grid import Cell

    D = len(real_profile(name))
    c = Cell("direct", name, int(mult * D), D, eps, reps)
    fixed = deconvolution.deconv_tol
    new = grid.run_cell(c, layers=(1, 2), methods=("deconvolution", "mle", "auto"))
    deconvolution.deconv_tol = lambda p, layers=1, hashed=False: deconvolution.DECONV_TOL
    try:
        old = grid.run_cell(c, layers=(1, 2), methods=("deconvolution", "mle", "auto"))
    finally:
        deconvolution.deconv_tol = fixed
    for m in ("deconvolution", "mle", "auto"):
        e1 = float(np.mean(new.l1[(1, m, "items")]))
        o2, n2 = (float(np.mean(r.l1[(2, m, "items")])) for r in (old, new))
        print(
            f"{name} n={c.n} D={D} eps={eps} {m} / items: 1 layer {e1:.0f}; 2 layers fixed "
            f"stop {o2:.0f} ({o2 / e1:.2f}x), scaled stop {n2:.0f} ({n2 / e1:.2f}x)"
        )


def best_ratios(out: str) -> None:
    """Is the layer cost the selection's or the estimators'? From a stored ``bench.accuracy.lofo``
    run (no estimator runs): per direct cell, E(2 layers) / E(1 layer) of the default (auto /
    items) against the same ratio of the best fixed candidate in hindsight at each layer count
    (the six of :data:`bench.accuracy.lofo.FIXED_SIX`, each layer count's own best)."""
    from pathlib import Path

    from . import lofo
    from ..harness import md_table

    lofo.OUT = Path(out) / "lofo_results.pkl"
    rows = []
    for key, r in lofo.load().items():
        if key[0] != "direct":
            continue
        E = {k: float(np.mean(v)) for k, v in r.l1.items()}
        b1 = min(E[(1, *c)] for c in lofo.FIXED_SIX)
        b2 = min(E[(2, *c)] for c in lofo.FIXED_SIX)
        if b1 > 0:
            rows.append((key, E[(2, "auto", "items")] / E[(1, "auto", "items")], b2 / b1))
    a, b = np.array([r[1] for r in rows]), np.array([r[2] for r in rows])
    print(
        f"{len(rows)} direct cells; E(2 layers) / E(1 layer), geometric mean / max: default "
        f"{math.exp(np.log(a).mean()):.2f} / {a.max():.2f}, best fixed candidate "
        f"{math.exp(np.log(b).mean()):.2f} / {b.max():.2f}\n"
    )
    top = sorted(rows, key=lambda r: -r[1])[:8]
    print(
        "\n".join(
            md_table(
                ["cell", "default", "best fixed candidate"],
                [
                    [f"{k[1]} n={k[2]} D={k[3]} eps={k[4]}", f"{x:.2f}", f"{y:.2f}"]
                    for k, x, y in top
                ],
            )
        )
    )


def main(argv=None) -> int:
    ap = parser(
        __doc__,
        "bench.accuracy.lofo's direct smoke cells, 1 and 2 layers, into "
        "out/layer_cost_smoke/, then read",
    )
    ap.add_argument("--best", metavar="OUT_DIR", help="stored errors only, no run")
    ap.add_argument("--tol-sweep", nargs=2, type=int, metavar=("LAYERS", "REP"))
    ap.add_argument("--cell", nargs=4, metavar=("NAME", "MULT", "EPS", "REPS"))
    args = ap.parse_args(argv)
    if args.best:
        best_ratios(args.best)
        return 0
    if args.tol_sweep:
        tol_sweep(*args.tol_sweep)
        return 0
    if args.cell:
        name, mult, eps, reps = args.cell
        one_cell(name, float(mult), float(eps), int(reps))
        return 0
    if args.smoke:  # the lofo run this reads, on lofo's smoke cells
        lofo.CELL_SET[:], lofo.MODES_RUN[:] = ["smoke"], ["direct"]
        lofo.REPS, lofo.LAYERS = 1, (1, 2)
        lofo.OUT = Path("out/layer_cost_smoke/lofo_results.pkl")
        lofo.OUT.parent.mkdir(parents=True, exist_ok=True)
        lofo.run((0, 1))
    res = load()
    rows = []
    fixed = deconvolution.deconv_tol
    for c in cells():
        if c.key not in res:
            continue
        r = res[c.key]
        e1 = float(np.mean(r.l1[(1, "auto", "items")]))
        e2 = float(np.mean(r.l1[(2, "auto", "items")]))
        # the code before
        deconvolution.deconv_tol = lambda p, layers=1, hashed=False: deconvolution.DECONV_TOL
        try:
            # (both layer counts: the noise draws follow in that order, so the 2-layer counters
            # are the same as in the lofo run)
            old = grid.run_cell(c, layers=(1, 2), methods=("auto",))
        finally:
            deconvolution.deconv_tol = fixed
        e2_old = float(np.mean(old.l1[(2, "auto", "items")]))
        p = p_from_epsilon(c.eps)
        floor = noise_floor(1000, p, 2) / noise_floor(1000, p, 1)
        rows.append((c, e1, e2_old, e2, floor))
        print(
            f"{c.mode} {c.dist} n={c.n} D={c.D} eps={c.eps}: 1 layer {e1:.0f}, 2 layers "
            f"{e2_old:.0f} -> {e2:.0f} ({e2_old / max(e1, 1e-9):.2f}x -> "
            f"{e2 / max(e1, 1e-9):.2f}x; floor {floor:.2f}x)",
            flush=True,
        )
    for mode in ("direct", "hashed"):
        sel = [x for x in rows if x[0].mode == mode and x[1] > 0]
        if not sel:
            continue
        before = np.array([x[2] / x[1] for x in sel])
        after = np.array([x[3] / x[1] for x in sel])
        real = [
            i for i, x in enumerate(sel) if family(x[0]) in ("wf", "sc", "ss", "jb", "ac", "py")
        ]
        print(
            f"\n{mode}: {len(sel)} cells; E(2)/E(1) geo-mean "
            f"{math.exp(np.log(before).mean()):.2f}"
            f" -> {math.exp(np.log(after).mean()):.2f}, max {before.max():.2f} -> "
            f"{after.max():.2f}; 2-layer error new / old geo-mean "
            f"{math.exp(np.log(after / before).mean()):.3f} (range {np.min(after / before):.2f}"
            f" .. {np.max(after / before):.2f})"
        )
        if real:
            b, a = before[real], after[real]
            print(
                f"  real profiles ({len(real)} cells): geo-mean {math.exp(np.log(b).mean()):.2f}"
                f" -> {math.exp(np.log(a).mean()):.2f}, max {b.max():.2f} -> {a.max():.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
