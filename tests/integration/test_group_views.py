"""A group with the default views exchange on a real broker: what its topics hold, read back as
an intruder would, and that every event is released once.

Each member counts its own source partitions into its own pan-private state and writes only
views (its state plus a fresh DLap layer) to the summaries topic (aggregator/service/group/
views.py). Read back: no repartition topic exists, no record of any internal topic is a
per-event record, and the views of all windows summed minus the exact counts of every produced
event is noise of exactly the layers the views claim (a view written without its layer, or a
state without its own, shows as a variance ratio near 0.5 or lower: the negative control).
"""

from __future__ import annotations

import json
import threading
import time
import zlib

import numpy as np
import pytest

from aggregator.noise import p_from_epsilon
from aggregator.service.group.topics import GroupTopics

from tests.helpers.group import (
    Members,
    group_status,
    counting_owner,
    last_saying,
    make_topic,
    produce,
    read_all,
    read_ledger,
    releases,
    second_group_on_released,
    tombstone_snapshots,
    wait_for_total,
)

D = 1000
PARTS = 4

#: what a view's header may carry: no counter, no item, no per-slice count
HEADER_KEYS = {
    "format",
    "version",
    "window",
    "partition",
    "covers",
    "partitions",
    "mode",
    "size",
    "epsilon",
    "neighbor",
    "p",
    "model",
    "window_info",
    "uid",
    "layers",
    "n",
    "chunks",
    "dtype",
    "ranges",
    "member",
    "refused",
    "charge",
}


