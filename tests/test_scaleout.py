"""Scale-out without a broker: summary merging, partition handover between two processes sharing
one directory (a fake consumer group; the real one is in tests/integration/test_scaleout_kafka.py),
and what a run on neighbouring streams shows."""

import json
import zlib
from pathlib import Path
import logging

import msgpack
import numpy as np
import pytest

from aggregator.service.config import load_config
from aggregator.estimate import anonymized_histogram
from aggregator.noise import discrete_laplace
from aggregator.estimate import noisy_value_counts
from aggregator.service.partitioned import (PartitionedAggregator, _value_counts as _vc, item_key_bytes,
                                 merge_summaries, partition_summary, remove_empty_counters)
from aggregator.state import PanPrivateHistogram
from consumers.base import Segment, Source
from state_store.local import LocalStore

D = 50
SEED = 99
INFO = {"kind": "count", "size": 10, "events": 10, "started_unix": 1.0, "ended_unix": 2.0}


def _summaries(states, model="state-only", window=0):
    return [partition_summary(s, model=model, window=window, partition=i, partitions=len(states),
                              window_info=INFO, rng=np.random.default_rng([7, i]))
            for i, s in enumerate(states)]


def test_hashed_partition_arrays_merge_into_one_state():
    """Disjoint B/P-bucket arrays: the merged release is the release of their concatenation."""
    rng = np.random.default_rng(1)
    states = []
    for i in range(3):
        s = PanPrivateHistogram(1.0, buckets=400, key=bytes([i + 1]) * 16,
                                rng=np.random.default_rng([5, i]))
        s.update([f"user-{k}" for k in rng.zipf(1.5, 500) if k < 10**6])
        states.append(s)
    rel = merge_summaries(_summaries(states))
    whole = np.concatenate([s.counts for s in states])
    n = sum(s.n for s in states)
    expect = anonymized_histogram(whole, states[0].p, n=n, buckets=1200)
    got = np.repeat(*np.array(rel["histogram"]["pairs"]).T)
    assert np.array_equal(np.sort(got)[::-1], expect)
    assert rel["n"] == n and rel["domain"] == {"mode": "hashed", "size": 1200, "counters": 1200,
                                               "partitions": 3, "empty_counters_removed": 0}


def test_direct_partition_summaries_add_up():
    """Direct mode: the value counts of all partitions' counters add up; the (P - 1) * D counters
    a keyed topic leaves empty are removed by their expected noise value counts."""
    states = []
    for i in range(2):
        s = PanPrivateHistogram(2.0, size=D, rng=np.random.default_rng([6, i]))
        s.add_indices(np.random.default_rng(i).integers(0, D, 300))
        states.append(s)
    rel = merge_summaries(_summaries(states, model="joint"), loss="l1")
    layer = [s.counts + discrete_laplace(s.p, D, rng=np.random.default_rng([7, i]))
             for i, s in enumerate(states)]
    vc = remove_empty_counters(noisy_value_counts(np.concatenate(layer)), D, states[0].p, 2)
    expect = anonymized_histogram(vc, states[0].p, layers=2, n=600)
    got = np.repeat(*np.array(rel["histogram"]["pairs"]).T)
    assert np.array_equal(np.sort(got)[::-1], expect)
    assert rel["layers"] == 2 and rel["domain"]["counters"] == 2 * D
    assert rel["domain"]["empty_counters_removed"] == D


def test_removing_empty_counters_is_unbiased_on_pure_noise():
    """The value counts of noise-only counters minus their expectation: about nothing left."""
    p = 0.6
    noise = sum(discrete_laplace(p, 200_000, rng=np.random.default_rng([3, k])) for k in range(2))
    left = remove_empty_counters(noisy_value_counts(noise), 200_000, p, 2)
    assert left.total < 0.01 * 200_000  # only rounding and sampling fluctuation remain


