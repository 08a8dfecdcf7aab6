"""Time of a group's sum rollup: each partition's fold per close and the leader's merge.

    python -m bench.service.group_rollup_time D P K REPS

D counters in P slices; each slice folds K views (zipf(1.3) counts of 20,000 / P events plus
two DLap layers, as a joint-model release view) through SliceRollups.fold, then the leader
merges the P rollup summaries (merge_summaries, REPS error-bar repetitions). Prints the mean
fold time per close (deepcopy of the sum, update, to_bytes) and the merge + estimate time.
"""

import json
import time
from types import SimpleNamespace

import numpy as np

from aggregator.noise import discrete_laplace
from aggregator.service.group.repartition import slice_size
from aggregator.service.group.rollups import SliceRollups
from aggregator.service.group.summary import merge_summaries
from aggregator.state import PanPrivateHistogram
from bench.harness import parser


def run(D: int, P: int, k: int, reps: int) -> None:
    ident = {"lineage": "L", "model": "joint", "window_size": 3600.0, "partitions": P, "size": D}
    rolls = SliceRollups({"x": k}, None, ident)
    rng = np.random.default_rng()  # synthetic counts; the layers come from the CSPRNG
    summaries, folding = [], 0.0
    for p in range(P):
        rolls.sums[p] = {}
        proto = PanPrivateHistogram(1.0, size=slice_size(D, P, p))
        for w in range(k):
            items = rng.zipf(1.3, 20_000 // P) % proto.size
            view = (
                np.bincount(items, minlength=proto.size)
                + discrete_laplace(proto.p, proto.size)
                + discrete_laplace(proto.p, proto.size)
            )
            state = SimpleNamespace(
                p=proto.p,
                mode=proto.mode,
                size=proto.size,
                epsilon=proto.epsilon,
                neighbor=proto.neighbor,
                n=len(items),
            )
            t0 = time.perf_counter()
            msgs, apply = rolls.fold(p, w, (view, 2), state=state, events=len(items), member="m")
            apply()
            folding += time.perf_counter() - t0
        summaries.append(json.loads(msgs[0][3]))
    t0 = time.perf_counter()
    rel = merge_summaries(summaries, error_bar_reps=reps)
    print(
        f"D={D} P={P} k={k} reps={reps} layers={rel['layers']} n={rel['n']} "
        f"fold per close={1000 * folding / (P * k):.1f} ms "
        f"merge+estimate={time.perf_counter() - t0:.1f} s"
    )


def main(argv=None) -> None:
    ap = parser(__doc__, "D = 1000, P = 2, K = 2, REPS = 2 (error bars need two)")
    for name in ("D", "P", "K", "REPS"):
        ap.add_argument(name, type=int, nargs="?")
    args = ap.parse_args(argv)
    if args.smoke:
        args.D, args.P, args.K, args.REPS = 1000, 2, 2, 2
    if None in (args.D, args.P, args.K, args.REPS):
        ap.error("give D P K REPS (or --smoke)")
    run(args.D, args.P, args.K, args.REPS)


if __name__ == "__main__":
    main()
