"""An intake stall: a Kafka client that holds its partitions, with records waiting in them, and
hands over none (seen with librdkafka after a clean broker restart: ~2 minutes of REQTMOUT on its
group coordinator while time windows were released with n = 0 and /ready said 200).

No broker can be made to stall a client on demand, so the test stops the real client's fetches
behind the service's back (``pause`` on the client itself, not through the source, which would
know): what is checked is what the service does about a client that delivers nothing, on both
backends and a real broker: one WARNING, /ready 503 with the reason, the rebuild counted in
``panagg_consumer_rebuilds_total``, and intake resumed by a new client with every event counted
exactly once (docs/operations.md, "Intake stalled")."""

from __future__ import annotations

import logging
import threading
import time

import msgpack
import pytest

from aggregator.service.cli import _make_aggregator
from aggregator.service.config import load_config
from aggregator.service.metrics import Metrics
from tests.helpers.kafka import CLIENTS, D, make_topic, produce


class _ReadyLog(Metrics):
    """The service's metrics, with every change of /ready kept (a 503 lasts seconds only)."""

    def __init__(self):
        super().__init__()
        self.ready_log: list[tuple[bool, str]] = []

    def set_ready(self, ready: bool, reason: str = "") -> None:
        if not self.ready_log or self.ready_log[-1] != (bool(ready), reason):
            self.ready_log.append((bool(ready), reason))
        super().set_ready(ready, reason)


