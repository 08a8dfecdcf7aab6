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
import urllib.error
import urllib.request
import uuid

import msgpack
import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient

from prometheus_client.parser import text_string_to_metric_families

from aggregator.service.charges import ChargeBook
from aggregator.service.group.ledger_topic import TopicLedger
from aggregator.service.group.topics import GroupTopics
from tests.helpers.group import (
    D,
    ET_LATENESS,
    ET_SIZE,
    Members,
    PARTS,
    WINDOW_S,
    by_event_window,
    event_setup,
    event_stream,
    group_status,
    one_process,
    produce_stamped,
    reference_windows,
    crash_traces,
    feed_across_a_kill,
    make_topic,
    member_cmd,
    produce,
    read_all,
    read_ledger,
    released_once,
    releases,
    second_group_on_released,
    tombstone_snapshots,
    wait_for_total,
)


def check_exact(bootstrap, topics, total, eps=1.0, empty_skipped=False):
    """The checks of the module docstring (each position charged ``eps``); returns the release
    documents. ``empty_skipped``: count windows, where a window the leader cut while its read
    totals lagged can hold no event and is never released (docs/scale-out.md, "Count
    windows"): window numbers may then leave gaps, and so may the ranges, but only over offsets
    that hold no committed event (transaction markers), so no event was in a skipped window."""
    docs = releases(bootstrap, topics)
    windows = [d["window"] for d in docs]
    assert len(windows) == len(set(windows)), "a window was released twice"
    if empty_skipped:
        assert windows == sorted(windows), "windows out of order"
    else:
        assert windows == list(range(windows[0], windows[0] + len(windows))), (
            "windows not consecutive"
        )
    assert sum(d["n"] for d in docs) == total
    # the repartition topic: each source record once; events per message
    rp = read_all(bootstrap, topics.repartition)
    events_at = {p: {off: len(v) // 4 for off, _, v in recs} for p, recs in rp.items()}
    assert sum(sum(m.values()) for m in events_at.values()) == total
    # the ledger: chain, one release per window, ranges tile each partition, n matches ranges
    ledger = read_ledger(bootstrap, topics)
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
        p = int(part.rsplit(":", 1)[1])
        for (a0, b0), (a1, b1) in zip(ss, ss[1:]):
            # a skipped window's span may hold offsets with no event: transaction markers,
            # aborted writes, and the skipped window's own close marker (a record holding no
            # event: the suite at 29843ff saw [66, 81) then [82, 87), offset 81 such a marker)
            assert b0 == a1 or (
                empty_skipped
                and b0 < a1
                and not any(k for off, k in events_at[p].items() if b0 <= off < a1)
            ), f"{part}: windows {ss} leave a gap holding events, or overlap"
    book = ChargeBook(ledger.entries)
    for part, ss in spans.items():
        for a, b in ss:
            if b > a:
                assert book.peak({part: [a, b]}, 0.0) == pytest.approx(eps)
    return docs


def test_three_members_killed_twenty_times_and_a_zombie_release_every_event_once(
    kafka_broker, tmp_path
):
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    topics = GroupTopics(group)
    rng = np.random.default_rng()
    items = np.minimum(rng.zipf(1.3, 120_000), D - 1)
    members = Members(kafka_broker, topic, group, tmp_path)
    names = ["m1", "m2", "m3"]
    try:
        members.start("m1")
        time.sleep(4)  # m1 makes the group (internal topics, identity)
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
                z.send_signal(signal.SIGSTOP)  # its partitions move after the session
                time.sleep(10)
                z.send_signal(signal.SIGCONT)  # wakes as a zombie: fenced
                zombie_done = True
                continue
            members.kill_and_restart_one(chaos, names)
            kills += 1
        producer.join()
        wait_for_total(kafka_broker, topics, len(items), 240, members)
    finally:
        members.stop_all()
    try:
        docs = check_exact(kafka_broker, topics, len(items))
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{members.logs()}") from None
    logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
    print(
        f"\n{len(docs)} windows, {members.runs} member runs, "
        f"{logs.count('not written')} summaries and {logs.count('intake transaction aborted')} "
        f"intake transactions fenced or failed, {logs.count('leading group')} leader starts"
    )
    # no member crashed, and none printed a trace at its stop (the release worker's pool once
    # did: ReleaseWorker.close now joins it)
    assert not crash_traces(logs), members.logs()
    # a start of the opt-in items exchange says what it gives up (sections 20 and 22; a
    # member killed early in its start may not have said it yet)
    said = [ln for ln in logs.splitlines() if "scale.exchange = items:" in ln]
    assert said and all("plaintext" in ln for ln in said), said[:3]


class SteadyProducer:
    """Sends items to ``topic`` at about ``rate``/s from a thread until :meth:`stop`, through
    broker outages (sends that fail are dropped: the source topic's own contents are what the
    group must release, :func:`source_records`)."""

    def __init__(self, bootstrap, topic, rate=2000, seed=None):
        self.bootstrap, self.topic, self.rate = bootstrap, topic, rate
        self.rng = np.random.default_rng(seed)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        p = KafkaProducer(
            bootstrap_servers=self.bootstrap,
            linger_ms=20,
            max_block_ms=2000,
            request_timeout_ms=5000,
            reconnect_backoff_max_ms=1000,
        )
        step = max(1, self.rate // 20)
        while not self._stop.is_set():
            for it in np.minimum(self.rng.zipf(1.3, step), D - 1):
                try:
                    p.send(self.topic, value=msgpack.packb({"item": int(it)}))
                except Exception:
                    break  # the broker is away: this batch is not sent
            time.sleep(0.05)
        try:
            p.flush(timeout=30)
        finally:
            p.close(timeout=5)

    def stop(self):
        self._stop.set()
        self.thread.join(60)


def source_records(bootstrap, topic) -> int:
    """Records the source topic holds (what the producer's sends really left there)."""
    return sum(len(recs) for recs in read_all(bootstrap, topic).values())


def test_three_members_survive_a_broker_kill_and_a_clean_restart_and_lose_nothing(
    restartable_broker, tmp_path
):
    """Issue 46: three members, a steady producer, the broker killed -9 mid-window and back
    after 8 s, then stopped cleanly and started again: every member stays up (none prints a
    trace), the group releases again after each return, and every event the source topic holds
    is released once (check_exact)."""
    broker = restartable_broker
    bootstrap = broker.bootstrap
    topic = make_topic(bootstrap)
    group = f"g-{uuid.uuid4().hex[:8]}"
    topics = GroupTopics(group)
    members = Members(bootstrap, topic, group, tmp_path)
    producer = None
    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        members.start("m3")
        producer = SteadyProducer(bootstrap, topic)
        wait_for_total(bootstrap, topics, 1, 180, members)  # the group is up and releasing
        resumed = []
        for outage in (broker.kill, broker.stop):
            time.sleep(10)
            outage()
            time.sleep(8)
            broker.start()
            back = time.monotonic()
            before = _released_total(bootstrap, topics)
            while _released_total(bootstrap, topics) <= before:
                # (generous: a loaded 2-core machine leaves the leader windows behind; the
                # figure itself is measured in docs/scale-out.md, not asserted)
                assert time.monotonic() - back < 300, "no release after the broker came back"
                assert all(p.poll() is None for p in members.procs.values()), "a member exited"
                time.sleep(0.5)
            resumed.append(time.monotonic() - back)
        time.sleep(5)
        producer.stop()
        total = source_records(bootstrap, topic)
        wait_for_total(bootstrap, topics, total, 420, members)
        print(
            f"\nreleases resumed {resumed[0]:.1f} s after the kill -9, {resumed[1]:.1f} s "
            f"after the clean restart; {total} events"
        )
        assert all(p.poll() is None for p in members.procs.values()), "a member exited"
        members.stop_all()
        check_exact(bootstrap, topics, total)
        logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
        assert not crash_traces(logs)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{members.logs()}") from None
    finally:
        if producer is not None:
            producer.stop()
        members.stop_all()


def _feed_across_a_kill(members, bootstrap, topic, items, rate):
    """m1 makes the group, m2 joins; half the items at ``rate``/s, m2 killed -9 and started
    again, then the other half."""
    members.start("m1")
    time.sleep(4)
    members.start("m2")
    half = len(items) // 2
    produce(bootstrap, topic, items[:half], rate)
    members.kill("m2")
    members.start("m2")
    produce(bootstrap, topic, items[half:], rate)


def _user_ip_records(n):
    """``n`` records of a user (Zipf over the domain) and an IP (one of 5,000)."""
    rng = np.random.default_rng()
    return [
        msgpack.packb({"user": int(u), "ip": f"10.0.{i // 256}.{i % 256}"})
        for u, i in zip(np.minimum(rng.zipf(1.3, n), D - 1), rng.integers(0, 5000, n))
    ]


def test_several_aggregations_each_release_every_event_once(kafka_broker, tmp_path):
    """Two aggregations of one unkeyed topic (accounts in direct mode, IPs hashed), two
    members, one killed -9 and restarted: the source is read once, each aggregation has its own
    topics and ledger, and each releases every event once."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    extra = (
        "--metrics-port",
        "0",
        "--set",
        "ledger.budget_per_event=2",
        "--set",
        "aggregations.user.item.field=user",
        "--set",
        "aggregations.ip.item.field=ip",
        "--set",
        "aggregations.ip.state.mode=hashed",
        "--set",
        "aggregations.ip.state.expected_n=5000",
    )
    members = Members(kafka_broker, topic, group, tmp_path, *extra)
    n = 30_000
    records = _user_ip_records(n)
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
        time.sleep(6)  # one report interval
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                "status",
                "--group",
                group,
                "--bootstrap",
                kafka_broker,
                "--topic",
                topic,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        out = res.stdout
        assert "aggregation ip of group" in out and "aggregation user of group" in out, out
        assert out.count("leads (ledger, merges)") == 2, out
        # the only readiness problem allowed: a leader that says it is behind (2 s windows on a
        # loaded 2-core machine; issue 46: it must say so, with /ready 503)
        for line in out.splitlines():
            if "NOT READY" in line:
                assert "leads" in line and "the leader is behind" in line, out
        urls = sorted(set(re.findall(r"http://\S+/metrics", out)))
        assert len(urls) == 2, out
        # a forced release on a member's directory asks each aggregation's leader
        forced = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                "release",
                "--state-dir",
                str(tmp_path / "m1" / "state"),
            ],
            capture_output=True,
            text=True,
            timeout=200,
        )
        assert forced.returncode == 0, forced.stderr
        # each aggregation's leader answers: released, or (a leader behind its windows on a
        # loaded machine, as above) its markers written and the release to follow
        for name in ("ip", "user"):
            assert re.search(rf"released {name} window \d+", forced.stdout) or re.search(
                rf"{name} window \d+ closed in every partition; its release follows", forced.stdout
            ), forced.stdout
        events = {"user": 0.0, "ip": 0.0}
        for url in urls:
            with urllib.request.urlopen(url.replace("/metrics", "/healthz"), timeout=5) as r:
                assert r.status == 200
            try:
                with urllib.request.urlopen(url.replace("/metrics", "/ready"), timeout=5) as r:
                    assert r.status == 200
            except urllib.error.HTTPError as exc:  # a leader behind its windows, and only that
                assert exc.code == 503 and "the leader is behind" in exc.read().decode()
            # each aggregation its own series, labelled as one process labels them
            with urllib.request.urlopen(url, timeout=5) as r:
                fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
            for s in fams["panagg_events"].samples:
                if s.name == "panagg_events_total":
                    events[s.labels["aggregation"]] += s.value
            assert {s.labels["aggregation"] for s in fams["panagg_epsilon"].samples} == {
                "user",
                "ip",
            }
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
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), members.logs()


def test_rollup_levels_in_a_group_each_release_every_event_once(kafka_broker, tmp_path):
    """window.rollups with the default hybrid design in a group: the 6 s span is a level with
    its own state (an aggregation of its own), eps split 0.5 / 0.5; two members, one killed
    -9 and restarted; each level releases every event once and says what it is."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    members = Members(kafka_broker, topic, group, tmp_path, "--set", "window.rollups=6s")
    items = np.minimum(np.random.default_rng().zipf(1.3, 20_000), D - 1)
    try:
        _feed_across_a_kill(members, kafka_broker, topic, items, 4000)
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
        assert d["rollup_level"] == {
            "span": "6s",
            "design": "hybrid",
            "base": "base",
            "base_windows": 3,
            "epsilon": 0.5,
            "epsilon_per_event": 1.0,
            "sums": [],
        }
        assert d["window_info"]["started_unix"] % 6 == 0  # level windows align with base ones
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), members.logs()


def _sum_of_counters(summary) -> int:
    """The sum of a summary's counters (its value counts keep it: sum of value * count)."""
    return sum(v * c for v, c in summary["values"])


def wait_for_rollups(bootstrap, topics, k, timeout_s=60):
    """Wait until the rollup holding the last base window with events is released."""
    base = releases(bootstrap, topics)
    last = max(d["window"] for d in base if d["n"])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(
            d["rollup"]["index"] == last // k for d in releases(bootstrap, topics, rollups=True)
        ):
            return
        time.sleep(1)


def check_rollups(bootstrap, topics, total, k, span):
    """Sum rollups of ``k`` base windows: each released once at 0 eps with the argument, its n
    the sum of its base windows' n, 2 layers per base window, every event in one rollup, and
    each partition's rollup summary the sum of exactly the views its base summaries were taken
    from (the sum of counters adds up: a re-drawn layer would not). Returns the documents."""
    from aggregator.service.rollup import ROLLUP_ARGUMENT

    base = {d["window"]: d for d in releases(bootstrap, topics)}
    rolls = releases(bootstrap, topics, rollups=True)
    assert rolls, "no rollup released"
    names = [d["window"] for d in rolls]
    assert len(names) == len(set(names)), "a rollup was released twice"
    first = min(base)
    for d in rolls:
        r = d["rollup"]
        idx = r["index"]
        assert d["window"] == f"{span}-{idx}" and r["span"] == span and r["base_windows"] == k
        assert r["windows"] == [w for w in range(k * idx, k * idx + k) if w in base]
        assert [m["window"] for m in r["missing"]] == [
            w for w in range(k * idx, k * idx + k) if w < first
        ]
        assert d["n"] == sum(base[w]["n"] for w in r["windows"])
        assert d["window_info"]["events"] == d["n"]
        # (a window no event fell in, never released, is in the sums as layers only)
        quiet = r.get("noise_only_windows", [])
        assert not set(quiet) & set(base)
        assert r["layers"] == d["layers"] == 2 * (len(r["windows"]) + len(quiet))
        assert r["epsilon_spent"] == 0.0 and r["argument"] == ROLLUP_ARGUMENT
        assert d["window_info"]["kind"] == "rollup"
        assert d["window_info"]["size"] == base[r["windows"][0]]["window_info"]["size"] * k
    covered = [w for d in rolls for w in d["rollup"]["windows"]]
    assert len(covered) == len(set(covered))
    assert sum(d["n"] for d in rolls) == total, "an event is in no rollup, or in two"
    ledger = read_ledger(bootstrap, topics)
    entries = [e for e in ledger.entries if e["kind"] in ("rollup", "refused-rollup")]
    assert sorted(e["window"] for e in entries) == sorted(names)
    for e in entries:
        assert e["kind"] == "rollup" and e["epsilon_spent"] == 0.0
        assert e["note"] == ROLLUP_ARGUMENT
        doc = next(d for d in rolls if d["window"] == e["window"])
        assert [b["window"] for b in e["base_windows"]] == doc["rollup"]["windows"]
        assert e["n"] == doc["n"]
    views, summed = {}, []
    for _, key, value in read_all(bootstrap, topics.summaries, [0])[0]:
        if value is None:
            continue
        s = json.loads(value)
        if s.get("rollup"):
            summed.append(s)
        elif not s.get("refused"):
            assert key.decode() not in views, f"two committed summaries of {key}"
            views[key.decode()] = _sum_of_counters(s)
    assert summed
    for s in summed:
        parts = [f"{v['window']}/{s['partition']}" for v in s["parts"].values()]
        assert _sum_of_counters(s) == sum(views[k] for k in parts), (
            f"rollup {s['window']} of partition {s['partition']} is not the sum of its views"
        )
    return rolls


def test_sum_rollups_in_a_group_across_a_kill_sum_the_released_views(kafka_broker, tmp_path):
    """window.rollups = 3x as sums in a group of two, one member killed -9 and restarted:
    every base window released once and every event in exactly one; the rollups as
    check_rollups says."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "window.rollups=3x",
        "--set",
        "window.rollup_design=sum",
    )
    topics = GroupTopics(group)
    items = np.minimum(np.random.default_rng().zipf(1.3, 20_000), D - 1)
    try:
        _feed_across_a_kill(members, kafka_broker, topic, items, 4000)
        wait_for_total(kafka_broker, topics, len(items), 180, members)
        wait_for_rollups(kafka_broker, topics, 3)
    finally:
        members.stop_all()
    try:
        check_exact(kafka_broker, topics, len(items))
        check_rollups(kafka_broker, topics, len(items), 3, "3x")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{members.logs()}") from None
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), members.logs()


def test_sum_rollups_of_count_windows_in_a_group(kafka_broker, tmp_path):
    """window.rollups = 3x as sums over a group's count windows (cut by the leader): about six
    windows of about 1,000 events (the last ones forced), whole rollups, each the sum of its
    three released views at 0 eps, as check_rollups says."""
    N, total = 1000, 6000
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "window.kind=count",
        "--set",
        f"window.size={N}",
        "--set",
        "window.rollups=3x",
        "--set",
        "window.rollup_design=sum",
    )
    topics = GroupTopics(group)
    items = np.minimum(np.random.default_rng().zipf(1.3, total), D - 1)
    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        produce(kafka_broker, topic, items, 2000)
        _intake_caught_up(kafka_broker, topic, group)
        wait_for_total(kafka_broker, topics, total - N, 60, members)
        release = [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "release",
            "--state-dir",
            str(tmp_path / "m1" / "state"),
        ]
        forced = subprocess.run(release, capture_output=True, text=True, timeout=120)
        assert forced.returncode == 0 or "holds no events" in forced.stderr, forced.stderr
        wait_for_total(kafka_broker, topics, total, 60, members)
        # a loaded leader may cut fewer windows (a cut a whole window late starts the next
        # target there), or one no event fell in (its read totals lagged: not released): a
        # few more events and forced cuts until the last rollup is whole
        while (max(d["window"] for d in releases(kafka_broker, topics)) + 1) % 3:
            more = np.minimum(np.random.default_rng().zipf(1.3, 300), D - 1)
            produce(kafka_broker, topic, more, 2000)
            total += len(more)
            _intake_caught_up(kafka_broker, topic, group)
            _force_until_taken(release)
            wait_for_total(kafka_broker, topics, total, 60, members)
        wait_for_rollups(kafka_broker, topics, 3)
    finally:
        members.stop_all()
    try:
        check_exact(kafka_broker, topics, total, empty_skipped=True)
        rolls = check_rollups(kafka_broker, topics, total, 3, "3x")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{members.logs()}") from None
    assert len(rolls) == (max(d["window"] for d in releases(kafka_broker, topics)) + 1) // 3
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), members.logs()


def test_sum_rollups_of_two_aggregations_are_independent(kafka_broker, tmp_path):
    """Two aggregations (direct users with 3x sums, hashed IPs with 2x sums), two members, one
    killed -9 and restarted: each aggregation's rollups are its own (its topics, sums, ledger)
    and check out as check_rollups says."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "ledger.budget_per_event=2",
        "--set",
        "aggregations.user.item.field=user",
        "--set",
        "aggregations.ip.item.field=ip",
        "--set",
        "aggregations.ip.state.mode=hashed",
        "--set",
        "aggregations.ip.state.expected_n=5000",
        "--set",
        "aggregations.user.window.rollups=3x",
        "--set",
        "aggregations.user.window.rollup_design=sum",
        "--set",
        "aggregations.ip.window.rollups=2x",
        "--set",
        "aggregations.ip.window.rollup_design=sum",
    )
    n = 20_000
    records = _user_ip_records(n)
    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        p = KafkaProducer(bootstrap_servers=kafka_broker, linger_ms=20)
        for i, rec in enumerate(records):
            p.send(topic, value=rec)
            if i % 1000 == 999:
                time.sleep(0.25)  # about 4,000 a second: several windows
            if i == n // 2:
                p.flush()
                members.kill("m2")
                members.start("m2")
        p.flush()
        p.close()
        for name, k in (("user", 3), ("ip", 2)):
            wait_for_total(kafka_broker, GroupTopics(group, name), n, 180, members)
            wait_for_rollups(kafka_broker, GroupTopics(group, name), k)
    finally:
        members.stop_all()
    try:
        for name, k in (("user", 3), ("ip", 2)):
            check_exact(kafka_broker, GroupTopics(group, name), n)
            rolls = check_rollups(kafka_broker, GroupTopics(group, name), n, k, f"{k}x")
            assert all(d["aggregation"] == {"name": name} for d in rolls)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{members.logs()}") from None
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), members.logs()


