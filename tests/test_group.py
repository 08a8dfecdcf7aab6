"""Kafka-only scale-out (scale.store = kafka), the parts that need no broker: the domain split,
the merge of slice summaries, the identity check and the config's refusals. The real-broker
tests are in tests/integration/test_group_kafka.py."""

import numpy as np
import pytest

from aggregator.estimate import noisy_value_counts
from aggregator.service.config import ConfigError, load_config
from aggregator.service.group.repartition import slice_size
from aggregator.service.group.service import GroupService
from aggregator.service.group.topics import GroupTopics
from aggregator.service.metrics import Metrics
from aggregator.service.group.summary import _value_counts, merge_summaries, partition_summary
from aggregator.service.process import ServiceError
from aggregator.state import PanPrivateHistogram
from tests.helpers.event_time import contiguous_stream


@pytest.mark.parametrize("D,P", [(1, 1), (10, 3), (1000, 6), (1001, 12), (5, 8)])
def test_the_slices_cover_the_domain_once(D, P):
    sizes = [slice_size(D, P, p) for p in range(P)]
    assert sum(sizes) == D
    owners = np.arange(D) % P
    assert sizes == [int(np.count_nonzero(owners == p)) for p in range(P)]


def test_merged_slice_summaries_are_one_state_of_D_counters():
    D, P = 997, 6
    rng = np.random.default_rng()
    items = rng.integers(0, D, 5000)
    states = [PanPrivateHistogram(1.0, size=slice_size(D, P, p)) for p in range(P)]
    for p, st in enumerate(states):
        st.add_indices(items[items % P == p] // P)
    info = {"kind": "time", "size": 2.0, "events": 0, "started_unix": 0.0, "ended_unix": 2.0}
    summaries = []
    for p, st in enumerate(states):
        s = partition_summary(
            st,
            model="state-only",
            window=7,
            partition=p,
            partitions=P,
            window_info=dict(info, events=st.n),
        )
        summaries.append(s)
    # the value counts of the P slices are those of the one D-counter vector they form
    whole = np.concatenate([st.counts for st in states])
    assert len(whole) == D
    vc = _value_counts(summaries[0])
    for s in summaries[1:]:
        vc = vc.merge(_value_counts(s))
    one = noisy_value_counts(whole)
    assert vc.lo == one.lo and np.array_equal(vc.c, one.c)
    release = merge_summaries(summaries, error_bar_reps=0)
    assert release["n"] == len(items)
    assert release["domain"]["size"] == D and release["domain"]["counters"] == D


def test_internal_topic_names_follow_the_group():
    t = GroupTopics("logins")
    assert {t.repartition, t.summaries, t.ledger, t.releases} == {
        "logins.panagg.repartition",
        "logins.panagg.summaries",
        "logins.panagg.ledger",
        "logins.panagg.releases",
    }
    wanted = t.wanted(6, 3600_000)
    assert wanted[t.ledger][0] == 1 and wanted[t.ledger][1]["cleanup.policy"] == "compact"
    # a quarter-retention segment: the broker deletes whole segments only, so without it a
    # quiet topic's plaintext indices would outlive retention.ms by the broker's week
    assert wanted[t.repartition] == (
        6,
        {"cleanup.policy": "delete", "retention.ms": "3600000", "segment.ms": "900000"},
    )
    assert t.repartition not in t.wanted(6, 3600_000, views=True)
    # a views group has a snapshots topic only when it takes in-window snapshots
    assert t.snapshots not in t.wanted(6, 3600_000, views=True)
    assert t.wanted(6, 3600_000, views=True, snapshots=True)[t.snapshots][0] == 6


def _cfg(*extra):
    return load_config(
        None,
        overrides=[
            "scale.partitioned=true",
            "scale.store=kafka",
            "scale.exchange=items",
            "window.kind=time",
            "window.size=60",
            *extra,
        ],
    )


@pytest.mark.parametrize(
    "extra,said",
    [
        (
            ["window.kind=count", "checkpoint.snapshots_per_window=2"],
            "set checkpoint.snapshots_per_window = 0",
        ),
        (["source.kind=file", "source.path=x"], "needs source.kind = kafka"),
        (["state.model=shuffle"], "does not apply to state.model = shuffle"),
    ],
)
def test_what_the_kafka_store_cannot_do_is_refused_in_one_line(extra, said):
    with pytest.raises(ConfigError) as err:
        _cfg(*extra)
    msg = str(err.value)
    assert said in msg and "scale.store = kafka" in msg and "\n" not in msg


def test_source_start_only_places_a_new_group():
    """A member asking another source.start than the group started with is refused in one
    line (it would resume from the group's offsets: the setting silently ignored)."""
    pipe = GroupService(_cfg("source.start=latest"), Metrics()).pipelines[0]
    pipe.identity = dict(pipe.identity_of_config(6), start="earliest")
    with pytest.raises(ServiceError) as err:
        pipe._check_start()
    msg = str(err.value)
    assert "only places a new group" in msg and "another source.group" in msg
    assert "\n" not in msg
    pipe.identity["start"] = "latest"
    pipe._check_start()  # the group's own start: fine
    earliest = GroupService(_cfg(), Metrics()).pipelines[0]
    earliest.identity = dict(earliest.identity_of_config(6), start="latest")
    earliest._check_start()  # no source.start: resume wherever the group is


def test_a_member_with_other_settings_than_its_group_is_refused():
    pipe = GroupService(_cfg("state.epsilon=2"), Metrics()).pipelines[0]
    pipe.identity = dict(pipe.identity_of_config(6), epsilon=1.0)
    with pytest.raises(ServiceError) as err:
        pipe.check_identity(pipe.identity_of_config(6))
    assert "state.epsilon = 1.0" in str(err.value) and "another source.group" in str(err.value)
    pipe.identity = pipe.identity_of_config(6)
    with pytest.raises(ServiceError, match="scale.partitions = 6"):
        pipe.check_identity(pipe.identity_of_config(3))


def test_several_aggregations_are_one_pipeline_each_with_their_own_topics():
    svc = GroupService(
        _cfg(
            "ledger.budget_per_event=2",
            "aggregations.user.item.field=user",
            "aggregations.ip.item.field=ip",
            "aggregations.ip.state.mode=hashed",
        ),
        Metrics(),
    )
    assert [p.name for p in svc.pipelines] == ["ip", "user"]
    assert {p.topics.ledger for p in svc.pipelines} == {
        "panagg.panagg.ip.ledger",
        "panagg.panagg.user.ledger",
    }
    assert [p.direct for p in svc.pipelines] == [False, True]


def test_fresh_start_does_not_apply_to_a_group():
    with pytest.raises(ServiceError, match="another source.group"):
        GroupService(_cfg(), Metrics(), fresh_start=True)


def test_a_state_directory_with_a_ledger_is_never_taken_over_by_a_member(tmp_path):
    (tmp_path / "ledger.jsonl").write_text("")
    svc = GroupService(
        _cfg(f"checkpoint.dir={tmp_path}", "source.bootstrap=127.0.0.1:1"), Metrics()
    )
    with pytest.raises(ServiceError) as err:
        svc.start()
    assert "empty scratch checkpoint.dir" in str(err.value) and "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.jsonl"]  # nothing written


