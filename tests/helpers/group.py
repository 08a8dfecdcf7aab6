"""What the group tests on a real broker share: member processes, the group's topics read back,
the event-time reference windows (tests/integration/test_group_*.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import msgpack
import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

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
    return [
        sys.executable,
        "-m",
        "aggregator.service.cli",
        "run",
        "--bootstrap",
        bootstrap,
        "--topic",
        topic,
        "--state-dir",
        str(tmp / name / "state"),
        "--release-dir",
        str(tmp / name / "releases"),
        "--metrics-port",
        "-1",
        "--set",
        "scale.partitioned=true",
        "--set",
        "scale.store=kafka",
        # these tests are the domain-split exchange's (the views exchange's:
        # test_group_views.py and the chaos matrix)
        "--set",
        "scale.exchange=items",
        "--set",
        "window.kind=time",
        "--set",
        f"window.size={WINDOW_S}",
        "--set",
        f"state.domain_size={D}",
        "--set",
        f"source.group={group}",
        "--set",
        f"source.instance_id={name}",
        "--set",
        "source.session_timeout_s=6",
        "--set",
        "scale.close_grace_s=1",
        "--set",
        "release.error_bar_reps=0",
        *extra,
    ]


def last_saying(tmp_path, pattern: str, *texts: str) -> str:
    """The member whose log (files ``pattern`` in ``tmp_path``, named ``<member>-<start>.log``)
    says last one of ``texts``: which member counts a partition, or leads, now."""
    last = {}
    for f in tmp_path.glob(pattern):
        for line in f.read_text().splitlines():
            if any(t in line for t in texts):
                last[f.name.split("-")[0]] = line[:23]
    return max(last, key=last.get)


def counting_owner(bootstrap, topics, topic: str, partition: int, timeout_s: float = 60) -> str:
    """The member (its ``source.instance_id``) the group's counting consumers assigned
    ``partition`` of ``topic`` to, read from Kafka once the counting group is stable: members
    started together rebalance a few times, and a log line saying who counts a partition may
    be older than the last move (a test once killed the wrong member that way)."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            g = admin.describe_groups([topics.counting_group]).get(topics.counting_group, {})
            if g.get("group_state") == "Stable":
                for m in g.get("members") or []:
                    for a in (m.get("member_assignment") or {}).get("assigned_partitions") or []:
                        if a["topic"] == topic and partition in a["partitions"]:
                            return str(m.get("client_id", "")).removeprefix("panagg-")
            assert time.monotonic() < deadline, f"no stable owner of {topic}:{partition}: {g}"
            time.sleep(0.5)
    finally:
        admin.close()


def crash_traces(logs: str) -> list[str]:
    """The tracebacks in member logs (CPython's "Exception ignored in ..." reports at exit
    included: an operator sees them all the same). Not counted: a release-worker process that
    was being spawned when its member was killed -9 (it reads its start from the dead parent's
    pipe: ``EOFError`` in multiprocessing's spawn), which is the kill's, not a member's crash."""
    lines = logs.splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last)"):
            continue
        block = "\n".join(lines[max(0, i - 1) : i + 20])
        if "multiprocessing/spawn.py" in block and "EOFError: Ran out of input" in block:
            continue
        out.append(block)
    return out


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
            member_cmd(*self.args, name, self.tmp, *self.extra),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )

    def kill(self, name):
        p = self.procs[name]
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)

    def kill_and_restart_one(self, chaos: random.Random, names) -> None:
        """kill -9 a member picked by ``chaos``, then start it again 0-2 s later."""
        victim = chaos.choice(names)
        self.kill(victim)
        time.sleep(chaos.uniform(0.0, 2.0))
        self.start(victim)

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

    def logs(self, last=3000, first=1500):
        out = []
        for f in sorted(self.tmp.glob("*.log")):
            text = f.read_text()
            if len(text) > first + last:
                text = f"{text[:first]}\n[...]\n{text[-last:]}"  # how it began, how it ends
            out.append(f"--- {f.name}\n{text}")
        return "\n".join(out)


def produce(bootstrap, topic, items, rate):
    p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20)
    step = max(1, int(rate / 20))
    for i in range(0, len(items), step):
        for it in items[i : i + step]:
            p.send(topic, value=msgpack.packb({"item": int(it)}))  # no key: any partition
        time.sleep(0.05)
    p.flush()
    p.close()


def read_all(bootstrap, topic, partitions=None, timeout_s=20.0):
    """Every committed record of ``topic``: {partition: [(offset, key, value)]}."""
    c = KafkaConsumer(
        bootstrap_servers=bootstrap,
        isolation_level="read_committed",
        enable_auto_commit=False,
        group_id=None,
    )
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