def test_hybrid_spans_after_the_first_are_sums_of_the_level_in_a_group(kafka_broker, tmp_path):
    """window.rollups = 4s,12s with the default hybrid design: base windows and the 4 s level
    each at eps 0.5, and the 12 s span the sum of three level windows (0 eps), in a group of
    two with a member killed -9."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    members = Members(kafka_broker, topic, group, tmp_path, "--set", "window.rollups=4s,12s")
    items = np.minimum(np.random.default_rng().zipf(1.3, 30_000), D - 1)
    level = GroupTopics(group, "r4s")
    try:
        _feed_across_a_kill(members, kafka_broker, topic, items, 3000)
        for name in ("base", "r4s"):
            # (generous: two levels of 4 s windows release 2-5 s each on a loaded 2-core
            # machine, and the leader catches up only once the feed has stopped; 75 s alone)
            wait_for_total(kafka_broker, GroupTopics(group, name), len(items), 360, members)
        wait_for_rollups(kafka_broker, level, 3)
    finally:
        members.stop_all()
    try:
        check_exact(kafka_broker, GroupTopics(group, "base"), len(items), eps=0.5)
        check_exact(kafka_broker, level, len(items), eps=0.5)
        rolls = check_rollups(kafka_broker, level, len(items), 3, "12s")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{members.logs()}") from None
    assert not releases(kafka_broker, GroupTopics(group, "base"), rollups=True)
    for d in rolls:
        assert d["window_info"]["size"] == 12 and d["window_info"]["base_kind"] == "time"
        assert d["rollup_level"]["sums"] == ["12s"] and d["aggregation"] == {"name": "r4s"}
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), members.logs()


@pytest.mark.parametrize("withheld", [False, True])
def test_the_leader_releases_a_sum_rollup_or_withholds_it_with_a_withheld_base_window(
    kafka_broker, tmp_path, withheld
):
    """The leader's part on real topics (a real Leader, ledger topic and transactions; the
    rollup summaries of real slices, tests/test_group_rollups.py). ``withheld``: partition 1
    refused window 7 (its positions were charged) and the leader withheld 7, whose slices on
    partitions 0 and 2 are in their sums: the rollup is withheld, a refused-rollup entry at 0
    eps, nothing in the releases topic, no file. Otherwise the same path releases it (ledger
    entry with the argument and the base windows, the document in the topic and the file).
    Either way the rollup summaries are tombstoned in the decision."""
    from kafka.admin import KafkaAdminClient

    from aggregator.service.group.leader import Leader
    from aggregator.service.group.rollups import RollupReleases
    from aggregator.service.group.txn import Transactions
    from aggregator.service.metrics import Metrics
    from aggregator.service.rollup import ROLLUP_ARGUMENT
    from tests.test_group_rollups import IDENT, _close_windows

    group = f"g-{uuid.uuid4().hex[:8]}"
    topics = GroupTopics(group)
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    topics.ensure(admin, IDENT["partitions"], 3600_000)
    admin.close()
    refused = {(7, 1)} if withheld else set()
    _, rolled, _, _ = _close_windows([6, 7, 8], np.random.default_rng(), refused=refused)

    def client(**kw):
        return KafkaConsumer(
            bootstrap_servers=kafka_broker,
            isolation_level="read_committed",
            enable_auto_commit=False,
            group_id=None,
            **kw,
        )

    def producer():
        p = KafkaProducer(
            bootstrap_servers=kafka_broker,
            transactional_id=f"{group}.leader",
            max_request_size=16 << 20,
        )
        p.init_transactions()
        return p

    txn = Transactions(producer, remake=False)
    ledger = TopicLedger(client(), topics.ledger, budget_per_window=1.0)
    ledger.read_to_end()
    txn.begin()
    for w in (6, 7, 8):
        extra = {"withheld": "positions were released before"} if w == 7 and withheld else {}
        ledger.append(
            entry_id=f"L/{w}",
            kind="release",
            window=w,
            epsilon_spent=1.0,
            window_uid=f"L/{w}",
            producer=txn,
            **extra,
        )
    for p, s in rolled.items():  # as the partitions wrote them
        txn.send(
            topics.summaries, partition=0, key=f"r/3x/2/{p}".encode(), value=json.dumps(s).encode()
        )
    txn.commit()
    ledger.committed()
    leader = Leader(
        txn,
        ledger,
        client(),
        topics,
        dict(IDENT, window_kind="time"),
        Metrics(),
        release_dir=str(tmp_path / "releases"),
        error_bar_reps=0,
    )
    leader.rollups = RollupReleases(leader, {"3x": 3})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not ledger.has("L/rollup-3x-2"):
        ledger.tail(0)  # as the member's counting stage does every turn
        leader.step()
        time.sleep(0.2)
    txn.close()
    entry = ledger.get("L/rollup-3x-2")
    assert entry is not None, (
        f"undecided; the leader holds "
        f"{ {k: sorted(v) for k, v in leader.rollups.pending.items()} }, "
        f"decided {sorted(leader.decided())}, {ledger.entries}"
    )
    assert entry["epsilon_spent"] == 0.0
    docs = releases(kafka_broker, topics, rollups=True)
    left = [
        v for _, k, v in read_all(kafka_broker, topics.summaries, [0])[0] if k.startswith(b"r/")
    ]
    assert left[-3:] == [None, None, None]  # tombstoned in the decision
    if withheld:
        assert entry["kind"] == "refused-rollup" and "base window 7" in entry["note"]
        assert docs == [] and not (tmp_path / "releases" / "release-3x-2.json").exists()
    else:
        assert entry["kind"] == "rollup" and entry["note"] == ROLLUP_ARGUMENT
        assert [b["window"] for b in entry["base_windows"]] == [6, 7, 8]
        [doc] = docs
        assert doc["rollup"]["windows"] == [6, 7, 8] and doc["layers"] == 6
        assert doc["n"] == entry["n"] == sum(s["n"] for s in rolled.values())
        assert json.loads((tmp_path / "releases" / "release-3x-2.json").read_text()) == doc


def _intake_caught_up(bootstrap, topic, group, timeout_s=60, parts=PARTS):
    """Wait until the source group's committed offsets reach the topic's end (the intake has
    repartitioned every record, in committed transactions)."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    c = KafkaConsumer(bootstrap_servers=bootstrap)
    tps = [TopicPartition(topic, p) for p in range(parts)]
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


