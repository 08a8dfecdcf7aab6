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

What the repartition topic holds: counter indices of events, in plaintext, like the source topic
(docs/privacy.md section 17). Its retention is bounded (``scale.repartition_retention_s``).
"""

from __future__ import annotations

import logging
import time

from kafka.errors import KafkaError

import numpy as np

from consumers.base import Segment

from .topics import read_partition

__all__ = ["Repartitioner", "Route", "slice_size"]

log = logging.getLogger("panagg.group")


def slice_size(size: int, partitions: int, partition: int) -> int:
    """Counters of partition ``partition``'s slice: indices i < size with i mod P = partition.

    >>> [slice_size(10, 3, p) for p in range(3)]
    [4, 3, 3]
    """
    return max(0, -(-(int(size) - int(partition)) // int(partitions)))


class Route:
    """Where intake sends one aggregation's counter indices."""

    def __init__(self, topic: str, partitions: int, decoder, index_of, metrics):
        self.topic, self.partitions = topic, int(partitions)
        self.decoder, self.index_of, self.metrics = decoder, index_of, metrics


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

    def __init__(self, consumer, txn, routes: list[Route], max_records: int = 20000, *,
                 marks_topic: str = "", marks_reader=None):
        self.consumer, self.txn = consumer, txn
        self.routes = list(routes)
        self.max_records = int(max_records)
        self.records = 0
        #: (topic, partition) -> next source offset already repartitioned (from marks_topic)
        self.marks: dict[tuple[str, int], int] = {}
        self.marks_topic, self._marks_reader = marks_topic, marks_reader
        self._skip_noted: set[tuple[str, int]] = set()
        if marks_reader is not None:
            from kafka import TopicPartition
            self._marks_tp = TopicPartition(marks_topic, 0)
            marks_reader.assign([self._marks_tp])
            marks_reader.seek_to_beginning(self._marks_tp)
            self.read_marks()

    def read_marks(self, timeout_s: float = 30.0) -> None:
        """Read every committed high-water mark (at start and after each rebalance: a partition
        may come from a member that repartitioned it a moment ago)."""
        def take(r):
            topic, _, part = r.key.decode().rpartition(":")
            key = (topic, int(part))
            self.marks[key] = max(self.marks.get(key, 0), int(r.value))

        read_partition(self._marks_reader, self._marks_tp, take, timeout_s)

    def _above_marks(self, tp, recs):
        """The records of ``recs`` not repartitioned before (all but a reset's replay)."""
        mark = self.marks.get((tp.topic, tp.partition), 0)
        if not recs or recs[0].offset >= mark:
            return recs
        if (tp.topic, tp.partition) not in self._skip_noted:
            self._skip_noted.add((tp.topic, tp.partition))
            log.warning("source partition %s:%d was read from offset %d, but the group "
                        "repartitioned it up to %d already (its committed offsets were reset or "
                        "lost): records below %d are not counted again", tp.topic, tp.partition,
                        recs[0].offset, mark, mark)
        return [r for r in recs if r.offset >= mark]

    def step(self, timeout_s: float = 0.2) -> int:
        """One poll, one transaction; the number of source records taken."""
        from kafka.structs import OffsetAndMetadata

        polled = self.consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=self.max_records)
        if not polled:
            return 0
        now_ms = int(time.time() * 1000)
        taken = 0
        txn = self.txn
        try:
            txn.begin()
            offsets = {}
            for tp, recs in polled.items():
                if not recs:
                    continue
                nxt = recs[-1].offset + 1
                recs = self._above_marks(tp, recs)
                for route in self.routes:
                    self._send(txn, route, tp, recs, now_ms)
                offsets[tp] = OffsetAndMetadata(nxt, "", -1)
                if self.marks_topic:
                    txn.send(self.marks_topic, partition=0,
                             key=f"{tp.topic}:{tp.partition}".encode(), value=str(nxt).encode())
                taken += len(recs)
            txn.send_offsets(offsets, self.consumer.group_metadata())
            txn.commit()
        except KafkaError as exc:
            self._abort(polled, exc)
            return 0
        for tp, om in offsets.items():
            key = (tp.topic, tp.partition)
            self.marks[key] = max(self.marks.get(key, 0), om.offset)
        self.records += taken
        return taken

    @staticmethod
    def _send(producer, route: Route, tp, recs, now_ms: int) -> None:
        if not recs:
            return
        seg = Segment(partition=f"{tp.topic}:{tp.partition}", offsets=[r.offset for r in recs],
                      values=[r.value for r in recs], keys=[r.key for r in recs],
                      headers=[r.headers for r in recs])
        decoded = route.decoder.decode(seg.values, seg.keys, seg.headers)
        if decoded.rejected:
            Repartitioner._count_rejects(route.metrics, decoded.rejected)
        idx = (np.asarray(route.index_of(decoded.items), dtype=np.int64) if len(decoded.items)
               else np.zeros(0, dtype=np.int64))
        part = idx % route.partitions
        local = (idx // route.partitions).astype("<i4")
        # one message to every partition, empty ones included: how many messages a partition
        # holds (its offsets, in logs and status) then depends on the polls, never on which
        # slices the items fell in
        for p in range(route.partitions):
            producer.send(route.topic, partition=p, timestamp_ms=now_ms,
                          value=local[part == p].tobytes())

    @staticmethod
    def _count_rejects(metrics, rejected) -> None:
        from consumers.decode import FILTERED

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
        log.warning("intake transaction aborted (%s); re-reading from the committed offsets",
                    type(exc).__name__)
        self.txn.failed(exc)
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
            self.consumer.unsubscribe()
            self.consumer.subscribe(self._topics)
