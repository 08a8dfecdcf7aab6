"""Event-time windows of a views group (aggregator/service/group/event_views.py), without Kafka:
the per-partition rules and the commit points against the one-process reference of
tests/test_event_time_lateness.py, across crashes that replay from the committed offsets, and
the leader's filling of windows a partition skipped."""

from __future__ import annotations

import random

import numpy as np
import pytest

from aggregator.service.group.event_views import PartitionClock, commit_meta, skipped_parts
from aggregator.service.group.watermark import closable_upto

from tests.helpers.event_time import SIZE, reference
from tests.helpers.event_time import contiguous_stream


def _member(
    parts: dict, lateness: float, chaos: random.Random, *, crashes: int, meta=commit_meta
) -> dict:
    """One member owning every partition of ``parts`` ({partition: [(ts s, item)]}), reading
    them in random chunks, closing each window once every partition passed it, committing as
    views.py does (ViewCounter._event_commits), and crashing ``crashes`` times at random: its
    open windows are lost and it reads again from the commits. Returns {item: [windows it was
    released in]}."""
    size_ms, late_ms = SIZE * 1000, int(lateness * 1000)
    commits = {p: (0, {}) for p in parts}
    released: dict = {}

    def boot():
        return ({p: PartitionClock.from_commit(o, m) for p, (o, m) in commits.items()}, {})

    clocks, tasks = boot()  # tasks: window -> {"items": [], "first": {p: (offset, passed)}}

    def close(w):
        task = tasks.pop(w, {"items": [], "first": {}})
        for it in task["items"]:
            released.setdefault(it, []).append(w)
        for p, clock in clocks.items():
            later = [t["first"][p] for k, t in tasks.items() if k > w and p in t["first"]]
            offset, passed = min(later) if later else (clock.position, clock.passed_ms)
            m = meta(
                closed=w,
                position=clock.position,
                offset=offset,
                passed_ms=passed,
                skip_until=clock.skip_until,
                ledger_head="",
            )
            commits[p] = (offset, m)
            clock.closed, clock.skip_until = w, m.get("s")

    crash_left = crashes
    while True:
        open_parts = [p for p in parts if clocks[p].position < len(parts[p])]
        if not open_parts:
            break
        p = chaos.choice(open_parts)
        clock = clocks[p]
        lo = clock.position
        hi = min(len(parts[p]), lo + chaos.randint(1, 7))
        recs = parts[p][lo:hi]
        d = clock.assign(
            np.arange(lo, hi),
            np.array([int(round(t * 1000)) for t, _ in recs]),
            size_ms=size_ms,
            lateness_ms=late_ms,
        )
        for i, (_, item) in enumerate(recs):
            if d.skip[i]:
                continue
            task = tasks.setdefault(int(d.window[i]), {"items": [], "first": {}})
            task["items"].append(item)
            task["first"].setdefault(p, (lo + i, int(d.before[i])))
        clock.position = hi
        low = min((c.passed_ms if c.passed_ms is not None else -1) for c in clocks.values())
        upto = closable_upto(low if low >= 0 else None, size_ms=size_ms, lateness_ms=late_ms)
        for w in sorted(tasks):
            if upto is None or w > upto:
                break
            close(w)
        if crash_left and chaos.random() < 0.05:
            crash_left -= 1
            clocks, tasks = boot()
    for w in sorted(tasks):  # the input's end releases the rest
        close(w)
    return released


@pytest.mark.parametrize("lateness", [0, 4])
def test_a_views_member_windows_every_record_as_one_process_across_crashes(lateness):
    """Each record released exactly once, in the window one process puts it in, whatever the
    interleaving of the partitions' reads and wherever the member crashes and replays."""
    for seed in range(12):
        rng = np.random.default_rng(seed)
        stream = contiguous_stream(rng, lateness=lateness, size=SIZE)
        item = iter(range(10**6))
        parts = {p: [(t / 1000, next(item)) for t in ts] for p, ts in stream.items()}
        where, windows = reference(parts, lateness, "next")
        assert sum(late for _, late in windows.values()) > 0
        released = _member(parts, lateness, random.Random(seed), crashes=3)
        assert {it: ws for it, ws in released.items() if len(ws) != 1} == {}, seed
        assert {it: ws[0] for it, ws in released.items()} == where, seed


def test_without_the_skip_point_a_replay_counts_released_records_again():
    """The negative control: a commit that forgets where the closed window's records end (its
    ``s``) makes a replay count some records of a released window a second time."""

    def forgetful(**kw):
        m = commit_meta(**kw)
        m.pop("s", None)
        return m

    twice = 0
    for seed in range(12):
        rng = np.random.default_rng(seed)
        stream = contiguous_stream(rng, lateness=4, size=SIZE)
        item = iter(range(10**6))
        parts = {p: [(t / 1000, next(item)) for t in ts] for p, ts in stream.items()}
        released = _member(parts, 4, random.Random(seed), crashes=3, meta=forgetful)
        twice += sum(1 for ws in released.values() if len(ws) != 1)
    assert twice > 0


