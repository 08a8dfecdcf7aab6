"""Release time of the default release (estimator + error bars), as the service makes it.

Run from the repository root::

    .venv/bin/python -m bench.service.release_time          # D = 1e5, 1e6, 1e7 x 1-3 layers
    .venv/bin/python -m bench.service.release_time --sizes 1e7 --layers 2 --profile
        # where time goes

For each size D (direct mode, D counters; ``--hashed`` adds hashed mode with B = 1e7 buckets) a
real :class:`aggregator.state.PanPrivateHistogram` counts n = D events (``--n`` to override)
drawn from the Zipf(1.1) profile of bench/_data.py (seeded multinomial; the state's noise comes
from the OS CSPRNG as in production). Layers: 1 = the state-only model on a one-layer state;
2 = the joint model (the release draws its own layer) on a one-layer state; 3 = the joint model on
a state with one more layer (``rerandomize``: an in-window snapshot's layer). Timed:
``make_release(state, model=..., error_bar_reps=ERROR_BAR_REPS, method=None)``, the call the
service makes at a window's close (aggregator/service/process.py), against one
``np.bincount(counts - counts.min())`` over the same counters, interleaved in the same run
(the order alternates each repetition, GC off during a timed call). The table shows the median
release time, the median bincount time and the median of the paired per-repetition ratios.

Absolute times depend on the machine and its load (2 shared cores here); the ratio is the
machine-independent figure. Nothing here is judged by a test.
"""

from __future__ import annotations

import cProfile
import datetime
import io
import os
import pstats
import statistics
import sys
import time

import numpy as np

from .._data import weights
from ..harness import cpu_model, git_rev, parser, versions
from aggregator.release import ERROR_BAR_REPS, make_release
from aggregator.state import PanPrivateHistogram
from .speed import _time_once

COMMAND = ".venv/bin/python -m bench.service.release_time"
MODULES = [
    "aggregator/estimate.py",
    "aggregator/selection.py",
    "aggregator/intervals.py",
    "aggregator/largedomain.py",
    "aggregator/release.py",
    "aggregator/wupagh.py",
    "aggregator/properties.py",
    "aggregator/_leaf.py",
]


def build_state(
    D: int, n: int, layers: int, *, hashed: bool = False, seed: int = 2026, profile: str = "zipf"
) -> tuple[PanPrivateHistogram, str]:
    """A state with n events over D items (hashed: the D items hashed into D buckets) and the
    model that gives ``layers`` layers in the release."""
    rng = np.random.default_rng(seed)
    h = rng.multinomial(n, weights(profile, D)).astype(np.int64)
    if hashed:
        state = PanPrivateHistogram(epsilon=1.0, buckets=D)
        items = np.flatnonzero(h)
        idx = state.index_of(items)  # the keyed hash of each distinct item
        state.add_indices(np.repeat(idx, h[items]))
    else:
        state = PanPrivateHistogram(epsilon=1.0, size=D)
        state.add_indices(np.repeat(np.arange(D, dtype=np.int64), h))
    del h
    if layers == 1:
        return state, "state-only"
    for _ in range(layers - 2):
        state.rerandomize()
    return state, "joint"


def time_release(state, model: str, reps: int, bars: int = ERROR_BAR_REPS) -> dict:
    counts = state.counts
    comp = {
        "bincount": lambda: np.bincount(counts - counts.min()),
        "release": lambda: make_release(state, model=model, error_bar_reps=bars, method=None),
    }
    times = {k: [] for k in comp}
    est = None
    for r in range(reps):
        order = list(comp) if r % 2 == 0 else list(comp)[::-1]
        for k in order:  # (each release is cold: its memo goes with it)
            dt, out = _time_once(comp[k])
            times[k].append(dt)
            if k == "release" and est is None:
                est = out["accuracy"]["estimator"]
            del out
    ratios = [a / b for a, b in zip(times["release"], times["bincount"])]
    return {
        "release": statistics.median(times["release"]),
        "bincount": statistics.median(times["bincount"]),
        "ratio": statistics.median(ratios),
        "rmin": min(ratios),
        "rmax": max(ratios),
        "estimator": est,
        "all": times["release"],
    }


def profile_release(state, model: str, top: int = 30) -> str:
    pr = cProfile.Profile()
    pr.enable()
    make_release(state, model=model, error_bar_reps=ERROR_BAR_REPS, method=None)
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("cumulative").print_stats(top)
    st.sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main(argv=None) -> int:
    ap = parser(__doc__, "--sizes 1e4 --layers 1 --hashed 1e4 --reps 1 --error-bar-reps 2")
    ap.add_argument("--sizes", default="1e5,1e6,1e7", help="direct-mode D values")
    ap.add_argument("--layers", default="1,2,3")
    ap.add_argument("--n", type=float, default=None, help="events (default: n = D)")
    ap.add_argument("--hashed", default="1e7", help="hashed-mode B values ('' for none)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile one release per cell")
    ap.add_argument(
        "--error-bar-reps",
        type=int,
        default=ERROR_BAR_REPS,
        help="release.error_bar_reps (default: the service's default; 0: no bars)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.sizes, args.layers, args.hashed, args.reps, args.error_bar_reps = (
            "1e4",
            "1",
            "1e4",
            1,
            2,
        )
    log = lambda s: print(s, flush=True)  # noqa: E731
    sizes = [int(float(x)) for x in args.sizes.split(",") if x]
    hsizes = [int(float(x)) for x in args.hashed.split(",") if x]
    layers = [int(x) for x in args.layers.split(",") if x]
    cmd = COMMAND + (" " + " ".join(sys.argv[1:]) if argv is None and sys.argv[1:] else "")
    log(f"# {cmd}")
    log(
        f"# {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, "
        f"commit {git_rev(MODULES)}, {cpu_model()}, {os.cpu_count()} cores, load "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"{versions(('numpy', 'scipy'))}; error_bar_reps = {args.error_bar_reps}, "
        f"{args.reps} reps"
    )
    log(
        "| mode | counters | n | layers | estimator | release (median) | np.bincount | "
        "ratio (median, min..max) |"
    )
    log("|---|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    cells = [("direct", D) for D in sizes] + [("hashed", B) for B in hsizes]
    for mode, D in cells:
        n = int(args.n) if args.n else D
        for k in layers:
            state, model = build_state(D, n, k, hashed=mode == "hashed")
            if args.profile:
                log(profile_release(state, model))
            res = time_release(state, model, args.reps, args.error_bar_reps)
            log(
                f"| {mode} | {D:.0e} | {n:.0e} | {k} | {res['estimator']} | "
                f"{res['release']:.2f} s | {res['bincount'] * 1e3:.1f} ms | "
                f"{res['ratio']:.0f}x ({res['rmin']:.0f}..{res['rmax']:.0f}) |"
            )
            del state
    log(
        f"# {time.perf_counter() - t0:.0f} s; load at end "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