def _force_until_taken(release, timeout_s=60):
    """A forced release of a count window, asked again while the leader's read totals have not
    yet seen the events the intake took (it answers "holds no events yet" until they arrive)."""
    deadline = time.monotonic() + timeout_s
    while True:
        forced = subprocess.run(release, capture_output=True, text=True, timeout=120)
        if forced.returncode == 0:
            return
        assert "holds no events" in forced.stderr and time.monotonic() < deadline, forced.stderr
        time.sleep(1)


def _start_two_and_feed(members, bootstrap, topic, group, items):
    """m1 makes the group, m2 joins; ``items`` at 3,000/s; back once the intake took them all."""
    members.start("m1")
    time.sleep(4)
    members.start("m2")
    produce(bootstrap, topic, items, 3000)
    _intake_caught_up(bootstrap, topic, group)


#: windows that do not end within a test: hour-long, or count windows of 100,000 events
LONG_WINDOWS = {
    "time": ("--set", "window.size=3600"),
    "count": ("--set", "window.kind=count", "--set", "window.size=100000"),
}


@pytest.mark.parametrize("kind", sorted(LONG_WINDOWS))
def test_a_forced_release_closes_the_open_window_in_every_partition(kafka_broker, tmp_path, kind):
    """panagg release on a member's directory: the leader writes close markers into every
    repartition partition; the window open now (hour-long, or of 100,000 events, here) is
    released with exactly the events taken before the request; a second request closes the
    next window."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    members = Members(kafka_broker, topic, group, tmp_path, *LONG_WINDOWS[kind])
    rng = np.random.default_rng()
    first, second = (np.minimum(rng.zipf(1.3, k), D - 1) for k in (3000, 2000))
    release = [
        sys.executable,
        "-m",
        "aggregator.service.cli",
        "release",
        "--state-dir",
        str(tmp_path / "m1" / "state"),
    ]
    try:
        _start_two_and_feed(members, kafka_broker, topic, group, first)
        out1 = subprocess.run(release, capture_output=True, text=True, timeout=120)
        assert out1.returncode == 0, out1.stderr + members.logs()
        produce(kafka_broker, topic, second, 3000)
        _intake_caught_up(kafka_broker, topic, group)
        out2 = subprocess.run(release, capture_output=True, text=True, timeout=120)
        assert out2.returncode == 0, out2.stderr + members.logs()
        # a member that reads the intake topic's marks after the requests (a restart) skips
        # the requests' keys (they once crashed it)
        members.kill("m2")
        members.start("m2")
        wait_for_total(kafka_broker, GroupTopics(group), 5000, 60, members)
        time.sleep(3)
        assert all(p.poll() is None for p in members.procs.values()), members.logs()
    finally:
        members.stop_all()
    k1, k2 = (int(re.search(r"released window (\d+)", o.stdout).group(1)) for o in (out1, out2))
    assert k2 > k1, (out1.stdout, out2.stdout)
    docs = check_exact(kafka_broker, GroupTopics(group), 5000)
    n_by = {d["window"]: d["n"] for d in docs}
    # the forced window held exactly what was taken before the request, the next one the rest
    assert sum(n for w, n in n_by.items() if w <= k1) == 3000, n_by
    assert sum(n for w, n in n_by.items() if k1 < w <= k2) == 2000, n_by
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), members.logs()


def test_count_windows_of_a_group_are_cut_by_the_leader_and_hold_every_event_once(
    kafka_broker, tmp_path
):
    """window.kind = count in a group: the leader cuts window K once the intakes' committed
    totals grew by N since the last cut (markers in every repartition partition). Two members,
    one killed -9 and restarted mid-stream; the rest is closed by a forced release. Every event
    is released once with exact ranges and charges, and the cuts never fall short: the events
    released up to the K-th counted window are at least K * N."""
    N, total = 2500, 12_000
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "window.kind=count",
        "--set",
        f"window.size={N}",
    )
    items = np.minimum(np.random.default_rng().zipf(1.3, total), D - 1)
    release = [
        sys.executable,
        "-m",
        "aggregator.service.cli",
        "release",
        "--state-dir",
        str(tmp_path / "m1" / "state"),
    ]
    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        produce(kafka_broker, topic, items[:6000], 2000)
        members.kill("m1")  # the leader or not: either way the group goes on
        members.start("m1")
        produce(kafka_broker, topic, items[6000:], 2000)
        _intake_caught_up(kafka_broker, topic, group)
        topics = GroupTopics(group)
        wait_for_total(kafka_broker, topics, N * (total // N), 120, members)
        forced = subprocess.run(release, capture_output=True, text=True, timeout=120)
        # (the last cut may hold the rest already: then there is nothing to force)
        assert forced.returncode == 0 or "holds no events" in forced.stderr, (
            forced.stderr + members.logs()
        )
        wait_for_total(kafka_broker, topics, total, 60, members)
    finally:
        members.stop_all()
    try:
        docs = check_exact(kafka_broker, topics, total, empty_skipped=True)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{members.logs()}") from None
    n_by = {d["window"]: d["n"] for d in docs}
    assert min(n_by) == 0 and all(d["window_info"]["kind"] == "count" for d in docs)
    last = max(n_by) if forced.returncode else max(n_by) - 1  # the forced window: the rest
    released = np.cumsum([n_by[w] for w in sorted(n_by)])
    for k in range(last + 1):
        assert released[k] >= (k + 1) * N, n_by
    print(f"\ncount windows of {N}: n = {[n_by[w] for w in sorted(n_by)]}")
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), members.logs()


def test_count_windows_of_two_aggregations_are_cut_each_by_its_own_total(kafka_broker, tmp_path):
    """Two aggregations with count windows of different sizes (window.size per aggregation):
    each leader sums its own aggregation's totals; both release every event once."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    sizes = {"user": 2000, "ip": 3000}
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "window.kind=count",
        "--set",
        "ledger.budget_per_event=2",
        "--set",
        "aggregations.user.item.field=user",
        "--set",
        f"aggregations.user.window.size={sizes['user']}",
        "--set",
        "aggregations.ip.item.field=ip",
        "--set",
        f"aggregations.ip.window.size={sizes['ip']}",
    )
    n = 9000
    rng = np.random.default_rng()
    records = [
        msgpack.packb({"user": int(u), "ip": int(i)})
        for u, i in zip(np.minimum(rng.zipf(1.3, n), D - 1), rng.integers(0, D, n))
    ]
    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        p = KafkaProducer(bootstrap_servers=kafka_broker, linger_ms=20)
        for rec in records:
            p.send(topic, value=rec)
        p.flush()
        p.close()
        _intake_caught_up(kafka_broker, topic, group)
        for name, size in sizes.items():
            wait_for_total(
                kafka_broker, GroupTopics(group, name), (n // size - 1) * size, 90, members
            )
        status = group_status(kafka_broker, group, topic)
        # each aggregation's open count window and how far it is (the taken events are public:
        # every release states its n)
        for name, size in sizes.items():
            assert re.search(
                rf"count window \d+ open: [\d,]+ events taken .*cut after [\d,]+ "
                rf"more \(windows of {size:,}\)",
                status,
            ), status
        forced = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                "release",
                "--state-dir",
                str(tmp_path / "m1" / "state"),
            ],
            capture_output=True,
            text=True,
            timeout=200,
        )
        for name in sizes:
            wait_for_total(kafka_broker, GroupTopics(group, name), n, 90, members)
    finally:
        members.stop_all()
    # a request no leader answers (the members are stopped) is shown as pending
    from aggregator.service.group.forced import REQUEST, _ask

    _ask(kafka_broker, {}, GroupTopics(group, "ip"), REQUEST, uuid.uuid4().hex)
    status = group_status(kafka_broker, group, topic)
    assert status.count("a forced release is asked and not yet answered") == 1, status
    for name, size in sizes.items():
        try:
            docs = check_exact(kafka_broker, GroupTopics(group, name), n, empty_skipped=True)
        except AssertionError as exc:
            raise AssertionError(
                f"{name}: {exc}\n{forced.stdout}{forced.stderr}{members.logs()}"
            ) from None
        assert all(
            d["aggregation"] == {"name": name} and d["window_info"]["size"] == size for d in docs
        )
        released = np.cumsum([d["n"] for d in sorted(docs, key=lambda d: d["window"])])
        assert all(released[k] >= (k + 1) * size for k in range(len(docs) - 1)), released
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), members.logs()


