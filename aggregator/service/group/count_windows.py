"""The leader's count closer: ends a group's count windows once the group has taken N events.

One process ends a count window at its N-th event. A group's members read their source
partitions side by side, so the group's N-th event is a race between their transactions; what a
group can decide exactly once is *where in each repartition log* a window ends. So:

* the intake keeps, per source partition and aggregation, the running total of events it sent
  (decoded items, the ones a window counts), committed with the partition's offset (its
  metadata) and published under ``n:<repartition topic>:<source partition>`` in the intake topic
  in the same transaction (``Repartitioner``);
* the leader sums the published totals; once the sum has grown by ``window.size`` since the last
  cut, it writes, in ONE transaction (its transactional id: a fenced leader writes nothing), a
  close marker for window K into every repartition partition and ``count:<repartition topic>``
  = ``{"closed": K, "total": T}`` (the sum it cut at) into the intake topic, so the next leader
  goes on from there;
* each counting partition closes its open window at the marker (``Counter``): window K holds
  every event whose repartition message precedes the marker, in every partition.

Window K therefore holds the events the intakes committed between the two markers: ``N`` plus
or minus what they committed while the leader read the totals and wrote the markers (at most a
poll, ``scale.intake_max_records`` records, per source partition; more if the leader was away).
The cut never drifts: the next one is at ``T + N`` whatever K held. Each release states its
exact ``n``, and a replay never moves a marker, so every event is in exactly one window.

A forced release or an audit export ends the open window at once (``force``); the next window
then counts N from that cut.
"""

from __future__ import annotations

import json
import logging

from .topics import read_partition

__all__ = ["CountCloser", "cut_key"]

log = logging.getLogger("panagg.group")


def cut_key(repartition_topic: str) -> str:
    """The intake topic's key of the last count window cut (``{"closed", "total"}``)."""
    return f"count:{repartition_topic}"


class CountCloser:
    """Close markers for one count-window aggregation while this member leads.

    Parameters
    ----------
    txn
        The leader's :class:`~aggregator.service.group.txn.Transactions`.
    reader
        kafka-python consumer (no group, read_committed), assigned here to the intake topic.
    topics
        The aggregation's :class:`~aggregator.service.group.topics.GroupTopics`.
    partitions
        P, the repartition topic's partitions (each gets every marker).
    size
        ``window.size``: the events a window holds.
    """

    def __init__(self, txn, reader, topics, partitions: int, size: int):
        from kafka import TopicPartition

        self.txn, self.reader, self.topics = txn, reader, topics
        self.P, self.size = int(partitions), int(size)
        #: source partition -> events the intake has sent (committed), as published
        self.totals: dict[str, int] = {}
        #: the last window closed, and the total it was cut at (none yet: window 0 is open,
        #: from the group's first event)
        self.closed, self.cut_at = -1, 0
        self._cut_key = cut_key(topics.repartition)
        self._prefix = f"n:{topics.repartition}:"
        self._tp = TopicPartition(topics.intake, 0)
        reader.assign([self._tp])
        reader.seek_to_beginning(self._tp)
        read_partition(reader, self._tp, self._take)

    def _take(self, r) -> None:
        key = r.key.decode() if r.key else ""
        if r.value is None:
            return
        if key == self._cut_key:
            cut = json.loads(r.value)
            if int(cut["closed"]) > self.closed:
                self.closed, self.cut_at = int(cut["closed"]), int(cut["total"])
        elif key.startswith(self._prefix):
            src = key[len(self._prefix):]
            self.totals[src] = max(self.totals.get(src, 0), int(r.value))

    def read(self) -> None:
        for records in self.reader.poll(timeout_ms=0).values():
            for r in records:
                self._take(r)

    @property
    def total(self) -> int:
        """Events the group's intake has committed, all source partitions together."""
        return sum(self.totals.values())

    def _cut(self, extra_headers=(), also=None) -> int:
        """Close window ``closed + 1`` at the current total, in one transaction."""
        from kafka.errors import KafkaError

        k, total = self.closed + 1, self.total
        headers = [("close", str(k).encode()), *extra_headers]
        txn = self.txn
        try:
            txn.begin()
            for p in range(self.P):
                txn.send(self.topics.repartition, partition=p, value=b"", headers=headers)
            txn.send(self.topics.intake, partition=0, key=self._cut_key.encode(),
                     value=json.dumps({"closed": k, "total": total}).encode())
            if also is not None:
                also(txn, k)
            txn.commit()
        except KafkaError as exc:
            txn.failed(exc)
            raise
        self.closed, self.cut_at = k, total
        return k

    def step(self) -> int | None:
        """Read the new totals; cut the open window if the group took N events since the last
        cut (the window closed, or None)."""
        self.read()
        if self.total - self.cut_at < self.size:
            return None
        k = self._cut()
        log.info("count window %d of %s closed: the group's intake passed %d events since the "
                 "last cut", k, self.topics.repartition, self.size)
        return k

    def force(self, also, export_id: str | None = None) -> int:
        """A forced release or an audit export (forced.py, export.py): close the open window
        now, with ``also(txn, K)``'s messages (the answer) in the same transaction. An export's
        markers carry its id (each partition exports its slice, then closes)."""
        self.read()
        extra = [("export", export_id.encode())] if export_id else []
        k = self._cut(extra, also)
        log.info("%s: count window %d of %s closed now",
                 "audit export" if export_id else "forced release", k, self.topics.repartition)
        return k