# -- the summary and the merge (aggregator.service.group.summary) ---------------------------------
INFO = {"kind": "time", "size": 10, "events": 10, "started_unix": 1.0, "ended_unix": 2.0}


def _summaries(states, model="state-only", window=0):
    return [
        partition_summary(
            s,
            model=model,
            window=window,
            partition=i,
            partitions=len(states),
            window_info=INFO,
            rng=np.random.default_rng([7, i]),
        )
        for i, s in enumerate(states)
    ]


def test_hashed_slices_merge_into_the_release_of_their_concatenation():
    from aggregator.anonymize import anonymized_histogram

    rng = np.random.default_rng(1)
    states = []
    for i in range(3):
        s = PanPrivateHistogram(
            1.0, buckets=400, key=bytes([i + 1]) * 16, rng=np.random.default_rng([5, i])
        )
        s.update([f"user-{k}" for k in rng.zipf(1.5, 500) if k < 10**6])
        states.append(s)
    rel = merge_summaries(_summaries(states))
    whole = np.concatenate([s.counts for s in states])
    n = sum(s.n for s in states)
    expect = anonymized_histogram(whole, states[0].p, n=n, buckets=1200)
    got = np.repeat(*np.array(rel["histogram"]["pairs"]).T)
    assert np.array_equal(np.sort(got)[::-1], expect)
    assert rel["n"] == n and rel["domain"] == {
        "mode": "hashed",
        "size": 1200,
        "counters": 1200,
        "partitions": 3,
    }


def test_a_merged_release_is_the_one_state_release_whatever_P():
    """Zipf items over D counters split into P = 6 slices, joint model: the merged release equals
    the release of the one D-counter state the slices form (with the same release layers)."""
    from aggregator.anonymize import anonymized_histogram

    Dz, P, eps = 20_000, 6, 1.0
    rng = np.random.default_rng(17)
    items = np.minimum(rng.zipf(1.1, 200_000) - 1, Dz - 1)
    parts = []
    for p in range(P):
        s = PanPrivateHistogram(eps, size=slice_size(Dz, P, p), rng=np.random.default_rng([2, p]))
        mine = items[items % P == p] // P
        s.add_indices(mine)
        parts.append(s)
    merged = merge_summaries(_summaries(parts, model="joint"))
    from aggregator.noise import discrete_laplace

    layered = np.concatenate(
        [
            s.counts + discrete_laplace(s.p, s.size, rng=np.random.default_rng([7, i]))
            for i, s in enumerate(parts)
        ]
    )
    expect = anonymized_histogram(noisy_value_counts(layered), parts[0].p, layers=2, n=200_000)
    got = np.repeat(*np.array(merged["histogram"]["pairs"]).T)
    assert np.array_equal(np.sort(got)[::-1], expect) and merged["n"] == 200_000


