"""The service on a real broker: topics, producers, reading a topic back, the service as a
subprocess with the suite's seeded settings, and the scrape-and-wait of its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid

import msgpack
import numpy as np
from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.structs import TopicPartition
from prometheus_client.parser import text_string_to_metric_families

#: the domain and the test noise seed of :func:`service_args`
D = 2000
SEED = 777
#: both Kafka clients, for tests run against each
CLIENTS = ["kafka-python", "confluent"]


def make_topic(bootstrap, partitions=3):
    name = f"t-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    admin.close()
    return name


def produce(bootstrap, topic, values, key_of=None):
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, linger_ms=50, batch_size=256 * 1024, acks="all"
    )
    for i, v in enumerate(values):
        producer.send(topic, value=v, key=None if key_of is None else key_of(i))
    producer.flush()
    producer.close()


def produce_items(bootstrap, topic, n, seed):
    """``n`` msgpack events of items drawn from ``seed``, all to one partition (one key)."""
    items = np.random.default_rng(seed).integers(0, D, n)
    produce(
        bootstrap, topic, [msgpack.packb({"item": int(i)}) for i in items], key_of=lambda i: b"k"
    )
    return items


def service_args(bootstrap, topic, tmp_path, *extra):
    args = [
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
        "--set",
        f"state.domain_size={D}",
        "--set",
        "window.size=100000000",
        "--set",
        f"testing.noise_seed={SEED}",
        "--set",
        f"source.group=g-{topic}",
        "--set",
        "release.on_exhausted=false",
    ]
    return args + list(extra)


def count_window_args(bootstrap, topic, tmp_path, *extra):
    """:func:`service_args` with count windows of 1,000 that exits once idle for 3 s."""
    args = service_args(bootstrap, topic, tmp_path, "--exit-when-idle", "3", *extra)
    args[args.index("window.size=100000000")] = "window.size=1000"
    return args


def release_entries(tmp_path):
    """The release entries of the ledger in ``tmp_path/state``."""
    return [
        json.loads(x)
        for x in (tmp_path / "state" / "ledger.jsonl").read_text().splitlines()
        if json.loads(x)["kind"] == "release"
    ]


def env():
    return dict(os.environ, PANAGG_TESTING="1")


def run_service(args, timeout=240, extra_env=None):
    return subprocess.run(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(env(), **(extra_env or {})),
    )


def read_to_end(bootstrap, topic, isolation="read_uncommitted", timeout_s=60.0):
    """Every record of ``topic``, read from the beginning up to the end offsets taken first (no
    consumer_timeout_ms: that waits its whole length after the last record)."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level=isolation
    )
    try:
        deadline = time.monotonic() + timeout_s
        found = consumer.partitions_for_topic(topic)
        while not found and time.monotonic() < deadline:
            time.sleep(0.2)
            found = consumer.partitions_for_topic(topic)
        assert found, f"topic {topic} not found"
        parts = [TopicPartition(topic, p) for p in sorted(found)]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        ends = consumer.end_offsets(parts)
        out = []
        while any(consumer.position(tp) < ends[tp] for tp in parts):
            assert time.monotonic() < deadline, f"{topic}: not read to {ends} in {timeout_s} s"
            for recs in consumer.poll(timeout_ms=500).values():
                out.extend(recs)
        return sorted(out, key=lambda r: (r.partition, r.offset))
    finally:
        consumer.close()


def scrape(url):
    """{metric name: value} of the unlabelled samples at ``url``, by the real parser."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        f.name: f.samples[0].value
        for f in text_string_to_metric_families(text)
        if f.samples and not f.samples[0].labels
    }


def wait_for(cond, timeout_s, what):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if cond():
                return
        except OSError:  # (a scrape while the service starts or stops)
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def produce_at(bootstrap, topic, records):
    """``records``: (partition, timestamp in s, item), each sent to that partition with that
    Kafka timestamp (event-time windows read it)."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for part, ts, item in records:
        producer.send(
            topic, value=msgpack.packb({"item": item}), partition=part, timestamp_ms=int(ts * 1000)
        )
    producer.flush()
    producer.close()
