"""An ``auto`` variant of :mod:`bench.accuracy.lofo` (``--extra``) on every direct cell of the
accuracy grid, beside the fixed candidates and ``auto``: the check a variant that won the
leave-one-family-out cells must pass on the grid's other cells before it becomes a default.

Each cell runs its own repetitions with the grid's seeds (:func:`bench.accuracy.grid.draw`); every
candidate sees the same noisy counters. Regret as ``bench.accuracy.lofo --versus`` reads it
(:func:`bench.accuracy.lofo.versus_rows`): a candidate's mean l1 error over the best mean of the six
fixed candidates (threshold / EM / NPMLE x items / scale) and itself, and for the variant also
against a best that includes the three fixed ``fitted`` candidates (the fair reference if the
library offered that cap).

Usage (results in out/grid_extra/<variant>.<shard>.pkl; shards run in parallel)::

    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python -m bench.accuracy.grid_extra --run auto_fitted \
        --shard 0/2
    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python -m bench.accuracy.grid_extra --run auto_fitted \
        --shard 1/2
    .venv/bin/python -m bench.accuracy.grid_extra --report auto_fitted
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import numpy as np

from . import grid, lofo
from ..harness import md_table, parser, shard_arg, shard_of

OUT = Path("out") / "grid_extra"


def _path(variant: str, shard: str, layers: int = 1) -> Path:
    # (1 layer keeps the names of the first runs)
    tag = "" if layers == 1 else f".{layers}layers"
    return OUT / f"{variant}{tag}.{shard.replace('/', 'of')}.pkl"


def run(variant: str, shard: str, layers: int = 1, smoke: bool = False) -> None:
    """The shard's direct grid cells (cheapest first), resumable: a finished cell is saved
    (``smoke``: the grid's smoke cell instead)."""
    path = _path(variant, shard, layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = pickle.loads(path.read_bytes()) if path.exists() else {}
    cells = sorted(
        (c for c in grid.grid_cells("smoke" if smoke else False) if c.mode == "direct"),
        key=lambda c: (c.n > 10 * (c.D or 1), c.n),
    )
    methods = lofo.METHODS + (variant,)
    for c in shard_of(cells, shard):
        if c.key in done:
            continue
        t = time.time()
        done[c.key] = grid.run_cell(c, layers=(layers,), methods=methods, estimate=lofo._estimate_y)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(done))
        tmp.replace(path)
        print(
            f"{c.dist} n={c.n} D={c.D} eps={c.eps} reps={c.reps}: {time.time() - t:.1f} s",
            flush=True,
        )


def load(variant: str, layers: int = 1) -> dict:
    out = {}
    for f in sorted(OUT.glob(_path(variant, "*", layers).name)):
        if layers == 1 and "layers." in f.name:
            continue  # another layer count's file
        out.update(pickle.loads(f.read_bytes()))
    return out


def report(variant: str, layers: int = 1) -> None:
    rows = lofo.versus_rows(load(variant, layers).values(), variant, layers)
    if not rows:
        print(f"no results for {variant} at {layers} layer(s) in {OUT}: run --run {variant} first")
        return
    print(f"{len(rows)} direct grid cells, {layers} layer{'s' * (layers > 1)}\n")
    table = []
    for j, name in (
        (2, "auto (default)"),
        (3, variant),
        (4, f"{variant}, fixed fitted caps in the best"),
    ):
        v = np.array([r[j] for r in rows])
        c = max(rows, key=lambda r: r[j])[1]
        table.append(
            [
                name,
                f"{np.median(v):.3f}",
                f"{np.exp(np.mean(np.log(v))):.3f}",
                f"{v.max():.2f} ({c.dist} n={c.n} D={c.D} eps={c.eps})",
                int((v > 1.5).sum()),
            ]
        )
    print("\n".join(md_table(["", "median", "geo-mean", "worst (cell)", "cells above 1.5"], table)))
    print("\nlargest changes (auto -> variant):")
    for r in sorted(rows, key=lambda r: abs(np.log(r[3] / r[2])), reverse=True)[:8]:
        c = r[1]
        print(f"  {c.dist} n={c.n} D={c.D} eps={c.eps}: {r[2]:.2f} -> {r[3]:.2f}")


def main(argv=None) -> int:
    ap = parser(__doc__, "--run and --report auto_fitted on the grid's direct smoke cell")
    ap.add_argument("--run", metavar="VARIANT", choices=sorted(lofo.EXTRA))
    ap.add_argument("--shard", type=shard_arg, default="0/1")
    ap.add_argument("--report", metavar="VARIANT", choices=sorted(lofo.EXTRA))
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="noise layers of the counters (default 1; the grid's layer counts)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.run = args.report = "auto_fitted"
    if not (args.run or args.report):
        ap.error("give --run VARIANT and/or --report VARIANT")
    if args.run:
        run(args.run, args.shard, args.layers, args.smoke)
    if args.report:
        report(args.report, args.layers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
