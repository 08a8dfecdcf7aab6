"""Intake stalls at a window's close, the way an operator sees them (issue 53): a real broker, a
producer at a steady rate, count windows, ``panagg run`` as a process, its ``/metrics`` sampled
every 0.25 s. A stall is a stretch of samples over which ``panagg_events_total`` stays flat
while the producer has written records the service has not counted (the service's own lag gauge
is not updated while its loop is stalled, so the producer's count is the reference), from the
first event counted on (the start, the group join, is not a stall); the table gives the longest,
next to the longest ``panagg_intake_stall_seconds`` the service exported, and the release
time in the documents.

    python -m bench.service.intake_stall --counters 1e7 --rate 4000 --window 100000 --windows 3
    python -m bench.service.intake_stall --aggregations 3 --counters 1e6 --rate 20000 \
        --window 100000
    python -m bench.service.intake_stall --root /path/to/other/checkout  # the same, other code

Needs java and mvn (deploy/kafka/kafka.sh) like the integration tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import msgpack

from bench.harness import ROOT, parser


def _metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        key = name.split("{", 1)[0]
        if key in (
            "panagg_events_total",
            "panagg_consumer_lag_records",
            "panagg_intake_stall_seconds",
        ):
            out[key] = (
                out.get(key, 0.0) + float(value)
                if key != "panagg_intake_stall_seconds"
                else max(out.get(key, 0.0), float(value))
            )
    return out


def _toml(aggregations: int, counters: int) -> str:
    lines = ["[ledger]", f"budget_per_event = {float(max(1, aggregations))}"]
    for k in range(aggregations):
        lines += [f"[aggregations.a{k}]", f"state.domain_size = {counters}"]
    return "\n".join(lines) + "\n"


def run(
    bootstrap: str,
    root: Path,
    counters: int,
    rate: float,
    window: int,
    windows: int,
    aggregations: int,
) -> dict:
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    topic = f"stall-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, 3, 1)])
    admin.close()
    with tempfile.TemporaryDirectory(prefix="panagg-stall-") as tmp:
        args = [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "run",
            "--bootstrap",
            bootstrap,
            "--topic",
            topic,
            "--state-dir",
            f"{tmp}/state",
            "--release-dir",
            f"{tmp}/releases",
            "--metrics-port",
            "0",
            "--set",
            "window.kind=count",
            "--set",
            f"window.size={window}",
            "--set",
            f"state.domain_size={counters}",
            "--set",
            f"source.group=g-{topic}",
        ]
        if aggregations > 1:
            Path(tmp, "multi.toml").write_text(_toml(aggregations, counters))
            args += ["--config", f"{tmp}/multi.toml"]
        env = dict(os.environ, PYTHONPATH=str(root))
        proc = subprocess.Popen(args, cwd=root, env=env, stderr=subprocess.PIPE, text=True)
        log: list[str] = []
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
        deadline = time.monotonic() + 120
        while not any(x.startswith("metrics on ") for x in log):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("".join(log)[-3000:])
            time.sleep(0.1)
        url = next(x.split()[-1] for x in log if x.startswith("metrics on "))
        stop = threading.Event()
        sent = [0]

        def produce():
            p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=10)
            i, t0 = 0, time.monotonic()
            while not stop.is_set():
                for _ in range(int(rate // 20)):
                    p.send(topic, msgpack.packb({"item": (i * 7919) % counters}))
                    i += 1
                sent[0] = i
                time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            p.flush()
            p.close()

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        samples = []
        end = time.monotonic() + (windows + 1) * window / rate
        while time.monotonic() < end:
            try:
                m = _metrics(url)
                m["sent"] = sent[0]
                samples.append((time.monotonic(), m))
            except OSError:
                pass
            time.sleep(0.25)
        stop.set()
        producer.join()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
        docs = [json.loads(p.read_text()) for p in Path(tmp, "releases").rglob("release-*.json")]
    aggregations_factor = 1.0 / max(1, aggregations)  # several: events_total sums them
    longest, since = 0.0, None
    for (t0, a), (t1, b) in zip(samples, samples[1:]):
        if not a.get("panagg_events_total", 0):
            continue  # still starting
        flat = b.get("panagg_events_total", 0) == a.get("panagg_events_total", 0)
        # records written before the earlier sample and still not counted at the later one
        if flat and a["sent"] > b.get("panagg_events_total", 0) * aggregations_factor:
            since = t0 if since is None else since
            longest = max(longest, t1 - since)
        else:
            since = None
    exported = max((m.get("panagg_intake_stall_seconds", 0.0) for _, m in samples), default=0.0)
    return {
        "longest_stall_s": round(longest, 2),
        "exported_stall_s": round(exported, 2),
        "releases": len(docs),
        "release_seconds": sorted(round(d.get("release_seconds", 0), 2) for d in docs),
    }


def main(argv=None) -> None:
    ap = parser(
        __doc__,
        "D = 1e4, 2 windows of 1000 events at 2000 events/s; the broker of "
        "$PANAGG_KAFKA_BOOTSTRAP if set",
    )
    ap.add_argument("--counters", type=float, default=1e7)
    ap.add_argument("--rate", type=float, default=4000)
    ap.add_argument("--window", type=int, default=100_000, help="events per count window")
    ap.add_argument("--windows", type=int, default=3, help="windows to produce")
    ap.add_argument("--aggregations", type=int, default=1)
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose service runs")
    ap.add_argument("--bootstrap", help="a running broker (default: one started here)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.counters, args.rate, args.window, args.windows = 1e4, 2000.0, 1000, 2
        args.bootstrap = args.bootstrap or os.environ.get("PANAGG_KAFKA_BOOTSTRAP")
    broker_dir = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        broker_dir = tempfile.mkdtemp(prefix="panagg-stall-kafka-")
        out = subprocess.run(
            [str(ROOT / "deploy/kafka/kafka.sh"), "start", broker_dir],
            capture_output=True,
            text=True,
            check=True,
        )
        bootstrap = out.stdout.strip().splitlines()[-1].split("=", 1)[1]
    try:
        res = run(
            bootstrap,
            args.root,
            int(args.counters),
            args.rate,
            args.window,
            args.windows,
            args.aggregations,
        )
    finally:
        if broker_dir is not None:
            subprocess.run(
                [str(ROOT / "deploy/kafka/kafka.sh"), "stop", broker_dir], capture_output=True
            )
    print(
        f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}; root {args.root}; "
        f"D = {args.counters:.0e}, {args.aggregations} aggregation(s), {args.rate:.0f} "
        f"events/s, windows of {args.window} events"
    )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