def test_the_leader_fills_in_windows_a_partition_skipped_and_waits_for_the_rest():
    view = lambda after: {"after": after}  # noqa: E731
    empty = lambda w, p: {"empty": (w, p)}  # noqa: E731
    # partition 1's next view is of window 7, after window 4: it had nothing in 5 and 6
    pending = {5: {0: view({"0": 4})}, 7: {1: view({"1": 4}), 0: view({"0": 6})}}
    have = skipped_parts(5, pending, 2, empty)
    assert have[1] == {"empty": (5, 1)} and have[0] is pending[5][0]
    # partition 2 has reported nothing past window 4: window 5 waits for it
    assert 2 not in skipped_parts(5, pending, 3, empty)
    # a later view that closed window 5 before it (after = 5) does not stand for window 5
    assert 1 not in skipped_parts(5, {5: pending[5], 7: {1: view({"1": 5})}}, 2, empty)


def test_a_commit_that_only_sends_dead_letters_keeps_moved_late_records_for_the_replay():
    """Records of a window closed while their partition was idle are moved, late, into the
    next window, which is still open; a commit that sends dead letters without closing a window
    must leave them to the replay (``d``, not ``s``). Committed as a close (the control), the
    replay would pass over them: lost."""
    ts = np.array([30_000, 31_000])  # window 3, on a partition closed up to window 5
    first = PartitionClock(start=0, passed_ms=None, closed=5, skip_until=None)
    d = first.assign(np.arange(2), ts, size_ms=10_000, lateness_ms=0)
    assert d.window.tolist() == [6, 6] and d.late.all()
    kw = dict(closed=5, position=2, offset=0, passed_ms=None, skip_until=None, ledger_head="")
    meta = commit_meta(**kw, closing=False)
    assert meta == {"lh": "", "k": 5, "d": 2}
    replay = PartitionClock.from_commit(0, meta)
    again = replay.assign(np.arange(2), ts, size_ms=10_000, lateness_ms=0)
    assert again.window.tolist() == [6, 6] and not again.skip.any()
    assert replay.dead_until == 2  # their dead letters (if any) are not sent twice
    control = PartitionClock.from_commit(0, commit_meta(**kw, closing=True))
    assert control.assign(np.arange(2), ts, size_ms=10_000, lateness_ms=0).skip.all()


def test_a_partition_far_past_the_groups_watermark_is_paused_and_idle_ones_hold_nothing():
    """GroupMarks: the group's closable window is the least of every source partition's
    watermark (reports of the other members' partitions, this member's own live values), idle
    ones left out after the timeout; an own partition more than MAX_AHEAD_WINDOWS windows past
    it is to be paused."""
    from aggregator.service.group.event_views import GroupMarks
    from aggregator.service.group.repartition import EventClock
    from aggregator.service.group.watermark import MAX_AHEAD_WINDOWS, MarkRecord

    clock = EventClock(size_s=10, lateness_s=2, max_future_skew_s=60, late="next", idle_timeout_s=3)
    marks = GroupMarks("rp", "src", 3, clock)
    assert marks.take(marks.key(2), MarkRecord(45_000).encode())
    assert not marks.take(b"progress:src:2", b"{}")
    own = {0: MarkRecord(120_000), 1: MarkRecord(None)}
    assert marks.closable(own, now_ms=0) is None  # partition 1 has no watermark yet
    own[1] = MarkRecord(None, idle_since_ms=0)
    assert marks.closable(own, now_ms=1000) is None  # idle for 1 s of 3
    assert marks.closable(own, now_ms=3000) == 3  # 45 s >= (3 + 1) * 10 + 2
    far = (45_000 // 10_000 + MAX_AHEAD_WINDOWS + 1) * 10_000
    own[0] = MarkRecord(far)
    assert marks.ahead(own, now_ms=3000) == {0}
    own[0] = MarkRecord(far - 10_000)
    assert marks.ahead(own, now_ms=3000) == set()


def test_a_deleted_span_rides_in_the_commits_until_its_last_window_closes():
    """Records deleted before they were counted taint every window up to ``through``; each
    commit carries the span (``l``) while a tainted window is still to close, so a replay from
    it withholds them too, and none after."""
    lost = (100, 500, 12)
    for closed, carried in ((None, True), (9, True), (11, True), (12, False), (13, False)):
        meta = commit_meta(
            closed=closed,
            position=600,
            offset=550,
            passed_ms=1_000,
            skip_until=None,
            ledger_head="1:ab",
            lost=lost,
        )
        assert ("l" in meta) is carried, (closed, meta)
        clock = PartitionClock.from_commit(550, meta)
        assert clock.lost == (lost if carried else None)
