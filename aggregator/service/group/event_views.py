"""Event-time windows of a views group: each member windows its own partitions by their records'
timestamps, and closes a window once the group's low watermark has passed it.

The rules are one process's (aggregator/service/event_time.py), in the per-partition form the
items exchange decides them in (:func:`.watermark.stamp`): window ``k`` is ``[k*S, (k+1)*S)``, L
is ``window.allowed_lateness_s``, and a source partition *passes* window k at its first record
stamped at or after ``(k+1)*S + L``.

* **A record's window** is the one its timestamp names, unless its partition passed that window
  before it (then it is *late*: counted in the first window its partition has not passed, or a
  dead letter with ``window.late = dead_letter``), or unless that window is already closed on
  its partition (its partition was left out of the watermark as idle): late too, counted in the
  window after the last one closed. Every decision depends on the partition's own records and
  on where its windows closed, which the committed offsets record: a replay decides alike.
* **Closing.** Each member reports its partitions' ``passed`` (largest good timestamp) and,
  once a partition is read to its end, since when, to the intake topic (the items exchange's
  :class:`.watermark.MarkRecord`, the numbers any release states at a coarser grain). Every
  member reads every report; the group's low watermark is :func:`.watermark.low_watermark`
  over all source partitions (those idle for ``window.idle_partition_timeout_s`` left out), so
  no member closes a window before every partition has passed it or is idle, and an idle
  partition does not hold the group for ever. A partition more than
  :data:`.watermark.MAX_AHEAD_WINDOWS` windows past the low watermark is paused until it follows
  (the items exchange's bound on the open windows, each a state of D counters). A member closes each of its open windows up to
  :func:`.watermark.closable_upto` in order, one view each (views.py); when the watermark moved
  on but it holds no events of those windows, it writes one empty view of the latest one.
* **What a view says of skipped windows.** A view names, per partition it covers, the last window
  closed on that partition before it (``after``): the windows between were empty there. The
  leader fills those in as empty parts of a window (:func:`skipped_parts`), so it releases each
  window once every source partition has reported through it; a window no partition holds an
  event of is not released (one process skips it too).
* **Records deleted before they were counted** (the source topic's retention, a member down
  longer than it): a partition acquired from a commit below its first offset, or whose offsets
  jump past deleted records while counting, may have lost records of any window not yet closed
  on it up to :func:`lost_through`; each of those windows is withheld naming the deleted
  offsets (the leader ledgers it and publishes nothing of it), and the commits carry the span
  (``l``) until the last of them closes, so a replay withholds them too.
* **Offsets.** Several windows may be open on a partition. Closing window k commits, per
  partition, the first offset counted into a window still open (or the position when none is),
  with metadata ``k`` (last window closed), ``s`` (the position at the close: below it, records
  of windows up to k were in committed views, or dead letters sent) and ``pm`` (the partition's
  ``passed`` before the committed offset). A replay (a crash, a handover) starts there, passes
  over what ``s`` says was decided, and counts the rest again under fresh noise: each source
  position is in exactly one committed view. Dead letters go out with a close; while no window
  closes (the watermark stands still) they go out in a commit of their own, which says how far
  they were sent (``d``) and leaves ``s`` as it was: a record moved late into the open window
  is not decided by it.

>>> c = PartitionClock(start=0, passed_ms=None, closed=None, skip_until=None)
>>> d = c.assign(np.arange(4), np.array([1500, 2600, 1200, 3100]), size_ms=1000, lateness_ms=500)
>>> d.window.tolist(), d.late.tolist(), d.skip.tolist(), c.passed_ms
([1, 2, 2, 3], [False, False, True, False], [False, False, False, False], 3100)
>>> r = PartitionClock(start=0, passed_ms=None, closed=1, skip_until=2)  # a replay after 1 closed
>>> d = r.assign(np.arange(3), np.array([1500, 1600, 1700]), size_ms=1000, lateness_ms=500)
>>> d.window.tolist(), d.late.tolist(), d.skip.tolist()  # offset 2 was read after 1 closed
([1, 1, 2], [False, False, True], [True, True, False])
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from .deleted import lost_through
from .watermark import MarkRecord, closable_upto, low_watermark, stamp, too_far_ahead

__all__ = [
    "PartitionClock",
    "Decisions",
    "GroupMarks",
    "skipped_parts",
    "commit_meta",
    "lost_through",
    "window_info",
]


@dataclass
class Decisions:
    """What :meth:`PartitionClock.assign` decided of each good record: its ``window``, whether
    it is ``late``, whether a replay passes over it (``skip``: decided before the committed
    close), and the partition's ``passed`` before it (``before``, -1: none)."""

    window: np.ndarray
    late: np.ndarray
    skip: np.ndarray
    before: np.ndarray


