"""The internal topics of a scale-out group, their names and their checks.

Names derive from the consumer group (``source.group``), so two groups never share them (with
several ``[aggregations.NAME]`` each has its own set, ``<group>.panagg.<NAME>.*``)::

    <group>.panagg.repartition   counter indices by domain slice (plaintext like the source:
                                 docs/privacy.md section 17); delete retention, bounded
    <group>.panagg.summaries     per-partition window summaries; compacted, key <window>/<p>
    <group>.panagg.ledger        the privacy ledger, ONE partition; compacted with unique keys
                                 (nothing is ever removed)
    <group>.panagg.releases      the merged release documents; compacted, key <window>
    <group>.panagg.exports       audit exports: exported slices, then the signed document
    <group>.panagg.snapshots     layered snapshots of open windows, partition p, key p
    <group>.panagg.rollups       sum rollups: partition p's running sums of its slice's release
                                 views, key <span>/<index>; tombstoned when the rollup closes
    <group>.panagg.members       each member's latest report (partitions, readiness, metrics URL)
    <group>.panagg.intake        per source partition, the next offset already repartitioned
                                 (compacted; the intake never repartitions a record twice, even
                                 after the source group's offsets were reset); event-time
                                 windows: each one's watermark and the last window closed;
                                 count windows: each one's running event total, the last cut

Each is created at start if missing and checked if present: the partition count (the ledger has
exactly one; the repartition topic has ``scale.partitions`` or the source's count) and the cleanup
policy. A topic that is unfit stops the start with one line naming the fix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kafka import TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
from kafka.errors import TopicAlreadyExistsError

__all__ = ["GroupTopics", "GroupTopicError", "read_partition", "latest_values", "follow_intake"]


def read_partition(consumer, tp, on_record, timeout_s: float = 30.0) -> bool:
    """Hand ``on_record`` every record of ``tp`` from ``consumer``'s position up to the end
    offset it has now (read committed: what is committed now). ``consumer`` is assigned ``tp``
    (and nothing that has records). False if that end was not reached within ``timeout_s``."""
    end = consumer.end_offsets([tp], timeout_ms=10000)[tp]
    deadline = time.monotonic() + timeout_s
    while consumer.position(tp) < end:
        if time.monotonic() > deadline:
            return False
        for records in consumer.poll(timeout_ms=200).values():
            for record in records:
                on_record(record)
    return True


def latest_values(consumer, topic: str, timeout_s: float = 30.0) -> dict[str, bytes] | None:
    """The latest value of each key of ``topic``'s one partition committed now, as a compacted
    topic's reader sees it (a tombstone removes its key); ``consumer`` has no group and is
    assigned the partition here. None if its end was not reached within ``timeout_s``."""
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    latest: dict[str, bytes | None] = {}
    if not read_partition(
        consumer, tp, lambda r: latest.__setitem__(r.key.decode(), r.value), timeout_s
    ):
        return None
    return {k: v for k, v in latest.items() if v is not None}


def follow_intake(reader, topics, on_record):
    """Assign ``reader`` (no group, read committed) the intake topic's one partition, hand
    ``on_record`` everything committed there now, and return ``read()``: the records committed
    since, without waiting (the leader's closers follow the intake's marks this way)."""

    tp = TopicPartition(topics.intake, 0)
    reader.assign([tp])
    reader.seek_to_beginning(tp)
    read_partition(reader, tp, on_record)

    def read() -> None:
        for records in reader.poll(timeout_ms=0).values():
            for r in records:
                on_record(r)

    return read


class GroupTopicError(RuntimeError):
    """An internal topic that is missing and cannot be created, or exists unfit (one line)."""


@dataclass(frozen=True)
class GroupTopics:
    """The internal topic names of consumer group ``group`` (and of one of its
    ``[aggregations.NAME]``: ``<group>.panagg.<NAME>.*``)."""

    group: str
    aggregation: str = ""

    @property
    def prefix(self) -> str:
        return f"{self.group}.panagg" + (f".{self.aggregation}" if self.aggregation else "")

    @property
    def repartition(self) -> str:
        return f"{self.prefix}.repartition"

    @property
    def summaries(self) -> str:
        return f"{self.prefix}.summaries"

    @property
    def ledger(self) -> str:
        return f"{self.prefix}.ledger"

    @property
    def releases(self) -> str:
        return f"{self.prefix}.releases"

    @property
    def snapshots(self) -> str:
        """Layered snapshots of open windows (checkpoint.snapshots_per_window): partition p,
        key p, the latest only (compacted); tombstoned when the window closes."""
        return f"{self.prefix}.snapshots"

    @property
    def rollups(self) -> str:
        """The open sum rollups' running sums (window.rollups, rollup_design = sum): partition
        p, key ``<span>/<index>``, the latest only (compacted); tombstoned once the rollup's
        summary is written (rollups.py)."""
        return f"{self.prefix}.rollups"

    @property
    def exports(self) -> str:
        """Audit exports: each partition's exported slice until the leader signs the whole
        (key ``slice/<id>/<p>``), then the signed document (key ``doc/<id>``)."""
        return f"{self.prefix}.exports"

    @property
    def intake(self) -> str:
        """The intake's high-water marks: per source partition, the next offset already
        repartitioned (one per group, whatever the aggregations)."""
        return f"{self.group}.panagg.intake"

    @property
    def members(self) -> str:
        """Each member's latest report (compacted, key = member): partitions, readiness."""
        return f"{self.group}.panagg.members"

    @property
    def counting_group(self) -> str:
        """The consumer group of the counting stage (over the repartition topic)."""
        return f"{self.prefix}.count"

    def wanted(
        self, partitions: int, retention_ms: int, views: bool = False, snapshots: bool = False
    ) -> dict[str, tuple[int, dict]]:
        """``{topic: (partitions, configs)}``; ``views`` (scale.exchange = views): no
        repartition topic, the snapshots topic only when it takes ``snapshots``
        (checkpoint.snapshots_per_window), one partition for the rollup sums its leader
        keeps."""
        compact = {"cleanup.policy": "compact"}
        # retention deletes whole segments only: a segment rolls at a quarter of the retention,
        # so no plaintext index outlives it by more than that (the broker's default keeps a
        # quiet topic's records for a week, whatever retention.ms says)
        repartition = (
            {}
            if views
            else {
                self.repartition: (
                    int(partitions),
                    {
                        "cleanup.policy": "delete",
                        "retention.ms": str(int(retention_ms)),
                        "segment.ms": str(max(60_000, int(retention_ms) // 4)),
                    },
                )
            }
        )
        return {
            **repartition,
            self.summaries: (1, compact),
            self.ledger: (1, compact),
            self.releases: (1, compact),
            # a signed export holds every counter (8 bytes each): 64 MB fits 8e6 of them
            self.exports: (1, dict(compact, **{"max.message.bytes": str(64 * 1024 * 1024)})),
            **(
                {}
                if views and not snapshots
                else {
                    self.snapshots: (
                        int(partitions),
                        dict(compact, **{"max.message.bytes": str(64 * 1024 * 1024)}),
                    )
                }
            ),
            # a sum holds its slice's counters (8 bytes each): the producer sends up to 16 MB;
            # a views group's leader keeps the sums of all D counters, zlib'd, in partition 0
            self.rollups: (
                1 if views else int(partitions),
                dict(compact, **{"max.message.bytes": str(64 * 1024 * 1024)}),
            ),
            self.intake: (1, compact),
            self.members: (1, compact),
        }

    @staticmethod
    def _described(admin, names, wait_s: float = 15.0) -> dict[str, int]:
        """Partition counts; a topic created a moment ago shows none until its metadata has
        spread, so wait for it (bounded)."""
        deadline = time.monotonic() + wait_s
        while True:
            counts = _partition_counts(admin, names)
            if all(counts.get(n, 0) for n in names) or time.monotonic() > deadline:
                return counts
            time.sleep(0.2)

    def ensure(
        self,
        admin,
        partitions: int,
        retention_ms: int,
        replication_factor: int = 1,
        views: bool = False,
        snapshots: bool = False,
    ) -> list[str]:
        """Create what is missing, check what exists; returns one log line per created topic.

        ``admin`` is a kafka-python ``KafkaAdminClient``.
        """

        wanted = self.wanted(partitions, retention_ms, views, snapshots)
        existing = set(admin.list_topics())
        created = []
        for name, (parts, configs) in wanted.items():
            if name in existing:
                continue
            try:
                admin.create_topics(
                    [
                        NewTopic(
                            name,
                            num_partitions=parts,
                            replication_factor=int(replication_factor),
                            topic_configs=configs,
                        )
                    ]
                )
                created.append(
                    f"created internal topic {name} ({parts} partition(s), "
                    f"{configs['cleanup.policy']})"
                )
            except TopicAlreadyExistsError:  # another member made it a moment ago
                pass
        described = self._described(admin, list(wanted))
        for name, (parts, _) in wanted.items():
            have = described.get(name, 0)
            if have != parts:
                raise GroupTopicError(
                    f"internal topic {name} has {have} partition(s) but needs {parts}"
                    + (
                        " (the ledger is one ordered log)"
                        if name == self.ledger
                        else " (scale.partitions: the domain is split by it; it cannot change while "
                        "the group has state)"
                    )
                    + f": delete it only together with the group's other {self.group}.panagg.* "
                    "topics, or use another source.group"
                )
        resources = [ConfigResource(ConfigResourceType.TOPIC, name) for name in wanted]
        described_configs = admin.describe_configs(resources)
        for name, (_, configs) in wanted.items():
            want = configs["cleanup.policy"]
            policy = _policy(described_configs, name)
            if policy is not None and policy != want:
                raise GroupTopicError(
                    f"internal topic {name} has cleanup.policy={policy} but needs {want}"
                    + (
                        " (compaction keeps every ledger entry: their keys are unique)"
                        if want == "compact"
                        else " (a compacted repartition topic keeps plaintext items forever)"
                    )
                    + f"; fix it with kafka-configs.sh --alter --entity-type topics "
                    f"--entity-name {name} --add-config cleanup.policy={want}"
                )
        return created


def _partition_counts(admin, names) -> dict[str, int]:
    return {
        d.get("topic", d.get("name")): len(d.get("partitions") or [])
        for d in admin.describe_topics(names)
    }


def _policy(response, topic: str) -> str | None:
    """cleanup.policy of ``topic`` in kafka-python's describe_configs answer (a dict:
    ``{"topic": {name: {config: {"value": ...}}}}``)."""
    entry = (response or {}).get("topic", {}).get(topic, {}).get("cleanup.policy")
    return None if entry is None else str(entry.get("value"))
