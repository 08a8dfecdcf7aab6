"""The hand-off at a window's close: how long the consume loop's ``submit`` of the closed state
(D counters) to the release worker takes, and how fast a counting thread goes in the second
after it against the second before (the pickling runs in the executor's feeder thread; the
worker then estimates on another core).

    python -m bench.service.handoff --counters 1e7 --reps 3
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from aggregator.service.release_worker import ReleaseWorker, compute_release
from aggregator.state import PanPrivateHistogram
from bench.harness import parser


def one(worker: ReleaseWorker, counters: int, rep: int, rng, route: str) -> tuple[float, float]:
    closed = PanPrivateHistogram(1.0, size=counters)
    closed.add_indices(rng.integers(0, counters, counters))
    live = PanPrivateHistogram(1.0, size=counters)
    batch = rng.integers(0, counters, 20000)
    counted, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            live.add_indices(batch)
            counted[0] += len(batch)

    t = threading.Thread(target=count)
    t.start()
    time.sleep(1.0)
    c0 = counted[0]
    time.sleep(1.0)
    before = counted[0] - c0
    c1, t0 = counted[0], time.perf_counter()
    hand = worker.submit if route == "shm" else (lambda *a, **k: worker.call(compute_release,
                                                                            *a, **k))
    future = hand(closed, model="joint", loss="l1", window=rep, rng=None, error_bar_reps=0,
                  method="threshold")
    submit_s = time.perf_counter() - t0
    time.sleep(1.0)
    after = counted[0] - c1
    stop.set()
    t.join()
    future.result()
    return submit_s, after / before


def main(argv=None) -> None:
    ap = parser(__doc__, "--counters 1e4 --reps 1")
    ap.add_argument("--counters", type=float, default=1e7)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.smoke:
        args.counters, args.reps = 1e4, 1
    worker = ReleaseWorker(1)
    rng = np.random.default_rng()
    print(f"cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}; "
          f"D = {args.counters:.0e}")
    print("| route | rep | submit() | counting in the second after / the second before |")
    print("|---|---|---|---|")
    try:
        for rep in range(args.reps):
            for route in ("shm", "pipe"):
                submit_s, ratio = one(worker, int(args.counters), rep, rng, route)
                print(f"| {route} | {rep} | {submit_s * 1000:.1f} ms | {ratio:.2f}x |",
                      flush=True)
    finally:
        worker.close()


if __name__ == "__main__":
    main()