def _wait_counting(members, tmp_path, timeout_s=90):
    """Until both members count partitions and one leads (their logs say so)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logs = {f.name.split("-")[0]: f.read_text() for f in tmp_path.glob("v*.log")}
        if (
            len(logs) == 2
            and all("counting partition" in t for t in logs.values())
            and any("leading" in t for t in logs.values())
        ):
            return
        time.sleep(0.5)
    pytest.fail(f"the members did not start counting\n{members.logs()}")


def _check_ranges_tile(bootstrap, topics, topic) -> None:
    """Every event once: no window withheld, each release's n the events of its ledgered
    source ranges (one a record), and the ranges tile each source partition from offset 0."""
    entries = [e for e in read_ledger(bootstrap, topics).entries if e["kind"] == "release"]
    assert not any(e.get("withheld") for e in entries)
    spans: dict[str, list] = {}
    for e in entries:
        assert e["n"] == sum(b - a for a, b in e["ranges"].values())
        for part, ab in e["ranges"].items():
            spans.setdefault(part, []).append(tuple(ab))
    assert sorted(spans) == [f"{topic}:{p}" for p in range(PARTS)]
    for part, ss in spans.items():
        ss.sort()
        assert ss[0][0] == 0 and all(b0 == a1 for (_, b0), (a1, _) in zip(ss, ss[1:])), part


def _dlap_variance(p: float) -> float:
    return 2 * p / (1 - p) ** 2


def test_a_views_group_writes_no_event_to_any_topic_and_releases_each_once(kafka_broker, tmp_path):
    topic = make_topic(kafka_broker, PARTS)
    group = f"g-{topic}"
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "scale.exchange=views",
        "--set",
        f"state.domain_size={D}",
    )
    rng = np.random.default_rng(7)
    # a skewed stream: a few heavy items, many light ones
    items = np.concatenate([rng.integers(0, 20, 3000), rng.integers(0, D, 5000)])
    rng.shuffle(items)
    try:
        for name in ("v1", "v2"):
            members.start(name)
        _wait_counting(members, tmp_path)
        # several windows of 2 s, each member with its own partitions in each
        produce(kafka_broker, topic, items, rate=1000)
        topics = GroupTopics(group)
        wait_for_total(kafka_broker, topics, len(items), 120, members)
    finally:
        members.stop_all()
    logs = members.logs(last=100000)
    assert "scale.exchange = views" in logs and "Traceback" not in logs, logs[-3000:]

    # every event once: the ledger's source ranges tile each partition, n = events in them
    docs = releases(kafka_broker, topics)
    windows = [d["window"] for d in docs]
    assert len(windows) == len(set(windows))
    assert sum(d["n"] for d in docs) == len(items)
    _check_ranges_tile(kafka_broker, topics, topic)
    assert all(d["scale_out"]["exchange"] == "views" for d in docs)

    # what an intruder reads in the internal topics
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    internal = sorted(t for t in admin.list_topics() if t.startswith(f"{group}.panagg"))
    admin.close()
    assert topics.repartition not in internal
    headers, chunks = [], {}
    for t in internal:
        for recs in read_all(kafka_broker, t).values():
            for _, key, value in recs:
                if value is None:
                    continue
                if t == topics.summaries and b"/c" in key:
                    chunks[key.decode()] = value
                    continue
                doc = json.loads(value)  # every other record is a JSON document
                if t == topics.summaries:
                    assert set(doc) <= HEADER_KEYS, set(doc) - HEADER_KEYS
                    headers.append((key.decode(), doc))
    views = [(k, h) for k, h in headers if h.get("chunks")]
    assert views and all(h["layers"] == 2 for _, h in views)
    total = np.zeros(D, dtype=np.int64)
    for key, h in views:
        parts = [
            np.frombuffer(zlib.decompress(chunks.pop(f"{key}/c{k}")), dtype=h["dtype"])
            for k in range(h["chunks"])
        ]
        total += np.concatenate(parts).astype(np.int64)
    assert not chunks, "a chunk no header names"
    exact = np.bincount(items, minlength=D)
    residual = total - exact
    layers = sum(h["layers"] for _, h in views)
    ratio = residual.var() / (layers * _dlap_variance(p_from_epsilon(1.0, 2)))
    # the noise each view claims, all of it: without one layer per view it would be ~0.5
    # several windows, each member's own view in them
    assert len({h["member"] for _, h in views}) == 2 and len(views) >= 4, views
    assert 0.75 < ratio < 1.3, (ratio, layers)
    # and nothing exact: the sum is far from the counts on most counters
    assert np.mean(residual == 0) < 0.3


def test_a_second_group_on_released_records_withholds_them_naming_the_first(kafka_broker, tmp_path):
    """Two views groups with different names over one topic (the audit's 3,400 of 1,200): the
    second group's leader finds the first group's charges in the budget registry and withholds
    every window over them, in one line naming the first group."""
    entries, again, logs, topic = second_group_on_released(
        kafka_broker, tmp_path, PARTS, "--set", "scale.exchange=views"
    )
    assert all(e.get("withheld") for e in entries if sum(b - a for a, b in e["ranges"].values())), (
        entries
    )
    assert again == 0
    assert f"released by group a-{topic}" in logs, logs[-3000:]


def test_a_forced_release_of_a_views_group_closes_the_open_window_at_every_member(
    kafka_broker, tmp_path
):
    """panagg release on a member's directory: the leader writes one close record to the
    intake topic, both members close the open window at once (an hour-long one), and the
    release holds every event produced."""
    import subprocess
    import sys

    topic = make_topic(kafka_broker, PARTS)
    group = f"g-{topic}"
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "scale.exchange=views",
        "--set",
        "window.size=3600",
    )
    try:
        for name in ("v1", "v2"):
            members.start(name)
        _wait_counting(members, tmp_path)
        produce(kafka_broker, topic, np.arange(900) % D, rate=3000)
        time.sleep(3)  # both members have counted them (no window ends for an hour)
        forced = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                "release",
                "--state-dir",
                str(tmp_path / "v1" / "state"),
            ],
            capture_output=True,
            text=True,
            timeout=200,
        )
        assert forced.returncode == 0, forced.stderr + members.logs()
        wait_for_total(kafka_broker, GroupTopics(group), 900, 60, members)
    finally:
        members.stop_all()
    docs = releases(kafka_broker, GroupTopics(group))
    assert [d["n"] for d in docs] == [900], docs
    assert docs[0]["exchange"]["views"] >= 1


def test_a_views_group_cuts_count_windows_at_the_groups_total_and_releases_each_once(
    kafka_broker, tmp_path
):
    """window.kind = count with the views exchange: each member cuts its own partitions' window
    once the group's reported total reaches the window's goal (count_views.py). Every event is
    released once (the ledger's source ranges tile every partition, each window's n is the
    events of its ranges), the windows are consecutive, and the group took at least N events
    per window: the first K windows hold at least K x N (a member cutting at its own total
    alone would release windows of about 2 N here). A forced release then closes the rest."""
    import subprocess
    import sys

    N = 2000
    topic = make_topic(kafka_broker, PARTS)
    group = f"g-{topic}"
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "scale.exchange=views",
        "--set",
        f"state.domain_size={D}",
        "--set",
        "window.kind=count",
        "--set",
        f"window.size={N}",
    )
    items = np.random.default_rng(11).integers(0, D, 9 * N + 700)
    topics = GroupTopics(group)
    try:
        for name in ("v1", "v2"):
            members.start(name)
        _wait_counting(members, tmp_path)
        produce(kafka_broker, topic, items, rate=3000)
        wait_for_total(kafka_broker, topics, 7 * N, 120, members)
        # what an operator sees of the open window: the group's total from the members'
        # reports, once they have counted every event
        deadline = time.monotonic() + 60
        while True:
            status = group_status(kafka_broker, group, topic)
            if f"the group has counted {len(items):,} events" in status:
                break
            assert time.monotonic() < deadline, status
            time.sleep(1)
        forced = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                "release",
                "--state-dir",
                str(tmp_path / "v1" / "state"),
            ],
            capture_output=True,
            text=True,
            timeout=200,
        )
        assert forced.returncode == 0, forced.stderr + members.logs()
        wait_for_total(kafka_broker, topics, len(items), 120, members)
    finally:
        members.stop_all()
    logs = members.logs(last=100000)
    assert "count windows of 2,000 events of the group" in logs and "Traceback" not in logs, logs[
        -3000:
    ]
    docs = sorted(releases(kafka_broker, topics), key=lambda d: d["window"])
    sizes = [d["n"] for d in docs]
    print(f"\nwindow sizes (N = {N}): {sizes}")
    assert sum(sizes) == len(items)
    windows = [d["window"] for d in docs]
    assert windows == list(range(windows[0], windows[0] + len(windows))), windows
    assert all(d["window_info"]["kind"] == "count" for d in docs)
    # every window before the forced one closed at the group's total: the first K windows hold
    # at least K x N (goals are multiples of N), and a window is N plus what was in flight at
    # its cut: the median one well under 2 N (members cutting at their own totals alone
    # release windows of about 2 N here and fail this; one window past 3 N under load was seen)
    for k in range(1, len(sizes)):
        assert sum(sizes[:k]) >= k * N, (k, sizes)
    assert np.median(sizes[:-1]) < 1.5 * N, sizes
    assert len(sizes) >= 5, sizes
    _check_ranges_tile(kafka_broker, topics, topic)


def test_sum_rollups_of_a_views_group_add_up_the_released_views_across_a_leader_kill(
    kafka_broker, tmp_path
):
    """window.rollups = 3x (rollup_design = sum) with the views exchange: the leader adds each
    released window's summed views to its rollups' running sums in the window's transaction
    (view_rollups.py). The leader is killed -9 mid-stream and restarted: each rollup is
    released once at 0 eps, its n is the sum of its base windows' n, its layers theirs, every
    event is in one rollup, and each rollup's last running sum holds exactly the counters of
    the views of its base windows (a window added twice, or a re-drawn layer, would not add
    up)."""
    from aggregator.service.rollup import ROLLUP_ARGUMENT
    from aggregator.service.group.view_format import decode_view

    topic = make_topic(kafka_broker, PARTS)
    group = f"g-{topic}"
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "scale.exchange=views",
        "--set",
        f"state.domain_size={D}",
        "--set",
        "window.kind=time",
        "--set",
        "window.size=2",
        "--set",
        "window.rollups=3x",
        "--set",
        "window.rollup_design=sum",
    )
    topics = GroupTopics(group)
    items = np.random.default_rng(5).integers(0, D, 24_000)
    try:
        for name in ("v1", "v2"):
            members.start(name)
        _wait_counting(members, tmp_path)
        feed = threading.Thread(target=produce, args=(kafka_broker, topic, items, 2000))
        feed.start()
        # the leader is killed just after it released the first window of a rollup: the
        # rollup's other windows are added by the next leader, to the sum read back
        deadline = time.monotonic() + 60
        while not any(d["window"] % 3 == 0 and d["n"] for d in releases(kafka_broker, topics)):
            assert time.monotonic() < deadline, members.logs()
            time.sleep(0.2)
        victim = last_saying(tmp_path, "v*.log", "leading group", "leading aggregation")
        members.kill(victim)
        members.start(victim)
        feed.join()
        wait_for_total(kafka_broker, topics, len(items), 180, members)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # the rollup of the last window with events
            base = releases(kafka_broker, topics)
            last = max(d["window"] for d in base if d["n"])
            if any(
                d["rollup"]["index"] == last // 3
                for d in releases(kafka_broker, topics, rollups=True)
            ):
                break
            time.sleep(1)
    finally:
        members.stop_all()
    logs = members.logs(last=100000)
    assert "Traceback" not in logs, logs[-3000:]
    base = {d["window"]: d for d in releases(kafka_broker, topics)}
    assert sum(d["n"] for d in base.values()) == len(items)
    rolls = releases(kafka_broker, topics, rollups=True)
    names = [d["window"] for d in rolls]
    assert rolls and len(names) == len(set(names)), names
    for d in rolls:
        r = d["rollup"]
        assert r["windows"] == [
            w for w in range(3 * r["index"], 3 * r["index"] + 3) if w in base
        ], (r, sorted(base))
        assert d["n"] == sum(base[w]["n"] for w in r["windows"])
        # (a window no member counted an event in adds no layer; a rollup of such windows
        # only is released from two layers of its own, as such a window is)
        layers = sum(base[w]["layers"] for w in r["windows"] if base[w]["n"])
        assert r["layers"] == d["layers"] == (layers or 2)
        assert r["epsilon_spent"] == 0.0 and r["argument"] == ROLLUP_ARGUMENT
        assert d["window_info"]["kind"] == "rollup" and d["window_info"]["size"] == 6
    assert sum(d["n"] for d in rolls) == len(items), "an event is in no rollup, or in two"
    entries = [e for e in read_ledger(kafka_broker, topics).entries if e["kind"] == "rollup"]
    assert sorted(e["window"] for e in entries) == sorted(names)
    for e in entries:
        doc = next(d for d in rolls if d["window"] == e["window"])
        assert e["epsilon_spent"] == 0.0 and e["n"] == doc["n"]
        assert [b["window"] for b in e["base_windows"]] == doc["rollup"]["windows"]
    # the running sums, read back (tombstoned, not compacted yet): each rollup's last sum is
    # the sum of the committed views of its windows
    heads, chunks = {}, {}
    for _, key, value in read_all(kafka_broker, topics.summaries, [0])[0]:
        if value is None:
            continue
        if b"/c" in key:
            chunks[key.decode()] = value
        else:
            heads[key.decode()] = json.loads(value)
    view_sum: dict[int, np.ndarray] = {}
    for key, h in heads.items():
        if h.get("chunks"):
            h["_chunks"] = [chunks[f"{key}/c{k}"] for k in range(h["chunks"])]
            view_sum[h["window"]] = view_sum.get(h["window"], 0) + decode_view(h)
    last_sum = {}
    for _, key, value in read_all(kafka_broker, topics.rollups, [0])[0]:
        if value is not None:
            last_sum[key.decode()] = value
    from aggregator.service.rollup import RollupSum

    checked = 0
    for key, value in last_sum.items():
        r = RollupSum.from_bytes(zlib.decompress(value))
        if f"3x-{r.index}" not in names:
            continue
        want = sum((view_sum[w] for w in r.covered() if w in view_sum), np.zeros(D, np.int64))
        assert np.array_equal(r.counts, want), f"rollup 3x-{r.index} is not its views' sum"
        checked += 1
    assert checked >= 2, (checked, sorted(last_sum))


def test_an_audit_export_of_a_views_group_is_its_windows_summed_views_signed(
    kafka_broker, tmp_path, monkeypatch
):
    """panagg audit export on a member's directory of a views group: the leader closes the
    open window at every member (as a forced release) and signs the sum of that window's views,
    the very counters its release is computed from (no layer drawn: 0 eps in the ledger); the
    window is then released once from the same views."""
    import os
    import subprocess
    import sys

    from aggregator.state import PanPrivateHistogram
    from state_store.audit import read_export

    key = os.urandom(32).hex()
    monkeypatch.setenv("PANAGG_AUDIT_KEY", key)  # the members' (the leader signs)
    topic = make_topic(kafka_broker, PARTS)
    group = f"g-{topic}"
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "scale.exchange=views",
        "--set",
        f"state.domain_size={D}",
        "--set",
        "window.kind=time",
        "--set",
        "window.size=3600",
    )
    topics = GroupTopics(group)
    cli = [sys.executable, "-m", "aggregator.service.cli"]
    try:
        for name in ("v1", "v2"):
            members.start(name)
        _wait_counting(members, tmp_path)
        produce(kafka_broker, topic, np.arange(900) % D, rate=3000)
        time.sleep(3)  # both members have counted them (no window ends for an hour)
        out = subprocess.run(
            cli + ["audit", "export", "--state-dir", str(tmp_path / "v1" / "state")],
            capture_output=True,
            text=True,
            timeout=200,
            env=dict(os.environ, PANAGG_AUDIT_KEY=""),
        )
        assert out.returncode == 0, out.stderr + members.logs()
        wait_for_total(kafka_broker, topics, 900, 60, members)
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
    doc = read_export(path, bytes.fromhex(key))
    state = PanPrivateHistogram.deserialize(doc["state"])
    docs = releases(kafka_broker, topics)
    assert [d["n"] for d in docs] == [900], docs
    # the export holds what the release was computed from: the same n and layers (2 per view)
    assert state.size == D and state.n == 900 and state.layers == docs[0]["layers"] >= 2, (
        state.n,
        state.layers,
        docs[0]["layers"],
    )
    assert doc["window"]["windows"] == [docs[0]["window"]]
    assert doc["window"]["exchange"] == "views" and len(doc["offsets"]) == PARTS
    exports = [e for e in read_ledger(kafka_broker, topics).entries if e["kind"] == "export"]
    assert len(exports) == 1 and exports[0]["epsilon_spent"] == 0.0
    assert "Traceback" not in members.logs(last=100000)


def _kill_the_owner_and_delete(bootstrap, topic, topics, members, tmp_path, admin):
    """Kill -9 the member counting partition 1, write 3 s of records, then delete them
    (DeleteRecords: what retention does, sooner) before anyone counted them. Returns the
    counting group's committed offset there, the first offset left and the member killed."""
    import signal

    from kafka import KafkaConsumer, TopicPartition

    tp = TopicPartition(topic, 1)
    victim = counting_owner(bootstrap, topics, topic, 1)
    members.procs[victim].send_signal(signal.SIGKILL)
    members.procs[victim].wait(30)
    produce(bootstrap, topic, np.arange(3000) % D, 1000)  # 3 s: several windows
    c = KafkaConsumer(bootstrap_servers=bootstrap)
    low = c.end_offsets([tp])[tp]
    c.close()
    counting = admin.list_group_offsets(topics.counting_group)[topics.counting_group]
    committed = counting[tp].offset
    admin.delete_records({tp: low})
    assert committed < low
    return committed, low, victim


def test_source_records_deleted_before_they_were_counted_withhold_their_window(
    kafka_broker, tmp_path
):
    """A views member killed -9; records of its source partition are deleted (DeleteRecords:
    what the topic's retention does, sooner) before the next owner counts them. The window
    that would hold them is withheld with a ledger entry naming the deleted offsets and its
    window range; none is released short of them; later windows of that partition release.
    (Before, the new owner's consumer jumped to the first record left and the window was
    released with its range over the deleted offsets and an n short of them, no flag.)"""
    from kafka.admin import KafkaAdminClient

    topic = make_topic(kafka_broker, 2)
    group = f"g-{topic}"
    topics = GroupTopics(group)
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "scale.exchange=views",
        "--set",
        f"state.domain_size={D}",
        "--set",
        "window.kind=time",
        "--set",
        "window.size=2",
        "--set",
        "source.session_timeout_s=15",
    )
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    try:
        for name in ("v1", "v2"):
            members.start(name)
        _wait_counting(members, tmp_path)
        produce(kafka_broker, topic, np.arange(2000) % D, 2000)
        wait_for_total(kafka_broker, topics, 2000, 120, members)
        committed, low, victim = _kill_the_owner_and_delete(
            kafka_broker, topic, topics, members, tmp_path, admin
        )
        produce(kafka_broker, topic, np.arange(1000) % D, 1000)
        survivor = "v2" if victim == "v1" else "v1"
        deadline = time.monotonic() + 180
        while True:  # the survivor counts partition 1 past the deletion
            entries = read_ledger(kafka_broker, topics).entries
            after = [
                e
                for e in entries
                if e["kind"] == "release"
                and not e.get("withheld")
                and e["ranges"].get(f"{topic}:1", [0, 0])[0] >= low
            ]
            if after:
                break
            assert members.procs[survivor].poll() is None, members.logs()
            assert time.monotonic() < deadline, members.logs()
            time.sleep(2)
    finally:
        members.stop_all()
        admin.close()
    key = f"{topic}:1"
    released = [e for e in entries if e["kind"] == "release" and not e.get("withheld")]
    short = [
        (e["window"], e["ranges"][key])
        for e in released
        if key in e["ranges"] and e["ranges"][key][0] < low and e["ranges"][key][1] > committed
    ]
    assert not short, f"released over deleted records {committed}-{low}: {short}"
    named = [
        e["withheld"]
        for e in entries
        if e["kind"] == "release"
        and e.get("withheld")
        and f"from offset {committed} to {low} were deleted" in e["withheld"]
    ]
    assert named and "window range [" in named[0], [
        e.get("withheld") for e in entries if e.get("withheld")
    ]
    assert "Traceback" not in members.logs(last=100000)


