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

``--group views`` or ``--group items``: a group of two members (``panagg run`` children, 5 s
time windows, ``scale.exchange`` as given) over a steady stream instead, once with a new registry
topic and once with ``ledger.registry_topic = ""``, each for ``--seconds``. The leader's check
is read from its own metrics (``panagg_registry_check_seconds``, beside
``panagg_release_latency_seconds``: window end -> merged release published), the mean of each
over the run's releases::

    python -m bench.service.registry_cost --group items --seconds 90 --reps 2
"""

from __future__ import annotations

import json
import socket
import statistics
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from aggregator.service import Aggregator
from aggregator.service.config import load_config
from aggregator.service.release_gate import ReleaseGate
from bench.harness import parser, provenance
from bench.service import group as group_bench
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
                self.calls.append((what, threading.current_thread().name, time.perf_counter() - t0))

        return timed


def one_run(
    bootstrap: str, topic: str, events: int, window: int, tmp: Path, registry: bool
) -> dict:
    state = tmp / f"run-{uuid.uuid4().hex[:8]}"
    topic_of_registry = f"panagg.budget.bench-{uuid.uuid4().hex[:8]}" if registry else ""
    cfg = load_config(
        None,
        [
            "source.kind=kafka",
            f"source.bootstrap={bootstrap}",
            f"source.topic={topic}",
            f"state.domain_size={D}",
            "window.kind=count",
            f"window.size={window}",
            f"checkpoint.dir={state}",
            f"release.dir={state}/rel",
            "metrics.port=-1",
            f"ledger.registry_topic={topic_of_registry}",
        ],
        env={},
    )
    probe = _Probe()
    check, record = ReleaseGate._check_registry, ReleaseGate._record
    ReleaseGate._check_registry = probe.wrap("check", check)
    ReleaseGate._record = probe.wrap("record", record)
    try:
        agg = Aggregator(cfg, kafka_source(bootstrap, topic)(cfg))
        stop = threading.Thread(target=_stop_when_counted, args=(agg, events, window), daemon=True)
        stop.start()
        t0 = time.monotonic()
        agg.run(poll_timeout_s=0.5)
        seconds = time.monotonic() - t0
    finally:
        ReleaseGate._check_registry, ReleaseGate._record = check, record
    releases = [e for e in agg.ledger.releases() if e.get("document")]
    latency = [
        e["time_unix"] - json.loads(e["document"])["window_info"]["ended_unix"] for e in releases
    ]
    return {
        "registry": registry,
        "releases": len(releases),
        "latency": latency,
        "calls": probe.calls,
        "seconds": seconds,
    }


def _metrics(port: int) -> dict[str, float]:
    """``{sample name: value}`` of a member's /metrics (empty when it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if not s.labels or set(s.labels) == {"aggregation"}
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def group_run(bootstrap: str, tmp: Path, exchange: str, seconds: float, registry: bool) -> dict:
    """Two members over a steady stream for ``seconds``; the leader's means (see the module
    docstring). The topic and the group are new, so nothing of another run is charged."""
    topic, group = group_bench._topic(bootstrap), f"rc-{uuid.uuid4().hex[:8]}"
    reg = [f"panagg.budget.bench-{uuid.uuid4().hex[:8]}" if registry else ""]
    ports = [_free_port(), _free_port()]
    procs = [
        group_bench._member(
            bootstrap,
            topic,
            group,
            f"m{k}",
            tmp,
            window=5,
            extra=[
                "--metrics-port",
                str(port),
                "--set",
                f"scale.exchange={exchange}",
                "--set",
                f"ledger.registry_topic={reg[0]}",
                "--set",
                "release.error_bar_reps=0",
            ],
        )
        for k, port in enumerate(ports)
    ]
    try:
        group_bench._produce(bootstrap, topic, int(2_000 * seconds), rate=2_000)
        time.sleep(15)  # the last windows close and are released
        scraped = [_metrics(port) for port in ports]
    finally:
        group_bench._stop(procs)
    # per release from the ledger (time windows numbered by the epoch: window w ends at
    # (w + 1) x 5 s): the median, which one slow first release (the registry opened) moves not
    ledgered = [t - (w + 1) * 5 for w, n, t in group_bench._released(bootstrap, group) if n]
    lead = max(scraped, key=lambda m: m.get("panagg_release_latency_seconds_count", 0))
    releases = lead.get("panagg_release_latency_seconds_count", 0)
    checks = lead.get("panagg_registry_check_seconds_count", 0)
    return {
        "registry": registry,
        "releases": int(releases),
        "checks": int(checks),
        "latency": lead.get("panagg_release_latency_seconds_sum", 0) / max(releases, 1),
        "median": statistics.median(ledgered) if ledgered else float("nan"),
        "first": ledgered[0] if ledgered else float("nan"),
        "check": lead.get("panagg_registry_check_seconds_sum", 0) / max(checks, 1),
    }


