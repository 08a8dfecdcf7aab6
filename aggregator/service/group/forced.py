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

A views group (``scale.exchange = views``) has no repartition partitions: the leader writes one
``close:<summaries topic>`` = ``{"upto": K}`` record to the intake topic instead, which every
member follows (views.py): it closes its windows up to K at once, and the partitions count into
K + 1 until K + 1 ends by the clock. A member that misses the record (it starts after it) closes
K by the clock: K is released then, as any window.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid

from kafka import KafkaConsumer, KafkaProducer, TopicPartition

__all__ = [
    "ReleaseRequests",
    "request_release",
    "request_export",
    "ForcedReleaseError",
    "REQUEST",
    "DONE",
    "EXPORT",
    "EXPORTED",
    "close_key",
]

log = logging.getLogger("panagg.group")

REQUEST = "release:"
DONE = "released:"
#: an audit export rides the same path: the markers also carry ``export`` = its id
EXPORT = "export:"
EXPORTED = "exported:"


def close_key(topics) -> bytes:
    """The intake topic's key of a views group's forced close (views.py follows it)."""
    return f"close:{topics.summaries}".encode()


class ForcedReleaseError(RuntimeError):
    """The group did not answer a forced release (one line naming what to check)."""


class ReleaseRequests:
    """The leader's view of the forced-release and audit-export requests of one aggregation.

    ``consumer``: a kafka-python consumer with no group (read committed); assigned here to the
    intake topic's one partition and read from its start (the topic is compacted: the latest
    request and answer per key)."""

    def __init__(self, consumer, topics):
        self.consumer, self.topics = consumer, topics
        self._tp = TopicPartition(topics.intake, 0)
        consumer.assign([self._tp])
        consumer.seek_to_beginning(self._tp)
        rp = topics.repartition
        self._keys = {
            f"{REQUEST}{rp}".encode(): ("release", "asked"),
            f"{DONE}{rp}".encode(): ("release", "answered"),
            f"{EXPORT}{rp}".encode(): ("export", "asked"),
            f"{EXPORTED}{rp}".encode(): ("export", "answered"),
        }
        self.ids = {
            ("release", "asked"): None,
            ("release", "answered"): None,
            ("export", "asked"): None,
            ("export", "answered"): None,
        }
        #: the latest export answered: (its id, the window it closed) (a views group's leader
        #: signs it from that window's views: leader.py)
        self.exported: tuple[str, int] | None = None
        #: event-time windows of a views group: the newest timestamp any source partition's
        #: watermark report holds (event_views.py; None: none yet)
        self.newest_ms: int | None = None
        self._marks = f"wm:{rp}:".encode()

    def poll(self) -> None:
        for records in self.consumer.poll(timeout_ms=0).values():
            for rec in records:
                if rec.key and rec.key.startswith(self._marks) and rec.value is not None:
                    ts = json.loads(rec.value).get("ts")
                    if ts is not None:
                        self.newest_ms = max(int(ts), self.newest_ms or int(ts))
                    continue
                what = self._keys.get(rec.key)
                if what is not None and rec.value is not None:
                    body = json.loads(rec.value)
                    self.ids[what] = str(body["id"])
                    if what == ("export", "answered"):
                        self.exported = (
                            (str(body["id"]), int(body["window"]))
                            if body.get("window") is not None
                            else None
                        )

    def export_of(self, window: int) -> str | None:
        """The id of the export answered with ``window`` (None: none)."""
        self.poll()
        if self.exported is not None and self.exported[1] == int(window):
            return self.exported[0]
        return None

    def pending(self) -> tuple[str, str] | None:
        """``(kind, id)`` of a request not answered yet, exports first (None: none)."""
        self.poll()
        for kind in ("export", "release"):
            asked = self.ids[(kind, "asked")]
            if asked and asked != self.ids[(kind, "answered")]:
                return kind, asked
        return None

    def answer(
        self, txn, kind: str, request_id: str, window: int | None, partitions: int, error: str = ""
    ) -> None:
        """Markers closing windows up to ``window`` into every repartition partition (with the
        export's id for an export), and the answer, in one transaction (begun and committed
        here). With ``error`` only the answer (nothing closes)."""
        txn.begin()
        if not error:
            headers = [("close", str(int(window)).encode())]
            if kind == "export":
                headers.append(("export", request_id.encode()))
            for p in range(partitions):
                txn.send(self.topics.repartition, partition=p, value=b"", headers=headers)
        self.send_answer(txn, kind, request_id, window, error)
        txn.commit()
        self.answered(kind, request_id)

    def answer_views(self, txn, request_id: str, window: int, kind: str = "release") -> None:
        """A views group (views.py): the members close on their clocks and hold no marker
        partition, so the close is one record ``close:<summaries topic>`` = ``{"upto": K}`` in
        the intake topic, which every member follows; with the answer, in one transaction. An
        export is then signed by the leader from window K's views (leader.py)."""
        txn.begin()
        txn.send(
            self.topics.intake,
            partition=0,
            key=close_key(self.topics),
            value=json.dumps({"upto": int(window), "id": request_id}).encode(),
        )
        self.send_answer(txn, kind, request_id, window)
        txn.commit()
        self.answered(kind, request_id)

    def send_answer(
        self, txn, kind: str, request_id: str, window: int | None, error: str = ""
    ) -> None:
        """The answer alone, in ``txn``'s open transaction (an event-time group's closer writes
        the markers: closer.py)."""
        done = DONE if kind == "release" else EXPORTED
        body = (
            {"id": request_id, "window": window}
            if not error
            else {"id": request_id, "error": error}
        )
        txn.send(
            self.topics.intake,
            partition=0,
            key=f"{done}{self.topics.repartition}".encode(),
            value=json.dumps(body).encode(),
        )

    def answered(self, kind: str, request_id: str) -> None:
        self.ids[(kind, "answered")] = request_id


