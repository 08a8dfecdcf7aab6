"""Scale-out against a real broker: 3 aggregator processes, a 6-partition topic keyed by item,
>= 500k events, one process killed (-9) twice and restarted; exactly once, and the merged releases
equal both an offline recomputation and a single-process run on the same data and noise."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from aggregator.service.partitioned import merge_summaries, partition_summary
from aggregator.state import PanPrivateHistogram
from state_store.local import LocalStore



def env():
    return dict(os.environ, PANAGG_TESTING="1")

D = 2000
SEED = 4242
PARTS = 6
WIN = 25_000          # count windows close per partition
TOTAL = 510_000
CHUNKS = 5


def make_topic(bootstrap):
    name = f"so-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(name, num_partitions=PARTS, replication_factor=1)])
    admin.close()
    return name


def produce(bootstrap, topic, items, placed, keyed=True):
    """Send items keyed by themselves; record where each landed as (partition -> [(offset, item)])."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=50, batch_size=256 * 1024,
                             acks="all")
    futures = [producer.send(topic, value=msgpack.packb({"item": int(i)}),
                             key=str(int(i)).encode() if keyed else None) for i in items]
    producer.flush()
    for fut, item in zip(futures, items):
        md = fut.get(timeout=60)
        placed.setdefault(md.partition, []).append((md.offset, int(item)))
    producer.close()


def member_args(bootstrap, topic, state, releases, group, instance):
    return ["run", "--bootstrap", bootstrap, "--topic", topic, "--state-dir", str(state),
            "--release-dir", str(releases), "--metrics-port", "-1",
            "--set", f"state.domain_size={D}", "--set", f"window.size={WIN}",
            "--set", f"testing.noise_seed={SEED}", "--set", f"source.group={group}",
            "--set", "scale.partitioned=true", "--set", "scale.store=directory", "--set", f"source.instance_id={instance}",
            "--set", "source.session_timeout_s=6",
            "--set", "source.max_records=2000", "--exit-when-idle", "12"]


def start(args, log_path, extra_env=None):
    log = open(log_path, "a")
    return subprocess.Popen([sys.executable, "-m", "aggregator.service.cli", *args],
                            env=dict(env(), **(extra_env or {})), stdout=log, stderr=log)


def partition_items(placed):
    return {p: np.array([i for _, i in sorted(placed[p])], dtype=np.int64) for p in placed}


def offline_release(per_part, w):
    """Window w's release recomputed from the data with the test noise of each partition."""
    summaries = []
    for p, items in per_part.items():
        state = PanPrivateHistogram(1.0, size=D, rng=np.random.default_rng([SEED, 0, p, w]))
        state.add_indices(items[w * WIN:(w + 1) * WIN])
        info = {"kind": "count", "size": WIN, "events": WIN, "started_unix": 0.0,
                "ended_unix": 0.0}
        summaries.append(partition_summary(state, model="joint", window=w, partition=p,
                                           partitions=PARTS, window_info=info,
                                           rng=np.random.default_rng([SEED, 1, p, w])))
    return merge_summaries(summaries)


def same_release(a, b):
    keys = ("window", "n", "n_in_histogram", "epsilon", "p", "layers", "model", "domain")
    return all(a[k] == b[k] for k in keys) and a["histogram"] == b["histogram"]


def _tails(logs) -> str:
    return "\n".join(f"--- member {k}:\n{path.read_text()[-2500:]}" for k, path in logs.items())