def test_merged_direct_release_is_about_as_accurate_as_one_state():
    """Zipf items over D counters, keyed into P = 6 partitions, joint model (2 layers): the merged
    release is within 2x of the one-state error, where summing value counts alone was ~10x."""
    from aggregator.estimate import l1_distance
    Dz, P, eps = 20_000, 6, 1.0
    rng = np.random.default_rng(17)
    items = np.minimum(rng.zipf(1.1, 200_000) - 1, Dz - 1)
    h = np.bincount(items, minlength=Dz)
    truth = np.sort(h[h > 0])[::-1]
    one = PanPrivateHistogram(eps, size=Dz, rng=np.random.default_rng(1))
    one.add_indices(items)
    single = merge_summaries(_summaries([one], model="joint"))
    parts = []
    owner = np.arange(Dz) % P
    for i in range(P):
        s = PanPrivateHistogram(eps, size=Dz, rng=np.random.default_rng([2, i]))
        s.add_indices(items[owner[items] == i])
        parts.append(s)
    merged = merge_summaries(_summaries(parts, model="joint"))
    vc = None
    for s, summ in zip(parts, _summaries(parts, model="joint")):
        v = _vc(summ)
        vc = v if vc is None else vc.merge(v)
    naive = anonymized_histogram(vc, parts[0].p, layers=2, n=200_000)

    def err(rel):
        return l1_distance(truth, np.repeat(*np.array(rel["histogram"]["pairs"]).T))
    assert merged["n"] == single["n"] == 200_000
    assert err(merged) < 2 * err(single)
    assert err(merged) < 0.5 * l1_distance(truth, naive)


def test_merge_refuses_incomplete_or_inconsistent_windows():
    a = PanPrivateHistogram(1.0, size=D, rng=np.random.default_rng(1))
    b = PanPrivateHistogram(2.0, size=D, rng=np.random.default_rng(2))
    both = _summaries([a, a])
    with pytest.raises(ValueError, match="partitions 0..1"):
        merge_summaries(both[:1])
    bad = _summaries([a, b])
    with pytest.raises(ValueError, match="disagree"):
        merge_summaries(bad)
    with pytest.raises(ValueError, match="no summaries"):
        merge_summaries([])


def test_item_key_bytes():
    assert item_key_bytes("é") == "é".encode() and item_key_bytes(b"\x00") == b"\x00"
    assert item_key_bytes(42) == b"42"


# -- a fake consumer group -------------------------------------------------------------------------
class FakeTopic:
    def __init__(self, name, partitions):
        self.name = name
        self.records = {p: [] for p in range(partitions)}  # (key, value)

    def produce(self, item, partition, keyed=True):
        self.records[partition].append((item_key_bytes(item) if keyed else None,
                                        msgpack.packb({"item": item})))


class FakeMember(Source):
    """What PartitionedAggregator needs from KafkaSource; the test sets ``owned_now``."""

    def __init__(self, topic: FakeTopic, batch=7):
        self.topic, self.batch = topic, batch
        self.owned_now: set[int] = set()
        self.generation = 0
        self.position: dict[int, int] = {}
        self.paused: set[int] = set()

    def assign(self, parts):
        self.owned_now = set(parts)
        self.generation += 1
        for p in parts:
            self.position[p] = 0  # as if reset to an old committed offset: the service seeks

    def owned(self):
        return {f"{self.topic.name}:{p}" for p in self.owned_now}

    def partition_count(self):
        return len(self.topic.records)

    def start_offset(self, key):
        return 0

    def seek_partition(self, key, offset):
        self.position[int(key.rpartition(":")[2])] = offset

    def pause(self, keys):
        self.paused |= {int(k.rpartition(":")[2]) for k in keys}

    def resume(self, keys):
        self.paused -= {int(k.rpartition(":")[2]) for k in keys}

    def poll(self, timeout_s=1.0):
        out = []
        for p in sorted(self.owned_now - self.paused):
            recs = self.topic.records[p]
            start = self.position[p]
            chunk = recs[start:start + self.batch]
            if chunk:
                out.append(Segment(f"{self.topic.name}:{p}", list(range(start, start + len(chunk))),
                                   [v for _, v in chunk], [k for k, _ in chunk]))
                self.position[p] = start + len(chunk)
        return out


@pytest.fixture
def cfg_for(tmp_path, monkeypatch):
    monkeypatch.setenv("PANAGG_TESTING", "1")

    def make(window=1000, **extra):
        sets = [f"checkpoint.dir={tmp_path / 'shared'}", f"release.dir={tmp_path / 'rel'}",
                f"state.domain_size={D}", f"window.size={window}", "scale.partitioned=true", "scale.store=directory",
                f"testing.noise_seed={SEED}", "metrics.port=-1"]
        sets += [f"{k}={v}" for k, v in extra.items()]
        return load_config(overrides=sets, env={})
    return make