@pytest.mark.parametrize("kind", sorted(LONG_WINDOWS))
def test_an_audit_export_of_a_group_is_one_signed_state_and_closes_its_window(
    kafka_broker, tmp_path, monkeypatch, kind
):
    """panagg audit export on a member's directory: every partition exports its open window's
    slice with fresh layers around it and closes that window in the same transaction; the
    leader signs the whole state (D counters, n of the events taken) and ledgers it at eps 0;
    the window is then released once, every partition's summary at the same layer count."""
    key = os.urandom(32).hex()
    monkeypatch.setenv("PANAGG_AUDIT_KEY", key)  # the members sign with it (the leader)
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    members = Members(kafka_broker, topic, group, tmp_path, *LONG_WINDOWS[kind])
    items = np.minimum(np.random.default_rng().zipf(1.3, 3000), D - 1)
    cli = [sys.executable, "-m", "aggregator.service.cli"]
    try:
        _start_two_and_feed(members, kafka_broker, topic, group, items)
        # (m1's directory: m2 may still be starting, its directory not yet a member's)
        out = subprocess.run(
            cli + ["audit", "export", "--state-dir", str(tmp_path / "m1" / "state")],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PANAGG_AUDIT_KEY=""),
        )
        assert out.returncode == 0, out.stderr + members.logs()
        wait_for_total(kafka_broker, GroupTopics(group), 3000, 60, members)
    finally:
        members.stop_all()
    path = out.stdout.strip().splitlines()[-1]
    ok = subprocess.run(
        cli + ["audit", "verify", path],
        capture_output=True,
        text=True,
        env=dict(os.environ, PANAGG_AUDIT_KEY=key),
    )
    assert ok.returncode == 0 and ok.stdout.startswith("OK"), ok.stdout + ok.stderr
    from state_store.audit import read_export
    from aggregator.state import PanPrivateHistogram

    doc = read_export(path, bytes.fromhex(key))
    state = PanPrivateHistogram.deserialize(doc["state"])
    # (the member logs with it: once, under load, a state of n = 0 was exported)
    assert state.size == D and state.n == 3000 and state.layers == 2, (
        f"n={state.n} layers={state.layers} window={doc['window']}\n"
        f"{out.stdout}{out.stderr}\n{members.logs()}"
    )
    assert doc["window"]["partitions"] == PARTS and len(doc["offsets"]) == PARTS
    docs = check_exact(kafka_broker, GroupTopics(group), 3000)
    exported = [d for d in docs if d["window"] in doc["window"]["windows"]]
    assert exported and all(d["layers"] == 4 for d in exported)  # 1 + 2 export + release
    ledger = read_ledger(kafka_broker, GroupTopics(group))
    exports = [e for e in ledger.entries if e["kind"] == "export"]
    assert len(exports) == 1 and exports[0]["epsilon_spent"] == 0.0
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), members.logs()


def test_source_start_latest_places_a_new_group_at_the_end(kafka_broker, tmp_path):
    """source.start = latest: the records already in the topic are never counted, the ones
    after the start are, once; the start is in the group's identity."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng()
    produce(kafka_broker, topic, np.minimum(rng.zipf(1.3, 2000), D - 1), 5000)  # before
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
        time.sleep(3 * WINDOW_S)  # nothing more comes (the 2,000 before are not read)
    finally:
        members.stop_all()
    docs = releases(kafka_broker, GroupTopics(group))
    assert sum(d["n"] for d in docs) == 1500
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), members.logs()


def test_snapshots_bound_the_replay_and_a_member_resumes_from_one(kafka_broker, tmp_path):
    """checkpoint.snapshots_per_window = 2 in a group (6 s windows): partitions snapshot at 1/3
    and 2/3 of each window with the committed offset; a member killed -9 and restarted resumes
    windows from their snapshots (never from their start), and every event is released once."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    topics = GroupTopics(group)
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "window.size=6",
        "--set",
        "checkpoint.snapshots_per_window=2",
    )
    items = np.minimum(np.random.default_rng().zipf(1.3, 30_000), D - 1)

    def snapshots_written() -> int:
        try:
            return sum(
                v is not None
                for recs in read_all(kafka_broker, topics.snapshots).values()
                for _, _, v in recs
            )
        except (TypeError, ValueError):  # the topic is not there yet
            return 0

    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        m2_log = tmp_path / f"m2-{members.runs}.log"
        producer = threading.Thread(target=produce, args=(kafka_broker, topic, items, 1000))
        producer.start()
        # each kill once m2 counts partitions and a snapshot was written after that (fixed
        # sleeps let a loaded run's kills land before the window's first snapshot, or before
        # the restarted m2 had joined), until a restart resumed from one or the stream ended
        for _ in range(6):
            deadline = time.monotonic() + 60
            while producer.is_alive() and "counting partition" not in m2_log.read_text():
                assert time.monotonic() < deadline, members.logs()
                time.sleep(0.3)
            seen = snapshots_written()
            while producer.is_alive() and snapshots_written() <= seen:
                assert time.monotonic() < deadline, members.logs()
                time.sleep(0.3)
            if not producer.is_alive():
                break
            members.kill("m2")
            members.start("m2")
            m2_log = tmp_path / f"m2-{members.runs}.log"
            deadline = time.monotonic() + 20
            while "from its snapshot" not in "".join(f.read_text() for f in tmp_path.glob("*.log")):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            else:
                break
        producer.join()
        wait_for_total(kafka_broker, GroupTopics(group), len(items), 180, members)
    finally:
        members.stop_all()
    docs = check_exact(kafka_broker, GroupTopics(group), len(items))
    logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
    assert "from its snapshot" in logs, members.logs()
    # 1 + 2 snapshots x 2 + release; a resumed window too (its restore layer stands where the
    # snapshot's second layer, which the snapshot does not hold, stood)
    assert max(d["layers"] for d in docs) == 6
    assert "is missing from" not in logs and not crash_traces(logs), members.logs()


