"""The leader's closer: ends event-time windows with close markers in every repartition partition.

It reads the watermarks the intake commits (``<group>.panagg.intake``, one per source partition
and aggregation, :mod:`.watermark`), takes the low watermark W over the source topic's
partitions and, once W reaches a window's end plus ``window.allowed_lateness_s``, writes in ONE
transaction (the leader's transactional id: a fenced leader writes nothing) a marker closing every
window up to K into each repartition partition, and K itself under ``close:<repartition topic>``
in the intake topic, so the next leader goes on from K. Each counting partition then closes
those windows at the marker's position in its own log (:mod:`.event_windows`).

The first marker *opens* the group's windows: once every source partition has a first record
(or is idle), it closes everything before the earliest first record's window, as one process
opens its first window there. The counting partitions count nothing before it: they read up to
it and start again from their first offset knowing where windows begin (records stamped
earlier are late), so a group created before its records arrive (a backfill) windows them as one
process would.
"""

from __future__ import annotations

import logging
import time

from kafka.errors import KafkaError

from .topics import follow_intake
from .watermark import MarkRecord, closable_upto, low_watermark, opening_window

__all__ = ["Closer"]

log = logging.getLogger("panagg.group")


class Closer:
    """Close markers for one aggregation while this member leads.

    Parameters
    ----------
    txn
        The leader's :class:`~aggregator.service.group.txn.Transactions`.
    reader
        kafka-python consumer (no group, read_committed), assigned here to the intake topic.
    sources
        The source topic's partitions, as ``"<topic>:<partition>"``: each holds the watermark.
    clock
        The aggregation's :class:`~aggregator.service.group.repartition.EventClock`.
    """

    def __init__(self, txn, reader, topics, partitions: int, sources: list[str], clock):
        self.txn, self.reader, self.topics = txn, reader, topics
        self.P, self.sources, self.clock = int(partitions), list(sources), clock
        self.marks: dict[str, MarkRecord] = {}
        #: the last window closed (None: the windows are not opened yet)
        self.closed: int | None = None
        self._close_key = MarkRecord.close_key(topics.repartition)
        self._prefix = f"wm:{topics.repartition}:"
        self._read = follow_intake(reader, topics, self._take)

    def _take(self, r) -> None:
        key = r.key.decode() if r.key else ""
        if r.value is None:
            return
        if key == self._close_key:
            self.closed = max(
                self.closed if self.closed is not None else int(r.value), int(r.value)
            )
        elif key.startswith(self._prefix):
            self.marks[key[len(self._prefix) :]] = MarkRecord.decode(r.value)

    def watermark(self, now_ms: int | None = None) -> int | None:
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        return low_watermark(
            self.marks, self.sources, now_ms=now_ms, idle_timeout_ms=self.clock.idle_timeout_ms
        )

    def force(self, also) -> int | None:
        """A forced release (forced.py): close every window up to the newest one a source
        partition has reached, now, with ``also(txn, K)``'s messages (the answer) in the same
        transaction. Records of those windows read later are late (event_windows.py), as after
        any marker. None: the windows are not open yet (nothing to close)."""

        self._read()
        if self.closed is None:
            return None
        seen = [m.passed_ms for m in self.marks.values() if m.passed_ms is not None]
        upto = max([self.closed] + [int(t) // self.clock.size_ms for t in seen])
        txn = self.txn
        try:
            txn.begin()
            if upto > self.closed:
                for p in range(self.P):
                    txn.send(
                        self.topics.repartition,
                        partition=p,
                        value=b"",
                        headers=[("close", str(upto).encode())],
                    )
                txn.send(
                    self.topics.intake,
                    partition=0,
                    key=self._close_key.encode(),
                    value=str(upto).encode(),
                )
            also(txn, upto)
            txn.commit()
        except KafkaError as exc:
            txn.failed(exc)
            raise
        log.info(
            "forced release: event-time windows up to %d of %s closed now",
            upto,
            self.topics.repartition,
        )
        self.closed = upto
        return upto

    def step(self) -> int | None:
        """Read the new watermarks; write the markers if windows can close (the new K)."""
        self._read()
        if self.closed is None:
            first = opening_window(
                self.marks,
                self.sources,
                now_ms=int(time.time() * 1000),
                idle_timeout_ms=self.clock.idle_timeout_ms,
                size_ms=self.clock.size_ms,
            )
            upto = None if first is None else first - 1
        else:
            upto = closable_upto(
                self.watermark(), size_ms=self.clock.size_ms, lateness_ms=self.clock.lateness_ms
            )
            if upto is not None and upto <= self.closed:
                upto = None
        if upto is None:
            return None

        txn = self.txn
        try:
            txn.begin()
            for p in range(self.P):
                txn.send(
                    self.topics.repartition,
                    partition=p,
                    value=b"",
                    headers=[("close", str(upto).encode())],
                )
            txn.send(
                self.topics.intake,
                partition=0,
                key=self._close_key.encode(),
                value=str(upto).encode(),
            )
            txn.commit()
        except KafkaError as exc:
            txn.failed(exc)
            raise
        if self.closed is None:
            log.info(
                "event-time windows of %s open at window %d (the earliest first record of "
                "the source partitions)",
                self.topics.repartition,
                upto + 1,
            )
        else:
            log.info(
                "event-time windows up to %d of %s closed: the low watermark passed their "
                "end plus the allowed lateness",
                upto,
                self.topics.repartition,
            )
        self.closed = upto
        return upto