class PartitionClock:
    """One owned source partition's event time: its ``passed``, the last window closed on it
    (``closed``), below which offset a replay passes over decided records (``skip_until``),
    the next offset to read (``position``) and since when it is read to its end."""

    def __init__(
        self, *, start: int, passed_ms: int | None, closed: int | None, skip_until: int | None
    ):
        self.position = int(start)
        self.passed_ms = None if passed_ms is None else int(passed_ms)
        self.closed = None if closed is None else int(closed)
        self.skip_until = None if skip_until is None else int(skip_until)
        #: below it, the dead letters of the records read were sent (at least ``skip_until``)
        self.dead_until = self.skip_until
        self.idle_since_ms: int | None = None
        #: (first, end, through): records [first, end) were deleted by retention before they
        #: were counted, and every window up to ``through`` may have held one (:func:`lost_through`)
        self.lost: tuple[int, int, int] | None = None

    @classmethod
    def from_commit(cls, offset: int, meta: dict) -> "PartitionClock":
        clock = cls(
            start=offset, passed_ms=meta.get("pm"), closed=meta.get("k"), skip_until=meta.get("s")
        )
        clock.dead_until = max(int(meta.get("d", 0)), clock.skip_until or 0) or None
        if meta.get("l"):
            first, end, through = (int(x) for x in meta["l"])
            clock.lost = (first, end, through)
        return clock

    def assign(
        self, offsets: np.ndarray, ts: np.ndarray, *, size_ms: int, lateness_ms: int
    ) -> Decisions:
        """The decisions for the good records at ``offsets`` stamped ``ts`` (in order); moves
        ``passed`` on."""
        offsets = np.asarray(offsets, dtype=np.int64)
        ts = np.asarray(ts, dtype=np.int64)
        prior = -1 if self.passed_ms is None else self.passed_ms
        before = (
            np.maximum.accumulate(np.concatenate(([prior], ts[:-1])))
            if len(ts)
            else np.zeros(0, np.int64)
        )
        window, late, passed = stamp(ts, self.passed_ms, size_ms=size_ms, lateness_ms=lateness_ms)
        self.passed_ms = passed
        skip = np.zeros(len(ts), dtype=bool)
        if self.closed is not None:
            done = window <= self.closed
            replay = offsets < self.skip_until if self.skip_until is not None else skip
            skip = done & replay
            # closed here while its partition was idle: late, in the window after the closed one
            moved = done & ~replay
            late = late | moved
            window = np.where(moved, self.closed + 1, window)
        return Decisions(window, late, skip, before)

    def watermark(self) -> MarkRecord:
        return MarkRecord(self.passed_ms, self.idle_since_ms)


def commit_meta(
    *,
    closed: int | None,
    position: int,
    offset: int,
    passed_ms: int | None,
    skip_until: int | None,
    ledger_head: str,
    closing: bool = True,
    dead_until: int | None = None,
    lost: tuple[int, int, int] | None = None,
) -> dict:
    """The offset metadata of a partition committed at ``offset``, read to ``position``, the
    last window closed on it ``closed`` (None: none yet). ``closing``: window ``closed`` closes
    in this commit, so every record read so far of a window up to it is decided (``s``); else
    the commit only sends the dead letters of the records read so far (``d``): records moved
    late into the window after ``closed`` are not decided by it."""
    meta: dict = {"lh": ledger_head}
    if closed is not None:
        meta["k"] = int(closed)
    if passed_ms is not None and passed_ms >= 0:
        meta["pm"] = int(passed_ms)
    decided = max(int(position), int(skip_until or 0)) if closing else int(skip_until or 0)
    if offset < decided:
        meta["s"] = decided
    sent = max(int(position), int(dead_until or 0))
    if sent > max(offset, decided):
        meta["d"] = sent
    if lost is not None and (closed is None or closed < lost[2]):
        meta["l"] = [int(x) for x in lost]  # a replay withholds the windows still to close
    return meta