def test_a_lost_snapshot_of_an_items_group_is_withheld_with_its_positions_charged(
    kafka_broker, tmp_path
):
    """The items exchange end to end: a member killed -9 with snapshots in the topic, which
    are then gone (tombstones): restarted, it withholds those windows, each ledger entry
    naming the missing snapshot and charging every partition's range, the lost ones' too (its
    snapshots were views of their events; before, the withheld entry left them out although
    docs/privacy.md said they were charged); later windows are released."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    topics = GroupTopics(group)
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "window.size=6",
        "--set",
        "checkpoint.snapshots_per_window=2",
    )
    try:
        members.start("m1")
        producer = threading.Thread(
            target=produce, args=(kafka_broker, topic, np.arange(12_000) % D, 1000)
        )
        producer.start()
        deadline = time.monotonic() + 90

        def snapshotted() -> bool:
            try:
                return any(
                    v is not None
                    for recs in read_all(kafka_broker, topics.snapshots).values()
                    for _, _, v in recs
                )
            except (TypeError, ValueError):  # the topic is not there yet
                return False

        while not snapshotted():
            assert time.monotonic() < deadline, members.logs()
            time.sleep(0.3)
        members.kill("m1")
        tombstone_snapshots(kafka_broker, topics, PARTS)
        members.start("m1")
        producer.join()
        deadline = time.monotonic() + 120
        while True:
            entries = [
                e for e in read_ledger(kafka_broker, topics).entries if e["kind"] == "release"
            ]
            held = [e for e in entries if e.get("withheld")]
            if held and any(
                e["window"] > held[-1]["window"] and not e.get("withheld") for e in entries
            ):
                break
            assert members.procs["m1"].poll() is None, members.logs()
            assert time.monotonic() < deadline, members.logs()
            time.sleep(2)
    finally:
        members.stop_all()
    for e in held:
        assert "is missing from" in e["withheld"], e["withheld"]
        assert len(e["ranges"]) == PARTS and e["epsilon_spent"] > 0, e
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log")))


def _snapshot_reader(bootstrap, topic):
    """What a counter reads its snapshots with: a consumer with no group, and the topic."""
    from types import SimpleNamespace

    return SimpleNamespace(
        consumer=KafkaConsumer(
            bootstrap_servers=bootstrap,
            isolation_level="read_committed",
            enable_auto_commit=False,
            group_id=None,
        ),
        topic=topic,
    )


def test_a_lost_snapshot_withholds_its_window_never_replays_it(kafka_broker):
    """The metadata names a snapshot the topic does not hold: the window is marked lost (it
    will be withheld at its close), not restarted from its start under fresh noise."""

    from aggregator.service.group.counter import SliceTask
    from aggregator.service.group.snapshots import restore
    from aggregator.state import PanPrivateHistogram

    empty = make_topic(kafka_broker, partitions=1)
    reader = _snapshot_reader(kafka_broker, empty)
    task = SliceTask(0, 7, 120, 10, lambda: PanPrivateHistogram(1.0, size=10))
    try:
        restore(task, {"w": 7, "s": 1, "st": 100}, reader, 0)
    finally:
        reader.consumer.close()
    assert task.lost and "withheld" in task.lost and task.start == 100


def test_a_restored_snapshot_gets_a_fresh_layer_before_counting_on(kafka_broker):
    """One process's restore rule in both exchanges (snapshots.restore, view_resume): the state
    resumed from a snapshot carries one more layer than the snapshot and other counters, so the
    new owner's memory is never the snapshot plus exact increments (section 16). (Before, the
    items exchange's restore kept the snapshot's counters as they were.)"""

    import msgpack

    from aggregator.service.group.counter import SliceTask
    from aggregator.service.group.snapshots import restore, view_resume
    from aggregator.state import PanPrivateHistogram

    topic = make_topic(kafka_broker, partitions=1)
    snap = PanPrivateHistogram(1.0, size=200)
    snap.rerandomize()
    p = KafkaProducer(bootstrap_servers=kafka_broker)
    p.send(
        topic,
        partition=0,
        key=b"0",
        value=msgpack.packb(
            {
                "window": 7,
                "seq": 1,
                "start": 100,
                "position": 120,
                "events": 0,
                "state": snap.serialize(),
            },
            use_bin_type=True,
        ),
    )
    p.flush()
    reader = _snapshot_reader(kafka_broker, topic)
    task = SliceTask(0, 7, 120, 10, lambda: PanPrivateHistogram(1.0, size=200))
    try:
        restore(task, {"w": 7, "s": 1, "st": 100}, reader, 0)
        p.send(
            topic,
            partition=0,
            key=b"0",
            value=msgpack.packb(
                {"window": 7, "seq": 1, "ranges": {"0": [100, 120]}, "state": snap.serialize()},
                use_bin_type=True,
            ),
        )
        p.flush()
        got = view_resume(reader, 0, (7, 1), {0: 120})
    finally:
        reader.consumer.close()
        p.close()
    assert not task.lost and not isinstance(got, str), (task.lost, got)
    for state in (task.state, got[0]):
        assert state.layers == snap.layers + 1
        assert np.mean(state.counts == snap.counts) < 0.5
    assert got[1] == {0: 100}


def test_dead_letters_of_a_group_are_written_once_with_the_intakes_transaction(
    kafka_broker, tmp_path
):
    """source.dead_letter_topic in a group: every bad record gets exactly one dead letter (read
    committed), a member killed -9 between; the good records are released once."""
    topic = make_topic(kafka_broker)
    dead = make_topic(kafka_broker, partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    members = Members(
        kafka_broker, topic, group, tmp_path, "--set", f"source.dead_letter_topic={dead}"
    )
    items = np.minimum(np.random.default_rng().zipf(1.3, 3000), D - 1)
    p = KafkaProducer(bootstrap_servers=kafka_broker, linger_ms=20)
    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        for i, it in enumerate(items):
            p.send(topic, value=msgpack.packb({"item": int(it)}))
            if i % 10 == 0:
                p.send(topic, value=b"\xc1 not msgpack")  # 300 bad records
            if i == 1500:
                p.flush()
                members.kill("m2")
                members.start("m2")
                time.sleep(1)
        p.flush()
        wait_for_total(kafka_broker, GroupTopics(group), 3000, 120, members)
    finally:
        p.close()
        members.stop_all()
    check_exact(kafka_broker, GroupTopics(group), 3000)
    letters = read_all(kafka_broker, dead, [0])[0]
    keys = [k for _, k, _ in letters]
    assert len(keys) == 300 and len(set(keys)) == 300, (len(keys), len(set(keys)))
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), members.logs()


def test_a_forced_release_of_an_event_time_group_releases_every_window_so_far(
    kafka_broker, tmp_path
):
    """panagg release on an event-time group: windows no watermark has closed yet (no record
    passes them) are closed at once up to the newest one seen, and every record read so far is
    released, once; an audit export is answered with one line."""
    parts = 4
    topic, group, topics, t0, stream = event_setup(kafka_broker, parts, 4)
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "window.kind=event_time",
        "--set",
        f"window.size={ET_SIZE}",
        "--set",
        f"window.allowed_lateness_s={ET_LATENESS}",
    )
    cli = [sys.executable, "-m", "aggregator.service.cli"]
    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        produce_stamped(kafka_broker, topic, stream)
        _intake_caught_up(kafka_broker, topic, group, parts=parts)
        time.sleep(3)  # the leader's first marker opens the windows
        out = subprocess.run(
            cli + ["release", "--state-dir", str(tmp_path / "m1" / "state")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr + members.logs()
        wait_for_total(kafka_broker, topics, len(stream), 90, members)
        exp = subprocess.run(
            cli + ["audit", "export", "--state-dir", str(tmp_path / "m1" / "state")],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        members.stop_all()
    docs = releases(kafka_broker, topics)
    assert len({d["window"] for d in docs}) == len(docs), "a window was released twice"
    assert sum(d["n"] for d in docs) == len(stream)
    assert exp.returncode != 0 and "event-time windows are not built yet" in exp.stderr
    assert len(exp.stderr.strip().splitlines()) == 1, exp.stderr
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), members.logs()


def _released_total(bootstrap, topics):
    return sum(d["n"] for d in releases(bootstrap, topics))


def _reset_source_offsets(admin, group, topic):
    """An operator's --reset-offsets --to-earliest on the stopped group (metadata dropped)."""
    from kafka.structs import OffsetAndMetadata

    deadline = time.monotonic() + 30  # offsets of a group change only while it is empty
    while admin.describe_groups([group])[group]["group_state"] != "Empty":
        assert time.monotonic() < deadline, "the source group never emptied"
        time.sleep(0.5)
    admin.alter_group_offsets(
        group, {TopicPartition(topic, p): OffsetAndMetadata(0, "", -1) for p in range(PARTS)}
    )
    reset = admin.list_group_offsets(group)[group]
    assert {om.offset for om in reset.values()} == {0}