def forced_window(size: float, next_undecided: int, now: float | None = None) -> int:
    """The window a forced release closes: the clock's, or the next undecided one if later."""
    clock = int(math.floor((time.time() if now is None else now) / float(size)))
    return max(clock, int(next_undecided))


def _ask(bootstrap: str, security: dict, topics, key: str, rid: str) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, **security)
    try:
        producer.send(
            topics.intake,
            partition=0,
            key=f"{key}{topics.repartition}".encode(),
            value=json.dumps({"id": rid, "requested_unix": time.time()}).encode(),
        )
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=5)


def _answer(
    consumer, topics, key: str, rid: str, deadline: float, bootstrap: str, timeout_s: float
) -> dict:
    got = _scan(
        consumer,
        TopicPartition(topics.intake, 0),
        deadline,
        lambda rec: (
            rec.key == f"{key}{topics.repartition}".encode()
            and rec.value is not None
            and json.loads(rec.value).get("id") == rid
        ),
        lambda rec: json.loads(rec.value),
    )
    if got is None:
        raise ForcedReleaseError(
            f"no leader of {topics.prefix} answered within {timeout_s:g} s: is the group "
            f"running? (panagg status --group {topics.group} --bootstrap {bootstrap})"
        )
    if got.get("error"):
        raise ForcedReleaseError(got["error"])
    return got


def _consumer(bootstrap: str, security: dict):
    return KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed",
        **security,
    )


def _request(
    bootstrap: str,
    security: dict,
    topics,
    ask: str,
    answer: str,
    *,
    timeout_s: float,
    topic: str,
    match,
    value,
) -> tuple[int, str, object]:
    """Ask with key ``ask``, wait for the leader's ``answer`` (its window), then for the record
    of ``topic`` that ``match``es it (its ``value``, or None when the wait ended first)."""

    rid = uuid.uuid4().hex
    _ask(bootstrap, security, topics, ask, rid)
    consumer = _consumer(bootstrap, security)
    try:
        deadline = time.monotonic() + timeout_s
        window = int(
            _answer(consumer, topics, answer, rid, deadline, bootstrap, timeout_s)["window"]
        )
        found = _scan(
            consumer,
            TopicPartition(topic, 0),
            deadline,
            lambda rec: rec.value is not None and match(rec, rid, window),
            value,
        )
        return window, rid, found
    finally:
        consumer.close()


def request_release(bootstrap: str, security: dict, topics, *, timeout_s: float = 60.0) -> dict:
    """Ask the leader of ``topics``' aggregation to close its window now; wait for the release.
    Returns ``{"window": K, "release": document or None}`` (None: K closed, its release not in
    yet when the wait ended)."""
    window, _, doc = _request(
        bootstrap,
        security,
        topics,
        REQUEST,
        DONE,
        timeout_s=timeout_s,
        topic=topics.releases,
        match=lambda rec, rid, w: rec.key == str(w).encode(),
        value=lambda rec: json.loads(rec.value),
    )
    return {"window": window, "release": doc}


def request_export(bootstrap: str, security: dict, topics, *, timeout_s: float = 60.0) -> dict:
    """Ask the leader for an audit export of the live state (export.py); wait for the signed
    document. Returns ``{"id", "window", "document": bytes}``."""
    window, rid, doc = _request(
        bootstrap,
        security,
        topics,
        EXPORT,
        EXPORTED,
        timeout_s=timeout_s,
        topic=topics.exports,
        match=lambda rec, rid, w: rec.key == f"doc/{rid}".encode(),
        value=lambda rec: rec.value,
    )
    if doc is None:
        raise ForcedReleaseError(
            f"the export's window {window} closed, but its document was not in "
            f"{topics.exports} within {timeout_s:g} s (the leader waits for every partition: "
            f"panagg status --group {topics.group} --bootstrap {bootstrap})"
        )
    return {"id": rid, "window": window, "document": doc}


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
