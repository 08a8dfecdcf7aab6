"""Scale-out on Kafka alone (scale.store = kafka) against a real broker.

Three members with separate local directories on a 6-partition topic NOT keyed by item, killed
(-9) and restarted at random points 20 times, one of them stopped (SIGSTOP) until the group has
moved its partitions and then woken (a zombie). Afterwards, from the topics alone:

* every source record entered the repartition topic exactly once (read committed);
* every window was released exactly once, windows consecutive;
* each window's n equals the events in its ledgered ranges of the repartition topic, and the
  ranges of each partition tile it without gap or overlap (the ledger's charges are exact: every
  position carries eps once);
* the ledger's hash chain holds.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import msgpack
import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

from prometheus_client.parser import text_string_to_metric_families

from aggregator.service.charges import ChargeBook
from aggregator.service.group.ledger_topic import TopicLedger
from aggregator.service.group.topics import GroupTopics

D = 1000
PARTS = 6
WINDOW_S = 2


def make_topic(bootstrap, partitions=PARTS):
    name = f"grp-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    admin.close()
    return name


def member_cmd(bootstrap, topic, group, name, tmp, *extra):
    return [sys.executable, "-m", "aggregator.service.cli", "run", "--bootstrap", bootstrap,
            "--topic", topic, "--state-dir", str(tmp / name / "state"),
            "--release-dir", str(tmp / name / "releases"), "--metrics-port", "-1",
            "--set", "scale.partitioned=true", "--set", "scale.store=kafka",
            "--set", "window.kind=time", "--set", f"window.size={WINDOW_S}",
            "--set", f"state.domain_size={D}", "--set", f"source.group={group}",
            "--set", f"source.instance_id={name}", "--set", "source.session_timeout_s=6",
            "--set", "scale.close_grace_s=1", "--set", "release.error_bar_reps=0", *extra]


def crash_traces(logs: str) -> list[str]:
    """The tracebacks in member logs (CPython's "Exception ignored in ..." reports at exit
    included: an operator sees them all the same)."""
    lines = logs.splitlines()
    return ["\n".join(lines[max(0, i - 1):i + 20]) for i, line in enumerate(lines)
            if line.startswith("Traceback (most recent call last)")]


class Members:
    """Member processes by name; each run's log kept for the failure message."""

    def __init__(self, bootstrap, topic, group, tmp, *extra):
        self.args = (bootstrap, topic, group)
        self.tmp, self.extra = tmp, extra
        self.procs: dict[str, subprocess.Popen] = {}
        self.runs = 0

    def start(self, name):
        self.runs += 1
        log = open(self.tmp / f"{name}-{self.runs}.log", "w")
        self.procs[name] = subprocess.Popen(
            member_cmd(*self.args, name, self.tmp, *self.extra), stdout=log,
            stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def kill(self, name):
        p = self.procs[name]
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)

    def stop_all(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()

    def logs(self, last=3000):
        out = []
        for f in sorted(self.tmp.glob("*.log")):
            out.append(f"--- {f.name}\n{f.read_text()[-last:]}")
        return "\n".join(out)


def produce(bootstrap, topic, items, rate):
    p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20)
    step = max(1, int(rate / 20))
    for i in range(0, len(items), step):
        for it in items[i:i + step]:
            p.send(topic, value=msgpack.packb({"item": int(it)}))   # no key: any partition
        time.sleep(0.05)
    p.flush()
    p.close()


def read_all(bootstrap, topic, partitions=None, timeout_s=20.0):
    """Every committed record of ``topic``: {partition: [(offset, key, value)]}."""
    c = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed",
                      enable_auto_commit=False, group_id=None)
    parts = partitions if partitions is not None else sorted(c.partitions_for_topic(topic))
    tps = [TopicPartition(topic, p) for p in parts]
    c.assign(tps)
    c.seek_to_beginning(*tps)
    end = c.end_offsets(tps)
    out = {tp.partition: [] for tp in tps}
    deadline = time.monotonic() + timeout_s
    while any(c.position(tp) < end[tp] for tp in tps) and time.monotonic() < deadline:
        for tp, recs in c.poll(timeout_ms=500).items():
            out[tp.partition].extend((r.offset, r.key, r.value) for r in recs)
    c.close()
    return out


def releases(bootstrap, topics):
    docs = [json.loads(v) for _, _, v in read_all(bootstrap, topics.releases, [0])[0]
            if v is not None]
    return docs


