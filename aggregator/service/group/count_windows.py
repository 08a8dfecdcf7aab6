"""The leader's count closer: ends a group's count windows once the group has taken N events.

One process ends a count window at its N-th event. A group's members read their source
partitions side by side, so the group's N-th event is a race between their transactions; what a
group can decide exactly once is *where in each repartition log* a window ends. So:

* the intake keeps, per source partition and aggregation, the running total of events it sent
  (decoded items, the ones a window counts), committed with the partition's offset (its
  metadata) and published under ``n:<repartition topic>:<source partition>`` in the intake topic
  in the same transaction (``Repartitioner``);
* the leader sums the published totals; once the sum reaches the next cut's target (K + 1) N
  (counted from the group's start or the last forced cut), it writes, in ONE transaction (its
  transactional id: a fenced leader writes nothing), a close marker for window K into every
  repartition partition and ``count:<repartition topic>`` = ``{"closed": K, "total": T,
  "next": target}`` into the intake topic, so the next leader goes on from there;
* each counting partition closes its open window at the marker (``Counter``): window K holds
  every event whose repartition message precedes the marker, in every partition.

Window K therefore holds the events the intakes committed between the two markers: ``N`` plus
or minus what they committed while the leader read the totals and wrote the markers (about a
poll of the stream; more if the leader was away). The targets are multiples of N, not the
totals a cut happened at, so the overshoots do not add up: the events in windows 0..K are at
least (K + 1) N and windows hold N on average. Only when a cut found the total a whole window
past its target (the leader was away) does the next target start from that total, so no
window is cut empty to catch up. Each release states its exact ``n``, and a replay never moves
a marker, so every event is in exactly one window.

A forced release or an audit export ends the open window at once (``force``); the next window
then counts N from that cut.
"""

from __future__ import annotations

import json
import logging

from kafka.errors import KafkaError

from .topics import follow_intake

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
        self.txn, self.reader, self.topics = txn, reader, topics
        self.P, self.size = int(partitions), int(size)
        #: source partition -> events the intake has sent (committed), as published
        self.totals: dict[str, int] = {}
        #: the last window closed, the total it was cut at, and the total the next cut waits
        #: for (none yet: window 0 is open, from the group's first event)
        self.closed, self.cut_at, self.next_at = -1, 0, self.size
        self._cut_key = cut_key(topics.repartition)
        self._prefix = f"n:{topics.repartition}:"
        #: ``read()``: the totals and cuts committed since (never waits)
        self.read = follow_intake(reader, topics, self._take)

    def _take(self, r) -> None:
        key = r.key.decode() if r.key else ""
        if r.value is None:
            return
        if key == self._cut_key:
            cut = json.loads(r.value)
            if int(cut["closed"]) > self.closed:
                self.closed, self.cut_at = int(cut["closed"]), int(cut["total"])
                self.next_at = int(cut["next"])
        elif key.startswith(self._prefix):
            src = key[len(self._prefix) :]
            self.totals[src] = max(self.totals.get(src, 0), int(r.value))

    @property
    def total(self) -> int:
        """Events the group's intake has committed, all source partitions together."""
        return sum(self.totals.values())

    def _cut(self, extra_headers=(), also=None, forced: bool = False) -> int:
        """Close window ``closed + 1`` at the current total, in one transaction."""

        k, total = self.closed + 1, self.total
        nxt = self.next_at + self.size
        if forced or total >= nxt:  # a forced cut, or the leader was a window behind
            nxt = total + self.size
        headers = [("close", str(k).encode()), *extra_headers]
        txn = self.txn
        try:
            txn.begin()
            for p in range(self.P):
                txn.send(self.topics.repartition, partition=p, value=b"", headers=headers)
            txn.send(
                self.topics.intake,
                partition=0,
                key=self._cut_key.encode(),
                value=json.dumps({"closed": k, "total": total, "next": nxt}).encode(),
            )
            if also is not None:
                also(txn, k)
            txn.commit()
        except KafkaError as exc:
            txn.failed(exc)
            raise
        self.closed, self.cut_at, self.next_at = k, total, nxt
        return k

    def step(self) -> int | None:
        """Read the new totals; cut the open window if they reached the next cut's target (the
        window closed, or None)."""
        self.read()
        if self.total < self.next_at:
            return None
        k = self._cut()
        log.info(
            "count window %d of %s closed: the group's intake reached the window's end "
            "(windows of %d events)",
            k,
            self.topics.repartition,
            self.size,
        )
        return k

    def force(self, also, export_id: str | None = None) -> int:
        """A forced release or an audit export (forced.py, export.py): close the open window
        now, with ``also(txn, K)``'s messages (the answer) in the same transaction. An export's
        markers carry its id (each partition exports its slice, then closes)."""
        self.read()
        extra = [("export", export_id.encode())] if export_id else []
        k = self._cut(extra, also, forced=True)
        log.info(
            "%s: count window %d of %s closed now",
            "audit export" if export_id else "forced release",
            k,
            self.topics.repartition,
        )
        return k
