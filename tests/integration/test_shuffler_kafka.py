"""The shuffler on the real broker: clients -> panagg shuffle -> analyzer topic.

* kill -9 of the shuffler mid-window (records arriving while it runs, window boundaries not
  aligned with the kills), once exactly before and once exactly after a window's
  ``commit_transaction``: every window on the analyzer topic (read_committed) holds exactly the
  boxes of its events, no box lost or twice, no event split across windows, redeliveries
  dropped, malformed records dead-lettered with reasons, and nothing of the clients' records
  (keys, event ids, headers, timestamps) on the analyzer topic;
* time windows: a short window is topped up to n, a window never takes more than n events;
* clients -> shuffler -> analyzer (``panagg run`` with state.model = shuffle) releases.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from aggregator.service.config import load_config
from tests.helpers.kafka import read_to_end
from aggregator.service.shuffle_client import ShuffleClient
from aggregator.service.shuffle_wire import (
    new_keypair,
    open_boxes,
    parse_analyzer_record,
    parse_client_record,
    public_key_hex,
    save_private_key,
)

B, N, EPS = 40, 60, 20.0


def topics(bootstrap, **parts):
    names = {k: f"{k}-{uuid.uuid4().hex[:8]}" for k in parts}
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics(
        [NewTopic(names[k], num_partitions=p, replication_factor=1) for k, p in parts.items()]
    )
    admin.close()
    return names


def sets(bootstrap, t, tmp_path, pub, key_file=None, *extra):
    out = [
        f"source.bootstrap={bootstrap}",
        f"source.topic={t['analyzer']}",
        "state.model=shuffle",
        f"state.epsilon={EPS}",
        f"state.domain_size={B}",
        f"window.size={N}",
        f"shuffle.public_key={pub}",
        f"shuffle.client_topic={t['clients']}",
        f"shuffle.group=sh-{t['clients']}",
        f"shuffle.shuffler_dir={tmp_path / 'shuffler'}",
        f"source.dead_letter_topic={t['dlq']}",
        f"checkpoint.dir={tmp_path / 'state'}",
        f"release.dir={tmp_path / 'releases'}",
        "metrics.port=-1",
        f"source.group=an-{t['clients']}",
        "release.error_bar_reps=0",
        "release.estimator=threshold",
        *extra,
    ]
    if key_file:
        out.append(f"shuffle.key_file={key_file}")
    return [x for s in out for x in ("--set", s)]


def shuffler_cmd(setargs, *extra):
    return [
        sys.executable,
        "-m",
        "aggregator.service.cli",
        "shuffle",
        "--config",
        os.devnull,
        *setargs,
        *extra,
    ]


def read_all(bootstrap, topic, isolation="read_committed"):
    return read_to_end(bootstrap, topic, isolation)


def windows_of(recs):
    """{window: boxes} and {window: end marker} of analyzer records (each marker once)."""
    by_window, markers = {}, {}
    for r in recs:
        d = parse_analyzer_record(r.value)
        if d.get("end"):
            assert d["window"] not in markers  # each window once
            markers[d["window"]] = d
        else:
            assert d["window"] not in markers  # chunks before the marker
            by_window.setdefault(d["window"], []).extend(d["boxes"])
    return by_window, markers


def no_client_metadata(recs, records):
    assert all(r.key is None and not r.headers for r in recs)
    stamps = {}
    for r in recs:
        stamps.setdefault(parse_analyzer_record(r.value)["window"], set()).add(r.timestamp)
    assert all(len(s) == 1 for s in stamps.values())  # one timestamp a window
    blob = b"".join(r.value for r in recs)
    assert not any(k in blob for k, _ in records[:200])  # no event id anywhere


def test_kill_minus_nine_mid_window_every_window_exact(kafka_broker, tmp_path):
    t = topics(kafka_broker, clients=3, analyzer=1, dlq=1)
    key = new_keypair()
    setargs = sets(kafka_broker, t, tmp_path, public_key_hex(key))
    cfg = load_config(None, [a for a in setargs if a != "--set"])
    client = ShuffleClient.from_config(cfg)
    rng = np.random.default_rng()
    windows = 8
    events = windows * N
    items = rng.integers(0, B, events)
    records = client.records(items)
    owner = {}  # box -> event index
    for i, (_, v) in enumerate(records):
        for b in parse_client_record(v):
            owner[b] = i
    producer = KafkaProducer(bootstrap_servers=kafka_broker, acks="all")

    def send(lo, hi):
        for key_, value in records[lo:hi]:
            producer.send(t["clients"], key=key_, value=value)
        producer.flush()

    env = dict(os.environ, PANAGG_TESTING="1")
    # 1. 1.5 windows; killed inside the first commit after the transaction's sends and the
    #    pending state, before commit_transaction: the window is aborted, read again
    send(0, 3 * N // 2)
    first = subprocess.run(
        shuffler_cmd(setargs),
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(env, PANAGG_TESTING_SHUFFLER_KILL="before_commit"),
    )
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    aborted = len(read_all(kafka_broker, t["analyzer"], "read_uncommitted"))
    assert aborted > 0 and read_all(kafka_broker, t["analyzer"]) == []
    # 2. killed just after commit_transaction, before the state file marks window 0 committed
    second = subprocess.run(
        shuffler_cmd(setargs),
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(env, PANAGG_TESTING_SHUFFLER_KILL="after_commit"),
    )
    assert second.returncode == -signal.SIGKILL, second.stderr[-2000:]
    # a redelivery of an event of window 0, which the state file holds only as pending: the
    # restart finds window 0 committed in Kafka, keeps its event ids and drops the copy
    state = json.loads((tmp_path / "shuffler" / "shuffler.json").read_text())
    assert state["pending"]["window"] == 0 and state["next_window"] == 0
    again = next(r for r in records if r[0].hex() == state["pending"]["ids"][7])
    producer.send(t["clients"], key=again[0], value=again[1])
    # 3. the rest in uneven pieces while the shuffler runs, killed -9 at random moments
    sent, kills = 3 * N // 2, 0
    bad_sent = False
    while sent < events or kills < 4:
        proc = subprocess.Popen(
            shuffler_cmd(setargs), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        deadline = time.monotonic() + float(rng.uniform(2.5, 6.0))
        while time.monotonic() < deadline:
            if sent < events:
                step = int(rng.integers(N // 4, N))
                send(sent, min(events, sent + step))
                sent = min(events, sent + step)
            if sent > 4 * N and not bad_sent:  # redelivery + malformed
                producer.send(t["clients"], key=records[4 * N - 1][0], value=records[4 * N - 1][1])
                producer.send(t["clients"], key=os.urandom(16), value=b"\xc1not msgpack")
                producer.send(t["clients"], key=b"short", value=records[6][1])
                producer.flush()
                bad_sent = True
            time.sleep(float(rng.uniform(0.1, 0.8)))
        assert proc.poll() is None, "the shuffler stopped by itself"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    producer.close()
    done = subprocess.run(
        shuffler_cmd(setargs, "--exit-when-idle", "4"), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]

    recs = read_all(kafka_broker, t["analyzer"])
    no_client_metadata(recs, records)
    by_window, markers = windows_of(recs)
    assert sorted(markers) == list(range(windows))
    seen_events: dict = {}
    for w in range(windows):
        boxes = by_window[w]
        assert len(boxes) == len(set(boxes))  # no box twice
        evs = {owner[b] for b in boxes}  # no unknown box
        for e in evs:
            assert e not in seen_events, f"event {e} in windows {seen_events[e]} and {w}"
            seen_events[e] = w
        mine = [b for e in evs for b in parse_client_record(records[e][1])]
        assert sorted(mine) == sorted(boxes)  # whole events only
        m = markers[w]
        assert m["events"] == len(evs) == N and m["topped_up"] == 0
        assert m["messages"] == len(boxes)
        assert m["params"]["n"] == N and m["params"]["buckets"] == B
        # decrypted: exactly the rows of its events' messages
        rows = open_boxes(boxes, key)
        assert len(rows) == sum(len(parse_client_record(records[e][1])) for e in evs)
        truth = np.bincount(items[sorted(evs)], minlength=B)
        plus = np.bincount(rows[rows[:, 1] > 0, 0], minlength=B)
        assert (plus >= truth).all()  # each event's own (x, +1)
    assert len(seen_events) == events  # none lost
    # the aborted transaction (step 1) is there uncommitted, invisible to read_committed
    assert len(read_all(kafka_broker, t["analyzer"], "read_uncommitted")) >= len(recs) + aborted
    letters = read_all(kafka_broker, t["dlq"])
    assert sorted(dict(m.headers)["reason"] for m in letters) == [b"no_event_id", b"undecodable"]
    for m in letters:
        h = dict(m.headers)
        assert m.key == h["source"] and m.key.startswith(t["clients"].encode() + b":")
        if h["reason"] == b"no_event_id":
            assert h["key"] == b"short" and m.value == records[6][1]
        else:
            assert m.value == b"\xc1not msgpack" and len(h["key"]) == 16


def test_time_windows_top_up_and_close_at_n(kafka_broker, tmp_path):
    t = topics(kafka_broker, clients=2, analyzer=1, dlq=1)
    key = new_keypair()
    setargs = sets(
        kafka_broker,
        t,
        tmp_path,
        public_key_hex(key),
        None,
        "window.kind=time",
        "window.size=4",
        f"shuffle.n={N}",
    )
    cfg = load_config(None, [a for a in setargs if a != "--set"])
    client = ShuffleClient.from_config(cfg)
    records = client.records(np.random.default_rng().integers(0, B, 3 * N // 2 + N // 3))
    producer = KafkaProducer(bootstrap_servers=kafka_broker, acks="all")
    for k, v in records:
        producer.send(t["clients"], key=k, value=v)
    producer.close()
    sh = subprocess.run(
        shuffler_cmd(setargs, "--exit-when-idle", "9"), capture_output=True, text=True, timeout=120
    )
    assert sh.returncode == 0, sh.stderr[-3000:]
    recs = read_all(kafka_broker, t["analyzer"])
    no_client_metadata(recs, records)
    by_window, markers = windows_of(recs)
    assert len(markers) >= 2
    first, second = markers[0], markers[1]
    assert first["events"] == N and first["topped_up"] == 0  # closed at n, not at 4 s
    assert second["events"] == len(records) - N and second["topped_up"] == 2 * N - len(records)
    for w, m in markers.items():
        assert m["events"] + m["topped_up"] == N and m["messages"] == len(by_window.get(w, []))
    assert sum(m["events"] for m in markers.values()) == len(records)
    # the topped-up window decrypts: its own events' boxes plus noise-only rows
    owner = {b: i for i, (_, v) in enumerate(records) for b in parse_client_record(v)}
    evs = {owner[b] for b in by_window[1] if b in owner}
    assert len(evs) == second["events"]
    assert {b for e in evs for b in parse_client_record(records[e][1])} <= set(by_window[1])
    extra = [b for b in by_window[1] if b not in owner]
    assert len(extra) > 0 and len(open_boxes(extra, key)) == len(extra)


def test_clients_shuffler_analyzer_end_to_end(kafka_broker, tmp_path):
    t = topics(kafka_broker, clients=2, analyzer=1, dlq=1)
    key = new_keypair()
    key_file = tmp_path / "analyzer.key"
    save_private_key(key, str(key_file))
    setargs = sets(kafka_broker, t, tmp_path, public_key_hex(key), key_file)
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "shuffle-clients",
            "--config",
            os.devnull,
            *setargs,
            "--events",
            str(3 * N),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert gen.returncode == 0, gen.stderr[-3000:]
    sh = subprocess.run(
        shuffler_cmd(setargs, "--exit-when-idle", "3"), capture_output=True, text=True, timeout=300
    )
    assert sh.returncode == 0, sh.stderr[-3000:]
    assert sh.stdout.startswith("3 window(s), 180 events"), sh.stdout
    an = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "run",
            "--config",
            os.devnull,
            *setargs,
            "--exit-when-idle",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert an.returncode == 0, an.stderr[-3000:]
    rel = sorted((tmp_path / "releases").glob("release-*.json"))
    assert len(rel) == 3
    for p in rel:
        doc = json.loads(p.read_text())
        assert doc["model"] == "shuffle" and doc["n"] == N


def test_sigterm_stops_the_shuffler_with_status_0(kafka_broker, tmp_path):
    """A supervisor's stop (SIGTERM) ends `panagg shuffle` between polls with exit status 0 and
    its stats line; before, it had no handler and died of the signal (exit status -15), found by
    the fault harness (docs/chaos.md, "The shuffle analyzer")."""
    t = topics(kafka_broker, clients=2, analyzer=1, dlq=1)
    setargs = sets(kafka_broker, t, tmp_path, public_key_hex(new_keypair()))
    err = open(tmp_path / "shuffler.log", "w")
    proc = subprocess.Popen(shuffler_cmd(setargs), stdout=subprocess.PIPE, stderr=err, text=True)
    deadline = time.monotonic() + 120
    while (
        "shuffling" not in (tmp_path / "shuffler.log").read_text()
        and proc.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert proc.poll() is None, (tmp_path / "shuffler.log").read_text()[-2000:]
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, (tmp_path / "shuffler.log").read_text()[-2000:]
    assert out.startswith("0 window(s), 0 events"), out
    assert "stopped on a signal" in (tmp_path / "shuffler.log").read_text()