def wait_for_total(bootstrap, topics, total, timeout_s, members):
    deadline = time.monotonic() + timeout_s
    got = 0
    while time.monotonic() < deadline:
        got = sum(d["n"] for d in releases(bootstrap, topics))
        if got >= total:
            return got
        if members.procs and all(p.poll() is not None for p in members.procs.values()):
            pytest.fail(f"every member exited; releases hold {got} of {total}\n{members.logs()}")
        time.sleep(2)
    pytest.fail(f"releases hold {got} of {total} events after {timeout_s} s\n{members.logs()}")


def check_exact(bootstrap, topics, total, eps=1.0):
    """The checks of the module docstring (each position charged ``eps``); returns the release
    documents."""
    docs = releases(bootstrap, topics)
    windows = [d["window"] for d in docs]
    assert len(windows) == len(set(windows)), "a window was released twice"
    assert windows == list(range(windows[0], windows[0] + len(windows))), "windows not consecutive"
    assert sum(d["n"] for d in docs) == total
    # the repartition topic: each source record once; events per message
    rp = read_all(bootstrap, topics.repartition)
    events_at = {p: {off: len(v) // 4 for off, _, v in recs} for p, recs in rp.items()}
    assert sum(sum(m.values()) for m in events_at.values()) == total
    # the ledger: chain, one release per window, ranges tile each partition, n matches ranges
    c = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed",
                      enable_auto_commit=False, group_id=None)
    ledger = TopicLedger(c, topics.ledger, budget_per_window=1.0)
    ledger.read_to_end()
    c.close()
    entries = [e for e in ledger.entries if e["kind"] == "release"]
    assert sorted(e["window"] for e in entries) == sorted(windows)
    assert not any(e.get("withheld") for e in entries)
    by_window = {d["window"]: d for d in docs}
    spans: dict[str, list] = {}
    for e in entries:
        n = 0
        for part, (a, b) in e["ranges"].items():
            p = int(part.rsplit(":", 1)[1])
            n += sum(k for off, k in events_at[p].items() if a <= off < b)
            spans.setdefault(part, []).append((a, b))
        assert n == by_window[e["window"]]["n"] == e["n"], f"window {e['window']}"
    assert len(spans) == PARTS
    for part, ss in spans.items():
        ss.sort()
        for (a0, b0), (a1, b1) in zip(ss, ss[1:]):
            assert b0 == a1, f"{part}: windows {ss} leave a gap or overlap"
    book = ChargeBook(ledger.entries)
    for part, ss in spans.items():
        for a, b in ss:
            if b > a:
                assert book.peak({part: [a, b]}, 0.0) == pytest.approx(eps)
    return docs


def test_three_members_killed_twenty_times_and_a_zombie_release_every_event_once(
        kafka_broker, tmp_path):
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    topics = GroupTopics(group)
    rng = np.random.default_rng()
    items = np.minimum(rng.zipf(1.3, 120_000), D - 1)
    members = Members(kafka_broker, topic, group, tmp_path)
    names = ["m1", "m2", "m3"]
    try:
        members.start("m1")
        time.sleep(4)          # m1 makes the group (internal topics, identity)
        for name in names[1:]:
            members.start(name)
        producer = threading.Thread(target=produce, args=(kafka_broker, topic, items, 2500))
        producer.start()
        chaos = random.Random()
        kills = 0
        zombie_done = False
        while kills < 20:
            time.sleep(chaos.uniform(0.5, 2.5))
            if not zombie_done and kills == 10:
                z = members.procs["m3"]
                z.send_signal(signal.SIGSTOP)      # its partitions move after the session
                time.sleep(10)
                z.send_signal(signal.SIGCONT)      # wakes as a zombie: fenced
                zombie_done = True
                continue
            victim = chaos.choice(names)
            members.kill(victim)
            kills += 1
            time.sleep(chaos.uniform(0.0, 2.0))
            members.start(victim)
        producer.join()
        wait_for_total(kafka_broker, topics, len(items), 240, members)
    finally:
        members.stop_all()
    try:
        docs = check_exact(kafka_broker, topics, len(items))
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{members.logs()}") from None
    logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
    print(f"\n{len(docs)} windows, {members.runs} member runs, "
          f"{logs.count('not written')} summaries and {logs.count('intake transaction aborted')} "
          f"intake transactions fenced or failed, {logs.count('leading group')} leader starts")
    # no member crashed, and none printed a trace at its stop (the release worker's pool once
    # did: ReleaseWorker.close now joins it)
    assert not crash_traces(logs), members.logs()


def test_a_broker_killed_mid_window_and_restarted_loses_and_doubles_nothing(tmp_path):
    """A broker of its own, fresh (kill -9 while two members count and a window is open), back
    after 8 s on the same port: the members stay up and every event is released once."""
    from tests.conftest import RestartableBroker

    broker = RestartableBroker(tmp_path / "kafka")
    bootstrap = broker.start()
    topic = make_topic(bootstrap)
    group = f"g-{uuid.uuid4().hex[:8]}"
    topics = GroupTopics(group)
    rng = np.random.default_rng()
    first, second = (np.minimum(rng.zipf(1.3, 20_000), D - 1) for _ in range(2))
    members = Members(bootstrap, topic, group, tmp_path)
    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        produce(bootstrap, topic, first, 5000)
        broker.kill()
        time.sleep(8)
        broker.start()
        back = time.monotonic()
        produce(bootstrap, topic, second, 5000)
        wait_for_total(bootstrap, topics, 40_000, 300, members)
        print(f"\nreleases held every event {time.monotonic() - back:.1f} s after the broker "
              "was back")
        assert all(p.poll() is None for p in members.procs.values()), members.logs()
        members.stop_all()
        check_exact(bootstrap, topics, 40_000)
        logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
        assert not crash_traces(logs), members.logs()
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{members.logs()}") from None
    finally:
        members.stop_all()
        broker.stop()


def test_several_aggregations_each_release_every_event_once(kafka_broker, tmp_path):
    """Two aggregations of one unkeyed topic (accounts in direct mode, IPs hashed), two
    members, one killed -9 and restarted: the source is read once, each aggregation has its own
    topics and ledger, and each releases every event once."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    extra = ("--metrics-port", "0",
             "--set", "ledger.budget_per_event=2", "--set", "aggregations.user.item.field=user",
             "--set", "aggregations.ip.item.field=ip", "--set", "aggregations.ip.state.mode=hashed",
             "--set", "aggregations.ip.state.expected_n=5000")
    members = Members(kafka_broker, topic, group, tmp_path, *extra)
    rng = np.random.default_rng()
    n = 30_000
    users = np.minimum(rng.zipf(1.3, n), D - 1)
    ips = rng.integers(0, 5000, n)
    records = [msgpack.packb({"user": int(u), "ip": f"10.0.{i // 256}.{i % 256}"})
               for u, i in zip(users, ips)]
    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        p = KafkaProducer(bootstrap_servers=kafka_broker, linger_ms=20)
        for i, rec in enumerate(records):
            p.send(topic, value=rec)
            if i == n // 2:
                p.flush()
                members.kill("m2")
                members.start("m2")
        p.flush()
        p.close()
        for name in ("user", "ip"):
            wait_for_total(kafka_broker, GroupTopics(group, name), n, 180, members)
        # operators see the group: both members, their partitions, who leads, readiness, and
        # each member's metrics endpoint answers /healthz and /ready
        time.sleep(6)   # one report interval
        res = subprocess.run([sys.executable, "-m", "aggregator.service.cli", "status", "--group",
                              group, "--bootstrap", kafka_broker, "--topic", topic],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        out = res.stdout
        assert "aggregation ip of group" in out and "aggregation user of group" in out, out
        assert out.count("leads (ledger, merges)") == 2 and "NOT READY" not in out, out
        urls = sorted(set(re.findall(r"http://\S+/metrics", out)))
        assert len(urls) == 2, out
        events = {"user": 0.0, "ip": 0.0}
        for url in urls:
            for path in ("healthz", "ready"):
                with urllib.request.urlopen(url.replace("/metrics", f"/{path}"), timeout=5) as r:
                    assert r.status == 200
            # each aggregation its own series, labelled as one process labels them
            with urllib.request.urlopen(url, timeout=5) as r:
                fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
            for s in fams["panagg_events"].samples:
                if s.name == "panagg_events_total":
                    events[s.labels["aggregation"]] += s.value
            assert {s.labels["aggregation"] for s in fams["panagg_epsilon"].samples} == \
                {"user", "ip"}
        # both aggregations' events are counted under their own names (a killed run's counts
        # are gone with it, so the totals are not n)
        assert events["user"] > 0 and events["ip"] > 0, events
    finally:
        members.stop_all()
    try:
        for name in ("user", "ip"):
            docs = check_exact(kafka_broker, GroupTopics(group, name), n)
            assert all(d["aggregation"]["name"] == name for d in docs)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{members.logs()}") from None
    assert (tmp_path / "m1" / "releases" / "user").is_dir(), "each aggregation has its own dir"
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), \
        members.logs()


def test_rollup_levels_in_a_group_each_release_every_event_once(kafka_broker, tmp_path):
    """window.rollups with the default hybrid design in a group: the 6 s span is a level with
    its own state (an aggregation of its own), eps split 0.5 / 0.5; two members, one killed
    -9 and restarted; each level releases every event once and says what it is."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    members = Members(kafka_broker, topic, group, tmp_path, "--set", "window.rollups=6s")
    items = np.minimum(np.random.default_rng().zipf(1.3, 20_000), D - 1)
    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        produce(kafka_broker, topic, items[:10_000], 4000)
        members.kill("m2")
        members.start("m2")
        produce(kafka_broker, topic, items[10_000:], 4000)
        for name in ("base", "r6s"):
            wait_for_total(kafka_broker, GroupTopics(group, name), len(items), 180, members)
    finally:
        members.stop_all()
    try:
        base = check_exact(kafka_broker, GroupTopics(group, "base"), len(items), eps=0.5)
        day = check_exact(kafka_broker, GroupTopics(group, "r6s"), len(items), eps=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{members.logs()}") from None
    assert all("rollup_level" not in d and d["epsilon"] == pytest.approx(0.5) for d in base)
    for d in day:
        assert d["epsilon"] == pytest.approx(0.5) and d["window_info"]["size"] == 6
        assert d["rollup_level"] == {"span": "6s", "design": "hybrid", "base": "base",
                                     "base_windows": 3, "epsilon": 0.5,
                                     "epsilon_per_event": 1.0, "sums": []}
        assert d["window_info"]["started_unix"] % 6 == 0    # level windows align with base ones
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), \
        members.logs()


def _intake_caught_up(bootstrap, topic, group, timeout_s=60):
    """Wait until the source group's committed offsets reach the topic's end (the intake has
    repartitioned every record, in committed transactions)."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    c = KafkaConsumer(bootstrap_servers=bootstrap)
    tps = [TopicPartition(topic, p) for p in range(PARTS)]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ends = c.end_offsets(tps)
            got = admin.list_group_offsets(group).get(group) or {}
            if all(got.get(tp) is not None and got[tp].offset >= ends[tp] for tp in tps):
                return
            time.sleep(0.5)
    finally:
        c.close()
        admin.close()
    pytest.fail("the intake did not take every record")


def test_a_forced_release_closes_the_open_window_in_every_partition(kafka_broker, tmp_path):
    """panagg release on a member's directory: the leader writes close markers into every
    repartition partition; the window open now (hour-long here) is released with exactly the
    events taken before the request; a second request closes the next window."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    members = Members(kafka_broker, topic, group, tmp_path, "--set", "window.size=3600")
    rng = np.random.default_rng()
    first, second = (np.minimum(rng.zipf(1.3, k), D - 1) for k in (3000, 2000))
    release = [sys.executable, "-m", "aggregator.service.cli", "release", "--state-dir",
               str(tmp_path / "m1" / "state")]
    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        produce(kafka_broker, topic, first, 3000)
        _intake_caught_up(kafka_broker, topic, group)
        out1 = subprocess.run(release, capture_output=True, text=True, timeout=120)
        assert out1.returncode == 0, out1.stderr + members.logs()
        produce(kafka_broker, topic, second, 3000)
        _intake_caught_up(kafka_broker, topic, group)
        out2 = subprocess.run(release, capture_output=True, text=True, timeout=120)
        assert out2.returncode == 0, out2.stderr + members.logs()
        wait_for_total(kafka_broker, GroupTopics(group), 5000, 60, members)
    finally:
        members.stop_all()
    k1, k2 = (int(re.search(r"released window (\d+)", o.stdout).group(1)) for o in (out1, out2))
    assert k2 > k1, (out1.stdout, out2.stdout)
    docs = check_exact(kafka_broker, GroupTopics(group), 5000)
    n_by = {d["window"]: d["n"] for d in docs}
    # the forced window held exactly what was taken before the request, the next one the rest
    assert sum(n for w, n in n_by.items() if w <= k1) == 3000, n_by
    assert sum(n for w, n in n_by.items() if k1 < w <= k2) == 2000, n_by
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), \
        members.logs()