def test_count_windows_go_on_counting_after_the_source_offsets_were_reset(kafka_broker, tmp_path):
    """The intake's running totals live in the committed offsets' metadata; an offset reset
    drops it. The totals then go on from the ones published in the intake topic, so the leader
    still cuts the next window after N more events (with the totals restarted at 0 it would
    wait for ever)."""
    N = 2000
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    topics = GroupTopics(group)
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "window.kind=count",
        "--set",
        f"window.size={N}",
    )
    rng = np.random.default_rng()
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    try:
        members.start("m1")
        produce(kafka_broker, topic, np.minimum(rng.zipf(1.3, 3000), D - 1), 5000)
        wait_for_total(kafka_broker, topics, N, 120, members)
        members.stop_all()
        _reset_source_offsets(admin, group, topic)
        members.start("m1")
        produce(kafka_broker, topic, np.minimum(rng.zipf(1.3, 2000), D - 1), 5000)
        _intake_caught_up(kafka_broker, topic, group)
        wait_for_total(kafka_broker, topics, 2 * N, 60, members)
        forced = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                "release",
                "--state-dir",
                str(tmp_path / "m1" / "state"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert forced.returncode == 0 or "holds no events" in forced.stderr, forced.stderr
        wait_for_total(kafka_broker, topics, 5000, 60, members)
    finally:
        members.stop_all()
        admin.close()
    check_exact(kafka_broker, topics, 5000, empty_skipped=True)


def test_reset_source_offsets_and_a_deleted_ledger_never_release_an_event_twice(
    kafka_broker, tmp_path
):
    """The group edition of "one event, one charge": the source group's offsets reset to the
    earliest record (what an operator's --reset-offsets does) re-reads the topic, but the
    intake's high-water marks keep every record from being repartitioned again; a ledger topic
    deleted while the group is stopped is refused at the next start, in one line, before
    anything is created."""
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
        _reset_source_offsets(admin, group, topic)
        members.start("m1")
        produce(kafka_broker, topic, np.minimum(rng.zipf(1.3, 1000), D - 1), 5000)
        wait_for_total(kafka_broker, topics, 6000, 120, members)
        time.sleep(3 * WINDOW_S + 2)  # windows after the last events: nothing more comes
        assert _released_total(kafka_broker, topics) == 6000, members.logs()
        members.stop_all()
        logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
        assert "are not counted again" in logs, logs[-3000:]
        check_exact(kafka_broker, topics, 6000)
        # the ledger topic deleted while the group is stopped: the next start refuses
        admin.delete_topics([topics.ledger])
        time.sleep(2)
        res = subprocess.run(
            member_cmd(kafka_broker, topic, group, "m1", tmp_path),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode != 0
        last = res.stderr.strip().splitlines()[-1]
        assert "ledger topic" in last and "deleted" in last and "Traceback" not in res.stderr
        assert topics.ledger not in set(admin.list_topics()), "a refused start created it"
        admin.close()
    finally:
        members.stop_all()


@pytest.mark.parametrize("exchange", ["items", "views"])
def test_a_deleted_intake_topic_and_reset_offsets_never_release_an_event_twice(
    kafka_broker, tmp_path, exchange
):
    """Issue 48's group case (measured 2,200 released of 1,200 produced): the group stopped, its
    ``<group>.panagg.intake`` topic deleted and its source offsets reset to the earliest
    record, then started again. The items exchange's intake marks are gone, so its start is
    refused in one line, creating nothing. A views group's members find no commit of theirs
    and go on after the positions its ledger released, so the records written since are
    released once and none twice."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    topics = GroupTopics(group)
    extra = ("--set", f"scale.exchange={exchange}", "--set", f"ledger.registry_topic=reg-{topic}")
    if exchange == "views":
        # count windows: once the 1,200 are released no window closes, so the released ranges
        # are known when the group stops (a window between its view and its release:
        # test_offsets_reset_between_a_view_and_its_release_count_no_record_twice)
        extra += ("--set", "window.kind=count", "--set", "window.size=300")
    members = Members(kafka_broker, topic, group, tmp_path, *extra)
    rng = np.random.default_rng()
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    try:
        members.start("m1")
        produce(kafka_broker, topic, np.minimum(rng.zipf(1.3, 1200), D - 1), 5000)
        wait_for_total(kafka_broker, topics, 1200, 120, members)
        members.stop_all()
        admin.delete_topics([topics.intake])
        time.sleep(2)
        assert topics.intake not in set(admin.list_topics())
        # (the views exchange's members read the source as <group>.panagg.count)
        _reset_source_offsets(
            admin, group if exchange == "items" else f"{group}.panagg.count", topic
        )
        produce(kafka_broker, topic, np.minimum(rng.zipf(1.3, 300), D - 1), 5000)
        if exchange == "items":
            res = subprocess.run(
                member_cmd(kafka_broker, topic, group, "m1", tmp_path, *extra),
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert res.returncode != 0
            last = res.stderr.strip().splitlines()[-1]
            assert "intake topic" in last and "deleted" in last, res.stderr[-3000:]
            assert "Traceback" not in res.stderr
            assert topics.intake not in set(admin.list_topics()), "a refused start created it"
        else:
            members.start("m1")
            wait_for_total(kafka_broker, topics, 1500, 120, members)
            time.sleep(3 * WINDOW_S + 4)  # windows over the re-read records: none comes
        released = _released_total(kafka_broker, topics)
    finally:
        members.stop_all()
        admin.close()
    logs = members.logs(last=100000)
    print(
        f"issue 48, {exchange} group, intake topic deleted and source offsets reset: "
        f"{released} released / 1500 produced (1,200 of them before)"
    )
    assert not crash_traces(logs), crash_traces(logs)[0]
    assert released <= 1500, f"{released} events released of 1,500 produced"
    if exchange == "items":
        assert released == 1200
    else:
        assert released == 1500 and "are not counted again" in logs, logs[-3000:]
        entries = [e for e in read_ledger(kafka_broker, topics).entries if e["kind"] == "release"]
        assert not [e for e in entries if e.get("withheld")]
        for part in range(PARTS):  # the released ranges tile each partition from 0
            spans = sorted(
                tuple(e["ranges"][f"{topic}:{part}"])
                for e in entries
                if f"{topic}:{part}" in e["ranges"]
            )
            assert spans[0][0] == 0 and all(b == a for (_, b), (a, _) in zip(spans, spans[1:])), (
                spans
            )


def _undecided_views(bootstrap, topics) -> dict[str, dict]:
    """The view headers the summaries topic holds now (the leader tombstones a window's views
    once it decided the window), by key."""
    c = KafkaConsumer(
        bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False
    )
    tp = TopicPartition(topics.summaries, 0)
    try:
        c.assign([tp])
        c.seek_to_beginning(tp)
        end = c.end_offsets([tp])[tp]
        latest: dict[str, bytes | None] = {}
        while c.position(tp) < end:
            for recs in c.poll(timeout_ms=500).values():
                for r in recs:
                    if "/c" not in r.key.decode():  # not a view's chunk
                        latest[r.key.decode()] = r.value
    finally:
        c.close()
    return {k: json.loads(v) for k, v in latest.items() if v is not None}


def test_offsets_reset_between_a_view_and_its_release_count_no_record_twice(kafka_broker, tmp_path):
    """A views group killed while its leader still had windows to release (their views in the
    summaries topic, the ledger not charged yet), then its source offsets reset without
    panagg's metadata. The member going on after the ledger's charges alone counted those
    windows' records again into a second view of the same window, and the leader withheld the
    window as viewed twice (issue 46, docs/chaos.md "Offsets reset"). It now goes on after the
    views already written as well: every record is released once, none withheld."""
    topic = make_topic(kafka_broker)
    group = f"g-{uuid.uuid4().hex[:8]}"
    topics = GroupTopics(group)
    extra = ("--set", "scale.exchange=views", "--set", f"ledger.registry_topic=reg-{topic}")
    # slow releases (many error-bar draws) so views wait at the leader
    slow = ("--set", "release.error_bar_reps=3000", "--set", "release.max_in_flight=50")
    members = Members(kafka_broker, topic, group, tmp_path, *extra, *slow)
    rng = np.random.default_rng()
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    try:
        members.start("m1")
        produce(kafka_broker, topic, np.minimum(rng.zipf(1.3, 2400), D - 1), 400)
        deadline = time.monotonic() + 120
        while True:
            charged = {
                int(e["window"])
                for e in read_ledger(kafka_broker, topics).entries
                if e["kind"] == "release"
            }
            waiting = [
                h
                for h in _undecided_views(kafka_broker, topics).values()
                if h.get("format") and int(h["window"]) not in charged and h.get("n")
            ]
            if waiting:
                members.procs["m1"].send_signal(signal.SIGKILL)
                members.procs["m1"].wait(30)
                break
            assert members.procs["m1"].poll() is None, members.logs()
            assert time.monotonic() < deadline, "no view ever waited for its release"
            time.sleep(0.1)
        charged = {
            int(e["window"])
            for e in read_ledger(kafka_broker, topics).entries
            if e["kind"] == "release"
        }
        pending = sorted(
            {
                int(h["window"])
                for h in _undecided_views(kafka_broker, topics).values()
                if h.get("format") and int(h["window"]) not in charged
            }
        )
        assert pending, "the views were released before the kill: the case did not happen"
        _reset_source_offsets(admin, f"{group}.panagg.count", topic)
        produce(kafka_broker, topic, np.minimum(rng.zipf(1.3, 300), D - 1), 5000)
        members.extra = extra  # releases at their usual speed again
        members.start("m1")
        wait_for_total(kafka_broker, topics, 2700, 180, members)
        time.sleep(3 * WINDOW_S + 4)  # windows over the re-read records: none comes
        released = _released_total(kafka_broker, topics)
        entries = [e for e in read_ledger(kafka_broker, topics).entries if e["kind"] == "release"]
    finally:
        members.stop_all()
        admin.close()
    logs = members.logs(last=100000)
    print(
        f"views group killed with window(s) {pending} between view and release, offsets "
        f"reset: {released} released / 2700 produced"
    )
    assert not crash_traces(logs), crash_traces(logs)[0]
    assert not [e.get("withheld") for e in entries if e.get("withheld")], [
        e.get("withheld") for e in entries if e.get("withheld")
    ]
    assert released == 2700
    for part in range(PARTS):  # the released ranges tile each partition from 0
        spans = sorted(
            tuple(e["ranges"][f"{topic}:{part}"])
            for e in entries
            if f"{topic}:{part}" in e["ranges"]
        )
        assert spans[0][0] == 0 and all(b == a for (_, b), (a, _) in zip(spans, spans[1:])), spans


def test_a_second_items_group_on_released_records_withholds_them_naming_the_first(
    kafka_broker, tmp_path
):
    """Issue 48 for the items exchange: its ledger counts repartition positions, so its charges
    were not in the budget registry and a second group with a new name over the same records
    released them again. Now each window's source positions ride from the intake to the
    leader, which checks and writes them in the registry: the second group's leader finds the
    first group's charges and withholds every window over them, naming the first group."""
    entries, again, logs, topic = second_group_on_released(kafka_broker, tmp_path, 2, key="sources")
    assert again == 0, f"the second group released {again} events of 3,000 again"
    over = [e for e in entries if e.get("sources")]
    assert over and all(e.get("withheld") for e in over), entries
    assert read_all(kafka_broker, f"reg-{topic}", [0])[0], "no charge in the registry"
    assert f"released by group a-{topic}" in logs, logs[-3000:]
    assert not crash_traces(logs), crash_traces(logs)[0]


def _deleted_while_down(bootstrap, topic, group, members, name, admin, n=2000):
    """Kill -9 ``name`` (the intake of every source partition), write ``n`` records, then
    delete partition 1's (DeleteRecords: what the source topic's retention does, sooner)
    before the intake read them. Returns the intake's committed offset there and the first
    offset left."""
    tp = TopicPartition(topic, 1)
    members.kill(name)
    produce(bootstrap, topic, np.arange(n) % D, 2000)
    c = KafkaConsumer(bootstrap_servers=bootstrap)
    low = c.end_offsets([tp])[tp]
    c.close()
    committed = admin.list_group_offsets(group)[group][tp].offset
    admin.delete_records({tp: low})
    assert committed < low
    return committed, low


def _withheld_then_released(bootstrap, topics, members, name, committed, low, deadline):
    """The windows withheld naming source partition 1's offsets ``committed`` to ``low`` as
    deleted, once a window after them is released (None before that)."""
    entries = read_ledger(bootstrap, topics).entries
    named = sorted(
        e["window"]
        for e in entries
        if e["kind"] == "release"
        and f"partition 1 from offset {committed} to {low} were deleted"
        in (e.get("withheld") or "")
    )
    if named and any(
        e["kind"] == "release" and not e.get("withheld") and e["window"] > named[-1]
        for e in entries
    ):
        return named, entries
    assert members.procs[name].poll() is None, members.logs()
    assert time.monotonic() < deadline, (
        [e.get("withheld") for e in entries if e.get("withheld")],
        members.logs(),
    )
    return None, entries


@pytest.mark.parametrize("kind", ["time", "count"])
def test_source_records_deleted_before_the_intake_read_them_withhold_their_window(
    kafka_broker, tmp_path, kind
):
    """Issue 46, the items exchange: the intake down while records of a source partition are
    deleted (the topic's retention, DeleteRecords here) before it read them. The window that
    would have counted them is withheld with a ledger entry naming the deleted source offsets,
    none is released short of them without that entry, and later windows are released. (Before,
    the intake's consumer went on from the first record left and the window was released with
    fewer events than the stream had, no flag.)"""
    topic = make_topic(kafka_broker, 2)
    group = f"g-{topic}"
    topics = GroupTopics(group)
    extra = ("--set", "window.kind=count", "--set", "window.size=500") if kind == "count" else ()
    members = Members(kafka_broker, topic, group, tmp_path, *extra)
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    try:
        members.start("i1")
        produce(kafka_broker, topic, np.arange(2000) % D, 2000)
        wait_for_total(kafka_broker, topics, 2000, 120, members)
        committed, low = _deleted_while_down(kafka_broker, topic, group, members, "i1", admin)
        members.start("i1")
        deadline = time.monotonic() + 180
        named = None
        while named is None:  # a window released after the one the deleted records fell in
            produce(kafka_broker, topic, np.arange(1000) % D, 2000)
            named, _ = _withheld_then_released(
                kafka_broker, topics, members, "i1", committed, low, deadline
            )
    finally:
        members.stop_all()
        admin.close()
    assert len(named) == 1, named  # named once, not again at each restart or poll
    logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
    assert f"from offset {committed} to {low} were deleted" in logs
    assert not crash_traces(logs), crash_traces(logs)[0]


def test_event_time_source_records_deleted_before_the_intake_read_them_withhold_their_windows(
    kafka_broker, tmp_path
):
    """The event-time edition of the test above: the deleted records' timestamps went with
    them, so every window not passed on their partition, up to the window of now +
    window.max_future_skew_s (later stamps are rejected), may have held one. Each of those is
    withheld naming the deleted offsets, none is released, and later windows are released."""
    topic = make_topic(kafka_broker, 2)
    group = f"g-{topic}"
    topics = GroupTopics(group)
    size_s, skew_s = 2, 4
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "window.kind=event_time",
        "--set",
        f"window.size={size_s}",
        "--set",
        "window.allowed_lateness_s=1",
        "--set",
        f"window.max_future_skew_s={skew_s}",
        "--set",
        "window.idle_partition_timeout_s=3",
    )
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    try:
        members.start("i1")
        deadline = time.monotonic() + 120
        while _released_total(kafka_broker, topics) < 1000:  # windows close as event time
            produce(kafka_broker, topic, np.arange(500) % D, 500)  # moves on
            assert time.monotonic() < deadline, members.logs()
        killed_ms = int(time.time() * 1000)
        committed, low = _deleted_while_down(kafka_broker, topic, group, members, "i1", admin)
        started_ms = int(time.time() * 1000)
        members.start("i1")
        deadline = time.monotonic() + 180
        tainted = None
        while tainted is None:  # a window released after the ones the deleted records may hold
            produce(kafka_broker, topic, np.arange(200) % D, 400)
            tainted, entries = _withheld_then_released(
                kafka_broker, topics, members, "i1", committed, low, deadline
            )
    finally:
        members.stop_all()
        admin.close()
    size_ms = size_s * 1000
    # from a window open when the intake was killed, to the skew's end past its restart
    assert tainted[0] <= killed_ms // size_ms, (tainted, killed_ms // size_ms)
    assert tainted[-1] >= (started_ms + skew_s * 1000) // size_ms, (tainted, started_ms)
    assert tainted == list(range(tainted[0], tainted[-1] + 1)), tainted
    released = [e["window"] for e in entries if e["kind"] == "release" and not e.get("withheld")]
    assert not [w for w in released if tainted[0] <= w <= tainted[-1]], (released, tainted)
    assert len(released) == len(set(released))
    # each withheld entry names the positions it withholds: its refused parts' ranges too
    # (before, only the charged parts': every part refused, it named none, and the chaos
    # checker found the windows' events outside any range)
    for e in entries:
        if e["kind"] == "release" and e.get("withheld") and e["window"] in tainted:
            named = dict(e.get("ranges") or {}, **(e.get("withheld_ranges") or {}))
            assert named and all(k.startswith(f"{topics.repartition}:") for k in named), e
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log")))


def test_event_time_group_equals_one_process_across_a_kill(kafka_broker, tmp_path):
    """Event-time windows with allowed lateness in a group of 2 members on an unkeyed
    4-partition topic, timestamps out of order within the lateness and some late records, a
    member killed -9 mid-stream and restarted: every window released once, its n and late count
    those of a one-process run over the same records (and of the definitions' reference), each
    repartitioned event in exactly one release, no position charged more than eps."""
    from tests.helpers.event_time import SIZE

    assert SIZE == ET_SIZE
    parts = 4
    topic, group, topics, t0, stream = event_setup(kafka_broker, parts, windows := 12)
    extra = (
        "--set",
        "window.kind=event_time",
        "--set",
        f"window.size={ET_SIZE}",
        "--set",
        f"window.allowed_lateness_s={ET_LATENESS}",
    )
    members = Members(kafka_broker, topic, group, tmp_path, *extra)
    flush_at = (t0 + (windows + 10) * ET_SIZE) * 1000
    try:
        # the group is made on an empty topic; the records, two hours old, come after it (a
        # backfill): its windows open at the earliest first record, as one process's do
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        victim = feed_across_a_kill(
            kafka_broker, topic, topics, members, stream, ("m1", "m2"), parts, flush_at
        )
        expected = reference_windows(kafka_broker, topic, parts, flush_at)
        total = sum(ev for ev, _ in expected.values())
        assert total == len(stream)
        wait_for_total(kafka_broker, topics, total, 240, members)
    finally:
        members.stop_all()
    one_process(kafka_broker, topic, tmp_path, group, extra)
    one_docs = [json.loads(f.read_text()) for f in (tmp_path / "one" / "releases").glob("*.json")]
    try:
        docs = releases(kafka_broker, topics)
        assert len({d["window"] for d in docs}) == len(docs), "a window was released twice"
        got = by_event_window(docs)
        assert got == by_event_window(one_docs) == expected
        assert sum(late for _, late in got.values()) > 0, "the stream had no late record"
        # each repartitioned event once: the events in the repartition topic are the releases'
        rp = read_all(kafka_broker, topics.repartition)
        assert sum(len(v) // 4 for recs in rp.values() for _, _, v in recs if v) == total + parts
        released_once(kafka_broker, topics, docs)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{members.logs()}") from None
    logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
    assert not crash_traces(logs), members.logs()
    print(
        f"\n{len(docs)} event-time windows, {sum(l for _, l in got.values())} late records, "
        f"killed {victim}"
    )


def test_sum_rollups_of_event_time_windows_in_a_group(kafka_broker, tmp_path):
    """window.rollups = 3x as sums over a group's event-time windows, a member killed -9
    mid-stream: every event-time window released once, each rollup the sum of its released
    windows' n at 0 eps; windows no event fell in (skipped, never ledgered) are in the sums as
    noise layers only and named as such, never as base windows."""
    from aggregator.service.rollup import ROLLUP_ARGUMENT

    parts = 4
    topic, group, topics, t0, stream = event_setup(kafka_broker, parts, windows := 9)
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "window.kind=event_time",
        "--set",
        f"window.size={ET_SIZE}",
        "--set",
        f"window.allowed_lateness_s={ET_LATENESS}",
        "--set",
        "window.rollups=3x",
        "--set",
        "window.rollup_design=sum",
    )
    flush_at = (t0 + (windows + 10) * ET_SIZE) * 1000
    try:
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        half = len(stream) // 2
        produce_stamped(kafka_broker, topic, stream[:half])
        members.kill("m2")
        members.start("m2")
        produce_stamped(kafka_broker, topic, stream[half:])
        for p in range(parts):  # every partition passes the last window
            produce_stamped(kafka_broker, topic, [(flush_at, 0)], partition=p)
        wait_for_total(kafka_broker, topics, len(stream), 240, members)
        last = max(d["window"] for d in releases(kafka_broker, topics))
        deadline = time.monotonic() + 90
        while not any(
            d["rollup"]["index"] == last // 3 for d in releases(kafka_broker, topics, rollups=True)
        ):
            assert time.monotonic() < deadline, f"no last rollup\n{members.logs()}"
            time.sleep(1)
    finally:
        members.stop_all()
    try:
        base = {d["window"]: d for d in releases(kafka_broker, topics)}
        rolls = releases(kafka_broker, topics, rollups=True)
        names = [d["window"] for d in rolls]
        assert len(names) == len(set(names)), "a rollup was released twice"
        covered = []
        for d in rolls:
            r = d["rollup"]
            assert set(r["windows"]) <= set(base), r  # only released windows are bases
            quiet = r.get("noise_only_windows", [])
            assert not set(quiet) & set(base)
            assert d["n"] == sum(base[w]["n"] for w in r["windows"])
            assert d["layers"] == 2 * (len(r["windows"]) + len(quiet))
            assert r["epsilon_spent"] == 0.0 and r["argument"] == ROLLUP_ARGUMENT
            covered += r["windows"]
        assert sorted(covered) == sorted(base), "a released window is in no rollup, or two"
        assert sum(d["n"] for d in rolls) == len(stream)
        ledger = read_ledger(kafka_broker, topics)
        entries = [e for e in ledger.entries if e["kind"] in ("rollup", "refused-rollup")]
        assert sorted(e["window"] for e in entries) == sorted(names)
        assert all(e["kind"] == "rollup" and e["epsilon_spent"] == 0.0 for e in entries)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{members.logs()}") from None
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log"))), members.logs()
    print(
        f"\n{len(base)} event-time windows, {len(rolls)} rollups, noise-only windows "
        f"{sorted(w for d in rolls for w in d['rollup'].get('noise_only_windows', []))}"
    )


def test_event_time_group_an_idle_partition_stops_holding_windows_and_its_late_record_counts(
    kafka_broker, tmp_path
):
    """window.idle_partition_timeout_s in a group: a source partition that got a few records and
    then nothing stops holding the watermark once idle, so the windows close; a record it gets
    afterwards, stamped in a window already closed, arrives after that window's close marker:
    late, counted in the window after the last closed one, as one process counts it in its open
    window. Every event is released once."""
    from tests.helpers.event_time import SIZE, reference

    topic = make_topic(kafka_broker, 3)
    group = f"g-{uuid.uuid4().hex[:8]}"
    topics = GroupTopics(group)
    t0 = (int(time.time()) - 7200) // SIZE * SIZE
    rng = np.random.default_rng()
    busy = [
        (int((t0 + t) * 1000), int(i))
        for t, i in zip(np.sort(rng.uniform(0, 6 * SIZE, 600)), rng.integers(0, D, 600))
    ]
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "window.kind=event_time",
        "--set",
        f"window.size={SIZE}",
        "--set",
        "window.allowed_lateness_s=2",
        "--set",
        "window.idle_partition_timeout_s=2",
    )
    try:
        produce_stamped(kafka_broker, topic, [(t0 * 1000 + 500, 1)], partition=2)
        for p in (0, 1):
            produce_stamped(kafka_broker, topic, busy[p::2], partition=p)
        members.start("m1")
        deadline = time.monotonic() + 120
        while not any(
            d["window_info"]["event_start_unix"] >= t0 + 3 * SIZE
            for d in releases(kafka_broker, topics)
        ):
            assert time.monotonic() < deadline, f"windows never closed\n{members.logs()}"
            time.sleep(1)
        # partition 2 wakes with a record of window 1, closed by now: late
        produce_stamped(kafka_broker, topic, [((t0 + SIZE + 1) * 1000, 2)], partition=2)
        for p in (0, 1):  # the busy partitions move on, so the late record's window closes
            produce_stamped(kafka_broker, topic, [((t0 + 20 * SIZE) * 1000, 3)], partition=p)
        wait_for_total(kafka_broker, topics, 602, 120, members)
        time.sleep(2)
    finally:
        members.stop_all()
    docs = releases(kafka_broker, topics)
    got = by_event_window(docs)
    assert sum(n for n, _ in got.values()) == 602
    assert sum(late for _, late in got.values()) == 1
    # the busy partitions' records in their windows, as the definitions say
    parts = {
        f"{topic}:{p}": [(ts / 1000, (p, k)) for k, (ts, _) in enumerate(busy[p::2])]
        for p in (0, 1)
    }
    parts[f"{topic}:2"] = [(t0 + 0.5, (2, 0))]
    _, ref = reference(parts, 2, "next")
    expected = {k * SIZE: ev for k, (ev, _) in ref.items()}
    late_in = [w for w, (_, late) in got.items() if late]
    assert {w: n - (1 if w in late_in else 0) for w, (n, _) in got.items()} == expected
    assert late_in[0] > t0 + SIZE
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log")))