def test_event_time_records_deleted_before_they_were_counted_withhold_every_window_they_may_hold(
    kafka_broker, tmp_path
):
    """The event-time edition of the test above. The deleted records' timestamps are gone with
    them, so any window not closed on their partition, up to the window of now +
    window.max_future_skew_s (later stamps are rejected), may have held one: each of those is
    withheld naming the deleted offsets, none is released over that partition, and the windows
    after it release. (Before, the new owner counted on from the first record left and the
    windows were released short of the deleted records, no flag.)"""
    import re
    from kafka.admin import KafkaAdminClient

    topic = make_topic(kafka_broker, 2)
    group = f"g-{topic}"
    topics = GroupTopics(group)
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "scale.exchange=views",
        "--set",
        f"state.domain_size={D}",
        "--set",
        "window.kind=event_time",
        "--set",
        "window.size=2",
        "--set",
        "window.allowed_lateness_s=1",
        "--set",
        "window.max_future_skew_s=4",
        "--set",
        "window.idle_partition_timeout_s=3",
        "--set",
        "source.session_timeout_s=15",
    )
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    key = f"{topic}:1"
    try:
        for name in ("v1", "v2"):
            members.start(name)
        _wait_counting(members, tmp_path)
        deadline = time.monotonic() + 120
        while sum(d["n"] for d in releases(kafka_broker, topics)) < 1000:  # windows close as
            produce(kafka_broker, topic, np.arange(500) % D, 500)  # event time moves on
            assert time.monotonic() < deadline, members.logs()[-4000:]
        committed, low, victim = _kill_the_owner_and_delete(
            kafka_broker, topic, topics, members, tmp_path, admin
        )
        produce(kafka_broker, topic, np.arange(1000) % D, 250)  # 4 s
        survivor = "v2" if victim == "v1" else "v1"
        said = None
        deadline = time.monotonic() + 180
        while True:  # the survivor releases partition 1's windows past the taint
            logs = members.logs(last=100000)
            said = said or re.search(
                r"partition 1 of \S+ from offset (\d+) to (\d+) were "
                r"deleted .* up to window (\d+) is withheld",
                logs,
            )
            entries = read_ledger(kafka_broker, topics).entries
            if said:
                after = [
                    e
                    for e in entries
                    if e["kind"] == "release"
                    and not e.get("withheld")
                    and e["window"] > int(said.group(3))
                    and e["ranges"].get(key, [0, 0])[1] > e["ranges"].get(key, [0, 0])[0]
                ]
                if after:
                    break
            produce(kafka_broker, topic, np.arange(100) % D, 100)  # time moves on
            assert members.procs[survivor].poll() is None, members.logs()
            assert time.monotonic() < deadline, members.logs()[-4000:]
    finally:
        members.stop_all()
        admin.close()
    first, end, through = (int(x) for x in said.groups())
    assert (first, end) == (committed, low), said.group(0)
    withheld = {
        e["window"]: e["withheld"] for e in entries if e["kind"] == "release" and e.get("withheld")
    }
    released = {e["window"]: e for e in entries if e["kind"] == "release" and not e.get("withheld")}
    tainted = [
        w
        for w, text in withheld.items()
        if f"from offset {committed} to {low} were deleted" in text
    ]
    assert tainted and max(tainted) <= through, (tainted, through)
    # no window that may hold a deleted record is released: those after the last one closed on
    # partition 1 (the survivor's commit says which) up to the taint's end
    acquired = re.search(
        rf"counting partition 1 of \S+ from offset {committed} by event time "
        r"\(last window closed there: (\w+)\)",
        logs,
    )
    assert acquired, logs[-3000:]
    closed_before = -1 if acquired.group(1) == "none" else int(acquired.group(1))
    short = sorted(w for w in released if closed_before < w <= through)
    assert not short, (short, closed_before, through, tainted)
    assert "Traceback" not in members.logs(last=100000)


