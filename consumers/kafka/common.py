"""What both Kafka backends say and name the same way: partition keys, the partial-assignment
refusal and why a topic cannot replay an open window."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

__all__ = [
    "IntakeWatch",
    "PartialAssignment",
    "RecordColumn",
    "partial_assignment_error",
    "partition_key",
    "replay_problem",
]

log = logging.getLogger("panagg.kafka")


def partition_key(topic: str, partition: int) -> str:
    """The service's name of a partition (``"logins:3"``), the same for every backend."""
    return f"{topic}:{partition}"


class PartialAssignment(RuntimeError):
    """Another member of the group holds some of the topic's partitions."""


def partial_assignment_error(group: str, topic: str, mine: list[int]) -> PartialAssignment:
    return PartialAssignment(
        f"consumer group {group!r} gave this process only partitions {mine} of {topic!r}: "
        "another aggregator runs in the same group. Set scale.partitioned = true on every "
        "member to run several aggregators in one group (docs/scale-out.md), or give each its "
        "own source.group"
    )


def replay_problem(
    topic: str,
    config: dict[str, str] | None,
    window_seconds: float | None,
    offsets: dict[str, int],
    begins: dict[str, int] | None,
) -> str | None:
    """Why ``topic`` could not replay an open window starting at ``offsets`` (None: it can),
    from its configuration and the first offset of each partition (None: unknown). A restart
    rebuilds the open window from the topic (docs/privacy.md), so the topic must keep at least
    a window's records and must not be compacted."""
    if config is None:
        log.warning(
            "could not read the configuration of topic %r: its retention is not "
            "checked against the window",
            topic,
        )
    else:
        if "compact" in config.get("cleanup.policy", ""):
            return (
                f"topic {topic!r} is compacted (cleanup.policy="
                f"{config['cleanup.policy']}): a restart replays the open window from "
                "the topic, which compaction shortens; count a topic with "
                "cleanup.policy=delete"
            )
        retention = int(config.get("retention.ms", "-1"))
        if window_seconds and 0 <= retention < 2000 * window_seconds:
            return (
                f"topic {topic!r} keeps records for retention.ms={retention}, less "
                f"than two windows (window.size={window_seconds:g} s): a restart could "
                "not replay the open window; raise the topic's retention.ms or shorten "
                "window.size"
            )
    for key, begin in (begins or {}).items():
        start = offsets[key]
        if begin > start:
            return (
                f"the open window starts at offset {start} of partition {key}, but the "
                f"topic now begins at {begin} (retention deleted part of the window), so "
                "it cannot be replayed; raise the topic's retention.ms, and to go on "
                "without that window move the checkpoints away and start with "
                "--fresh-start"
            )
    return None


class RecordColumn(Sequence):
    """One field (key, headers or timestamp) of a poll's records, read only where it is used:
    the service reads keys for dead letters and the keyed-topic sample, headers only for
    ``item.source = header``, so building a list of every record's key and headers on each poll
    (about 60 ns a record) is wasted in the common case. ``get`` reads the field of one record
    (an ``itemgetter`` for kafka-python's tuples, a method call for librdkafka's messages).
    Indexing, slicing and iteration give the same values as the list would."""

    __slots__ = ("_records", "_get")

    def __init__(self, records, get):
        self._records, self._get = records, get

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return RecordColumn(self._records[i], self._get)
        return self._get(self._records[i])

    def __iter__(self):
        get = self._get
        return (get(r) for r in self._records)

    def __eq__(self, other):
        if isinstance(other, (list, tuple, RecordColumn)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"RecordColumn({list(self)!r})"


class IntakeWatch:
    """Whether a Kafka client stopped delivering (both backends): a client can hold its
    assignment and yet hand over no record for minutes while its partitions have records waiting
    (seen with librdkafka after a clean broker restart: its group coordinator requests timed out,
    REQTMOUT, for ~2 minutes). :meth:`stalled` says so from the broker's end offsets;
    the backend's ``rebuild`` replaces the client (docs/operations.md, "Intake stalled").

    The backend calls :meth:`_delivered` when a poll returned records, :meth:`_polling` at each
    poll, :meth:`_quiet_from_now` on a new assignment or client, and keeps :attr:`paused` (a
    paused partition is not expected to deliver)."""

    #: a gap between two polls longer than this (s) is the loop's own (closing, a release
    #: pause), not the client's: the quiet time starts again
    POLL_GAP_S = 5.0

    assigned: set[str]
    start_offsets: dict[str, int]

    def _watch_init(self) -> None:
        now = time.monotonic()
        #: since when the client delivered nothing while polled (monotonic s)
        self.quiet_since = now
        self._polled_at = now
        #: when a poll last returned records (monotonic s; 0: never)
        self.delivered_at = 0.0
        #: partitions the service paused (held at a replay target, ...)
        self.paused: set[str] = set()

    def _polling(self) -> None:
        now = time.monotonic()
        if now - self._polled_at > self.POLL_GAP_S:
            self.quiet_since = now
        self._polled_at = now

    def _delivered(self) -> None:
        self.quiet_since = self.delivered_at = time.monotonic()

    def _quiet_from_now(self) -> None:
        self.quiet_since = time.monotonic()

    def end_offsets(self) -> dict[str, int] | None:  # the backend's
        raise NotImplementedError

    def client_positions(self, keys) -> dict[str, int]:  # the backend's
        """The client's own next offset in each of ``keys`` where it knows it (no wait)."""
        raise NotImplementedError

    def stalled(self, positions: dict[str, int], after_s: float) -> bool:
        """True if the client has partitions assigned and not paused, delivered nothing for
        ``after_s`` seconds of polling, and the broker's end offsets show records past
        ``positions`` (the service's next offsets) and past the client's own position in one of
        them. Asks the broker (bounded)
        only once the quiet time passed ``after_s``."""
        if after_s <= 0 or time.monotonic() - self.quiet_since < after_s:
            return False
        waiting = [k for k in self.assigned if k not in self.paused and k in positions]
        if not waiting:
            return False
        ends = self.end_offsets()
        if not ends:  # unknown (the broker does not answer): an outage, reported as one
            return False
        # the client's own position where it is further: it steps over transaction markers,
        # which the end offset counts and the service's positions (records) never reach
        try:
            client = self.client_positions(waiting)
        except Exception:
            client = {}
        return any(ends.get(k, 0) > max(positions[k], client.get(k, -1)) for k in waiting)
