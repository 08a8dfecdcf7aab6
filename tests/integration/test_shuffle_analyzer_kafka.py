"""The shuffle-model analyzer on the real broker: records made with shuffle_wire (no shuffler),
kill -9 at random points and inside checkpoint writes, an aborted transaction, a wrong key."""

import json
import os
import random
import signal
import subprocess
import sys
import uuid

import numpy as np
from kafka import KafkaProducer

from aggregator.service.shuffle_wire import (
    ParamTag,
    chunk_record,
    end_record,
    new_keypair,
    save_private_key,
    seal_rows,
)
from tests.helpers.kafka import make_topic, read_to_end

B, N, EPS = 200, 400, 20.0
#: the clients' parameter fingerprint (sealed into every message) at the analyzer's settings
TAG = ParamTag(
    {"protocol": "gkmp", "epsilon": EPS, "delta": 1e-6, "n": N, "buckets": B, "gamma": 0.1}
)


def produce(bootstrap, topic, values):
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    for v in values:
        producer.send(topic, value=v)
    producer.flush()
    producer.close()


def produce_aborted(bootstrap, topic, values):
    """Records in a transaction that is aborted: a read_committed reader never sees them."""
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, acks="all", transactional_id=f"tx-{uuid.uuid4().hex[:8]}"
    )
    producer.init_transactions()
    producer.begin_transaction()
    for v in values:
        producer.send(topic, value=v)
    producer.flush()
    producer.abort_transaction()
    producer.close()


def window(w, key, rng, chunk=25):
    """Noise-free rows of N events plus cancelling (j, +1), (j, -1) pairs: at eps = 20 the
    release is exactly the true anonymized histogram, so a lost or doubled chunk shows."""
    items = rng.zipf(1.4, N) % B
    pairs = rng.integers(0, B, 150)
    rows = np.concatenate(
        [
            np.column_stack([items, np.ones(N, np.int64)]),
            np.column_stack([pairs, np.ones(150, np.int64)]),
            np.column_stack([pairs, -np.ones(150, np.int64)]),
        ]
    ).astype(np.int64)
    rows = rows[rng.permutation(len(rows))]
    boxes = seal_rows(rows, key.public_key, TAG)
    chunks = [chunk_record(w, boxes[i : i + chunk]) for i in range(0, len(boxes), chunk)]
    marker = end_record(w, N, 0, len(boxes))
    counts = np.bincount(items, minlength=B)
    return chunks, marker, sorted(counts[counts > 0].tolist())


def args(bootstrap, topic, tmp_path, key_file, *extra):
    return [
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
        "state.model=shuffle",
        "--set",
        f"state.epsilon={EPS}",
        "--set",
        f"state.domain_size={B}",
        "--set",
        f"window.size={N}",
        "--set",
        f"shuffle.key_file={key_file}",
        "--set",
        f"source.group=g-{topic}",
        "--set",
        "release.error_bar_reps=0",
        "--set",
        "release.estimator=threshold",
        *extra,
    ]


def env(**extra):
    return dict(os.environ, PANAGG_TESTING="1", **extra)


def released(tmp_path):
    d = tmp_path / "releases"
    return (
        {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in d.glob("release-*.json")}
        if d.exists()
        else {}
    )