def test_a_member_exits_when_idle_only_after_its_leader_released_the_complete_windows(
    kafka_broker, tmp_path
):
    """``--exit-when-idle`` on a member that leads: its intake goes idle once the backlog is
    counted, but releases slower than the windows (400 bootstrap repetitions each) still queue
    complete windows at its leader. The member exits only once they are released: every window
    but the open one is in the releases (before, it exited with complete windows queued, and
    the fault matrix's slow_release drain found 17,959 events of a count group unreleased)."""
    import subprocess
    import sys

    N = 2000
    topic = make_topic(kafka_broker, PARTS)
    group = f"g-{topic}"
    items = np.random.default_rng(5).integers(0, D, 5 * N + 300)
    cmd = [
        sys.executable,
        "-m",
        "aggregator.service.cli",
        "run",
        "--bootstrap",
        kafka_broker,
        "--topic",
        topic,
        "--state-dir",
        str(tmp_path / "state"),
        "--release-dir",
        str(tmp_path / "releases"),
        "--metrics-port",
        "-1",
        "--set",
        "scale.partitioned=true",
        "--set",
        "scale.store=kafka",
        "--set",
        f"source.group={group}",
        "--set",
        "source.instance_id=v1",
        "--set",
        f"state.domain_size={D}",
        "--set",
        "window.kind=count",
        "--set",
        f"window.size={N}",
        "--set",
        "release.error_bar_reps=400",
        "--exit-when-idle",
        "3",
    ]
    log = tmp_path / "v1.log"
    with open(log, "w") as out:
        member = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 90
            while "counting partition" not in log.read_text():
                assert member.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            # (at a rate, so that the windows are cut near N: a backlog read at once is
            # one window, docs/scale-out.md "Count windows with views")
            produce(kafka_broker, topic, items, 4000)
            code = member.wait(timeout=600)
        finally:
            if member.poll() is None:
                member.kill()
    run = subprocess.CompletedProcess(cmd, code, "", log.read_text())
    assert run.returncode == 0, run.stderr[-3000:]
    docs = releases(kafka_broker, GroupTopics(group))
    released = sum(d["n"] for d in docs)
    print(f"\n{len(docs)} windows released, {released} of {len(items)} events")
    # the open window holds less than N plus what was in flight at the last cut
    assert len(docs) >= 4 and len(items) - released < 2 * N, (
        len(docs),
        released,
        run.stderr[-3000:],
    )


