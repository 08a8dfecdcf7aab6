"""The hand-off at a window's close: how long the consume loop's ``submit`` of the closed state
(D counters) to the release worker takes, the CPU it costs this process (the loop's thread in
``submit`` and, for the pipe, the executor's feeder thread pickling), and how fast a counting
thread goes in the second after it against the second before (the worker then estimates on
another core). Routes: ``housed`` (the state counted in its own shared block, drawn so beside
the loop: what the service does from 1e5 counters on), ``shm`` (copied into a fresh block at
the close: a state drawn before the worker started), ``pipe`` (pickled through the pool).

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
    if route == "housed":
        closed = worker.house(closed)
    closed.add_indices(rng.integers(0, counters, counters))
    live = PanPrivateHistogram(1.0, size=counters)
    batch = rng.integers(0, counters, 20000)
    counted, counting_cpu, stop = [0], [0.0], threading.Event()

    def count():
        while not stop.is_set():
            live.add_indices(batch)
            counted[0] += len(batch)
            counting_cpu[0] = time.thread_time()

    t = threading.Thread(target=count)
    t.start()
    time.sleep(1.0)
    c0 = counted[0]
    time.sleep(1.0)
    before = counted[0] - c0
    c1, t0, cpu0, count0 = counted[0], time.perf_counter(), time.process_time(), counting_cpu[0]
    hand = (
        worker.submit
        if route != "pipe"
        else (lambda *a, **k: worker.call(compute_release, *a, **k))
    )
    tt0 = time.thread_time()
    future = hand(
        closed, model="joint", loss="l1", window=rep, rng=None, error_bar_reps=0, method="threshold"
    )
    submit_cpu = time.thread_time() - tt0
    submit_s = time.perf_counter() - t0
    del closed  # the loop lets go of the closed state (the service's task.state = None)
    time.sleep(1.0)
    after = counted[0] - c1
    # this process's CPU in the second after the close, beyond the counting thread's
    handoff_cpu = (time.process_time() - cpu0) - (counting_cpu[0] - count0)
    stop.set()
    t.join()
    future.result()
    return submit_s, submit_cpu, handoff_cpu, after / before


def main(argv=None) -> None:
    ap = parser(__doc__, "--counters 1e4 --reps 1")
    ap.add_argument("--counters", type=float, default=1e7)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.smoke:
        args.counters, args.reps = 1e4, 1
    worker = ReleaseWorker(1)
    rng = np.random.default_rng()
    print(
        f"cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}; D = {args.counters:.0e}"
    )
    print(
        "| route | rep | submit() | its CPU | hand-off CPU in the second after | "
        "counting in the second after / the second before |"
    )
    print("|---|---|---|---|---|---|")
    try:
        for rep in range(args.reps):
            for route in ("housed", "shm", "pipe"):
                submit_s, submit_cpu, handoff_cpu, ratio = one(
                    worker, int(args.counters), rep, rng, route
                )
                print(
                    f"| {route} | {rep} | {submit_s * 1000:.1f} ms | {submit_cpu * 1000:.1f} ms"
                    f" | {handoff_cpu * 1000:.0f} ms | {ratio:.2f}x |",
                    flush=True,
                )
    finally:
        worker.close()


if __name__ == "__main__":
    main()
