"""Intake while a release runs: events counted per second during a release vs without one, in the
same run, and the release latency (window end -> ledgered), with the release worker
(``release.workers = 1``) and with the release in the loop (``release.workers = 0``).

The real service path in-process: a synthetic Zipf login stream (consumers.generator) at a fixed
offered rate through the decoder, direct-mode counters, processing-time windows, the default
estimator with error bars. A probe on the counting call records when events were counted and
whether a release was in flight; the rates are events counted over wall time with (without) a
window waiting for its release.

    python -m bench.service.release_intake --counters 1e6 --window 10 --rate 40000 --seconds 45
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time

import numpy as np

from aggregator.service import Aggregator
from aggregator.service.config import load_config
from bench.harness import parser
from consumers.generator import GeneratorSource, ZipfLogins


#: --smoke's cheap release (the threshold estimator, no error bars, no plan), so that a window's
#: release takes a fraction of a 1 s window
SMOKE_RELEASE = (
    "release.estimator=threshold",
    "release.error_bar_reps=0",
    "release.plan_errors=false",
)


def run(
    counters: int, window: float, rate: float, seconds: float, workers: int, options=()
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            None,
            [
                "source.kind=generator",
                f"state.domain_size={counters}",
                "window.kind=time",
                f"window.size={int(window)}",
                f"checkpoint.dir={tmp}/state",
                f"release.dir={tmp}/releases",
                "metrics.port=-1",
                f"release.workers={workers}",
                *options,
            ],
        )
        gen = ZipfLogins(int(rate * seconds * 2), accounts=counters, batch=2000)
        agg = Aggregator(cfg, GeneratorSource(gen, rate=rate))
        marks: list[tuple[float, int, bool]] = []
        count = agg.intake.count
        closing = {"busy": False}
        close = agg.close_window

        def probe(state, batch):
            waiting = bool(agg.task.inflight) or closing["busy"]
            marks.append((time.monotonic(), len(batch), waiting))
            return count(state, batch)

        def timed_close():  # in the loop the release itself is the stall
            closing["busy"] = True
            try:
                return close()
            finally:
                closing["busy"] = False

        agg.intake.count, agg.close_window = probe, timed_close
        stop = threading.Timer(seconds, agg.stop_event.set)
        stop.start()
        t0 = time.monotonic()
        agg.run()
        stop.cancel()
    t = np.array([m[0] for m in marks]) - t0
    n = np.array([m[1] for m in marks])
    busy = np.array([m[2] for m in marks])
    # wall time attributed to each counting call: the gap since the previous one
    dt = np.diff(np.concatenate([[0.0], t]))
    warm = t > window  # skip the first window (worker start, imports)
    rate_busy = n[warm & busy].sum() / max(dt[warm & busy].sum(), 1e-9)
    rate_idle = n[warm & ~busy].sum() / max(dt[warm & ~busy].sum(), 1e-9)
    lat = [ended - started for _, started, ended in agg.release_runs]
    # window end -> ledgered, per release (the ledger entry's time minus the window's end)
    ledgered = [
        e["time_unix"] - json.loads(e["document"])["window_info"]["ended_unix"]
        for e in agg.ledger.releases()
        if e.get("document")
    ]
    return {
        "workers": workers,
        "counters": counters,
        "events": int(n.sum()),
        "rate_during_release": rate_busy,
        "rate_without": rate_idle,
        "ratio": rate_busy / rate_idle if rate_idle else float("nan"),
        "releases": len(agg.ledger.releases()),
        "latency": agg.metrics.release_latency,
        "compute_s": lat,
        "ledgered_s": ledgered,
    }


def _quantiles(values) -> str:
    if not values:
        return "-"
    v = np.asarray(values)
    return f"p50 {np.percentile(v, 50):.2f} / p99 {np.percentile(v, 99):.2f} s over {len(v)}"


def main(argv=None) -> None:
    ap = parser(
        __doc__,
        "D = 1e4, 1 s windows, 5,000 events/s for 3 s, both routes, the "
        "threshold estimator without error bars",
    )
    ap.add_argument("--counters", type=float, default=1e6)
    ap.add_argument("--window", type=float, default=10)
    ap.add_argument("--rate", type=float, default=40000)
    ap.add_argument("--seconds", type=float, default=45)
    ap.add_argument("--workers", default="1,0", help="release.workers values to run, e.g. 1")
    args = ap.parse_args(argv)
    if args.smoke:
        args.counters, args.window, args.rate, args.seconds = 1e4, 1.0, 5000.0, 3.0
    print(
        f"cores: {os.cpu_count()}; D = {args.counters:.0e}, {args.window:g} s windows, offered "
        f"{args.rate:,.0f} events/s, {args.seconds:g} s"
    )
    print(
        "| release | events/s during a release | events/s without | ratio | releases | "
        "release compute p50 / max | window end -> ledgered |"
    )
    print("|---|---|---|---|---|---|---|")
    for workers in (int(w) for w in args.workers.split(",")):
        r = run(
            int(args.counters),
            args.window,
            args.rate,
            args.seconds,
            workers,
            SMOKE_RELEASE if args.smoke else (),
        )
        comp = sorted(r["compute_s"])
        comp_txt = f"{np.median(comp):.2f} / {max(comp):.2f} s" if comp else "in the loop"
        print(
            f"| {'worker' if workers else 'in the loop'} | {r['rate_during_release']:,.0f} | "
            f"{r['rate_without']:,.0f} | {r['ratio']:.2f} | {r['releases']} | {comp_txt} | "
            f"{_quantiles(r['ledgered_s'])} |"
        )


if __name__ == "__main__":
    main()
