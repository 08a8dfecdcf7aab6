"""Retention: records deleted by the source topic's retention before they were read.

A Kafka consumer that falls behind its topic's retention (a stall, a pause, a process stopped
by SIGSTOP) goes on from the first record left without a word (``auto_offset_reset =
earliest``). The open window would then hold the records after the deletion and be released
short of the records its ledgered range names, charged as released. :class:`RetentionWatch`
sees it before the segment is counted: a segment that starts past where its partition was due
to go on asks the source where the partition begins now (:func:`deleted_spans`, the same look
the start makes) and stops the service with one line if the records in between are gone. The
open window is not released; the next start withholds it with a ledger entry naming the
deleted records and goes on (:meth:`.resume.Resume.withhold_deleted`).

A jump in offsets is most often a transaction marker, one offset per transaction, so a jump of
at most :data:`SMALL_JUMP` offsets is looked at once a second per partition at most; a larger
one always. Writes nothing; one ListOffsets request per look (a Kafka source); a source that
cannot say where its partitions begin (files, tests) is never asked.

Found by the fault harness (``source_retention_frozen``, docs/chaos.md).
"""

from __future__ import annotations

import time

from consumers.base import Segment

from ..errors import ServiceError

__all__ = ["RetentionWatch", "SMALL_JUMP", "deleted_text", "deleted_spans", "stop_for_deleted"]

#: a jump in a partition's offsets this small is most often transaction markers
SMALL_JUMP = 4


def deleted_text(topic: str, partition: int, first: int, end: int) -> str:
    """The words a withheld window's ledger entry names deleted records with (every mode: the
    fault harness's checker reads them, tests/chaos/invariant.py)."""
    return (f"records of partition {partition} from offset {first} to {end} were deleted by "
            f"the retention of {topic} before they were counted")


def deleted_spans(source, offsets: dict[str, int]) -> dict[str, tuple[int, int]]:
    """``{partition key: (from, to)}``: the records from ``offsets`` on that the topic no
    longer holds (its first offset now is ``to``), for a source that can say where its
    partitions begin (``initial_offsets("earliest")``, Kafka); empty otherwise."""
    probe = getattr(source, "initial_offsets", None)
    firsts = probe("earliest") if probe is not None and offsets else None
    return {p: (int(a), int(firsts[p])) for p, a in sorted(offsets.items())
            if firsts and p in firsts and int(firsts[p]) > int(a)}


class RetentionWatch:
    """Asks ``source`` whether a segment's jump in offsets skipped deleted records."""

    def __init__(self, source):
        self.source = source
        self.asks = getattr(source, "initial_offsets", None) is not None   # Kafka sources
        #: per partition, when the source was last asked about a small jump
        self._looked_at: dict[str, float] = {}

    def check(self, seg: Segment, want: int | None) -> dict[str, tuple[int, int]]:
        """``{partition: (want, first)}`` if ``seg`` starts past ``want`` (where its partition
        was due to go on) because the records in between were deleted (the partition begins at
        ``first`` now); empty otherwise."""
        first = int(seg.offsets[0])
        if want is None or first <= want or not self.asks:
            return {}
        now = time.monotonic()
        if first - want <= SMALL_JUMP and now - self._looked_at.get(seg.partition, -1e9) < 1.0:
            return {}
        self._looked_at[seg.partition] = now
        return deleted_spans(self.source, {seg.partition: int(want)})


def stop_for_deleted(gone: dict[str, tuple[int, int]], window, why: str) -> ServiceError:
    """The one line a running service stops with when it cannot withhold the open window
    ``window`` over the deleted records ``gone`` (``why``): the next start withholds it."""
    (partition, (want, begin)), = list(gone.items())[:1]
    return ServiceError(
        f"records of {partition} from offset {want} were deleted before they were read (the "
        f"service fell behind the topic's retention; it begins at {begin} now); window "
        f"{window} ({why}) is not released: the next start withholds it, naming them, and "
        "counts on from the first record left; raise the topic's retention.ms above the "
        "longest stall")