class GroupMarks:
    """Every source partition's latest watermark report (the intake topic), with this member's
    own partitions' live values in their place; the group's closable window."""

    def __init__(self, route_topic: str, source_topic: str, partitions: int, clock):
        self.prefix = f"wm:{route_topic}:".encode()
        self.route_topic, self.source_topic = route_topic, source_topic
        self.sources = [f"{source_topic}:{p}" for p in range(int(partitions))]
        self.clock = clock
        self.reported: dict[str, MarkRecord] = {}

    def key(self, partition: int) -> bytes:
        return MarkRecord.key(self.route_topic, f"{self.source_topic}:{int(partition)}").encode()

    def take(self, key: bytes | None, value: bytes | None) -> bool:
        """Note a record of the intake topic; True if it was a watermark report."""
        if not key or not key.startswith(self.prefix):
            return False
        if value is not None:
            self.reported[key[len(self.prefix) :].decode()] = MarkRecord.decode(value)
        return True

    def low(self, own: dict[int, MarkRecord], now_ms: int) -> int | None:
        """The group's low watermark (ms; None while a partition that counts has none)."""
        marks = dict(self.reported)
        marks.update({f"{self.source_topic}:{p}": m for p, m in own.items()})
        return low_watermark(
            marks, self.sources, now_ms=now_ms, idle_timeout_ms=self.clock.idle_timeout_ms
        )

    def closable(self, own: dict[int, MarkRecord], now_ms: int) -> int | None:
        """The last window every source partition has passed (idle ones left out)."""
        return closable_upto(
            self.low(own, now_ms), size_ms=self.clock.size_ms, lateness_ms=self.clock.lateness_ms
        )

    def ahead(self, own: dict[int, MarkRecord], now_ms: int) -> set[int]:
        """This member's partitions more than MAX_AHEAD_WINDOWS windows past the group's low
        watermark: paused until it follows (each open window holds a state of D counters)."""
        low = self.low(own, now_ms)
        return {
            p for p, m in own.items() if too_far_ahead(m.passed_ms, low, size_ms=self.clock.size_ms)
        }


def skipped_parts(
    w: int, pending: dict[int, dict[int, dict]], partitions: int, empty
) -> dict[int, dict]:
    """Window ``w``'s parts from ``pending`` (window -> partition -> view), with an empty part
    (``empty(w, p)``) for each partition whose next view is of a later window and says the
    windows up to it were empty there (its ``after`` is before ``w``).

    >>> pend = {3: {0: {"after": {"0": None}}}, 5: {1: {"after": {"1": 2}}}}
    >>> sorted(skipped_parts(3, pend, 2, lambda w, p: {"empty": p}).items())
    [(0, {'after': {'0': None}}), (1, {'empty': 1})]
    >>> sorted(skipped_parts(3, {3: pend[3], 5: {1: {"after": {"1": 3}}}}, 2, None))
    [0]
    """
    have = dict(pending.get(w, {}))
    for p in range(int(partitions)):
        if p in have:
            continue
        later = [k for k in pending if k > w and p in pending[k]]
        if not later:
            continue
        after = (pending[min(later)][p].get("after") or {}).get(str(p))
        if after is None or int(after) < w:
            have[p] = empty(w, p)
    return have


def window_info(w: int, identity: dict, *, events: int = 0, late: int = 0) -> dict:
    """The ``window_info`` of a member's part of event-time window ``w``."""
    size = float(identity["window_size"])
    return {
        "kind": "event_time",
        "size": size,
        "events": int(events),
        "started_unix": w * size,
        "ended_unix": (w + 1) * size,
        "event_start_unix": w * size,
        "event_end_unix": (w + 1) * size,
        "late": int(late),
        "late_policy": identity.get("late", "next"),
        "allowed_lateness_s": float(identity.get("allowed_lateness_s", 0.0)),
    }


def encode_meta(meta: dict) -> str:
    return json.dumps(meta, separators=(",", ":"))
