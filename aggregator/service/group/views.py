"""The views exchange (``scale.exchange = "views"``): each member counts its own source partitions.

A member reads the source partitions the counting group (``<group>.panagg.count``) assigns it and
counts them into its own pan-private state of all D counters, as one process would: its memory
holds counters plus its own DLap layer, never an event. Nothing per event is written to any
topic. Windows are the member's processing time, aligned to the epoch: window w covers what the
member counted in [w * size, (w + 1) * size).

Closing window w, in one Kafka transaction (docs/privacy.md section 20):
1. ask the ledger whether the window's source positions were charged already (then the summary
   says "refused", and no view is drawn);
2. otherwise draw the view: the state plus a fresh DLap layer V. An intruder who read the
   member's memory during the window knows ``c(t) + L``; the view is ``c(T) + L + V``, so the
   increments between the two stay behind one full DLap layer (section 16's lesson);
3. write the view (zlib chunks of int32 or int64 counters, then a JSON header naming the source
   ranges it covers) to ``<group>.panagg.summaries`` and commit the partitions' next offsets with
   metadata ``{"w": w + 1}`` to the counting group, with the group's metadata (a member the group
   dropped is fenced: nothing of it is seen).

The leader sums the views of a window once they cover every source partition
(:func:`.view_format.merge_views`). A member-window that counted no event sends no view (its ranges are empty:
public); the sum then has fewer layers, and the release says how many.

A rebalance is a handover like a restart: a window whose partitions changed owner is dropped and
replayed from the committed offsets under fresh noise, by whoever owns each partition next.
With ``checkpoint.snapshots_per_window`` (time windows) the commits inside a window are at its
layered snapshots (snapshots.py): a new owner of all the partitions a snapshot covers resumes
the window from it; one that cannot (the snapshot is gone, or a rebalance split its partitions)
withholds the window, never replays it under fresh noise.

The view itself, its sum and the release from it: :mod:`.view_format`.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from consumers.base import take_items
from consumers.kafka.compat import finish_join, unpark

from ...state import PanPrivateHistogram
from .count_views import PROGRESS_S, GroupTotals, next_goal, progress_key
from .counter import charged_before
from .deleted import deleted_since, deleted_text, lost_through
from .event_views import GroupMarks, PartitionClock, commit_meta, encode_meta
from .event_views import window_info as event_window_info
from .forced import close_key
from .membership import Membership
from .repartition import Repartitioner, dead_letter_records
from .snapshots import view_resume, view_snapshot
from .view_format import VIEW_FORMAT, state_params, view_header
from .watermark import MAX_AHEAD_WINDOWS, stamped

__all__ = ["ViewCounter"]

log = logging.getLogger("panagg.group")


# -- the member's counting stage --------------------------------------------------------------
class MemberWindow:
    """One open window of this member: the partitions counted into it and their ranges."""

    def __init__(self, window: int):
        self.window = int(window)
        self.state: PanPrivateHistogram | None = None  # drawn at the first event
        #: source partition -> [first offset of the window, next offset to read]
        self.ranges: dict[int, list[int]] = {}
        self.events = 0
        #: dead letters of rejected records, sent with the window's close (exactly once)
        self.dead: list[tuple[bytes, bytes, list]] = []
        #: count windows (count_views.py): partition -> its running total at the window's
        #: start, and events counted into this window from it; the group total that closes it
        self.base: dict[int, int] = {}
        self.counted: dict[int, int] = {}
        self.goal: int | None = None
        self.opened_unix = time.time()
        #: partition -> first offset of a jump in its records (a transaction marker, or records
        #: the topic's retention deleted before they were counted: looked at when it closes)
        self.gaps: dict[int, int] = {}
        #: event-time windows (event_views.py): late events counted here, and each partition's
        #: ``passed`` before its first record here (a commit at that record restores it)
        self.late = 0
        self.passed_at: dict[int, int] = {}
        #: partition -> (first, last + 1) offsets deleted before they were counted: the window
        #: is withheld naming them, never released short of them
        self.lost: dict[int, tuple[int, int]] = {}
        #: in-window snapshots (checkpoint.snapshots_per_window, snapshots.py): taken so far,
        #: this member's latest commit per partition (a snapshot's position, else the window's
        #: start), the keys of the snapshots the state holds (tombstoned at the close), and why
        #: the window is withheld (a snapshot it cannot resume: never replayed under fresh noise)
        self.snapshots = 0
        self.committed: dict[int, int] = {}
        self.snap_keys: set[int] = set()
        self.withheld: str | None = None


class ViewCounter:
    """Counts the assigned source partitions into this member's own state; writes its views.

    ``consumer``, ``txn``, ``topics``, ``identity``, ``ledger`` and ``metrics`` are what
    :class:`~aggregator.service.group.counter.Counter` takes, the consumer subscribed here to the
    source topic (and the ledger's). ``route`` is the intake's
    :class:`~aggregator.service.group.repartition.Route` (decoder, counter index of an item,
    metrics, dead-letter topic); ``closes`` a consumer with no group that follows the forced
    releases' close records.
    """

    def __init__(
        self,
        consumer,
        txn,
        topics,
        identity: dict,
        ledger,
        metrics,
        *,
        member: str,
        source_topic: str,
        route,
        closes=None,
        snapshots_per_window: int = 0,
        snapshot_reader=None,
        views_reader=None,
    ):
        self.consumer, self.txn, self.topics = consumer, txn, topics
        self.identity, self.ledger, self.metrics = identity, ledger, metrics
        self.member, self.source_topic, self.route = member, source_topic, route
        self.P = int(identity["partitions"])
        self.D = int(identity["size"])
        self.size = float(identity["window_size"])
        self.first_window = int(identity["first_window"])
        #: window -> its MemberWindow; partition -> the window it is counted into
        self.tasks: dict[int, MemberWindow] = {}
        self.where: dict[int, int] = {}
        self.summaries_written = 0
        #: k layered snapshots of each open time window at j / (k + 1) of it by this member's
        #: clock, each in the transaction of its partitions' offsets (snapshots.py);
        #: ``snapshot_reader`` (a consumer with no group and the topic) reads one back
        self.snapshots_per_window = int(snapshots_per_window)
        self.snapshot_reader = snapshot_reader
        #: ``views_reader()``: the summaries topic's latest values by key (views written and
        #: not yet decided), read when a partition comes without commit metadata
        self.views_reader, self._pending_views = views_reader, None
        #: forced releases (forced.py): a consumer following the intake topic's close records
        #: from its end now (a record missed before the start is a window closed by the clock)
        self.closes = closes
        self._forced_upto = -1
        if closes is not None:
            tp = TopicPartition(topics.intake, 0)
            closes.assign([tp])
            closes.seek_to_end(tp)
            closes.position(tp)
        #: count windows: cut by the group's reported totals (count_views.py)
        self.count = identity.get("window_kind") == "count"
        self.totals = GroupTotals(source_topic)
        self._reported_at = 0.0
        self._reported: dict[int, tuple[int, int]] = {}
        #: event-time windows (event_views.py): each owned partition's clock, the group's
        #: watermarks, the offsets this member last committed, the dead letters not sent yet
        self.event = identity.get("window_kind") == "event_time"
        self.clocks: dict[int, PartitionClock] = {}
        self.marks = (
            GroupMarks(topics.repartition, source_topic, self.P, route.clock)
            if self.event
            else None
        )
        self._committed: dict[int, int] = {}
        self._dead_pending: list[tuple[int, tuple]] = []
        self._marked: dict[int, tuple] = {}
        #: partition -> the position before a jump in its offsets (event time; looked at before
        #: the next close: records deleted there, or transaction markers only)
        self._event_gaps: dict[int, int] = {}
        if closes is not None and (self.count or self.event):
            # the latest totals (watermarks) of every partition: the intake topic from its start
            closes.seek_to_beginning(tp)
        self._needs_sync = False
        self._last_wait: str | None = None
        self.membership = Membership(consumer, source_topic, topics.ledger)
        self.is_leader = False
        self.membership.subscribe(self)

    # -- what the member holds (status, stop line) -----------------------------------------
    def held(self) -> list[str]:
        return [
            f"window {w} with {t.events:,} events of partition(s) "
            f"{', '.join(f'{p} from offset {r[0]}' for p, r in sorted(t.ranges.items()))}"
            for w, t in sorted(self.tasks.items())
        ]

    def owned(self) -> list[int]:
        return sorted(self.where)

    def windows(self) -> dict[str, int]:
        return {str(p): w for p, w in sorted(self.where.items())}

    # -- ownership ---------------------------------------------------------------------------
    def _drop_window(self, w: int) -> None:
        if self.event:
            # one window's records are spread over the partitions' open windows: all go, and
            # every partition is read again from its commit
            self._drop_event_time()
            return
        task = self.tasks.pop(w, None)
        if task is None:
            return
        for p in task.ranges:
            self.where.pop(p, None)
        if task.ranges:
            log.info(
                "window %d of partition(s) %s is dropped here and %s",
                w,
                ", ".join(map(str, sorted(task.ranges))),
                "resumed from its committed snapshot"
                if task.snap_keys
                else "replayed from its start under fresh noise",
            )
            self.metrics.handovers.labels(event="released").inc()

    def _sync(self) -> None:
        self._needs_sync = False
        owned = self.membership.sync()
        if owned is None:  # between generations: nothing is acquired or closed until synced
            self._needs_sync = True
            return
        self.is_leader = self.membership.is_leader
        if self.event:
            self._sync_event_time(owned)
            return
        # a window that lost a partition holds that partition's events in its one state: the
        # whole window is dropped; its other partitions are read again from their commits.
        # So is a window whose partition was committed past its start meanwhile: another
        # member held it between two of this member's syncs and wrote its view.
        for w, task in list(self.tasks.items()):
            if set(task.ranges) - owned or self._moved_on(task):
                self._drop_window(w)
        for w, task in self.tasks.items():
            for p, (_, position) in task.ranges.items():
                # a poll that brought the assignment may have read past what was counted
                self.consumer.seek(TopicPartition(self.source_topic, p), position)
        snapped: dict[tuple[int, int, int], dict[int, int]] = {}  # (w, s, key) -> p: offset
        for p in sorted(owned - set(self.where)):
            tp = TopicPartition(self.source_topic, p)
            offset, meta = self._commit_of(p)
            if offset is None:  # no commit: counted from the beginning
                meta = None
                window = self.first_window
                self.consumer.seek_to_beginning(tp)
                start = self.consumer.position(tp)
            else:
                window = int(meta.get("w", self.first_window))
                start = offset
                self.consumer.seek(tp, start)
            released = None
            if not meta:
                window, start, released = self._past_released(tp, window, start)
            task = self.tasks.setdefault(window, MemberWindow(window))
            task.ranges[p] = [start, start]
            task.committed[p] = start
            if meta and "s" in meta:  # committed at an in-window snapshot: resumed below
                task.ranges[p][0] = int(meta["f"])
                held = snapped.setdefault((window, int(meta["s"]), int(meta["a"])), {})
                held[p] = start
                for q in meta["c"]:  # (-1: a partition of the snapshot not acquired here)
                    held.setdefault(int(q), -1)
            if meta is not None:
                # the window's first records may be gone (the source topic's retention, a
                # member down longer than it): replayed without them it would be short
                self._note_deleted(task, {p: start})
            if self.count:
                # a count window goes on from the committed numbers (a new group: from 0)
                at = meta or {}
                # (after a reset: the records released there stand for the events counted)
                task.base[p], task.counted[p] = int(at.get("t", released or 0)), 0
                self._reported.pop(p, None)  # its next report is sent whatever it says
                goal = int(at.get("g", (window - self.first_window + 1) * self.size))
                task.goal = max(task.goal or 0, goal)
            self.where[p] = window
            self.metrics.handovers.labels(event="acquired").inc()
            log.info(
                "counting partition %d of %s from offset %d (window %d) into this "
                "member's own state",
                p,
                self.source_topic,
                start,
                window,
            )
        for (w, seq, key), at in snapped.items():
            self._resume(self.tasks[w], seq, key, at)
        self.metrics.partitions_owned.set(len(self.where))

    def _past_released(self, tp, window: int, start: int) -> tuple[int, int, int | None]:
        """A partition acquired without the group's commit metadata (its offsets reset by an
        operator, or deleted): the window after the last one the ledger charged over it or a
        member already wrote a view of (the leader releases it from that view), from the end
        of those positions, as the one process and the items intake do, and the number of
        records there (None, and ``window`` and ``start`` unchanged, when there are none).
        Counted from ``start`` instead, the records would be withheld as released before, and
        the new records read in the same window with them (found by the fault harness,
        ``offsets_reset``); counted from the ledger's end alone, a window between its view and
        its release was viewed twice and withheld. Time and count windows (event-time windows
        are not in offset order: :meth:`_sync_event_time`)."""
        self.ledger.read_to_end()
        key = f"{self.source_topic}:{tp.partition}"
        spans = [
            (int(e["window"]), *map(int, e["ranges"][key]))
            for e in self.ledger.entries
            if e.get("kind") == "release"
            and e.get("epsilon_spent")
            and key in (e.get("ranges") or {})
        ]
        spans += [
            (int(h["window"]), *map(int, h["ranges"][key]))
            for h in self._views_written()
            if key in (h.get("ranges") or {})
        ]
        if not spans:
            return window, start, None
        last = max(w for w, _, _ in spans)
        end = max(b for _, _, b in spans)
        if end > start:
            log.warning(
                "partition %d of %s was to be read from offset %d, but the group "
                "released or viewed it up to %d already (its committed offsets were "
                "reset or lost): records below %d are not counted again",
                tp.partition,
                self.source_topic,
                start,
                end,
                end,
            )
            self.consumer.seek(tp, end)
        covered, reach = 0, None  # the union of the ranges (withheld ones overlap)
        for _, a, b in sorted(spans, key=lambda s: s[1]):
            lo = a if reach is None else max(a, reach)
            covered += max(0, b - lo)
            reach = b if reach is None else max(reach, b)
        return max(window, last + 1), max(start, end), covered

    def _views_written(self) -> list[dict]:
        """The views in the summaries topic now: windows the leader has not decided yet (it
        tombstones a window's views once it has). Read once a start; none if it cannot be
        read (a window between its view and its release is then withheld as viewed twice:
        named, never released twice)."""
        if self._pending_views is None:
            got = self.views_reader() if self.views_reader is not None else None
            heads = [json.loads(v) for k, v in (got or {}).items() if "/c" not in k]
            self._pending_views = [
                h for h in heads if h.get("format") == VIEW_FORMAT and not h.get("skipped")
            ]
        return self._pending_views

    def _resume(self, task: MemberWindow, seq: int, key: int, at: dict[int, int]) -> None:
        """Resume ``task`` from the snapshot ``seq`` its partitions' commits name (``at``: each
        partition it covers -> the offset acquired here, -1 for one held elsewhere), adding it to
        the window's state; or withhold the window, never replaying it under fresh noise (a
        replay would be a second view of the events the snapshot holds)."""
        got = (
            "its partition(s) "
            + ", ".join(str(p) for p, o in sorted(at.items()) if o < 0)
            + " went to other members (a rebalance split the snapshot's partitions)"
            if min(at.values()) < 0
            else view_resume(self.snapshot_reader, key, (task.window, seq), at)
        )
        if isinstance(got, str):
            why = (
                f"window {task.window} of partition(s) {', '.join(map(str, sorted(at)))} "
                f"cannot resume from its layered snapshot {seq}: {got}; the window is "
                "withheld, never replayed under fresh noise"
            )
            task.withheld = "; ".join(filter(None, (task.withheld, why)))
            log.error("%s", why)
            return
        state, firsts = got
        task.state = state if task.state is None else task.state.merge(state)
        task.events += int(state.n or 0)
        task.snapshots = max(task.snapshots, seq)
        task.snap_keys.add(key)
        for p, first in firsts.items():
            task.ranges[p][0] = first
        log.info(
            "partition(s) %s resume window %d from its snapshot %d at offset(s) %s",
            ", ".join(map(str, sorted(at))),
            task.window,
            seq,
            ", ".join(str(at[p]) for p in sorted(at)),
        )

    def _moved_on(self, task: MemberWindow) -> bool:
        """Whether a partition of ``task`` has a committed offset other than the window's start
        (a view of this window, or a later one, was written by another member)."""

        for p, (start, _) in task.ranges.items():
            committed = self.consumer.committed(
                TopicPartition(self.source_topic, p), timeout_ms=5000
            )
            if (
                committed is not None
                and committed >= 0
                and committed != task.committed.get(p, start)
            ):
                return True
        return False

    # -- counting ----------------------------------------------------------------------------
    def _state(self) -> PanPrivateHistogram:
        ident = self.identity
        return PanPrivateHistogram(ident["epsilon"], neighbor=ident["neighbor"], size=self.D)

    def step(self, timeout_s: float = 0.2) -> int:
        """One poll; count it; close the windows that ended. Returns events counted."""
        if self.event:
            self._pace()
        finish_join(self.consumer)
        polled = self.consumer.poll(timeout_ms=int(timeout_s * 1000))
        if self._needs_sync:
            self._sync()
            polled = {}  # read again from what the sync sought
        self.ledger.tail(0)
        if self.event:
            return self._step_event_time(polled)
        counted = 0
        for tp, recs in polled.items():
            if tp.topic != self.source_topic or tp.partition not in self.where:
                continue
            task = self.tasks[self.where[tp.partition]]
            rng = task.ranges[tp.partition]
            recs = [r for r in recs if r.offset >= rng[1]]
            if not recs:
                continue
            if recs[0].offset > rng[1]:
                task.gaps.setdefault(tp.partition, rng[1])
            counted += self._count(task, tp, recs)
            rng[1] = recs[-1].offset + 1
        if counted:
            self.metrics.events.inc(counted)
        forced = self._forced()
        if self.count:
            self._close_counted(forced)
            return counted
        now = time.time()
        if self.snapshots_per_window:
            for w in sorted(self.tasks):
                if w in self.tasks and not self._maybe_snapshot(self.tasks[w], now):
                    break
        for w in sorted(self.tasks):
            if (now >= (w + 1) * self.size or w <= forced) and w in self.tasks:
                if not self._close(self.tasks[w]):
                    break
        return counted

    # -- count windows (count_views.py) ------------------------------------------------------
    def _own_totals(self) -> dict[int, int]:
        return {
            p: task.base[p] + task.counted[p]
            for task in self.tasks.values()
            for p in task.ranges
            if p in task.base
        }

    def _close_counted(self, forced: int) -> None:
        """Close the open windows the group's total has reached (or a forced release asked),
        then report this member's totals."""
        for w in sorted(self.tasks):
            task = self.tasks.get(w)
            if task is None or not task.ranges:
                continue
            total = self.totals.total(self._own_totals())
            if task.goal is None:
                task.goal = total + int(self.size)
            if not (total >= task.goal or w <= forced):
                continue
            nxt_goal = (
                total + int(self.size)
                if w <= forced
                else next_goal(task.goal, total, int(self.size))
            )
            if not self._close(task, goal_after=nxt_goal):
                break
        self._report()

    def _report(self) -> None:
        """This member's partitions' running totals to the intake topic (count_views.py), at
        most every PROGRESS_S, only those that changed."""
        now = time.monotonic()
        if now - self._reported_at < PROGRESS_S:
            return
        self._reported_at = now
        news = {}
        for task in self.tasks.values():
            for p, (_, position) in task.ranges.items():
                if p in task.base:
                    now_at = (task.base[p] + task.counted[p], position)
                    if self._reported.get(p) != now_at:
                        news[p] = (now_at, task.window, task.goal)
        if not news or not all(self._still_owned(t) for t in self.tasks.values() if t.ranges):
            return
        records = [
            (
                progress_key(self.source_topic, p),
                json.dumps(
                    {"t": t, "o": o, "w": w, "g": g, "m": self.member}, separators=(",", ":")
                ).encode(),
            )
            for p, ((t, o), w, g) in sorted(news.items())
        ]
        if not self._send_reports(records, news, "progress"):
            return
        for p, (at, _, _) in news.items():
            self._reported[p] = at

    def _forced(self) -> int:
        """The latest window a forced release asked to close now (-1: none)."""
        if self.closes is None:
            return -1
        key = close_key(self.topics)
        for records in self.closes.poll(timeout_ms=0).values():
            for rec in records:
                if self.count and self.totals.take(rec.key, rec.value):
                    continue
                if self.event and self.marks.take(rec.key, rec.value):
                    continue
                if rec.key == key and rec.value is not None:
                    self._forced_upto = max(self._forced_upto, int(json.loads(rec.value)["upto"]))
        return self._forced_upto

    def _count(self, task: MemberWindow, tp, recs) -> int:
        route = self.route
        decoded = route.decoder.decode(
            [r.value for r in recs], [r.key for r in recs], [r.headers for r in recs]
        )
        if decoded.rejected:
            Repartitioner._count_rejects(route.metrics, decoded.rejected)
            if route.dead_topic:
                task.dead += dead_letter_records(route, tp, recs, decoded.rejected)
        if not len(decoded.items):
            return 0
        idx = np.asarray(route.index_of(decoded.items), dtype=np.int64)
        if task.state is None:
            task.state = self._state()
        task.state.add_indices(idx)
        task.events += len(idx)
        if tp.partition in task.counted:
            task.counted[tp.partition] += len(idx)
        return len(idx)

    # -- in-window snapshots (snapshots.py) -----------------------------------------------------
    def _maybe_snapshot(self, task: MemberWindow, now: float) -> bool:
        """Snapshot j of the window at j / (k + 1) of it by this member's clock (public
        points): a fresh layer, the snapshot, another fresh layer, and in one transaction the
        snapshot (key: the window's lowest partition), its dead letters and its partitions'
        offsets at its positions with ``s`` = j in the metadata. False: not written, the
        window is dropped and resumed from its last commit."""
        k, w = self.snapshots_per_window, task.window
        # the latest point passed (several after a restart or a slow turn: only that one is
        # taken, each snapshot costs two layers)
        passed = min(k, int((now / self.size - w) * (k + 1)))
        if (
            passed <= task.snapshots
            or now >= (w + 1) * self.size
            or task.withheld
            or not task.ranges
        ):
            return True
        if task.gaps:  # records deleted before they were counted: the window is withheld
            self._note_deleted(task, dict(task.gaps))
            task.gaps.clear()
        if (
            task.lost
            or task.state is None
            or all(r[1] == task.committed.get(p) for p, r in task.ranges.items())
        ):
            # nothing to release, no event yet, or nothing read since the last commit
            task.snapshots = passed
            return True
        task.snapshots = passed - 1
        if not self._still_owned(task):
            self._needs_sync = True
            return False
        key = min(task.ranges)
        message = view_snapshot(task)
        head = self.ledger.head()
        covers = sorted(task.ranges)

        def meta(p: int) -> str:
            return json.dumps(
                {
                    "w": w,
                    "s": task.snapshots,
                    "a": key,
                    "c": covers,
                    "f": task.ranges[p][0],
                    "lh": f"{head['seq']}:{head['hash'][:16]}",
                },
                separators=(",", ":"),
            )

        if not self._transact(
            task,
            [(self.topics.snapshots, key, str(key).encode(), message)],
            {p: (r[1], meta(p)) for p, r in task.ranges.items()},
            f"snapshot {task.snapshots} of window {w}",
            "resumed from its last commit",
        ):
            return False
        task.snap_keys.add(key)
        for p, r in task.ranges.items():
            task.committed[p] = r[1]
        log.info(
            "window %d: layered snapshot %d of partition(s) %s at offset(s) %s",
            w,
            task.snapshots,
            ", ".join(map(str, covers)),
            ", ".join(str(task.ranges[p][1]) for p in covers),
        )
        return True

    def _transact(
        self,
        task: MemberWindow,
        records: list,
        commits: dict[int, tuple[int, str]],
        what: str,
        then: str,
    ) -> bool:
        """One transaction: ``records`` (topic, partition, key, value), the window's dead
        letters so far and its partitions' ``commits`` (partition -> (offset, metadata)) with
        the group's metadata. False: not written; the window is dropped (``then`` says how it
        comes back) and the member syncs again."""

        txn = self.txn
        try:
            txn.begin()
            for topic, partition, key, value in records:
                txn.send(topic, partition=partition, key=key, value=value)
            for dkey, value, headers in task.dead:
                txn.send(self.route.dead_topic, key=dkey, value=value, headers=headers)
            txn.send_offsets(
                {
                    TopicPartition(self.source_topic, p): OffsetAndMetadata(o, m, -1)
                    for p, (o, m) in commits.items()
                },
                self.membership.generation,
            )
            txn.commit()
        except Exception as exc:
            log.warning("%s not written (%s); the window is %s", what, type(exc).__name__, then)
            self.txn.failed(exc)
            self._drop_window(task.window)
            self._needs_sync = True
            return False
        if task.dead:
            self.route.metrics.dead_letters.inc(len(task.dead))
            task.dead = []
        return True

    # -- closing -----------------------------------------------------------------------------
    def _close(self, task: MemberWindow, goal_after: int | None = None) -> bool:
        """Write the window's view, its partitions' next offsets (and its dead letters) in one
        transaction; then the partitions count into the next window. False: not written, the
        window is dropped and replayed."""
        w = task.window
        if not self._still_owned(task):
            # not closed now: the next sync keeps the window when its partitions are still this
            # member's and nobody committed past its start, or drops it (replayed elsewhere)
            why = self._why_not_owned(task)
            if why != self._last_wait:
                log.info("window %d waits for the group to settle: %s", w, why)
                self._last_wait = why
            self._needs_sync = True
            return False
        self._last_wait = None
        if task.gaps:  # one look at the first offsets of the partitions that jumped
            self._note_deleted(task, dict(task.gaps))
            task.gaps.clear()
        for p, (_, first_left) in task.lost.items():
            # a window that ends before the first record left takes the deleted span whole,
            # so the next one starts at that record and is released
            task.ranges[p][1] = max(task.ranges[p][1], first_left)
        ranges = {f"{self.source_topic}:{p}": list(r) for p, r in sorted(task.ranges.items())}
        if self.event:
            info = event_window_info(w, self.identity, events=task.events, late=task.late)
        elif self.count:  # a count window's times are when this member opened and closed it
            info = {
                "kind": "count",
                "size": self.size,
                "events": int(task.events),
                "started_unix": task.opened_unix,
                "ended_unix": time.time(),
            }
        else:
            info = {
                "kind": "time",
                "size": self.size,
                "events": int(task.events),
                "started_unix": w * self.size,
                "ended_unix": (w + 1) * self.size,
            }
        refused = (
            "; ".join(
                f"{deleted_text(self.source_topic, p, a, b)}; window range "
                f"[{task.ranges[p][0]}, {task.ranges[p][1]}) cannot be released whole"
                for p, (a, b) in sorted(task.lost.items())
            )
            or task.withheld
            or (self._refusal(w, ranges) if task.events else None)
        )
        if refused:
            head = {
                "format": VIEW_FORMAT,
                "version": 1,
                "window": w,
                "partition": min(task.ranges),
                "covers": sorted(task.ranges),
                "partitions": self.P,
                "refused": refused,
                "chunks": 0,
                "_chunks": [],
            }
            if refused == task.withheld:
                # its snapshots were views of its events: its positions are charged, as a
                # released window's are (never released, never counted again)
                head["charge"] = True
        else:
            head = view_header(
                task.state,
                window=w,
                covers=list(task.ranges),
                partitions=self.P,
                window_info=info,
                mode=self.identity["mode"],
                size=self.D,
                params=state_params(self.identity),
            )
        head.update(ranges=ranges, member=self.member)
        if self.event:  # the windows before w since the last closed one were empty here
            head["after"] = {str(p): self.clocks[p].closed for p in sorted(task.ranges)}
        chunks = head.pop("_chunks")
        key = f"{w}/{head['partition']}"
        ledger_head = self.ledger.head()
        lh = f"{ledger_head['seq']}:{ledger_head['hash'][:16]}"

        def meta(p: int) -> str:
            at = {"w": w + 1, "lh": lh}
            if self.count:  # where the partition's next count window starts (count_views.py)
                at.update(t=task.base[p] + task.counted[p], g=goal_after)
            return json.dumps(at, separators=(",", ":"))

        commits = (
            self._event_commits(list(task.ranges), w, lh)
            if self.event
            else {p: (r[1], meta(p)) for p, r in task.ranges.items()}
        )
        # the chunks first: the leader reads them before the header that names them; the
        # window's snapshots are done with (tombstones): no noisy state left at rest for it
        records = [
            (self.topics.summaries, 0, f"{key}/c{k}".encode(), chunk)
            for k, chunk in enumerate(chunks)
        ]
        records.append(
            (self.topics.summaries, 0, key.encode(), json.dumps(head, allow_nan=False).encode())
        )
        records += [
            (self.topics.snapshots, snap, str(snap).encode(), None)
            for snap in sorted(task.snap_keys)
        ]
        if not self._transact(
            task,
            records,
            commits,
            f"view of window {w}",
            "replayed from its start" if not task.snap_keys else "resumed from its last commit",
        ):
            return False
        self.summaries_written += 1
        self.metrics.summaries.inc()
        del self.tasks[w]
        if self.event:
            self._event_closed(task, commits)
            return True
        nxt = self.tasks.setdefault(w + 1, MemberWindow(w + 1))
        for p, r in task.ranges.items():
            nxt.ranges[p] = [r[1], r[1]]
            self.where[p] = w + 1
            if self.count:
                nxt.base[p], nxt.counted[p] = task.base[p] + task.counted[p], 0
        if self.count:
            nxt.goal = max(nxt.goal or 0, goal_after or 0) or None
        return True

    # -- event-time windows (event_views.py) ------------------------------------------------
    def _drop_event_time(self) -> None:
        if any(t.events for t in self.tasks.values()):
            log.info(
                "event-time window(s) %s of partition(s) %s are dropped here and replayed "
                "from the committed offsets under fresh noise",
                ", ".join(map(str, sorted(self.tasks))),
                ", ".join(map(str, sorted(self.clocks))),
            )
            self.metrics.handovers.labels(event="released").inc()
        self.tasks.clear()
        self.clocks.clear()
        self.where.clear()
        self._committed.clear()
        self._dead_pending.clear()
        self._marked.clear()
        self._event_gaps.clear()

    def _sync_event_time(self, owned: set[int]) -> None:
        """After a rebalance: keep the open windows when this member still holds every
        partition it counted and nobody committed one of them since; else drop them all and
        read every owned partition again from its commit (R3: fresh noise)."""

        moved = any(
            self._commit_of(p)[0] != self._committed.get(p) for p in self.clocks if p in owned
        )
        if set(self.clocks) - owned or moved:
            self._drop_event_time()
        for p, clock in self.clocks.items():
            self.consumer.seek(TopicPartition(self.source_topic, p), clock.position)
        resumed: dict[int, int] = {}  # partitions counted on from a commit
        for p in sorted(owned - set(self.clocks)):
            offset, meta = self._commit_of(p)
            tp = TopicPartition(self.source_topic, p)
            if offset is None:
                self.consumer.seek_to_beginning(tp)
                offset = self.consumer.position(tp)
                clock = PartitionClock(start=offset, passed_ms=None, closed=None, skip_until=None)
            else:
                self.consumer.seek(tp, offset)
                clock = PartitionClock.from_commit(offset, meta)
            self.clocks[p], self._committed[p] = clock, offset
            if meta:
                resumed[p] = offset
            self.where[p] = -1 if clock.closed is None else clock.closed + 1
            self.metrics.handovers.labels(event="acquired").inc()
            log.info(
                "counting partition %d of %s from offset %d by event time (last window "
                "closed there: %s) into this member's own state",
                p,
                self.source_topic,
                offset,
                "none" if clock.closed is None else clock.closed,
            )
        # records after a commit may be gone (retention; a member down longer than it)
        self._note_deleted_event_time(resumed)
        self.metrics.partitions_owned.set(len(self.clocks))

    def _commit_of(self, p: int) -> tuple[int | None, dict]:
        """The counting group's committed offset of source partition ``p`` and its metadata."""

        got = self.consumer.committed(
            TopicPartition(self.source_topic, p), metadata=True, timeout_ms=5000
        )
        if got is None or got.offset is None or got.offset < 0:
            return None, {}
        return int(got.offset), json.loads(got.metadata or "{}")

    def _step_event_time(self, polled) -> int:
        counted = 0
        now_ms = int(time.time() * 1000)
        for tp, recs in polled.items():
            clock = self.clocks.get(tp.partition) if tp.topic == self.source_topic else None
            if clock is None:
                continue
            recs = [r for r in recs if r.offset >= clock.position]
            if not recs:
                continue
            if recs[0].offset > clock.position:  # most often a transaction marker; looked
                self._event_gaps.setdefault(tp.partition, clock.position)  # at before a close
            counted += self._count_event_time(tp.partition, tp, recs, now_ms)
            clock.position = recs[-1].offset + 1
            clock.idle_since_ms = None
        if counted:
            self.metrics.events.inc(counted)
        self._note_idle(polled, now_ms)
        self._forced()  # (reads the group's watermark reports)
        self._close_event_time(now_ms)
        self._send_dead_letters()
        self._report_marks()
        return counted

    def _send_dead_letters(self) -> None:
        """Dead letters waiting for a close that does not come (the watermark stands still):
        sent at most every PROGRESS_S with their partitions' offsets (commits that close no
        window), so each is written once."""
        if (
            not self._dead_pending
            or time.monotonic() - self._reported_at < PROGRESS_S
            or self._needs_sync
            or not self.membership.holds(list(self.clocks))
        ):
            return

        parts = sorted({p for p, _ in self._dead_pending})
        head = self.ledger.head()
        commits = self._event_commits(parts, None, f"{head['seq']}:{head['hash'][:16]}")
        letters = [dl for _, dl in self._dead_pending]
        txn = self.txn
        try:
            txn.begin()
            for dkey, value, headers in letters:
                txn.send(self.route.dead_topic, key=dkey, value=value, headers=headers)
            txn.send_offsets(
                {
                    TopicPartition(self.source_topic, p): OffsetAndMetadata(o, m, -1)
                    for p, (o, m) in commits.items()
                },
                self.membership.generation,
            )
            txn.commit()
        except Exception as exc:
            log.warning(
                "dead letters of partition(s) %s not written (%s); they are read again "
                "from the committed offsets",
                ", ".join(map(str, parts)),
                type(exc).__name__,
            )
            self.txn.failed(exc)
            self._drop_event_time()
            self._needs_sync = True
            return
        self.route.metrics.dead_letters.inc(len(letters))
        for p, (offset, meta) in commits.items():
            self._committed[p] = offset
            self.clocks[p].dead_until = self.clocks[p].position
        self._dead_pending = []

    def _pace(self) -> None:
        """Pause the owned partitions too far ahead of the group's low watermark; resume the
        others (event_views.GroupMarks.ahead)."""

        ahead = {
            TopicPartition(self.source_topic, p)
            for p in self.marks.ahead(
                {p: c.watermark() for p, c in self.clocks.items()}, int(time.time() * 1000)
            )
        }
        paused = {tp for tp in self.consumer.paused() if tp.topic == self.source_topic}
        if ahead - paused:
            self.consumer.pause(*(ahead - paused))
            log.info(
                "partition(s) %s of %s paused: more than %d windows past the group's low watermark",
                ", ".join(str(tp.partition) for tp in sorted(ahead - paused)),
                self.source_topic,
                MAX_AHEAD_WINDOWS,
            )
        if paused - ahead:
            self.consumer.resume(*(paused - ahead))
        # kafka-python keeps a resumed partition's parked records out of later fetches without
        # this (consumers/kafka/compat.py)
        unpark(self.consumer)

    def _note_idle(self, polled, now_ms: int) -> None:
        """A partition read to its end says since when (window.idle_partition_timeout_s)."""

        for p, clock in self.clocks.items():
            tp = TopicPartition(self.source_topic, p)
            high = self.consumer.highwater(tp)
            if polled.get(tp) or high is None or clock.position < high:
                clock.idle_since_ms = None
            elif clock.idle_since_ms is None:
                clock.idle_since_ms = now_ms

    def _count_event_time(self, p: int, tp, recs, now_ms: int) -> int:
        """Count ``recs`` of partition ``p`` into the windows their timestamps name
        (:meth:`.event_views.PartitionClock.assign`); rejects become dead letters sent with the
        next close, except those a replay passes over (sent before)."""

        route, c = self.route, self.route.clock
        decoded, good, ts, rejects, counts = stamped(route.decoder, recs, now_ms, c.skew_ms)
        keep = np.flatnonzero(counts)
        items = take_items(decoded.items, keep)
        good = good[keep]
        offsets = np.asarray([recs[i].offset for i in good], dtype=np.int64)
        d = self.clocks[p].assign(offsets, ts[keep], size_ms=c.size_ms, lateness_ms=c.lateness_ms)
        count = ~d.skip
        if c.late == "dead_letter":
            rejects += [(int(i), "late") for i in good[d.late & ~d.skip]]
            count &= ~d.late
        sent = self.clocks[p].dead_until
        if sent is not None:  # a replay: those were dead letters before
            rejects = [(i, r) for i, r in rejects if recs[i].offset >= sent]
        if rejects:
            Repartitioner._count_rejects(route.metrics, rejects)
            if route.dead_topic:
                self._dead_pending += [
                    (p, dl) for dl in dead_letter_records(route, tp, recs, sorted(rejects))
                ]
        sel = np.flatnonzero(count)
        if not len(sel):
            return 0
        idx = np.asarray(route.index_of(take_items(items, sel)), dtype=np.int64)
        wins, late, offs = d.window[sel], d.late[sel], offsets[sel]
        for w in np.unique(wins):
            mine = wins == w
            task = self.tasks.setdefault(int(w), MemberWindow(int(w)))
            if task.state is None:
                task.state = self._state()
            task.state.add_indices(idx[mine])
            task.events += int(mine.sum())
            task.late += int(late[mine].sum())
            at = offs[mine]
            if p in task.ranges:
                task.ranges[p][1] = int(at[-1]) + 1
            else:
                task.ranges[p] = [int(at[0]), int(at[-1]) + 1]
                task.passed_at[p] = int(d.before[sel][mine][0])
        return len(sel)

    def _close_event_time(self, now_ms: int) -> None:
        """Close the open windows the group's low watermark has passed, in order; then, if
        the watermark moved on past every window this member holds events of, one empty view
        of the last closable window (the leader learns these partitions had nothing up to
        it)."""
        if not self.clocks:
            return
        upto = self.marks.closable({p: c.watermark() for p, c in self.clocks.items()}, now_ms)
        if self._forced_upto >= 0:  # a forced release closes every window up to it now
            upto = max(upto if upto is not None else -1, self._forced_upto)
        if upto is None:
            return
        for clock in self.clocks.values():
            if clock.lost is not None:
                # each window that may hold a deleted record gets a view of its own (withheld):
                # skipped, it would count as empty there (the views' "after")
                first = (
                    clock.closed + 1 if clock.closed is not None else min(self.tasks, default=upto)
                )
                for w in range(first, min(upto, clock.lost[2]) + 1):
                    self.tasks.setdefault(w, MemberWindow(w))
        for w in sorted(self.tasks):
            if w > upto:
                break
            if not self._close_event_window(w):
                return
        if any(c.closed is None or c.closed < upto for c in self.clocks.values()):
            self._close_event_window(upto)

    def _close_event_window(self, w: int) -> bool:
        """Close window ``w`` on every owned partition where it is still open: its view
        covers them (empty ranges where they had no events of it)."""
        task = self.tasks.setdefault(w, MemberWindow(w))
        if self._event_gaps:  # one look at the first offsets of the partitions that jumped
            self._note_deleted_event_time(self._event_gaps)
            self._event_gaps.clear()
        for p, clock in self.clocks.items():
            if clock.closed is None or clock.closed < w:
                task.ranges.setdefault(p, [clock.position, clock.position])
                if clock.lost is not None and w <= clock.lost[2]:
                    task.lost[p] = clock.lost[:2]
        task.dead = [dl for p, dl in self._dead_pending if p in task.ranges]
        return self._close(task)

    def _note_deleted_event_time(self, since: dict[int, int]) -> None:
        """For each partition p of ``since`` whose records from ``since[p]`` were deleted
        before they were counted (its first offset is past it), every window not closed on it
        up to :func:`.deleted.lost_through` is withheld there, naming them."""
        c = self.route.clock
        look = {
            p: at
            for p, at in since.items()
            if self.clocks[p].lost is None or self.clocks[p].lost[1] <= at
        }
        through = lost_through(int(time.time() * 1000), size_ms=c.size_ms, skew_ms=c.skew_ms)
        for p, low in self._deleted_since(look).items():
            clock = self.clocks[p]
            first = since[p] if clock.lost is None else min(clock.lost[0], since[p])
            clock.lost = (int(first), low, max(through, clock.lost[2] if clock.lost else 0))
            log.warning(
                "records of partition %d of %s from offset %d to %d were deleted by "
                "the topic's retention before they were counted; their timestamps are "
                "gone with them, so every window not closed there up to window %d is "
                "withheld naming them (window.max_future_skew_s bounds how far)",
                p,
                self.source_topic,
                clock.lost[0],
                clock.lost[1],
                clock.lost[2],
            )

    def _event_commits(self, parts, closing: int | None, lh: str) -> dict[int, tuple[int, str]]:
        """The offset and metadata of each of ``parts`` once window ``closing`` closes (None:
        none, the commit only sends dead letters): the first record counted into a window still
        open (it is replayed from there), else the position."""
        out = {}
        for p in parts:
            clock = self.clocks[p]
            closed = clock.closed if closing is None else closing
            later = [
                t for k, t in self.tasks.items() if (closed is None or k > closed) and p in t.ranges
            ]
            if later:
                first = min(later, key=lambda t: t.ranges[p][0])
                offset, passed = first.ranges[p][0], first.passed_at[p]
            else:
                offset, passed = clock.position, clock.passed_ms
            out[p] = (
                int(offset),
                encode_meta(
                    commit_meta(
                        closed=closed,
                        position=clock.position,
                        offset=offset,
                        passed_ms=passed,
                        skip_until=clock.skip_until,
                        ledger_head=lh,
                        closing=closing is not None,
                        dead_until=clock.dead_until,
                        lost=clock.lost,
                    )
                ),
            )
        return out

    def _event_closed(self, task: MemberWindow, commits: dict) -> None:
        for p, (offset, meta) in commits.items():
            clock = self.clocks[p]
            clock.closed = task.window
            clock.skip_until = json.loads(meta).get("s")
            clock.dead_until = max(clock.position, clock.skip_until or 0)
            if clock.lost is not None and task.window >= clock.lost[2]:
                clock.lost = None  # every window that may have held them is closed
            self._committed[p] = offset
            self.where[p] = task.window + 1
        self._dead_pending = [(p, dl) for p, dl in self._dead_pending if p not in task.ranges]

    def _send_reports(self, records: list[tuple[bytes, bytes]], parts, what: str) -> bool:
        """``records`` (key, value) to the intake topic in one transaction of this member's.
        False when it failed: reports only time the cuts and closes, so nothing counted is
        lost; the member syncs with the group at its next turn (a fenced one starts over)."""
        txn = self.txn
        try:
            txn.begin()
            for key, value in records:
                txn.send(self.topics.intake, partition=0, key=key, value=value)
            txn.commit()
        except Exception as exc:
            log.info(
                "%s of partition(s) %s not reported (%s)",
                what,
                ", ".join(map(str, sorted(parts))),
                type(exc).__name__,
            )
            self.txn.failed(exc)
            self._needs_sync = True
            return False
        return True

    def _report_marks(self) -> None:
        """This member's partitions' watermarks to the intake topic (event_views.py), at most
        every PROGRESS_S, only those that changed."""
        now = time.monotonic()
        if now - self._reported_at < PROGRESS_S or not self.clocks:
            return
        self._reported_at = now
        news = {
            p: c.watermark()
            for p, c in self.clocks.items()
            if self._marked.get(p) != (c.passed_ms, c.idle_since_ms)
        }
        if not news or self._needs_sync or not self.membership.holds(list(self.clocks)):
            return
        records = [(self.marks.key(p), mark.encode()) for p, mark in sorted(news.items())]
        if not self._send_reports(records, news, "watermarks"):
            return
        for p, mark in news.items():
            self._marked[p] = (mark.passed_ms, mark.idle_since_ms)

    def _note_deleted(self, task: MemberWindow, since: dict[int, int]) -> None:
        """Note on ``task`` the records of each partition p of ``since`` from ``since[p]`` to
        the partition's first offset, if the topic's retention deleted them before they were
        counted (a jump in a partition's offsets is most often a transaction marker)."""
        for p, low in self._deleted_since(
            {p: at for p, at in since.items() if p not in task.lost}
        ).items():
            task.lost[p] = (int(since[p]), low)
            log.warning(
                "records of partition %d of %s from offset %d to %d were deleted by "
                "the topic's retention before they were counted; window %d is withheld "
                "naming them",
                p,
                self.source_topic,
                since[p],
                low,
                task.window,
            )

    def _deleted_since(self, since: dict[int, int]) -> dict[int, int]:
        """Partition -> its first offset, for each partition p of ``since`` whose records from
        ``since[p]`` were deleted before they were counted (:func:`.deleted.deleted_since`)."""

        lows = deleted_since(
            self.consumer, {TopicPartition(self.source_topic, p): at for p, at in since.items()}
        )
        return {tp.partition: low for tp, low in lows.items()}

    def _still_owned(self, task: MemberWindow) -> bool:
        """Whether this member still holds the window's partitions in the generation it synced
        (kafka-python rejoins in its background thread: a rebalance may have moved them since
        the last poll, and its listener only marks the sync as needed)."""
        return not self._needs_sync and self.membership.holds(task.ranges)

    def _why_not_owned(self, task: MemberWindow) -> str:
        if self._needs_sync:
            return "a rebalance came since the last sync"
        return self.membership.why_not(task.ranges) or "?"

    def _refusal(self, window: int, ranges: dict) -> str | None:
        return charged_before(
            self.ledger, self.identity, ranges, self.identity.get("window_kind", "time")
        )
