"""Dead letters: rejected records go to a Kafka topic at least once, never lost on a crash.

Every rejected record is produced to ``source.dead_letter_topic`` with

* key ``<partition>@<offset>`` of the source record, so a consumer can drop the duplicates that a
  replay after a crash re-sends (at least once, never lost);
* headers ``reason`` (a :data:`consumers.decode.REASONS` name), ``source`` (the same position),
  ``key`` = the source record's own key (when it had one: the record key is not the dead
  letter's key, so that the dead-letter topic can be compacted by position) and, for a value too
  large for one Kafka request, ``truncated`` = its length in bytes with an empty value (a record
  larger than the producer's limit would otherwise fail to send; the position still identifies
  it in the source topic);
* with several aggregations of one stream, ``aggregation`` = the one that rejected the record
  (the key then ends in ``#<aggregation>``): a record every aggregation rejects has one dead
  letter per aggregation.

Durability: a checkpoint moves the source offsets past the records it covers, so the dead letters
of those records must be acknowledged by the broker first (:meth:`DeadLetters.flush`, step 1 of
every checkpoint). A send that fails (synchronously, or later through its future) is kept and
retried at the flush; the flush raises :class:`DeadLetterError` while any is unacknowledged, and
the checkpoint waits. Every blocking call is bounded (``max_block_ms``, flush timeouts).
"""

from __future__ import annotations

import logging
import threading

from consumers.kafka_security import client_options

from .settings import Config

__all__ = ["DeadLetters", "DeadLetterError", "dead_letter_record", "service_producer"]

log = logging.getLogger("panagg.deadletter")

MAX_REQUEST_BYTES = 1 << 20  # kafka-python's default max_request_size, set explicitly
_VALUE_LIMIT = MAX_REQUEST_BYTES - (64 << 10)  # room for key, headers and batch overhead


def service_producer(cfg: Config):
    """The producer a service writes its dead letters and release topic with: the source's
    brokers and security, every write acknowledged by all in-sync replicas (``acks="all"``), a
    send that cannot be buffered failing within 5 s instead of blocking intake, and requests up
    to :data:`MAX_REQUEST_BYTES`."""
    from kafka import KafkaProducer  # noqa: PLC0415 (a Kafka client is loaded by a Kafka run only)

    return KafkaProducer(
        bootstrap_servers=cfg.source.bootstrap,
        acks="all",
        linger_ms=20,
        max_block_ms=5000,
        max_request_size=MAX_REQUEST_BYTES,
        request_timeout_ms=10000,
        reconnect_backoff_max_ms=1000,
        **client_options(cfg.security),
    )


class DeadLetterError(RuntimeError):
    """Some dead letters are not acknowledged by the broker yet."""


def dead_letter_record(
    partition, offset: int, value, reason: str, key=None, aggregation: str | None = None
) -> tuple:
    """``(key, value, headers)`` of the dead letter of one rejected record (the format of the
    module docstring); the shuffler sends these inside its own Kafka transactions.
    ``aggregation``: the aggregation that rejected it (several aggregations of one stream): an
    ``aggregation`` header, and ``#name`` after the key so that compaction keeps one dead letter
    per aggregation (each may reject the same record for its own reason)."""
    raw = bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else b""
    headers = [("reason", reason.encode()), ("source", f"{partition}@{offset}".encode())]
    position = f"{partition}@{offset}"
    if aggregation:
        headers.append(("aggregation", aggregation.encode()))
        position += f"#{aggregation}"
    if isinstance(key, (bytes, bytearray, memoryview)):
        headers.append(("key", bytes(key)))
    if len(raw) > _VALUE_LIMIT:
        headers.append(("truncated", str(len(raw)).encode()))
        raw = b""
    return position.encode(), raw, headers


class DeadLetters:
    """Producer of dead letters for one service (see the module docstring).

    Parameters
    ----------
    topic
        The dead-letter topic.
    producer_factory
        Returns a kafka-python ``KafkaProducer`` (created on the first rejected record).
    metrics
        The service's :class:`Metrics` (``dead_letters`` counts acknowledged sends).
    """

    def __init__(self, topic: str, producer_factory, metrics=None, aggregation: str | None = None):
        self.topic = topic
        self.aggregation = aggregation
        self._factory = producer_factory
        self._producer = None
        self.metrics = metrics
        self._lock = threading.Lock()  # futures complete on the producer's IO thread
        self._unacked: dict[int, tuple] = {}
        self._failed: list[tuple] = []
        self._seq = 0

    def send(self, partition: str, offset: int, value, reason: str, key=None) -> None:
        """Queue one rejected record (never raises: a failure is retried at the flush).
        ``key``: the source record's key, kept in the ``key`` header."""
        self._send(dead_letter_record(partition, offset, value, reason, key, self.aggregation))

    def _send(self, record: tuple) -> None:
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._unacked[seq] = record
        try:
            if self._producer is None:
                self._producer = self._factory()
            future = self._producer.send(
                self.topic, key=record[0], value=record[1], headers=record[2]
            )
        except Exception as exc:  # buffer full, broker unknown, ...: retried at the flush
            self._fail(seq, exc)
            return
        future.add_callback(lambda _meta, seq=seq: self._ack(seq))
        future.add_errback(lambda exc, seq=seq: self._fail(seq, exc))

    def _ack(self, seq: int) -> None:
        with self._lock:
            self._unacked.pop(seq, None)
        if self.metrics is not None:
            self.metrics.dead_letters.inc()

    def _fail(self, seq: int, exc: BaseException) -> None:
        with self._lock:
            record = self._unacked.pop(seq, None)
            if record is not None:
                self._failed.append((record, type(exc).__name__))

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._unacked) + len(self._failed)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every dead letter sent so far is acknowledged; re-send failed ones once.
        Raises DeadLetterError (naming the error type) if some are still not acknowledged."""
        if self._producer is None and not self._failed:
            return
        for _ in range(2):
            with self._lock:
                retry, self._failed = self._failed, []
            for record, _why in retry:
                self._send(record)
            if self._producer is not None:
                try:
                    self._producer.flush(timeout=timeout_s)
                except Exception as exc:  # a flush timeout: the records stay unacknowledged
                    log.debug("dead-letter flush: %s", type(exc).__name__)
            if not self.outstanding:
                return
        with self._lock:
            why = self._failed[0][1] if self._failed else "no acknowledgement in time"
            count = len(self._unacked) + len(self._failed)
        raise DeadLetterError(
            f"{count} dead letter(s) to topic {self.topic!r} not acknowledged ({why})"
        )

    def close(self, timeout_s: float = 5.0) -> None:
        if self._producer is not None:
            try:
                self._producer.close(timeout=timeout_s)
            except Exception:
                pass
            self._producer = None
