"""Event-time windows (``window.kind = event_time``): which window a Kafka record is counted in,
decided by its timestamp, with an optional allowed lateness.

Windows are epoch-aligned and tumbling: window ``k`` is ``[k*S, (k+1)*S)`` for ``window.size`` S
seconds. Write ``e_k = (k+1)*S`` for its end and L for ``window.allowed_lateness_s`` (0 <= L < S).

Definitions (what the code computes; tests/test_event_time*.py check them against a reference):

* A partition *passes* the open window ``a`` at its first record stamped at or after
  ``e_a + L``; that record is the window's **close position** on the partition. The partition is
  paused there (the record is read again once the window has closed), so the records a
  partition holds before its close position all carry timestamps ``< e_a + L``.
* The window closes when every assigned partition has passed it (the watermark, the least of the
  partitions' latest timestamps, has passed ``e_a + L``), or when the partitions that have not
  are idle for ``window.idle_partition_timeout_s`` (their close position is then where they
  are). A release closes it too (``panagg release``, the end of a finite input).
* A record before its partition's close position belongs to the window its timestamp says:
  ``a`` (counted in the open window), ``a + 1`` (stamped in ``[e_a, e_a + L)``: counted in the
  *second* live window, which exists only while L > 0), or an earlier one: *late*, counted in
  the open window (``window.late = next``) or a dead letter with reason ``late``.
* After a close the next window is ``a + 1`` if the second window counted anything (it stays
  live, with the same noisy state), else the earliest window a paused record falls in (windows no
  record falls in are skipped). With L = 0 the second window never counts anything, and this is
  the one-open-window behaviour exactly.

Every decision depends on each partition's own records and the recorded close positions, never on
how reads of the partitions interleave, so a replay after a crash reproduces every window.

The one decision the records alone do not fix is ``future_timestamp`` (stamped later than the
wall clock plus ``window.max_future_skew_s``): a replay runs later, and the clock would let it
count a record whose dead letter the first run already sent. So a future rejection is written
to ``checkpoint.dir/future_rejects`` (position only, synced) before its dead letter goes out,
and a replay rejects the records listed there again whatever the clock says
(:class:`FutureRejects`).

What a checkpoint records (:meth:`EventTimeWindows.open_window`). The checkpoint
written when window ``a`` closes starts window ``a + 1``. If that window already counted records
(read before ``a``'s close positions), the checkpoint holds no counters for them (as always: the
open window's events are replayed from the source under fresh noise) but two positions per
partition: ``offsets``, where the replay starts (the partition's first record of ``a + 1``, or its
close position of ``a`` when it has none there), and ``window.skip_until``, the close position of
``a``. Between the two the replay counts only the records stamped in ``a + 1``: the others were
released in ``a`` (or were late or rejects there, already in the totals and dead letters). The
checkpoint's totals leave out the events the replay will count again.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np

from consumers.base import Segment, offsets_array, take_items
from state_store.atomic import atomic_write

from .window import WindowTask, totals_from

__all__ = ["EventTimeWindows", "SecondWindow", "FutureRejects"]

log = logging.getLogger("panagg.service")


class FutureRejects:
    """The positions of the records rejected as ``future_timestamp``, durable before their dead
    letters are sent, so that a replay (later, with a later clock) rejects them again.

    One line ``<partition> <offset>`` per record in ``path``; :meth:`add` appends and syncs. The
    file holds positions only (no content, no timestamp): what the dead letters' keys say.
    :meth:`prune` drops the positions a restore can no longer replay (before the durable
    checkpoint's offsets), rewriting the file atomically.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.positions: dict[str, set[int]] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                part, _, off = line.rpartition(" ")
                if part and off.isdigit():
                    self.positions.setdefault(part, set()).add(int(off))

    def __contains__(self, position) -> bool:
        part, off = position
        return int(off) in self.positions.get(part, ())

    def mask(self, partition: str, offsets) -> np.ndarray:
        """Which of ``offsets`` (of ``partition``) are listed."""
        known = self.positions.get(partition)
        if not known:
            return np.zeros(len(offsets), dtype=bool)
        return np.fromiter((int(o) in known for o in offsets), dtype=bool, count=len(offsets))

    def add(self, partition: str, offset: int) -> None:
        if (partition, offset) in self:
            return
        with open(self.path, "a") as f:
            f.write(f"{partition} {int(offset)}\n")
            f.flush()
            os.fsync(f.fileno())
        self.positions.setdefault(partition, set()).add(int(offset))

    def prune(self, offsets: dict[str, int]) -> None:
        """Forget the positions before ``offsets`` (a durable checkpoint's: never replayed)."""
        kept = {
            p: {o for o in offs if o >= offsets.get(p, 0)} for p, offs in self.positions.items()
        }
        kept = {p: offs for p, offs in kept.items() if offs}
        if kept == self.positions:
            return
        atomic_write(
            self.path,
            "".join(f"{p} {o}\n" for p in sorted(kept) for o in sorted(kept[p])),
            mode=None,
        )
        self.positions = kept


class SecondWindow:
    """The window after the open one while it already counts records: those stamped in it that
    arrive before the open window's close positions (``window.allowed_lateness_s`` > 0).

    ``state`` is its own pan-private state with its own fresh noise; ``first`` the offset of its
    first record per partition (where a replay of it starts)."""

    def __init__(self, index: int, state):
        self.index, self.state = index, state
        self.events = 0
        self.first: dict[str, int] = {}


class EventTimeWindows:
    """Which event-time window each record of the consume loop is counted in, and when the open
    window closes (the module docstring's definitions), as a component of the loop.

    ``host`` is the :class:`aggregator.service.process.Aggregator` it serves. It counts with the
    host's intake stage (:class:`.stages.intake.Intake`) and nothing else: ``decode`` /
    ``parse`` (records to items), ``count`` (items into a state), ``account`` / ``reject`` /
    ``hold`` / ``closed_or_held`` / ``release_held`` (source positions, rejects and paused
    partitions) and ``window_gauges``; it opens windows through the host's window assigner
    (``assigner.new_window``) and closes them through ``_new_state`` / ``close_window`` /
    ``_ledger_append``; it reads the host's ``cfg``, ``task``, ``source``, ``metrics``, ``dir``
    and ``model``. The host calls :meth:`ingest` for each segment, :meth:`turn` once a loop
    turn, :meth:`open_window` for each window it opens and :meth:`carried_state`,
    :meth:`second_window_fields` and :meth:`skip_decided_window` on its close and restore path.
    """

    def __init__(self, host) -> None:
        self.host = host
        self._next_event_index: int | None = None  # the window a close opens
        self._ahead: dict[str, int] = {}  # partition -> window its held record is in
        self._idle_since: float | None = None
        #: the window after the open one while it counts already (allowed lateness), else None
        self.second: SecondWindow | None = None
        self._carried = None  # the second window's state, taken over by the window a close opens
        #: a restore replayed the open window: the second window's records read before the stop
        #: are counted again too, in the window the next close opens (:meth:`restored`)
        self._second_replayed = False
        #: positions rejected as future_timestamp, rejected again on a replay (event_time only)
        self.future = (
            FutureRejects(host.dir / "future_rejects")
            if host.cfg.window.kind == "event_time"
            else None
        )

    # -- window bounds -------------------------------------------------------------------------
    def open_window(self, task: WindowTask, w: dict) -> None:
        """Event-time fields of the window ``w`` that is about to start (set before the
        checkpoint that starts it, so a replay from that checkpoint assigns every record as the
        first run did): its bounds, which earlier records are late, and, if the second window
        already counted records, what the checkpoint must replay of them."""
        prev = task.window or {}
        closed = prev.get("event_index")
        if self.future is not None and task.durable is not None:
            # a crash from here on restores at least the last durable checkpoint
            self.future.prune(self.replay_starts(task.durable))
        # records of windows before this one are late
        w["late_before"] = closed + 1 if closed is not None else prev.get("late_before")
        w["late"] = 0
        index, second = self._next_event_index, self.second
        self._next_event_index, self.second, self._carried = None, None, None
        task.replay = None
        at = dict(task.offsets)  # the closing window's close positions
        # a close before a replay got through the records released two windows ago (a release
        # request): the rest of them are skipped in the next window too (none is stamped in it)
        skip = {p: u for p, u in (prev.get("skip_until") or {}).items() if at.get(p, -1) < u}
        if second is not None and second.events and closed is not None:
            # the second window stays live: it is the next one (no paused record is earlier)
            index, self._carried = second.index, second.state
            w["events"] = second.events
            start = {p: min(off, at[p]) for p, off in second.first.items()}
            skip.update({p: at[p] for p in start if start[p] < at[p]})
            task.replay = {"offsets": dict(at, **start), "events": second.events}
        if skip:
            w["skip_until"] = dict(sorted(skip.items()))
        self.set_event_index(w, index)
        # waiting partitions wait for this window's end now (a release request may close a
        # window before they all passed it): they read their waiting records again
        self._ahead.clear()
        self.host.intake.release_held()
        if self._second_replayed:
            self._second_replayed = False
            self._charge_second_replay(task, w)

    def restored(self) -> None:
        """A restore replays the open window from its checkpoint (its restart entry is
        ledgered). With allowed lateness the second window may have counted records before the
        stop; the replay counts them again under fresh noise, into the window the next close
        opens, so that window is named in a restart entry of its own (:meth:`open_window`)."""
        self._second_replayed = True

    def _charge_second_replay(self, task: WindowTask, w: dict) -> None:
        """Under ``state.privacy_unit = user`` a window's restarts are charged to every user by
        its uid (:meth:`.user_budget.UserBudget.charge_of`), so the second window's replay needs
        an entry naming it; the event unit charges by source position, which the restored
        window's entry covers already. When the second window had counted nothing before the
        stop the entry charges a replay that did not happen: one eps, on the safe side."""
        cfg = self.host.cfg
        if cfg.state.privacy_unit != "user" or float(cfg.window.allowed_lateness_s) <= 0:
            return
        self.host._ledger_append(
            entry_id=f"restart-{os.urandom(6).hex()}",
            kind="restart",
            window=w["id"],
            window_uid=w["uid"],
            model=self.host.model,
            replay_from=dict(task.offsets),
            unit=task.name,
            note="the second live window at the stop: its records read before "
            "it counted again under fresh noise after the restore",
        )

    def second_window_fields(self) -> dict:
        """What a closing event-time window's ledger entry records of the second window (so a
        restart can open the next window as the close did, without replaying this one)."""
        second = self.second
        if second is None or not second.events:
            return {"second": None}
        return {
            "second": {
                "index": int(second.index),
                "events": int(second.events),
                "first": dict(second.first),
            }
        }

    def skip_decided_window(self, task: WindowTask, entry: dict) -> bool:
        """The restored event-time window is in the ledger already (a stop between its ledger
        entry and the checkpoint that opens the next window): open the next window as the close
        did instead of replaying this one. The replay reads from the decided window's start,
        counts only the records stamped in the next window up to the ledgered close positions
        (``skip_until``) and passes over the decided window's records without counting them: no
        memory holds them again beside their published release. False for entries from before
        the ``second`` field (they are replayed as before)."""
        if "second" not in entry:
            return False
        closed, second = dict(task.window), entry["second"]
        ends = {p: int(o) for p, o in entry["end_offsets"].items()}
        w = self.host.assigner.new_window(task, closed["id"] + 1)
        index = closed.get("event_index")
        w["late_before"] = index + 1 if index is not None else closed.get("late_before")
        w["late"] = 0
        skip = {
            p: int(u)
            for p, u in (closed.get("skip_until") or {}).items()
            if ends.get(p, -1) < int(u)
        }
        skip.update({p: e for p, e in ends.items() if int(task.offsets.get(p, -1)) < e})
        if skip:
            w["skip_until"] = dict(sorted(skip.items()))
        first = (second or {}).get("first") or {}
        w.update(
            lineage=closed.get("lineage"),
            start_offsets=dict(
                ends, **{p: min(int(o), ends.get(p, int(o))) for p, o in first.items()}
            ),
        )
        self.set_event_index(w, second["index"] if second else None)
        totals = totals_from(entry["totals"])
        totals["events"] -= int((second or {}).get("events", 0))  # the replay counts them again
        task.window, task.totals = w, totals
        task.mark_start()
        task.state = self.host._new_state(task, w["id"])
        task.close_at, task.replay = None, None
        self._ahead.clear()
        if second:
            self.host._ledger_append(
                entry_id=f"restart-{os.urandom(6).hex()}",
                kind="restart",
                window=w["id"],
                window_uid=w["uid"],
                model=self.host.model,
                replay_from=dict(task.offsets),
                unit=task.name,
                note="the second window's events (read before the stop) "
                "counted again under fresh noise; 2 eps for them against "
                "an intruder who read memory before the restart",
            )
        return True

    @staticmethod
    def replay_starts(ckpt) -> dict[str, int]:
        """Where a restore from ``ckpt`` starts reading each partition."""
        return {p: int(o) for p, o in (ckpt.offsets or {}).items()}

    def carried_state(self):
        """The state of the window just opened if it was the live second window, else None."""
        state, self._carried = self._carried, None
        return state

    def set_event_index(self, w: dict, index: int | None) -> None:
        size = int(self.host.cfg.window.size)
        w["event_index"] = None if index is None else int(index)
        w["event_start_unix"] = None if index is None else int(index) * size
        w["event_end_unix"] = None if index is None else (int(index) + 1) * size

    # -- counting ------------------------------------------------------------------------------
    def ingest(self, seg: Segment) -> None:
        """Count ``seg``: first its records a restored window replays among records already
        released in the window before it (``window.skip_until``), then the rest."""
        until = (self.host.task.window.get("skip_until") or {}).get(seg.partition)
        if until is not None and seg.offsets[0] < until:
            cut = int(np.searchsorted(offsets_array(seg.offsets), until))
            self._replay_among_released(self.host.task, _slice(seg, 0, cut))
            seg = _slice(seg, cut, len(seg))
            if not len(seg):
                return
        items, good, rejected = self.host.intake.decode(seg)
        self.count(self.host.task, seg, items, good, rejected, self.host.close_window)

    def _replay_among_released(self, task: WindowTask, seg: Segment) -> None:
        """Records before the previous window's close position on their partition: count those
        stamped in the open window (it was the second window when they were first read) and
        pass over the rest silently (released, late or rejected before: their totals and dead
        letters are in the checkpoint already)."""
        decoded = self.host.intake.parse(seg)
        bad = {i for i, _ in decoded.rejected}
        good_idx = np.asarray([i for i in range(len(seg)) if i not in bad], dtype=np.int64)
        if len(good_idx) and task.window["event_index"] is not None:
            wcfg = self.host.cfg.window
            ts = _timestamps(seg, len(seg))[good_idx]
            limit_ms = int((time.time() + float(wcfg.max_future_skew_s)) * 1000)
            was_future = self.future.mask(seg.partition, offsets_array(seg.offsets)[good_idx])
            mine = (
                (ts >= 0)
                & (ts <= limit_ms)
                & ~was_future
                & (ts // (int(wcfg.size) * 1000) == task.window["event_index"])
            )
            self._count_events(task, take_items(decoded.items, np.flatnonzero(mine)))
        task.offsets[seg.partition] = int(seg.offsets[-1]) + 1

    def _count_events(self, task: WindowTask, items) -> None:
        """Count ``items`` into ``task``'s open window."""
        if not len(items):
            return
        self.host.intake.count(task.state, items)
        task.window["events"] += len(items)
        task.totals["events"] += len(items)
        self.host.metrics.events.inc(len(items))
        self.host.intake.window_gauges(task)

    def _count_second(self, task: WindowTask, partition: str, first_offset: int, items) -> None:
        """Count ``items`` (the first at ``first_offset``) into the second window."""
        if self.second is None:
            wid = task.window["id"] + 1
            self.second = SecondWindow(
                task.window["event_index"] + 1, self.host._new_state(task, wid)
            )
        second = self.second
        self.host.intake.count(second.state, items)
        second.events += len(items)
        second.first.setdefault(partition, int(first_offset))
        task.totals["events"] += len(items)
        self.host.metrics.events.inc(len(items))

    def count(self, task: WindowTask, seg: Segment, items, good, rejected, close) -> None:
        """Count ``seg`` by its records' timestamps (the module docstring's definitions).

        A record of the open window, or late, goes to the open window (late ones: or a dead
        letter); one stamped in the next window before the open window's end plus the allowed
        lateness goes to the second window; the partition's first record at or after that point
        pauses it (the close position). A record without a timestamp (``no_timestamp``) or later
        than now + ``window.max_future_skew_s`` (``future_timestamp``) is rejected."""
        offsets = offsets_array(seg.offsets)
        m = len(offsets)
        good_idx = np.arange(len(items)) if good is None else np.asarray(good, dtype=np.int64)
        wcfg = self.host.cfg.window
        size_ms = int(wcfg.size) * 1000
        lateness_ms = int(round(float(wcfg.allowed_lateness_s) * 1000))
        ts = _timestamps(seg, m)[good_idx] if len(good_idx) else np.zeros(0, np.int64)
        limit_ms = int((time.time() + float(wcfg.max_future_skew_s)) * 1000)
        reasons = {int(i): r for i, r in rejected}  # record index -> reason
        # future: by the clock now, or by the decision of an earlier read of the record (a
        # replay's later clock must not count what the first read dead-lettered)
        future = (ts >= 0) & ((ts > limit_ms) | self.future.mask(seg.partition, offsets[good_idx]))
        bad = (ts < 0) | future
        if bad.any():
            for i in np.flatnonzero(bad):
                if future[i]:  # durable before the dead letter
                    self.future.add(seg.partition, int(offsets[good_idx[i]]))
                self.host.intake.reject(
                    seg,
                    int(good_idx[i]),
                    "no_timestamp" if ts[i] < 0 else "future_timestamp",
                    reasons,
                )
            keep = np.flatnonzero(~bad)
            items, good_idx, ts = take_items(items, keep), good_idx[keep], ts[keep]
        widx = ts // size_ms
        dead_letter_late = wcfg.late == "dead_letter"
        j = rec = 0
        while True:
            target = task.close_at.get(seg.partition) if task.close_at else None
            rec_limit = m if target is None else int(np.searchsorted(offsets, target))
            jl = int(np.searchsorted(good_idx, rec_limit))
            w = task.window
            open_ = w.get("event_index")
            # the close position: past the open window's end plus the allowed lateness (before
            # a window opens, every record not late is "ahead" of nothing yet)
            ahead = np.flatnonzero(
                ts[j:jl] >= (open_ + 1) * size_ms + lateness_ms
                if open_ is not None
                else widx[j:jl] >= (w.get("late_before") or 0)
            )
            ahead_at = j + int(ahead[0]) if ahead.size else jl
            late_before = open_ if open_ is not None else w.get("late_before")
            chunk = widx[j:ahead_at]
            late = chunk < late_before if late_before is not None else np.zeros(len(chunk), bool)
            n_late = int(late.sum())
            later = chunk > open_ if open_ is not None else np.zeros(len(chunk), bool)
            if dead_letter_late and n_late:
                for i in np.flatnonzero(late):
                    self.host.intake.reject(seg, int(good_idx[j + i]), "late", reasons)
            if later.any():
                at = j + np.flatnonzero(later)
                self._count_second(
                    task, seg.partition, int(offsets[good_idx[at[0]]]), take_items(items, at)
                )
            mine = ~later & ~late if dead_letter_late else ~later
            self._count_events(
                task,
                items[j:ahead_at] if mine.all() else take_items(items, j + np.flatnonzero(mine)),
            )
            w["late"] = w.get("late", 0) + n_late
            j = ahead_at
            upto = int(good_idx[j]) if ahead_at < jl else rec_limit
            rej_idx = np.asarray(sorted(reasons), dtype=np.int64)
            self.host.intake.account(
                task, seg.partition, offsets, rej_idx, [reasons[int(i)] for i in rej_idx], rec, upto
            )
            rec = max(rec, upto)
            if ahead_at < jl:  # this partition has passed the open window: it waits here
                self._ahead[seg.partition] = int(widx[j])
                self.host.intake.hold(seg.partition, int(offsets[rec]))
                self.advance(task, close)
                return
            if self.host.intake.closed_or_held(task, seg.partition, offsets, rec, close):
                continue  # (a close clears the waits: _open_event_time_window)
            return

    # -- closing -------------------------------------------------------------------------------
    def advance(self, task: WindowTask, close, idle=()) -> None:
        """Close the open event-time window (or open the first one) once every assigned
        partition has passed it, except ``idle`` ones. The next window is the second window if
        it counted anything, else the earliest one a waiting record falls in
        (:meth:`_open_event_time_window`)."""
        assigned = getattr(self.host.source, "assigned", None)
        parts = set(assigned) if assigned else set(self._ahead)
        if not self._ahead or not parts - set(idle) <= set(self._ahead):
            return
        nxt = min(self._ahead.values())
        self._ahead.clear()
        self._idle_since = None
        if task.window.get("event_index") is None:
            self.set_event_index(task.window, nxt)  # the first window (in memory: replayable)
        else:
            self._next_event_index = nxt
            close()
        self.host.intake.release_held()

    def turn(self, task: WindowTask) -> None:
        """``window.idle_partition_timeout``: partitions read to their end while the others wait
        at a later window stop holding the watermark after that many seconds (logged)."""
        timeout = float(self.host.cfg.window.idle_partition_timeout_s)
        assigned = getattr(self.host.source, "assigned", None)
        if not timeout or not self._ahead or task.close_at is not None:
            self._idle_since = None
            return
        parts = set(assigned) if assigned else set(self._ahead)
        idle = sorted(parts - set(self._ahead))
        probe = getattr(self.host.source, "caught_up", None)
        if not idle or (probe is not None and not probe(idle)):
            self._idle_since = None
            return
        now = time.monotonic()
        self._idle_since = self._idle_since or now
        if now - self._idle_since >= timeout:
            log.info(
                "event-time window %s: partition(s) %s idle for %.0f s "
                "(window.idle_partition_timeout_s) no longer hold the watermark; the "
                "window closes at the other partitions' positions",
                task.window["id"],
                ", ".join(idle),
                now - self._idle_since,
            )
            self.advance(task, self.host.close_window, idle=idle)


def _timestamps(seg: Segment, m: int) -> np.ndarray:
    """The segment's record timestamps in ms as int64 (-1: none)."""
    col = seg.timestamps
    if col is None:
        return np.full(m, -1, dtype=np.int64)
    try:
        return np.fromiter(col, dtype=np.int64, count=m)
    except TypeError:  # a None among them
        return np.asarray([-1 if t is None else t for t in col], dtype=np.int64)


def _slice(seg: Segment, lo: int, hi: int) -> Segment:
    """Records ``[lo, hi)`` of ``seg``."""

    def part(col):
        return None if col is None else col[lo:hi]

    return Segment(
        seg.partition,
        seg.offsets[lo:hi],
        seg.values[lo:hi],
        part(seg.keys),
        part(seg.headers),
        part(seg.timestamps),
    )
