"""Kafka source on confluent-kafka (librdkafka): ``source.client = "confluent"``.

The same interface and the same exactly-once contract as :class:`consumers.kafka.kafka_python.
KafkaSource` (the service keeps every partition's next offset in its checkpoint and seeks there on
each assignment; commits to the group are for lag tooling only), on a client whose record parsing
is C. kafka-python parses records in Python, which was ~79 % of the service's time
(docs/e2e.md); librdkafka hands over parsed messages, so the service's own per-event work is what
is left. Install with ``pip install 'panagg[confluent]'``.

Differences the backend hides:

* assignment: the rebalance callback assigns each partition at the offset the counters hold
  (``TopicPartition.offset``), so no record before it is fetched;
* a seek on a partition whose fetcher has not started yet fails in librdkafka ("erroneous
  state"): it is kept and tried again before the next poll;
* the connection state comes from librdkafka's statistics (one JSON a second): a broker in state
  ``UP`` means connected;
* librdkafka pre-fetches into its own queue: ``queued.max.messages.kbytes`` is bounded by
  ``source.fetch_max_bytes`` (plaintext in memory until counted, docs/privacy.md "In flight");
* a client that holds its assignment but delivers nothing while records wait (after a clean
  broker restart its group coordinator requests can time out for minutes) is replaced by
  :meth:`ConfluentSource.rebuild`, which resumes at the service's offsets like any assignment.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence

from ..base import Segment, Source
from ..kafka_security import KafkaConnectError, SecurityError, client_options
from .common import (
    IntakeWatch,
    RecordColumn,
    partial_assignment_error,
    partition_key,
    replay_problem,
)

__all__ = ["ConfluentSource", "librdkafka_options"]

log = logging.getLogger("panagg.kafka")

_CALL_S = 5.0  # bound on every blocking client call outside poll()
_CLOSE_S = 15.0  # bound on leaving the group at a stop (close())
_REBUILD_CLOSE_S = 5.0  # bound on closing a stalled client before its replacement starts

#: kafka-python option (consumers.kafka_security.client_options) -> librdkafka property
_SECURITY = {
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanism",
    "sasl_plain_username": "sasl.username",
    "sasl_plain_password": "sasl.password",
    "ssl_cafile": "ssl.ca.location",
    "ssl_certfile": "ssl.certificate.location",
    "ssl_keyfile": "ssl.key.location",
    "ssl_password": "ssl.key.password",
}


def librdkafka_options(security: dict | None) -> dict:
    """librdkafka properties for a ``[security]`` config section: the same checks and warnings
    as the kafka-python backend (:func:`consumers.kafka_security.client_options`)."""
    out = {}
    for key, value in client_options(security).items():
        if key == "ssl_check_hostname":
            out["ssl.endpoint.identification.algorithm"] = "https" if value else "none"
        else:
            out[_SECURITY[key]] = value
    return out


class _Quieter(logging.Filter):
    """librdkafka logs every failed reconnect (tens a second during a broker outage) at ERROR;
    the service reports the outage itself (``Kafka broker unreachable``), so each kind of
    librdkafka line passes at most once per :attr:`every_s`."""

    every_s = 60.0

    def __init__(self):
        super().__init__()
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        kind = msg.split(" ", 1)[0]  # the facility, e.g. FAIL, REQTMOUT
        now = time.monotonic()
        if now - self._last.get(kind, -1e9) < self.every_s:
            return False
        self._last[kind] = now
        return True


_RDLOG = logging.getLogger("panagg.kafka.librdkafka")
_RDLOG.addFilter(_Quieter())


def _import():
    try:
        import confluent_kafka  # noqa: PLC0415 (an optional extra)
    except ImportError:
        raise KafkaConnectError(
            'source.client = "confluent" needs confluent-kafka: pip install '
            "'panagg[confluent]' (or set source.client = \"kafka-python\")"
        ) from None
    return confluent_kafka


def _key(m):
    return m.key()


def _headers(m):
    return m.headers() or []


def _timestamp(m):
    kind, ts = m.timestamp()
    return ts if kind else -1  # TIMESTAMP_NOT_AVAILABLE is 0


class ConfluentSource(Source, IntakeWatch):
    """Records of ``topic`` for consumer group ``group`` through librdkafka.

    ``consumer_config`` takes librdkafka properties (``"session.timeout.ms"``, ...), added to and
    overriding the ones built here; ``security`` is the ``[security]`` config section.
    """

    #: a real Kafka source (the budget registry attaches to these)
    is_kafka = True

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        group: str,
        max_records: int = 20000,
        consumer_config: dict | None = None,
        security: dict | None = None,
        fetch_max_bytes: int = 16 * 1024 * 1024,
        max_partition_fetch_bytes: int = 4 * 1024 * 1024,
    ):
        ck = _import()
        self._ck = ck
        self.topic, self.group, self.max_records = topic, group, int(max_records)
        self.bootstrap = bootstrap
        self.start_offsets: dict[str, int] = {}
        self.assigned: set[str] = set()
        self.partial_assignment: list[int] | None = None
        self.assignment_changed = False
        self._pending_seeks: dict[str, int] = {}
        self._brokers_up: bool | None = None
        self._config_cache: dict[str, str] | None = None
        try:
            self._security = librdkafka_options(security)
        except SecurityError as exc:
            raise KafkaConnectError(str(exc)) from None
        config = {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "client.id": f"panagg-{group}",
            "fetch.max.bytes": int(fetch_max_bytes),
            "max.partition.fetch.bytes": int(max_partition_fetch_bytes),
            # librdkafka's own pre-fetch queue is plaintext not yet counted: bounded the same
            "queued.max.messages.kbytes": max(1, int(fetch_max_bytes) // 1024),
            "queued.min.messages": self.max_records,
            "reconnect.backoff.max.ms": 1000,
            "allow.auto.create.topics": False,
            "enable.partition.eof": False,
            "statistics.interval.ms": 1000,
            "stats_cb": self._stats,
            "error_cb": self._error,
            "logger": _RDLOG,
            **self._security,
        }
        config.update(consumer_config or {})
        self._config = config
        self._watch_init()
        #: what the start line names
        self.client_version = f"confluent-kafka {ck.version()[0]} (librdkafka {ck.libversion()[0]})"
        self.consumer = self._subscribed()

    def _subscribed(self):
        consumer = self._ck.Consumer(self._config)
        consumer.subscribe(
            [self.topic],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )
        return consumer

    def rebuild(self) -> None:
        """Replace the client: close this one (bounded: a coordinator that does not answer
        cannot hold the loop) and subscribe a new one, which joins the group again (the same
        ``group.instance.id``: it takes the partitions back at once) and starts every partition
        at the service's offsets (:meth:`_on_assign`). Records the old client had fetched but
        not handed over are simply fetched again: nothing is counted twice or skipped."""
        old, self.consumer = self.consumer, self._subscribed()
        self.assigned.clear()
        self._pending_seeks.clear()
        self.assignment_changed = False
        self.partial_assignment = None
        # (its revocation, if the close runs late, is ignored: the callbacks act for the
        # current client only)
        self._close_bounded(old, _REBUILD_CLOSE_S)
        self._quiet_from_now()

    # -- group callbacks (run inside consume()) -------------------------------------------------
    def _on_assign(self, consumer, partitions) -> None:
        if consumer is not self.consumer:  # a replaced client (rebuild) still closing
            return
        for tp in partitions:
            key = partition_key(tp.topic, tp.partition)
            self.assigned.add(key)
            # the live offsets of the state: a rejoin must continue where the counters are
            if key in self.start_offsets:
                tp.offset = int(self.start_offsets[key])
        consumer.assign(partitions)
        # a partition the service holds stays held in a new assignment (or a new client)
        held = [tp for tp in partitions if partition_key(tp.topic, tp.partition) in self.paused]
        if held:
            consumer.pause(held)
        self.assignment_changed = True
        self._quiet_from_now()
        log.info("assigned partitions: %s", sorted(self.assigned))

    def _on_revoke(self, consumer, partitions) -> None:
        if consumer is not self.consumer:  # a replaced client (rebuild) still closing
            try:
                consumer.unassign()
            except Exception:
                pass
            return
        gone = {partition_key(tp.topic, tp.partition) for tp in partitions}
        self.assigned -= gone
        for key in gone:
            self._pending_seeks.pop(key, None)
        try:
            consumer.unassign()
        except Exception:
            pass

    def _stats(self, stats_json: str) -> None:
        try:
            brokers = json.loads(stats_json).get("brokers", {})
        except ValueError:
            return
        real = [b for b in brokers.values() if b.get("nodeid", -1) >= 0]
        self._brokers_up = any(b.get("state") == "UP" for b in real) if real else None

    def _error(self, err) -> None:
        if err.code() == self._ck.KafkaError._ALL_BROKERS_DOWN:
            self._brokers_up = False
        log.debug("librdkafka: %s", err.name())

    # -- positions ------------------------------------------------------------------------------
    def _tp(self, key: str, offset: int | None = None, metadata: str | None = None):
        topic, _, part = key.rpartition(":")
        if offset is None:
            return self._ck.TopicPartition(topic, int(part))
        if metadata is None:
            return self._ck.TopicPartition(topic, int(part), int(offset))
        return self._ck.TopicPartition(topic, int(part), int(offset), metadata)

    def seek(self, offsets: dict[str, int]) -> None:
        # the caller's dict itself: the service updates it as it counts, so a later
        # (re)assignment starts at the offsets the counters include
        self.start_offsets = offsets
        for key in self.assigned:
            if key in offsets:
                self.seek_partition(key, offsets[key])

    def seek_partition(self, key: str, offset: int) -> None:
        if key not in self.assigned:
            log.info("partition %s left the assignment before its seek", key)
            return
        try:
            self.consumer.seek(self._tp(key, offset))
            self._pending_seeks.pop(key, None)
        except self._ck.KafkaException:
            # not fetching yet (just assigned): the assignment's offset or the retry places it
            self._pending_seeks[key] = int(offset)

    def _retry_seeks(self) -> None:
        for key, offset in list(self._pending_seeks.items()):
            self.seek_partition(key, offset)

    def pause(self, keys) -> None:
        keys = list(keys)
        self.paused.update(keys)
        tps = [self._tp(k) for k in keys if k in self.assigned]
        if tps:
            self.consumer.pause(tps)

    def resume(self, keys) -> None:
        keys = list(keys)
        self.paused.difference_update(keys)
        tps = [self._tp(k) for k in keys if k in self.assigned]
        if tps:
            self.consumer.resume(tps)

    # -- records --------------------------------------------------------------------------------
    def poll(self, timeout_s: float = 1.0) -> list[Segment]:
        self._polling()
        if self._pending_seeks:
            self._retry_seeks()
        msgs = self.consumer.consume(num_messages=self.max_records, timeout=timeout_s)
        if self.assignment_changed:
            self._check_assignment()
        if self.partial_assignment is not None:
            raise partial_assignment_error(self.group, self.topic, self.partial_assignment)
        if not msgs:
            return []
        self._brokers_up = True
        self._delivered()
        by_part: dict[int, list] = {}
        for m in msgs:
            if m.error() is not None:
                self._message_error(m.error())
                continue
            part = m.partition()
            got = by_part.get(part)
            if got is None:
                by_part[part] = [m]
            else:
                got.append(m)
        segments = []
        for part, ms in by_part.items():
            first, last = ms[0].offset(), ms[-1].offset()
            offsets: Sequence[int] = (
                range(first, last + 1) if last - first == len(ms) - 1 else [m.offset() for m in ms]
            )
            segments.append(
                Segment(
                    partition_key(self.topic, part),
                    offsets,
                    [m.value() for m in ms],
                    RecordColumn(ms, _key),
                    RecordColumn(ms, _headers),
                    RecordColumn(ms, _timestamp),
                )
            )
        return segments

    def _message_error(self, err) -> None:
        if err.fatal():
            raise KafkaConnectError(f"the Kafka client stopped: {err.str()}")
        log.debug("consume: %s", err.name())

    def _check_assignment(self) -> None:
        try:
            meta = self.consumer.list_topics(self.topic, timeout=_CALL_S)
        except self._ck.KafkaException:
            return  # check again next poll
        topic = meta.topics.get(self.topic)
        if topic is None or topic.error is not None or not topic.partitions:
            return
        self.assignment_changed = False
        mine = {tp.partition for tp in self.consumer.assignment() if tp.topic == self.topic}
        partial = mine and mine != set(topic.partitions)
        self.partial_assignment = sorted(mine) if partial else None

    # -- where the topic ends, what the group committed -------------------------------------------
    def topics(self) -> set[str]:
        return set(self.consumer.list_topics(timeout=_CALL_S).topics)

    def _partitions(self) -> list[int]:
        meta = self.consumer.list_topics(self.topic, timeout=_CALL_S)
        topic = meta.topics.get(self.topic)
        if topic is None or topic.error is not None:
            return []
        return sorted(topic.partitions)

    def _keys(self) -> list[str]:
        return [partition_key(self.topic, p) for p in self._partitions()]

    def _watermarks(self, keys, cached: bool = False) -> dict[str, tuple[int, int]]:
        return {
            k: self.consumer.get_watermark_offsets(self._tp(k), timeout=_CALL_S, cached=cached)
            for k in keys
        }

    def initial_offsets(self, start) -> dict[str, int] | None:
        keys = self._keys()
        if not keys:
            return None
        marks = self._watermarks(keys)
        if start == "earliest":
            return {k: lo for k, (lo, _) in marks.items()}
        ends = {k: hi for k, (_, hi) in marks.items()}
        if start == "latest":
            return ends
        found = self.consumer.offsets_for_times(
            [self._tp(k, int(start)) for k in keys], timeout=_CALL_S
        )
        out = {}
        for tp in found:
            key = partition_key(tp.topic, tp.partition)
            out[key] = int(tp.offset) if tp.offset >= 0 else ends[key]
        return out

    def end_offsets(self) -> dict[str, int] | None:
        try:
            keys = self._keys()
            return {k: hi for k, (_, hi) in self._watermarks(keys).items()} if keys else None
        except Exception as exc:
            log.warning("end offsets of %r unknown (%s)", self.topic, type(exc).__name__)
            return None

    def caught_up(self, keys) -> bool:
        try:
            keys = list(keys)
            mine = {partition_key(tp.topic, tp.partition) for tp in self.consumer.assignment()}
            if not keys or any(k not in mine for k in keys):
                return False
            ends = self._watermarks(keys)
            for tp in self.consumer.position([self._tp(k) for k in keys]):
                key = partition_key(tp.topic, tp.partition)
                # nothing consumed since the assignment: librdkafka has no position yet
                # (OFFSET_INVALID); the assignment's offset is where reading stands
                pos = tp.offset if tp.offset >= 0 else self.start_offsets.get(key, -1)
                if pos < 0 or pos < ends[key][1]:
                    return False
            return True
        except Exception:
            return False

    def client_positions(self, keys) -> dict[str, int]:
        """librdkafka's application position in each of ``keys`` (where it has one)."""
        return {
            partition_key(tp.topic, tp.partition): int(tp.offset)
            for tp in self.consumer.position([self._tp(k) for k in keys])
            if tp.offset >= 0
        }

    def _committed(self) -> list:
        return self.consumer.committed([self._tp(k) for k in self._keys()], timeout=_CALL_S)

    def committed_offsets(self) -> dict[str, int]:
        try:
            return {
                partition_key(tp.topic, tp.partition): int(tp.offset)
                for tp in self._committed()
                if tp.offset >= 0
            }
        except Exception as exc:
            log.warning(
                "committed offsets of group %r unknown (%s)", self.group, type(exc).__name__
            )
            return {}

    def committed_metadata(self) -> list[str]:
        try:
            return [tp.metadata for tp in self._committed() if tp.offset >= 0 and tp.metadata]
        except Exception as exc:
            log.warning(
                "committed offsets of group %r unknown (%s): the ledger is not checked "
                "against its Kafka anchor",
                self.group,
                type(exc).__name__,
            )
            return []

    def replay_problem(self, offsets: dict[str, int], window_seconds: float | None) -> str | None:
        config = self._topic_config()
        try:
            begins: dict[str, int] | None = {
                k: lo for k, (lo, _) in self._watermarks(list(offsets)).items()
            }
        except Exception as exc:
            log.warning("beginning offsets of %r unknown (%s)", self.topic, type(exc).__name__)
            begins = None
        return replay_problem(self.topic, config, window_seconds, offsets, begins)

    def _topic_config(self) -> dict[str, str] | None:
        if self._config_cache is not None:
            return self._config_cache
        ck = self._ck
        try:
            admin = ck.admin.AdminClient(
                {"bootstrap.servers": self.bootstrap, **self._security, "logger": _RDLOG}
            )
            res = ck.admin.ConfigResource(ck.admin.ResourceType.TOPIC, self.topic)
            entries = admin.describe_configs([res], request_timeout=10)[res].result(timeout=10)
            self._config_cache = {k: str(v.value) for k, v in entries.items()}
        except Exception as exc:
            log.debug("describe_configs: %s", type(exc).__name__)
            return None
        return self._config_cache

    # -- progress, lag, health ------------------------------------------------------------------
    def commit(self, offsets: dict[str, int], metadata: str = "") -> None:
        """Offsets to the group for lag dashboards, with the ledger's anchor as metadata;
        asynchronous, never blocks counting."""
        mine = [self._tp(k, v, metadata) for k, v in offsets.items() if k in self.assigned]
        if mine:
            try:
                self.consumer.commit(offsets=mine, asynchronous=True)
            except Exception as exc:  # lag reporting only: never fatal
                log.warning("offset commit for lag monitoring failed: %s", type(exc).__name__)

    def lag(self, positions: dict[str, int] | None = None) -> dict[str, int] | None:
        """Records behind the end of each assigned partition, from the high watermarks the
        fetches last reported (no request: never blocks during an outage)."""
        out = {}
        try:
            for key in sorted(self.assigned):
                _, high = self.consumer.get_watermark_offsets(self._tp(key), cached=True)
                if high >= 0 and positions and key in positions:
                    out[key] = max(0, high - positions[key])
        except Exception:
            return None
        return out

    def lag_now(self, positions: dict[str, int] | None = None) -> dict[str, int] | None:
        """Like :meth:`lag` from the end offsets asked of the broker now (one bounded request
        per partition)."""
        try:
            keys = sorted(self.assigned)
            ends = {
                k: self.consumer.get_watermark_offsets(self._tp(k), timeout=1.0)[1] for k in keys
            }
        except Exception:
            return self.lag(positions)
        return {
            k: max(0, int(end) - positions[k])
            for k, end in ends.items()
            if positions and k in positions
        }

    def connected(self) -> bool | None:
        """Whether librdkafka holds a connection to some broker that is up (None: not known
        yet: no statistics arrived)."""
        return self._brokers_up

    def close(self) -> None:
        """Leave the group, bounded: librdkafka's close can wait forever on a group coordinator
        that does not answer (seen after a clean broker restart; librdkafka#3740), and a stop
        must not hang on it. Nothing durable depends on the close (the checkpoint holds the
        offsets); past the bound the broker expires the membership itself."""
        if not self._close_bounded(self.consumer, _CLOSE_S):
            log.warning(
                "the Kafka consumer did not leave group %r within %g s (its group "
                "coordinator did not answer); stopping without it: the broker drops the "
                "membership after its session timeout",
                self.group,
                _CLOSE_S,
            )

    @staticmethod
    def _close_bounded(consumer, bound_s: float) -> bool:
        """Close ``consumer`` on a thread of its own, waiting at most ``bound_s`` (False: it
        was still closing)."""

        def leave() -> None:
            try:
                consumer.close()
            except Exception as exc:
                log.debug("close: %s", type(exc).__name__)

        closing = threading.Thread(target=leave, name="panagg-confluent-close", daemon=True)
        closing.start()
        closing.join(bound_s)
        return not closing.is_alive()
