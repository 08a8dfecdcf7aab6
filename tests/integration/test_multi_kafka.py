"""Several aggregations of one login topic on the real broker: per account, per IP and per
device (logins only), one consumer, a SIGKILL mid-run and a restart; every aggregation's windows
hold exactly their events, and a record one aggregation rejects is its dead letter."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic

from tests.helpers.multi import login_aggregations

from tests.helpers.kafka import env, make_topic, run_service

SIZES = {"account": 1000, "ip": 1300, "device": 700}


def produce_logins(bootstrap, topic, count):
    """JSON login events over 3 partitions; returns the events each aggregation should count."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks="all")
    truth = {"account": 0, "ip": 0, "device": 0}
    for i in range(count):
        event = "login" if i % 4 else "logout"
        doc = {
            "user": {"id": i % 300},
            "device": f"dev-{i % 37}",
            "event": event,
            "ip": f"192.0.2.{i % 211}",
        }
        if i % 250 == 7:
            del doc["ip"]  # only the ip aggregation rejects it
        truth["account"] += 1
        truth["ip"] += "ip" in doc
        truth["device"] += event == "login"
        producer.send(topic, key=f"k{i % 13}".encode(), value=json.dumps(doc).encode())
    producer.flush()
    producer.close()
    return truth


def args_for(bootstrap, topic, tmp_path, group):
    toml = tmp_path / "multi.toml"
    toml.write_text(login_aggregations(300, 1300, SIZES))
    return [
        "run",
        "--config",
        str(toml),
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
        "source.format=json",
        "--set",
        f"source.group={group}",
        "--set",
        "release.error_bar_reps=0",
        "--set",
        f"source.dead_letter_topic={topic}-dlq",
        "--set",
        "source.max_records=300",
    ]


def released(tmp_path, name):
    docs = [json.loads(p.read_text()) for p in (tmp_path / "releases" / name).glob("*.json")]
    return sorted(docs, key=lambda d: d["window"])


