"""Where a new state directory starts (source.start) against a real broker: latest, a time
(offsets_for_times on the records' timestamps), stated in the start line; an explicit start on a
directory that resumes from its checkpoint is refused with one line."""

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone

import msgpack
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

D = 100


def run(bootstrap, topic, state, *sets):
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
        str(state / "state"),
        "--release-dir",
        str(state / "releases"),
        "--metrics-port",
        "-1",
        "--exit-when-idle",
        "2",
        "--set",
        f"source.group=g-{topic}-{state.name}",
        "--set",
        f"state.domain_size={D}",
        "--set",
        "release.error_bar_reps=0",
    ]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(
        args, capture_output=True, text=True, timeout=180, env=dict(os.environ, PANAGG_TESTING="1")
    )


def produce(bootstrap, topic, n, ts_ms=None):
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks="all")
    for i in range(n):
        producer.send(topic, value=msgpack.packb({"item": i % D}), timestamp_ms=ts_ms)
    producer.flush()
    producer.close()


def released(state):
    return [json.loads(p.read_text())["n"] for p in sorted((state / "releases").glob("*.json"))]


def test_start_latest_and_at_a_time(kafka_broker, tmp_path):
    topic = f"st-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
    admin.close()
    now = int(time.time() * 1000)
    produce(kafka_broker, topic, 500, ts_ms=now - 2 * 3600_000)  # two hours ago
    produce(kafka_broker, topic, 400, ts_ms=now - 3600_000)  # one hour ago

    latest = tmp_path / "latest"
    res = run(kafka_broker, topic, latest, "source.start=latest", "window.size=300")
    assert res.returncode == 0, res.stderr[-3000:]
    line = [x for x in res.stderr.splitlines() if "starting window 0 at" in x]
    assert line and "the latest offsets (source.start)" in line[0] and f"{topic}:0 at " in line[0]
    produce(kafka_broker, topic, 300)
    # the next start resumes from the checkpoint (source.start no longer given: not refused)
    res = run(kafka_broker, topic, latest, "window.size=300")
    assert res.returncode == 0, res.stderr[-3000:]
    assert released(latest) == [300]

    at = datetime.fromtimestamp((now - 90 * 60_000) / 1000, timezone.utc).isoformat()
    timed = tmp_path / "timed"
    res = run(kafka_broker, topic, timed, f"source.start={at}", "window.size=700")
    assert res.returncode == 0, res.stderr[-3000:]
    assert any(
        f"the first records at or after {at} (source.start)" in x for x in res.stderr.splitlines()
    )
    assert released(timed) == [700]  # the 400 of an hour ago and the 300 since

    res = run(kafka_broker, topic, timed, "source.start=latest", "window.size=700")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("panagg: error: source.start = latest only places a new state directory")
        and "use a new checkpoint.dir" in last
    )
