"""kafka-python: a rejoin a short ``poll`` left half done never completes.

    python docs/upstream/repro_stuck_join.py BOOTSTRAP [--patched]

Prints ``REPRODUCED`` (the bug: new groups whose consumer never gets a partition) or ``OK``.
``--patched`` applies panagg's workaround (consumers/kafka/compat.py, ``finish_join``) before
each poll, which must print ``OK``. Needs a broker at BOOTSTRAP (e.g. deploy/kafka/kafka.sh start).
"""

from __future__ import annotations

import sys
import time
import uuid

from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

GROUPS = 5
WAIT_S = 10.0


def main(bootstrap: str, patched: bool) -> str:
    topic = f"stuck-join-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for p in range(3):
        producer.send(topic, value=b"x", partition=p)
    producer.flush()
    producer.close()

    stuck = 0
    for k in range(GROUPS):
        # a new group: its first join runs before the consumer knows the topic's partitions,
        # so the leader assigns nothing, then rejoins once the metadata shows them
        consumer = KafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=f"{topic}-{k}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        consumer.subscribe([topic])
        deadline = time.monotonic() + WAIT_S
        while not consumer.assignment() and time.monotonic() < deadline:
            if patched:
                from consumers.kafka.compat import finish_join

                finish_join(consumer)
            consumer.poll(timeout_ms=1)  # short polls: the join outlives many of them
        stuck += not consumer.assignment()
        consumer.close(autocommit=False)
    if not stuck:
        return "OK"
    return (
        f"REPRODUCED: {stuck} of {GROUPS} new groups had no partition after {WAIT_S:.0f} s "
        "(the rejoin's SyncGroup answer was never applied)"
    )


if __name__ == "__main__":
    print(main(sys.argv[1], "--patched" in sys.argv[2:]))
