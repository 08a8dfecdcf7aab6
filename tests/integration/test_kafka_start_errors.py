"""A wrong topic name is one line at start, on a real broker, and the topic is not created."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from kafka import KafkaConsumer


def test_missing_topic_is_refused_and_not_created(kafka_broker, tmp_path):
    topic = f"typo-{uuid.uuid4().hex[:8]}"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "run",
            "--bootstrap",
            kafka_broker,
            "--topic",
            topic,
            "--state-dir",
            str(tmp_path / "s"),
            "--metrics-port",
            "-1",
            "--exit-when-idle",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"panagg: error: topic {topic!r} does not exist on the cluster: "
        f"create it (e.g. kafka-topics.sh --create --topic {topic} "
        "--partitions 3) or fix source.topic"
    )
    probe = KafkaConsumer(bootstrap_servers=kafka_broker)
    try:
        assert topic not in probe.topics()  # reading did not create it
    finally:
        probe.close()


def test_a_missing_analyzer_topic_names_the_command_that_makes_it(kafka_broker, tmp_path):
    """The shuffle model's analyzer topic has one partition: the line names panagg's command,
    not kafka-topics.sh with three (docs/shuffle.md's analyzer block found it)."""
    topic = f"typo-{uuid.uuid4().hex[:8]}"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "run",
            "--bootstrap",
            kafka_broker,
            "--topic",
            topic,
            "--state-dir",
            str(tmp_path / "s"),
            "--metrics-port",
            "-1",
            "--set",
            "state.model=shuffle",
            "--set",
            "window.size=1000",
            "--set",
            "state.domain_size=100",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PANAGG_SHUFFLE_PRIVATE_KEY": "11" * 32},
    )
    assert res.returncode == 2, res.stderr
    assert (
        res.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"panagg: error: topic {topic!r} does not exist on the cluster: create it with "
            "`panagg shuffle-topics --config FILE` (one partition, with the client topic) or fix "
            "source.topic"
        )
    )  # (then the topics there, on a broker other tests use)
    assert not (tmp_path / "s").exists()
