"""Sum rollups in a Kafka-only group (aggregator/service/group/rollups.py), the parts that need
no broker: each partition's running sums of its release views, the rollup summaries' merge, and
the ledger's answer (a withheld base window withholds the rollup). The real-broker test is
tests/integration/test_group_kafka.py::test_sum_rollups_in_a_group_across_a_kill_sum_the_released_views."""

import json

import numpy as np
import pytest

from aggregator.service.group.repartition import slice_size
from aggregator.service.group.rollups import SliceRollups, judge_rollup
from aggregator.service.group.summary import merge_summaries, partition_summary
from aggregator.service.group.topics import GroupTopics
from aggregator.service.ledger import Ledger
from aggregator.service.rollup import RollupSum
from aggregator.state import PanPrivateHistogram

D, P, K, IDX = 60, 3, 3, 2  # windows 6, 7, 8 make rollup 3x-2
IDENT = {"lineage": "L", "model": "joint", "window_size": 2.0, "partitions": P, "first_window": 0}
TOPICS = GroupTopics("g")


def _counters(summary) -> int:
    return sum(v * c for v, c in summary["values"])


def _close_windows(windows, rng, refused=()):
    """Close ``windows`` on every partition as Counter._close does (a real state, its summary,
    the same view into the sums); returns the base summaries {(w, p)}, the rollup summaries
    {p} and the sums' messages."""
    rolls = SliceRollups({"3x": K}, TOPICS, IDENT)
    base, rolled, msgs_of = {}, {}, {}
    for p in range(P):
        rolls.sums[p] = {}
    for w in windows:
        for p in range(P):
            st = PanPrivateHistogram(1.0, size=slice_size(D, P, p))
            st.add_indices(rng.integers(0, st.size, 100 + 10 * p))
            view = []
            info = {
                "kind": "time",
                "size": 2.0,
                "events": st.n,
                "started_unix": 2.0 * w,
                "ended_unix": 2.0 * w + 2,
            }
            if (w, p) not in refused:
                base[w, p] = partition_summary(
                    st,
                    model="joint",
                    window=w,
                    partition=p,
                    partitions=P,
                    window_info=info,
                    view=view,
                )
            msgs, apply = rolls.fold(
                p, w, view[0] if view else None, state=st, events=st.n, member="m"
            )
            apply()
            msgs_of[w, p] = msgs
            for topic, _, key, value in msgs:
                if topic == TOPICS.summaries:
                    rolled[p] = json.loads(value)
    return base, rolled, msgs_of, rolls


def test_each_partition_sums_exactly_the_views_its_summaries_were_taken_from():
    base, rolled, msgs_of, rolls = _close_windows([6, 7, 8], np.random.default_rng(1))
    for p in range(P):
        # the rollup's summary comes with the last window's close; its sum is tombstoned then
        assert [(t, k, v is None) for t, _, k, v in msgs_of[8, p]] == [
            (TOPICS.summaries, f"r/3x/{IDX}/{p}".encode(), False),
            (TOPICS.rollups, f"3x/{IDX}".encode(), True),
        ]
        assert [(t, part, k) for t, part, k, _ in msgs_of[6, p]] == [
            (TOPICS.rollups, p, f"3x/{IDX}".encode())
        ]
        s = rolled[p]
        assert s["rollup"] == "3x" and s["index"] == IDX and s["layers"] == 2 * K
        assert sorted(v["window"] for v in s["parts"].values()) == [6, 7, 8]
        # the same release views: the counters add up (a second draw of a layer would not)
        assert _counters(s) == sum(_counters(base[w, p]) for w in (6, 7, 8))
        assert s["n"] == sum(base[w, p]["n"] for w in (6, 7, 8))
    assert rolls.sums == {p: {} for p in range(P)}
    release = merge_summaries([rolled[p] for p in range(P)], error_bar_reps=0)
    assert release["n"] == sum(s["n"] for s in base.values()) and release["layers"] == 2 * K
    assert release["window"] == f"3x-{IDX}" and release["domain"]["size"] == D


