"""A wrong topic name is one line at start, on a real broker, and the topic is not created."""

from __future__ import annotations

import subprocess
import sys
import uuid

from kafka import KafkaConsumer


def test_missing_topic_is_refused_and_not_created(kafka_broker, tmp_path):
    topic = f"typo-{uuid.uuid4().hex[:8]}"
    res = subprocess.run([sys.executable, "-m", "aggregator.service.cli", "run", "--bootstrap",
                          kafka_broker, "--topic", topic, "--state-dir", str(tmp_path / "s"),
                          "--metrics-port", "-1", "--exit-when-idle", "5"],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith(f"panagg: error: topic {topic!r} does not exist on the cluster: "
                           f"create it (e.g. kafka-topics.sh --create --topic {topic} "
                           "--partitions 3) or fix source.topic")
    probe = KafkaConsumer(bootstrap_servers=kafka_broker)
    try:
        assert topic not in probe.topics()  # reading did not create it
    finally:
        probe.close()