def test_three_processes_six_partitions_kill_twice_exactly_once(kafka_broker, tmp_path):
    topic = make_topic(kafka_broker)
    items = np.random.default_rng(21).integers(0, D, TOTAL)
    chunks = np.array_split(items, CHUNKS)
    state, rel, group = tmp_path / "state", tmp_path / "releases", f"g-{topic}"
    logs = {k: tmp_path / f"member{k}.log" for k in (1, 2, 3)}
    args = {k: member_args(kafka_broker, topic, state, rel, group, f"m{k}") for k in (1, 2, 3)}
    placed: dict[int, list] = {}

    procs = {k: start(args[k], logs[k]) for k in (1, 2, 3)}
    time.sleep(3)
    produce(kafka_broker, topic, chunks[0], placed)
    produce(kafka_broker, topic, chunks[1], placed)
    # kill 1: SIGKILL mid-stream, stay down past the session timeout so its partitions move
    procs[1].send_signal(signal.SIGKILL)
    assert procs[1].wait() == -signal.SIGKILL, _tails(logs)
    produce(kafka_broker, topic, chunks[2], placed)
    time.sleep(10)
    # restart; this incarnation kills itself (SIGKILL) inside its first checkpoint write (a window
    # close), unless we
    # kill it first
    procs[1] = start(args[1], logs[1], {"PANAGG_TEST_FAULT": "checkpoint-mid-write:1"})
    time.sleep(4)
    produce(kafka_broker, topic, chunks[3], placed)
    try:
        procs[1].wait(timeout=20)
    except subprocess.TimeoutExpired:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
    assert procs[1].returncode == -signal.SIGKILL, _tails(logs)
    procs[1] = start(args[1], logs[1])  # at once: static membership takes its partitions back
    produce(kafka_broker, topic, chunks[4], placed)
    for k, proc in procs.items():
        assert proc.wait(timeout=600) == 0, _tails(logs)

    text = {k: logs[k].read_text() for k in logs}
    assert sum(t.count("handed over partition") for t in text.values()) >= 2
    # the partitions member 1 held before its first kill were taken by another member meanwhile
    assert any("took partition" in text[k] for k in (2, 3))
    for t in text.values():
        assert "Traceback" not in t

    per_part = partition_items(placed)
    assert sorted(per_part) == list(range(PARTS)) and sum(map(len, per_part.values())) == TOTAL
    # each partition's checkpoint is the start of its open window: no counters on disk, the
    # offset where that window's replay begins, every summary published
    for p, its in per_part.items():
        ckpt = LocalStore(state / "partitions" / f"{topic}-{p}").load_latest()
        w = len(its) // WIN
        assert ckpt.state is None and ckpt.pending == []
        assert ckpt.offsets == {f"{topic}:{p}": w * WIN}
        assert ckpt.window["id"] == w and ckpt.window["events"] == 0
        assert ckpt.totals["events"] == w * WIN

    complete = min(len(v) for v in per_part.values()) // WIN
    assert complete >= 2
    released = sorted(int(f.stem.split("-")[1]) for f in rel.glob("release-*.json"))
    assert released == list(range(complete))
    ledger = [json.loads(line) for line in (state / "ledger.jsonl").read_text().splitlines()]
    documents = sorted(e["window"] for e in ledger if e["kind"] == "release-document")
    reserved = sorted(e["window"] for e in ledger if e["kind"] == "release")
    assert documents == list(range(complete))  # each complete window merged and ledgered once
    assert reserved[:complete] == documents and len(set(reserved)) == len(reserved)
    docs = {w: json.loads((rel / f"release-{w}.json").read_text()) for w in range(complete)}
    for w, doc in docs.items():
        assert doc["n"] == PARTS * WIN and doc["domain"]["partitions"] == PARTS
        assert "warning" not in doc and not any("key" in k for k in doc["window_info"])
        assert same_release(doc, offline_release(per_part, w)), f"window {w}"

    # the same data and noise through one process: the same releases
    single_state, single_rel = tmp_path / "single", tmp_path / "single-releases"
    one = start(member_args(kafka_broker, topic, single_state, single_rel, f"{group}-single",
                            "solo"), tmp_path / "single.log")
    assert one.wait(timeout=600) == 0, (tmp_path / "single.log").read_text()[-3000:]
    for w, doc in docs.items():
        assert same_release(doc, json.loads((single_rel / f"release-{w}.json").read_text()))


def test_keying_is_stated_never_counted(kafka_broker, tmp_path):
    """Records without the item as key and records keyed by it: both runs say once that records
    must be keyed by the item, and neither logs anything that tells them apart (a count of
    unkeyed records would be an un-noised function of the events)."""
    topic = make_topic(kafka_broker)
    placed: dict[int, list] = {}
    produce(kafka_broker, topic, np.arange(3000) % 97 + 123456, placed, keyed=False)
    args = member_args(kafka_broker, topic, tmp_path / "state", tmp_path / "rel", f"g-{topic}",
                       "solo")
    args[args.index("--exit-when-idle") + 1] = "5"
    args += ["--set", "state.domain_size=200000"]
    res = subprocess.run([sys.executable, "-m", "aggregator.service.cli", *args], env=env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    stated = [line for line in res.stderr.splitlines() if "must be keyed by the counted" in line]
    assert len(stated) == 1 and "not checked on the records" in stated[0]
    assert "not keyed by their item" not in res.stderr
    assert not any(str(123456 + k) in res.stderr for k in range(97))
    # the same records keyed by item: the same line, nothing else about keys
    topic2 = make_topic(kafka_broker)
    produce(kafka_broker, topic2, np.arange(3000) % 97 + 123456, {}, keyed=True)
    args2 = [a.replace(topic, topic2) for a in args]
    args2[args2.index("--state-dir") + 1] = str(tmp_path / "state2")
    res2 = subprocess.run([sys.executable, "-m", "aggregator.service.cli", *args2], env=env(),
                          capture_output=True, text=True, timeout=300)
    assert res2.returncode == 0, res2.stderr[-3000:]
    assert "not keyed by their item" not in res2.stderr
    assert [x for x in res2.stderr.splitlines() if "keyed" in x][0].split(" ", 3)[3] == \
        stated[0].split(" ", 3)[3]
    assert Path(tmp_path / "state2" / "partitions").is_dir()
