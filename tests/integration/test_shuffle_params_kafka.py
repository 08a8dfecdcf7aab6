"""Issue 31 on the real broker, real crypto: clients whose randomizer parameters or key differ
from the analyzer's. Each such window is refused with one line naming the cause and both sides'
parameters, nothing is published; `panagg shuffle-recover` under the fix then releases each one
once, the ledger charging the clients' epsilon and the exact delta.

Topics come from `panagg shuffle-topics` (kafka-python's admin client), the shuffler runs with
the analyzer's settings (only the clients are wrong, as in the issue), the analyzer and the
recovery are `panagg` processes.
"""

import json
import os
import subprocess
import sys
import uuid

import numpy as np
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient

from aggregator.service.config import load_config
from aggregator.service.shuffle_client import ShuffleClient
from aggregator.service.shuffle_wire import new_keypair, public_key_hex, save_private_key
from aggregator.service.shuffler import Shuffler
from aggregator.shuffle import GKMPRandomizer

B, N, EPS, DELTA = 8, 40, 1.0, 1e-6


def cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PANAGG_TESTING="1"),
    )


def panagg_lines(stderr, level="ERROR"):
    return [line for line in stderr.splitlines() if f" {level} panagg." in line]


def test_other_parameters_refused_in_one_line_then_recovered_once(kafka_broker, tmp_path):
    tag = uuid.uuid4().hex[:8]
    names = {"clients": f"cl-{tag}", "analyzer": f"an-{tag}", "dlq": f"dl-{tag}"}
    key, other = new_keypair(), new_keypair()
    key_file, other_file = tmp_path / "analyzer.key", tmp_path / "other.key"
    save_private_key(key, str(key_file))
    save_private_key(other, str(other_file))
    base = [
        f"source.bootstrap={kafka_broker}",
        f"source.topic={names['analyzer']}",
        f"source.dead_letter_topic={names['dlq']}",
        "state.model=shuffle",
        f"state.epsilon={EPS}",
        f"state.domain_size={B}",
        f"window.size={N}",
        f"shuffle.delta={DELTA}",
        f"shuffle.public_key={public_key_hex(key)}",
        f"shuffle.client_topic={names['clients']}",
        f"shuffle.group=sh-{tag}",
        f"shuffle.shuffler_dir={tmp_path / 'shuffler'}",
        f"shuffle.key_file={key_file}",
        f"checkpoint.dir={tmp_path / 'state'}",
        f"release.dir={tmp_path / 'releases'}",
        f"source.group=an-{tag}",
        "metrics.port=-1",
        "release.error_bar_reps=0",
        "release.estimator=threshold",
    ]

    def sets(*extra):
        return [x for s in [*base, *extra] for x in ("--set", s)]

    # 1. topics with what the product ships
    # one order: a window per kind
    made = cli("shuffle-topics", "--config", os.devnull, *sets(), "--client-partitions", "1")
    assert made.returncode == 0, made.stderr[-2000:]
    assert sorted(made.stdout.split("\n")[:3]) == sorted(
        [
            f"{names['clients']}: 1 partition(s), created",
            f"{names['analyzer']}: 1 partition(s), created",
            f"{names['dlq']}: 1 partition(s), created",
        ]
    )
    again = cli("shuffle-topics", "--config", os.devnull, *sets())
    assert again.returncode == 0 and again.stdout.count("exists") == 3
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    parts = {d["name"]: len(d["partitions"]) for d in admin.describe_topics(list(names.values()))}
    admin.close()
    assert parts == {names["clients"]: 1, names["analyzer"]: 1, names["dlq"]: 1}

    # 2. one window per kind of client: right, eps 2, delta 1e-4, 5 buckets, 12 buckets, the
    #    right parameters sealed to another key; the shuffler forwards all six windows
    kinds = [
        ("right", []),
        ("epsilon", ["state.epsilon=2.0"]),
        ("delta", ["shuffle.delta=1e-4"]),
        ("fewer", ["state.domain_size=5"]),
        ("more", ["state.domain_size=12"]),
        ("key", [f"shuffle.public_key={public_key_hex(other)}"]),
    ]
    producer = KafkaProducer(
        bootstrap_servers=kafka_broker, acks="all", max_request_size=16 * 1024 * 1024
    )
    rng = np.random.default_rng(31)
    for _kind, extra in kinds:
        client = ShuffleClient.from_config(load_config(None, [*base, *extra], env={}))
        items = rng.integers(0, client.randomizer.buckets, N)
        for k, v in client.records(items):
            producer.send(names["clients"], key=k, value=v)
        producer.flush()  # one kind after the other: each window holds one kind
    producer.close()
    shuffler = Shuffler(load_config(None, base, env={}))
    shuffler.run(max_windows=len(kinds), idle_exit_s=20)
    assert shuffler.stats["windows"] == len(kinds) and shuffler.stats["events"] == len(kinds) * N

    # 3. the analyzer: window 0 released, windows 1-5 refused, one error line each
    run = cli("run", "--config", os.devnull, *sets(), "--exit-when-idle", "4")
    assert run.returncode == 0, run.stderr[-3000:]
    errors = panagg_lines(run.stderr)
    assert len(errors) == 5, run.stderr[-5000:]
    assert all("not released" in e for e in errors)
    want = {
        1: "epsilon 2 (analyzer: 1)",
        2: "delta 0.0001 (analyzer: 1e-06)",
        3: "buckets 5 (analyzer: 8)",
        4: "buckets 12 (analyzer: 8)",
        5: "no message decrypts with this analyzer's key",
    }
    for w, text in want.items():
        (line,) = [e for e in errors if f"window {w}:" in e]
        assert text in line, line
    for w in (1, 2, 3, 4):  # parameter lines name both sides in full, never the key
        (line,) = [e for e in errors if f"window {w}:" in e]
        assert "[clients: protocol gkmp" in line and "(protocol gkmp, epsilon 1," in line
        assert "public key" not in line
    releases = tmp_path / "releases"
    assert sorted(p.name for p in releases.glob("release-*.json")) == ["release-0.json"]

    def ledger():
        path = tmp_path / "state" / "ledger.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()]

    refused = {e["window"]: e for e in ledger() if e["kind"] == "refused"}
    assert {w: e["cause"] for w, e in refused.items()} == {
        1: "parameters",
        2: "parameters",
        3: "buckets",
        4: "buckets",
        5: "key",
    }
    assert all(e["epsilon_spent"] == 0 for e in refused.values())
    assert all(
        e["marker"] == {"events": N, "topped_up": 0, "messages": e["marker"]["messages"]}
        for e in refused.values()
    )

    # 4. recovery under the unfixed settings: still refused, one line, nothing published
    same = cli("shuffle-recover", "--config", os.devnull, *sets(), "--window", "1")
    assert same.returncode == 1 and "window 1" in same.stdout and "still refused" in same.stdout
    assert len(panagg_lines(same.stderr)) == 1
    assert not (releases / "release-1.json").exists()

    # 5. recovery under each fix: released once (window 5 after retention took every window
    #    off the analyzer topic: from the dead-letter topic, where its chunks went)
    fixes = {
        1: ["state.epsilon=2.0"],
        2: ["shuffle.delta=1e-4"],
        3: ["state.domain_size=5"],
        4: ["state.domain_size=12"],
        5: [f"shuffle.key_file={other_file}"],
    }
    for w, fix in fixes.items():
        if w == 5:
            from kafka import TopicPartition

            admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
            end = int(refused[5]["end"].rpartition(":")[2])
            admin.delete_records({TopicPartition(names["analyzer"], 0): end})
            admin.close()
        rec = cli("shuffle-recover", "--config", os.devnull, *sets(*fix), "--window", str(w))
        assert rec.returncode == 0, rec.stderr[-3000:]
        assert rec.stdout.strip().endswith("released"), rec.stdout
        assert panagg_lines(rec.stderr) == []
        if w == 5:
            assert "recovered from the dead-letter topic" in rec.stderr
    twice = cli("shuffle-recover", "--config", os.devnull, *sets(*fixes[1]), "--window", "1")
    assert twice.returncode == 0 and twice.stdout.strip().endswith("re-published")

    assert sorted(int(p.stem.split("-")[1]) for p in releases.glob("release-*.json")) == [
        0,
        1,
        2,
        3,
        4,
        5,
    ]
    entries = ledger()
    rel = {e["window"]: e for e in entries if e["kind"] == "release"}
    assert (
        sorted(rel) == [0, 1, 2, 3, 4, 5]
        and len([e for e in entries if e["kind"] == "release"]) == 6
    )
    exact = {
        0: GKMPRandomizer(EPS, DELTA, N, B),
        1: GKMPRandomizer(2.0, DELTA, N, B),
        2: GKMPRandomizer(EPS, 1e-4, N, B),
        3: GKMPRandomizer(EPS, DELTA, N, 5),
        4: GKMPRandomizer(EPS, DELTA, N, 12),
        5: GKMPRandomizer(EPS, DELTA, N, B),
    }
    for w, rz in exact.items():
        e = rel[w]
        doc = json.loads((releases / f"release-{w}.json").read_text())
        assert doc == json.loads(e["document"])
        # the ledger and the release carry the privacy the clients gave, delta exact
        assert e["epsilon_spent"] == rz.epsilon == doc["epsilon"]
        assert e["delta_spent"] == rz.delta_spent == doc["delta_spent"] and e["delta"] == rz.delta
        assert doc["domain"]["size"] == rz.buckets and doc["n"] == N
        assert e.get("recovered_from") == (
            None if w == 0 else f"refused-{refused[w]['window_uid']}"
        )
        assert e["window_uid"] == (refused[w]["window_uid"] if w else e["window_uid"])