def releases(bootstrap, topics, *, rollups=False):
    """The window release documents of ``topics`` (``rollups``: the sum rollups' instead)."""
    docs = [
        json.loads(v) for _, _, v in read_all(bootstrap, topics.releases, [0])[0] if v is not None
    ]
    return [d for d in docs if ("rollup" in d) == rollups]


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


def read_ledger(bootstrap, topics) -> TopicLedger:
    """The group's ledger, read to its end (its hash chain checked)."""
    c = KafkaConsumer(
        bootstrap_servers=bootstrap,
        isolation_level="read_committed",
        enable_auto_commit=False,
        group_id=None,
    )
    ledger = TopicLedger(c, topics.ledger, budget_per_window=1.0)
    ledger.read_to_end()
    c.close()
    return ledger


def group_status(bootstrap, group, topic) -> str:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "status",
            "--group",
            group,
            "--bootstrap",
            bootstrap,
            "--topic",
            topic,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def tombstone_snapshots(bootstrap, topics, partitions: int) -> None:
    """Every snapshot key of the group's snapshots topic tombstoned (the snapshots gone, as a
    deletion or truncation leaves them)."""
    tomb = KafkaProducer(bootstrap_servers=bootstrap)
    for p in range(partitions):
        tomb.send(topics.snapshots, partition=p, key=str(p).encode(), value=None)
    tomb.flush()
    tomb.close()


def one_process(bootstrap, topic, tmp_path, group, extra):
    """One process over the same records (its own consumer group), to exit once idle: the
    reference a group's releases are compared with (its releases in tmp_path/one/releases)."""
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "run",
            "--bootstrap",
            bootstrap,
            "--topic",
            topic,
            "--state-dir",
            str(tmp_path / "one" / "state"),
            "--release-dir",
            str(tmp_path / "one" / "releases"),
            "--metrics-port",
            "-1",
            "--exit-when-idle",
            "5",
            "--set",
            f"state.domain_size={D}",
            "--set",
            f"source.group=one-{group}",
            "--set",
            "release.error_bar_reps=0",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]


def second_group_on_released(bootstrap, tmp_path, partitions, *extra, key="ranges"):
    """Two groups with different names over one topic and one budget registry: the first
    releases 3,000 records and stops, then the second starts. Returns the second group's
    release ledger entries once their source positions (``key``) cover the records or it
    released them, the events it released, its logs, and the topic's name."""
    topic = make_topic(bootstrap, partitions)
    reg = ("--set", f"ledger.registry_topic=reg-{topic}", *extra)
    items = np.arange(3000) % D
    first = Members(bootstrap, topic, f"a-{topic}", tmp_path / "a", *reg)
    (tmp_path / "a").mkdir()
    try:
        first.start("g1")
        produce(bootstrap, topic, items, 3000)
        wait_for_total(bootstrap, GroupTopics(f"a-{topic}"), len(items), 120, first)
    finally:
        first.stop_all()
    second = Members(bootstrap, topic, f"b-{topic}", tmp_path / "b", *reg)
    (tmp_path / "b").mkdir()
    topics = GroupTopics(f"b-{topic}")
    try:
        second.start("h1")
        deadline = time.monotonic() + 120
        while True:
            try:
                entries = [
                    e for e in read_ledger(bootstrap, topics).entries if e["kind"] == "release"
                ]
            except Exception:
                entries = []
            covered = sum(b - a for e in entries for a, b in e.get(key, {}).values())
            again = sum(d["n"] for d in releases(bootstrap, topics))
            if covered >= len(items) or again >= len(items):
                break
            assert time.monotonic() < deadline, second.logs()
            time.sleep(2)
    finally:
        second.stop_all()
    return entries, again, second.logs(last=100000), topic


ET_SIZE, ET_LATENESS = 10, 4  # the reference of tests/test_event_time_lateness.py uses 10 s


def event_stream(rng, windows, per_window, t0):
    """(timestamp ms, item) in production order: windows one after another, each record up to
    the lateness late within its window's span, and about 2 % pushed back 15 s (most of them late
    on their partition: counted in the window after). None in the first window: pushed back from
    there, one could open a window two before it with none between, and after such an empty
    window a group counts late records in it while one process counts them in the next window
    that has records (docs/scale-out.md, "Event-time windows")."""
    out = []
    for k in range(windows):
        ts = t0 + k * ET_SIZE + rng.uniform(0, ET_SIZE + 0.9 * ET_LATENESS, per_window)
        ts.sort()
        back = (rng.random(per_window) < 0.02) & (k > 0)
        ts[back] -= 1.5 * ET_SIZE
        out += [
            (int(t * 1000), int(i))
            for t, i in zip(ts, np.minimum(rng.zipf(1.3, per_window), D - 1))
        ]
    return out