def test_event_time_windows_of_a_views_group_equal_one_process_across_a_kill(
    kafka_broker, tmp_path
):
    """window.kind = event_time with the views exchange (event_views.py): two members on a
    4-partition topic, timestamps out of order within the lateness and some late records, a
    member killed -9 while records flow and restarted. Every window is released once, its n
    and late count those of a one-process run over the same records and of the definitions'
    reference, n is the events of its ledgered positions' good records, no position is charged
    more than eps, and every view is a member's state plus its layer (nothing per event)."""
    from tests.helpers.group import (
        ET_LATENESS,
        ET_SIZE,
        by_event_window,
        event_setup,
        one_process,
        reference_windows,
        feed_across_a_kill,
        released_once,
    )

    parts = 4
    topic, group, topics, t0, stream = event_setup(kafka_broker, parts, windows := 12)
    extra = (
        "--set",
        "scale.exchange=views",
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
        for name in ("v1", "v2"):
            members.start(name)
        _wait_counting(members, tmp_path)
        victim = feed_across_a_kill(
            kafka_broker, topic, topics, members, stream, ("v1", "v2"), parts, flush_at
        )
        where: dict = {}
        expected = reference_windows(kafka_broker, topic, parts, flush_at, where)
        total = sum(ev for ev, _ in expected.values())
        assert total == len(stream)
        wait_for_total(kafka_broker, topics, total, 240, members)
    finally:
        members.stop_all()
    one_process(kafka_broker, topic, tmp_path, group, extra[2:])
    one_docs = [json.loads(f.read_text()) for f in (tmp_path / "one" / "releases").glob("*.json")]
    logs = members.logs(last=100000)
    try:
        assert "Traceback" not in logs
        assert "by event time (allowed lateness 4 s), closed at the group's low watermark" in logs
        docs = releases(kafka_broker, topics)
        assert len({d["window"] for d in docs}) == len(docs), "a window was released twice"
        assert all(d["scale_out"]["exchange"] == "views" for d in docs)
        got = by_event_window(docs)
        assert got == by_event_window(one_docs) == expected
        assert sum(late for _, late in got.values()) > 0, "the stream had no late record"
        entries = released_once(kafka_broker, topics, docs)
        # each record's position is in the ledgered ranges of the window it was released in
        # (the reference's window for it; the flush records' window stays open)
        ranges = {e["window"]: e["ranges"] for e in entries}
        flush_w = flush_at // 1000 // ET_SIZE
        placed = {pos: w for pos, w in where.items() if w < flush_w}
        assert len(placed) == len(stream) and set(placed.values()) <= set(ranges)
        outside = [
            (p, off, w)
            for (p, off), w in placed.items()
            if not ranges[w].get(f"{topic}:{p}", [0, 0])[0]
            <= off
            < ranges[w].get(f"{topic}:{p}", [0, 0])[1]
        ]
        assert not outside, outside[:5]
        # what an intruder reads in the internal topics: no repartition topic, views' headers
        # with their counters' metadata and the windows closed before them, watermarks
        from kafka.admin import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
        internal = sorted(t for t in admin.list_topics() if t.startswith(f"{group}.panagg"))
        admin.close()
        assert topics.repartition not in internal
        marks = 0
        for t in internal:
            for recs in read_all(kafka_broker, t).values():
                for _, key, value in recs:
                    if value is None or (t == topics.summaries and b"/c" in key):
                        continue
                    doc = json.loads(value)
                    if t == topics.summaries:
                        assert set(doc) <= HEADER_KEYS | {"after"}, set(doc) - HEADER_KEYS
                    if key.startswith(b"wm:"):
                        assert set(doc) == {"ts", "idle", "first"}, doc
                        marks += 1
        assert marks > 0
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{logs[-6000:]}") from None
    print(
        f"\n{len(docs)} event-time windows, {sum(x for _, x in got.values())} late records, "
        f"killed {victim}"
    )


def test_an_idle_partition_holds_no_event_time_window_of_a_views_group(kafka_broker, tmp_path):
    """Event-time windows with views, window.late = dead_letter, one of 4 source partitions
    never written to (window.idle_partition_timeout_s = 3): the members leave it out of the
    group's watermark once it is idle, so the windows of the other three are released, each with
    the n the definitions give (late records dead letters, once each, at their positions). A
    record written to the idle partition afterwards, stamped in a released window, is late
    there: a dead letter too, never counted (it waited for a close that never comes before the
    dead letters got a commit of their own: this test failed then). An audit export is answered
    with one line (not built for event-time views)."""
    from tests.helpers.group import ET_LATENESS, ET_SIZE, event_stream, produce_stamped

    from tests.helpers.event_time import reference

    topic = make_topic(kafka_broker, PARTS)
    dead = make_topic(kafka_broker, 1)
    group = f"g-{topic}"
    topics = GroupTopics(group)
    t0 = (int(time.time()) - 7200) // ET_SIZE * ET_SIZE
    stream = event_stream(np.random.default_rng(), 6, 300, t0)
    busy = {p: stream[p::3] for p in range(3)}
    flush_at = (t0 + 20 * ET_SIZE) * 1000
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "scale.exchange=views",
        "--set",
        "window.kind=event_time",
        "--set",
        f"window.size={ET_SIZE}",
        "--set",
        f"window.allowed_lateness_s={ET_LATENESS}",
        "--set",
        "window.late=dead_letter",
        "--set",
        "window.idle_partition_timeout_s=3",
        "--set",
        f"source.dead_letter_topic={dead}",
    )
    try:
        for name in ("v1", "v2"):
            members.start(name)
        _wait_counting(members, tmp_path)
        for p, recs in busy.items():
            produce_stamped(kafka_broker, topic, recs + [(flush_at, 0)], partition=p)
        parts = {
            f"{topic}:{p}": [(ts / 1000, (p, off)) for off, (ts, _) in enumerate(recs)]
            for p, recs in busy.items()
        }
        where, windows = reference(parts, ET_LATENESS, "dead_letter")
        expected = {k: ev for k, (ev, _) in windows.items() if ev}
        dead_at = {f"{topic}:{p}@{off}" for (p, off), w in where.items() if w == "dead"}
        assert dead_at, "the stream had no late record"
        wait_for_total(kafka_broker, topics, sum(expected.values()), 120, members)
        # a record on the idle partition, stamped in the first (released) window
        produce_stamped(kafka_broker, topic, [(t0 * 1000 + 1000, 1)], partition=3)
        dead_at.add(f"{topic}:3@0")
        deadline = time.monotonic() + 60
        while True:
            keys = [k.decode() for _, k, _ in read_all(kafka_broker, dead, [0])[0]]
            if f"{topic}:3@0" in keys:
                break
            assert time.monotonic() < deadline, f"no dead letter of it\n{members.logs()}"
            time.sleep(1)
        # an audit export is not built for event-time views: one line, nothing closes
        import subprocess
        import sys

        forced = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                "audit",
                "export",
                "--state-dir",
                str(tmp_path / "v1" / "state"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        time.sleep(3)
    finally:
        members.stop_all()
    logs = members.logs(last=100000)
    assert "Traceback" not in logs, logs[-3000:]
    assert forced.returncode != 0 and "are not built yet" in forced.stderr, forced.stderr
    assert len(forced.stderr.strip().splitlines()) == 1, forced.stderr
    docs = releases(kafka_broker, topics)
    got = {d["window"]: d["n"] for d in docs if d["n"]}
    assert got == expected, (got, expected, logs[-3000:])
    assert len({d["window"] for d in docs}) == len(docs)
    keys = [k.decode() for _, k, _ in read_all(kafka_broker, dead, [0])[0]]
    assert len(keys) == len(set(keys)) and set(keys) == dead_at, (sorted(keys), sorted(dead_at))


def test_an_event_time_partition_far_ahead_waits_for_the_groups_watermark(kafka_broker, tmp_path):
    """Event-time windows with views, no idle timeout: partition 0 holds 10 windows of records,
    the other three only the first window's. Partition 0's member pauses it once it is more than
    MAX_AHEAD_WINDOWS windows past the group's low watermark (its open windows each hold a
    state), so no window closes past the others' records. Then the others get the rest: the
    watermark moves, partition 0 resumes, and every window is released once with the n the
    definitions give."""
    from tests.helpers.group import ET_LATENESS, ET_SIZE, produce_stamped

    from tests.helpers.event_time import reference

    topic = make_topic(kafka_broker, PARTS)
    group = f"g-{topic}"
    topics = GroupTopics(group)
    t0 = (int(time.time()) - 7200) // ET_SIZE * ET_SIZE
    rng = np.random.default_rng()
    per = {
        p: sorted(
            int((t0 + rng.uniform(0, 10 * ET_SIZE if p == 0 else ET_SIZE)) * 1000)
            for _ in range(400 if p == 0 else 40)
        )
        for p in range(PARTS)
    }
    rest = {
        p: sorted(int((t0 + rng.uniform(ET_SIZE, 10 * ET_SIZE)) * 1000) for _ in range(120))
        for p in range(1, PARTS)
    }
    flush_at = (t0 + 20 * ET_SIZE) * 1000
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "scale.exchange=views",
        "--set",
        "window.kind=event_time",
        "--set",
        f"window.size={ET_SIZE}",
        "--set",
        f"window.allowed_lateness_s={ET_LATENESS}",
        "--set",
        "source.max_records=50",
    )  # polls that a pause can stop
    try:
        for name in ("v1", "v2"):
            members.start(name)
        _wait_counting(members, tmp_path)
        for p, ts in per.items():
            produce_stamped(kafka_broker, topic, [(t, 1) for t in ts], partition=p)
        deadline = time.monotonic() + 60
        while "paused: more than 3 windows past" not in members.logs(last=100000):
            assert time.monotonic() < deadline, f"partition 0 was not paused\n{members.logs()}"
            time.sleep(1)
        time.sleep(2)
        early = releases(kafka_broker, topics)
        for p, ts in rest.items():
            produce_stamped(
                kafka_broker, topic, [(t, 1) for t in ts] + [(flush_at, 0)], partition=p
            )
        produce_stamped(kafka_broker, topic, [(flush_at, 0)], partition=0)
        parts = {
            f"{topic}:{p}": [(t / 1000, (p, i)) for i, t in enumerate(per[p] + rest.get(p, []))]
            for p in range(PARTS)
        }
        _, windows = reference(parts, ET_LATENESS, "next")
        expected = {k: ev for k, (ev, _) in windows.items() if ev and k < flush_at // 10_000}
        wait_for_total(kafka_broker, topics, sum(expected.values()), 120, members)
    finally:
        members.stop_all()
    logs = members.logs(last=100000)
    assert "Traceback" not in logs, logs[-3000:]
    # before the others' records came, nothing past the first windows closed
    assert all(d["window"] <= t0 // ET_SIZE + 1 for d in early), [d["window"] for d in early]
    docs = releases(kafka_broker, topics)
    assert len({d["window"] for d in docs}) == len(docs)
    assert {d["window"]: d["n"] for d in docs if d["n"]} == expected


def test_a_forced_release_of_an_event_time_views_group_releases_every_record_read(
    kafka_broker, tmp_path
):
    """panagg release on an event-time views group: the leader answers with the window of the
    newest timestamp the members reported, every member closes its windows up to it at once
    (no record passes the last one, so the watermark alone would never close it), and every
    record produced is released, each window once."""
    import subprocess
    import sys

    from tests.helpers.group import ET_LATENESS, ET_SIZE, produce_stamped

    topic = make_topic(kafka_broker, PARTS)
    group = f"g-{topic}"
    topics = GroupTopics(group)
    t0 = (int(time.time()) - 7200) // ET_SIZE * ET_SIZE
    rng = np.random.default_rng()
    per = {
        p: sorted(int((t0 + rng.uniform(0, 3 * ET_SIZE)) * 1000) for _ in range(150))
        for p in range(PARTS)
    }
    members = Members(
        kafka_broker,
        topic,
        group,
        tmp_path,
        "--set",
        "scale.exchange=views",
        "--set",
        "window.kind=event_time",
        "--set",
        f"window.size={ET_SIZE}",
        "--set",
        f"window.allowed_lateness_s={ET_LATENESS}",
    )
    total = sum(len(ts) for ts in per.values())
    try:
        for name in ("v1", "v2"):
            members.start(name)
        _wait_counting(members, tmp_path)
        for p, ts in per.items():
            produce_stamped(kafka_broker, topic, [(t, 1) for t in ts], partition=p)
        deadline = time.monotonic() + 60  # the first window closes by the watermark
        while not releases(kafka_broker, topics):
            assert time.monotonic() < deadline, f"no release\n{members.logs()}"
            time.sleep(1)
        time.sleep(2)
        assert sum(d["n"] for d in releases(kafka_broker, topics)) < total
        forced = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                "release",
                "--state-dir",
                str(tmp_path / "v1" / "state"),
            ],
            capture_output=True,
            text=True,
            timeout=200,
        )
        assert forced.returncode == 0, forced.stderr + members.logs()
        wait_for_total(kafka_broker, topics, total, 60, members)
    finally:
        members.stop_all()
    logs = members.logs(last=100000)
    assert "Traceback" not in logs, logs[-3000:]
    docs = releases(kafka_broker, topics)
    assert len({d["window"] for d in docs}) == len(docs), "a window was released twice"
    assert sum(d["n"] for d in docs) == total
    newest = max(max(ts) for ts in per.values()) // (ET_SIZE * 1000)
    assert max(d["window"] for d in docs) == newest


