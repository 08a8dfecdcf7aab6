"""What the second noise layer costs: E(2 layers) / E(1 layer) of the default, before and after
the layer-scaled EM tolerance (issue 28, "Layer cost").

On the cells of bench/lofo.py (every candidate, the same noisy counters per repetition), the
default's (auto / items) l1 error with 2 layers over its error with 1 layer; "before" re-runs the
2-layer default with the early-stopped EM's tolerance fixed at 1e-5 for every layer count (the
code before ``estimate.deconv_tol``), on the same counters. Also the information floor of the
ratio: sqrt(chi2_1 / chi2_2), how much the Cramer-Rao floor on the number of items grows with the
second layer (``intervals.noise_floor``).

Usage (after ``bench.lofo --run``)::

    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python -m bench.layer_cost
"""

from __future__ import annotations

import math
import sys

import numpy as np

from aggregator import estimate
from aggregator.intervals import noise_floor
from aggregator.noise import p_from_epsilon

from . import grid
from .lofo import cells, family, load


def main() -> int:
    res = load()
    rows = []
    fixed = estimate.deconv_tol
    for c in cells():
        if c.key not in res:
            continue
        r = res[c.key]
        e1 = float(np.mean(r.l1[(1, "auto", "items")]))
        e2 = float(np.mean(r.l1[(2, "auto", "items")]))
        estimate.deconv_tol = lambda p, layers=1: estimate.DECONV_TOL  # the code before
        try:
            # (both layer counts: the noise draws follow in that order, so the 2-layer counters
            # are the same as in the lofo run)
            old = grid.run_cell(c, layers=(1, 2), methods=("auto",))
        finally:
            estimate.deconv_tol = fixed
        e2_old = float(np.mean(old.l1[(2, "auto", "items")]))
        p = p_from_epsilon(c.eps)
        floor = noise_floor(1000, p, 2) / noise_floor(1000, p, 1)
        rows.append((c, e1, e2_old, e2, floor))
        print(f"{c.mode} {c.dist} n={c.n} D={c.D} eps={c.eps}: 1 layer {e1:.0f}, 2 layers "
              f"{e2_old:.0f} -> {e2:.0f} ({e2_old / max(e1, 1e-9):.2f}x -> "
              f"{e2 / max(e1, 1e-9):.2f}x; floor {floor:.2f}x)", flush=True)
    for mode in ("direct", "hashed"):
        sel = [x for x in rows if x[0].mode == mode and x[1] > 0]
        if not sel:
            continue
        before = np.array([x[2] / x[1] for x in sel])
        after = np.array([x[3] / x[1] for x in sel])
        real = [i for i, x in enumerate(sel) if family(x[0]) in ("wf", "sc", "ss", "jb", "ac",
                                                               "py")]
        print(f"\n{mode}: {len(sel)} cells; E(2)/E(1) geo-mean {math.exp(np.log(before).mean()):.2f}"
              f" -> {math.exp(np.log(after).mean()):.2f}, max {before.max():.2f} -> "
              f"{after.max():.2f}; 2-layer error new / old geo-mean "
              f"{math.exp(np.log(after / before).mean()):.3f} (range {np.min(after / before):.2f}"
              f" .. {np.max(after / before):.2f})")
        if real:
            b, a = before[real], after[real]
            print(f"  real profiles ({len(real)} cells): geo-mean {math.exp(np.log(b).mean()):.2f}"
                  f" -> {math.exp(np.log(a).mean()):.2f}, max {b.max():.2f} -> {a.max():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
