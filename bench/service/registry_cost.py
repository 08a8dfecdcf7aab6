"""What the budget registry costs a release (issue 48's target: <= 5 % of release latency,
nothing on the counting path).

A real broker (``deploy/kafka/kafka.sh``, or ``$PANAGG_KAFKA_BOOTSTRAP``), a topic of msgpack
events, and the real service in-process over it with count windows and the default release
worker. The gate's two ways into the registry are timed where it makes them: the check before a
release (read the registry topic to its end, write what the ledger holds and the topic does not,
sum the other deployments' charges) and the write of each ledgered charge. Per release that time
is set against the release's latency (window end -> ledgered), and each call's thread is noted
(the consume loop's, or the release worker's). Each repetition runs once with a new registry
topic and once with ``ledger.registry_topic = ""`` (the control), on the same backlog with a new
consumer group, so the latencies with and without compare in one run.

    python -m bench.service.registry_cost --events 400000 --window 20000 --reps 3
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

from aggregator.service import Aggregator
from aggregator.service.config import load_config
from aggregator.service.release_gate import ReleaseGate
from bench.harness import parser, provenance
from bench.service.e2e import kafka_source, produce, start_broker, stop_broker

D = 100_000


class _Probe:
    """Wall time of each registry call, by what made it and on which thread."""

    def __init__(self):
        self.calls: list[tuple[str, str, float]] = []  # (what, thread, seconds)

    def wrap(self, what: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls.append((what, threading.current_thread().name,
                                   time.perf_counter() - t0))
        return timed


def one_run(bootstrap: str, topic: str, events: int, window: int, tmp: Path,
            registry: bool) -> dict:
    state = tmp / f"run-{uuid.uuid4().hex[:8]}"
    topic_of_registry = f"panagg.budget.bench-{uuid.uuid4().hex[:8]}" if registry else ""
    cfg = load_config(None, [
        "source.kind=kafka", f"source.bootstrap={bootstrap}", f"source.topic={topic}",
        f"state.domain_size={D}", "window.kind=count", f"window.size={window}",
        f"checkpoint.dir={state}", f"release.dir={state}/rel", "metrics.port=-1",
        f"ledger.registry_topic={topic_of_registry}"], env={})
    probe = _Probe()
    check, record = ReleaseGate._check_registry, ReleaseGate._record
    ReleaseGate._check_registry = probe.wrap("check", check)
    ReleaseGate._record = probe.wrap("record", record)
    try:
        agg = Aggregator(cfg, kafka_source(bootstrap, topic)(cfg))
        stop = threading.Thread(target=_stop_when_counted, args=(agg, events, window),
                                daemon=True)
        stop.start()
        t0 = time.monotonic()
        agg.run(poll_timeout_s=0.5)
        seconds = time.monotonic() - t0
    finally:
        ReleaseGate._check_registry, ReleaseGate._record = check, record
    releases = [e for e in agg.ledger.releases() if e.get("document")]
    latency = [e["time_unix"] - json.loads(e["document"])["window_info"]["ended_unix"]
               for e in releases]
    return {"registry": registry, "releases": len(releases), "latency": latency,
            "calls": probe.calls, "seconds": seconds}


def _stop_when_counted(agg, events: int, window: int) -> None:
    """Stop once every window of the backlog is ledgered (the last, partial one stays open)."""
    whole = events // window
    while not agg.stop_event.is_set():
        if agg.ledger is not None and len(agg.ledger.releases()) >= whole:
            agg.stop_event.set()
            return
        time.sleep(0.2)


def _p(values, q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))] if v else float("nan")


def main(argv=None) -> None:
    ap = parser(__doc__, "--events 20000 --window 5000 --reps 1 (its own broker)")
    ap.add_argument("--events", type=int, default=400_000)
    ap.add_argument("--window", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.smoke:
        args.events, args.window, args.reps = 20_000, 5_000, 1
    with tempfile.TemporaryDirectory(prefix="panagg-registry-") as tmp_name:
        tmp = Path(tmp_name)
        bootstrap, broker_state = start_broker(tmp)
        try:
            topic = f"registry-cost-{uuid.uuid4().hex[:8]}"
            produce(bootstrap, topic, args.events)
            runs = []
            for rep in range(args.reps):
                for registry in (True, False):
                    r = one_run(bootstrap, topic, args.events, args.window, tmp, registry)
                    runs.append(r)
                    print(f"  rep {rep} registry {'on ' if registry else 'off'}: "
                          f"{r['releases']} releases, latency p50 {_p(r['latency'], .5):.3f} s, "
                          f"registry {sum(c[2] for c in r['calls']):.3f} s in "
                          f"{len(r['calls'])} calls ({r['seconds']:.1f} s)", flush=True)
        finally:
            stop_broker(broker_state)
    on = [r for r in runs if r["registry"]]
    off = [r for r in runs if not r["registry"]]
    lat_on = [x for r in on for x in r["latency"]]
    lat_off = [x for r in off for x in r["latency"]]
    releases = sum(r["releases"] for r in on)
    per_release = [sum(c[2] for c in r["calls"]) / max(r["releases"], 1) for r in on]
    by_what = {w: [c[2] for r in on for c in r["calls"] if c[0] == w]
               for w in ("check", "record")}
    threads = sorted({c[1] for r in on for c in r["calls"]})
    print(f"\n{provenance(('aggregator', 'state_store'), ('numpy', 'kafka-python'))}; "
          f"{args.events:,} events, count windows of {args.window:,}, "
          f"{args.reps} repetitions\n")
    print("| measured | registry on | registry off |")
    print("|---|---|---|")
    print(f"| releases | {releases} | {sum(r['releases'] for r in off)} |")
    print(f"| release latency (window end -> ledgered) p50 / p90 | {_p(lat_on, .5):.3f} / "
          f"{_p(lat_on, .9):.3f} s | {_p(lat_off, .5):.3f} / {_p(lat_off, .9):.3f} s |")
    for what, xs in by_what.items():
        print(f"| registry {what} per call: p50 / max ({len(xs)} calls) | "
              f"{_p(xs, .5) * 1e3:.1f} / {max(xs, default=0) * 1e3:.1f} ms | - |")
    share = statistics.median(per_release) / _p(lat_on, .5) if lat_on else float("nan")
    print(f"| registry time per release, median over repetitions | "
          f"{statistics.median(per_release) * 1e3:.1f} ms ({share:.1%} of the p50 latency) "
          f"| - |")
    print(f"\nthreads that called the registry: {', '.join(threads)}; "
          f"p50 latency on / off: {_p(lat_on, .5) / _p(lat_off, .5):.2f}")


if __name__ == "__main__":
    main()
