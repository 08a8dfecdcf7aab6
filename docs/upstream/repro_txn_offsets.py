"""kafka-python: an aborted transaction's offsets are committed by the next transaction.

    python docs/upstream/repro_txn_offsets.py BOOTSTRAP [--patched]

Transaction 1 offers partition 0's offset 5 with a stale consumer-group generation: the broker
refuses it (``CommitFailedError``) and the transaction is aborted. Transaction 2 offers partition
1's offset 7 with the right generation and commits. Only partition 1 may then have a committed
offset. Prints ``REPRODUCED`` (partition 0 committed at 5 too) or ``OK``. ``--patched`` applies
panagg's workaround (consumers/kafka/compat.py, ``drop_stale_offsets``) before each
``begin_transaction``, which must print ``OK``. Needs a broker at BOOTSTRAP.
"""

from __future__ import annotations

import sys
import time
import uuid

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import CommitFailedError
from kafka.structs import OffsetAndMetadata


def main(bootstrap: str, patched: bool) -> str:
    topic, out = f"txo-{uuid.uuid4().hex[:8]}", f"txo-out-{uuid.uuid4().hex[:8]}"
    group = f"txo-g-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, 2, 1), NewTopic(out, 1, 1)])
    admin.close()
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        isolation_level="read_committed",
    )
    consumer.subscribe([topic])
    deadline = time.monotonic() + 60
    while not consumer.assignment() and time.monotonic() < deadline:
        consumer.poll(timeout_ms=200)
    meta = consumer.group_metadata()
    stale = meta._replace(generation_id=meta.generation_id + 7)  # what a rebalance leaves

    producer = KafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"{group}.p")
    producer.init_transactions()

    def begin():
        if patched:
            from consumers.kafka.compat import drop_stale_offsets

            drop_stale_offsets(producer)
        producer.begin_transaction()

    begin()
    producer.send(out, value=b"first")
    try:
        producer.send_offsets_to_transaction(
            {TopicPartition(topic, 0): OffsetAndMetadata(5, "", -1)}, stale
        )
    except CommitFailedError:
        pass
    producer.abort_transaction()
    begin()
    producer.send(out, value=b"second")
    producer.send_offsets_to_transaction(
        {TopicPartition(topic, 1): OffsetAndMetadata(7, "", -1)}, meta
    )
    producer.commit_transaction()
    producer.close(timeout=5)
    committed = {p: consumer.committed(TopicPartition(topic, p), timeout_ms=10000) for p in (0, 1)}
    consumer.close()
    if committed == {0: None, 1: 7}:
        return "OK"
    return (
        f"REPRODUCED: committed offsets {committed}; the aborted transaction's offset 5 of "
        "partition 0 went out with the next transaction's TxnOffsetCommit"
    )


if __name__ == "__main__":
    print(main(sys.argv[1], "--patched" in sys.argv[2:]))