def _snapshotting_group(bootstrap, tmp_path, window_s: int):
    """A new source topic of PARTS partitions and a views group over it, time windows of
    ``window_s``, two in-window snapshots each: (topic, its GroupTopics, Members)."""
    topic = make_topic(bootstrap, PARTS)
    group = f"g-{topic}"
    return (
        topic,
        GroupTopics(group),
        Members(
            bootstrap,
            topic,
            group,
            tmp_path,
            "--set",
            "scale.exchange=views",
            "--set",
            f"state.domain_size={D}",
            "--set",
            "window.kind=time",
            "--set",
            f"window.size={window_s}",
            "--set",
            "checkpoint.snapshots_per_window=2",
        ),
    )


def _snapshot_records(bootstrap, topics) -> list[tuple[int, bytes | None]]:
    """(key, value) of every committed record of the group's snapshots topic, in order."""
    return [
        (int(key), value)
        for recs in read_all(bootstrap, topics.snapshots).values()
        for _, key, value in recs
    ]


def _check_snapshot_topic(records) -> None:
    """What an intruder reads in the snapshots topic: layered states and source ranges only (no
    per-event record, no field beside them), each state with its own layer and the snapshot's
    (at least 2), and every key tombstoned last (the windows closed: no state left at rest)."""
    import msgpack

    from aggregator.state import PanPrivateHistogram

    states = [msgpack.unpackb(v, raw=False) for _, v in records if v is not None]
    assert states, "no snapshot was written"
    for doc in states:
        assert set(doc) == {"window", "seq", "ranges", "state"}, set(doc)
        assert PanPrivateHistogram.deserialize(doc["state"]).layers >= 2
    last = {key: value for key, value in records}
    assert all(v is None for v in last.values()), "a closed window's snapshot left at rest"


