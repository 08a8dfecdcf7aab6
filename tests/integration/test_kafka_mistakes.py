"""Issue 27 on a real broker: a refused start writes nothing, so following its advice works; the
refusal is not preceded by the normal stop line; kafka-python's own lines stay out of normal runs
and broker restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import msgpack
from kafka import KafkaConsumer, KafkaProducer
from tests.helpers.kafka import make_topic, scrape, wait_for


D = 100


def run(bootstrap, topic, state, group, *extra, timeout=180):
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
        f"source.group={group}",
        "--set",
        f"state.domain_size={D}",
        "--set",
        "release.error_bar_reps=0",
        "--set",
        "window.size=350",
        *extra,
    ]
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PANAGG_TESTING="1"),
    )


def new_topic(bootstrap, partitions=2) -> str:
    return make_topic(bootstrap, partitions)


def produce(bootstrap, topic, n):
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks="all")
    for i in range(n):
        producer.send(topic, value=msgpack.packb({"item": i % D}))
    producer.flush()
    producer.close()


def ledger_kinds(state):
    path = state / "state" / "ledger.jsonl"
    return [json.loads(x)["kind"] for x in path.read_text().splitlines() if x.strip()]


def refused_and_wrote_nothing(res, state):
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert "stopped (" not in res.stderr  # no normal stop line before the refusal
    # a refused start writes nothing: no ledger entry, no saved config, no checkpoint
    assert not (state / "state" / "ledger.jsonl").exists()
    assert not (state / "state" / "config.json").exists()
    assert not list((state / "state").glob("checkpoints/*"))
    assert not (state / "releases").exists()
    return res.stderr.strip().splitlines()[-1]


def released_n(state):
    return sum(json.loads(p.read_text())["n"] for p in (state / "releases").glob("*.json"))


def test_following_the_committed_offsets_refusal_works(kafka_broker, tmp_path):
    """The group's offsets were committed by another consumer (no panagg state behind them)."""
    topic = new_topic(kafka_broker)
    produce(kafka_broker, topic, 700)
    group = f"g-{topic}"
    other = KafkaConsumer(
        topic,
        bootstrap_servers=kafka_broker,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    got = 0
    while got < 700:
        got += sum(len(v) for v in other.poll(timeout_ms=1000).values())
    other.commit()
    other.close()
    b = tmp_path / "b"
    line = refused_and_wrote_nothing(run(kafka_broker, topic, b, group), b)
    assert line == (
        f"panagg: error: no checkpoint in {b / 'state' / 'checkpoints'}, but consumer group "
        f"'{group}' has committed offsets: another state directory (or a lost one) counted this "
        "topic. Use that state directory, another source.group, or --fresh-start to count from "
        "the committed offsets"
    )
    # following the advice literally works, on the same directory: another source.group ...
    res = run(kafka_broker, topic, b, f"{group}-2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert ledger_kinds(b)[0] == "identity" and released_n(b) == 700
    # ... or --fresh-start (counting from the committed offsets: nothing new yet)
    c = tmp_path / "c"
    refused_and_wrote_nothing(run(kafka_broker, topic, c, group), c)
    produce(kafka_broker, topic, 350)
    res = run(kafka_broker, topic, c, group, "--fresh-start")
    assert res.returncode == 0, res.stderr[-3000:]
    assert released_n(c) == 350


def test_a_new_directory_on_a_group_another_one_used(kafka_broker, tmp_path):
    """The group's offsets carry another panagg directory's ledger head: the refusal says it may
    be another directory (not only a lost ledger), and another group works."""
    topic = new_topic(kafka_broker)
    produce(kafka_broker, topic, 700)
    group = f"g-{topic}"
    first = run(kafka_broker, topic, tmp_path / "a", group)
    assert first.returncode == 0, first.stderr[-3000:]
    b = tmp_path / "b"
    line = refused_and_wrote_nothing(run(kafka_broker, topic, b, group), b)
    assert line == (
        f"panagg: error: checkpoint.dir {b / 'state'} is new, but consumer group '{group}' has "
        "committed offsets of a state directory whose ledger had 3 entries: another state "
        "directory (or a lost one) counted this topic. Use that state directory (restore it from "
        "a backup if it was lost), or another source.group to count the topic anew"
    )
    res = run(kafka_broker, topic, b, f"{group}-2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert released_n(b) == 700


def test_broker_restarts_show_only_panaggs_lines(tmp_path, restartable_broker):
    """The restartable broker, stopped and started again under a running service: kafka-python's
    connection aborts and refused reconnects (a dozen ERROR lines) are not in the log, the
    service's own two lines are; it counts every event."""
    broker = restartable_broker
    bootstrap = broker.bootstrap
    proc = None
    try:
        topic = new_topic(bootstrap, partitions=2)
        produce(bootstrap, topic, 20000)
        log_path = tmp_path / "service.log"
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
            "0",
            "--set",
            f"state.domain_size={D}",
            "--set",
            "window.size=10000",
            "--set",
            "release.error_bar_reps=0",
            "--set",
            "source.max_records=2000",
        ]
        proc = subprocess.Popen(
            args, env=dict(os.environ, PANAGG_TESTING="1"), stderr=open(log_path, "w"), text=True
        )
        url = []
        wait_for(
            lambda: (
                url
                or [
                    url.append(x.split()[-1])
                    for x in log_path.read_text().splitlines()
                    if x.startswith("metrics on ")
                ]
            ),
            60,
            "the metrics URL",
        )
        wait_for(lambda: scrape(url[0])["panagg_events"] == 20000, 90, "the first events")
        # (a kill -9 of the broker is left out here: the service can stop on a
        # KafkaConnectionError from the consumer's poll then, a fault of issue 27's first part)
        broker.stop()
        wait_for(lambda: scrape(url[0])["panagg_broker_connected"] == 0, 60, "connected = 0")
        time.sleep(3)  # the client retries its connections meanwhile
        assert broker.start() == bootstrap  # the same port
        produce(bootstrap, topic, 10000)
        wait_for(
            lambda: scrape(url[0])["panagg_events"] == 30000, 120, "counting after the restart"
        )
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        assert proc.returncode == 0, log_path.read_text()[-3000:]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
    lines = log_path.read_text().splitlines()
    assert [x for x in lines if " kafka" in x] == []  # no line of kafka-python's own
    assert "Traceback" not in log_path.read_text()
    # the service's own account of the outage is there (its wording is the faults part's)
    assert any("WARNING panagg.service: Kafka broker unreachable" in x for x in lines), lines