def test_event_time_group_with_two_aggregations_equals_one_process(kafka_broker, tmp_path):
    """Two aggregations (accounts direct, IPs hashed) with event-time windows in a group of 2
    members: each aggregation's windows, n and late counts are those of one process with the
    same two aggregations over the same records."""
    from tests.helpers.event_time import SIZE

    topic = make_topic(kafka_broker, 3)
    group = f"g-{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng()
    t0 = (int(time.time()) - 7200) // SIZE * SIZE
    stream = event_stream(rng, 6, 400, t0)
    pack = lambda i: {"user": i, "ip": f"10.0.{i // 256}.{i % 256}"}  # noqa: E731
    extra = (
        "--set",
        "window.kind=event_time",
        "--set",
        f"window.size={SIZE}",
        "--set",
        f"window.allowed_lateness_s={ET_LATENESS}",
        "--set",
        "ledger.budget_per_event=2",
        "--set",
        "aggregations.user.item.field=user",
        "--set",
        "aggregations.ip.item.field=ip",
        "--set",
        "aggregations.ip.state.mode=hashed",
        "--set",
        "aggregations.ip.state.expected_n=5000",
    )
    members = Members(kafka_broker, topic, group, tmp_path, *extra)
    flush_at = (t0 + 20 * SIZE) * 1000
    try:
        produce_stamped(kafka_broker, topic, stream[:100], pack=pack)
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        produce_stamped(kafka_broker, topic, stream[100:], pack=pack)
        for p in range(3):
            produce_stamped(kafka_broker, topic, [(flush_at, 0)], partition=p, pack=pack)
        for name in ("user", "ip"):
            wait_for_total(kafka_broker, GroupTopics(group, name), len(stream), 180, members)
    finally:
        members.stop_all()
    one_process(kafka_broker, topic, tmp_path, group, extra)
    for name in ("user", "ip"):
        docs = releases(kafka_broker, GroupTopics(group, name))
        one_docs = [
            json.loads(f.read_text()) for f in (tmp_path / "one" / "releases" / name).glob("*.json")
        ]
        got = by_event_window(docs)
        assert got == by_event_window(one_docs), f"{name}\n{members.logs()}"
        assert sum(n for n, _ in got.values()) == len(stream)
        assert all(d["aggregation"]["name"] == name for d in docs)