def test_merge_refuses_incomplete_or_inconsistent_windows():
    a = PanPrivateHistogram(1.0, size=50, rng=np.random.default_rng(1))
    b = PanPrivateHistogram(2.0, size=50, rng=np.random.default_rng(2))
    both = _summaries([a, a])
    with pytest.raises(ValueError, match="partitions 0..1"):
        merge_summaries(both[:1])
    with pytest.raises(ValueError, match="disagree"):
        merge_summaries(_summaries([a, b]))
    with pytest.raises(ValueError, match="no summaries"):
        merge_summaries([])


def test_the_removed_shared_directory_store_is_refused_with_the_way_on():
    with pytest.raises(ConfigError) as err:
        _cfg("scale.store=directory")
    msg = str(err.value)
    assert "was removed" in msg and "same source.group" in msg and "\n" not in msg


def test_a_forced_release_closes_the_clock_window_or_the_next_undecided_one():
    """panagg release closes the window open now; asked twice within one window (the first
    forced close already decided it), it closes the next one, never a decided window again."""
    from aggregator.service.group.forced import forced_window

    assert forced_window(60.0, next_undecided=10, now=60.0 * 20 + 5) == 20
    assert forced_window(60.0, next_undecided=21, now=60.0 * 20 + 5) == 21
    assert forced_window(2.5, next_undecided=0, now=10.0) == 4


def test_an_export_slice_set_is_one_state_in_the_intakes_counter_order():
    """Counter i of the group is slice i mod P's counter i div P: the assembled export holds
    each counter where one process would, every slice at the same layer count, n summed."""
    from aggregator.service.group.export import assemble
    from aggregator.service.group.repartition import slice_size
    from aggregator.state import PanPrivateHistogram

    D, P = 11, 3
    truth = np.arange(D) * 100  # far above the noise: each counter recognisable
    slices = []
    for p in range(P):
        st = PanPrivateHistogram(1.0, size=slice_size(D, P, p))
        mine = truth[p::P]
        st.add_indices(np.repeat(np.arange(len(mine)), mine))
        st.rerandomize()
        slices.append({"state": st.serialize(), "partition": p})
    whole = assemble(slices)
    assert whole.size == D and whole.layers == 2 and whole.n == int(truth.sum())
    assert np.all(np.abs(whole.counts - truth) < 50)


def test_a_window_merges_partitions_at_different_layer_counts_at_the_most():
    """A partition that exported its window holds two more layers; the merge adds fresh
    layers to the others (never refuses the window) and states the count it used."""
    from aggregator.service.group.summary import merge_summaries, partition_summary
    from aggregator.state import PanPrivateHistogram

    info = {"kind": "time", "size": 60.0, "events": 0, "started_unix": 0.0, "ended_unix": 60.0}
    parts = [PanPrivateHistogram(1.0, size=500) for _ in range(2)]
    parts[0].add_indices(np.repeat(np.arange(50), 20))
    parts[1].rerandomize()
    parts[1].rerandomize()  # as an export leaves it
    summaries = [
        partition_summary(s, model="joint", window=3, partition=p, partitions=2, window_info=info)
        for p, s in enumerate(parts)
    ]
    assert [s["layers"] for s in summaries] == [2, 4]
    release = merge_summaries(summaries, error_bar_reps=0)
    assert release["layers"] == 4 and release["n"] == 1000
    assert release["domain"]["counters"] == 1000


# -- event-time windows in a group (watermark.py, event_windows.py) ---------------------------
from aggregator.service.group.event_windows import EventSlice  # noqa: E402
from aggregator.service.group.watermark import (  # noqa: E402
    MarkRecord,
    closable_upto,
    low_watermark,
    opening_window,
    stamp,
)


