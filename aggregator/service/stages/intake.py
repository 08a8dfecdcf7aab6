"""Intake: a polled segment's records decoded and counted into the open window's state.

:meth:`Intake.decode` turns a segment into items, the records they came from and the rejected
records (each with a reason, in metrics by reason, in the reject log by position and, if
configured, as a dead letter; never fatal, never silently counted). :meth:`Intake.count_segment`
counts the items into a :class:`..window.WindowTask` in one vectorized call per run of records
(:meth:`Intake.count`), closing the window (the caller's ``close``) when a count window fills or
a replay reaches its target, so that each window holds exactly its records. A partition that
reached its replay target before the others is held there (:meth:`Intake.hold`) until the window
closes. The decoder follows the source's and the items' settings (:func:`decoder_for`).

Invariant: the task's offsets always match its counters and its reject totals (a record is in
exactly one of: counted, rejected, filtered; each exactly once). Writes nothing durable; the
counters are in memory only (the dead letters go to their Kafka topic: the raw rejected record,
as the operator configured).
"""

from __future__ import annotations

import logging

import numpy as np

from consumers.base import Segment, offsets_array
from consumers.decode import FILTERED, Decoder, ItemSpec

from ...state import PanPrivateHistogram
from ..metrics import Metrics
from ..rejects import RejectLog, RejectWatch
from ..window import WindowTask

__all__ = ["Intake", "decoder_for"]

log = logging.getLogger("panagg.service")


def decoder_for(cfg, domain_size: int | None) -> Decoder:
    """The decoder of ``cfg``'s source and item settings; ``domain_size``: a direct domain's
    size (its indices are checked against it), None for hashed items."""
    src = cfg.source
    return Decoder(
        src.format,
        domain_size=domain_size,
        max_message_bytes=src.max_message_bytes,
        max_item_bytes=src.max_item_bytes,
        spec=ItemSpec.from_config(cfg.item),
    )