def _drain(*aggs, rounds=200):
    for _ in range(rounds):
        if not sum(a.step(0) for a in aggs):
            return
    raise AssertionError("did not drain")


def _expected(items, p, window=0):
    s = PanPrivateHistogram(1.0, size=D, rng=np.random.default_rng([SEED, 0, p, window]))
    s.add_indices(np.asarray(items, dtype=np.int64))
    return s.counts


def test_partition_moves_to_another_process_without_loss_or_double_count(cfg_for, tmp_path):
    topic = FakeTopic("ev", 2)
    rng = np.random.default_rng(3)
    items = {0: rng.integers(0, D, 40).tolist(), 1: rng.integers(0, D, 60).tolist()}
    for p, its in items.items():
        for i in its[:30]:
            topic.produce(i, p)
    ma, mb = FakeMember(topic), FakeMember(topic)
    a, b = PartitionedAggregator(cfg_for(), ma), PartitionedAggregator(cfg_for(), mb)
    ma.assign({0, 1})
    _drain(a, b)
    assert set(a.tasks) == {"ev:0", "ev:1"} and not b.tasks
    # rebalance: partition 1 moves to b; b notices first and must wait for a's lock
    for i in items[1][30:]:
        topic.produce(i, 1)
    ma.assign({0})
    mb.assign({1})
    b.step(0)
    assert "ev:1" not in b.tasks and b.waiting == {"ev:1"} and mb.paused == {1}
    a.step(0)  # a hands it over: checkpoint, then unlock
    assert "ev:1" not in a.tasks
    _drain(a, b)
    assert "ev:1" in b.tasks and not mb.paused
    for i in items[0][30:]:
        topic.produce(i, 0)
    _drain(a, b)
    assert np.array_equal(a.tasks["ev:0"].state.counts, _expected(items[0], 0))
    assert np.array_equal(b.tasks["ev:1"].state.counts, _expected(items[1], 1))
    assert a.metrics.handovers.labels(event="released")._value.get() == 1
    assert b.metrics.handovers.labels(event="acquired")._value.get() == 1


def test_crashed_owner_is_replayed_from_the_window_start(cfg_for):
    """The owner dies (its lock goes with it) after counting into its open window: nothing of
    those counters is on disk, and the next owner replays the window from its start offset,
    counting every record exactly once under (test-seeded) fresh noise."""
    topic = FakeTopic("ev", 1)
    items = np.random.default_rng(4).integers(0, D, 43).tolist()
    for i in items:
        topic.produce(i, 0)
    ma = FakeMember(topic, batch=4)
    a = PartitionedAggregator(cfg_for(window=20), ma)
    ma.assign({0})
    for _ in range(8):
        a.step(0)
    task = a.tasks["ev:0"]
    ckpt = LocalStore(task.dir).load_latest()
    assert ckpt.state is None and ckpt.window["id"] == 1
    assert ckpt.offsets["ev:0"] == 20 < task.offsets["ev:0"]  # counted past the window start
    task.lock.release()  # the process is gone; nothing else of it survives
    mb = FakeMember(topic, batch=4)
    b = PartitionedAggregator(cfg_for(window=20), mb)
    mb.assign({0})
    _drain(b)
    assert np.array_equal(b.tasks["ev:0"].state.counts, _expected(items[40:], 0, window=2))
    assert b.tasks["ev:0"].offsets == {"ev:0": 43}
    b._merge_scan(force=True)
    releases = sorted((b.cfg["release"]["dir"] and Path(b.cfg["release"]["dir"])).glob("*.json"))
    assert [json.loads(r.read_text())["n"] for r in releases] == [20, 20]