def group_main(args) -> None:
    with tempfile.TemporaryDirectory(prefix="panagg-registry-") as tmp_name:
        tmp = Path(tmp_name)
        bootstrap, broker_state = start_broker(tmp)
        try:
            runs = []
            for rep, registry in _arms(args.reps):
                r = group_run(bootstrap, tmp, args.group, args.seconds, registry)
                runs.append(r)
                print(
                    f"  rep {rep} registry {'on ' if registry else 'off'}: "
                    f"{r['releases']} releases, mean latency {r['latency']:.3f} s "
                    f"(median {r['median']:.3f} s, first {r['first']:.3f} s), "
                    f"{r['checks']} checks of {r['check'] * 1e3:.1f} ms",
                    flush=True,
                )
        finally:
            stop_broker(broker_state)
    on = [r for r in runs if r["registry"]]
    off = [r for r in runs if not r["registry"]]
    lat_on = statistics.mean(r["latency"] for r in on)
    lat_off = statistics.mean(r["latency"] for r in off)
    check = statistics.mean(r["check"] for r in on)
    print(
        f"\n{provenance(('aggregator', 'state_store'), ('numpy', 'kafka-python'))}; a group "
        f"of 2 ({args.group} exchange), 5 s windows, 2,000 events/s for {args.seconds:g} s, "
        f"{args.reps} repetitions\n"
    )
    print("| measured | registry on | registry off |")
    print("|---|---|---|")
    print(
        f"| releases (leader) | {sum(r['releases'] for r in on)} | "
        f"{sum(r['releases'] for r in off)} |"
    )
    print(f"| mean release latency (window end -> published) | {lat_on:.3f} s | {lat_off:.3f} s |")
    med_on = statistics.median(r["median"] for r in on)
    med_off = statistics.median(r["median"] for r in off)
    print(f"| median ledgered latency of a window with events | {med_on:.3f} s | {med_off:.3f} s |")
    print(
        f"| mean registry check per release | {check * 1e3:.1f} ms "
        f"({check / lat_on:.1%} of the latency) | - |"
    )


def _arms(reps: int):
    """(repetition, registry on?) in run order: each repetition runs both arms, and which goes
    first alternates, since the machine's load drifts over a run."""
    for rep in range(reps):
        for registry in (True, False) if rep % 2 == 0 else (False, True):
            yield rep, registry


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
    ap.add_argument(
        "--group",
        choices=("views", "items"),
        default=None,
        help="a group of two members with this exchange instead of one process",
    )
    ap.add_argument(
        "--seconds",
        type=float,
        default=90.0,
        help="--group: how long the steady stream of each run lasts",
    )
    args = ap.parse_args(argv)
    if args.group:
        if args.smoke:
            args.seconds, args.reps = 15.0, 1
        group_main(args)
        return
    if args.smoke:
        args.events, args.window, args.reps = 20_000, 5_000, 1
    with tempfile.TemporaryDirectory(prefix="panagg-registry-") as tmp_name:
        tmp = Path(tmp_name)
        bootstrap, broker_state = start_broker(tmp)
        try:
            topic = f"registry-cost-{uuid.uuid4().hex[:8]}"
            produce(bootstrap, topic, args.events)
            runs = []
            for rep, registry in _arms(args.reps):
                r = one_run(bootstrap, topic, args.events, args.window, tmp, registry)
                runs.append(r)
                print(
                    f"  rep {rep} registry {'on ' if registry else 'off'}: "
                    f"{r['releases']} releases, latency p50 {_p(r['latency'], 0.5):.3f} s, "
                    f"registry {sum(c[2] for c in r['calls']):.3f} s in "
                    f"{len(r['calls'])} calls ({r['seconds']:.1f} s)",
                    flush=True,
                )
        finally:
            stop_broker(broker_state)
    on = [r for r in runs if r["registry"]]
    off = [r for r in runs if not r["registry"]]
    lat_on = [x for r in on for x in r["latency"]]
    lat_off = [x for r in off for x in r["latency"]]
    releases = sum(r["releases"] for r in on)
    per_release = [sum(c[2] for c in r["calls"]) / max(r["releases"], 1) for r in on]
    by_what = {w: [c[2] for r in on for c in r["calls"] if c[0] == w] for w in ("check", "record")}
    threads = sorted({c[1] for r in on for c in r["calls"]})
    print(
        f"\n{provenance(('aggregator', 'state_store'), ('numpy', 'kafka-python'))}; "
        f"{args.events:,} events, count windows of {args.window:,}, "
        f"{args.reps} repetitions\n"
    )
    print("| measured | registry on | registry off |")
    print("|---|---|---|")
    print(f"| releases | {releases} | {sum(r['releases'] for r in off)} |")
    print(
        f"| release latency (window end -> ledgered) p50 / p90 | {_p(lat_on, 0.5):.3f} / "
        f"{_p(lat_on, 0.9):.3f} s | {_p(lat_off, 0.5):.3f} / {_p(lat_off, 0.9):.3f} s |"
    )
    for what, xs in by_what.items():
        print(
            f"| registry {what} per call: p50 / max ({len(xs)} calls) | "
            f"{_p(xs, 0.5) * 1e3:.1f} / {max(xs, default=0) * 1e3:.1f} ms | - |"
        )
    share = statistics.median(per_release) / _p(lat_on, 0.5) if lat_on else float("nan")
    print(
        f"| registry time per release, median over repetitions | "
        f"{statistics.median(per_release) * 1e3:.1f} ms ({share:.1%} of the p50 latency) "
        f"| - |"
    )
    print(
        f"\nthreads that called the registry: {', '.join(threads)}; "
        f"p50 latency on / off: {_p(lat_on, 0.5) / _p(lat_off, 0.5):.2f}"
    )


if __name__ == "__main__":
    main()
