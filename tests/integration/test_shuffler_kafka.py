"""The shuffler on the real broker: clients -> panagg shuffle -> analyzer topic, kill -9 of the
shuffler mid-run, redelivered and malformed client records, then clients -> shuffler ->
analyzer end to end."""

import json
import os
import signal
import subprocess
import sys
import uuid

import numpy as np
from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from aggregator.service.config import load_config
from aggregator.service.shuffle_client import ShuffleClient
from aggregator.service.shuffle_wire import (new_keypair, open_boxes, parse_analyzer_record,
                                             parse_client_record, public_key_hex, save_private_key)

B, N, EPS = 40, 60, 20.0


def topics(bootstrap, **parts):
    names = {k: f"{k}-{uuid.uuid4().hex[:8]}" for k in parts}
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(names[k], num_partitions=p, replication_factor=1)
                         for k, p in parts.items()])
    admin.close()
    return names


def sets(bootstrap, t, tmp_path, pub, key_file=None):
    out = [f"source.bootstrap={bootstrap}", f"source.topic={t['analyzer']}",
           "state.model=shuffle", f"state.epsilon={EPS}", f"state.domain_size={B}",
           f"window.size={N}", f"shuffle.public_key={pub}", f"shuffle.client_topic={t['clients']}",
           f"shuffle.group=sh-{t['clients']}", f"shuffle.shuffler_dir={tmp_path / 'shuffler'}",
           f"source.dead_letter_topic={t['dlq']}", f"checkpoint.dir={tmp_path / 'state'}",
           f"release.dir={tmp_path / 'releases'}", "metrics.port=-1", f"source.group=an-{t['clients']}",
           "release.error_bar_reps=0", "release.estimator=threshold"]
    if key_file:
        out.append(f"shuffle.key_file={key_file}")
    return [x for s in out for x in ("--set", s)]


def shuffler_cmd(setargs, *extra):
    return [sys.executable, "-m", "aggregator.service.cli", "shuffle", "--config", os.devnull,
            *setargs, *extra]


def read_all(bootstrap, topic, isolation="read_committed"):
    c = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                      enable_auto_commit=False, consumer_timeout_ms=5000, isolation_level=isolation)
    out = list(c)
    c.close()
    return out


def test_kill_minus_nine_every_box_once_and_no_metadata(kafka_broker, tmp_path):
    t = topics(kafka_broker, clients=3, analyzer=1, dlq=1)
    key = new_keypair()
    pub = public_key_hex(key)
    setargs = sets(kafka_broker, t, tmp_path, pub)
    cfg = load_config(None, [a for a in setargs if a != "--set"])
    client = ShuffleClient.from_config(cfg)
    rng = np.random.default_rng()
    events = 6 * N
    items = rng.integers(0, B, events)
    records = client.records(items)
    sent_boxes = [b for _, v in records for b in parse_client_record(v)]
    producer = KafkaProducer(bootstrap_servers=kafka_broker, acks="all")
    kills = 0
    for i in range(0, events, N):
        for key_, value in records[i:i + N]:
            producer.send(t["clients"], key=key_, value=value)
        if i == 2 * N:  # a redelivered record and two malformed ones
            producer.send(t["clients"], key=records[5][0], value=records[5][1])
            producer.send(t["clients"], key=os.urandom(16), value=b"not msgpack")
            producer.send(t["clients"], key=b"short", value=records[6][1])
        producer.flush()
        proc = subprocess.Popen(shuffler_cmd(setargs), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            proc.wait(timeout=float(rng.uniform(2.0, 6.0)))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
    producer.close()
    done = subprocess.run(shuffler_cmd(setargs, "--exit-when-idle", "4"), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert kills >= 3

    recs = read_all(kafka_broker, t["analyzer"])
    assert all(r.key is None and not r.headers for r in recs)          # nothing of the clients
    docs = [parse_analyzer_record(r.value) for r in recs]
    by_window: dict = {}
    markers = {}
    for d in docs:
        if d.get("end"):
            assert d["window"] not in markers                             # each window once
            markers[d["window"]] = d
        else:
            by_window.setdefault(d["window"], []).extend(d["boxes"])
    assert sorted(markers) == list(range(events // N))
    got = [b for w in sorted(by_window) for b in by_window[w]]
    assert len(got) == len(set(got)) == len(sent_boxes)                   # none lost, none twice
    assert set(got) == set(sent_boxes)
    for w, m in markers.items():
        assert m["events"] == N and m["topped_up"] == 0 and m["messages"] == len(by_window[w])
        assert m["params"]["n"] == N and m["params"]["buckets"] == B
    # every real event's (x, +1) is in exactly one window: the analyzer's totals add up
    rows = open_boxes(got, key)
    counts = np.bincount(rows[rows[:, 1] > 0, 0], minlength=B) - np.bincount(rows[rows[:, 1] < 0, 0], minlength=B)
    noise = counts - np.bincount(items, minlength=B)
    assert abs(int(noise.sum())) < 60 * np.sqrt(B * len(markers))      # DLap(p) sums, p small
    letters = read_all(kafka_broker, t["dlq"])
    assert sorted(dict(m.headers)["reason"] for m in letters) == [b"malformed", b"no_event_id"]
    assert all(b"not msgpack" == m.value or m.key == b"short" for m in letters)


def test_clients_shuffler_analyzer_end_to_end(kafka_broker, tmp_path):
    t = topics(kafka_broker, clients=2, analyzer=1, dlq=1)
    key = new_keypair()
    key_file = tmp_path / "analyzer.key"
    save_private_key(key, str(key_file))
    setargs = sets(kafka_broker, t, tmp_path, public_key_hex(key), key_file)
    gen = subprocess.run([sys.executable, "-m", "aggregator.service.cli", "shuffle-clients",
                          "--config", os.devnull, *setargs, "--events", str(3 * N)],
                         capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr[-3000:]
    sh = subprocess.run(shuffler_cmd(setargs, "--exit-when-idle", "3"), capture_output=True,
                        text=True, timeout=300)
    assert sh.returncode == 0, sh.stderr[-3000:]
    an = subprocess.run([sys.executable, "-m", "aggregator.service.cli", "run", "--config",
                         os.devnull, *setargs, "--exit-when-idle", "4"],
                        capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert an.returncode == 0, an.stderr[-3000:]
    rel = sorted((tmp_path / "releases").glob("release-*.json"))
    assert len(rel) == 3
    for p in rel:
        doc = json.loads(p.read_text())
        assert doc["model"] == "shuffle" and doc["n"] == N