def test_windows_close_per_partition_and_merge_once(cfg_for, tmp_path):
    topic = FakeTopic("ev", 3)
    rng = np.random.default_rng(5)
    items = {p: rng.integers(0, D, 25).tolist() for p in range(3)}
    for p, its in items.items():
        for i in its:
            topic.produce(i, p)
    members = [FakeMember(topic) for _ in range(3)]
    aggs = [PartitionedAggregator(cfg_for(window=10), m) for m in members]
    for p, m in enumerate(members):
        m.assign({p})
    _drain(*aggs)
    for a in aggs:
        a._merge_scan(force=True)
    rel = tmp_path / "rel"
    assert sorted(f.name for f in rel.glob("*.json")) == ["release-0.json", "release-1.json"]
    ledger = [json.loads(x) for x in (tmp_path / "shared" / "ledger.jsonl").read_text().split("\n")
              if x]
    kinds = [(e["kind"], e["window"]) for e in ledger if e["kind"] != "identity"]
    # each window: reserved once (before any release layer), its merged document ledgered once
    assert sorted(kinds) == [("release", 0), ("release", 1), ("release-document", 0),
                             ("release-document", 1)]
    assert sum(e["epsilon_spent"] for e in ledger) == 2.0
    doc = json.loads((rel / "release-1.json").read_text())
    assert doc["n"] == 30 and doc["window_info"]["events"] == 30
    # the open window 2 holds the last 5 events of each partition
    for p, a in enumerate(aggs):
        assert a.tasks[f"ev:{p}"].window == dict(a.tasks[f"ev:{p}"].window, id=2, events=5)
        assert np.array_equal(a.tasks[f"ev:{p}"].state.counts, _expected(items[p][20:], p, 2))


def _observed(tmp_path, caplog, name, items_of, keyed):
    """Metrics, logs, status and the release's public fields of a scale-out run over one
    partition holding ``items_of`` (paths and times normalised; noised values left out)."""
    from prometheus_client import generate_latest
    topic = FakeTopic("ev", 1)
    for item, key in zip(items_of, keyed):
        topic.produce(item, 0, keyed=key)
    m = FakeMember(topic)
    root = tmp_path / name
    sets = [f"checkpoint.dir={root / 'shared'}", f"release.dir={root / 'rel'}",
            f"state.domain_size={D}", "window.size=1000", "scale.partitioned=true", "scale.store=directory",
            "metrics.port=-1", "release.error_bar_reps=0"]
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        a = PartitionedAggregator(load_config(overrides=sets, env={}), m)
        m.assign({0})
        _drain(a)
        a._close_task_window(a.tasks["ev:0"])
        a._merge_scan(force=True)
    timing = ("seconds", "duration", "_time", "unix", "age", "latency", "created")
    # the published release's statistics are noised values (the release itself)
    noised = ("panagg_release_distinct_items", "panagg_release_entropy",
              "panagg_release_signal_to_noise")
    metrics = [line for line in generate_latest(a.metrics.registry).decode().splitlines()
               if not any(t in line.split("{")[0].split(" ")[0] for t in timing)
               and not line.split("{")[0].split(" ")[0].startswith(noised)]
    logs = [r.getMessage().replace(str(root), "ROOT") for r in caplog.records]
    doc = json.loads((root / "rel" / "release-0.json").read_text())
    public = {k: doc[k] for k in ("n", "window", "epsilon", "model") if k in doc}
    return metrics, logs, public


def test_neighbouring_streams_show_the_same_metrics_logs_and_public_fields(tmp_path, caplog):
    """One event's item changed (with its key, or the record unkeyed): everything an operator or
    an intruder reads besides the noised release values is identical (issue "One event, one
    charge", item 4: the old per-partition count of unkeyed records told them apart)."""
    items = [40 + i % 7 for i in range(30)]
    keyed = [True] * 30
    neighbour_items = list(items)
    neighbour_items[11] = 3          # another item ...
    neighbour_keyed = list(keyed)
    neighbour_keyed[11] = False      # ... and a record not keyed by it
    a = _observed(tmp_path, caplog, "a", items, keyed)
    b = _observed(tmp_path, caplog, "b", neighbour_items, neighbour_keyed)
    assert a[0] == b[0]
    assert a[1] == b[1]
    assert a[2] == b[2] and a[2]["n"] == 30
    assert not any("keyed" in line and any(ch.isdigit() for ch in line) for line in a[1])