def wait_for(cond, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _stop_fetching(client, source) -> None:
    """Pause every assigned partition on the real client itself (the source does not know)."""
    parts = [(k.rsplit(":", 1)[0], int(k.rsplit(":", 1)[1])) for k in source.assigned]
    assert parts
    if client == "confluent":
        from confluent_kafka import TopicPartition

        source.consumer.pause([TopicPartition(t, p) for t, p in parts])
    else:
        from kafka.structs import TopicPartition as KafkaTopicPartition

        source.consumer.pause(*[KafkaTopicPartition(t, p) for t, p in parts])


@pytest.mark.parametrize("client", CLIENTS)
def test_a_consumer_that_delivers_nothing_is_said_rebuilt_and_loses_nothing(
    kafka_broker, tmp_path, caplog, client
):
    if client == "confluent":
        pytest.importorskip("confluent_kafka")
    topic = make_topic(kafka_broker)
    produce(kafka_broker, topic, [msgpack.packb({"item": i % D}) for i in range(3000)])
    cfg = load_config(
        None,
        [
            "source.kind=kafka",
            f"source.bootstrap={kafka_broker}",
            f"source.topic={topic}",
            f"source.group=g-{topic}",
            f"source.client={client}",
            f"state.domain_size={D}",
            "window.kind=count",
            "window.size=100000000",  # one open window: every event in it
            f"checkpoint.dir={tmp_path / 'state'}",
            f"release.dir={tmp_path / 'releases'}",
            "metrics.port=-1",
            "release.error_bar_reps=0",
            "release.workers=0",
            "release.plan_errors=false",
            "source.stall_timeout_s=3",
        ],
    )
    metrics = _ReadyLog()
    agg = _make_aggregator(cfg, metrics)
    events = metrics.events._value.get
    runner = threading.Thread(target=agg.run, name="service", daemon=True)
    with caplog.at_level(logging.INFO, logger="panagg"):
        runner.start()
        try:
            wait_for(lambda: events() == 3000, 120, "the first 3000 events")
            stuck = agg.source.consumer
            _stop_fetching(client, agg.source)
            produce(kafka_broker, topic, [msgpack.packb({"item": i % D}) for i in range(2000)])
            wait_for(lambda: agg.source.consumer is not stuck, 120, "the consumer's rebuild")
            wait_for(lambda: events() == 5000, 120, "the 2000 events after the stall")
            wait_for(lambda: metrics.readiness()[0] == 200, 60, "/ready 200 again")
            time.sleep(2)  # polls after the last record: nothing is delivered twice
        finally:
            agg.stop_event.set()
            runner.join(120)
    assert not runner.is_alive()
    assert events() == 5000
    assert agg.task.totals["events"] == 5000
    assert sum(agg.task.offsets.values()) == 5000  # every record once: none skipped, none twice
    assert metrics.consumer_rebuilds._value.get() >= 1
    stalled = [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if "Kafka intake stalled" in r.getMessage()
    ]
    assert len(stalled) == 1 and stalled[0][0] == logging.WARNING, stalled  # once per stall
    # public-safe: no count or offset of the data in the line (3 is source.stall_timeout_s)
    assert not any(ch.isdigit() for ch in stalled[0][1].replace("3 s", "")), stalled
    not_ready = [reason for ready, reason in metrics.ready_log if not ready]
    assert any("Kafka intake stalled" in reason for reason in not_ready), metrics.ready_log
    assert any("Kafka intake resumed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("client", CLIENTS)
def test_an_idle_transactional_topic_is_not_a_stall(kafka_broker, tmp_path, caplog, client):
    """A transactional producer's commit markers count in the end offsets but are no records:
    read to its end, the topic has end offsets past the service's positions and nothing to
    deliver. The client's own position (past the markers) says so: no stall, no rebuild."""
    if client == "confluent":
        pytest.importorskip("confluent_kafka")
    from kafka import KafkaProducer

    topic = make_topic(kafka_broker)
    producer = KafkaProducer(bootstrap_servers=kafka_broker, transactional_id=f"tx-{topic}")
    producer.init_transactions()
    for batch in range(3):
        producer.begin_transaction()
        for i in range(500):
            producer.send(topic, msgpack.packb({"item": (batch * 500 + i) % D}))
        producer.commit_transaction()
    producer.close()
    cfg = load_config(
        None,
        [
            "source.kind=kafka",
            f"source.bootstrap={kafka_broker}",
            f"source.topic={topic}",
            f"source.group=g-{topic}",
            f"source.client={client}",
            f"state.domain_size={D}",
            "window.kind=count",
            "window.size=100000000",
            f"checkpoint.dir={tmp_path / 'state'}",
            f"release.dir={tmp_path / 'releases'}",
            "metrics.port=-1",
            "release.error_bar_reps=0",
            "release.workers=0",
            "release.plan_errors=false",
            "source.stall_timeout_s=1",
        ],
    )
    metrics = _ReadyLog()
    agg = _make_aggregator(cfg, metrics)
    runner = threading.Thread(target=agg.run, name="service", daemon=True)
    with caplog.at_level(logging.INFO, logger="panagg"):
        runner.start()
        try:
            wait_for(lambda: metrics.events._value.get() == 1500, 120, "the 1500 events")
            ends = agg.source.end_offsets()
            assert sum(ends.values()) > sum(agg.task.offsets.values())  # the markers
            # idle past the stall time, over several of the 5 s health looks
            time.sleep(16)
        finally:
            agg.stop_event.set()
            runner.join(120)
    assert metrics.consumer_rebuilds._value.get() == 0
    assert not any("Kafka intake stalled" in r.getMessage() for r in caplog.records)
    assert all(ready for ready, _ in metrics.ready_log), metrics.ready_log


def test_several_aggregations_rebuild_their_one_consumer_and_lose_nothing(
    kafka_broker, tmp_path, caplog
):
    """Two aggregations fed by one consumer (aggregator/service/multi.py): the stall is seen by
    an aggregation's watch, the shared consumer is rebuilt once per look and its positions
    reset, and each aggregation still counts every event exactly once."""
    topic = make_topic(kafka_broker)
    produce(kafka_broker, topic, [msgpack.packb({"item": i % D}) for i in range(3000)])
    toml = tmp_path / "two.toml"
    toml.write_text(
        "[ledger]\nbudget_per_event = 2.0\n"
        "[aggregations.a]\nwindow.size = 100000000\nstate.epsilon = 1.0\n"
        "[aggregations.b]\nwindow.size = 100000000\nstate.epsilon = 1.0\n"
    )
    cfg = load_config(
        str(toml),
        [
            "source.kind=kafka",
            f"source.bootstrap={kafka_broker}",
            f"source.topic={topic}",
            f"source.group=g-{topic}",
            "source.client=kafka-python",
            f"state.domain_size={D}",
            "window.kind=count",
            f"checkpoint.dir={tmp_path / 'state'}",
            f"release.dir={tmp_path / 'releases'}",
            "metrics.port=-1",
            "release.error_bar_reps=0",
            "release.workers=0",
            "release.plan_errors=false",
            "source.stall_timeout_s=3",
        ],
    )
    metrics = _ReadyLog()
    hub = _make_aggregator(cfg, metrics)
    aggs = hub.aggs.values()

    def counted(n):
        return all(a.metrics.events._value.get() == n for a in aggs)

    runner = threading.Thread(target=hub.run, name="service", daemon=True)
    with caplog.at_level(logging.INFO, logger="panagg"):
        runner.start()
        try:
            wait_for(lambda: counted(3000), 120, "the first 3000 events in each aggregation")
            stuck = hub.source.consumer
            _stop_fetching("kafka-python", hub.source)
            produce(kafka_broker, topic, [msgpack.packb({"item": i % D}) for i in range(2000)])
            wait_for(lambda: hub.source.consumer is not stuck, 120, "the consumer's rebuild")
            wait_for(lambda: counted(5000), 120, "the 2000 events after the stall")
            wait_for(lambda: metrics.readiness()[0] == 200, 60, "/ready 200 again")
            time.sleep(2)
        finally:
            hub.stop_event.set()
            runner.join(120)
    assert not runner.is_alive()
    for agg in aggs:
        assert agg.task.totals["events"] == 5000
        assert sum(agg.task.offsets.values()) == 5000
    assert sum(a.metrics.consumer_rebuilds._value.get() for a in aggs) >= 1
    stalled = [r for r in caplog.records if "Kafka intake stalled" in r.getMessage()]
    assert 1 <= len(stalled) <= len(aggs), [r.getMessage() for r in stalled]
    assert any(
        "Kafka intake stalled" in reason for ready, reason in metrics.ready_log if not ready
    ), metrics.ready_log
