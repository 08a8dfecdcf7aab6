"""Counting: one pan-private state per repartition partition, for that partition's domain slice.

A member counts the repartition partitions the group (``<group>.panagg.count``) assigns it. Each
partition's open window lives only in this process's memory (docs/privacy.md section 16): a
:class:`~aggregator.state.PanPrivateHistogram` of the slice's counters, drawn with its noise
when the window opens. Windows are cut by the repartition messages' timestamps (the intake time),
aligned to the epoch: window w covers [w * size, (w + 1) * size). A message stamped before the
open window counts in it (late: next window); one stamped after closes the open window first.
A window also closes on the clock, ``scale.close_grace_s`` after its end, so a partition without
traffic still closes (noise only) and the merge never waits for it.

Closing window w of partition p, in one Kafka transaction:

1. ask the ledger (read from its topic) whether the window's positions [start, end) of p were
   charged already: if so the summary says "refused" and no release layer is drawn;
2. otherwise add the release layer (joint model) and take the noisy-value counts (the summary,
   :func:`~aggregator.service.group.summary.partition_summary`: post-processing of the release
   view);
3. write the summary to ``<group>.panagg.summaries`` (key ``w/p``) and commit the partition's
   offset ``end`` with metadata ``{"w": w + 1}`` to the counting group, with the group's
   metadata, so a member the group has dropped (a zombie) is fenced and nothing of it is seen.

The committed offset and its metadata are the partition's whole durable state: a new owner
(after a rebalance or a crash) starts window w + 1 at ``end`` and replays it under fresh noise.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid

import msgpack
import numpy as np
from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from consumers.kafka.compat import finish_join

from ...state import PanPrivateHistogram
from .deleted import deleted_since
from .event_windows import EventSlice
from .membership import Membership
from .repartition import slice_size
from .snapshots import layered_look, restore, take_snapshot
from .summary import add_source, partition_summary

__all__ = ["SliceTask", "Counter"]

log = logging.getLogger("panagg.group")

#: a jump of the repartition offsets this small may be transaction markers of intakes writing
#: at once; larger ones are checked against the partition's first offset every time
SMALL_JUMP = 64


def charged_before(ledger, identity: dict, ranges: dict, window_kind: str) -> str | None:
    """Why the group's ``ledger`` refuses a window over ``ranges`` (its positions were charged
    before, past the per-event budget); None if it may be summarized. Event-time windows of the
    group's lineage overlap in positions and split the records between them: charges.py takes
    their largest charge, not the sum."""
    eps = float(identity["epsilon"])
    peak = ledger.charges().peak(ranges, eps, lineage=identity["lineage"], window_kind=window_kind)
    if peak > ledger.budget_per_event * (1 + 1e-12):
        return (
            f"positions {ranges} were released before (they would reach {peak:g} eps "
            f"> {ledger.budget_per_event:g})"
        )
    return None


class SliceTask:
    """The open window of one repartition partition."""

    def __init__(self, partition: int, window: int, start: int, size: int, make_state):
        self.partition = int(partition)
        self.window = int(window)
        self.start = int(start)  # first offset of the open window
        self.position = int(start)  # next offset to read
        self.size = int(size)
        self._make_state = make_state
        self.state = make_state()
        self.events = 0
        self.opened_unix = time.time()
        #: event-time windows: the live windows and where they end (None: intake time)
        self.slice: EventSlice | None = None
        #: layered snapshots taken in this window (checkpoint.snapshots_per_window)
        self.snapshots = 0
        #: why this window cannot be released (its snapshot was lost): it is withheld
        self.lost: str | None = None
        #: (first, end) offsets of this partition deleted (retention) before they were
        #: counted: every window whose range starts below ``end`` is withheld, naming them
        self.deleted: tuple[int, int] | None = None
        #: the source positions the window's messages came from (the budget registry's charge)
        self.sources: dict[str, list[int]] = {}
        #: the position at a jump whose first offset was not looked at (looked at less than a
        #: second before): looked at before the window closes (:meth:`SliceCounter._close`)
        self.unchecked_from: int | None = None

    def advance(self, window: int) -> None:
        """Open ``window`` at the current position (fresh noise)."""
        self.window = int(window)
        self.start = self.position
        self.state = self._make_state()
        self.events = 0
        self.opened_unix = time.time()
        self.snapshots = 0
        self.lost = None
        self.sources = {}


class Counter:
    """Counts the assigned repartition partitions and writes their window summaries.

    Parameters
    ----------
    consumer
        kafka-python consumer (group ``<group>.panagg.count``, read_committed, no auto-commit),
        not yet subscribed.
    txn
        :class:`~aggregator.service.group.txn.Transactions` (the transactional producer).
    topics
        :class:`~aggregator.service.group.topics.GroupTopics`.
    identity
        The group identity from the ledger (mode, size, epsilon, partitions, window size, ...).
    ledger
        A :class:`~aggregator.service.group.ledger_topic.TopicLedger` reader (tailed here).
    """

    def __init__(
        self,
        consumer,
        txn,
        topics,
        identity: dict,
        ledger,
        metrics,
        *,
        member: str,
        grace_s: float = 2.0,
        first_window: int | None = None,
        snapshots_per_window: int = 0,
        snapshot_reader=None,
        rollups=None,
    ):
        self.consumer, self.txn, self.topics = consumer, txn, topics
        #: partition -> when its first offset was last looked at (_check_deleted)
        self._low_checked: dict[int, float] = {}
        self.identity, self.ledger, self.metrics = identity, ledger, metrics
        self.member = member
        self.P = int(identity["partitions"])
        self.size = float(identity["window_size"])
        self.grace_s = float(grace_s)
        self.first_window = int(identity["first_window"] if first_window is None else first_window)
        #: event-time windows, closed by the leader's markers (event_windows.py)
        self.event_time = identity.get("window_kind", "time") == "event_time"
        #: count windows: they end only at the leader's markers (count_windows.py)
        self.window_kind = identity.get("window_kind", "time")
        self.count = self.window_kind == "count"
        self.late_policy = str(identity.get("late", "next"))
        self.tasks: dict[int, SliceTask] = {}
        #: k layered snapshots per window at public points (intake time j / (k + 1) of the
        #: window), each in the transaction that commits the partition's offset (snapshots.py)
        self.snapshots_per_window = int(snapshots_per_window)
        self.snapshot_reader = snapshot_reader
        #: sum rollups: each partition's running sums of its views (rollups.SliceRollups)
        self.rollups = rollups
        self.summaries_written = 0
        self._needs_sync = False
        self.membership = Membership(consumer, topics.repartition, topics.ledger)
        #: the group assigned this member the ledger's partition: it leads
        self.is_leader = False
        self.membership.subscribe(self, on_revoked=self._drop)

    # -- ownership ---------------------------------------------------------------------------
    def _drop(self, partition: int) -> None:
        task = self.tasks.pop(partition, None)
        if self.rollups is not None:
            self.rollups.drop(partition)
        if task is not None:
            # the counters are only in memory: dropping them is all a handover needs
            log.info(
                "partition %d of %s moved away; its open window %d is replayed by its next owner",
                partition,
                self.topics.repartition,
                task.window,
            )
            self.metrics.handovers.labels(event="released").inc()
        self.metrics.partitions_owned.set(len(self.tasks))

    def _sync(self) -> None:
        self._needs_sync = False
        owned = self.membership.sync()
        if owned is None:  # between generations: nothing is counted or closed until synced
            self._needs_sync = True
            return
        self.is_leader = self.membership.is_leader
        for p in list(self.tasks):
            if p not in owned:
                self._drop(p)
        for p, task in self.tasks.items():
            # a poll that brought the assignment may have read past what the task counted
            self.consumer.seek(TopicPartition(self.topics.repartition, p), task.position)
        for p in sorted(owned - set(self.tasks)):
            tp = TopicPartition(self.topics.repartition, p)
            committed = self.consumer.committed(tp, metadata=True, timeout_ms=5000)
            meta = {}
            if committed is None or committed.offset is None or committed.offset < 0:
                window, start = self.first_window, 0
                self.consumer.seek_to_beginning(tp)
                start = self.consumer.position(tp)
            else:
                meta = json.loads(committed.metadata or "{}")
                window, start = int(meta.get("w", self.first_window)), int(committed.offset)
                self.consumer.seek(tp, start)
            task = SliceTask(
                p,
                window,
                start,
                slice_size(self.identity["size"], self.P, p),
                lambda p=p: self._new_state(p),
            )
            if committed is not None and committed.offset is not None and committed.offset >= 0:
                low = deleted_since(self.consumer, {tp: start}).get(tp)
                if low is not None:
                    # retention deleted records of the open window before it closed: replayed
                    # without them it would release fewer events than its positions say
                    task.lost = (
                        f"records of partition {p} from offset {start} to {low} were "
                        "deleted by the repartition topic's retention before the window "
                        "closed (scale.repartition_retention_s)"
                    )
                    task.deleted = (start, low)
            if committed is not None and "s" in meta:
                # the window resumes from its layered snapshot, never from its start (a replay
                # under fresh noise would be a second view of what the snapshot holds)
                restore(task, meta, self.snapshot_reader, p)
            if self.rollups is not None:
                self.rollups.restore(p)  # the sums as of the committed offset
            if self.event_time:
                # where windows ended at the resume offset, and what is summarized already
                # (none yet: the leader's first marker will say where they begin)
                task.slice = EventSlice(
                    closed=meta.get("k"),
                    summarized=meta.get("c"),
                    make_state=task._make_state,
                    late_policy=self.late_policy,
                )
            self.tasks[p] = task
            self.metrics.handovers.labels(event="acquired").inc()
            log.info(
                "counting partition %d of %s from offset %d (window %d)",
                p,
                self.topics.repartition,
                start,
                window,
            )
        self.metrics.partitions_owned.set(len(self.tasks))

    def _new_state(self, partition: int) -> PanPrivateHistogram:
        ident = self.identity
        return PanPrivateHistogram(
            ident["epsilon"],
            neighbor=ident["neighbor"],
            size=slice_size(ident["size"], self.P, partition),
        )

    # -- counting ----------------------------------------------------------------------------
    def step(self, timeout_s: float = 0.2) -> int:
        """One poll; count it; close the windows that ended. Returns events counted."""
        finish_join(self.consumer)
        polled = self.consumer.poll(timeout_ms=int(timeout_s * 1000))
        if self._needs_sync:
            # positions may have moved (a rebalance, a failed close): everything polled now is
            # read again after the sync seeks each partition to what it counted
            self._sync()
            # records polled before the sync may predate the committed offsets: drop them
            polled = {}
        self.ledger.tail(0)
        counted = 0
        for tp, recs in polled.items():
            task = self.tasks.get(tp.partition) if tp.topic == self.topics.repartition else None
            if task is None:
                continue
            if task.slice is not None:
                counted += self._count_event_time(tp.partition, task, recs)
                continue
            for rec in recs:
                if rec.offset < task.position:
                    continue
                if rec.offset > task.position + 1:
                    self._check_deleted(task, tp, rec.offset - task.position)
                head = dict(rec.headers or ())
                close = head.get("close")
                if close is not None:
                    # a forced release or an audit export (forced.py): windows up to it end
                    # here, at once; an export first takes the open window's slice, which
                    # is written with that window's close (so no crash replays what it saw)
                    upto, extra = int(close), None
                    if "export" in head:
                        extra = self._export_slice(task, head["export"].decode())
                        upto = max(upto, task.window)
                    while task.window <= upto and self._close(task, extra):
                        extra = None
                    if self.tasks.get(tp.partition) is not task:
                        break  # the close failed: the partition is read again
                    task.position = rec.offset + 1
                    continue
                wid = (
                    task.window
                    if self.count
                    else int(math.floor(rec.timestamp / 1000.0 / self.size))
                )
                while wid > task.window and self._close(task):
                    pass
                if self.tasks.get(tp.partition) is not task:
                    break  # the close failed: the partition is read again from its offsets
                lost = head.get("lost")
                if lost is not None:
                    # the intake found source records deleted before it read them, where this
                    # message is: the window that would have counted them is withheld
                    task.lost = "; ".join(filter(None, (task.lost, lost.decode())))
                add_source(task.sources, head.get("src"))
                idx = np.frombuffer(rec.value, dtype="<i4").astype(np.int64)
                task.state.add_indices(idx)
                task.events += len(idx)
                task.position = rec.offset + 1
                counted += len(idx)
                if self.snapshots_per_window and not self._maybe_snapshot(task, rec.timestamp):
                    break  # the snapshot failed: the partition is read again
        if counted:
            self.metrics.events.inc(counted)
        now = time.time()
        for task in list(self.tasks.values()):
            while (
                task.slice is None
                and not self.count
                and now >= (task.window + 1) * self.size + self.grace_s
                and self._close(task)
            ):
                pass
        return counted

    # -- event-time windows ------------------------------------------------------------------
    def _count_event_time(self, partition: int, task: SliceTask, recs) -> int:
        """Count ``recs`` of one partition into their event-time windows; close at markers."""
        counted = rejected = 0
        for rec in recs:
            if rec.offset < task.position:
                continue
            head = dict(rec.headers or ())
            if not task.slice.opened():
                # nothing is counted before the first marker says where the windows begin: read
                # on to it, then start again from the partition's first offset
                if "close" in head:
                    task.slice.open_at(int(head["close"]))
                    self.consumer.seek(
                        TopicPartition(self.topics.repartition, partition), task.position
                    )
                    break
                continue
            if "close" in head:
                upto = int(head["close"])
                if task.slice.marker(upto) and not self._close_event_time(task, rec.offset, upto):
                    break  # the close failed: the partition is read again from its offsets
                task.position = rec.offset + 1
                continue
            if "lost" in head:  # source records deleted before the intake read them (intake)
                task.slice.lose(
                    rec.offset, int(head["from"]), int(head["through"]), head["lost"].decode()
                )
                task.position = rec.offset + 1
                continue
            if "w" not in head:
                task.position = rec.offset + 1
                continue
            idx = np.frombuffer(rec.value, dtype="<i4").astype(np.int64)
            n, late = task.slice.add(
                rec.offset, int(head["w"]), "late" in head, idx, source=head.get("src")
            )
            counted += n
            rejected += late
            task.position = rec.offset + 1
        if counted:
            self.metrics.events.inc(counted)
        if rejected:
            self.metrics.decode_errors.labels(reason="late").inc(rejected)
        return counted

    def _close_event_time(self, task: SliceTask, marker: int, upto: int) -> bool:
        """The marker at offset ``marker`` closes every window up to ``upto``: their summaries
        and the partition's resume point in one transaction (False: not written; replayed)."""

        p, sl = task.partition, task.slice
        if not self._still_owned(task):
            return False
        key = f"{self.topics.repartition}:{p}"
        out, rolled = [], []
        for w, live in sl.to_close(upto):
            state = live.state if live is not None else task._make_state()
            start = live.first if live is not None else marker + 1
            ranges = {key: [start, marker + 1]}
            info = {
                "kind": "event_time",
                "size": self.size,
                "events": int(live.events) if live else 0,
                "started_unix": w * self.size,
                "ended_unix": (w + 1) * self.size,
                "event_start_unix": w * self.size,
                "event_end_unix": (w + 1) * self.size,
                "late": int(live.late) if live else 0,
                "late_policy": self.late_policy,
                "allowed_lateness_s": float(self.identity.get("allowed_lateness_s", 0.0)),
                "start_offset": start,
                "end_offset": marker + 1,
            }
            refused = (live.lost or self._refusal(w, ranges)) if live is not None else None
            view = [] if self.rollups is not None else None
            if refused:
                summary = {
                    "format": "panagg.summary",
                    "version": 1,
                    "window": w,
                    "partition": p,
                    "partitions": self.P,
                    "refused": refused,
                    "ranges": ranges,
                    "member": self.member,
                }
            else:
                summary = partition_summary(
                    state,
                    model=self.identity["model"],
                    window=w,
                    partition=p,
                    partitions=self.P,
                    window_info=info,
                    view=view,
                )
                summary.update(ranges=ranges, member=self.member, uid=uuid.uuid4().hex)
            summary["sources"] = sl.sources.get(w, {})
            out.append((w, summary))
            if self.rollups is not None:
                # the same view into the rollup sums; applied at once so the next window of
                # this close adds to it (an aborted close re-reads the sums: _abort, _sync)
                msgs, apply = self.rollups.fold(
                    p,
                    w,
                    view[0] if view else None,
                    state=state,
                    events=info["events"],
                    member=self.member,
                    times=(info["started_unix"], info["ended_unix"]),
                )
                rolled += msgs
                apply()
        resume, closed_there = sl.resume_point(upto, marker + 1)
        head = self.ledger.head()
        meta = json.dumps(
            {
                "w": upto + 1,
                "k": closed_there,
                "c": upto,
                "lh": f"{head['seq']}:{head['hash'][:16]}",
            },
            separators=(",", ":"),
        )
        txn = self.txn
        try:
            txn.begin()
            for w, summary in out:
                txn.send(
                    self.topics.summaries,
                    partition=0,
                    key=f"{w}/{p}".encode(),
                    value=json.dumps(summary, allow_nan=False).encode(),
                )
            for topic, part, rkey, value in rolled:
                txn.send(topic, partition=part, key=rkey, value=value)
            tp = TopicPartition(self.topics.repartition, p)
            txn.send_offsets({tp: OffsetAndMetadata(resume, meta, -1)}, self.membership.generation)
            txn.commit()
        except Exception as exc:
            self._abort(task, exc)
            return False
        self.summaries_written += len(out)
        self.metrics.summaries.inc(len(out))
        sl.closed_at(upto)
        task.window = upto + 1
        task.start = resume
        return True

    def _maybe_snapshot(self, task: SliceTask, stamp_ms: int) -> bool:
        """Snapshot j of the window once a record stamped at j / (k + 1) of it is counted (the
        intake's stamps: public, and they advance with a replay too). False: it failed."""
        k = self.snapshots_per_window
        due = (task.window + (task.snapshots + 1) / (k + 1)) * self.size
        if task.snapshots >= k or stamp_ms / 1000.0 < due or task.lost:
            return True

        t0 = time.perf_counter()
        message = take_snapshot(task)
        head = self.ledger.head()
        meta = json.dumps(
            {
                "w": task.window,
                "s": task.snapshots,
                "st": task.start,
                "lh": f"{head['seq']}:{head['hash'][:16]}",
            },
            separators=(",", ":"),
        )
        txn = self.txn
        try:
            txn.begin()
            txn.send(
                self.topics.snapshots,
                partition=task.partition,
                key=str(task.partition).encode(),
                value=message,
            )
            txn.send_offsets(
                {
                    TopicPartition(self.topics.repartition, task.partition): OffsetAndMetadata(
                        task.position, meta, -1
                    )
                },
                self.membership.generation,
            )
            txn.commit()
        except Exception as exc:
            self._abort(task, exc)
            return False
        self.metrics.checkpointed(time.perf_counter() - t0)
        return True

    def _export_slice(self, task: SliceTask, export_id: str) -> list:
        """An audit export of the open window's slice (docs/privacy.md section 6): a fresh
        layer, the snapshot, another fresh layer; returned as the message to write with the
        window's close."""

        snapshot = layered_look(task.state)
        value = msgpack.packb(
            {
                "id": export_id,
                "partition": task.partition,
                "partitions": self.P,
                "window": task.window,
                "range": [task.start, task.position],
                "member": self.member,
                "state": snapshot,
            },
            use_bin_type=True,
        )
        return [(self.topics.exports, f"slice/{export_id}/{task.partition}".encode(), value)]

    def _check_deleted(self, task: SliceTask, tp, jump: int) -> None:
        """The partition's records jumped ``jump`` offsets (more than one transaction marker):
        if the partition's first offset is now past the task's position, retention deleted
        records before they were counted (the consumer went on from the first one left).
        Noted on the task: every window they may belong to is withheld (:meth:`_close`),
        never released short of them (issue 46: a window was released with the ranges of
        three partitions empty, no flag). Small jumps are common (several intakes' markers
        interleave, aborted transactions): those look at the first offset at most once a
        second per partition; a jump of more than SMALL_JUMP offsets always looks (retention
        deletes whole segments)."""
        if task.deleted is not None and task.deleted[1] > task.position:
            return
        now = time.monotonic()
        if jump <= SMALL_JUMP and now - self._low_checked.get(tp.partition, -1e9) < 1.0:
            # not looked at now: at the close at the latest, so that no window is released
            # short of records deleted at this jump
            if task.unchecked_from is None:
                task.unchecked_from = task.position
            return
        self._low_checked[tp.partition] = now
        self._note_deleted(task, tp, task.position)

    def _note_deleted(self, task: SliceTask, tp, since: int) -> None:
        """Note on ``task`` the records from ``since`` to the partition's first offset, if
        retention deleted them (the first offset is past ``since``)."""
        low = deleted_since(self.consumer, {tp: since}).get(tp)
        if low is not None and (task.deleted is None or task.deleted[1] <= since):
            task.deleted = (since, int(low))
            log.warning(
                "records of partition %d of %s from offset %d to %d were deleted by "
                "its retention before they were counted (scale."
                "repartition_retention_s); the windows they fall in are withheld",
                task.partition,
                self.topics.repartition,
                since,
                low,
            )

    def _deleted_reason(self, task: SliceTask, end: int) -> str | None:
        """Why the window of ``task`` (its range ending at ``end``) is withheld if it may
        hold records deleted before they were counted; None if it cannot."""
        if task.deleted is None or task.start >= task.deleted[1]:
            return None
        first, last = max(task.start, task.deleted[0]), task.deleted[1]
        return (
            f"records of partition {task.partition} from offset {first} to {last} were "
            "deleted by the repartition topic's retention before they were counted "
            f"(scale.repartition_retention_s); window range [{task.start}, {end}) "
            "cannot be released whole"
        )

    def _close(self, task: SliceTask, extra: list | None = None) -> bool:
        """Write task's window summary and its partition's next start in one transaction
        (False: not written, the window is dropped and replayed); ``extra`` messages
        (topic, key, value) go in the same transaction."""

        w, p = task.window, task.partition
        if not self._still_owned(task):
            return False
        end = task.position
        key = f"{self.topics.repartition}:{p}"
        if task.unchecked_from is not None:  # a jump of this window not looked at yet
            since, task.unchecked_from = task.unchecked_from, None
            self._note_deleted(task, TopicPartition(self.topics.repartition, p), since)
        ranges = {key: [task.start, end]}
        refused = task.lost or self._deleted_reason(task, end) or self._refusal(w, ranges)
        if self.count:  # a count window's times are when this partition opened and closed it
            times = task.opened_unix, time.time()
        else:
            times = w * self.size, (w + 1) * self.size
        info = {
            "kind": self.window_kind,
            "size": self.size,
            "events": int(task.events),
            "started_unix": times[0],
            "ended_unix": times[1],
            "start_offset": task.start,
            "end_offset": end,
        }
        view = [] if self.rollups is not None else None
        if refused:
            extra = None  # a replay of charged positions: no export of it either
            summary = {
                "format": "panagg.summary",
                "version": 1,
                "window": w,
                "partition": p,
                "partitions": self.P,
                "refused": refused,
                "ranges": ranges,
                "member": self.member,
            }
            if refused == task.lost and task.deleted is None:
                # a lost snapshot was a view of the window's events: its positions are charged
                # (the leader's _withhold), never released, never counted again
                summary["charge"] = True
        else:
            summary = partition_summary(
                task.state,
                model=self.identity["model"],
                window=w,
                partition=p,
                partitions=self.P,
                window_info=info,
                view=view,
            )
            summary.update(ranges=ranges, member=self.member, uid=uuid.uuid4().hex)
        summary["sources"] = task.sources
        rolled, rolled_in = [], None
        if self.rollups is not None:  # the same view into the rollup sums (rollups.py)
            rolled, rolled_in = self.rollups.fold(
                p,
                w,
                view[0] if view else None,
                state=task.state,
                events=task.events,
                member=self.member,
                times=times,
            )
        head = self.ledger.head()
        # the ledger's head rides with the offsets: a start that finds the ledger topic deleted
        # or rolled back behind it refuses (the charges it held would be forgotten)
        meta = json.dumps(
            {"w": w + 1, "lh": f"{head['seq']}:{head['hash'][:16]}"}, separators=(",", ":")
        )
        txn = self.txn
        try:
            txn.begin()
            txn.send(
                self.topics.summaries,
                partition=0,
                key=f"{w}/{p}".encode(),
                value=json.dumps(summary, allow_nan=False).encode(),
            )
            for topic, key, value in extra or ():
                txn.send(topic, partition=0, key=key, value=value)
            for topic, part, key, value in rolled:
                txn.send(topic, partition=part, key=key, value=value)
            if task.snapshots:
                # the window's snapshot is done with: no noisy state left at rest for it
                txn.send(self.topics.snapshots, partition=p, key=str(p).encode(), value=None)
            tp = TopicPartition(self.topics.repartition, p)
            txn.send_offsets({tp: OffsetAndMetadata(end, meta, -1)}, self.membership.generation)
            txn.commit()
        except Exception as exc:
            self._abort(task, exc)
            return False
        if rolled_in is not None:
            rolled_in()
        self.summaries_written += 1
        self.metrics.summaries.inc()
        task.advance(w + 1)
        return True

    def _still_owned(self, task: SliceTask) -> bool:
        """Whether this member still holds the task's partition in the generation it synced;
        if not, the task is dropped (its next owner replays it) and a sync is due. kafka-python
        rejoins in its background thread, so a rebalance may have moved the partition since the
        last poll: a close then would be a second view of what the new owner replays."""
        ok = not self._needs_sync and self.membership.holds([task.partition])
        if not ok:
            self.tasks.pop(task.partition, None)
            self._needs_sync = True
        return ok

    def _refusal(self, window: int, ranges: dict) -> str | None:
        """Why the ledger refuses this partition's window (its positions were charged)."""
        return charged_before(self.ledger, self.identity, ranges, self.window_kind)

    def _abort(self, task: SliceTask, exc: Exception) -> None:
        """The group moved the partition (we are fenced) or the broker is gone: the summary is
        not written; drop the window, the partition's owner replays it from its offsets."""
        log.warning(
            "summary of window %d, partition %d not written (%s); the window is "
            "replayed from its start",
            task.window,
            task.partition,
            type(exc).__name__,
        )
        self.txn.failed(exc)
        self.tasks.pop(task.partition, None)
        self._needs_sync = True
