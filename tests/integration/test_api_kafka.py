"""examples/kafka_consumer.py against a real broker (issue 54): aggregator.api inside a plain
kafka-python consumer loop releases each window once, and a second run resumes at the open
window's start (its records counted once more under fresh noise, the released windows' never)."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import msgpack
import numpy as np
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from aggregator.api import Release

ROOT = Path(__file__).resolve().parents[2]
D = 400


def produce(bootstrap, topic, items):
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks="all")
    for k, i in enumerate(items):
        producer.send(topic, partition=k % 2, value=msgpack.packb({"item": int(i)}))
    producer.flush()
    producer.close()


def run_example(bootstrap, topic, tmp_path):
    args = [
        sys.executable,
        str(ROOT / "examples" / "kafka_consumer.py"),
        "--bootstrap",
        bootstrap,
        "--topic",
        topic,
        "--state-dir",
        str(tmp_path / "state"),
        "--release-dir",
        str(tmp_path / "releases"),
        "--exit-when-idle",
        "3",
        "--set",
        f"state.domain_size={D}",
        "--set",
        "window.kind=count",
        "--set",
        "window.size=1000",
        "--set",
        "release.plan_errors=false",
    ]
    res = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return [line for line in res.stdout.splitlines() if line.startswith("window ")]


def test_the_kafka_consumer_example_releases_each_window_once(kafka_broker, tmp_path):
    topic = f"api-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
    admin.close()
    xs = np.random.default_rng(2).integers(0, D, 3000)
    produce(kafka_broker, topic, xs[:2500])

    lines = run_example(kafka_broker, topic, tmp_path)
    assert [ln.split(":")[0] for ln in lines] == ["window 0", "window 1"]
    assert all("n=1000 " in ln and "eps=1 per event" in ln for ln in lines)

    produce(kafka_broker, topic, xs[2500:])
    lines = run_example(kafka_broker, topic, tmp_path)  # replays window 2's first 500
    assert [ln.split(":")[0] for ln in lines] == ["window 2"] and "n=1000 " in lines[0]

    ledgered = Release.from_ledger(tmp_path / "state" / "ledger.jsonl")
    assert [(r.window, r.n, r.epsilon_spent) for r in ledgered] == [
        (0, 1000, 1.0),
        (1, 1000, 1.0),
        (2, 1000, 1.0),
    ]
    assert ledgered[-1].ledger["totals"]["events"] == 3000  # each record once
    for r in ledgered:
        assert (
            Release.read(tmp_path / "releases" / f"release-{r.window}.json") == r.without_ledger()
        )
        assert r.document["counted"]["stream"] == f"kafka:{topic}"
    kinds = [
        json.loads(x)["kind"]
        for x in (tmp_path / "state" / "ledger.jsonl").read_text().splitlines()
    ]
    assert "restart" in kinds
