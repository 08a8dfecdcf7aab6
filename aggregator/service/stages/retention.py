"""Retention: records deleted by the source topic's retention before they were read.

A Kafka consumer that falls behind its topic's retention (a stall, a pause, a process stopped
by SIGSTOP) goes on from the first record left without a word (``auto_offset_reset =
earliest``). The open window would then hold the records after the deletion and be released
short of the records its ledgered range names, charged as released. :class:`RetentionWatch`
sees it before the segment is counted: a segment that starts past where its partition was due
to go on asks the source where the partition begins now (:func:`deleted_spans`, the same look
the start makes). If the records in between are gone, the loop withholds the open window
(:meth:`.close.Closer.withhold_deleted`): the ledger entry a start writes for records deleted
while the service was down (:func:`.withhold.withhold_window`, naming them in the words of
:func:`deleted_text`; its range: the records the window counted), one WARNING line, and the
next window starts at the first record left. Where the open window cannot be withheld running
(an event-time window, a restart's replay, a restored snapshot's window) the service stops
with one line (:func:`stop_for_deleted`) and the next start withholds it
(:meth:`.resume.Resume.withhold_deleted`).

A jump in offsets is most often a transaction marker, one offset per transaction, so a jump of
at most :data:`SMALL_JUMP` offsets is looked at once a second per partition at most; a larger
one always. The watch writes nothing; one ListOffsets request per look (a Kafka source); a
source that cannot say where its partitions begin (files, tests) is never asked.

Found by the fault harness (``source_retention_frozen``, docs/chaos.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np

from consumers.base import Segment, offsets_array

from ..errors import ServiceError

__all__ = ["RetentionWatch", "SMALL_JUMP", "deleted_text", "deleted_spans", "stop_for_deleted"]

log = logging.getLogger("panagg.service")

#: a jump in a partition's offsets this small is most often transaction markers
SMALL_JUMP = 4


def deleted_text(topic: str, partition: int, first: int, end: int) -> str:
    """The words a withheld window's ledger entry names deleted records with (every mode: the
    fault harness's checker reads them, tests/chaos/invariant.py)."""
    return (
        f"records of partition {partition} from offset {first} to {end} were deleted by "
        f"the retention of {topic} before they were counted"
    )


def deleted_spans(source, offsets: dict[str, int]) -> dict[str, tuple[int, int]]:
    """``{partition key: (from, to)}``: the records from ``offsets`` on that the topic no
    longer holds (its first offset now is ``to``), for a source that can say where its
    partitions begin (``initial_offsets("earliest")``, Kafka); empty otherwise."""
    probe = getattr(source, "initial_offsets", None)
    firsts = probe("earliest") if probe is not None and offsets else None
    return {
        p: (int(a), int(firsts[p]))
        for p, a in sorted(offsets.items())
        if firsts and p in firsts and int(firsts[p]) > int(a)
    }


