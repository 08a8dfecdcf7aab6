"""Intake: source records -> counter indices, partitioned by the domain slice they belong to.

Kafka Streams repartitions a stream by key before ``groupByKey``; this does the same for the
counted item, so the source topic may be keyed any way (or not at all). Each record is decoded
once; its item becomes a counter index ``i`` (direct mode: the item; hashed mode: its bucket
under the group's hash key) and goes to repartition partition ``i mod P`` as the local index
``i div P``. Partition p thus receives exactly the items of its slice of the domain, and its
counter holds ``ceil((D - p) / P)`` counters: the P slices together are one D-counter state.

One message per (poll, target partition) carries the local indices as little-endian int32, and
the message timestamp is the intake time (windows are cut by it). Every poll is one Kafka
transaction: the messages and the source offsets they came from (``send_offsets_to_transaction``
with the consumer's group metadata, so a member the group has dropped is fenced: its transaction
aborts and its messages are never read). A source record therefore enters the repartition topic
exactly once, whatever crashes or rebalances happen.

And only once ever: each transaction also writes, per source partition, the next offset it has
repartitioned to ``<group>.panagg.intake`` (compacted). Records below that high-water mark are
never taken again, even if the source group's committed offsets were reset (an operator's
``--reset-offsets --to-earliest``, offsets expired): the events are not released twice, and the
first such skip per partition says so in one line.

Source records deleted before they were read (the source topic's retention, a member down longer
than it): where a partition's offsets start (from its committed offset) or jump, the intake
looks whether its first offset is past where reading was due to go on. If so, the same
transaction writes a ``lost`` message (no indices, the deleted offsets in its header) to every
repartition partition, stamped like the poll's records, where the deleted records would have
been: each partition's window there is refused and the leader withholds it naming them
(counter.py). Event-time windows: the deleted records' timestamps went with them, so the
message names every window they may have held, from the first one their partition had not
passed to :func:`.deleted.lost_through` (now plus the allowed future skew), and each of those
is refused on every partition (event_windows.py).

What the repartition topic holds: counter indices of events, in plaintext, like the source topic
(docs/privacy.md section 17). Its retention is bounded (``scale.repartition_retention_s``).
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
from kafka import TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from consumers.base import Segment
from consumers.decode import FILTERED
from consumers.kafka.compat import finish_join, unpark

from ..deadletter import dead_letter_record
from .deleted import deleted_since, deleted_text, lost_through
from .topics import read_partition
from .watermark import MarkRecord, low_watermark, stamp, stamped, too_far_ahead

__all__ = ["Repartitioner", "Route", "EventClock", "slice_size", "total_key", "dead_letter_records"]

log = logging.getLogger("panagg.group")


def total_key(route_topic: str, tp) -> str:
    """The intake topic's key of a source partition's running event total for one count-window
    aggregation (``n:<repartition topic>:<source topic>:<partition>``)."""
    return f"n:{route_topic}:{tp.topic}:{tp.partition}"


def slice_size(size: int, partitions: int, partition: int) -> int:
    """Counters of partition ``partition``'s slice: indices i < size with i mod P = partition.

    >>> [slice_size(10, 3, p) for p in range(3)]
    [4, 3, 3]
    """
    return max(0, -(-(int(size) - int(partition)) // int(partitions)))


def source_header(tp, recs) -> tuple[str, bytes]:
    """The header naming the source positions a repartition message's indices came from
    (``<topic>:<partition>:<first>:<end>``): the leader charges them in the budget registry,
    which is keyed by source positions. The same on every target partition: no item in it."""
    return ("src", f"{tp.topic}:{tp.partition}:{recs[0].offset}:{recs[-1].offset + 1}".encode())


def dead_letter_records(route, tp, recs, rejected) -> list:
    """``(key, value, headers)`` of each rejected record's dead letter (not of the records the
    item filter leaves out), as one process writes them."""

    return [
        dead_letter_record(
            f"{tp.topic}:{tp.partition}",
            recs[i].offset,
            recs[i].value,
            reason,
            recs[i].key,
            aggregation=route.name or None,
        )
        for i, reason in rejected
        if reason != FILTERED
    ]


class EventClock:
    """Event-time windows of one aggregation (watermark.py): window size, allowed lateness, the
    future skew, the late policy and the idle timeout."""

    def __init__(
        self,
        *,
        size_s: float,
        lateness_s: float,
        max_future_skew_s: float,
        late: str,
        idle_timeout_s: float,
    ):
        self.size_ms = int(round(float(size_s) * 1000))
        self.lateness_ms = int(round(float(lateness_s) * 1000))
        self.skew_ms = int(round(float(max_future_skew_s) * 1000))
        self.late = late
        self.idle_timeout_ms = int(round(float(idle_timeout_s) * 1000))


class Route:
    """Where intake sends one aggregation's counter indices (``clock``: by event time)."""

    def __init__(
        self,
        topic: str,
        partitions: int,
        decoder,
        index_of,
        metrics,
        clock: EventClock | None = None,
        *,
        name: str = "",
        dead_topic: str = "",
        counted: bool = False,
    ):
        self.topic, self.partitions = topic, int(partitions)
        self.decoder, self.index_of, self.metrics = decoder, index_of, metrics
        self.clock = clock
        #: count windows: the intake keeps each source partition's running total of events
        #: it sent this route, which the leader sums to cut the windows (count_windows.py)
        self.counted = bool(counted)
        #: the aggregation's name (dead letters say which one rejected a record) and
        #: source.dead_letter_topic ("" : none)
        self.name, self.dead_topic = name, dead_topic