def test_an_audit_export_of_a_group_is_one_signed_state_and_closes_its_window(
        kafka_broker, tmp_path, monkeypatch):
    """panagg audit export on a member's directory: every partition exports its open window's
    slice with fresh layers around it and closes that window in the same transaction; the
    leader signs the whole state (D counters, n of the events taken) and ledgers it at eps 0;
    the window is then released once, every partition's summary at the same layer count."""
    key = os.urandom(32).hex()
    monkeypatch.setenv("PANAGG_AUDIT_KEY", key)   # the members sign with it (the leader)
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    members = Members(kafka_broker, topic, group, tmp_path, "--set", "window.size=3600")
    items = np.minimum(np.random.default_rng().zipf(1.3, 3000), D - 1)
    cli = [sys.executable, "-m", "aggregator.service.cli"]
    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        produce(kafka_broker, topic, items, 3000)
        _intake_caught_up(kafka_broker, topic, group)
        out = subprocess.run(cli + ["audit", "export", "--state-dir",
                                    str(tmp_path / "m2" / "state")],
                             capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PANAGG_AUDIT_KEY=""))
        assert out.returncode == 0, out.stderr + members.logs()
        wait_for_total(kafka_broker, GroupTopics(group), 3000, 60, members)
    finally:
        members.stop_all()
    path = out.stdout.strip().splitlines()[-1]
    ok = subprocess.run(cli + ["audit", "verify", path], capture_output=True, text=True,
                        env=dict(os.environ, PANAGG_AUDIT_KEY=key))
    assert ok.returncode == 0 and ok.stdout.startswith("OK"), ok.stdout + ok.stderr
    from state_store.audit import read_export
    from aggregator.state import PanPrivateHistogram
    doc = read_export(path, bytes.fromhex(key))
    state = PanPrivateHistogram.deserialize(doc["state"])
    assert state.size == D and state.n == 3000 and state.layers == 2
    assert doc["window"]["partitions"] == PARTS and len(doc["offsets"]) == PARTS
    docs = check_exact(kafka_broker, GroupTopics(group), 3000)
    exported = [d for d in docs if d["window"] in doc["window"]["windows"]]
    assert exported and all(d["layers"] == 4 for d in exported)   # 1 + 2 export + release
    c = KafkaConsumer(bootstrap_servers=kafka_broker, isolation_level="read_committed",
                      enable_auto_commit=False, group_id=None)
    ledger = TopicLedger(c, GroupTopics(group).ledger, budget_per_window=1.0)
    ledger.read_to_end()
    c.close()
    exports = [e for e in ledger.entries if e["kind"] == "export"]
    assert len(exports) == 1 and exports[0]["epsilon_spent"] == 0.0
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), \
        members.logs()