def test_snapshots_of_a_views_group_bound_the_replay_and_a_member_resumes_from_one(
    kafka_broker, tmp_path
):
    """checkpoint.snapshots_per_window = 2 on the views exchange (6 s windows): each member
    snapshots its window's state at 1/3 and 2/3 of it with its partitions' offsets; a member
    killed -9 three times and restarted resumes its windows from their snapshots (never from
    their start), every event is released once, the releases count the snapshots' layers, and
    the snapshots topic holds only layered states. (Before, the start was refused.)"""
    topic, topics, members = _snapshotting_group(kafka_broker, tmp_path, 6)
    items = np.minimum(np.random.default_rng().zipf(1.3, 30_000), D - 1)
    try:
        for name in ("v1", "v2"):
            members.start(name)
        _wait_counting(members, tmp_path)
        producer = threading.Thread(target=produce, args=(kafka_broker, topic, items, 1500))
        producer.start()
        for _ in range(3):
            # killed just after a snapshot of its current run (so within that window)
            time.sleep(2)
            deadline = time.monotonic() + 30
            while "layered snapshot" not in (tmp_path / f"v2-{members.runs}.log").read_text():
                assert time.monotonic() < deadline, members.logs()
                time.sleep(0.1)
            members.kill("v2")
            members.start("v2")
        producer.join()
        wait_for_total(kafka_broker, topics, len(items), 180, members)
        time.sleep(2)  # the last closes' tombstones are in the transactions of their views
    finally:
        members.stop_all()
    logs = members.logs(last=100000)
    assert "resume window" in logs and "from its snapshot" in logs, logs[-5000:]
    assert "cannot resume" not in logs and "Traceback" not in logs, logs[-5000:]
    docs = releases(kafka_broker, topics)
    assert len({d["window"] for d in docs}) == len(docs)
    assert sum(d["n"] for d in docs) == len(items)
    _check_ranges_tile(kafka_broker, topics, topic)
    # a member's view: its state's layer, 2 per snapshot, its view's layer (a resumed state's
    # restore layer stands for the snapshot's second one); two members' views summed
    assert max(d["layers"] for d in docs) >= 12, [d["layers"] for d in docs]
    _check_snapshot_topic(_snapshot_records(kafka_broker, topics))


