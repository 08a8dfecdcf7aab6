"""Throughput of three aggregations of one stream (one consumer, one pass) against one.

    PANAGG_KAFKA_BOOTSTRAP=host:port .venv/bin/python -m bench.service.multi_agg \\
        [--events 300000] [--reps 3]

One topic of JSON login events (``{"user": {"id"}, "ip", "device", "event"}``, 3 partitions).
Per repetition, alternating (the order rotates): the service with one aggregation (per account,
``item.field = user.id``, direct) and with three (per account, per IP hashed, per device hashed
with the filter ``event = login``), and the three again with each aggregation parsing every
record itself (the shared parse of ``consumers/decode.py`` off: what sharing it saves), each from
a fresh state directory and consumer group over the same records. Events/s = records / (last
record delivered - first record delivered), the wall clock of the process (the broker shares the
two cores); CPU = the process's CPU seconds over the same span. Writes a section of
docs/item_selection.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import uuid
from pathlib import Path


from aggregator.service.config import load_config  # noqa: E402
from aggregator.service.multi import MultiAggregator  # noqa: E402
from aggregator.service.process import Aggregator  # noqa: E402
from bench.harness import ROOT, parser, write_doc_section  # noqa: E402
from bench.service.e2e import TimedSource, load1, machine, start_broker  # noqa: E402
from consumers.kafka.kafka_python import KafkaSource  # noqa: E402

DOC = ROOT / "docs" / "item_selection.md"
ACCOUNTS = 100_000

THREE = {
    "account": ["item.field=user.id", f"state.domain_size={ACCOUNTS}", "state.epsilon=1"],
    "ip": ["item.field=ip", "state.mode=hashed", "state.epsilon=0.5"],
    "device": [
        "item.field=device",
        "item.filter_field=event",
        "item.filter_value=login",
        "state.mode=hashed",
        "state.epsilon=0.5",
    ],
}


def produce(bootstrap: str, topic: str, events: int) -> None:
    import numpy as np
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
    admin.close()
    rng = np.random.default_rng(0)
    users = rng.zipf(1.1, events) % ACCOUNTS
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, linger_ms=50, batch_size=512 * 1024, acks=1
    )
    for k, u in enumerate(users.tolist()):
        doc = {
            "user": {"id": u},
            "ip": f"10.{u % 7}.{u % 251}.{k % 13}",
            "device": f"dev-{(u * 7 + k) % 5000}",
            "event": "login" if k % 4 else "logout",
        }
        producer.send(topic, json.dumps(doc).encode())
    producer.flush()
    producer.close()


#: the configurations compared: label -> (aggregations, whether they share each record's parse)
KINDS = {"1": (1, True), "3": (3, True), "3, each parses": (3, False)}


def one_run(bootstrap: str, topic: str, events: int, tmp: Path, kind: str) -> tuple:
    aggregations, shared = KINDS[kind]
    state = tmp / f"run-{uuid.uuid4().hex[:8]}"
    sets = [
        f"checkpoint.dir={state}",
        f"release.dir={state}/rel",
        "metrics.port=-1",
        "source.format=json",
        f"window.size={10 * events}",
        "release.on_exhausted=false",
        f"source.bootstrap={bootstrap}",
        f"source.topic={topic}",
        # repetitions over one topic on purpose: the budget registry would refuse the second
        "ledger.registry_topic=",
    ]
    if aggregations == 1:
        sets += THREE["account"]
    else:
        sets += ["ledger.budget_per_event=2"]
        sets += [f"aggregations.{name}.{s}" for name, ss in THREE.items() for s in ss]
    cfg = load_config(None, sets, env={})
    src = cfg.source
    inner = KafkaSource(
        bootstrap,
        topic,
        f"bench-{uuid.uuid4().hex}",
        src.max_records,
        consumer_config={
            "fetch_max_bytes": src.fetch_max_bytes,
            "max_partition_fetch_bytes": src.max_partition_fetch_bytes,
        },
    )
    ref: list = [None]
    # Every record delivered is counted by the turn after it: stop on the count delivered.
    t = TimedSource(inner, lambda s: s.delivered >= events, lambda: ref[0].stop_event.set())
    service = (Aggregator if aggregations == 1 else MultiAggregator)(cfg, t)
    ref[0] = service
    if not shared:
        for agg in service.aggs.values():
            agg.decoder.shared = None
    service.run(poll_timeout_s=1.0)
    return t.t1 - t.t0, t.c1 - t.c0


def main(argv=None) -> int:
    ap = parser(__doc__, "--events 1000 --reps 1 --no-write")
    ap.add_argument("--events", type=int, default=300_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.events, args.reps, args.no_write = 1000, 1, True
    m = machine()
    head = (
        f"Command: `python -m bench.service.multi_agg {' '.join(sys.argv[1:])}` ({m['when']}; "
        f"{m['cpus']} CPUs, {m['cpu']}; git {m['rev']}; broker on loopback). Load average "
        f"at start: {load1():.2f}."
    )
    print(head, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="panagg-multi-") as t:
        tmp = Path(t)
        bootstrap, _ = start_broker(tmp)
        topic = f"multi-{uuid.uuid4().hex[:8]}"
        produce(bootstrap, topic, args.events)
        kinds = list(KINDS)
        for rep in range(args.reps):
            r = {}
            for k in kinds[rep % 3 :] + kinds[: rep % 3]:  # the order rotates
                r[k] = one_run(bootstrap, topic, args.events, tmp, k)
            rows.append(r)
            print(
                f"  rep {rep}: "
                + ", ".join(f"{k}: {args.events / r[k][0]:,.0f} ev/s" for k in kinds),
                flush=True,
            )

    def ratio(a: str, b: str, i: int) -> str:  # events/s of a over b (i = 1: CPU per event b / a)
        xs = [r[b][i] / r[a][i] for r in rows]
        return f"median {statistics.median(xs):.2f}x (repetitions {min(xs):.2f}..{max(xs):.2f})"

    lines = [
        head,
        "",
        "| aggregations | events/s (median) | CPU µs/event (median) |",
        "|---|---|---|",
    ]
    for k in kinds:
        lines.append(
            f"| {k} | {args.events / statistics.median(r[k][0] for r in rows):,.0f} | "
            f"{1e6 * statistics.median(r[k][1] for r in rows) / args.events:.2f} |"
        )
    lines += [
        "",
        f"3 aggregations / 1, events/s: {ratio('3', '1', 0)}; CPU per event 1 / 3: "
        f"{ratio('3', '1', 1)}. Shared parse / each parses, events/s: "
        f"{ratio('3', '3, each parses', 0)}; CPU per event: "
        f"{ratio('3', '3, each parses', 1)} (each parses / shared). Load average at the "
        f"end: {load1():.2f}.",
    ]
    print("\n".join(lines))
    if not args.no_write:
        write_doc_section(
            DOC, "bench.service.multi_agg", "latest", lines, title="Choosing the item"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