def test_source_start_latest_places_a_new_group_at_the_end(kafka_broker, tmp_path):
    """source.start = latest: the records already in the topic are never counted, the ones
    after the start are, once; the start is in the group's identity."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng()
    produce(kafka_broker, topic, np.minimum(rng.zipf(1.3, 2000), D - 1), 5000)   # before
    members = Members(kafka_broker, topic, group, tmp_path, "--set", "source.start=latest")
    try:
        members.start("m1")
        deadline = time.monotonic() + 60
        while "starts at the latest offsets" not in (tmp_path / "m1-1.log").read_text():
            assert time.monotonic() < deadline, members.logs()
            time.sleep(0.5)
        members.start("m2")
        produce(kafka_broker, topic, np.minimum(rng.zipf(1.3, 1500), D - 1), 3000)  # after
        wait_for_total(kafka_broker, GroupTopics(group), 1500, 90, members)
        time.sleep(3 * WINDOW_S)     # nothing more comes (the 2,000 before are not read)
    finally:
        members.stop_all()
    docs = releases(kafka_broker, GroupTopics(group))
    assert sum(d["n"] for d in docs) == 1500
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), \
        members.logs()


def test_snapshots_bound_the_replay_and_a_member_resumes_from_one(kafka_broker, tmp_path):
    """checkpoint.snapshots_per_window = 2 in a group (6 s windows): partitions snapshot at 1/3
    and 2/3 of each window with the committed offset; a member killed -9 and restarted resumes
    windows from their snapshots (never from their start), and every event is released once."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    members = Members(kafka_broker, topic, group, tmp_path, "--set", "window.size=6",
                      "--set", "checkpoint.snapshots_per_window=2")
    items = np.minimum(np.random.default_rng().zipf(1.3, 30_000), D - 1)
    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        producer = threading.Thread(target=produce, args=(kafka_broker, topic, items, 2000))
        producer.start()
        for _ in range(3):
            time.sleep(4.5)
            members.kill("m2")
            members.start("m2")
        producer.join()
        wait_for_total(kafka_broker, GroupTopics(group), len(items), 180, members)
    finally:
        members.stop_all()
    docs = check_exact(kafka_broker, GroupTopics(group), len(items))
    logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
    assert "from its snapshot" in logs, members.logs()
    assert max(d["layers"] for d in docs) == 6          # 1 + 2 snapshots x 2 + release
    assert "is missing from" not in logs and not crash_traces(logs), members.logs()


