"""Forced releases in a Kafka-only group: ``panagg release`` on a member's directory.

One process closes its open window when asked. A group has no single process to ask, and its
windows end in P partitions at once, so the request goes through Kafka and the close is a marker
in every partition's log:

1. ``panagg release`` writes ``release:<repartition topic>`` = ``{"id": ...}`` to
   ``<group>.panagg.intake`` (compacted; the key keeps the latest request);
2. the aggregation's leader, at its next turn, picks the window K to close: the one open now by
   the clock, or the next undecided window when that is later (a second request within one
   window closes the next one); then, in one transaction, writes a close marker K (header
   ``close``, no events) into every repartition partition and ``released:<repartition topic>``
   = ``{"id": ..., "window": K}`` (the request is done: the next leader does not repeat it);
3. each counting partition closes its windows up to K at the marker (``Counter``), so a
   partition's K ends exactly at its marker, wherever its member was; the leader then decides
   K as any window, charging exactly the positions before the markers;
4. the command waits for ``released:`` with its id, then for K's release document, and names it.

Records stamped in K that a partition reads after its marker count in the next window (as a late
record of intake time always does). Nothing in a request or marker depends on the events.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid

__all__ = ["ReleaseRequests", "request_release", "ForcedReleaseError", "REQUEST", "DONE"]

log = logging.getLogger("panagg.group")

REQUEST = "release:"
DONE = "released:"


class ForcedReleaseError(RuntimeError):
    """The group did not answer a forced release (one line naming what to check)."""


class ReleaseRequests:
    """The leader's view of the forced-release requests of one aggregation.

    ``consumer``: a kafka-python consumer with no group (read committed); assigned here to the
    intake topic's one partition and read from its start (the topic is compacted: the latest
    request and answer per key)."""

    def __init__(self, consumer, topics):
        from kafka import TopicPartition

        self.consumer, self.topics = consumer, topics
        self._tp = TopicPartition(topics.intake, 0)
        consumer.assign([self._tp])
        consumer.seek_to_beginning(self._tp)
        self._request_key = f"{REQUEST}{topics.repartition}".encode()
        self._done_key = f"{DONE}{topics.repartition}".encode()
        self.requested: str | None = None
        self.answered: str | None = None

    def poll(self) -> None:
        for records in self.consumer.poll(timeout_ms=0).values():
            for rec in records:
                if rec.value is None:
                    continue
                if rec.key == self._request_key:
                    self.requested = str(json.loads(rec.value)["id"])
                elif rec.key == self._done_key:
                    self.answered = str(json.loads(rec.value)["id"])

    def pending(self) -> str | None:
        """The id of a request not answered yet (None: none)."""
        self.poll()
        return self.requested if self.requested and self.requested != self.answered else None

    def answer(self, txn, request_id: str, window: int, partitions: int) -> None:
        """Markers closing windows up to ``window`` into every repartition partition, and the
        answer, in one transaction (the caller's, begun and committed here)."""
        txn.begin()
        for p in range(partitions):
            txn.send(self.topics.repartition, partition=p, value=b"",
                     headers=[("close", str(int(window)).encode())])
        txn.send(self.topics.intake, partition=0, key=self._done_key,
                 value=json.dumps({"id": request_id, "window": int(window)}).encode())
        txn.commit()
        self.answered = request_id


def forced_window(size: float, next_undecided: int, now: float | None = None) -> int:
    """The window a forced release closes: the clock's, or the next undecided one if later."""
    clock = int(math.floor((time.time() if now is None else now) / float(size)))
    return max(clock, int(next_undecided))


def request_release(bootstrap: str, security: dict, topics, *, timeout_s: float = 60.0) -> dict:
    """Ask the leader of ``topics``' aggregation to close its window now; wait for the release.
    Returns ``{"window": K, "release": document or None}`` (None: K closed, its release not in
    yet when the wait ended)."""
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    rid = uuid.uuid4().hex
    producer = KafkaProducer(bootstrap_servers=bootstrap, **security)
    try:
        producer.send(topics.intake, partition=0, key=f"{REQUEST}{topics.repartition}".encode(),
                      value=json.dumps({"id": rid, "requested_unix": time.time()}).encode())
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=5)
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                             enable_auto_commit=False, isolation_level="read_committed",
                             **security)
    try:
        deadline = time.monotonic() + timeout_s
        window = _scan(consumer, TopicPartition(topics.intake, 0), deadline,
                       lambda rec: rec.key == f"{DONE}{topics.repartition}".encode()
                       and json.loads(rec.value).get("id") == rid,
                       lambda rec: int(json.loads(rec.value)["window"]))
        if window is None:
            raise ForcedReleaseError(
                f"no leader of {topics.prefix} answered within {timeout_s:g} s: is the group "
                f"running? (panagg status --group {topics.group} --bootstrap {bootstrap})")
        doc = _scan(consumer, TopicPartition(topics.releases, 0), deadline,
                    lambda rec: rec.key == str(window).encode() and rec.value is not None,
                    lambda rec: json.loads(rec.value))
        return {"window": window, "release": doc}
    finally:
        consumer.close()


def _scan(consumer, tp, deadline: float, match, value):
    """Read ``tp`` from its start until a record ``match``es (its ``value``) or ``deadline``."""
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    while time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            for rec in records:
                if match(rec):
                    return value(rec)
    return None
