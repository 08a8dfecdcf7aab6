"""What both Kafka backends say and name the same way: partition keys, the partial-assignment
refusal and why a topic cannot replay an open window."""

from __future__ import annotations

import logging
from collections.abc import Sequence

__all__ = ["PartialAssignment", "RecordColumn", "partial_assignment_error", "partition_key",
           "replay_problem"]

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
        "own source.group")


def replay_problem(topic: str, config: dict[str, str] | None, window_seconds: float | None,
                   offsets: dict[str, int], begins: dict[str, int] | None) -> str | None:
    """Why ``topic`` could not replay an open window starting at ``offsets`` (None: it can),
    from its configuration and the first offset of each partition (None: unknown). A restart
    rebuilds the open window from the topic (docs/privacy.md), so the topic must keep at least
    a window's records and must not be compacted."""
    if config is None:
        log.warning("could not read the configuration of topic %r: its retention is not "
                    "checked against the window", topic)
    else:
        if "compact" in config.get("cleanup.policy", ""):
            return (f"topic {topic!r} is compacted (cleanup.policy="
                    f"{config['cleanup.policy']}): a restart replays the open window from "
                    "the topic, which compaction shortens; count a topic with "
                    "cleanup.policy=delete")
        retention = int(config.get("retention.ms", "-1"))
        if window_seconds and 0 <= retention < 2000 * window_seconds:
            return (f"topic {topic!r} keeps records for retention.ms={retention}, less "
                    f"than two windows (window.size={window_seconds:g} s): a restart could "
                    "not replay the open window; raise the topic's retention.ms or shorten "
                    "window.size")
    for key, begin in (begins or {}).items():
        start = offsets[key]
        if begin > start:
            return (f"the open window starts at offset {start} of partition {key}, but the "
                    f"topic now begins at {begin} (retention deleted part of the window), so "
                    "it cannot be replayed; raise the topic's retention.ms, and to go on "
                    "without that window move the checkpoints away and start with "
                    "--fresh-start")
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