def _until_every_position_is_ledgered(bootstrap, topics, members, total) -> list[dict]:
    """The release entries once every position is in one (released or withheld)."""
    deadline = time.monotonic() + 180
    while True:
        entries = [e for e in read_ledger(bootstrap, topics).entries if e["kind"] == "release"]
        if sum(b - a for e in entries for a, b in e["ranges"].values()) >= total:
            return entries
        assert all(p.poll() is None for p in members.procs.values()), members.logs()
        assert time.monotonic() < deadline, members.logs(last=100000)[-5000:]
        time.sleep(2)


def _check_withheld_once(entries, docs, total, said: str) -> None:
    """One window withheld naming ``said``, its positions charged; the later ones released;
    every position in one entry (the ranges tile each partition) and released n plus the
    withheld ranges = ``total``: nothing replayed, nothing lost."""
    withheld = [e for e in entries if e.get("withheld")]
    assert (
        len(withheld) == 1
        and said in withheld[0]["withheld"]
        and "never replayed" in withheld[0]["withheld"]
    ), [e.get("withheld") for e in entries]
    w = withheld[0]["window"]
    assert withheld[0]["epsilon_spent"] > 0 and withheld[0]["ranges"]
    assert w not in {d["window"] for d in docs} and any(d["window"] > w for d in docs)
    spans: dict[str, list] = {}
    for e in entries:
        for part, ab in e["ranges"].items():
            spans.setdefault(part, []).append(tuple(ab))
    assert len(spans) == PARTS
    for part, ss in spans.items():
        ss.sort()
        assert ss[0][0] == 0 and all(b0 == a1 for (_, b0), (a1, _) in zip(ss, ss[1:])), part
    assert (
        sum(d["n"] for d in docs) + sum(b - a for a, b in withheld[0]["ranges"].values()) == total
    )


def _wait_for(members, text: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in members.logs(last=100000):
        assert time.monotonic() < deadline, members.logs()
        time.sleep(0.2)


def test_a_lost_snapshot_of_a_views_group_withholds_its_window_never_replays_it(
    kafka_broker, tmp_path
):
    """A member killed -9 after a snapshot, whose snapshot is then gone from the topic (here a
    tombstone, as a deletion or truncation leaves it): restarted, it withholds that window with
    a ledger entry naming the missing snapshot (its positions charged, nothing released), never
    replays it under fresh noise, and releases the later windows; every position is in one
    entry."""
    topic, topics, members = _snapshotting_group(kafka_broker, tmp_path, 6)
    try:
        members.start("v1")
        _wait_for(members, "counting partition")
        producer = threading.Thread(
            target=produce, args=(kafka_broker, topic, np.arange(12_000) % D, 1000)
        )
        producer.start()
        _wait_for(members, "layered snapshot")
        members.kill("v1")
        tombstone_snapshots(kafka_broker, topics, PARTS)
        members.start("v1")
        producer.join()
        entries = _until_every_position_is_ledgered(kafka_broker, topics, members, 12_000)
    finally:
        members.stop_all()
    assert "Traceback" not in members.logs(last=100000)
    _check_withheld_once(entries, releases(kafka_broker, topics), 12_000, "is missing from")


def test_a_rebalance_that_splits_a_views_snapshot_withholds_its_window(kafka_broker, tmp_path):
    """A second member joins after the first snapshotted its window over all 4 partitions: the
    rebalance splits them, neither member can resume the snapshot alone, so that window is
    withheld at both (its positions charged, named in one ledger entry), never replayed under
    fresh noise; the next windows are released from both members' views."""
    topic, topics, members = _snapshotting_group(kafka_broker, tmp_path, 12)
    total = 20_000
    try:
        members.start("v1")
        _wait_for(members, "counting partition")
        producer = threading.Thread(
            target=produce, args=(kafka_broker, topic, np.arange(total) % D, 1000)
        )
        producer.start()
        _wait_for(members, "layered snapshot 1 ")  # 4 s into a 12 s window: v2 joins within it
        members.start("v2")
        producer.join()
        entries = _until_every_position_is_ledgered(kafka_broker, topics, members, total)
    finally:
        members.stop_all()
    logs = members.logs(last=100000)
    assert "Traceback" not in logs
    docs = releases(kafka_broker, topics)
    _check_withheld_once(entries, docs, total, "a rebalance split the snapshot's partitions")
    assert any(d["exchange"]["views"] == 2 for d in docs if "exchange" in d), docs[-1]
