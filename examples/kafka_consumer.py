"""panagg inside a plain kafka-python consumer loop (aggregator.api; docs/api.md).

Your consumer reads the topic; the aggregation counts each record into the pan-private state and
returns a release whenever a window closes. Exactly once without Kafka's group offsets: the
aggregation's checkpoint holds the next offset of every partition, and at each start the consumer
seeks where :attr:`Aggregation.resume_offsets` says (the open window's first records: they are
counted again under fresh noise, the released windows' records are skipped).

    python examples/kafka_consumer.py --bootstrap 127.0.0.1:9092 --topic logins \\
        --state-dir var/api --set state.domain_size=100000 --set window.kind=count \\
        --set window.size=100000

Prints one line per release (its headline) and stops after ``--exit-when-idle`` seconds without
records (0: never), or on SIGTERM. ``--config panagg.toml`` takes the service's config file as
it is.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time

from kafka import KafkaConsumer, TopicPartition

from aggregator.api import Aggregation, Release, settings


def partitions(consumer: KafkaConsumer, topic: str, wait_s: float = 30.0) -> list[TopicPartition]:
    deadline = time.monotonic() + wait_s
    while True:
        found = consumer.partitions_for_topic(topic)
        if found:
            return [TopicPartition(topic, p) for p in sorted(found)]
        if time.monotonic() > deadline:
            raise SystemExit(f"topic {topic!r} not found at the broker")
        time.sleep(0.5)


def show(release: Release) -> None:
    d, h = release.distinct_items, release.entropy_nats
    print(
        f"window {release.window}: n={release.n} distinct={d.value} {d.interval} "
        f"entropy={h.value:.3f} {h.interval} eps={release.epsilon:g} per "
        f"{release.privacy_unit} below_noise={release.signal_below_noise}",
        flush=True,
    )


#: set by SIGTERM (a container's stop, systemd's, kill): the loop ends after its turn and the
#: aggregation closes, so the stop is clean (its checkpoint written, exit 0)
STOP = threading.Event()


def run(
    bootstrap: str,
    topic: str,
    state_dir: str,
    release_dir: str,
    sets: dict[str, str],
    config: str | None = None,
    exit_when_idle: float = 0.0,
) -> None:
    cfg = settings(
        config,
        {
            "source.kind": "kafka",
            "source.topic": topic,
            "source.bootstrap": bootstrap,
            "checkpoint.dir": state_dir,
            "release.dir": release_dir,
            **sets,
        },
    )
    with Aggregation(cfg) as agg:
        consumer = KafkaConsumer(
            bootstrap_servers=bootstrap,
            enable_auto_commit=False,
            group_id=None,
            auto_offset_reset="earliest",
        )
        try:
            parts = partitions(consumer, topic)
            consumer.assign(parts)
            for tp in parts:  # where the aggregation's checkpoint says, else the beginning
                at = agg.resume_offsets.get(f"{tp.topic}:{tp.partition}")
                if at is None:
                    consumer.seek_to_beginning(tp)
                else:
                    consumer.seek(tp, at)
            idle_since = time.monotonic()
            while not STOP.is_set():
                batch = consumer.poll(timeout_ms=500, max_records=5000)
                made = []
                for tp, msgs in batch.items():
                    made += agg.feed_records(
                        [m.value for m in msgs],
                        partition=f"{tp.topic}:{tp.partition}",
                        offsets=[m.offset for m in msgs],
                        keys=[m.key for m in msgs],
                        headers=[m.headers for m in msgs],
                        timestamps=[m.timestamp for m in msgs],
                    )
                if not batch:
                    made += agg.tick()  # time windows close without records too
                for release in made:
                    show(release)
                if batch:
                    idle_since = time.monotonic()
                elif exit_when_idle and time.monotonic() - idle_since >= exit_when_idle:
                    break
        finally:
            consumer.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--state-dir", required=True, help="checkpoint.dir: state, ledger")
    ap.add_argument("--release-dir", default="out/releases")
    ap.add_argument("--config", help="a panagg TOML config file")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--exit-when-idle", type=float, default=0.0, metavar="SECONDS")
    args = ap.parse_args(argv)
    sets = dict(s.split("=", 1) for s in args.set)
    signal.signal(signal.SIGTERM, lambda *_: STOP.set())
    run(
        args.bootstrap,
        args.topic,
        args.state_dir,
        args.release_dir,
        sets,
        args.config,
        args.exit_when_idle,
    )


if __name__ == "__main__":
    main()
