"""The open event-time windows of one repartition partition, closed by the leader's markers.

A repartition partition interleaves the records of every source partition, so it cannot tell
from its own records when a window is complete; the leader can (the low watermark,
:mod:`.watermark`), and says so with a *close marker* ``K`` written into every repartition
partition in one transaction. In partition p's log, the marker is where windows ``<= K`` end:

* a message before it counts in the window its intake header names (its records' event window,
  or for late records the first window their source partition had not passed);
* a message after it naming a window ``<= K`` is late here (its source partition was left out
  of the watermark as idle): it counts in ``K + 1`` (``window.late = next``) or is rejected
  with reason ``late`` (``dead_letter``), as one process treats a late record;
* at the marker, every window in ``(closed, K]`` is summarized (noise only where this slice
  holds none of its events), in one transaction with the partition's committed offset.

One live pan-private state per open window that holds events here (the intake's pause bounds
how many: :data:`~.watermark.MAX_AHEAD_WINDOWS`). The committed offset is the first record of
the oldest live window (or just past the marker), and its metadata says ``k``, the last
window closed before that offset, and ``c``, the last window summarized: a replay from it
(a crash, a handover) repeats every decision, counts again only windows after ``c`` (under
fresh noise) and passes over the records of windows already summarized.
"""

from __future__ import annotations

from .summary import add_source

__all__ = ["EventSlice", "LiveWindow"]


class LiveWindow:
    """One open window's state on one partition."""

    __slots__ = ("state", "events", "late", "first", "closed_at_first", "lost")

    def __init__(self, state, first: int, closed_at_first: int):
        self.state, self.first, self.closed_at_first = state, int(first), int(closed_at_first)
        self.events = 0
        self.late = 0
        #: why the window cannot be released whole (source records it may hold were deleted)
        self.lost: str | None = None


class EventSlice:
    """The live windows of one repartition partition (pure: no Kafka).

    ``closed``: the last window closed before the position reading resumes at; ``summarized``:
    the last window whose summary is committed; ``make_state()`` a fresh noisy state.
    """

    def __init__(
        self, *, closed: int | None, summarized: int | None, make_state, late_policy: str = "next"
    ):
        #: None until the leader's first marker says where the windows begin
        self.closed = None if closed is None else int(closed)
        self.summarized = None if summarized is None else int(summarized)
        self.make_state = make_state
        self.late_policy = late_policy
        self.live: dict[int, LiveWindow] = {}
        #: window -> the source positions its messages came from (the budget registry's
        #: charge), of every message naming it, empty or not: what a summary names must not
        #: depend on which slices the items fell in
        self.sources: dict[int, dict[str, list[int]]] = {}

    def window_of(self, window: int, late: bool) -> tuple[int, bool]:
        """Where a message naming ``window`` (``late``: the intake found it late) counts now."""
        if window <= self.closed:
            return self.closed + 1, True
        return int(window), bool(late)

    def add(
        self, offset: int, window: int, late: bool, indices, source: bytes | None = None
    ) -> tuple[int, int]:
        """Count the message at ``offset``. Returns ``(counted, rejected_late)``: the events
        counted now (0 for windows already summarized: a replay passes over them) and the late
        events rejected (``dead_letter``)."""
        n = len(indices)
        window, late = self.window_of(window, late)
        if window > self.summarized:
            add_source(self.sources.setdefault(window, {}), source)
        if late and self.late_policy == "dead_letter":
            return 0, (n if window > self.summarized else 0)
        if window <= self.summarized or not n:
            return 0, 0
        live = self.live.get(window)
        if live is None:
            live = self.live[window] = LiveWindow(self.make_state(), offset, self.closed)
        live.state.add_indices(indices)
        live.events += n
        if late:
            live.late += n
        return n, 0

    def lose(self, offset: int, first: int, through: int, reason: str) -> None:
        """The message at ``offset`` says source records that may belong to any window from
        ``first`` to ``through`` were deleted before they were read: each of those not closed
        here is refused (a live window from the message on, so a replay from the commit reads
        the message again until the last of them is summarized)."""
        lo = max(int(first), self.closed + 1, self.summarized + 1)
        for w in range(lo, int(through) + 1):
            live = self.live.get(w)
            if live is None:
                live = self.live[w] = LiveWindow(self.make_state(), offset, self.closed)
            live.lost = "; ".join(filter(None, (live.lost, reason)))

    def to_close(self, upto: int) -> list[tuple[int, LiveWindow | None]]:
        """The windows a marker closing ``upto`` summarizes now: those after both ``closed`` and
        ``summarized`` (a replay passes over the rest), each with its live state or None."""
        lo = max(self.closed, self.summarized) + 1
        return [(w, self.live.get(w)) for w in range(lo, int(upto) + 1)]

    def closed_at(self, upto: int) -> None:
        """The marker's windows are summarized (their transaction committed)."""
        upto = int(upto)
        for w in [w for w in self.live if w <= upto]:
            del self.live[w]
        for w in [w for w in self.sources if w <= upto]:
            del self.sources[w]
        self.summarized = max(self.summarized, upto)
        self.closed = max(self.closed, upto)

    def opened(self) -> bool:
        """Whether the windows' beginning is known (before, nothing is counted)."""
        return self.closed is not None

    def open_at(self, upto: int) -> None:
        """The first marker: windows up to ``upto`` are before the group's first one."""
        self.closed = self.summarized = int(upto)

    def marker(self, upto: int) -> bool:
        """A marker closing windows up to ``upto``: True if some must be summarized now
        (:meth:`to_close`, then :meth:`closed_at` once committed); False for a replay's marker
        of windows summarized before, of which only where windows end is kept."""
        if int(upto) > self.summarized:
            return True
        self.closed = max(self.closed, int(upto))
        return False

    def resume_point(self, upto: int, after_marker: int) -> tuple[int, int]:
        """``(offset, closed there)`` a replay must start from once the windows up to ``upto``
        are summarized: the first record of the oldest later live window, with where windows had
        ended at it; else ``after_marker`` (just past the marker), where ``upto`` had."""
        later = [lw for w, lw in self.live.items() if w > upto]
        if not later:
            return int(after_marker), int(upto)
        oldest = min(later, key=lambda lw: lw.first)
        return oldest.first, oldest.closed_at_first