def test_partitioned_needs_kafka(tmp_path):
    from aggregator.service.config import ConfigError
    with pytest.raises(ConfigError, match="scale.partitioned needs source.kind = kafka"):
        load_config(overrides=["scale.partitioned=true", "scale.store=directory",
                               "source.kind=generator"], env={})
    with pytest.raises(ConfigError, match="scale.store = kafka needs source.kind = kafka"):
        load_config(overrides=["scale.partitioned=true", "source.kind=generator"], env={})


def _two_members_on_one_second_windows(cfg_for):
    """Two members on a 2-partition topic with 1 s time windows; member A owns partition 0 (five
    events, counted in its first window w0), member B owns nothing yet."""
    topic = FakeTopic("ev", 2)
    for i in range(5):
        topic.produce(i, 0)
    ma, mb = FakeMember(topic), FakeMember(topic)
    a = PartitionedAggregator(cfg_for(window=1, **{"window.kind": "time"}), ma)
    b = PartitionedAggregator(cfg_for(window=1, **{"window.kind": "time"}), mb)
    ma.assign({0})
    a.step(0)
    return ma, mb, a, b, a.tasks["ev:0"].window["id"]


def test_time_windows_align_and_a_late_partition_fills_in_noise_only(cfg_for, tmp_path):
    """Time windows are aligned to the epoch; a partition first owned after other partitions
    closed a window writes a noise-only summary for it, so that window's release is not stuck."""
    import time
    ma, mb, a, b, w0 = _two_members_on_one_second_windows(cfg_for)
    assert w0 == int(time.time()) or w0 == int(time.time()) - 1
    assert a.tasks["ev:0"].window["started_unix"] == w0
    time.sleep(max(0.0, w0 + 1.05 - time.time()))
    a.step(0)  # closes w0 for partition 0; partition 1 has no owner yet
    assert a.tasks["ev:0"].window["id"] > w0
    assert not (tmp_path / "rel" / f"release-{w0}.json").exists()
    mb.assign({1})
    b.step(0)
    b._merge_scan(force=True)
    doc = json.loads((tmp_path / "rel" / f"release-{w0}.json").read_text())
    assert doc["n"] == 5 and doc["domain"]["partitions"] == 2
    assert doc["window_info"]["kind"] == "time"


def test_inconsistent_window_is_set_aside_not_fatal(cfg_for, tmp_path, caplog):
    """Summaries that cannot be merged (here: different epsilons) stop that window's release
    with one error, not the process."""
    m = FakeMember(FakeTopic("ev", 2))
    a = PartitionedAggregator(cfg_for(), m)
    wdir = a.windows_dir / "0"
    wdir.mkdir()
    for i, eps in enumerate((1.0, 2.0)):
        s = PanPrivateHistogram(eps, size=D, rng=np.random.default_rng(i))
        doc = partition_summary(s, model="joint", window=0, partition=i, partitions=2,
                                window_info=INFO, rng=np.random.default_rng(9))
        (wdir / f"summary-{i}.json").write_text(json.dumps(doc))
    with caplog.at_level(logging.ERROR, logger="panagg.scaleout"):
        a._merge_scan(force=True)
    assert (wdir / "unmergeable").exists() and not (tmp_path / "rel").exists()
    assert any("cannot be merged" in r.getMessage() for r in caplog.records)
    assert a.metrics.windows_waiting._value.get() == 0


def test_merge_scan_survives_a_window_cleaned_up_meanwhile(cfg_for, tmp_path):
    """A merge (here or in another process) may remove an old published window directory after
    this scan listed it: the scan goes on (a bench run once died of FileNotFoundError here)."""
    m = FakeMember(FakeTopic("ev", 1))
    a = PartitionedAggregator(cfg_for(), m)
    a.restore()
    a.ledger.append(entry_id=f"release-doc-{a._window_uid(5)}", kind="release-document",
                    window=5, document="{}", model="joint")
    (a.windows_dir / "5").mkdir()
    listed = list(a.windows_dir.iterdir())
    import shutil
    shutil.rmtree(a.windows_dir / "5")
    for wdir in listed:
        assert a._try_merge(int(wdir.name)) is True
    assert not (a.windows_dir / "5").exists()