def test_a_lost_snapshot_withholds_its_window_never_replays_it(kafka_broker):
    """The metadata names a snapshot the topic does not hold: the window is marked lost (it
    will be withheld at its close), not restarted from its start under fresh noise."""
    from types import SimpleNamespace

    from aggregator.service.group.counter import SliceTask
    from aggregator.service.group.snapshots import restore
    from aggregator.state import PanPrivateHistogram

    empty = make_topic(kafka_broker, partitions=1)
    reader = SimpleNamespace(consumer=KafkaConsumer(bootstrap_servers=kafka_broker,
                                                    isolation_level="read_committed",
                                                    enable_auto_commit=False, group_id=None),
                             topic=empty)
    task = SliceTask(0, 7, 120, 10, lambda: PanPrivateHistogram(1.0, size=10))
    try:
        restore(task, {"w": 7, "s": 1, "st": 100}, reader, 0)
    finally:
        reader.consumer.close()
    assert task.lost and "withheld" in task.lost and task.start == 100


def _released_total(bootstrap, topics):
    return sum(d["n"] for d in releases(bootstrap, topics))


def test_reset_source_offsets_and_a_deleted_ledger_never_release_an_event_twice(
        kafka_broker, tmp_path):
    """The group edition of "one event, one charge": the source group's offsets reset to the
    earliest record (what an operator's --reset-offsets does) re-reads the topic, but the
    intake's high-water marks keep every record from being repartitioned again; a ledger topic
    deleted while the group is stopped is refused at the next start, in one line, before
    anything is created."""
    from kafka.structs import OffsetAndMetadata

    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    topics = GroupTopics(group)
    members = Members(kafka_broker, topic, group, tmp_path)
    rng = np.random.default_rng()
    try:
        members.start("m1")
        produce(kafka_broker, topic, np.minimum(rng.zipf(1.3, 5000), D - 1), 5000)
        wait_for_total(kafka_broker, topics, 5000, 120, members)
        members.stop_all()
        admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
        deadline = time.monotonic() + 30   # offsets of a group change only while it is empty
        while admin.describe_groups([group])[group]["group_state"] != "Empty":
            assert time.monotonic() < deadline, "the source group never emptied"
            time.sleep(0.5)
        admin.alter_group_offsets(group, {TopicPartition(topic, p): OffsetAndMetadata(0, "", -1)
                                          for p in range(PARTS)})
        reset = admin.list_group_offsets(group)[group]
        assert {om.offset for om in reset.values()} == {0}
        members.start("m1")
        produce(kafka_broker, topic, np.minimum(rng.zipf(1.3, 1000), D - 1), 5000)
        wait_for_total(kafka_broker, topics, 6000, 120, members)
        time.sleep(3 * WINDOW_S + 2)       # windows after the last events: nothing more comes
        assert _released_total(kafka_broker, topics) == 6000, members.logs()
        members.stop_all()
        logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
        assert "are not counted again" in logs, logs[-3000:]
        check_exact(kafka_broker, topics, 6000)
        # the ledger topic deleted while the group is stopped: the next start refuses
        admin.delete_topics([topics.ledger])
        time.sleep(2)
        res = subprocess.run(member_cmd(kafka_broker, topic, group, "m1", tmp_path),
                             capture_output=True, text=True, timeout=120)
        assert res.returncode != 0
        last = res.stderr.strip().splitlines()[-1]
        assert "ledger topic" in last and "deleted" in last and "Traceback" not in res.stderr
        assert topics.ledger not in set(admin.list_topics()), "a refused start created it"
        admin.close()
    finally:
        members.stop_all()
