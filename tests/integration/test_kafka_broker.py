"""The deploy script gives a real broker that kafka-python can produce to and consume from."""

import uuid

import msgpack
from kafka import KafkaConsumer, KafkaProducer


def test_round_trip_through_a_real_broker(kafka_broker):
    topic = f"smoke-{uuid.uuid4().hex[:8]}"
    producer = KafkaProducer(bootstrap_servers=kafka_broker, value_serializer=msgpack.packb)
    for i in range(500):
        producer.send(topic, {"item": i % 7})
    producer.flush()
    producer.close()
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=kafka_broker,
        group_id="smoke",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=30_000,
        value_deserializer=msgpack.unpackb,
    )
    items = []
    for m in consumer:  # the 500, then a short look for any record more
        items.append(m.value["item"])
        if len(items) == 500:
            break
    items += [r.value["item"] for recs in consumer.poll(timeout_ms=1000).values() for r in recs]
    consumer.close()
    assert len(items) == 500 and sorted(set(items)) == list(range(7))