class Intake:
    """Decoding and counting of one aggregation's records.

    Parameters
    ----------
    decoder
        The configured decoder (item spec, format, size limits).
    source
        The event source (``pause``, ``resume``, ``seek_partition`` to hold a partition).
    metrics
        Events, rejects by reason, filtered records, the window's gauges.
    direct
        Direct mode (items are counter indices) or hashed (items are hashed into buckets).
    reject_watch, reject_log
        What rejects say about the configuration; rejects by position.
    dead_letters
        The dead-letter producer, or None.
    """

    def __init__(
        self,
        decoder: Decoder,
        source,
        metrics: Metrics,
        *,
        direct: bool,
        reject_watch: RejectWatch,
        reject_log: RejectLog,
        dead_letters=None,
    ):
        self.decoder, self.source, self.metrics, self.direct = decoder, source, metrics, direct
        self.reject_watch, self.reject_log = reject_watch, reject_log
        self.dead_letters = dead_letters
        #: partitions held at their replay target until the window closes
        self.held: set[str] = set()

    def decode(self, seg: Segment):
        """(items, record index of each item or None when all are good, rejected records).

        Never raises for one record's sake: whatever a record makes the decoder do, the record
        becomes a reject with a reason (and a dead letter)."""
        decoded = self.parse(seg)
        # records the item filter left out ride along as FILTERED: not events, not rejects
        bad = [r for r in decoded.rejected if r[1] != FILTERED]
        self.reject_watch.observe(seg.values, bad, len(decoded.rejected) - len(bad))
        if not decoded.rejected:
            return decoded.items, None, []
        for i, reason in bad:
            self.reject_log.record(seg.partition, seg.offsets[i], reason)
            if self.dead_letters is not None:
                self.dead_letters.send(
                    seg.partition,
                    seg.offsets[i],
                    seg.values[i],
                    reason,
                    key=seg.keys[i] if seg.keys is not None else None,
                )
        keep = np.ones(len(seg), dtype=bool)
        keep[[i for i, _ in decoded.rejected]] = False
        return decoded.items, np.flatnonzero(keep), decoded.rejected

    def parse(self, seg: Segment):
        """The decoder's result for ``seg`` (no logs, metrics or dead letters)."""
        try:
            return self.decoder.decode(seg.values, seg.keys, seg.headers)
        except Exception as exc:  # a decoder bug on odd input: classify records one by one
            log.error(
                "batch decoder failed (%s) on partition %s at offset %d; decoding its "
                "records one by one",
                type(exc).__name__,
                seg.partition,
                seg.offsets[0],
            )
            return self.decoder.decode_each(seg.values, seg.keys, seg.headers)

    def count_segment(self, task: WindowTask, seg: Segment, items, good, rejected, close) -> None:
        """Count ``seg`` into ``task``: its good ``items`` (from records ``good``; None: every
        record) and its ``rejected`` records, closing the window (``close()``) when a count
        window fills or a replay reaches its target, so that each window holds exactly its
        records and the offsets always match the counters and the reject totals."""
        offsets = offsets_array(seg.offsets)
        m, k = len(offsets), len(items)
        good_idx = np.arange(k) if good is None else np.asarray(good, dtype=np.int64)
        rej_idx = np.asarray([i for i, _ in rejected], dtype=np.int64)
        rej_reason = [r for _, r in rejected]
        j = rec = 0  # next item to count; records before ``rec`` are accounted for
        while True:
            target = task.close_at.get(seg.partition) if task.close_at else None
            if task.close_at and target is None:
                # a replayed window counted nothing of this partition (it was first read in a
                # later window): hold it where it is until the window closes
                target = int(offsets[0])
            rec_limit = m if target is None else int(np.searchsorted(offsets, target))
            take = max(0, int(np.searchsorted(good_idx, rec_limit)) - j)
            room = task.room()
            if room is not None:
                take = min(take, room)
            if take:
                self.count(task.live_state(), items[j : j + take])
                j += take
                task.window["events"] += take
                task.totals["events"] += take
                self.metrics.events.inc(take)
                self.window_gauges(task)
            full = room is not None and task.room() == 0
            # a full window ends right after its last item; later records are the next one's
            upto = int(good_idx[j - 1]) + 1 if full and j else rec_limit
            self.account(task, seg.partition, offsets, rej_idx, rej_reason, rec, upto)
            rec = max(rec, upto)
            if self.closed_or_held(task, seg.partition, offsets, rec, close, full):
                continue
            return

    def closed_or_held(
        self, task: WindowTask, partition: str, offsets, rec: int, close, full: bool = False
    ) -> bool:
        """After a segment's records before ``rec`` are in: close the window if it is ``full``
        or a replay reached its target (True: the segment's rest goes on in the next window);
        else hold the partition at ``rec`` if it reached its replay target before the others."""
        if full or (task.close_at is not None and task.reached(task.close_at)):
            close()
            self.release_held()
            return rec < len(offsets)
        if rec < len(offsets):
            self.hold(partition, int(offsets[rec]))
        return False

    def reject(self, seg: Segment, i: int, reason: str, reasons: dict) -> None:
        """Record ``i`` of ``seg`` is rejected for ``reason`` (log by position, dead letter)."""
        reasons[i] = reason
        self.reject_log.record(seg.partition, seg.offsets[i], reason)
        if self.dead_letters is not None:
            self.dead_letters.send(
                seg.partition,
                seg.offsets[i],
                seg.values[i],
                reason,
                key=seg.keys[i] if seg.keys is not None else None,
            )

    def account(
        self, task: WindowTask, partition: str, offsets, rej_idx, rej_reason, lo: int, hi: int
    ) -> None:
        """Records [lo, hi) of the segment are now in the task: move its offset past them and
        add their rejects to the totals (exactly once, like the events)."""
        if hi <= lo:
            return
        # a partition the window had no start for (a first start from the earliest record):
        # its first record here is where the window's range begins
        task.window.setdefault("start_offsets", {}).setdefault(partition, int(offsets[lo]))
        task.offsets[partition] = int(offsets[hi - 1]) + 1
        a, b = np.searchsorted(rej_idx, [lo, hi])
        if b > a:
            counts: dict[str, int] = {}
            for reason in rej_reason[a:b]:
                counts[reason] = counts.get(reason, 0) + 1
            skipped = counts.pop(FILTERED, 0)
            if skipped:
                task.totals["filtered"] = task.totals.get("filtered", 0) + skipped
                self.metrics.filtered.inc(skipped)
            for reason, count in counts.items():
                self.metrics.decode_errors.labels(reason=reason).inc(count)
            task.count_rejects(counts)

    def hold(self, partition: str, offset: int) -> None:
        """Stop reading ``partition`` at ``offset`` until the window closes (the other
        partitions are still replaying towards their targets)."""
        seek = getattr(self.source, "seek_partition", None)
        if seek is None:
            return
        self.source.pause([partition])
        seek(partition, offset)
        self.held.add(partition)

    def release_held(self) -> None:
        if self.held:
            self.source.resume(sorted(self.held))
            self.held.clear()

    def window_gauges(self, task: WindowTask) -> None:
        self.metrics.window_events.set(task.window["events"])
        if task.window["kind"] == "count":
            self.metrics.window_progress.set(task.progress())

    def count(self, state: PanPrivateHistogram, items) -> None:
        if self.direct:
            state.add_indices(np.asarray(items, dtype=np.int64))  # ranges checked by the decoder
        else:
            state.update(items)