@pytest.mark.parametrize("lateness", [0, 4])
def test_the_intake_stamps_every_record_as_one_process_would(lateness):
    """The group's rule (each record's window from its own source partition's earlier records,
    at intake; records before the first window late at the counting partition, which knows it
    from the leader's opening marker: the earliest first record's window) against the
    one-process reference of tests/test_event_time_lateness.py, record by record, late ones
    included, on windows that each have records."""
    from tests.helpers.event_time import SIZE, reference

    rng = np.random.default_rng()
    stream = contiguous_stream(rng, lateness=lateness, size=SIZE)
    item = iter(range(10**6))
    parts = {p: [(t / 1000, next(item)) for t in ts] for p, ts in stream.items()}
    where, windows = reference(parts, lateness, "next")
    marks = {
        p: MarkRecord(None, first_ms=int(round(recs[0][0] * 1000))) for p, recs in parts.items()
    }
    first = opening_window(marks, list(parts), now_ms=0, idle_timeout_ms=0, size_ms=SIZE * 1000)
    assert first == min(int(recs[0][0] // SIZE) for recs in parts.values())
    counting = EventSlice(closed=first - 1, summarized=first - 1, make_state=None)
    mine: dict[int, list] = {}
    n_late = 0
    for p, recs in parts.items():
        ts = np.array([int(round(t * 1000)) for t, _ in recs])
        window, late, passed = stamp(ts, None, size_ms=SIZE * 1000, lateness_ms=lateness * 1000)
        assert passed == ts.max()
        for (_, it), w, x in zip(recs, window, late):
            w, x = counting.window_of(int(w), bool(x))
            mine[it] = w
            n_late += x
    assert mine == where
    assert n_late == sum(late for _, late in windows.values()) > 0


def test_stamping_in_pieces_equals_stamping_at_once():
    """A source partition's records stamped over several polls (and members: the watermark
    carried in the intake topic) get the windows of one pass."""
    rng = np.random.default_rng()
    ts = np.array(contiguous_stream(rng, parts=1)[0])
    whole = stamp(ts, None, size_ms=10_000, lateness_ms=4000, first_window=0)
    passed, pieces = None, []
    for chunk in np.array_split(ts, 7):
        w, late, passed = stamp(chunk, passed, size_ms=10_000, lateness_ms=4000, first_window=0)
        pieces.append((w, late))
    assert np.array_equal(np.concatenate([w for w, _ in pieces]), whole[0])
    assert np.array_equal(np.concatenate([x for _, x in pieces]), whole[1])


def test_the_low_watermark_waits_for_every_partition_but_not_for_idle_ones():
    srcs = ["t:0", "t:1", "t:2"]
    marks = {"t:0": MarkRecord(25_000), "t:1": MarkRecord(31_000)}
    assert low_watermark(marks, srcs, now_ms=100_000, idle_timeout_ms=0) is None
    marks["t:2"] = MarkRecord(12_000, idle_since_ms=90_000)
    assert low_watermark(marks, srcs, now_ms=100_000, idle_timeout_ms=0) == 12_000
    assert low_watermark(marks, srcs, now_ms=100_000, idle_timeout_ms=20_000) == 12_000
    assert low_watermark(marks, srcs, now_ms=100_000, idle_timeout_ms=5_000) == 25_000
    # every partition idle: all were read to their end
    idle = {s: MarkRecord(v, 0) for s, v in zip(srcs, (5, 9, 7))}
    assert low_watermark(idle, srcs, now_ms=10, idle_timeout_ms=1) == 9
    # window K closes once the watermark reaches its end plus the lateness
    assert closable_upto(24_999, size_ms=10_000, lateness_ms=5000) == 0
    assert closable_upto(25_000, size_ms=10_000, lateness_ms=5000) == 1
    assert MarkRecord.decode(MarkRecord(5, 7).encode()).idle_since_ms == 7


def _log(rng, windows=8, msgs=120):
    """A repartition partition's log: (offset, window, late, events) messages whose windows
    advance with the log, markers ("close", K) as a leader would place them."""
    log, closed, cur = [], -1, 0
    for off in range(msgs):
        if rng.random() < 0.12 and cur - 1 > closed:
            closed = int(rng.integers(closed + 1, cur))
            log.append((off, "close", closed))
            continue
        cur = min(windows - 1, cur + int(rng.random() < 0.1))
        w = int(rng.integers(max(0, cur - 2), cur + 1))
        log.append((off, w, bool(rng.random() < 0.1), int(rng.integers(0, 4))))
    log.append((msgs, "close", windows - 1))
    return log


def _run(log, sl, start, summarized, crash_at=None):
    """Feed ``log`` from ``start`` the way counter.py does; returns (summaries {window: n},
    the last committed (offset, k, c)) and stops before ``crash_at``."""
    out, committed = {}, None
    for off, a, b, *rest in log[start:]:
        if crash_at is not None and off >= crash_at:
            break
        if a == "close":
            if sl.marker(b):
                for w, live in sl.to_close(b):
                    out[w] = live.state.n if live else 0
                committed = (*sl.resume_point(b, off + 1), b)
                sl.closed_at(b)
            continue
        sl.add(off, a, b, np.zeros(rest[0], dtype=np.int64))
    return out, committed


def test_a_partition_replayed_from_its_commit_summarizes_each_window_once_with_its_events():
    """Markers close windows; a crash at any message and a replay from the committed offset with
    its metadata (k: closed there, c: summarized) give every window exactly the events of a run
    without the crash, late ones (after their window's marker) in the window after it."""
    rng = np.random.default_rng()
    make = lambda: PanPrivateHistogram(1.0, size=4)  # noqa: E731
    for _ in range(30):
        log = _log(rng)
        whole, _ = _run(log, EventSlice(closed=-1, summarized=-1, make_state=make), 0, -1)
        expected = sum(r[3] for r in log if r[1] != "close")
        assert sum(whole.values()) == expected and sorted(whole) == list(range(8))
        crash = int(rng.integers(1, len(log)))
        first, committed = _run(
            log, EventSlice(closed=-1, summarized=-1, make_state=make), 0, -1, crash_at=crash
        )
        start, k, c = committed if committed else (0, -1, -1)
        rest, _ = _run(log, EventSlice(closed=k, summarized=c, make_state=make), start, c)
        assert not set(first) & set(rest), "a window summarized twice"
        assert {**first, **rest} == whole


def test_late_messages_after_a_marker_count_in_the_next_window_or_are_rejected():
    make = lambda: PanPrivateHistogram(1.0, size=4)  # noqa: E731
    sl = EventSlice(closed=4, summarized=4, make_state=make)
    assert sl.add(10, 3, False, np.array([0, 1])) == (2, 0)  # window 3 closed: late -> 5
    assert sl.live[5].late == 2 and sl.live[5].events == 2
    dead = EventSlice(closed=4, summarized=4, make_state=make, late_policy="dead_letter")
    assert dead.add(10, 3, False, np.array([0, 1])) == (0, 2)
    assert dead.add(11, 6, False, np.array([0])) == (1, 0) and 5 not in dead.live


def test_a_group_takes_event_time_windows_and_keeps_intake_time_unless_asked():
    cfg = _cfg(
        "window.kind=event_time",
        "window.allowed_lateness_s=20",
        "source.kind=kafka",
        "source.topic=t",
    )
    assert cfg.window.kind == "event_time"
    auto = _cfg("source.kind=kafka", "source.topic=t")
    assert auto["window"]["kind"] == "time"  # window.clock = auto: intake time in a group
    record = _cfg("source.kind=kafka", "source.topic=t", "window.clock=record")
    assert record["window"]["kind"] == "event_time"


class _FakeIntakeConsumer:
    """What Repartitioner._pace asks of the intake's consumer and the intake topic's reader."""

    def __init__(self, tps):
        self.tps, self._paused = set(tps), set()

    def assignment(self):
        return set(self.tps)

    def subscription(self):
        return {tp.topic for tp in self.tps}

    def partitions_for_topic(self, topic):
        return {tp.partition for tp in self.tps if tp.topic == topic}

    def paused(self):
        return set(self._paused)

    def pause(self, *tps):
        self._paused |= set(tps)

    def resume(self, *tps):
        self._paused -= set(tps)

    # the reader of the intake topic: empty
    def assign(self, tps):
        pass

    def seek_to_beginning(self, *tps):
        pass

    def end_offsets(self, tps, timeout_ms=None):
        return {tp: 0 for tp in tps}

    def position(self, tp):
        return 0

    def poll(self, timeout_ms=0, max_records=None):
        return {}


def test_the_intake_pauses_a_partition_running_ahead_of_the_low_watermark():
    """A source partition more than MAX_AHEAD_WINDOWS windows past the low watermark is paused
    (its records would open ever more live windows in the counting partitions) and resumed once
    the watermark follows; the partition holding the watermark is never paused."""
    from kafka import TopicPartition

    from aggregator.service.group.repartition import EventClock, Repartitioner, Route

    tps = [TopicPartition("t", p) for p in range(3)]
    consumer = _FakeIntakeConsumer(tps)
    clock = EventClock(
        size_s=10, lateness_s=2, max_future_skew_s=300, late="next", idle_timeout_s=0
    )
    rp = Repartitioner(
        consumer,
        None,
        [Route("g.panagg.repartition", 4, None, None, None, clock=clock)],
        marks_topic="g.panagg.intake",
        marks_reader=_FakeIntakeConsumer([]),
    )

    def at(**windows):
        for name, w in windows.items():
            rp.watermarks[MarkRecord.key("g.panagg.repartition", f"t:{name[1:]}")] = MarkRecord(
                w * 10_000 + 1
            )
        rp._pace()
        return sorted(tp.partition for tp in consumer.paused())

    assert at(p0=10, p1=20, p2=12) == [1]  # low watermark in window 10: 1 is 10 ahead
    assert at(p0=18) == [0, 1]  # low now 12 (partition 2): 0 runs ahead too
    assert at(p2=19) == []  # low 18: everyone within 3 windows
    assert rp.pauses == 2


class _Sent:
    def __init__(self):
        self.messages = []

    def send(self, topic, partition=None, timestamp_ms=None, headers=None, value=None, key=None):
        self.messages.append((partition, dict(headers or ()), value))


@pytest.mark.parametrize("late_policy", ["next", "dead_letter"])
def test_the_intake_writes_each_window_to_every_partition_and_handles_late_records(late_policy):
    """One message per (window, late) group and repartition partition, empty ones included;
    late records flagged (next) or rejected with reason late (dead_letter, counted in the same
    metric as one process's); records without a timestamp or from the future rejected."""
    import collections
    import time as _time

    import msgpack

    from consumers.decode import Decoder
    from aggregator.service.group.repartition import EventClock, Repartitioner, Route

    Rec = collections.namedtuple("Rec", "offset value key headers timestamp")
    now_ms = int(_time.time() * 1000)
    base = (now_ms - 3_600_000) // 10_000 * 10_000
    # windows: 0, 2 (passes window 0 + 2 s lateness), then window 0 again: late; no stamp; future
    stamps = [base + 1000, base + 21_000, base + 3000, -1, now_ms + 10**7]
    recs = [Rec(i, msgpack.packb({"item": 7 + i}), None, [], ts) for i, ts in enumerate(stamps)]
    metrics = Metrics()
    route = Route(
        "g.panagg.repartition",
        3,
        Decoder("msgpack", domain_size=100),
        lambda it: np.asarray(it, dtype=np.int64),
        metrics,
        clock=EventClock(
            size_s=10, lateness_s=2, max_future_skew_s=300, late=late_policy, idle_timeout_s=0
        ),
    )
    out = _Sent()
    from kafka import TopicPartition

    mark = Repartitioner._send_event_time(out, route, TopicPartition("src", 4), recs, now_ms, None)
    assert (mark.passed_ms, mark.first_ms) == (base + 21_000, base + 1000)
    # each message names the source positions of the poll (the budget registry's charge)
    assert {h["src"] for _, h, _ in out.messages} == {b"src:4:0:5"}
    groups = collections.Counter((h["w"], "late" in h) for _, h, _ in out.messages)
    w0, w2 = str(base // 10_000).encode(), str(base // 10_000 + 2).encode()
    w1 = str(base // 10_000 + 1).encode()
    want = {(w0, False): 3, (w2, False): 3}
    if late_policy == "next":
        want[(w1, True)] = 3  # the first window its partition had not passed
    assert dict(groups) == want
    events = sum(len(v) // 4 for _, _, v in out.messages)
    assert events == (3 if late_policy == "next" else 2)

    def rejected(reason):
        return metrics.registry.get_sample_value("panagg_decode_errors_total", {"reason": reason})

    assert rejected("no_timestamp") == 1 and rejected("future_timestamp") == 1
    assert rejected("late") == (1 if late_policy == "dead_letter" else None)


def test_the_intake_writes_a_dead_letter_per_rejected_record_in_its_transaction():
    """source.dead_letter_topic in a group: each rejected record (bad input, no timestamp, from
    the future, late under late = dead_letter) gets its dead letter, keyed by its source position,
    sent with the intake's messages (one transaction: exactly when its offset commits). Filtered
    records are not rejects. It was silently ignored before."""
    import collections
    import time as _time

    import msgpack
    from kafka import TopicPartition

    from consumers.decode import Decoder
    from aggregator.service.group.repartition import EventClock, Repartitioner, Route

    sent = []

    class Producer:
        def send(
            self, topic, partition=None, timestamp_ms=None, headers=None, value=None, key=None
        ):
            sent.append((topic, key, dict(headers or ())))

    Rec = collections.namedtuple("Rec", "offset value key headers timestamp")
    now_ms = int(_time.time() * 1000)
    base = (now_ms - 3_600_000) // 10_000 * 10_000
    stamps = [base + 1000, base + 21_000, base + 3000, -1, now_ms + 10**7, base + 4000]
    values = [msgpack.packb({"item": 7 + i}) for i in range(5)] + [b"\xc1 not msgpack"]
    recs = [Rec(100 + i, v, b"k", [], ts) for i, (v, ts) in enumerate(zip(values, stamps))]
    tp = TopicPartition("src", 0)
    route = Route(
        "g.panagg.repartition",
        3,
        Decoder("msgpack", domain_size=100),
        lambda it: np.asarray(it, dtype=np.int64),
        Metrics(),
        clock=EventClock(
            size_s=10, lateness_s=2, max_future_skew_s=300, late="dead_letter", idle_timeout_s=0
        ),
        name="users",
        dead_topic="dl",
    )
    Repartitioner._send_event_time(Producer(), route, tp, recs, now_ms, None)
    dead = {key: h["reason"] for topic, key, h in sent if topic == "dl"}
    assert dead == {
        b"src:0@102#users": b"late",
        b"src:0@103#users": b"no_timestamp",
        b"src:0@104#users": b"future_timestamp",
        b"src:0@105#users": b"undecodable",
    }, dead
    # counted as one process counts them (the PanaggDeadLetters alert reads it)
    assert route.metrics.registry.get_sample_value("panagg_dead_letters_total") == 4
    # by intake time, the same path (bad input only)
    sent.clear()
    plain = Route(
        "g.panagg.repartition",
        3,
        Decoder("msgpack", domain_size=100),
        lambda it: np.asarray(it, dtype=np.int64),
        Metrics(),
        dead_topic="dl",
    )
    Repartitioner._send(Producer(), plain, tp, recs, now_ms)
    assert [(k, h["reason"]) for t, k, h in sent if t == "dl"] == [(b"src:0@105", b"undecodable")]


class _Admin:
    """A KafkaAdminClient that knows the topics ``have`` (3 partitions each) and records
    every call that would write."""

    def __init__(self, have, writes):
        self.have, self.writes = set(have), writes

    def describe_topics(self, names):
        return [{"topic": n, "partitions": [{}, {}, {}]} for n in names if n in self.have]

    def list_topics(self):
        return sorted(self.have)

    def create_topics(self, *a, **k):
        self.writes.append("create_topics")

    def close(self):
        pass


def test_a_missing_release_topic_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """deploy/kubernetes sets release.topic: the leader sends each release there in the
    transaction that ledgers it, so a missing topic would hold every window undecided."""
    from aggregator.service.group import service as group_service

    writes: list[str] = []
    monkeypatch.setattr(group_service, "KafkaAdminClient", lambda **kw: _Admin({"events"}, writes))
    svc = GroupService(
        _cfg(f"checkpoint.dir={tmp_path / 'scratch'}", "release.topic=panagg-releases"), Metrics()
    )
    with pytest.raises(ServiceError) as err:
        svc.start()
    assert str(err.value) == (
        "release.topic 'panagg-releases' does not exist on the cluster: create it once, "
        "compacted so that it keeps every release (kafka-topics.sh --create --topic "
        "panagg-releases --partitions 1 --config cleanup.policy=compact), or unset release.topic"
    )
    assert writes == [] and not (tmp_path / "scratch").exists()


def test_every_aggregations_ready_series_says_the_members_readiness():
    """``panagg_ready`` (the PanaggNotReady alert's series): with several aggregations the
    member's exposition is its pipelines' registries, so each must follow /ready."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    metrics = Metrics()
    svc = GroupService(
        _cfg(
            "ledger.budget_per_event=2",
            "aggregations.user.item.field=user",
            "aggregations.ip.item.field=ip",
        ),
        metrics,
    )

    def ready() -> dict[str, float]:
        text = generate_latest(metrics.registry).decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        return {s.labels["aggregation"]: s.value for s in fams["panagg_ready"].samples}

    assert ready() == {"ip": 0.0, "user": 0.0}
    svc._set_ready(True)
    assert ready() == {"ip": 1.0, "user": 1.0} and metrics.readiness()[0] == 200
    svc._set_ready(False, "Kafka errors in intake")
    assert ready() == {"ip": 0.0, "user": 0.0} and metrics.readiness()[0] == 503


def test_the_leader_shows_the_budget_and_keys_release_topic_as_one_process():
    """The budget alerts (deploy/prometheus/alerts.yml) read panagg_budget_*; a group's leader
    sets them from its ledger once a window's transaction is committed. On release.topic a
    release is keyed as one process keys it (docs/configuration.md: NAME/W)."""
    from types import SimpleNamespace

    from aggregator.service.group.leader import Leader

    sent = []
    txn = SimpleNamespace(
        begin=lambda: None,
        commit=lambda: None,
        send=lambda topic, key=None, **kw: sent.append((topic, key)),
    )
    spent = [7.0]
    ledger = SimpleNamespace(
        append=lambda **kw: spent.__setitem__(0, spent[0] + 1.0),
        committed=lambda: None,
        spent=lambda: spent[0],
        remaining=lambda: 10.0 - spent[0],
    )
    metrics = Metrics()
    lead = SimpleNamespace(
        txn=txn,
        ledger=ledger,
        metrics=metrics,
        pending={3: {0: {}}},
        release_topic="panagg-releases",
        identity={"lineage": "L"},
        topics=SimpleNamespace(releases="g.panagg.releases", summaries="g.panagg.summaries"),
        aggregation="",
        registry=None,
    )
    lead.release_key = lambda name: Leader.release_key(lead, name)
    assert Leader._transact(lead, 3, {0: {}}, entry={"kind": "release"}, document="{}")
    reg = metrics.registry
    assert reg.get_sample_value("panagg_budget_spent_epsilon") == 8.0
    assert reg.get_sample_value("panagg_budget_remaining_epsilon") == 2.0
    assert sent == [
        ("g.panagg.releases", b"3"),
        ("panagg-releases", b"3"),
        ("g.panagg.summaries", b"3/0"),
    ]
    # several aggregations share release.topic: keyed NAME/W as one process keys them, so a
    # compacted topic keeps every aggregation's release of window 3
    sent.clear()
    lead.aggregation, lead.pending = "ip", {3: {0: {}}}
    assert Leader._transact(lead, 3, {0: {}}, entry={"kind": "release"}, document="{}")
    assert ("panagg-releases", b"ip/3") in sent and ("g.panagg.releases", b"3") in sent


def test_history_of_a_members_scratch_directory_points_at_the_group(tmp_path):
    """Issue 54: a member's directory holds no ledger (the group's is in Kafka): `panagg history`
    on it names the command that reads the group's releases, in one line."""
    import json
    import subprocess
    import sys

    from consumers.kafka_security import redacted

    cfg = load_config(
        None,
        [
            "source.kind=kafka",
            "source.bootstrap=broker:9092",
            "source.topic=logins",
            "source.group=panagg",
            "scale.partitioned=true",
            "scale.store=kafka",
            "window.kind=time",
        ],
    )
    (tmp_path / "config.json").write_text(json.dumps(redacted(cfg)))
    res = subprocess.run(
        [sys.executable, "-m", "aggregator.service.cli", "history", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"panagg: error: {tmp_path} is the scratch directory of a member of group 'panagg', "
        "whose ledger is in Kafka: run panagg history --group panagg --bootstrap broker:9092"
    )
    res = subprocess.run(
        [sys.executable, "-m", "aggregator.service.cli", "history"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        "panagg: error: give --state-dir (one process) or --group with --bootstrap (a group "
        "with scale.store = kafka)"
    )


def test_a_member_between_generations_neither_syncs_nor_commits():
    """A consumer that fell out of its group keeps its assignment with generation -1 and no
    member id; the broker takes a TxnOffsetCommit with that metadata from anyone. The membership
    does not sync then, and the transaction refuses such offsets before the producer sees them."""
    from kafka import TopicPartition
    from kafka.errors import CommitFailedError
    from kafka.structs import ConsumerGroupMetadata

    from aggregator.service.group.membership import Membership, fencing
    from aggregator.service.group.txn import Transactions

    stable = ConsumerGroupMetadata("g", 7, "m-1", None, "<stable>")
    fell_out = ConsumerGroupMetadata("g", -1, "", None, "<unjoined>")
    rejoining = ConsumerGroupMetadata("g", 7, "m-1", None, "<rebalancing>")

    class Consumer:
        meta = stable

        def group_metadata(self):
            return self.meta

        def assignment(self):
            return {TopicPartition("src", 0), TopicPartition("src", 1)}

        def pause(self, *tps):
            pass

    consumer = Consumer()
    membership = Membership(consumer, "src", "ledger")
    assert membership.sync() == {0, 1} and membership.holds([0, 1])
    consumer.meta = fell_out
    assert not membership.holds([0, 1])
    assert "fell out" in membership.why_not([0, 1])
    assert membership.sync() is None  # the assignment is not taken while out
    consumer.meta = rejoining
    assert membership.sync() is None  # nor while the generation is not settled
    assert fencing(stable) and fencing(rejoining) and not fencing(fell_out)

    sent = []

    class Producer:
        def send_offsets_to_transaction(self, offsets, meta):
            sent.append(meta)

    txn = Transactions(Producer)
    with pytest.raises(CommitFailedError):
        txn.send_offsets({TopicPartition("src", 0): None}, fell_out)
    assert sent == []
    txn.send_offsets({TopicPartition("src", 0): None}, stable)
    txn.send_offsets({TopicPartition("src", 0): None}, "a-group-id")  # a seed: no generation
    assert sent == [stable, "a-group-id"]


def test_a_views_group_takes_count_windows_and_refuses_what_it_cannot_do_in_one_line():
    """The default exchange counts time, event-time (event_views.py) and count windows
    (count_views.py), sum rollups (view_rollups.py) and in-window snapshots of time windows;
    the hybrid and tree rollup designs are refused naming scale.exchange = items (and the sum
    design)."""
    base = ["scale.partitioned=true", "scale.store=kafka", "window.size=60"]
    cfg = load_config(None, overrides=[*base, "window.kind=count"])
    assert cfg.scale.exchange == "views" and cfg.window.kind == "count"
    cfg = load_config(
        None,
        overrides=[
            *base,
            "window.kind=event_time",
            "source.kind=kafka",
            "source.topic=t",
            "window.allowed_lateness_s=5",
        ],
    )
    assert cfg.scale.exchange == "views" and cfg.window.kind == "event_time"
    cfg = load_config(
        None,
        overrides=[*base, "window.kind=time", 'window.rollups=["1h"]', "window.rollup_design=sum"],
    )
    assert list(cfg.window.rollups) == ["1h"]
    # in-window snapshots of time windows (views.py, snapshots.py); count and event-time
    # windows refuse them in one line, as the items exchange and one process do
    cfg = load_config(
        None, overrides=[*base, "window.kind=time", "checkpoint.snapshots_per_window=2"]
    )
    assert cfg.scale.exchange == "views" and cfg.checkpoint.snapshots_per_window == 2
    for extra, said in (
        (["window.kind=count"], "set checkpoint.snapshots_per_window = 0"),
        (
            ["window.kind=event_time", "source.kind=kafka", "source.topic=t"],
            "does not support checkpoint.snapshots_per_window",
        ),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides=[*base, *extra, "checkpoint.snapshots_per_window=2"])
        assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides=[*base, 'window.rollups=["1h"]'])
    msg = str(err.value)
    assert 'scale.exchange = "items"' in msg and "\n" not in msg, msg
    # the default hybrid design: the sum design is named too
    assert 'window.rollup_design = "sum"' in msg, msg


def test_a_slices_source_positions_do_not_depend_on_where_the_items_fell():
    """What a partition's event-time summary names as its source positions (the budget
    registry's charge) is every message of the window it read, empty or not: a slice that got
    none of the items names the same positions as one that got them all."""

    def make():
        return PanPrivateHistogram(1.0, size=10)

    full = EventSlice(closed=4, summarized=4, make_state=make)
    empty = EventSlice(closed=4, summarized=4, make_state=make)
    for offset, src in enumerate((b"t:0:0:50", b"t:1:7:9", b"t:0:50:80")):
        full.add(offset, 5, False, np.array([1, 2], dtype=np.int64), source=src)
        empty.add(offset, 5, False, np.zeros(0, dtype=np.int64), source=src)
    assert full.sources[5] == empty.sources[5] == {"t:0": [0, 80], "t:1": [7, 9]}
    assert 5 in full.live and 5 not in empty.live
    full.closed_at(5)
    assert full.sources == {}


@pytest.mark.parametrize("error", ["ProducerFencedError", "InvalidTxnStateError"])
def test_a_start_another_member_fenced_is_tried_again(tmp_path, monkeypatch, error):
    """Members started together race for the group's transactional id while writing its
    identity: the one fenced gets ProducerFencedError, or InvalidTxnStateError for the
    transaction the fencing cut short; it starts again (it once exited, issue 46)."""
    import kafka.errors

    svc = GroupService(
        _cfg(f"checkpoint.dir={tmp_path / 'scratch'}", "source.connect_timeout_s=30"), Metrics()
    )
    tries = []

    def start():
        tries.append(1)
        if len(tries) == 1:
            raise getattr(kafka.errors, error)()

    monkeypatch.setattr(svc, "start", start)
    monkeypatch.setattr(svc, "close", lambda: None)
    svc._start_retrying()
    assert len(tries) == 2