def test_handed_over_partition_stops_reporting_lag(cfg_for):
    topic = FakeTopic("ev", 2)
    m = FakeMember(topic)
    m.lag = lambda positions=None: {"ev:0": 3, "ev:1": 4}
    a = PartitionedAggregator(cfg_for(), m)
    m.assign({0, 1})
    a.step(0)
    a._last_lag = 0.0
    a._update_lag()
    m.assign({0})
    a.step(0)
    a._last_lag = 0.0
    a._update_lag()  # the source's cached lag still names ev:1
    lag = {s.labels["partition"]: s.value for s in a.metrics.lag.collect()[0].samples}
    assert lag == {"ev:0": 3.0}


SUMMARY_FIELDS = {"format", "version", "window", "partition", "partitions", "mode", "size",
                  "epsilon", "neighbor", "p", "layers", "model", "n", "window_info", "values"}


def test_nothing_raw_or_seeded_in_the_shared_directory(cfg_for, tmp_path):
    """Hashed mode, string items: after windows close and merge, no file in the shared directory
    or the release directory contains an item, and summaries carry exactly their fields (noisy
    value counts, no seed, no key)."""
    topic = FakeTopic("ev", 2)
    names = [f"secret-account-{k:05d}" for k in range(40)]
    rng = np.random.default_rng(8)
    for _ in range(60):
        name = names[int(rng.integers(0, len(names)))]
        topic.produce(name, zlib.crc32(name.encode()) % 2)  # fixed: hash() is salted per run
    members = [FakeMember(topic), FakeMember(topic)]
    seed = 918273645
    cfg = cfg_for(window=12, **{"state.mode": "hashed", "state.buckets": 64,
                                "testing.noise_seed": seed})
    aggs = [PartitionedAggregator(cfg, m) for m in members]
    for p, m in enumerate(members):
        m.assign({p})
    _drain(*aggs)
    for a in aggs:
        a._merge_scan(force=True)
        a.close()
    summaries = list((tmp_path / "shared" / "windows").rglob("summary-*.json"))
    assert summaries and list((tmp_path / "rel").glob("release-*.json"))
    for path in summaries:
        assert set(json.loads(path.read_text())) == SUMMARY_FIELDS
    files = [p for p in (tmp_path / "shared").rglob("*") if p.is_file()]
    files += [p for p in (tmp_path / "rel").rglob("*") if p.is_file()]
    for path in files:
        data = path.read_bytes()
        assert not any(name.encode() in data for name in names), path
        if path.name != "config.json":  # the effective config names the test seed, nothing else
            assert str(seed).encode() not in data and seed.to_bytes(8, "little") not in data, path


def test_audit_export_collects_every_members_partitions(cfg_for, tmp_path, monkeypatch):
    """`panagg audit export` in partitioned mode: each running member exports the partitions it
    owns, each with fresh layers before and after, signed and ledgered; the command returns once
    every held partition is exported."""
    import threading

    from aggregator.service.cli import _export_partitioned
    from state_store.audit import read_export

    key_hex = "5a" * 32
    monkeypatch.setenv("PANAGG_AUDIT_KEY", key_hex)
    topic = FakeTopic("ev", 2)
    for i in range(20):
        topic.produce(i % D, i % 2)
    members = [FakeMember(topic), FakeMember(topic)]
    aggs = [PartitionedAggregator(cfg_for(**{"source.instance_id": f"m{k}"}), m)
            for k, m in enumerate(members)]
    for p, m in enumerate(members):
        m.assign({p})
    _drain(*aggs)
    before = {p: a.tasks[f"ev:{p}"].state.counts.copy() for p, a in enumerate(aggs)}
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            for a in aggs:
                a.step(0)

    worker = threading.Thread(target=serve)
    worker.start()
    try:
        paths = _export_partitioned(aggs[0].cfg, timeout_s=30)
    finally:
        stop.set()
        worker.join()
    assert len(paths) == 2
    for p, path in enumerate(sorted(paths)):
        doc = read_export(path, bytes.fromhex(key_hex))
        snap = PanPrivateHistogram.deserialize(doc["state"])
        task = aggs[p].tasks[f"ev:{p}"]
        assert snap.layers == 2 and task.state.layers == 3 and snap.n == 10
        assert not np.array_equal(snap.counts, before[p])  # a fresh layer before the snapshot
        assert not np.array_equal(snap.counts, task.state.counts)  # and one after it
        assert doc["offsets"] == {f"ev:{p}": 10}
    ledger = [json.loads(x) for x in (tmp_path / "shared" / "ledger.jsonl").read_text().split("\n")
              if x]
    assert sorted(e["kind"] for e in ledger) == ["export", "export", "identity"]
    assert not list((tmp_path / "shared" / "control").glob("*"))  # request and answers cleaned


