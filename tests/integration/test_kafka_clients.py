"""The Kafka source interface, the same checks against both clients on a real broker
(``source.client``: kafka-python and confluent-kafka): every record once with its offset, key,
headers and timestamp; the checkpoint's offsets honoured on assignment; pause, seek and resume
replaying exactly; commits carrying the ledger's anchor; end, start and committed offsets; lag.
Then the service itself on each client: the same topic gives the same counts."""

from __future__ import annotations

import json
import time
import uuid

import msgpack
import pytest
from kafka import KafkaProducer

from tests.helpers.kafka import CLIENTS, D, make_topic, run_service, service_args


def _source(client, bootstrap, topic, group=None, max_records=500):
    group = group or f"g-{uuid.uuid4().hex[:8]}"
    if client == "confluent":
        pytest.importorskip("confluent_kafka")
        from consumers.kafka.confluent import ConfluentSource

        return ConfluentSource(bootstrap, topic, group, max_records)
    from consumers.kafka.kafka_python import KafkaSource

    return KafkaSource(bootstrap, topic, group, max_records)


def _produce(bootstrap, topic, n, partitions=3, t0=None):
    """n records round-robin over the partitions, key ``k<i>``, a header ``h=<i>``, timestamps
    t0 + i ms; returns {(partition, offset-in-partition): i}."""
    t0 = t0 if t0 is not None else int(time.time() * 1000) - 10 * n
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20)
    placed = {}
    futures = []
    for i in range(n):
        futures.append(
            (
                i,
                producer.send(
                    topic,
                    value=msgpack.packb({"item": i % D}),
                    key=f"k{i}".encode(),
                    headers=[("h", str(i).encode())],
                    partition=i % partitions,
                    timestamp_ms=t0 + i,
                ),
            )
        )
    producer.flush()
    for i, fut in futures:
        md = fut.get(timeout=30)
        placed[(md.partition, md.offset)] = i
    producer.close()
    return placed, t0


def _drain(source, want, timeout_s=60.0):
    """Poll until ``want`` records came (or the time is up); returns every record as
    (partition key, offset, value, key, headers, timestamp)."""
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        for seg in source.poll(0.5):
            assert (
                len(seg.offsets)
                == len(seg.values)
                == len(seg.keys)
                == len(seg.headers)
                == len(seg.timestamps)
            )
            got += list(
                zip(
                    [seg.partition] * len(seg),
                    seg.offsets,
                    seg.values,
                    seg.keys,
                    seg.headers,
                    seg.timestamps,
                )
            )
    return got


@pytest.mark.parametrize("client", CLIENTS)
def test_every_record_once_with_its_offset_key_headers_and_timestamp(kafka_broker, client):
    topic = make_topic(kafka_broker)
    placed, t0 = _produce(kafka_broker, topic, 1200)
    src = _source(client, kafka_broker, topic)
    try:
        got = _drain(src, 1200)
        assert len(got) == 1200
        assert len({(p, o) for p, o, *_ in got}) == 1200
        for part, off, value, key, headers, ts in got:
            i = placed[(int(part.rsplit(":", 1)[1]), off)]
            assert msgpack.unpackb(value) == {"item": i % D}
            assert key == f"k{i}".encode()
            assert [(h, bytes(v)) for h, v in headers] == [("h", str(i).encode())]
            assert ts == t0 + i
        assert src.assigned == {f"{topic}:{p}" for p in range(3)}
        assert src.end_offsets() == {f"{topic}:{p}": 400 for p in range(3)}
        assert src.initial_offsets("latest") == {f"{topic}:{p}": 400 for p in range(3)}
        # by time: partition p's record i = 3j + p has timestamp t0 + i
        at = src.initial_offsets(t0 + 600)
        want = {
            f"{topic}:{p}": min(o for (q, o), i in placed.items() if q == p and i >= 600)
            for p in range(3)
        }
        assert at == want
        assert src.caught_up(src.assigned)
        assert src.lag({k: 400 for k in src.assigned}) in ({k: 0 for k in src.assigned}, {})
        assert src.lag_now({k: 100 for k in src.assigned}) == {k: 300 for k in src.assigned}
        assert topic in src.topics()
        assert src.connected() in (True, None)
    finally:
        src.close()


@pytest.mark.parametrize("client", CLIENTS)
def test_the_checkpoint_offsets_are_where_reading_starts(kafka_broker, client):
    topic = make_topic(kafka_broker)
    placed, _ = _produce(kafka_broker, topic, 600)
    src = _source(client, kafka_broker, topic)
    try:
        start = {f"{topic}:0": 150, f"{topic}:1": 0, f"{topic}:2": 199}
        src.seek(start)  # before the first poll, as the service does on a restart
        got = _drain(src, 200 - 150 + 200 + 1)
        by_part = {}
        for part, off, *_ in got:
            by_part.setdefault(part, []).append(off)
        assert {p: (min(o), max(o), len(o)) for p, o in by_part.items()} == {
            f"{topic}:0": (150, 199, 50),
            f"{topic}:1": (0, 199, 200),
            f"{topic}:2": (199, 199, 1),
        }
    finally:
        src.close()