class RetentionWatch:
    """Asks ``source`` whether a segment's jump in offsets skipped deleted records."""

    def __init__(self, source):
        self.source = source
        #: per partition, when the source was last asked about a small jump
        self._looked_at: dict[str, float] = {}
        #: per partition, the first record left after a withheld deletion (:meth:`passed`)
        self._floor: dict[str, int] = {}

    @property
    def asks(self) -> bool:
        """Whether the source can say where its partitions begin (Kafka sources)."""
        return getattr(self.source, "initial_offsets", None) is not None

    def check(self, seg: Segment, due: dict[str, int]) -> dict[str, tuple[int, int]]:
        """``{partition: (due, first)}`` if ``seg`` starts past ``due[seg.partition]`` (where its
        partition was due to go on) because the records in between were deleted (the partition
        begins at ``first`` now); empty otherwise. The same look names every other partition of
        ``due`` whose due records were deleted too: one window withholds them all, as a
        restart's does."""
        want = due.get(seg.partition)
        first = int(seg.offsets[0])
        if want is None or first <= want or not self.asks:
            return {}
        now = time.monotonic()
        if first - want <= SMALL_JUMP and now - self._looked_at.get(seg.partition, -1e9) < 1.0:
            return {}
        self._looked_at[seg.partition] = now
        gone = deleted_spans(self.source, dict(due))
        return gone if seg.partition in gone else {}

    def passed(self, gone: dict[str, tuple[int, int]]) -> None:
        """The window over ``gone`` is withheld: records of those partitions below the first
        one left that the source still delivers (fetched before the deletion) are dropped
        (:meth:`trim`), not counted into the next window beside the entry naming them
        deleted."""
        self._floor.update({p: int(first) for p, (_, first) in gone.items()})

    def trim(self, seg: Segment) -> Segment:
        """``seg`` without its records below its partition's first record left after a
        withheld deletion (:meth:`passed`)."""
        floor = self._floor.get(seg.partition)
        if floor is None:
            return seg
        offsets = offsets_array(seg.offsets)
        start = int(np.searchsorted(offsets, floor))
        if start < len(offsets):  # reached: the partition's later records are all past it
            del self._floor[seg.partition]
        if not start:
            return seg
        log.info(
            "partition %s: %d record(s) fetched before the deletion are dropped (named "
            "deleted in the withheld window's entry)",
            seg.partition,
            start,
        )
        return _slice(seg, start, len(seg))

    def split(self, seg: Segment) -> list[Segment]:
        """``seg`` cut before each jump of more than :data:`SMALL_JUMP` offsets inside it, so
        that :meth:`check` sees every such jump at a segment's start: a client that went on
        from the first record left after a deletion can hand the records before it and after
        it in one segment (librdkafka did: the several-aggregations run of the frozen fault
        released windows over the deleted records, unseen)."""
        if not self.asks or len(seg) < 2 or isinstance(seg.offsets, range):
            return [seg]
        offsets = offsets_array(seg.offsets)
        cuts = (np.flatnonzero(np.diff(offsets) > SMALL_JUMP + 1) + 1).tolist()
        if not cuts:
            return [seg]
        bounds = [0, *cuts, len(seg)]
        return [_slice(seg, a, b) for a, b in zip(bounds, bounds[1:])]

    def parts(self, seg: Segment, due: dict[str, int], withhold) -> Iterator[Segment]:
        """The parts of ``seg`` to count, in order: cut at its jumps (:meth:`split`), without
        the records fetched before a withheld deletion (:meth:`trim`); a part that starts past
        deleted records first has ``withhold(gone)`` called (the open window withheld, naming
        them). Lazy: each part is checked against ``due`` as the previous one left it."""
        for part in self.split(seg):
            part = self.trim(part)
            if not len(part):
                continue
            gone = self.check(part, due)
            if gone:  # withheld, or a stop where it cannot be withheld running
                withhold(gone)
                self.passed(gone)
            yield part


def _slice(seg: Segment, start: int, stop: int) -> Segment:
    """The records of ``seg`` from index ``start`` to ``stop``."""

    def cut(col):
        return None if col is None else col[start:stop]

    return Segment(
        seg.partition,
        seg.offsets[start:stop],
        seg.values[start:stop],
        cut(seg.keys),
        cut(seg.headers),
        cut(seg.timestamps),
    )


def stop_for_deleted(gone: dict[str, tuple[int, int]], window, why: str) -> ServiceError:
    """The one line a running service stops with when it cannot withhold the open window
    ``window`` over the deleted records ``gone`` (``why``): the next start withholds it."""
    ((partition, (want, begin)),) = list(gone.items())[:1]
    return ServiceError(
        f"records of {partition} from offset {want} were deleted before they were read (the "
        f"service fell behind the topic's retention; it begins at {begin} now); window "
        f"{window} ({why}) is not released: the next start withholds it, naming them, and "
        "counts on from the first record left; raise the topic's retention.ms above the "
        "longest stall"
    )