def ledger(tmp_path):
    path = tmp_path / "state" / "ledger.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_kill_minus_nine_exactly_one_release_per_window(kafka_broker, tmp_path):
    topic = make_topic(kafka_broker, partitions=1)
    key = new_keypair()
    key_file = tmp_path / "analyzer.key"
    save_private_key(key, str(key_file))
    rng = np.random.default_rng(11)
    wins = [window(w, key, rng) for w in range(3)]
    (c0, m0, t0), (c1, m1, t1), (c2, m2, t2) = wins
    bogus = chunk_record(1, seal_rows(np.array([[0, 1]] * 30, np.int64), key.public_key, TAG))
    # what arrives between two kills; the windows' markers come late (windows open across kills)
    steps = [
        c0[:10],
        c0[10:] + [m0],
        c1[:15],
        "aborted",
        c1[15:30],
        c1[30:] + [m1] + c2[:20],
        c2[20:],
        [m2],
    ]
    chooser = random.Random(5)
    kills = 0
    for i, step in enumerate(steps):
        if step == "aborted":
            produce_aborted(kafka_broker, topic, [bogus] * 3)
        else:
            produce(kafka_broker, topic, step)
        # every third run dies inside a checkpoint write, the others at a random time
        fault = (
            {"PANAGG_TEST_FAULT": f"checkpoint-before-rename:{chooser.randint(2, 4)}"}
            if i % 3 == 2
            else {}
        )
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                *args(kafka_broker, topic, tmp_path, key_file),
            ],
            env=env(**fault),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            proc.wait(timeout=chooser.uniform(2.0, 8.0))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert proc.returncode == -signal.SIGKILL
        kills += 1
        # an open window is never released before its marker
        open_windows = {0: i < 1, 1: i < 5, 2: i < 7}
        assert not [w for w in released(tmp_path) if open_windows[w]]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            *args(kafka_broker, topic, tmp_path, key_file),
            "--exit-when-idle",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert kills == len(steps)
    entries = ledger(tmp_path)
    rel = [e for e in entries if e["kind"] == "release"]
    assert [e["window"] for e in rel] == [0, 1, 2]
    assert not [e for e in entries if e["kind"] == "refused"]
    from aggregator.shuffle import GKMPRandomizer

    exact = GKMPRandomizer(EPS, 1e-6, N, B).delta_spent  # the exact delta, not the target
    assert all(e["epsilon_spent"] == EPS and e["delta_spent"] == exact < 1e-6 for e in rel)
    docs = released(tmp_path)
    assert sorted(docs) == [0, 1, 2]
    for w, (chunks, _, truth) in enumerate(wins):
        doc = docs[w]
        assert doc == json.loads(rel[w]["document"])
        assert doc["model"] == "shuffle" and doc["protocol"] == "gkmp" and doc["n"] == N
        assert doc["window_info"]["messages"] == N + 300
        assert sorted(r for r, c in doc["histogram"]["pairs"] for _ in range(c)) == truth


def test_wrong_key_dead_letters_and_one_refusal(kafka_broker, tmp_path):
    topic = make_topic(kafka_broker, partitions=1)
    dlq = f"{topic}-dlq"
    mine, theirs = new_keypair(), new_keypair()
    key_file = tmp_path / "analyzer.key"
    save_private_key(mine, str(key_file))
    chunks, marker, _ = window(0, theirs, np.random.default_rng(12))
    produce(kafka_broker, topic, chunks + [marker])
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            *args(
                kafka_broker, topic, tmp_path, key_file, "--set", f"source.dead_letter_topic={dlq}"
            ),
            "--exit-when-idle",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if " ERROR " in line or "ERROR" in line[:40]]
    ours = [line for line in errors if "panagg." in line]  # (kafka-python logs its own)
    assert len(ours) == 1, res.stderr  # one line per refused window: the key
    errors = ours
    assert "not released" in errors[0] and "no message decrypts" in errors[0]
    assert released(tmp_path) == {}
    assert [e["window"] for e in ledger(tmp_path) if e["kind"] == "refused"] == [0]
    letters = read_to_end(kafka_broker, dlq)
    assert len(letters) == len(chunks)
    assert all(dict(m.headers)["reason"] == b"undecryptable" for m in letters)
    assert {m.value for m in letters} == set(chunks)


def test_a_start_refused_after_the_analyzer_is_built_writes_nothing(kafka_broker, tmp_path):
    # the metrics port is taken: the start is refused after the analyzer (and its source) are
    # made, and a refused start leaves no trace (the analyzer made its state directory then)
    import socket

    topic = make_topic(kafka_broker, partitions=1)
    key_file = tmp_path / "analyzer.key"
    save_private_key(new_keypair(), str(key_file))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                *args(kafka_broker, topic, tmp_path, key_file, "--metrics-port", str(port)),
                "--exit-when-idle",
                "3",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env(),
        )
    assert res.returncode != 0
    assert "cannot serve metrics" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "state").exists() and not (tmp_path / "releases").exists()
