"""What the views-of-the-state design costs: release accuracy by layer count, and recovery time.

Checkpoints hold no counters of the open window (docs/privacy.md, section 16); a restart replays
the window from Kafka. ``checkpoint.snapshots_per_window = k`` bounds the replay to 1/(k+1) of a
window at 2k more noise layers in the release (a restore adds none). This bench
measures both sides on the same machine:

* ``accuracy``: l1 error of the default release estimator on the same true histograms with
  2 (the default: initial + release layer, as the joint model always had), 4, 6 and 8 layers;
* ``recovery``: a real broker, a window of N events counted, the process killed at the worst
  point (the end of the window), then the time a new process needs to restore and replay it,
  without and with snapshots;
* ``audit``: the intruder audit of tests/test_privacy_service.py, printed as a table.

Usage::

    python -m bench.service.views accuracy [--reps 3]
    python -m bench.service.views recovery --bootstrap 127.0.0.1:9092 [--events 1000000]
    python -m bench.service.views audit
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from aggregator.estimate import l1_distance
from aggregator.anonymize import anonymized_histogram
from aggregator.noise import p_from_epsilon

from .._data import noisy, true_counts
from ..harness import ROOT, parser

CELLS = [  # (distribution, D, n): a dense and a sparse shape
    ("zipf", 100_000, 1_000_000),
    ("geometric", 100_000, 1_000_000),
    ("zipf", 1_000_000, 100_000),
]
LAYERS = (2, 4, 6, 8)


SMOKE_CELLS = [("zipf", 1_000, 1_000)]  # --smoke accuracy


def accuracy(reps: int, eps: float = 1.0, cells=CELLS) -> None:
    p = p_from_epsilon(eps)
    print(
        f"l1 error of the default estimator (mean of {reps} runs; eps = {eps}); ratio to the "
        "2-layer default in the same run"
    )
    print("| cell | " + " | ".join(f"{k} layers" for k in LAYERS) + " |")
    print("|---|" + "---|" * len(LAYERS))
    for dist, D, n in cells:
        rng = np.random.default_rng([7, D, n])
        errs = {k: [] for k in LAYERS}
        for _ in range(reps):
            h = true_counts(rng, dist, D, n)
            truth = h[h > 0]
            for k in LAYERS:
                est = anonymized_histogram(noisy(rng, h, p, k), p, layers=k, n=n)
                errs[k].append(l1_distance(est, truth))
        base = np.mean(errs[2])
        cells = [f"{np.mean(errs[k]):,.0f} ({np.mean(errs[k]) / base:.2f}x)" for k in LAYERS]
        print(f"| {dist} D={D:.0e} n={n:.0e} | " + " | ".join(cells) + " |")


def recovery(bootstrap: str, events: int) -> None:
    import msgpack
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    from aggregator.service import Aggregator
    from aggregator.service.cli import _make_source
    from aggregator.service.config import load_config

    topic = f"views-{os.urandom(4).hex()}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=50, batch_size=1 << 20)
    items = np.random.default_rng(1).integers(0, 100_000, events)
    for i in items:
        producer.send(topic, msgpack.packb({"item": int(i)}))
    producer.flush()
    producer.close()
    print(
        f"recovery after a kill at the end of a window of {events:,} events (3 partitions; "
        "the restarted process restores and replays to the end of the topic)"
    )
    print("| snapshots_per_window | replayed events | restore + replay (s) | release layers |")
    print("|---|---|---|---|")
    for k in (0, 1, 3):
        with tempfile.TemporaryDirectory() as d:
            sets = [
                f"checkpoint.dir={d}/state",
                f"release.dir={d}/rel",
                "metrics.port=-1",
                f"source.bootstrap={bootstrap}",
                f"source.topic={topic}",
                f"source.group=views-{k}-{os.urandom(3).hex()}",
                "state.domain_size=100000",
                f"window.size={events + 1}",
                f"checkpoint.snapshots_per_window={k}",
                # runs over one topic on purpose: the budget registry would refuse the second
                "ledger.registry_topic=",
            ]
            cfg = load_config(None, sets, env={})
            first = Aggregator(cfg, _make_source(cfg))
            first._lock()
            first.restore()
            first.catch_up()  # counts the window; snapshots at their public points
            first.close()  # the worst point: the whole window (or snapshot interval) in memory
            second = Aggregator(cfg, _make_source(cfg))
            t0 = time.perf_counter()
            second._lock()
            second.restore()
            replay_from = sum(second.task.offsets.values())
            second.catch_up()
            seconds = time.perf_counter() - t0
            layers = second.task.state.layers + 1
            second.close()
            print(f"| {k} | {events - replay_from:,} | {seconds:.2f} | {layers} |")


def audit() -> None:
    sys.path.insert(0, str(ROOT))
    from tests import test_privacy_service as t

    rows = [
        ("memory + files + release, replaced event after the intrusion", {"gap": 1}),
        ("memory + files + release, replaced event before the intrusion", {"gap": 2}),
        ("memory + files + release, after the window closed", {"gap": 3}),
        (
            "snapshots_per_window = 2, intrusion after the replaced event",
            {"gap": 2, "checkpoint.snapshots_per_window": 2},
        ),
        (
            "two backups of the state directory + release",
            {"gap": 0, "backups": (1, 2), "checkpoint.snapshots_per_window": 2},
        ),
        (
            "NEGATIVE: checkpoint holding the live noise (old design)",
            {"gap": 2, "cls": t._OldCheckpoints, "checkpoint.snapshots_per_window": 1},
        ),
        ("NEGATIVE: noise for eps 1.25 claimed as eps 1", {"gap": 2, "epsilon": 1.25}),
    ]
    print("| view (eps = 1) | empirical eps |")
    print("|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for name, kw in rows:
            kw = dict(kw)
            gap = kw.pop("gap")
            (eps_hat, _), _ = t._audit(Path(d), gap, **kw)
            print(f"| {name} | {eps_hat:.3f} |")


def main(argv=None) -> int:
    ap = parser(
        __doc__,
        "accuracy (the default without a subcommand): one cell, D = n = 1000, "
        "one run; recovery: 2,000 events",
    )
    sub = ap.add_subparsers(dest="what")
    acc = sub.add_parser("accuracy")
    acc.add_argument("--reps", type=int, default=3)
    rec = sub.add_parser("recovery")
    rec.add_argument("--bootstrap", required=True)
    rec.add_argument("--events", type=int, default=1_000_000)
    sub.add_parser("audit")
    args = ap.parse_args(argv)
    if args.what is None and not args.smoke:
        ap.error("give accuracy, recovery or audit (or --smoke)")
    if args.what in (None, "accuracy"):
        accuracy(1, cells=SMOKE_CELLS) if args.smoke else accuracy(args.reps)
    elif args.what == "recovery":
        recovery(args.bootstrap, 2_000 if args.smoke else args.events)
    else:
        audit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