class Repartitioner:
    """Reads the source topic in the user's consumer group and writes the repartition topics
    (one per aggregation: the records are read and decoded once per aggregation, in one pass,
    all written in one transaction).

    Parameters
    ----------
    consumer
        kafka-python consumer subscribed to the source topic (group ``source.group``, no
        auto-commit, read_committed).
    txn
        :class:`~aggregator.service.group.txn.Transactions` (the transactional producer).
    routes
        One :class:`Route` per aggregation: its repartition topic and partition count P, its
        record decoder (:class:`consumers.decode.Decoder`), ``index_of`` (counter index of each
        decoded item, int64 in [0, D)) and its metrics (decode errors, filtered records).
    """

    def __init__(
        self,
        consumer,
        txn,
        routes: list[Route],
        max_records: int = 20000,
        *,
        marks_topic: str = "",
        marks_reader=None,
    ):
        self.consumer, self.txn = consumer, txn
        self.routes = list(routes)
        self.max_records = int(max_records)
        self.records = 0
        #: (topic, partition) -> next source offset already repartitioned (from marks_topic)
        self.marks: dict[tuple[str, int], int] = {}
        self.marks_topic, self._marks_reader = marks_topic, marks_reader
        self._skip_noted: set[tuple[str, int]] = set()
        #: event time: MarkRecord per "wm:" key (every source partition's, whoever wrote it),
        #: for pacing and idleness; it may lag a moment behind the commits
        self.watermarks: dict[str, MarkRecord] = {}
        #: event time: per "wm:" key of an assigned partition, its largest timestamp at the
        #: committed offset (read from that offset's metadata: the two are one commit), which
        #: decides the windows of the records after it
        self.passed: dict[str, int | None] = {}
        #: and the timestamp of its first record (the leader opens the first window by them)
        self.first: dict[str, int | None] = {}
        #: count windows: per "n:" key of an assigned partition, the events it has sent the
        #: route up to the committed offset (from that offset's metadata, like ``passed``)
        self.totals: dict[str, int] = {}
        #: and the same totals as published in the intake topic (read with the marks)
        self.published_totals: dict[str, int] = {}
        self._need_passed: set = set()
        #: times a source partition was paused for running ahead of the watermark
        self.pauses = 0
        self._idle_checked = 0.0
        self._idle_written: dict[str, int] = {}
        self._taken_at: dict = {}
        #: TopicPartition -> the next source offset due (None: none, a new group); a partition
        #: not in it is looked at from its committed offset at the next step
        self._next: dict = {}
        #: partitions whose committed offset is still to be compared with their first offset
        self._unchecked: set = set()
        if marks_reader is not None:
            self._marks_tp = TopicPartition(marks_topic, 0)
            marks_reader.assign([self._marks_tp])
            marks_reader.seek_to_beginning(self._marks_tp)
            self.read_marks()

    def read_marks(self, timeout_s: float = 30.0) -> None:
        """Read every committed high-water mark (at start and after each rebalance: a partition
        may come from a member that repartitioned it a moment ago)."""
        read_partition(self._marks_reader, self._marks_tp, self._take_mark, timeout_s)

    def _take_mark(self, r) -> None:
        key = r.key.decode()
        if r.value is not None and key.startswith("n:"):
            # a partition's running total as last committed (by whichever member): if its
            # offset's metadata is gone (offsets expired or reset), the total goes on from here
            self.published_totals[key] = max(self.published_totals.get(key, 0), int(r.value))
            return
        if r.value is None or key.startswith(("close:", "count:")):
            return  # the leader's keys (closer.py, count_windows.py)
        if key.startswith("wm:"):
            self.watermarks[key] = MarkRecord.decode(r.value)
            return
        topic, _, part = key.rpartition(":")
        if not part.isdigit():
            return  # another key of the topic: a forced release's request or answer (forced.py)
        pair = (topic, int(part))
        self.marks[pair] = max(self.marks.get(pair, 0), int(r.value))

    def _tail_marks(self) -> None:
        """The watermarks other members committed since (never waits)."""
        for records in self._marks_reader.poll(timeout_ms=0).values():
            for r in records:
                self._take_mark(r)

    def assigned(self, tps) -> None:
        """The group assigned ``tps`` (a rebalance callback): their watermarks are read from
        their committed offsets' metadata before their records are stamped."""
        self._need_passed |= set(tps)
        for tp in tps:
            self._next.pop(tp, None)  # looked at from its committed offset

    def _load_passed(self, tps) -> None:
        for tp in tps:
            om = self.consumer.committed(tp, metadata=True, timeout_ms=5000)
            try:
                meta = json.loads(om.metadata) if om is not None and om.metadata else {}
            except ValueError:
                meta = {}
            for route in self._clocked:
                key = MarkRecord.key(route.topic, f"{tp.topic}:{tp.partition}")
                self.passed[key], self.first[key] = (meta.get("wm") or {}).get(route.topic) or (
                    None,
                    None,
                )
            for route in self._counted:
                key = total_key(route.topic, tp)
                self.totals[key] = max(
                    int((meta.get("n") or {}).get(route.topic, 0)),
                    self.published_totals.get(key, 0),
                )
        self._need_passed -= set(tps)

    def _offset_meta(self, tp, marks: dict, totals: dict | None = None) -> str:
        """The committed offset's metadata: the partition's watermark and first timestamp per
        aggregation (``marks``: the new MarkRecords of this transaction), and its running event
        total per count-window aggregation (``totals``: this transaction's new ones)."""
        if not self._clocked and not self._counted:
            return ""
        src = f"{tp.topic}:{tp.partition}"
        meta = {}
        if self._clocked:
            wm = meta["wm"] = {}
            for route in self._clocked:
                key = MarkRecord.key(route.topic, src)
                m = marks.get(key)
                wm[route.topic] = (
                    [m.passed_ms, m.first_ms]
                    if m is not None
                    else [self.passed.get(key), self.first.get(key)]
                )
        if self._counted:
            totals = totals or {}
            meta["n"] = {}
            for route in self._counted:
                key = total_key(route.topic, tp)
                meta["n"][route.topic] = totals.get(key, self.totals.get(key, 0))
        return json.dumps(meta, separators=(",", ":"))

    @property
    def _counted(self) -> list[Route]:
        return [r for r in self.routes if r.counted]

    @property
    def _clocked(self) -> list[Route]:
        return [r for r in self.routes if r.clock is not None]

    def _pace(self) -> None:
        """Pause a source partition that has passed more than MAX_AHEAD_WINDOWS windows beyond
        the low watermark (the counting partitions keep a live state per open window); resume
        it once the watermark follows."""
        if not self._clocked or self._marks_reader is None:
            return
        self._tail_marks()
        now_ms = int(time.time() * 1000)
        sources = [f"{tp.topic}:{tp.partition}" for tp in self._all_partitions()]
        ahead = set()
        for route in self._clocked:
            c = route.clock
            marks = {s: self.watermarks.get(MarkRecord.key(route.topic, s)) for s in sources}
            low = low_watermark(marks, sources, now_ms=now_ms, idle_timeout_ms=c.idle_timeout_ms)
            for tp in self.consumer.assignment():
                mine = marks.get(f"{tp.topic}:{tp.partition}")
                if too_far_ahead(mine.passed_ms if mine else None, low, size_ms=c.size_ms):
                    ahead.add(tp)
        paused = self.consumer.paused()
        if ahead - paused:
            self.consumer.pause(*(ahead - paused))
            self.pauses += len(ahead - paused)
        if paused - ahead:
            self.consumer.resume(*(paused - ahead))

    def _all_partitions(self):
        out = []
        for topic in self._topics:
            for p in sorted(self.consumer.partitions_for_topic(topic) or ()):
                out.append(TopicPartition(topic, p))
        return out

    def _above_marks(self, tp, recs):
        """The records of ``recs`` not repartitioned before (all but a reset's replay)."""
        mark = self.marks.get((tp.topic, tp.partition), 0)
        if not recs or recs[0].offset >= mark:
            return recs
        if (tp.topic, tp.partition) not in self._skip_noted:
            self._skip_noted.add((tp.topic, tp.partition))
            log.warning(
                "source partition %s:%d was read from offset %d, but the group "
                "repartitioned it up to %d already (its committed offsets were reset or "
                "lost): records below %d are not counted again",
                tp.topic,
                tp.partition,
                recs[0].offset,
                mark,
                mark,
            )
        return [r for r in recs if r.offset >= mark]

    def step(self, timeout_s: float = 0.2) -> int:
        """One poll, one transaction; the number of source records taken."""

        self._pace()
        if self._clocked:
            # kafka-python 3.0.12 keeps a resumed partition's parked records (and the partition)
            # out of every later fetch without this: consumers/kafka_source.py says why
            unpark(self.consumer)
        finish_join(self.consumer)
        polled = self.consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=self.max_records)
        if time.monotonic() - self._idle_checked >= 1.0:
            self._idle_checked = time.monotonic()
            self._note_idle(polled)
        try:
            lost = self._deleted(polled)
        except KafkaError:  # looked at again at the next step (nothing is skipped)
            for tp, recs in polled.items():
                if recs:
                    self.consumer.seek(tp, recs[0].offset)
            return 0
        if not polled and not lost:
            return 0
        if self._need_passed and (self._clocked or self._counted):
            try:
                self._load_passed(
                    [tp for tp in self._need_passed if tp in self.consumer.assignment()]
                )
            except KafkaError:
                # the records are read again once the watermarks can be (nothing is skipped)
                for tp, recs in polled.items():
                    if recs:
                        self.consumer.seek(tp, recs[0].offset)
                for tp in lost:
                    self._next.pop(tp, None)  # its deleted records are looked at again
                raise
        now_ms = int(time.time() * 1000)
        taken = 0
        txn = self.txn
        try:
            txn.begin()
            offsets = {}
            passed = {}
            totals = {}
            for tp, (first, low) in lost.items():
                self._send_lost(txn, tp, first, low, now_ms)
                if not polled.get(tp):  # read from the first record left, named once
                    offsets[tp] = OffsetAndMetadata(low, self._offset_meta(tp, {}), -1)
            for tp, recs in polled.items():
                if not recs:
                    continue
                nxt = recs[-1].offset + 1
                recs = self._above_marks(tp, recs)
                for route in self.routes:
                    if route.clock is None:
                        sent = self._send(txn, route, tp, recs, now_ms)
                        if route.counted and sent:
                            key = total_key(route.topic, tp)
                            totals[key] = self.totals.get(key, 0) + sent
                            # the leader sums these to cut the count windows
                            txn.send(
                                self.marks_topic,
                                partition=0,
                                key=key.encode(),
                                value=str(totals[key]).encode(),
                            )
                    else:
                        key = MarkRecord.key(route.topic, f"{tp.topic}:{tp.partition}")
                        new = self._send_event_time(
                            txn, route, tp, recs, now_ms, self.passed.get(key), self.first.get(key)
                        )
                        if new.passed_ms is not None:
                            passed[key] = new
                            # published for the leader's watermark and the intakes' pacing
                            txn.send(
                                self.marks_topic, partition=0, key=key.encode(), value=new.encode()
                            )
                # the watermark rides with the offset it holds at: one commit, one decision
                offsets[tp] = OffsetAndMetadata(nxt, self._offset_meta(tp, passed, totals), -1)
                if self.marks_topic:
                    txn.send(
                        self.marks_topic,
                        partition=0,
                        key=f"{tp.topic}:{tp.partition}".encode(),
                        value=str(nxt).encode(),
                    )
                taken += len(recs)
            txn.send_offsets(offsets, self.consumer.group_metadata())
            txn.commit()
        except KafkaError as exc:
            self._abort({**{tp: [] for tp in lost}, **polled}, exc)
            return 0
        for tp, om in offsets.items():
            key = (tp.topic, tp.partition)
            self.marks[key] = max(self.marks.get(key, 0), om.offset)
            self._next[tp] = om.offset
            if polled.get(tp):
                self._taken_at[tp] = now_ms
        self.totals.update(totals)
        for key, mark in passed.items():
            self.passed[key], self.first[key] = mark.passed_ms, mark.first_ms
            self.watermarks[key] = mark
            self._idle_written.pop(key, None)
        self.records += taken
        return taken

    def _deleted(self, polled) -> dict:
        """TopicPartition -> (first, end) source offsets deleted before they were read: for a
        partition just assigned, from its committed offset (or the group's mark) to its first
        offset; for one whose records jump, from where they were due to go on. A jump is most
        often a transaction marker; each poll with one costs one look at the first offsets."""
        since = {}
        for tp in self.consumer.assignment():
            if tp not in self._next:
                at = self.consumer.committed(tp, timeout_ms=5000)
                self._next[tp] = (
                    self.marks.get((tp.topic, tp.partition)) if at is None or at < 0 else int(at)
                )
                self._unchecked.add(tp)
            at, recs = self._next[tp], polled.get(tp)
            if at is not None and (
                (recs and recs[0].offset > at) or (not recs and tp in self._unchecked)
            ):
                since[tp] = at
        lows = deleted_since(self.consumer, since)
        self._unchecked.clear()
        for tp, low in lows.items():
            log.warning(
                "records of partition %d of %s from offset %d to %d were deleted by "
                "the topic's retention before they were read; the windows they may "
                "have been counted in are withheld naming them",
                tp.partition,
                tp.topic,
                since[tp],
                low,
            )
        return {tp: (since[tp], low) for tp, low in lows.items()}

    def _send_lost(self, producer, tp, first: int, end: int, now_ms: int) -> None:
        """To every repartition partition of each route, a message with no indices naming the
        deleted offsets, stamped like the poll's records: the window that would have counted
        them is refused on every partition (counter.py), so the leader withholds it. Event
        time: every window they may have held (``from``, ``through`` headers), from the first
        one their partition had not passed (-1: it had no record yet, every open one)."""
        text = (
            f"{deleted_text(tp.topic, tp.partition, first, end)}; a window that may have "
            "counted them cannot be released whole"
        ).encode()
        for route in self.routes:
            headers = [("lost", text)]
            c = route.clock
            if c is not None:
                passed = self.passed.get(MarkRecord.key(route.topic, f"{tp.topic}:{tp.partition}"))
                lo = -1 if passed is None else (passed - c.lateness_ms) // c.size_ms
                through = lost_through(now_ms, size_ms=c.size_ms, skew_ms=c.skew_ms)
                headers += [("from", str(lo).encode()), ("through", str(through).encode())]
            for p in range(route.partitions):
                producer.send(
                    route.topic, partition=p, timestamp_ms=now_ms, headers=headers, value=b""
                )

    def _note_idle(self, polled) -> None:
        """``window.idle_partition_timeout_s``: a source partition read to its end says since
        when, once, with its watermark (the leader then stops waiting for it after the
        timeout). Written with the partition's offsets, so a fenced member writes nothing."""

        routes = [r for r in self._clocked if r.clock.idle_timeout_ms]
        if not routes:
            return
        now_ms = int(time.time() * 1000)
        writes, offsets = {}, {}
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            if (
                polled.get(tp)
                or tp in self._need_passed
                or high is None
                or self.consumer.position(tp) < high
            ):
                continue
            since = self._taken_at.setdefault(tp, now_ms)
            for route in routes:
                key = MarkRecord.key(route.topic, f"{tp.topic}:{tp.partition}")
                if self._idle_written.get(key) == since:
                    continue
                writes[key] = MarkRecord(self.passed.get(key), since, self.first.get(key))
                offsets[tp] = OffsetAndMetadata(
                    self.consumer.position(tp), self._offset_meta(tp, {}), -1
                )
        if not writes:
            return
        try:
            self.txn.begin()
            for key, mark in writes.items():
                self.txn.send(self.marks_topic, partition=0, key=key.encode(), value=mark.encode())
            self.txn.send_offsets(offsets, self.consumer.group_metadata())
            self.txn.commit()
        except KafkaError as exc:
            self._abort(offsets, exc)
            return
        self.watermarks.update(writes)
        for key, mark in writes.items():
            self._idle_written[key] = mark.idle_since_ms

    @staticmethod
    def _send_event_time(producer, route: Route, tp, recs, now_ms: int, passed_ms, first_ms=None):
        """Event time (watermark.py): each record's window (late ones: the first window their
        partition had not passed, or rejected), one message per (window, late) and target
        partition, the window in the headers. Returns the partition's new MarkRecord (its
        largest timestamp and its first record's; None where it still has none)."""
        if not recs:
            return MarkRecord(passed_ms, None, first_ms)
        c = route.clock
        decoded, good, ts, rejects, keep = stamped(route.decoder, recs, now_ms, c.skew_ms)
        items = decoded.items
        items = (
            np.asarray(items)[keep]
            if isinstance(items, np.ndarray)
            else [it for it, k in zip(items, keep) if k]
        )
        ts = ts[keep]
        if first_ms is None and len(ts):
            first_ms = int(ts[0])
        window, late, passed = stamp(ts, passed_ms, size_ms=c.size_ms, lateness_ms=c.lateness_ms)
        if c.late == "dead_letter" and late.any():
            rejects += [(int(i), "late") for i in good[keep][late]]
            items = (
                np.asarray(items)[~late]
                if isinstance(items, np.ndarray)
                else [it for it, k in zip(items, ~late) if k]
            )
            window, late = window[~late], late[~late]
        if rejects:
            Repartitioner._count_rejects(route.metrics, rejects)
            Repartitioner._dead_letters(producer, route, tp, recs, rejects)
        idx = (
            np.asarray(route.index_of(items), dtype=np.int64)
            if len(items)
            else np.zeros(0, dtype=np.int64)
        )
        part = idx % route.partitions
        local = (idx // route.partitions).astype("<i4")
        groups = sorted({(int(w), bool(x)) for w, x in zip(window, late)})
        src = source_header(tp, recs)
        # every (window, late) group to every partition, empty ones included: the partitions'
        # offsets depend on the records' timestamps (public), never on their items
        for w, is_late in groups:
            sel = (window == w) & (late == is_late)
            headers = [("w", str(w).encode()), src] + ([("late", b"1")] if is_late else [])
            for p in range(route.partitions):
                producer.send(
                    route.topic,
                    partition=p,
                    timestamp_ms=now_ms,
                    headers=headers,
                    value=local[sel & (part == p)].tobytes(),
                )
        return MarkRecord(passed, None, first_ms)

    @staticmethod
    def _send(producer, route: Route, tp, recs, now_ms: int) -> int:
        """Send ``recs``' counter indices to ``route``; returns how many (events counted)."""
        if not recs:
            return 0
        seg = Segment(
            partition=f"{tp.topic}:{tp.partition}",
            offsets=[r.offset for r in recs],
            values=[r.value for r in recs],
            keys=[r.key for r in recs],
            headers=[r.headers for r in recs],
        )
        decoded = route.decoder.decode(seg.values, seg.keys, seg.headers)
        if decoded.rejected:
            Repartitioner._count_rejects(route.metrics, decoded.rejected)
            Repartitioner._dead_letters(producer, route, tp, recs, decoded.rejected)
        idx = (
            np.asarray(route.index_of(decoded.items), dtype=np.int64)
            if len(decoded.items)
            else np.zeros(0, dtype=np.int64)
        )
        part = idx % route.partitions
        local = (idx // route.partitions).astype("<i4")
        # one message to every partition, empty ones included: how many messages a partition
        # holds (its offsets, in logs and status) then depends on the polls, never on which
        # slices the items fell in
        src = [source_header(tp, recs)]
        for p in range(route.partitions):
            producer.send(
                route.topic,
                partition=p,
                timestamp_ms=now_ms,
                headers=src,
                value=local[part == p].tobytes(),
            )
        return len(local)

    @staticmethod
    def _dead_letters(producer, route: Route, tp, recs, rejected) -> None:
        """Each rejected record (not the ones the item filter leaves out) to
        ``source.dead_letter_topic``, in the intake's transaction: a record's dead letter is
        written exactly when its source offset is committed, once."""
        if not route.dead_topic:
            return
        sent = 0
        for key, value, headers in dead_letter_records(route, tp, recs, rejected):
            producer.send(route.dead_topic, key=key, value=value, headers=headers)
            sent += 1
        # panagg_dead_letters_total, as one process counts them (the PanaggDeadLetters alert);
        # like the rejects, counted when sent in the transaction (an aborted one re-sends them)
        route.metrics.dead_letters.inc(sent)

    @staticmethod
    def _count_rejects(metrics, rejected) -> None:
        counts: dict[str, int] = {}
        for _, reason in rejected:
            counts[reason] = counts.get(reason, 0) + 1
        skipped = counts.pop(FILTERED, 0)
        if skipped:
            metrics.filtered.inc(skipped)
        for reason, count in counts.items():
            metrics.decode_errors.labels(reason=reason).inc(count)

    @property
    def _topics(self) -> list[str]:
        return sorted(self.consumer.subscription() or [])

    def _abort(self, polled, exc) -> None:
        """The transaction failed (fenced after a rebalance, a broker gone): nothing of it is
        visible; read the records again from the group's committed offsets."""
        log.warning(
            "intake transaction aborted (%s); re-reading from the committed offsets",
            type(exc).__name__,
        )
        self.txn.failed(exc)
        self._need_passed |= set(polled)  # back to what the committed offsets say
        for tp in polled:
            self._next.pop(tp, None)
        try:
            for tp in polled:
                if tp not in self.consumer.assignment():
                    continue
                committed = self.consumer.committed(tp, timeout_ms=5000)
                if committed is None:
                    self.consumer.seek_to_beginning(tp)
                else:
                    self.consumer.seek(tp, committed)
        except KafkaError:  # the broker is away: the group re-seeks at the next assignment
            self._rejoin()

    def _rejoin(self) -> None:
        """Leave the source group and subscribe again (same topics, same rebalance listener):
        the next assignment places every partition at its committed offset. The topics are
        taken before ``unsubscribe``, which empties the subscription (subscribing to nothing
        raised ValueError and killed the member during a broker outage, issue 46)."""
        topics = self._topics
        listener = getattr(
            getattr(self.consumer, "_subscription", None), "rebalance_listener", None
        )
        try:
            self.consumer.unsubscribe()
        except KafkaError:  # its LeaveGroup cannot reach the broker: the session expires it
            pass
        self.consumer.subscribe(topics, listener=listener)
