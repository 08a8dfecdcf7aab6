"""Kafka source on kafka-python (``source.client = "kafka-python"``, the default): consumer
group, auto-commit off, offsets from the checkpoint.

Exactly-once counting does not rely on Kafka's committed offsets: the service keeps the next
offset of every partition inside its checkpoint, and on (re)assignment this source seeks each
partition there. Offsets are committed to the group only after a checkpoint is durable, and only
so that lag shows up in the usual Kafka tooling.
"""

from __future__ import annotations

import logging
from operator import itemgetter

from kafka import ConsumerRebalanceListener, KafkaConsumer
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata, TopicPartition

from ..base import Segment, Source
from ..kafka_security import KafkaConnectError, SecurityError, client_options, diagnose_connect
from . import compat
from .common import (
    IntakeWatch,
    PartialAssignment,
    RecordColumn,
    partial_assignment_error,
    partition_key,
    replay_problem,
)

__all__ = ["KafkaSource", "PartialAssignment", "partition_key", "parse_partition_key"]

log = logging.getLogger("panagg.kafka")


def parse_partition_key(key: str) -> TopicPartition:
    topic, _, part = key.rpartition(":")
    return TopicPartition(topic, int(part))


_CALL_MS = 5000  # bound on every blocking client call outside poll()


_KEY = itemgetter(ConsumerRecord._fields.index("key"))
_HEADERS = itemgetter(ConsumerRecord._fields.index("headers"))
_TIMESTAMP = itemgetter(ConsumerRecord._fields.index("timestamp"))


def _offsets(records) -> range | list[int]:
    """The offsets of one partition's records from one poll (increasing): a ``range`` when they
    are consecutive (the common case: no compaction or transaction markers in between), which
    costs nothing per record; else a list."""
    first, last = records[0].offset, records[-1].offset
    if last - first == len(records) - 1:
        return range(first, last + 1)
    return [r.offset for r in records]


class _SeekOnAssign(ConsumerRebalanceListener):
    def __init__(self, source: "KafkaSource"):
        self.source = source

    def on_partitions_revoked(self, revoked):
        self.source.assigned -= {partition_key(tp.topic, tp.partition) for tp in revoked}

    def on_partitions_lost(self, lost):
        self.on_partitions_revoked(lost)

    def on_partitions_assigned(self, assigned):
        for tp in assigned:
            key = partition_key(tp.topic, tp.partition)
            self.source.assigned.add(key)
            # the live offsets of the state (not those at start-up): a rejoin after a stall
            # must continue where the counters are, or it would count records twice
            if key in self.source.start_offsets:
                self.source.consumer.seek(tp, self.source.start_offsets[key])
            # a partition the service holds stays held in a new assignment (or a new client)
            if key in self.source.paused:
                self.source.consumer.pause(tp)
        self.source._quiet_from_now()
        # the ownership check needs metadata, a blocking call: not allowed in this IO-thread
        # callback, so poll() does it
        self.source.assignment_changed = True
        log.info("assigned partitions: %s", sorted(self.source.assigned))


