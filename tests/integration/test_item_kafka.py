"""Choosing the item against a real broker: a nested field with a filter, the record key, a
header; filtered records are neither events nor rejects; a dead letter keeps the record's key."""

import json
import os
import subprocess
import sys
import uuid

from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

D = 500


def make_topic(bootstrap):
    name = f"i-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(name, num_partitions=2, replication_factor=1)])
    admin.close()
    return name


def run(bootstrap, topic, tmp_path, *sets):
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
        str(tmp_path / "state"),
        "--release-dir",
        str(tmp_path / "releases"),
        "--metrics-port",
        "-1",
        "--exit-when-idle",
        "3",
        "--set",
        f"source.group=g-{uuid.uuid4().hex[:6]}",
        "--set",
        "release.error_bar_reps=0",
        "--set",
        "source.format=json",
    ]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(
        args, capture_output=True, text=True, timeout=180, env=dict(os.environ, PANAGG_TESTING="1")
    )


def test_field_path_filter_key_and_header_items(kafka_broker, tmp_path):
    topic = make_topic(kafka_broker)
    dlq = f"{topic}-dlq"
    producer = KafkaProducer(bootstrap_servers=kafka_broker, linger_ms=20, acks="all")
    logins = 0
    for i in range(3000):
        event = "login" if i % 3 else "view"
        doc = {"event": event, "user": {"id": i % D}}
        if i == 301:
            doc = {"event": "login", "user": {"name": "SECRET-PAYLOAD-x7"}}  # no id: dead letter
        logins += event == "login" and i != 301
        producer.send(
            topic,
            key=f"acct-{i % 50}".encode(),
            value=json.dumps(doc).encode(),
            headers=[("device", f"Dev-{i % 7}".encode())],
        )
    producer.flush()
    producer.close()

    res = run(
        kafka_broker,
        topic,
        tmp_path / "path",
        f"state.domain_size={D}",
        "item.field=user.id",
        "item.filter_field=event",
        "item.filter_value=login",
        f"source.dead_letter_topic={dlq}",
        "window.size=1999",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "SECRET-PAYLOAD" not in res.stderr
    release = json.loads((tmp_path / "path" / "releases" / "release-0.json").read_text())
    assert release["n"] == logins == 1999
    consumer = KafkaConsumer(
        dlq, bootstrap_servers=kafka_broker, auto_offset_reset="earliest", group_id=f"check-{dlq}"
    )
    got = []
    for _ in range(20):
        got += [r for recs in consumer.poll(timeout_ms=500).values() for r in recs]
        if got:
            break
    consumer.close()
    assert len(got) == 1
    headers = dict(got[0].headers)
    assert headers["reason"] == b"missing_item" and headers["key"] == b"acct-1"  # 301 % 50
    assert got[0].key == headers["source"] and b"SECRET-PAYLOAD-x7" in got[0].value

    res = run(
        kafka_broker,
        topic,
        tmp_path / "key",
        "state.mode=hashed",
        "state.buckets=4096",
        "item.source=key",
        "window.size=3000",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    release = json.loads((tmp_path / "key" / "releases" / "release-0.json").read_text())
    assert release["n"] == 3000

    res = run(
        kafka_broker,
        topic,
        tmp_path / "hdr",
        "state.mode=hashed",
        "state.buckets=4096",
        "item.source=header",
        "item.header=device",
        "item.casefold=true",
        "item.filter_field=event",
        "item.filter_value=view",
        "window.size=1000",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    release = json.loads((tmp_path / "hdr" / "releases" / "release-0.json").read_text())
    assert release["n"] == 1000