@pytest.mark.parametrize("client", CLIENTS)
def test_pause_seek_and_resume_replay_exactly(kafka_broker, client):
    """The service holds a partition (pause), rewinds it (seek_partition) and lets it go on
    (resume) to replay a window: the records after the seek come again, once, in order."""
    topic = make_topic(kafka_broker, partitions=2)
    _produce(kafka_broker, topic, 400, partitions=2)
    src = _source(client, kafka_broker, topic, max_records=50)
    try:
        first = _drain(src, 400)
        assert len(first) == 400
        key = f"{topic}:1"
        src.pause([key])
        src.seek_partition(key, 120)
        _produce(kafka_broker, topic, 20, partitions=2)  # 10 more in each partition
        while_paused = _drain(src, 10, timeout_s=8)
        assert {p for p, *_ in while_paused} == {f"{topic}:0"}
        assert [o for _, o, *_ in while_paused] == list(range(200, 210))
        src.resume([key])
        again = _drain(src, 90)
        assert [o for _, o, *_ in again] == list(range(120, 210))
        assert {p for p, *_ in again} == {key}
    finally:
        src.close()


@pytest.mark.parametrize("client", CLIENTS)
def test_commits_carry_the_ledger_anchor(kafka_broker, client):
    topic = make_topic(kafka_broker, partitions=2)
    _produce(kafka_broker, topic, 100, partitions=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    src = _source(client, kafka_broker, topic, group=group)
    try:
        assert len(_drain(src, 100)) == 100
        anchor = json.dumps({"ledger": "abc", "seq": 7})
        src.commit({f"{topic}:0": 30, f"{topic}:1": 50}, anchor)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and src.committed_offsets() != {
            f"{topic}:0": 30,
            f"{topic}:1": 50,
        }:
            src.poll(0.2)  # asynchronous commits complete inside poll
        assert src.committed_offsets() == {f"{topic}:0": 30, f"{topic}:1": 50}
        assert src.committed_metadata() == [anchor, anchor]
    finally:
        src.close()
    # the other client reads what this one committed: one group, two clients, one truth
    other = _source(CLIENTS[1 - CLIENTS.index(client)], kafka_broker, topic, group=group)
    try:
        assert other.committed_offsets() == {f"{topic}:0": 30, f"{topic}:1": 50}
    finally:
        other.close()


@pytest.mark.parametrize("client", CLIENTS)
def test_replay_problem_names_retention(kafka_broker, client):
    from kafka.admin import KafkaAdminClient, NewTopic

    name = f"t-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    admin.create_topics([NewTopic(name, 1, 1, topic_configs={"retention.ms": "60000"})])
    admin.close()
    src = _source(client, kafka_broker, name)
    try:
        problem = src.replay_problem({f"{name}:0": 0}, window_seconds=3600)
        assert problem and "retention.ms=60000" in problem
        assert src.replay_problem({f"{name}:0": 0}, window_seconds=10) is None
    finally:
        src.close()


def test_the_service_counts_the_same_on_both_clients(kafka_broker, tmp_path):
    """One topic, the service on each client with the same noise seed: the same window, the
    same n, the same counters (the release's n and the ledgered positions agree)."""
    pytest.importorskip("confluent_kafka")
    topic = make_topic(kafka_broker)
    _produce(kafka_broker, topic, 3000)
    out = {}
    for client in CLIENTS:
        d = tmp_path / client
        args = service_args(
            kafka_broker,
            topic,
            d,
            "--exit-when-idle",
            "4",
            "--set",
            f"source.group=g-{client}-{topic}",
            "--set",
            f"source.client={client}",
            "--set",
            "window.size=3000",
            "--set",
            "release.error_bar_reps=0",
        )
        res = run_service(args)
        assert res.returncode == 0, res.stderr[-3000:]
        assert ("reading with confluent-kafka" in res.stderr) == (client == "confluent")
        doc = json.loads((d / "releases" / "release-0.json").read_text())
        out[client] = (doc["n"], doc["histogram"])
    assert out["kafka-python"] == out["confluent"]
    assert out["confluent"][0] == 3000


@pytest.mark.parametrize("client", CLIENTS)
def test_caught_up_when_started_at_the_end_with_nothing_to_read(kafka_broker, client):
    """A restart whose checkpoint is at the end of every partition reads nothing: it is caught
    up (what --exit-when-idle and the replay wait ask), not waiting for a position forever."""
    topic = make_topic(kafka_broker, partitions=2)
    _produce(kafka_broker, topic, 40, partitions=2)
    src = _source(client, kafka_broker, topic)
    try:
        src.seek({f"{topic}:0": 20, f"{topic}:1": 20})
        deadline = time.monotonic() + 60
        while len(src.assigned) < 2 and time.monotonic() < deadline:
            assert src.poll(0.5) == []
        assert src.caught_up(sorted(src.assigned))
        _produce(kafka_broker, topic, 2, partitions=2)
        assert not src.caught_up(sorted(src.assigned))
    finally:
        src.close()