def produce_stamped(bootstrap, topic, records, partition=None, pack=None):
    pack = pack or (lambda item: {"item": item})
    p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20)
    for ts, item in records:  # no key: the client picks the partitions
        p.send(topic, value=msgpack.packb(pack(item)), timestamp_ms=ts, partition=partition)
    p.flush()
    p.close()


def released_once(bootstrap, topics, docs) -> list[dict]:
    """The ledger's release entries: one per published window of ``docs``, none withheld, and
    no ledgered position charged past one window's eps (1.0)."""
    ledger = read_ledger(bootstrap, topics)
    entries = [e for e in ledger.entries if e["kind"] == "release"]
    assert sorted(e["window"] for e in entries) == sorted(d["window"] for d in docs)
    assert not any(e.get("withheld") for e in entries)
    book = ChargeBook(ledger.entries)
    for e in entries:
        for part, (a, b) in e["ranges"].items():
            if b > a:
                assert book.peak({part: [a, b]}, 0.0) == pytest.approx(1.0)
    return entries


def feed_across_a_kill(bootstrap, topic, topics, members, stream, names, parts, flush_at) -> str:
    """An event-time group's stream fed across a kill: the first half of ``stream``
    ((timestamp ms, item) pairs) until the group releases, then the rest at about 1,000
    records/s while one of ``names`` (at random) is killed -9 and started again 0-2 s later,
    then a record stamped ``flush_at`` on each of the ``parts`` partitions, so every window
    passes. Returns the member killed."""
    half = len(stream) // 2
    produce_stamped(bootstrap, topic, stream[:half])
    deadline = time.monotonic() + 120
    while not releases(bootstrap, topics):
        assert time.monotonic() < deadline, f"no release\n{members.logs()}"
        time.sleep(1)
    rest = stream[half:]
    feeder = threading.Thread(
        target=lambda: [
            (produce_stamped(bootstrap, topic, rest[i : i + 100]), time.sleep(0.1))
            for i in range(0, len(rest), 100)
        ]
    )
    feeder.start()
    chaos = random.Random()
    victim = chaos.choice(list(names))
    time.sleep(chaos.uniform(0.5, 2.5))
    members.kill(victim)
    time.sleep(chaos.uniform(0.0, 2.0))
    members.start(victim)
    feeder.join()
    for p in range(parts):  # every partition passes the last window
        produce_stamped(bootstrap, topic, [(flush_at, 0)], partition=p)
    return victim


def reference_windows(bootstrap, topic, parts, flush_at, positions=None):
    """{event_start_unix: (n, late)} the definitions give (tests/test_event_time_lateness.py's
    reference) over what the topic holds, partition by partition, before the flush window.
    ``positions`` (a dict): filled with each record's window, by (partition, offset)."""
    from tests.helpers.event_time import reference

    src = read_all(bootstrap, topic)
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    by_part = {}
    for p in range(parts):
        tp = TopicPartition(topic, p)
        c.assign([tp])
        c.seek_to_beginning(tp)
        recs = []
        while len(recs) < len(src[p]):
            for rs in c.poll(timeout_ms=500).values():
                recs += [(r.timestamp / 1000, (p, r.offset)) for r in rs]
        by_part[f"{topic}:{p}"] = recs
    c.close()
    where, ref = reference(by_part, ET_LATENESS, "next")
    if positions is not None:
        positions.update(where)
    flush_w = flush_at // 1000 // ET_SIZE
    return {k * ET_SIZE: (ev, late) for k, (ev, late) in ref.items() if k < flush_w}


def event_setup(bootstrap, parts, windows):
    """A topic, a group and its topics, and a stream of records stamped two hours back over
    ``windows`` event-time windows (500 a window)."""
    topic = make_topic(bootstrap, parts)
    group = f"g-{uuid.uuid4().hex[:8]}"
    t0 = (int(time.time()) - 7200) // ET_SIZE * ET_SIZE
    stream = event_stream(np.random.default_rng(), windows, 500, t0)
    return topic, group, GroupTopics(group), t0, stream


def by_event_window(docs):
    return {d["window_info"]["event_start_unix"]: (d["n"], d["window_info"]["late"]) for d in docs}