def test_a_sum_restored_by_a_new_owner_adds_a_replayed_window_once():
    rng = np.random.default_rng(2)
    _, _, msgs_of, _ = _close_windows([6, 7], rng)
    kept = msgs_of[7, 0][0][3]  # what the topic holds after window 7
    owner = SliceRollups({"3x": K}, TOPICS, IDENT)
    owner.sums[0] = {"3x": RollupSum.from_bytes(kept)}
    st = PanPrivateHistogram(1.0, size=slice_size(D, P, 0))
    msgs, apply = owner.fold(0, 7, (st.counts + 5, 2), state=st, events=0, member="m2")
    apply()
    again = owner.sums[0]["3x"]
    assert again.covered() == [6, 7]
    assert np.array_equal(again.counts, RollupSum.from_bytes(kept).counts)
    # an aborted close changes nothing: the sums move only with apply()
    before = owner.sums[0]["3x"].counts.copy()
    owner.fold(0, 8, (st.counts + 5, 2), state=st, events=0, member="m2")
    assert np.array_equal(owner.sums[0]["3x"].counts, before)


def _ledger(tmp_path, windows, withheld=()):
    ledger = Ledger(tmp_path / "ledger.jsonl", budget_per_window=1.0)
    for w in windows:
        extra = {"withheld": "positions were released before"} if w in withheld else {}
        ledger.append(
            entry_id=f"L/{w}",
            kind="release",
            window=w,
            epsilon_spent=1.0,
            window_uid=f"L/{w}",
            **extra,
        )
    return ledger


def test_a_rollup_of_released_windows_names_its_entries(tmp_path):
    _, rolled, _, _ = _close_windows([6, 7, 8], np.random.default_rng(3))
    reason, entries, missing = judge_rollup(rolled, _ledger(tmp_path, [6, 7, 8]), IDENT)
    assert reason is None and missing == []
    assert [e["window"] for e in entries] == [6, 7, 8]


def test_a_withheld_base_window_withholds_the_rollup(tmp_path):
    """Partition 1 refused window 7 (its positions were charged): the leader withheld 7, but
    partitions 0 and 2 hold their slices of it in their sums; nothing of the rollup may be
    published."""
    _, rolled, _, _ = _close_windows([6, 7, 8], np.random.default_rng(4), refused={(7, 1)})
    assert sorted(v["window"] for v in rolled[1]["parts"].values()) == [6, 8]
    ledger = _ledger(tmp_path, [6, 7, 8], withheld={7})
    reason, entries, _ = judge_rollup(rolled, ledger, IDENT)
    assert reason.startswith("rollup 3x-2 withheld: base window 7 was withheld") and not entries
    # a window the ledger had released but a partition does not hold: withheld too
    ledger = _ledger(tmp_path / "b", [6, 7, 8])
    reason, _, _ = judge_rollup(rolled, ledger, IDENT)
    assert "base window 7 is held by partitions [0, 2] of 3 only" in reason
    # and one the ledger never released
    reason, _, _ = judge_rollup(rolled, _ledger(tmp_path / "c", [6, 8]), IDENT)
    assert "base window 7 is not a ledgered release" in reason
    assert "\n" not in reason


def test_windows_no_partition_holds_are_named_missing_as_one_process_names_them(tmp_path):
    refused = {(7, p) for p in range(P)}  # every partition refused window 7
    _, rolled, _, _ = _close_windows([7, 8], np.random.default_rng(5), refused=refused)
    ident = dict(IDENT, first_window=7)  # window 6: before the group's first
    reason, entries, missing = judge_rollup(rolled, _ledger(tmp_path, [7, 8], withheld={7}), ident)
    assert reason is None and [e["window"] for e in entries] == [8]
    assert missing == [
        {"window": 6, "why": "not counted by this group (before its first window)"},
        {"window": 7, "why": "withheld by the ledger: it has no release"},
    ]


def test_the_rollups_topic_is_compacted_per_partition_and_takes_large_sums():
    wanted = TOPICS.wanted(6, 3600_000)
    parts, conf = wanted[TOPICS.rollups]
    assert TOPICS.rollups == "g.panagg.rollups" and parts == 6
    assert conf["cleanup.policy"] == "compact" and int(conf["max.message.bytes"]) >= 16 << 20


def test_a_slice_too_large_for_one_message_is_refused_at_start_in_one_line():
    from aggregator.service.process import ServiceError

    with pytest.raises(ServiceError) as exc:
        SliceRollups({"3x": K}, TOPICS, dict(IDENT, size=10_000_000, partitions=2))
    assert "use at least 5 partitions (scale.partitions)" in str(exc.value)
    assert "\n" not in str(exc.value)
    SliceRollups({"3x": K}, TOPICS, dict(IDENT, size=10_000_000, partitions=5))