def test_three_aggregations_one_consumer_exact_after_a_kill(kafka_broker, tmp_path):
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    truth = produce_logins(kafka_broker, topic, 9000)
    args = args_for(kafka_broker, topic, tmp_path, group)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:  # killed once some aggregation has released, others mid-window
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list((tmp_path / "releases").rglob("*.json")):
            time.sleep(0.05)
        members = KafkaAdminClient(bootstrap_servers=kafka_broker)
        described = members.describe_groups([group])[group]
        members.close()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert list((tmp_path / "releases").rglob("*.json")), "no release before the kill"
    assert len(described["members"]) == 1, described  # one consumer for the three aggregations
    done = run_service(args + ["--exit-when-idle", "3"])
    assert done.returncode == 0, done.stderr[-3000:]
    for name, size in SIZES.items():
        docs = released(tmp_path, name)
        assert [d["window"] for d in docs] == list(range(truth[name] // size)), name
        assert all(d["n"] == size for d in docs), name  # each window exactly its events
        assert all(d["aggregation"]["name"] == name for d in docs)
    # the open windows hold the rest: a restart over a few more records releases nothing twice
    ledgers = {
        name: [
            json.loads(x)
            for x in (tmp_path / "state" / name / "ledger.jsonl").read_text().splitlines()
        ]
        for name in SIZES
    }
    for name, entries in ledgers.items():
        windows = [e["window"] for e in entries if e["kind"] == "release"]
        assert len(windows) == len(set(windows)), name
        assert any(e["kind"] == "composition" for e in entries)
    # the ip aggregation's rejects, and only its, are dead letters (at least once)
    consumer = KafkaConsumer(
        f"{topic}-dlq",
        bootstrap_servers=kafka_broker,
        auto_offset_reset="earliest",
        group_id=f"check-{topic}",
    )
    got = []
    for _ in range(30):
        got += [r for recs in consumer.poll(timeout_ms=500).values() for r in recs]
        if len({r.key for r in got}) >= 9000 // 250 + (9000 % 250 > 7):
            break
    consumer.close()
    assert {dict(r.headers)["aggregation"] for r in got} == {b"ip"}
    assert all(r.key.endswith(b"#ip") and dict(r.headers)["reason"] == b"missing_item" for r in got)
    assert len({r.key for r in got}) == 9000 - truth["ip"]


def _tree(directory):
    """Every file under ``directory`` with its bytes (what a start wrote, if anything), but
    the lock files (a start holds them; they name its pid)."""
    return (
        {
            p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != "service.lock"
        }
        if directory.exists()
        else None
    )


def test_a_start_one_level_refuses_writes_nothing_in_any_level(kafka_broker, tmp_path):
    """window.rollups = ["1d"] (hybrid: the levels base and r1d, one directory each) on a topic
    that keeps a day: base's hour windows are replayable, r1d's day is not. The refusal came
    after base had started and left base/{checkpoints,ledger.jsonl,config.json}, for which the
    next start was refused (issue 46); now every level's checks run before any level writes."""
    topic = f"t-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    admin.create_topics(
        [
            NewTopic(
                topic,
                num_partitions=1,
                replication_factor=1,
                topic_configs={"retention.ms": str(3 * 86_400_000)},
            )
        ]
    )
    args = [
        "run",
        "--bootstrap",
        kafka_broker,
        "--topic",
        topic,
        "--exit-when-idle",
        "2",
        "--state-dir",
        str(tmp_path / "state"),
        "--release-dir",
        str(tmp_path / "rel"),
        "--metrics-port",
        "-1",
        "--set",
        f"source.group=g-{topic}",
        "--set",
        "state.domain_size=500",
        "--set",
        "window.kind=time",
        "--set",
        "window.size=3600",
        "--set",
        'window.rollups=["1d"]',
    ]
    fragment = "less than two windows (window.size=86400 s)"
    try:
        # a new directory: nothing left, not even the directories
        admin.alter_configs(
            [
                ConfigResource(
                    ConfigResourceType.TOPIC, topic, configs={"retention.ms": str(86_400_000)}
                )
            ]
        )
        refused = run_service(args)
        assert refused.returncode == 2 and fragment in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        assert _tree(tmp_path / "state") is None
        # a started directory: the refusal changes no file of either level
        admin.alter_configs(
            [
                ConfigResource(
                    ConfigResourceType.TOPIC, topic, configs={"retention.ms": str(3 * 86_400_000)}
                )
            ]
        )
        first = run_service(args)
        assert first.returncode == 0, first.stderr
        before = _tree(tmp_path / "state")
        assert {"base/ledger.jsonl", "r1d/ledger.jsonl"} <= set(before)
        admin.alter_configs(
            [
                ConfigResource(
                    ConfigResourceType.TOPIC, topic, configs={"retention.ms": str(86_400_000)}
                )
            ]
        )
        again = run_service(args)
        assert again.returncode == 2 and fragment in again.stderr, again.stderr
        assert _tree(tmp_path / "state") == before
    finally:
        admin.close()


def test_a_spent_budget_pauses_the_one_consumer_and_an_idle_run_still_exits(kafka_broker, tmp_path):
    """--exit-when-idle ends a run without events for that long. Once one aggregation's
    ledger.budget_total is spent the one consumer pauses (nothing more is counted): the run must
    end too, not wait forever (it did: a pause never counted as idle)."""
    topic = make_topic(kafka_broker)
    produce_logins(kafka_broker, topic, 3000)
    args = args_for(kafka_broker, topic, tmp_path, f"g-{uuid.uuid4().hex[:8]}")
    res = run_service(
        [*args, "--set", "ledger.budget_total=1", "--exit-when-idle", "3"], timeout=180
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert [d["window"] for d in released(tmp_path, "account")] == [0]
    paused = [ln for ln in res.stderr.splitlines() if "intake is paused" in ln]
    assert len(paused) == 1 and "privacy budget spent" in paused[0], res.stderr[-3000:]