class KafkaSource(Source, IntakeWatch):
    """Records of ``topic`` for consumer group ``group``.

    Parameters
    ----------
    bootstrap
        Broker list, e.g. ``"127.0.0.1:9092"``.
    topic, group
        Topic to count and consumer group id.
    max_records
        Records per poll (the batch the service counts at once).
    consumer_config
        Extra kafka-python ``KafkaConsumer`` settings.
    security
        The ``[security]`` config section (TLS, SASL; :mod:`consumers.kafka_security`), for the
        consumer and the admin client. A connection the cluster refuses for a security reason
        raises :class:`~consumers.kafka_security.KafkaConnectError` (one line naming the fix).
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
    ):
        self.topic, self.group, self.max_records = topic, group, int(max_records)
        self.bootstrap = bootstrap
        self._config_cache: dict[str, str] | None = None
        self.start_offsets: dict[str, int] = {}
        self.assigned: set[str] = set()
        #: set when the group gave this process only some partitions (another member holds the
        #: rest); one state per process is only exactly-once if it owns every partition
        self.partial_assignment: list[int] | None = None
        self.assignment_changed = False
        config = dict(
            bootstrap_servers=bootstrap,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=self.max_records,
            # records fetched but not yet counted are plaintext in memory: these bound them
            # (docs/privacy.md, "In flight"); the service sets them from its config
            fetch_max_bytes=16 * 1024 * 1024,
            max_partition_fetch_bytes=4 * 1024 * 1024,
            client_id=f"panagg-{group}",
            # a broker that comes back is found within a second (kafka-python's default backs
            # off up to 30 s between reconnects: counting resumed 24-35 s after an outage)
            reconnect_backoff_max_ms=1000,
        )
        try:
            self.security_options = client_options(security)
        except SecurityError as exc:
            raise KafkaConnectError(str(exc)) from None
        config.update(self.security_options)
        config.update(consumer_config or {})
        self._config, self._security = config, security
        self._watch_init()
        self.consumer = self._subscribed()

    def _subscribed(self) -> KafkaConsumer:
        with diagnose_connect(self._security, self.bootstrap):
            consumer = KafkaConsumer(**self._config)
        try:
            compat.check_consumer(consumer)
        except compat.KafkaPythonIncompatible as exc:
            consumer.close(autocommit=False)
            raise KafkaConnectError(str(exc)) from None
        consumer.subscribe([self.topic], listener=_SeekOnAssign(self))
        return consumer

    def rebuild(self) -> None:
        """Replace the client: close this one (bounded) and subscribe a new one, which joins
        the group again and seeks every partition to the service's offsets on its assignment
        (:class:`_SeekOnAssign`). Records the old client had fetched but not handed over are
        fetched again: nothing is counted twice or skipped."""
        try:
            new = self._subscribed()
        except Exception as exc:  # (the broker answered a moment ago; try again later)
            log.warning(
                "the stalled Kafka consumer could not be replaced (%s); trying again "
                "after source.stall_timeout_s",
                type(exc).__name__,
            )
            self._quiet_from_now()
            return
        old, self.consumer = self.consumer, new
        try:
            old.close(autocommit=False, timeout_ms=_CALL_MS)
        except Exception as exc:
            log.debug("close: %s", type(exc).__name__)
        self.assigned.clear()
        self.assignment_changed = False
        self.partial_assignment = None
        self._quiet_from_now()

    def seek(self, offsets: dict[str, int]) -> None:
        # keep the caller's dict itself: the service updates it as it counts, so every later
        # (re)assignment seeks to the offsets the counters actually include
        self.start_offsets = offsets
        for key in self.assigned:  # already assigned (seek after the first poll)
            if key in self.start_offsets:
                self.consumer.seek(parse_partition_key(key), self.start_offsets[key])

    def poll(self, timeout_s: float = 1.0) -> list[Segment]:
        self._polling()
        compat.unpark(self.consumer)
        compat.finish_join(self.consumer)
        try:
            polled = self.consumer.poll(
                timeout_ms=int(timeout_s * 1000), max_records=self.max_records
            )
        except KafkaError as exc:
            if not getattr(exc, "retriable", False):
                raise
            # a broker going away mid-poll (e.g. the group coordinator refused a reconnect):
            # nothing read this turn; the service reports the outage and polls again
            log.debug("poll: %s", type(exc).__name__)
            return []
        if self.assignment_changed:
            everything = self.consumer.partitions_for_topic(self.topic)
            if everything:  # None until the topic's metadata is known: check again next poll
                self.assignment_changed = False
                mine = {tp.partition for tp in self.consumer.assignment() if tp.topic == self.topic}
                # an empty assignment counts nothing (and is what a first join before the
                # topic's metadata looks like): only a non-empty partial one is a problem
                partial = mine and mine != set(everything)
                self.partial_assignment = sorted(mine) if partial else None
        if self.partial_assignment is not None:
            raise partial_assignment_error(self.group, self.topic, self.partial_assignment)
        segments = []
        for tp, records in polled.items():
            if records:
                segments.append(
                    Segment(
                        partition_key(tp.topic, tp.partition),
                        _offsets(records),
                        [r.value for r in records],
                        RecordColumn(records, _KEY),
                        RecordColumn(records, _HEADERS),
                        RecordColumn(records, _TIMESTAMP),
                    )
                )
        if segments:
            self._delivered()
        return segments

    def initial_offsets(self, start) -> dict[str, int] | None:
        """Where a new state directory starts in every partition of the topic: ``"earliest"``
        (the first record each still holds), ``"latest"`` (the end offsets now) or a Unix time
        in ms (the first record at or after it, or the end where there is none). None if the
        topic's partitions are not known (no such topic)."""
        tps = self._topic_partitions()
        if not tps:
            return None
        if start == "earliest":
            found = self.consumer.beginning_offsets(tps, timeout_ms=_CALL_MS)
        elif start == "latest":
            found = self.consumer.end_offsets(tps, timeout_ms=_CALL_MS)
        else:
            at = self.consumer.offsets_for_times(
                {tp: int(start) for tp in tps}, timeout_ms=_CALL_MS
            )
            ends = self.consumer.end_offsets(tps, timeout_ms=_CALL_MS)
            found = {tp: (at[tp].offset if at.get(tp) is not None else ends[tp]) for tp in tps}
        return {partition_key(tp.topic, tp.partition): int(off) for tp, off in found.items()}

    # The group can take a partition away at any moment (kafka-python coordinates on its own IO
    # thread); acting on a partition that is no longer assigned is then a no-op, and the
    # service's next assignment sync drops it.
    def seek_partition(self, key: str, offset: int) -> None:
        try:
            self.consumer.seek(parse_partition_key(key), int(offset))
        except ValueError:  # "Unassigned partition"
            log.info("partition %s left the assignment before its seek", key)

    def pause(self, keys) -> None:
        keys = list(keys)
        self.paused.update(keys)
        self._each(self.consumer.pause, keys)

    def resume(self, keys) -> None:
        keys = list(keys)
        self.paused.difference_update(keys)
        self._each(self.consumer.resume, keys)

    def _each(self, method, keys) -> None:
        for key in keys:
            try:
                method(parse_partition_key(key))
            except (KeyError, ValueError):
                pass

    def topics(self) -> set[str]:
        """The cluster's topic names."""
        return set(self.consumer.topics())

    # -- replay: where the topic ends, whether we are there, what the group committed ---------
    def _topic_partitions(self) -> list[TopicPartition]:
        parts = self.consumer.partitions_for_topic(self.topic) or set()
        return [TopicPartition(self.topic, p) for p in sorted(parts)]

    def end_offsets(self) -> dict[str, int] | None:
        """The end offset of every partition of the topic now (None if unknown)."""
        try:
            tps = self._topic_partitions()
            if not tps:
                return None
            ends = self.consumer.end_offsets(tps, timeout_ms=_CALL_MS)
        except Exception as exc:
            log.warning("end offsets of %r unknown (%s)", self.topic, type(exc).__name__)
            return None
        return {partition_key(tp.topic, tp.partition): int(off) for tp, off in ends.items()}

    def caught_up(self, keys) -> bool:
        """True if every partition in ``keys`` that this member is assigned is read up to the
        end offset last seen (an unassigned partition is not caught up)."""
        try:
            assigned = self.consumer.assignment()
            tps = [parse_partition_key(k) for k in keys]
            if not tps or any(tp not in assigned for tp in tps):
                return False
            ends = self.consumer.end_offsets(tps, timeout_ms=_CALL_MS)
            return all(self.consumer.position(tp) >= ends[tp] for tp in tps)
        except Exception:
            return False

    def client_positions(self, keys) -> dict[str, int]:
        """The consumer's fetch position in each of ``keys`` (bounded wait where unknown)."""
        out = {}
        for key in keys:
            pos = self.consumer.position(parse_partition_key(key), timeout_ms=1000)
            if pos is not None:
                out[key] = int(pos)
        return out

    def committed_offsets(self) -> dict[str, int]:
        """The group's committed offsets for the topic's partitions (empty: none)."""
        out = {}
        try:
            for tp in self._topic_partitions():
                committed = self.consumer.committed(tp, timeout_ms=_CALL_MS)
                if committed is not None:
                    out[partition_key(tp.topic, tp.partition)] = int(committed)
        except Exception as exc:
            log.warning(
                "committed offsets of group %r unknown (%s)", self.group, type(exc).__name__
            )
        return out

    def committed_metadata(self) -> list[str]:
        """The metadata of the group's committed offsets for the topic's partitions (the ledger
        anchors, aggregator.service.anchor); [] when none is known."""
        out = []
        try:
            for tp in self._topic_partitions():
                committed = self.consumer.committed(tp, metadata=True, timeout_ms=_CALL_MS)
                if committed is not None and getattr(committed, "metadata", None):
                    out.append(committed.metadata)
        except Exception as exc:
            log.warning(
                "committed offsets of group %r unknown (%s): the ledger is not checked "
                "against its Kafka anchor",
                self.group,
                type(exc).__name__,
            )
        return out

    def replay_problem(self, offsets: dict[str, int], window_seconds: float | None) -> str | None:
        """Why the topic could not replay an open window that starts at ``offsets`` (None: it
        can). A restart rebuilds the open window from the topic (docs/privacy.md), so the
        topic must keep at least a window's records and must not be compacted."""
        config = self._topic_config()
        try:
            tps = [parse_partition_key(k) for k in offsets]
            begins = self.consumer.beginning_offsets(tps, timeout_ms=_CALL_MS) if tps else {}
        except Exception as exc:
            log.warning("beginning offsets of %r unknown (%s)", self.topic, type(exc).__name__)
            begins = None
        return replay_problem(
            self.topic,
            config,
            window_seconds,
            offsets,
            None
            if begins is None
            else {partition_key(tp.topic, tp.partition): int(b) for tp, b in begins.items()},
        )

    def _topic_config(self) -> dict[str, str] | None:
        if self._config_cache is not None:
            return self._config_cache
        admin = None
        try:
            admin = KafkaAdminClient(
                bootstrap_servers=self.bootstrap,
                request_timeout_ms=10000,
                client_id=f"panagg-{self.group}-admin",
                **self.security_options,
            )
            res = admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, self.topic)], config_filter="all"
            )
            entries = res["topic"][self.topic]
            self._config_cache = {k: str(v["value"]) for k, v in entries.items()}
        except Exception as exc:
            log.debug("describe_configs: %s", type(exc).__name__)
            return None
        finally:
            if admin is not None:
                admin.close()
        return self._config_cache

    def commit(self, offsets: dict[str, int], metadata: str = "") -> None:
        """Offsets to the group for lag dashboards (with ``metadata``: the ledger's anchor,
        aggregator.service.anchor): asynchronous, never blocks counting."""
        mine = {
            parse_partition_key(k): OffsetAndMetadata(v, metadata, -1)
            for k, v in offsets.items()
            if k in self.assigned
        }
        if mine:
            try:
                self.consumer.commit_async(mine, callback=self._committed)
            except Exception as exc:  # lag reporting only: never fatal
                log.warning("offset commit for lag monitoring failed: %s", type(exc).__name__)

    @staticmethod
    def _committed(_offsets, response) -> None:
        if isinstance(response, Exception):
            log.info("offset commit for lag monitoring failed: %s", type(response).__name__)

    def lag(self, positions: dict[str, int] | None = None) -> dict[str, int] | None:
        """Records behind the end of each assigned partition: the high watermark the fetches
        report minus ``positions`` (the service's next offsets). No request of its own, so it
        never blocks during a broker outage."""
        out = {}
        try:
            for key in sorted(self.assigned):
                high = self.consumer.highwater(parse_partition_key(key))
                if high is not None and positions and key in positions:
                    out[key] = max(0, high - positions[key])
        except Exception:
            return None
        return out

    def lag_now(self, positions: dict[str, int] | None = None) -> dict[str, int] | None:
        """Like :meth:`lag`, but from the partitions' end offsets asked of the broker now (one
        bounded request): while the loop is not polling (intake paused for a release), the
        fetches' high watermarks stand still and :meth:`lag` would read 0."""
        try:
            tps = [parse_partition_key(k) for k in sorted(self.assigned)]
            ends = self.consumer.end_offsets(tps, timeout_ms=1000) if tps else {}
        except Exception:
            return self.lag(positions)
        return {
            partition_key(tp.topic, tp.partition): max(
                0, int(end) - positions[partition_key(tp.topic, tp.partition)]
            )
            for tp, end in ends.items()
            if positions and partition_key(tp.topic, tp.partition) in positions
        }

    def connected(self) -> bool | None:
        """Whether the client holds a ready connection to some broker (None: unknown)."""
        try:
            client = self.consumer._client
            return any(
                client.connected(getattr(b, "node_id", getattr(b, "nodeId", None)))
                for b in client.cluster.brokers()
            )
        except Exception:
            return None

    def close(self) -> None:
        # bounded: with the broker down, leaving the group cannot take longer than this
        self.consumer.close(autocommit=False, timeout_ms=_CALL_MS)
