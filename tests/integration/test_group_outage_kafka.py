"""A group member under broker outages and at start, against a real broker (issue 46).

The intake's transaction failing while the broker is away, a member started while the broker is
away, several members started at the same instant on a new group, and a leader that falls
behind its windows. The whole group across broker restarts is in test_group_kafka.py."""

from __future__ import annotations

import time
import uuid

import msgpack
import numpy as np
from kafka import KafkaConsumer, KafkaProducer

from aggregator.service.group import txn as txn_module
from aggregator.service.group.repartition import Repartitioner, Route
from aggregator.service.group.txn import Transactions
from aggregator.service.metrics import Metrics
from consumers.decode import Decoder

from .test_group_kafka import make_topic


def test_an_intake_transaction_failing_while_the_broker_is_away_keeps_the_member(
        restartable_broker, monkeypatch):
    """The intake has polled records, the broker stops before the transaction commits (the
    test stops it from inside the transaction, the one way to hit that instant every run): the
    transaction fails, the committed offsets cannot be read, so the intake leaves the source
    group and subscribes again to the same topic with the same rebalance listener (it once
    subscribed to nothing: ValueError, the member died). Once the broker is back the records
    are taken again from the committed offsets, none lost."""
    monkeypatch.setattr(txn_module, "TIMEOUT_S", 3.0)
    bootstrap = restartable_broker.bootstrap
    topic = make_topic(bootstrap, partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    p = KafkaProducer(bootstrap_servers=bootstrap)
    for i in range(200):
        p.send(topic, value=msgpack.packb({"item": i % 10}))
    p.flush()
    p.close()
    common = dict(bootstrap_servers=bootstrap, reconnect_backoff_max_ms=500)
    consumer = KafkaConsumer(**common, group_id=group, enable_auto_commit=False,
                             isolation_level="read_committed", auto_offset_reset="earliest",
                             session_timeout_ms=6000, heartbeat_interval_ms=2000)

    def make():
        prod = KafkaProducer(**common, transactional_id=f"{group}.intake",
                             transaction_timeout_ms=15000)
        prod.init_transactions()
        return prod

    class StopsTheBrokerOnce(Transactions):
        armed = False

        def send_offsets(self, offsets, group_metadata):
            if self.armed:
                self.armed = False
                restartable_broker.stop()
            super().send_offsets(offsets, group_metadata)

    txn = StopsTheBrokerOnce(make)
    from kafka import ConsumerRebalanceListener

    assigned = []

    class Listener(ConsumerRebalanceListener):
        def on_partitions_revoked(self, revoked):
            pass

        def on_partitions_assigned(self, tps):
            assigned.append(sorted(tps))

    consumer.subscribe([topic], listener=Listener())
    out = f"{group}.out"
    from kafka.admin import KafkaAdminClient, NewTopic
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(out, num_partitions=1, replication_factor=1)])
    admin.close()
    route = Route(out, 1, Decoder("msgpack", domain_size=10),
                  lambda it: np.asarray(it, dtype=np.int64), Metrics())
    rp = Repartitioner(consumer, txn, [route], max_records=20)
    try:
        deadline = time.monotonic() + 60
        while rp.step(0.5) == 0:        # the first 20; the rest stay fetched in the consumer
            assert time.monotonic() < deadline, "no record taken"
        txn.armed = True
        taken = rp.step(0.5)           # the broker stops inside the transaction: it fails
        assert taken == 0 and not restartable_broker.running()
        assert consumer.subscription() == {topic}
        assert consumer._subscription.rebalance_listener is not None
        restartable_broker.start()
        deadline = time.monotonic() + 120
        while rp.records < 200:
            rp.step(0.5)
            assert time.monotonic() < deadline, f"{rp.records} of 200 taken"
        assert rp.records == 200 and len(assigned) >= 2
    finally:
        txn.close()
        consumer.close()

