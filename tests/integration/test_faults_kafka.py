"""Faults an operator must see at once, on a real broker and a real full disk: a checkpoint that
cannot be written turns /ready to 503 with the reason, and the restart after it reads every
partition, with every window's n equal to its source range."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest

from tests.chaos.harness import fill_disk
from tests.helpers.kafka import (
    D,
    env,
    make_topic,
    produce,
    produce_items,
    run_service,
    service_args,
    wait_for,
)


def _mount_small_disk(path: Path, size: str = "4m") -> None:
    path.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:  # a full disk needs a filesystem of its own (root, CAP_SYS_ADMIN)
        pytest.skip(f"cannot mount a small tmpfs here: {res.stderr.strip()}")


def _ready(url):
    try:
        with urllib.request.urlopen(url.replace("/metrics", "/ready"), timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _stopped(pid):
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "T"


def _ledger_entries(state):
    return [json.loads(x) for x in (state / "ledger.jsonl").read_text().splitlines()]


def _releases(state):
    return [e for e in _ledger_entries(state) if e["kind"] == "release"]


@pytest.mark.parametrize("workers", [1, 0], ids=["release-worker", "in-loop"])
def test_a_full_disk_after_a_release_is_seen_and_every_partition_is_read_after(
    kafka_broker, tmp_path, workers
):
    disk = tmp_path / "disk"
    _mount_small_disk(disk)
    try:
        topic = make_topic(kafka_broker, partitions=2)
        produce(kafka_broker, topic, [msgpack.packb({"item": i % D}) for i in range(3500)])
        args = service_args(
            kafka_broker,
            topic,
            tmp_path,
            "--exit-when-idle",
            "4",
            "--set",
            f"release.workers={workers}",
            "--set",
            "release.error_bar_reps=0",
        )
        args[args.index("--state-dir") + 1] = str(disk / "state")
        args[args.index("window.size=100000000")] = "window.size=1000"
        args[args.index("--metrics-port") + 1] = "0"
        # the service stops itself right after window 0's release is ledgered
        proc = subprocess.Popen(
            [sys.executable, "-m", "aggregator.service.cli", *args],
            env=dict(env(), PANAGG_TEST_FAULT="ledger-after-release:1:stop"),
            stderr=subprocess.PIPE,
            text=True,
        )
        log = []
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
        filler = None
        try:
            deadline = time.time() + 90
            while not _stopped(proc.pid):
                assert proc.poll() is None and time.time() < deadline, "".join(log)[-3000:]
                time.sleep(0.05)
            url = next(line.split()[-1] for line in log if line.startswith("metrics on "))
            filler = fill_disk(disk)  # the checkpoint after the release now meets ENOSPC
            os.kill(proc.pid, signal.SIGCONT)
            t0 = time.time()
            while True:
                code, text = _ready(url)
                if (code == 503 and "checkpoint" in text) or time.time() - t0 > 15:
                    break
                time.sleep(0.2)
            seen_s = time.time() - t0
            assert code == 503 and "checkpoint" in text, (code, text)
            assert seen_s <= 10
            assert any("checkpoint failed" in line and "No space left" in line for line in log)
            metrics = urllib.request.urlopen(url, timeout=5).read().decode()
            assert 'panagg_write_failing{what="checkpoint"} 1.0' in metrics
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        filler.unlink()  # space freed: the restart must read everything
        res = subprocess.run(
            [sys.executable, "-m", "aggregator.service.cli", *args],
            env=env(),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        releases = _releases(disk / "state")
        assert [e["window"] for e in releases] == [0, 1, 2]
        ends = {f"{topic}:0": 0, f"{topic}:1": 0}
        for e in releases:  # contiguous ranges over both partitions, n equal to their width
            assert {p: r[0] for p, r in e["ranges"].items()} == {p: ends[p] for p in e["ranges"]}, (
                e["ranges"],
                ends,
            )
            assert e["n"] == sum(hi - lo for lo, hi in e["ranges"].values()) == 1000
            ends.update({p: r[1] for p, r in e["ranges"].items()})
        # the open window holds the last 500 records: every partition was read to its end
        assert "window 3 open with 500 events" in res.stderr, res.stderr[-3000:]
        assert sum(ends.values()) == 3000
        # published once each: window 0 is not published a second time
        published = sorted(os.listdir(tmp_path / "releases"))
        assert len([p for p in published if p.endswith(".json")]) == 3, published
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _events(url):
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    line = next(x for x in text.splitlines() if x.startswith("panagg_events_total "))
    return float(line.split()[1])


@pytest.mark.parametrize("how", ["clean", "kill-9"])
def test_counting_resumes_soon_after_the_broker_returns(tmp_path, how, restartable_broker):
    """The restartable broker (the session's broker is shared): stopped (cleanly or kill -9) for
    12 s while the service runs, restarted on its port; the time from its return to the first
    event counted from a record produced after it (the producer's own connect included)."""
    broker = restartable_broker
    bootstrap = broker.bootstrap
    topic = make_topic(bootstrap, partitions=2)
    produce(bootstrap, topic, [msgpack.packb({"item": i % D}) for i in range(500)])
    args = service_args(bootstrap, topic, tmp_path)
    args[args.index("--metrics-port") + 1] = "0"
    proc = subprocess.Popen(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        env=env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    log = []
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    try:
        deadline = time.time() + 60
        while not any(line.startswith("metrics on ") for line in log):
            assert proc.poll() is None and time.time() < deadline, "".join(log)[-3000:]
            time.sleep(0.1)
        url = next(line.split()[-1] for line in log if line.startswith("metrics on "))
        while _events(url) < 500:
            assert time.time() < deadline, "".join(log)[-3000:]
            time.sleep(0.1)
        if how == "clean":
            broker.stop()
        else:
            broker.kill()
        time.sleep(12)
        broker.start()
        back = time.monotonic()
        produce(bootstrap, topic, [msgpack.packb({"item": i % D}) for i in range(500)])
        while _events(url) < 501:
            assert time.monotonic() - back < 90 and proc.poll() is None, "".join(log)[-3000:]
            time.sleep(0.05)
        resumed_s = time.monotonic() - back
        print(f"broker outage ({how}): first event counted {resumed_s:.2f} s after its return")
        assert resumed_s <= 5.0, "".join(log)[-3000:]
        while _events(url) < 1000:
            assert time.monotonic() - back < 90, "".join(log)[-3000:]
            time.sleep(0.1)
        # the broker gauge followed the outage and says connected again within 5 s
        time.sleep(5.5)
        metrics = urllib.request.urlopen(url, timeout=5).read().decode()
        assert "panagg_broker_connected 1.0" in metrics, metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_service_started_while_the_broker_is_away_waits_for_it(tmp_path, restartable_broker):
    """Issue 46: a service (re)started while the broker restarts waits up to
    source.connect_timeout_s and counts once the broker is back (it exited at once, "cannot
    reach Kafka": a pod restarted during a broker restart crash-looped); a SIGTERM while it
    waits ends it with exit 0 and nothing written."""
    broker = restartable_broker
    bootstrap = broker.bootstrap
    topic = make_topic(bootstrap, partitions=2)
    produce(bootstrap, topic, [msgpack.packb({"item": i % D}) for i in range(700)])
    args = service_args(
        bootstrap,
        topic,
        tmp_path,
        "--set",
        "window.size=300",
        "--set",
        "source.connect_timeout_s=90",
        "--exit-when-idle",
        "3",
    )
    broker.stop()
    stopped = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            *service_args(bootstrap, topic, tmp_path / "other"),
            "--set",
            "source.connect_timeout_s=90",
        ],
        env=env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    waiting = subprocess.Popen(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        env=env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(8)
        assert waiting.poll() is None and stopped.poll() is None  # both still waiting
        stopped.send_signal(signal.SIGTERM)
        assert stopped.wait(timeout=60) == 0, stopped.stderr.read()[-3000:]
        assert not (tmp_path / "other").exists()
        broker.start()
        _, err = waiting.communicate(timeout=300)
    finally:
        for proc in (stopped, waiting):
            if proc.poll() is None:
                proc.kill()
    assert waiting.returncode == 0, err[-3000:]
    assert "waiting up to 90 s for it (source.connect_timeout_s)" in err
    assert "Traceback" not in err
    released = _releases(tmp_path / "state")
    assert sum(e["n"] for e in released) > 0
    assert all(e["n"] == sum(b - a for a, b in e["ranges"].values()) for e in released)


def test_a_held_and_resumed_partition_is_always_read_again(kafka_broker):
    """The service holds partitions (pause, seek) and resumes them to replay windows exactly;
    random sequences of those on a real broker, then everything resumed: every partition is read
    to its end (kafka-python 3.0.12 left one unread for good in 8 of 12 such runs)."""
    import random

    from kafka import TopicPartition

    from consumers.kafka.kafka_python import KafkaSource, partition_key

    topic = make_topic(kafka_broker, partitions=3)
    produce(kafka_broker, topic, [msgpack.packb({"item": i % D}) for i in range(9000)])
    for trial in range(6):
        source = KafkaSource(kafka_broker, topic, f"g-hold-{trial}-{topic}", max_records=300)
        rng = random.Random()  # any sequence must end read through
        read = {}
        try:
            # the holds below need an assignment: on a starved machine the join takes a while
            deadline = time.time() + 120
            while not source.assigned and time.time() < deadline:
                for seg in source.poll(0.2):
                    read[seg.partition] = max(read.get(seg.partition, 0), int(seg.offsets[-1]) + 1)
            assert source.assigned, f"trial {trial}: no partition assigned in 120 s"
            for turn in range(60):
                for seg in source.poll(0.2):
                    read[seg.partition] = max(read.get(seg.partition, 0), int(seg.offsets[-1]) + 1)
                if turn < 3 or not source.assigned:
                    continue
                key = partition_key(topic, rng.randrange(3))
                pos = source.consumer.position(TopicPartition(topic, int(key.rsplit(":", 1)[1])))
                op = rng.random()
                if op < 0.3:
                    source.pause([key])
                    source.seek_partition(key, max(0, pos - rng.randrange(200)))
                elif op < 0.6:
                    source.resume([key])
            source.resume(sorted(source.assigned))
            deadline = time.time() + 120
            while (
                not source.assigned or not source.caught_up(sorted(source.assigned))
            ) and time.time() < deadline:
                for seg in source.poll(0.2):
                    read[seg.partition] = max(read.get(seg.partition, 0), int(seg.offsets[-1]) + 1)
            assert read == source.end_offsets() and sum(read.values()) == 9000, (trial, read)
        finally:
            source.close()


def test_a_new_group_polled_in_short_turns_is_always_given_its_partitions(kafka_broker):
    """A new group's first join comes before the topic's metadata and assigns nothing; the
    rejoin that follows outlives many short polls. kafka-python 3.0.12 then never applies its
    answer (docs/upstream/kafka-python-stuck-join.md): with 1 ms polls no new group got a
    partition. The source finishes that join (compat.finish_join), so every one reads all."""
    from consumers.kafka.kafka_python import KafkaSource

    topic = make_topic(kafka_broker, partitions=3)
    produce(kafka_broker, topic, [msgpack.packb({"item": i}) for i in range(30)])
    for trial in range(5):
        source = KafkaSource(kafka_broker, topic, f"g-short-{trial}-{topic}")
        try:
            read = 0
            deadline = time.time() + 60
            while read < 30 and time.time() < deadline:
                read += sum(len(seg.offsets) for seg in source.poll(0.001))
            assert read == 30 and len(source.assigned) == 3, (trial, read, source.assigned)
        finally:
            source.close()


def test_a_backlog_lands_in_the_windows_of_its_timestamps(kafka_broker, tmp_path):
    """What a broker outage leaves: records stamped over three 30 s windows, all read at once.
    window.kind = time (the default clock, auto) puts each in the window of its timestamp, as
    the producer saw it, not all in the window open when they arrive."""
    from kafka import KafkaProducer

    topic = make_topic(kafka_broker, partitions=1)
    base = (int(time.time()) // 30 - 6) * 30
    producer = KafkaProducer(bootstrap_servers=kafka_broker, acks="all", linger_ms=20)
    sizes = [300, 500, 400]
    for k, n in enumerate(sizes):
        for i in range(n):
            producer.send(
                topic,
                value=msgpack.packb({"item": i % D}),
                timestamp_ms=(base + 30 * k + 5) * 1000 + i,
            )
    for i in range(50):  # the stream goes on now: the windows before are complete
        producer.send(topic, value=msgpack.packb({"item": i}), timestamp_ms=int(time.time() * 1000))
    producer.flush()
    producer.close()
    args = service_args(
        kafka_broker,
        topic,
        tmp_path,
        "--exit-when-idle",
        "4",
        "--set",
        "window.kind=time",
        "--set",
        "release.error_bar_reps=0",
    )
    args[args.index("window.size=100000000")] = "window.size=30"
    res = subprocess.run(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        env=env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert (
        "time windows of 30 s by the records' Kafka timestamps (window.clock = auto)" in res.stderr
    )
    releases = _releases(tmp_path / "state")
    assert [e["n"] for e in releases] == sizes, res.stderr[-3000:]
    starts = [json.loads(e["document"])["window_info"]["event_start_unix"] for e in releases]
    assert starts == [base, base + 30, base + 60]


@contextlib.contextmanager
def _logged_service(args, tmp_path):
    """``panagg run args`` in a subprocess, its stderr in ``tmp_path / "stderr.log"``; killed
    at the end if it is still running."""
    err = open(tmp_path / "stderr.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.close()


def test_a_first_start_from_earliest_knows_where_it_began_when_records_are_deleted(
    kafka_broker, tmp_path
):
    """A new state directory starts at the earliest retained records (the default), and is
    stopped before its first window closes; the topic's retention then deletes records it had
    not counted. Its checkpoint used to hold no start offsets for ``earliest``, so the restart
    began at the first record left and released the window without the deleted records, named
    nowhere (the fault harness's ``source_retention_early``: ``time`` lost [0, ~5,300) of
    each partition). The start now records each partition's first offset, so the restart
    sees the deletion: it withholds the window with a ledger entry naming the deleted records
    and counts on from the first record left; nothing is released short or lost unnamed."""
    from kafka import KafkaAdminClient, TopicPartition

    topic = make_topic(kafka_broker, partitions=1)
    produce_items(kafka_broker, topic, 500, seed=1)
    args = service_args(
        kafka_broker, topic, tmp_path, "--set", "window.kind=count", "--set", "window.size=1000"
    )
    with _logged_service(args, tmp_path) as proc:
        wait_for(
            lambda: (
                "starting window 0 at" in (tmp_path / "stderr.log").read_text()
                or proc.poll() is not None
            ),
            120,
            "the service's start",
        )
        time.sleep(3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    started = (tmp_path / "stderr.log").read_text()
    assert f"the earliest retained records: {topic}:0 at 0" in started, started[-2000:]
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    admin.delete_records({TopicPartition(topic, 0): 300})  # counted, never released
    admin.close()
    produce_items(kafka_broker, topic, 1500, seed=2)  # offsets 500-1999
    again = run_service([*args, "--exit-when-idle", "3"])
    assert again.returncode == 0, again.stderr[-2000:]
    decided = [
        e for e in _ledger_entries(tmp_path / "state") if e["kind"] in ("release", "refused")
    ]
    assert [(e["kind"], e["window"]) for e in decided] == [("refused", 0), ("release", 1)]
    assert decided[0]["note"].startswith(
        f"records of partition 0 from offset 0 to 300 were "
        f"deleted by the retention of {topic} before they "
        "were counted"
    ), decided[0]["note"]
    assert decided[1]["n"] == 1000 and decided[1]["ranges"] == {f"{topic}:0": [300, 1300]}
    assert "window 0 of all is withheld" in again.stderr


def _freeze_delete_thaw(bootstrap, proc, produce_unread, cut) -> None:
    """Stall ``proc`` (SIGSTOP), write records it does not read (``produce_unread``), delete
    each partition's records below ``cut`` ({TopicPartition: offset}: what retention does),
    then let it go on (SIGCONT)."""
    from kafka import KafkaAdminClient

    proc.send_signal(signal.SIGSTOP)
    wait_for(lambda: _stopped(proc.pid), 30, "the stall")
    # the fetch it had sent is answered (empty) within fetch_max_wait_ms (0.5 s): what is
    # produced next is not in a response waiting in its socket, read before the deletion
    time.sleep(3)
    produce_unread()
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.delete_records(cut)
    admin.close()
    proc.send_signal(signal.SIGCONT)


def _stop_cleanly(proc, tmp_path) -> None:
    """The service still running, then stopped by SIGTERM with exit 0."""
    assert proc.poll() is None, (tmp_path / "stderr.log").read_text()[-3000:]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def test_records_deleted_before_they_were_read_are_withheld_and_counting_goes_on(
    kafka_broker, tmp_path
):
    """A service stalled (SIGSTOP, as a long pause would) while the topic's retention deletes
    records it had not read: the consumer goes on from the first record left without a word.
    Before the first fix the open count window took the records after the deletion and was
    released with n = 2,000 over a range of 4,000 positions (the fault harness's
    ``source_retention_frozen``: count window n 4,000 over 8,503, a time window n 2,697 over
    7,350); after it the service stopped with one line (exit 2) and the next start withheld
    the window. Now the running service withholds the open window itself, with a ledger entry
    naming the deleted records in the words of the restart (its range: the records it did
    count), logs one WARNING line and counts on from the first record left: the next window is
    released whole, nothing is lost unnamed, the service never stops."""
    from kafka import TopicPartition

    topic = make_topic(kafka_broker, partitions=1)
    produce_items(kafka_broker, topic, 3000, seed=1)
    args = service_args(
        kafka_broker, topic, tmp_path, "--set", "window.kind=count", "--set", "window.size=2000"
    )
    with _logged_service(args, tmp_path) as proc:
        # window 0 released, window 1 open with records 2000-2999
        wait_for(
            lambda: (tmp_path / "releases" / "release-0.json").exists(), 120, "window 0's release"
        )
        _freeze_delete_thaw(
            kafka_broker,
            proc,  # offsets 3000-5999 written, 3000-4999 gone
            lambda: produce_items(kafka_broker, topic, 3000, seed=2),
            {TopicPartition(topic, 0): 5000},
        )
        wait_for(
            lambda: (
                proc.poll() is not None
                or "window 1 of all is withheld" in (tmp_path / "stderr.log").read_text()
            ),
            120,
            "window 1 withheld",
        )
        produce_items(kafka_broker, topic, 1000, seed=3)  # offsets 6000-6999: window 2 fills
        wait_for(
            lambda: proc.poll() is not None or (tmp_path / "releases" / "release-2.json").exists(),
            120,
            "window 2's release",
        )
        _stop_cleanly(proc, tmp_path)
    log = (tmp_path / "stderr.log").read_text()
    named = (
        f"records of partition 0 from offset 3000 to 5000 were deleted by the retention "
        f"of {topic} before they were counted"
    )
    warned = [line for line in log.splitlines() if "is withheld" in line]
    assert len(warned) == 1 and "WARNING" in warned[0] and named in warned[0], warned
    decided = [
        e for e in _ledger_entries(tmp_path / "state") if e["kind"] in ("release", "refused")
    ]
    assert [(e["kind"], e["window"]) for e in decided] == [
        ("release", 0),
        ("refused", 1),
        ("release", 2),
    ], decided
    part = f"{topic}:0"
    withheld, after = decided[1], decided[2]
    assert withheld["note"].startswith(named), withheld["note"]
    # the window's range is what it counted; the deleted span lies between it and the next
    assert withheld["ranges"] == {part: [2000, 3000]} and withheld["n"] == 1000, withheld
    assert withheld["end_offsets"] == {part: 5000}
    assert after["n"] == 2000 and after["ranges"] == {part: [5000, 7000]}, after
    assert not (tmp_path / "releases" / "release-1.json").exists()
    # a restart replays neither window: the ledger decided them
    again = run_service([*args, "--exit-when-idle", "3"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert [
        (e["kind"], e["window"])
        for e in _ledger_entries(tmp_path / "state")
        if e["kind"] in ("release", "refused")
    ] == [(e["kind"], e["window"]) for e in decided]
    assert "is withheld" not in again.stderr


def _produce_to(bootstrap, topic, partitions, n, seed):
    """``n`` msgpack events to each of ``partitions`` (explicitly, not by key)."""
    from kafka import KafkaProducer

    rng = np.random.default_rng(seed)
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=50, acks="all")
    for p in partitions:
        for item in rng.integers(0, D, n):
            producer.send(topic, value=msgpack.packb({"item": int(item)}), partition=p)
    producer.flush()
    producer.close()


def test_several_aggregations_withhold_one_window_each_over_every_deleted_partition(
    kafka_broker, tmp_path
):
    """Several aggregations over two partitions, stalled (SIGSTOP) while the retention deletes
    unread records of both: each aggregation withholds its open window once, its entry naming
    the deleted records of both partitions (one look at the source for all of them, as a
    restart's; the first version withheld one window per partition, each as its jump was
    seen, and the later ones held records still on the topic), and counts on from the first
    records left: the next window starts there in both partitions and is released whole."""
    from kafka import TopicPartition

    topic = make_topic(kafka_broker, partitions=2)
    _produce_to(kafka_broker, topic, [0, 1], 1000, seed=1)  # offsets 0-999 of each
    args = service_args(
        kafka_broker,
        topic,
        tmp_path,
        "--set",
        "window.kind=count",
        "--set",
        "ledger.budget_per_event=2",
        "--set",
        "aggregations.a.window.size=1500",
        "--set",
        "aggregations.b.window.size=1200",
    )
    rel = tmp_path / "releases"
    with _logged_service(args, tmp_path) as proc:
        wait_for(
            lambda: (
                proc.poll() is not None
                or (
                    (rel / "a" / "release-0.json").exists()
                    and (rel / "b" / "release-0.json").exists()
                )
            ),
            120,
            "both windows 0",
        )
        assert proc.poll() is None, (tmp_path / "stderr.log").read_text()[-3000:]
        time.sleep(2)  # the rest of the 2,000 records into the open windows
        _freeze_delete_thaw(
            kafka_broker,
            proc,  # 1000-1999 written, 1000-1499 gone
            lambda: _produce_to(kafka_broker, topic, [0, 1], 1000, seed=2),
            {TopicPartition(topic, 0): 1500, TopicPartition(topic, 1): 1500},
        )
        wait_for(
            lambda: (
                proc.poll() is not None
                or (tmp_path / "stderr.log").read_text().count("is withheld") >= 2
            ),
            120,
            "both open windows withheld",
        )
        _produce_to(kafka_broker, topic, [0, 1], 1000, seed=3)  # 2000-2999
        wait_for(
            lambda: (
                proc.poll() is not None
                or (
                    (rel / "a" / "release-2.json").exists()
                    and (rel / "b" / "release-3.json").exists()
                )
            ),
            120,
            "the windows after",
        )
        _stop_cleanly(proc, tmp_path)
    log = (tmp_path / "stderr.log").read_text()
    assert log.count("is withheld") == 2, log[-3000:]
    keys = [f"{topic}:0", f"{topic}:1"]
    for name in ("a", "b"):
        decided = [
            e
            for e in _ledger_entries(tmp_path / "state" / name)
            if e["kind"] in ("release", "refused")
        ]
        kinds = [(e["kind"], e["window"]) for e in decided]
        assert kinds[:3] == [("release", 0), ("refused", 1), ("release", 2)], (name, kinds)
        first, withheld, after = decided[:3]
        assert withheld["end_offsets"] == dict.fromkeys(keys, 1500), withheld
        for k, key in enumerate(keys):
            due = withheld["ranges"].get(key, [None, first["end_offsets"][key]])[1]
            assert (
                f"records of partition {k} from offset {due} to 1500 were deleted by the "
                f"retention of {topic} before they were counted"
            ) in withheld["note"], withheld["note"]
            assert after["ranges"][key][0] == 1500, after
        held = sum(b - a for a, b in withheld["ranges"].values())
        assert withheld["n"] == held and after["n"] == sum(
            b - a for a, b in after["ranges"].values()
        ), (withheld, after)
        assert not (rel / name / "release-1.json").exists()


def test_a_deletion_inside_one_segment_is_seen_where_the_records_jump(kafka_broker):
    """A client that went on from the first record left after a deletion can hand records from
    before it and after it in one segment (librdkafka did, in the several-aggregations run of
    the frozen fault: windows were released over the deleted records, unseen, since the watch
    looked only at where a segment starts). The watch cuts a segment before each jump of more
    than SMALL_JUMP offsets, and the look at the piece after it names the deleted records;
    jumps of transaction markers stay in one piece."""
    from kafka import KafkaAdminClient, TopicPartition

    from aggregator.service.stages.retention import SMALL_JUMP, RetentionWatch
    from consumers.base import Segment
    from consumers.kafka.kafka_python import KafkaSource

    topic = make_topic(kafka_broker, partitions=1)
    produce_items(kafka_broker, topic, 40, seed=1)
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    admin.delete_records({TopicPartition(topic, 0): 20})
    admin.close()
    source = KafkaSource(kafka_broker, topic, f"g-split-{topic}")
    try:
        key = f"{topic}:0"
        watch = RetentionWatch(source)
        # a jump of SMALL_JUMP offsets (transaction markers) stays in one piece
        marked = Segment(key, [20, 21, 22 + SMALL_JUMP], [b"x"] * 3)
        assert [list(p.offsets) for p in watch.split(marked)] == [[20, 21, 22 + SMALL_JUMP]]
        # 12-14 fetched before the deletion, 20-22 after the client went on from 20
        jumped = Segment(key, [12, 13, 14, 20, 21, 22], [b"x"] * 6)
        pieces = watch.split(jumped)
        assert [list(p.offsets) for p in pieces] == [[12, 13, 14], [20, 21, 22]]
        assert watch.check(pieces[0], {key: 12}) == {}
        assert watch.check(pieces[1], {key: 15}) == {key: (15, 20)}
    finally:
        source.close()


def _produce_stamped(bootstrap, topic, n, stamp_ms, seed):
    """``n`` msgpack events to partition 0, each stamped ``stamp_ms`` (+ its index, ms)."""
    from kafka import KafkaProducer

    items = np.random.default_rng(seed).integers(0, D, n)
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=50, acks="all")
    for i, item in enumerate(items):
        producer.send(
            topic,
            value=msgpack.packb({"item": int(item)}),
            partition=0,
            timestamp_ms=int(stamp_ms) + i % 1000,
        )
    producer.flush()
    producer.close()


def _event_time_args(bootstrap, topic, tmp_path):
    """Event-time windows of 2 s, stamps accepted up to 1 s ahead of the clock: a record
    deleted unread may belong to any window up to the one of now + 1 s."""
    args = service_args(
        bootstrap,
        topic,
        tmp_path,
        "--set",
        "window.kind=event_time",
        "--set",
        "window.max_future_skew_s=1",
    )
    args[args.index("window.size=100000000")] = "window.size=2"
    return args


def _check_event_time_withheld(tmp_path, topic, named, first_after):
    """Windows 0 released, 1 withheld naming ``named`` (over its whole range, to the first
    record of window 2), window 2 (past the last window a deleted record could be in) released
    whole from ``first_after``; the one invariant of every mode holds (the chaos checker)."""
    from tests.chaos.invariant import check_directory

    decided = [
        e for e in _ledger_entries(tmp_path / "state") if e["kind"] in ("release", "refused")
    ]
    assert [(e["kind"], e["window"]) for e in decided] == [
        ("release", 0),
        ("refused", 1),
        ("release", 2),
    ], decided
    part = f"{topic}:0"
    withheld, after = decided[1], decided[2]
    assert named in withheld["note"], withheld["note"]
    assert withheld["ranges"][part][1] == first_after, withheld
    assert after["ranges"] == {part: [first_after, first_after + 500]} and after["n"] == 500
    assert not (tmp_path / "releases" / "release-1.json").exists()
    report = check_directory(tmp_path / "state", tmp_path / "releases")
    assert all(not cov.violations for cov in report.values()), {
        k: c.violations for k, c in report.items()
    }


def _past_the_deleted_windows(bootstrap, topic, proc, tmp_path):
    """Once the running event-time service said it saw the deletion: 500 records (3000-3499)
    in the window of now, past the last window a deleted record can be in (now + 1 s), and 10
    more that close it; then its release, and a clean stop."""
    wait_for(
        lambda: (
            proc.poll() is not None
            or "every later event-time window" in (tmp_path / "stderr.log").read_text()
        ),
        120,
        "the deletion seen",
    )
    assert proc.poll() is None, (tmp_path / "stderr.log").read_text()[-3000:]
    time.sleep(3)
    _produce_stamped(bootstrap, topic, 500, time.time() // 2 * 2000, seed=4)
    time.sleep(3)
    _produce_stamped(bootstrap, topic, 10, time.time() * 1000, seed=5)  # closes that window
    wait_for(
        lambda: proc.poll() is not None or (tmp_path / "releases" / "release-2.json").exists(),
        120,
        "window 2's release",
    )
    _stop_cleanly(proc, tmp_path)


def test_event_time_records_deleted_unread_withhold_every_window_they_may_be_in(
    kafka_broker, tmp_path
):
    """Event-time windows, the service stalled (SIGSTOP) while retention deletes records of
    the open window it had not read (the fault harness's ``source_retention_frozen``). Before,
    the service stopped with one line (exit 2: "window 1 (an event-time window) is not
    released") and a supervisor's restart was refused the same way. A deleted record's
    timestamp is gone with it: any window from the open one to the window of now +
    ``window.max_future_skew_s`` may have held it. Now one WARNING line names the deleted
    records and those windows, each of them is withheld at its close (a ``refused`` entry
    naming the records), nothing of them is published, and the first window past them is
    released whole; the service never stops."""
    from kafka import TopicPartition

    topic = make_topic(kafka_broker, partitions=1)
    base = (int(time.time()) // 2 - 300) * 2000  # windows of 2 s, ten minutes ago
    _produce_stamped(kafka_broker, topic, 1000, base, seed=1)  # 0-999: window b
    _produce_stamped(kafka_broker, topic, 1000, base + 2000, seed=2)  # 1000-1999: b + 1
    args = _event_time_args(kafka_broker, topic, tmp_path)
    with _logged_service(args, tmp_path) as proc:
        wait_for(
            lambda: proc.poll() is not None or (tmp_path / "releases" / "release-0.json").exists(),
            120,
            "window 0's release",
        )
        time.sleep(2)  # the rest of window 1's records read
        _freeze_delete_thaw(
            kafka_broker,
            proc,  # 2000-2999 written (b + 1), 2000-2499 gone
            lambda: _produce_stamped(kafka_broker, topic, 1000, base + 2000, seed=3),
            {TopicPartition(topic, 0): 2500},
        )
        _past_the_deleted_windows(kafka_broker, topic, proc, tmp_path)
    log = (tmp_path / "stderr.log").read_text()
    named = (
        f"records of partition 0 from offset 2000 to 2500 were deleted by the retention "
        f"of {topic} before they were counted"
    )
    warned = [line for line in log.splitlines() if "WARNING" in line and named in line]
    assert len(warned) == 1 and "seen while running" in warned[0], warned
    _check_event_time_withheld(tmp_path, topic, named, 3000)
    # a restart replays no decided window
    again = run_service([*args, "--exit-when-idle", "3"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert (
        len([e for e in _ledger_entries(tmp_path / "state") if e["kind"] in ("release", "refused")])
        == 3
    )
    assert "withheld" not in again.stderr


def test_event_time_restart_over_deleted_records_withholds_and_counts_on(kafka_broker, tmp_path):
    """The same deletion while the event-time service was down (SIGTERM): the restart used to
    be refused in one line (the replay check: the window's records are gone), so a supervisor
    looped on it. Now the restart replays the open window from the first records left, noted
    as withheld with every later window a deleted record may be in (one WARNING line), and
    goes on: the first window past them is released whole."""
    from kafka import KafkaAdminClient, TopicPartition

    topic = make_topic(kafka_broker, partitions=1)
    base = (int(time.time()) // 2 - 300) * 2000
    _produce_stamped(kafka_broker, topic, 1000, base, seed=1)
    _produce_stamped(kafka_broker, topic, 1000, base + 2000, seed=2)
    args = _event_time_args(kafka_broker, topic, tmp_path)
    with _logged_service(args, tmp_path) as proc:
        wait_for(
            lambda: proc.poll() is not None or (tmp_path / "releases" / "release-0.json").exists(),
            120,
            "window 0's release",
        )
        time.sleep(2)
        _stop_cleanly(proc, tmp_path)
    _produce_stamped(kafka_broker, topic, 1000, base + 2000, seed=3)  # 2000-2999
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    admin.delete_records({TopicPartition(topic, 0): 2500})
    admin.close()
    (tmp_path / "stderr.log").rename(tmp_path / "stderr-1.log")
    with _logged_service(args, tmp_path) as proc:
        _past_the_deleted_windows(kafka_broker, topic, proc, tmp_path)
    log = (tmp_path / "stderr.log").read_text()
    # the window's replay started at its first record (1000): all of 1000-2499 is gone now
    named = (
        f"records of partition 0 from offset 1000 to 2500 were deleted by the retention "
        f"of {topic} before they were counted"
    )
    warned = [line for line in log.splitlines() if "WARNING" in line and named in line]
    assert len(warned) == 1 and "seen at a restart" in warned[0], warned
    _check_event_time_withheld(tmp_path, topic, named, 3000)