def test_event_time_group_of_three_killed_again_and_again_releases_the_reference(
    kafka_broker, tmp_path
):
    """3 members, event-time windows with lateness, 10,000 records over 20 windows fed for about
    20 s while a random member is killed -9 and restarted every 0.5-4.5 s: every window released
    once with the n and late count the definitions give over the topic."""
    parts = 4
    topic, group, topics, t0, stream = event_setup(kafka_broker, parts, windows := 20)
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "window.kind=event_time",
        "--set",
        f"window.size={ET_SIZE}",
        "--set",
        f"window.allowed_lateness_s={ET_LATENESS}",
    )
    flush_at = (t0 + (windows + 10) * ET_SIZE) * 1000
    names = ["m1", "m2", "m3"]
    kills = 0
    try:
        produce_stamped(kafka_broker, topic, stream[:200])
        members.start("m1")
        time.sleep(4)
        members.start("m2")
        members.start("m3")
        rest = stream[200:]
        feeder = threading.Thread(
            target=lambda: [
                (produce_stamped(kafka_broker, topic, rest[i : i + 100]), time.sleep(0.2))
                for i in range(0, len(rest), 100)
            ]
        )
        feeder.start()
        chaos = random.Random()
        while feeder.is_alive():
            time.sleep(chaos.uniform(0.5, 2.5))
            members.kill_and_restart_one(chaos, names)
            kills += 1
        feeder.join()
        for p in range(parts):
            produce_stamped(kafka_broker, topic, [(flush_at, 0)], partition=p)
        expected = reference_windows(kafka_broker, topic, parts, flush_at)
        wait_for_total(kafka_broker, topics, len(stream), 300, members)
        time.sleep(3)  # nothing more may come
    finally:
        members.stop_all()
    docs = releases(kafka_broker, topics)
    try:
        assert len({d["window"] for d in docs}) == len(docs), "a window was released twice"
        assert by_event_window(docs) == expected
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{members.logs()}") from None
    assert not crash_traces("".join(f.read_text() for f in tmp_path.glob("*.log")))
    print(f"\n{len(docs)} event-time windows, {kills} kills, {members.runs} member runs")


def test_a_member_stopped_by_sigterm_says_what_a_restart_finds(kafka_broker, tmp_path):
    """The one-process service ends with "stopped (...): window N open ..."; a member said
    nothing (issue 46). Now it names the repartition partitions it counted and their open
    windows, read before leaving the group gives them away."""
    topic, group = make_topic(kafka_broker, partitions=2), f"g-{uuid.uuid4().hex[:8]}"
    produce(kafka_broker, topic, list(range(200)), rate=10_000)
    # windows far longer than the test: the open window holds the events
    members = Members(kafka_broker, topic, group, tmp_path, "--set", "window.size=3600")
    members.start("m1")
    log = tmp_path / "m1-1.log"
    try:
        deadline = time.monotonic() + 120
        while "leading group" not in log.read_text() and time.monotonic() < deadline:
            assert members.procs["m1"].poll() is None, members.logs()
            time.sleep(0.5)
        assert "leading group" in log.read_text(), members.logs()
    finally:
        members.stop_all()
    assert members.procs["m1"].returncode == 0, members.logs()
    stops = [
        ln.split("panagg.group: ", 1)[1]
        for ln in log.read_text().splitlines()
        if "panagg.group: stopped (" in ln
    ]
    assert len(stops) == 1, members.logs()
    assert re.fullmatch(
        r"stopped \(stop requested\): member m1, partition 0 window \d+ with "
        r"[\d,]+ events from offset 0; partition 1 window \d+ with [\d,]+ events "
        r"from offset 0; an open window is replayed from its start by the member "
        r"counting its partition next",
        stops[0],
    ), stops[0]