def test_audit_export_needs_running_members(cfg_for):
    from aggregator.service.cli import UsageError, _export_partitioned
    with pytest.raises(UsageError, match="no partitioned aggregator holds a partition"):
        _export_partitioned(cfg_for(), timeout_s=1)


def test_other_settings_are_refused_before_any_partition_is_taken(cfg_for):
    from aggregator.service import ServiceError
    topic = FakeTopic("ev", 1)
    topic.produce(3, 0)
    m = FakeMember(topic)
    a = PartitionedAggregator(cfg_for(), m)
    m.assign({0})
    _drain(a)
    a._drop(a.tasks["ev:0"])
    m2 = FakeMember(topic)
    b = PartitionedAggregator(cfg_for(**{"state.epsilon": 2.0}), m2)
    m2.assign({0})
    with pytest.raises(ServiceError, match=r"belongs to other settings \(epsilon 1.0 -> 2.0.*"
                                           "--accept-change"):
        b.step(0)
    assert "ev:0" not in b.tasks
    assert a._take("ev:0")  # the refused process never held the lock
    # a refused run writes nothing either: not even the config.json offline commands reuse
    c = PartitionedAggregator(cfg_for(**{"state.epsilon": 2.0}), FakeMember(topic))
    with pytest.raises(ServiceError, match="belongs to other settings"):
        c.run()
    assert not (Path(c.cfg["checkpoint"]["dir"]) / "config.json").exists()


def test_a_partition_first_taken_before_the_previous_window_exists_still_contributes(cfg_for,
                                                                                      tmp_path):
    """The race of a withheld window: member B takes partition 1 for the first time just after
    a boundary, before member A has closed the previous window (no directory for it exists yet).
    B's set of windows comes from the group's first window and the clock, not from directory
    listings, so it writes its noise-only summary and the window is released."""
    import time
    ma, mb, a, b, w0 = _two_members_on_one_second_windows(cfg_for)
    time.sleep(max(0.0, w0 + 1.05 - time.time()))
    assert not (a.windows_dir / str(w0)).exists()
    mb.assign({1})
    b.step(0)  # first owner of partition 1, before partition 0 closed w0
    assert b.tasks["ev:1"].window["id"] > w0
    a.step(0)  # now partition 0 closes w0
    a._merge_scan(force=True)
    doc = json.loads((tmp_path / "rel" / f"release-{w0}.json").read_text())
    assert doc["n"] == 5 and doc["domain"]["partitions"] == 2
    assert a.metrics.windows_waiting._value.get() == 0


def test_a_refused_window_leaves_no_summary_to_rebuild_it(cfg_for, tmp_path):
    """The ledger is asked before any partition draws its release layer: a window the budget
    refuses gets no summary from any partition, so no deterministic merge can rebuild it."""
    topic = FakeTopic("ev", 2)
    for i in range(40):
        topic.produce(i % D, i % 2)
    members = [FakeMember(topic), FakeMember(topic)]
    aggs = [PartitionedAggregator(cfg_for(window=10, **{"ledger.budget_total": 1.0}), m)
            for m in members]
    for p, m in enumerate(members):
        m.assign({p})
    _drain(*aggs)
    for a in aggs:
        a._merge_scan(force=True)
    assert [f.name for f in (tmp_path / "rel").glob("*.json")] == ["release-0.json"]
    assert list((tmp_path / "shared" / "windows").glob("1/summary-*.json")) == []
    ledger = [json.loads(x) for x in (tmp_path / "shared" / "ledger.jsonl").read_text().split("\n")
              if x]
    assert [(e["kind"], e["window"]) for e in ledger if e["kind"] == "refused"] == [("refused", 1)]
    assert sum(e["epsilon_spent"] for e in ledger) == 1.0
