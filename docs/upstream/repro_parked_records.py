"""kafka-python: a resumed partition whose parsed records were parked is never read again.

    python docs/upstream/repro_parked_records.py BOOTSTRAP [--patched]

Prints ``REPRODUCED`` (the bug: the resumed partition's records never come) or ``OK``.
``--patched`` applies panagg's workaround (consumers/kafka/compat.py, ``unpark``) before each
poll, which must print ``OK``. Needs a broker at BOOTSTRAP (e.g. deploy/kafka/kafka.sh start).
"""

from __future__ import annotations

import sys
import time
import uuid

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

PER_PARTITION = 100


def main(bootstrap: str, patched: bool) -> str:
    topic = f"parked-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for p in (0, 1):
        for i in range(PER_PARTITION):
            producer.send(topic, value=b"%d" % i, partition=p)
    producer.flush()
    producer.close()

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    tps = [TopicPartition(topic, 0), TopicPartition(topic, 1)]
    consumer.assign(tps)

    def poll(max_records):
        if patched:
            from consumers.kafka.compat import unpark

            unpark(consumer)
        return consumer.poll(timeout_ms=2000, max_records=max_records)

    # 1. one record: the first partition's parsed records take the fetcher's in-line slot
    first = {}
    deadline = time.monotonic() + 30
    while not first and time.monotonic() < deadline:
        first = poll(1)
    (x,) = first
    (y,) = [tp for tp in tps if tp != x]
    # 2. pause it while its records are in the slot, then drain the other partition exactly:
    #    x's records are parked, and the slot is left holding y's drained (empty) records
    consumer.pause(x)
    got_y = sum(len(r) for r in poll(PER_PARTITION).values())
    assert got_y == PER_PARTITION, f"expected {PER_PARTITION} records of {y}, got {got_y}"
    # 3. resume: x's remaining records should come
    consumer.resume(x)
    got_x = 0
    deadline = time.monotonic() + 10
    while got_x < PER_PARTITION - 1 and time.monotonic() < deadline:
        got_x += sum(len(r) for r in poll(500).values())
    consumer.close()
    if got_x == PER_PARTITION - 1:
        return "OK"
    return (
        f"REPRODUCED: {got_x} of {PER_PARTITION - 1} records of resumed partition {x.partition}"
        " came in 10 s (its parsed records stay parked behind a drained in-line slot)"
    )


if __name__ == "__main__":
    print(main(sys.argv[1], "--patched" in sys.argv[2:]))
